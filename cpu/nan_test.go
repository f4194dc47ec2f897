package cpu_test

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
)

// TestNaNMatchesReference poisons one row of an input and checks that the
// fast backend puts NaN exactly where the float64 reference does (every
// output element a visible pair connects to the NaN, and nothing else:
// masked keys contribute nothing, a NaN query row is NaN, a row that sees
// no key stays O = 0, LSE = −Inf) and agrees with it elsewhere. The mask
// semantics themselves are checked from the mask alone by the conformance
// suite's nan cases.
func TestNaNMatchesReference(t *testing.T) {
	nan := float32(math.NaN())
	causal := attn.Options{Causal: true}
	tests := []struct {
		name       string
		n, m       int
		h, hkv     int
		opt        attn.Options
		seqQ, seqK []int32 // cu_seqlens of a packed batch
		tensor     int     // 0 q, 1 k, 2 v, 3 dO
		row, head  int
		value      float32
		bias       bool // add a bias [1, H, N, M] that requires its gradient
	}{
		{"v row 12 causal", 16, 16, 2, 1, causal, nil, nil, 2, 12, 0, nan, false},
		{"k row 12 causal", 16, 16, 2, 1, causal, nil, nil, 1, 12, 0, nan, false},
		{"q row 3 causal", 16, 16, 2, 1, causal, nil, nil, 0, 3, 1, nan, false},
		{"dO row 9 causal", 16, 16, 2, 2, causal, nil, nil, 3, 9, 1, nan, false},
		{"q row with no key", 30, 20, 1, 1, causal, nil, nil, 0, 4, 0, nan, false},
		{"v +Inf row 100 causal chunked", 150, 150, 2, 1, causal, nil, nil, 2, 100, 0, float32(math.Inf(1)), false},
		{"k row 64 window", 130, 130, 3, 1, attn.Options{Window: &attn.Window{Left: 30, Right: 2}}, nil, nil, 1, 64, 0, nan, false},
		{"q row 70 window top-left", 130, 90, 2, 2, attn.Options{Window: &attn.Window{Left: 10, Right: 10}, Align: attn.AlignTopLeft}, nil, nil, 0, 70, 1, nan, false},
		{"v row 50 causal dropout softcap", 80, 80, 2, 1, attn.Options{Causal: true, Dropout: 0.3, Seed: 3, Softcap: 4}, nil, nil, 2, 50, 0, nan, false},
		{"k row 12 causal packed", 0, 0, 2, 1, causal, []int32{0, 10, 40}, []int32{0, 10, 45}, 1, 12, 0, nan, false},
		{"q row 25 window packed", 0, 0, 2, 1, attn.Options{Window: &attn.Window{Left: 3, Right: 0}}, []int32{0, 20, 70}, []int32{0, 30, 80}, 0, 25, 1, nan, false},
		{"k row 80 window bias", 100, 100, 2, 1, attn.Options{Window: &attn.Window{Left: 20, Right: 20}}, nil, nil, 1, 80, 0, nan, true},
		{"v row 30 causal bias", 70, 70, 2, 2, causal, nil, nil, 2, 30, 1, nan, true},
	}
	r := rand.New(rand.NewPCG(3, 12))
	b := cpu.New()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			opt := tc.opt
			shapes := [][]int{{1, tc.n, tc.h, 8}, {1, tc.m, tc.hkv, 8}, {1, tc.m, tc.hkv, 8}, {1, tc.n, tc.h, 8}}
			if tc.seqQ != nil {
				opt.CuSeqlensQ, opt.CuSeqlensK = tc.seqQ, tc.seqK
				tq, tk := int(tc.seqQ[len(tc.seqQ)-1]), int(tc.seqK[len(tc.seqK)-1])
				shapes = [][]int{{tq, tc.h, 8}, {tk, tc.hkv, 8}, {tk, tc.hkv, 8}, {tq, tc.h, 8}}
			}
			in := make([]attn.Tensor, 4)
			for i, s := range shapes {
				in[i] = randTensor(r, attn.Float32, s...)
			}
			x := in[tc.tensor]
			for d := 0; d < 8; d++ {
				if tc.seqQ != nil {
					x.Set(tc.value, tc.row, tc.head, d)
				} else {
					x.Set(tc.value, 0, tc.row, tc.head, d)
				}
			}
			if tc.bias {
				opt.Bias = &attn.Bias{Tensor: randTensor(r, attn.Float32, 1, tc.h, tc.n, tc.m), RequiresGrad: true}
			}
			res, err := b.Forward(in[0], in[1], in[2], opt)
			if err != nil {
				t.Fatal(err)
			}
			g, err := b.Backward(in[0], in[1], in[2], res.O, res.LSE, in[3], opt)
			if err != nil {
				t.Fatal(err)
			}
			ref, err := cpu.Reference(in[0], in[1], in[2], opt)
			if err != nil {
				t.Fatal(err)
			}
			refG, err := cpu.ReferenceBackward(in[0], in[1], in[2], in[3], opt)
			if err != nil {
				t.Fatal(err)
			}
			var sawNaN, sawFinite bool
			type output struct {
				name     string
				got, ref []float64
			}
			outs := []output{{"O", res.O.Float64s(), ref.O}, {"LSE", res.LSE.Float64s(), ref.LSE},
				{"dQ", g.DQ.Float64s(), refG.DQ}, {"dK", g.DK.Float64s(), refG.DK}, {"dV", g.DV.Float64s(), refG.DV}}
			if tc.bias {
				outs = append(outs, output{"dBias", g.DBias.Float64s(), refG.DBias})
			}
			for _, o := range outs {
				scale := 1.0
				for _, v := range o.ref {
					if !math.IsNaN(v) && !math.IsInf(v, 0) {
						scale = max(scale, math.Abs(v))
					}
				}
				for i, want := range o.ref {
					got := o.got[i]
					switch {
					case math.IsNaN(want) != math.IsNaN(got):
						t.Fatalf("%s[%d] = %v, reference %v", o.name, i, got, want)
					case math.IsNaN(want):
						sawNaN = true
					case got == want:
						sawFinite = sawFinite || !math.IsInf(want, 0)
					case !(math.Abs(got-want) <= 1e-5*scale):
						t.Fatalf("%s[%d] = %v, reference %v", o.name, i, got, want)
					default:
						sawFinite = true
					}
				}
			}
			if !sawFinite || (!sawNaN && tc.name != "q row with no key") {
				t.Errorf("NaN seen %v, finite seen %v: the case tests nothing", sawNaN, sawFinite)
			}
		})
	}
}
