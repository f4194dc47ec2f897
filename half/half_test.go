package half

import (
	"math"
	"testing"
)

func TestFloat16RoundTripAllBits(t *testing.T) {
	// Every binary16 value converts to float32 and back to itself.
	for i := 0; i < 1<<16; i++ {
		h := Float16(i)
		f := h.Float32()
		back := Float16FromFloat32(f)
		if f != f { // NaN: must stay NaN
			if back&0x7c00 != 0x7c00 || back&0x3ff == 0 {
				t.Fatalf("NaN %#04x came back as %#04x", i, back)
			}
			continue
		}
		if back != h {
			t.Fatalf("%#04x -> %v -> %#04x", i, f, back)
		}
	}
}

func TestBFloat16RoundTripAllBits(t *testing.T) {
	for i := 0; i < 1<<16; i++ {
		h := BFloat16(i)
		f := h.Float32()
		back := BFloat16FromFloat32(f)
		if f != f {
			if !math.IsNaN(float64(back.Float32())) {
				t.Fatalf("NaN %#04x came back as %#04x", i, back)
			}
			continue
		}
		if back != h {
			t.Fatalf("%#04x -> %v -> %#04x", i, f, back)
		}
	}
}

func TestRoundingTiesToEven(t *testing.T) {
	tests := []struct {
		name string
		in   float32
		f16  float32
		bf16 float32
	}{
		{"one", 1, 1, 1},
		{"halfway-f16-down", 1 + 1.0/2048, 1, 1},                     // tie between 1 and 1+2^-10: even is 1
		{"halfway-f16-up", 1 + 3.0/2048, 1 + 2.0/1024, 1},            // tie between 1+2^-10 and 1+2^-9: even is up
		{"above-halfway", 1 + 1.0/2048 + 1.0/65536, 1 + 1.0/1024, 1}, // just above the tie
		{"bf16-tie-down", 1 + 1.0/256, 1 + 1.0/256, 1},               // tie between 1 and 1+2^-7
		{"bf16-tie-up", 1 + 3.0/256, 1 + 3.0/256, 1 + 4.0/256},       // tie: even is up
		{"f16-overflow", 70000, float32(math.Inf(1)), 70144},         // beyond 65504
		{"f16-max", 65504, 65504, 65536},                             // largest finite binary16
		{"f16-smallest-subnormal", 1.0 / (1 << 24), 1.0 / (1 << 24), 1.0 / (1 << 24)},
		{"f16-below-half-subnormal", 1.0 / (1 << 26), 0, 1.0 / (1 << 26)},
		{"negative", -2.5, -2.5, -2.5},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := RoundFloat16(tc.in); got != tc.f16 {
				t.Errorf("RoundFloat16(%v) = %v, want %v", tc.in, got, tc.f16)
			}
			if got := RoundBFloat16(tc.in); got != tc.bf16 {
				t.Errorf("RoundBFloat16(%v) = %v, want %v", tc.in, got, tc.bf16)
			}
		})
	}
}

func TestFloat16MatchesNearest(t *testing.T) {
	// For a sweep of float32 values, the result is the nearest binary16 (checked against
	// the two neighbours by distance in float64).
	for i := 0; i < 200000; i++ {
		f := math.Float32frombits(uint32(i)*21473 + 0x33000000)
		if math.Abs(float64(f)) > 65504 || f != f {
			continue
		}
		h := Float16FromFloat32(f)
		got := float64(h.Float32())
		up := float64((h + 1).Float32())
		var down float64
		if h&0x7fff != 0 {
			down = float64((h - 1).Float32())
		}
		d := math.Abs(got - float64(f))
		if math.Abs(up-float64(f)) < d || (h&0x7fff != 0 && math.Abs(down-float64(f)) < d) {
			t.Fatalf("%v rounded to %v, a neighbour is nearer", f, got)
		}
	}
}
