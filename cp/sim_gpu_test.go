package cp

import (
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/gpu"
)

// TestSimOnCUDA runs the schemes on P in-process ranks over the CUDA
// backend (host tensors; each rank's calls go through the backend's host
// path) and checks outputs and gradients against the float64 oracle with
// the same criterion as on the CPU. The CUDA backend places a call's
// dropout mask (attn.Options.DropoutAt) at key origins that are multiples
// of 16 only, so dropout runs on cases whose chunks are (the accuracy
// table's dropout cases cut 48 keys into chunks of 12 and are left out).
// Skips without a GPU.
func TestSimOnCUDA(t *testing.T) {
	b, err := gpu.Open()
	if err != nil {
		if cuda.Unavailable(err) {
			t.Skipf("no GPU: %v", err)
		}
		t.Fatalf("gpu.Open: %v", err)
	}
	defer b.Close()
	r := rand.New(rand.NewPCG(5, 6))
	cases := []accCase{
		// 128 keys: chunks of 16 at P = 4 under zigzag
		{"dropout-causal-aligned", 1, 128, 128, 2, 1, 32, 32, attn.Options{Causal: true, Dropout: 0.2, Seed: 9, Offset: 1}},
		{"dropout-placed-aligned", 2, 64, 128, 4, 2, 32, 16, attn.Options{Dropout: 0.3, Seed: 4, DropoutAt: &attn.DropoutOrigin{Query: 5, Key: 32, Head: 1, Heads: 6}}},
	}
	for _, tc := range accCases {
		if tc.opt.Dropout == 0 {
			cases = append(cases, tc)
		}
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, dt := range []attn.DType{attn.BFloat16, attn.Float32} {
				t.Run(dt.String(), func(t *testing.T) {
					q := normal(r, dt, tc.b, tc.n, tc.h, tc.dk)
					k := normal(r, dt, tc.b, tc.m, tc.hkv, tc.dk)
					v := normal(r, dt, tc.b, tc.m, tc.hkv, tc.dv)
					dO := normal(r, dt, tc.b, tc.n, tc.h, tc.dv)
					checkSplitsOn(t, b, variants, dt, q, k, v, dO, tc.opt, []int{1, 2, 4})
				})
			}
		})
	}
}
