package philox

import (
	"errors"
	"math"
	"testing"
)

// Known-answer vectors of Philox4x32-10 from the Random123 distribution
// (kat_vectors: philox4x32 10 rounds).
var random123 = []struct {
	name string
	c    [4]uint32
	k    [2]uint32
	want [4]uint32
}{
	{"zeros", [4]uint32{}, [2]uint32{}, [4]uint32{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
	{"ones", [4]uint32{^uint32(0), ^uint32(0), ^uint32(0), ^uint32(0)}, [2]uint32{^uint32(0), ^uint32(0)},
		[4]uint32{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
	{"pi", [4]uint32{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, [2]uint32{0xa4093822, 0x299f31d0},
		[4]uint32{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
}

func TestBlockKnownAnswers(t *testing.T) {
	for _, tc := range random123 {
		t.Run(tc.name, func(t *testing.T) {
			if got := Block(tc.c, tc.k); got != tc.want {
				t.Errorf("Block = %08x, want %08x", got, tc.want)
			}
		})
	}
}

// TestMappingKnownAnswers places each Random123 vector in the mask
// (counter = (j >> 4, i, b·H + h, offset), key = the seed's words) and
// checks the sixteen 8-bit numbers of its key group, written out by hand
// from the vector's words (little-endian bytes), and the keep decisions
// at two thresholds.
func TestMappingKnownAnswers(t *testing.T) {
	tests := []struct {
		name      string
		seed      uint64
		offset    uint32
		b, h, hs  int // batch, head, heads: b·hs + h = counter word 2
		i, j0     int // query, first key of the group (16·counter word 0)
		wantBytes [16]uint32
	}{
		{"zeros", 0, 0, 0, 0, 1, 0, 0,
			[16]uint32{0xd5, 0xe8, 0x27, 0x66, 0x8d, 0xc5, 0x69, 0xe1, 0x4c, 0xac, 0x57, 0xbc, 0xd8, 0xdb, 0x00, 0x9b}},
		{"ones", math.MaxUint64, math.MaxUint32, 0, math.MaxUint32, 1 << 32, math.MaxUint32, math.MaxUint32 << 4,
			[16]uint32{0x6d, 0x27, 0x8f, 0x40, 0x0e, 0x3b, 0xc8, 0x41, 0xc6, 0xc7, 0x0b, 0xa2, 0xfd, 0x51, 0x54, 0x6d}},
		{"pi", 0x299f31d0a4093822, 0x03707344, 1, 0x13198a2e - 0x1000, 0x1000, 0x85a308d3, 0x243f6a88 << 4,
			[16]uint32{0x09, 0xfe, 0x6c, 0xd1, 0xeb, 0xcc, 0xfd, 0x94, 0x20, 0xe4, 0x01, 0x50, 0xa1, 0x6e, 0x12, 0x24}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, th := range []uint32{0x80, 0xd6} {
				m := NewMask(tc.seed, tc.offset, th, tc.b, tc.h, tc.hs)
				keep := make([]bool, 16)
				m.KeepRow(tc.i, tc.j0, keep)
				for x, want := range tc.wantBytes {
					if got := m.Byte(tc.i, tc.j0+x); got != want {
						t.Errorf("key %d: u = %#02x, want %#02x", x, got, want)
					}
					if keep[x] != (want < th) || m.Keep(tc.i, tc.j0+x) != (want < th) {
						t.Errorf("T = %#x key %d: KeepRow %v, Keep %v, want %v", th, x, keep[x], m.Keep(tc.i, tc.j0+x), want < th)
					}
				}
			}
		})
	}
}

func TestKeepRowMatchesKeep(t *testing.T) {
	th, err := Threshold(0.3)
	if err != nil {
		t.Fatal(err)
	}
	m := NewMask(0x1234567890abcdef, 7, th, 2, 5, 8)
	for _, j0 := range []int{0, 1, 3, 4, 5, 15, 16, 17, 31, 100} {
		for _, n := range []int{0, 1, 15, 16, 17, 23, 31, 32, 33, 50, 64, 100} {
			keep := make([]bool, n)
			m.KeepRow(11, j0, keep)
			for x := range keep {
				if keep[x] != m.Keep(11, j0+x) {
					t.Fatalf("j0=%d n=%d x=%d: KeepRow disagrees with Keep", j0, n, x)
				}
			}
		}
	}
}

// TestKeptFraction draws 2^21 elements (rows × keys, several heads) per p
// and requires the kept fraction within 5 standard deviations of T/256,
// the probability the mask resolves p to; and each of the 256 values of u
// to be drawn within 5 standard deviations of 1/256 of the time.
func TestKeptFraction(t *testing.T) {
	for _, p := range []float64{0.1, 0.17, 0.5, 0.9, 0.99} {
		th, err := Threshold(p)
		if err != nil {
			t.Fatalf("Threshold(%v): %v", p, err)
		}
		var hist [Levels]int
		kept, total := 0, 0
		row := make([]bool, 1024)
		for h := 0; h < 4; h++ {
			m := NewMask(42, 3, th, 1, h, 4)
			for i := 0; i < 512; i++ {
				m.KeepRow(i, 0, row)
				for j, k := range row {
					if k {
						kept++
					}
					if j%16 == 0 {
						w := m.Words(i, j)
						for x := 0; x < 16; x++ {
							hist[byteOf(w, x)]++
						}
					}
					total++
				}
			}
		}
		q := float64(th) / Levels
		sd := math.Sqrt(q * (1 - q) / float64(total))
		if frac := float64(kept) / float64(total); math.Abs(frac-q) > 5*sd {
			t.Errorf("p=%v (T=%d): kept fraction %.5f, want %.5f ± %.5f", p, th, frac, q, 5*sd)
		}
		e := float64(total) / Levels
		for u, c := range hist {
			if math.Abs(float64(c)-e) > 5*math.Sqrt(e) {
				t.Errorf("p=%v: u=%d drawn %d times, want %.0f ± %.0f", p, u, c, e, 5*math.Sqrt(e))
			}
		}
	}
}

func TestThreshold(t *testing.T) {
	tests := []struct {
		p    float64
		want uint32
	}{
		{0, 256}, {0.5, 128}, {0.75, 64}, {0.1, 230}, {0.17, 212}, {0.3, 179},
		{1.0 / 256, 255}, {1.0/512 + 1e-12, 255}, {1 - 1.0/512, 1}, {1 - 1.0/256, 1}, {255.0 / 256, 1},
		{1.5 / 256, 255}, // 256·(1 − p) = 254.5: a tie rounds up
	}
	for _, tc := range tests {
		got, err := Threshold(tc.p)
		if err != nil || got != tc.want {
			t.Errorf("Threshold(%v) = %d, %v; want %d", tc.p, got, err, tc.want)
		}
	}
}

func TestThresholdRefuses(t *testing.T) {
	for _, p := range []float64{1e-12, 1e-3, 1.0 / 512, 1 - 1.0/512 + 1e-9, 0.9999, -0.1, 1, 2, math.NaN(), math.Inf(1)} {
		got, err := Threshold(p)
		if !errors.Is(err, ErrResolution) {
			t.Errorf("Threshold(%v) = %d, %v; want an error wrapping ErrResolution", p, got, err)
		}
	}
}

func TestScale(t *testing.T) {
	tests := []struct {
		t    uint32
		want float64
	}{{256, 1}, {128, 2}, {230, 256.0 / 230}, {1, 256}, {0, 0}}
	for _, tc := range tests {
		if got := Scale(tc.t); got != tc.want {
			t.Errorf("Scale(%d) = %v, want %v", tc.t, got, tc.want)
		}
	}
	// the expectation of a kept-and-scaled probability is the probability
	for _, p := range []float64{0.1, 0.17, 0.3, 0.9} {
		th, _ := Threshold(p)
		if e := float64(th) / Levels * Scale(th); math.Abs(e-1) > 1e-15 {
			t.Errorf("p=%v: keep probability × scale = %v, want 1", p, e)
		}
	}
}
