package kernels

import (
	"testing"

	"github.com/flashattn/flashattn/attn"
)

func TestHeadDimRules(t *testing.T) {
	type rule struct {
		name string
		f    func(int) int
		want map[int]int // head dim -> result
	}
	rules := []rule{
		{"padMMA", padMMA, map[int]int{1: 16, 16: 16, 17: 32, 59: 64, 127: 128, 257: 272, 512: 512}},
		{"fwdPadDV/1", func(d int) int { return fwdPadDV(d, 1) }, map[int]int{1: 16, 59: 64, 257: 272}},
		{"fwdPadDV/2", func(d int) int { return fwdPadDV(d, 2) }, map[int]int{1: 32, 59: 64, 65: 96, 257: 288}},
		{"fwdHopperSplitDV", fwdHopperSplitDV, map[int]int{321: 384, 384: 384, 400: 512, 512: 512}},
		{"hopperTileDim(d, 2d)", func(d int) int { return hopperTileDim(d, 2*d) }, map[int]int{1: 16, 59: 128, 100: 208}},
		{"swizzleAtoms", swizzleAtoms, map[int]int{16: 1, 64: 1, 80: 2, 128: 2, 272: 5, 512: 8}},
		{"bwdPadDim", bwdPadDim, map[int]int{1: 16, 59: 64, 64: 64, 65: 96, 111: 128, 199: 224, 257: 288, 512: 512}},
		{"CapacityDim", CapacityDim, map[int]int{1: 16, 59: 64, 64: 64, 199: 208}},
		{"TMACols", TMACols, map[int]int{1: 8, 8: 8, 59: 64, 60: 64, 123: 128, 199: 200}},
		{"StagedDim", StagedDim, map[int]int{1: 16, 59: 64, 199: 208, 200: 208, 257: 272}},
		{"BwdStagedDim/fp32", func(d int) int { return BwdStagedDim(attn.Float32, d) }, map[int]int{1: 8, 59: 64, 199: 200}},
		{"BwdStagedDim/bf16", func(d int) int { return BwdStagedDim(attn.BFloat16, d) }, map[int]int{1: 16, 59: 64, 199: 208}},
		{"BwdDQAccDim", BwdDQAccDim, map[int]int{1: 16, 8: 16, 16: 16, 17: 32, 32: 32, 33: 64, 59: 64, 127: 128, 257: 288}},
		{"FlatWidth", FlatWidth, map[int]int{1: 16, 59: 64, 123: 128, 187: 192}},
	}
	for _, r := range rules {
		for d, want := range r.want {
			if got := r.f(d); got != want {
				t.Errorf("%s(%d) = %d, want %d", r.name, d, got, want)
			}
		}
	}
}

func TestHeadDimPredicates(t *testing.T) {
	tests := []struct {
		dt       attn.DType
		dk, dv   int
		staging  bool // BwdNeedsStaging
		flatFits bool // FlatFits
	}{
		{attn.BFloat16, 64, 64, false, false},
		{attn.BFloat16, 59, 59, true, false},
		{attn.BFloat16, 57, 57, true, true},
		{attn.BFloat16, 8, 8, false, true},
		{attn.Float16, 9, 24, true, true},
		{attn.Float32, 4, 4, false, true},
		{attn.Float32, 6, 4, true, true},
		{attn.BFloat16, 1, 1, true, true},
		{attn.BFloat16, 111, 127, true, false},
	}
	for _, tc := range tests {
		if got := BwdNeedsStaging(tc.dt, tc.dk, tc.dv); got != tc.staging {
			t.Errorf("BwdNeedsStaging(%v, %d, %d) = %v, want %v", tc.dt, tc.dk, tc.dv, got, tc.staging)
		}
		if got := FlatFits(tc.dk, tc.dv); got != tc.flatFits {
			t.Errorf("FlatFits(%d, %d) = %v, want %v", tc.dk, tc.dv, got, tc.flatFits)
		}
	}
}
