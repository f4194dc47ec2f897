package gpu

import (
	"errors"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestSelectDQAlgorithm checks the measured table's choices and that
// Deterministic always gets the separate (bit-for-bit) algorithm.
func TestSelectDQAlgorithm(t *testing.T) {
	cases := []struct {
		name string
		p    attn.Problem
		k    DQKernels
		ask  DQAlgorithm
		want DQAlgorithm
	}{
		{"d64 short", attn.Problem{N: 512, M: 512, DK: 64, DV: 64}, DQKernels{}, DQAuto, DQAtomic},
		{"d128 causal", attn.Problem{N: 4096, M: 4096, DK: 128, DV: 128, Masked: true}, DQKernels{}, DQAuto, DQAtomic},
		{"d256 mma.sync", attn.Problem{N: 4096, M: 4096, DK: 256, DV: 256}, DQKernels{}, DQAuto, DQAtomic},
		{"d512", attn.Problem{N: 4096, M: 4096, DK: 512, DV: 384}, DQKernels{}, DQAuto, DQAtomic},
		{"hopper d128", attn.Problem{N: 4096, M: 4096, DK: 128, DV: 128}, DQKernels{Hopper: true}, DQAuto, DQSeparate},
		{"hopper d128 causal", attn.Problem{N: 4096, M: 4096, DK: 128, DV: 128, Masked: true}, DQKernels{Hopper: true}, DQAuto, DQAtomic},
		{"hopper d128 packed", attn.Problem{N: 4096, M: 4096, DK: 128, DV: 128, Varlen: true}, DQKernels{Hopper: true}, DQAuto, DQAtomic},
		{"hopper d96", attn.Problem{N: 1024, M: 1024, DK: 96, DV: 96}, DQKernels{Hopper: true}, DQAuto, DQSeparate},
		{"hopper d64", attn.Problem{N: 4096, M: 4096, DK: 64, DV: 64}, DQKernels{Hopper: true}, DQAuto, DQAtomic},
		{"hopper d256", attn.Problem{N: 4096, M: 4096, DK: 256, DV: 256, Masked: true}, DQKernels{Hopper: true}, DQAuto, DQSeparate},
		{"hopper d512: no atomic dQ there", attn.Problem{N: 4096, M: 4096, DK: 512, DV: 512}, DQKernels{Hopper: true}, DQAuto, DQSeparate},
		{"explicit atomic on hopper d320", attn.Problem{N: 4096, M: 4096, DK: 320, DV: 320}, DQKernels{Hopper: true}, DQAtomic, DQSeparate},
		{"mma.sync d512", attn.Problem{N: 4096, M: 4096, DK: 512, DV: 512}, DQKernels{}, DQAuto, DQAtomic},
		{"ws d64 causal", attn.Problem{N: 4096, M: 4096, DK: 64, DV: 64, Masked: true}, DQKernels{Hopper: true, WarpSpecialized: true}, DQAuto, DQAtomic},
		{"ws d96", attn.Problem{N: 4096, M: 4096, DK: 96, DV: 96}, DQKernels{Hopper: true, WarpSpecialized: true}, DQAuto, DQAtomic},
		{"ws d128", attn.Problem{N: 4096, M: 4096, DK: 128, DV: 128}, DQKernels{Hopper: true, WarpSpecialized: true}, DQAuto, DQSeparate},
		{"ws d128 causal", attn.Problem{N: 4096, M: 4096, DK: 128, DV: 128, Masked: true}, DQKernels{Hopper: true, WarpSpecialized: true}, DQAuto, DQSeparate},
		{"ws d128 packed: the lockstep rows", attn.Problem{N: 4096, M: 4096, DK: 128, DV: 128, Masked: true, Varlen: true}, DQKernels{Hopper: true, WarpSpecialized: true}, DQAuto, DQAtomic},
		{"ws d256", attn.Problem{N: 4096, M: 4096, DK: 256, DV: 256}, DQKernels{Hopper: true, WarpSpecialized: true}, DQAuto, DQSeparate},
		{"ws without the Hopper kernels: mma.sync rows", attn.Problem{N: 4096, M: 4096, DK: 128, DV: 128}, DQKernels{WarpSpecialized: true}, DQAuto, DQAtomic},
		{"deterministic", attn.Problem{N: 4096, M: 4096, DK: 128, DV: 128, Opt: attn.Options{Deterministic: true}}, DQKernels{}, DQAuto, DQSeparate},
		{"deterministic beats an explicit atomic", attn.Problem{N: 64, M: 64, DK: 64, DV: 64, Opt: attn.Options{Deterministic: true}}, DQKernels{Hopper: true}, DQAtomic, DQSeparate},
		{"explicit separate", attn.Problem{N: 4096, M: 4096, DK: 64, DV: 64}, DQKernels{}, DQSeparate, DQSeparate},
		{"explicit atomic on hopper", attn.Problem{N: 4096, M: 4096, DK: 256, DV: 256}, DQKernels{Hopper: true}, DQAtomic, DQAtomic},
	}
	for _, c := range cases {
		if got := resolveDQ(&c.p, c.ask, c.k); got != c.want {
			t.Errorf("%s: resolveDQ(%v, %+v) = %v, want %v", c.name, c.ask, c.k, got, c.want)
		}
	}
	// the Hopper kernels run 16-bit head dims up to 256, not fp32
	runs := func(dt attn.DType) bool {
		p := &attn.Problem{B: 1, N: 64, M: 64, H: 1, Hkv: 1, DK: 256, DV: 256}
		var a bwdArgs
		shape := []int{1, 64, 1, 256}
		a.Q, a.K, a.V, a.O, a.DO = seqView(256, dt, shape), seqView(256, dt, shape), seqView(256, dt, shape), seqView(256, dt, shape), seqView(256, dt, shape)
		a.DQ, a.DK, a.DV = a.Q, a.K, a.V
		return bwdHopperRuns(p, dt, &a, true, false)
	}
	if !runs(attn.BFloat16) || runs(attn.Float32) {
		t.Error("bwdHopperRuns: wrong kernels for bf16 or fp32 at D=256")
	}
}

func TestHopperAllowed(t *testing.T) {
	tests := []struct {
		name                string
		major, minor, nvrtc int
		env                 string
		want                bool
	}{
		{"H100/H200, NVRTC 13", 9, 0, 13, "", true},
		{"NVRTC 12", 9, 0, 12, "", true},
		{"opt-out 0 keeps them", 9, 0, 13, "0", true},
		{"opted out", 9, 0, 13, "1", false},
		{"NVRTC 11.8", 9, 0, 11, "", false},
		{"no NVRTC", 9, 0, 0, "", false},
		{"A100", 8, 0, 13, "", false},
		{"Blackwell", 10, 0, 13, "", false},
	}
	for _, tt := range tests {
		if got := hopperAllowed(tt.major, tt.minor, tt.nvrtc, tt.env); got != tt.want {
			t.Errorf("%s: hopperAllowed = %v, want %v", tt.name, got, tt.want)
		}
	}
}

// TestParseDQAlgorithm reads every algorithm's name back and refuses
// others.
func TestParseDQAlgorithm(t *testing.T) {
	for _, a := range []DQAlgorithm{DQAuto, DQAtomic, DQSeparate} {
		if got, err := ParseDQAlgorithm(a.String()); err != nil || got != a {
			t.Errorf("ParseDQAlgorithm(%q) = %v, %v", a.String(), got, err)
		}
	}
	if got, err := ParseDQAlgorithm(""); err != nil || got != DQAuto {
		t.Errorf(`ParseDQAlgorithm("") = %v, %v`, got, err)
	}
	if _, err := ParseDQAlgorithm("fast"); !errors.Is(err, attn.ErrOption) {
		t.Errorf(`ParseDQAlgorithm("fast"): %v, want ErrOption`, err)
	}
}
