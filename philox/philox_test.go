package philox

import "testing"

// Known-answer vectors of Philox4x32-10 from the Random123 distribution.
func TestBlockKnownAnswers(t *testing.T) {
	tests := []struct {
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
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := Block(tc.c, tc.k); got != tc.want {
				t.Errorf("Block = %08x, want %08x", got, tc.want)
			}
		})
	}
}

func TestKeepRowMatchesKeep(t *testing.T) {
	m := NewMask(0x1234567890abcdef, 7, 0.3, 2, 5, 8)
	for _, j0 := range []int{0, 1, 3, 4, 5, 17} {
		keep := make([]bool, 23)
		m.KeepRow(11, j0, keep)
		for x := range keep {
			if keep[x] != m.Keep(11, j0+x) {
				t.Fatalf("j0=%d x=%d: KeepRow disagrees with Keep", j0, x)
			}
		}
	}
}

func TestKeptFraction(t *testing.T) {
	for _, p := range []float64{0.1, 0.5, 0.9} {
		m := NewMask(42, 0, p, 0, 0, 1)
		kept, total := 0, 0
		row := make([]bool, 1000)
		for i := 0; i < 200; i++ {
			m.KeepRow(i, 0, row)
			for _, k := range row {
				if k {
					kept++
				}
				total++
			}
		}
		frac := float64(kept) / float64(total)
		if d := frac - (1 - p); d > 0.01 || d < -0.01 {
			t.Errorf("p=%v: kept fraction %.4f, want %.4f ± 0.01", p, frac, 1-p)
		}
	}
}

func TestThreshold(t *testing.T) {
	tests := []struct {
		p    float64
		want uint32
	}{{0, 0xffffffff}, {0.5, 0x80000000}, {0.75, 0x40000000}, {1e-12, 0xffffffff}}
	for _, tc := range tests {
		if got := Threshold(tc.p); got != tc.want {
			t.Errorf("Threshold(%v) = %#x, want %#x", tc.p, got, tc.want)
		}
	}
}
