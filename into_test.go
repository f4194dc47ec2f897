package flashattn

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestIntoForms checks ForwardInto and BackwardInto on the CPU backend
// (which computes and copies in) against Forward and Backward: the same
// values, in caller-allocated outputs of any layout, bit for bit.
func TestIntoForms(t *testing.T) {
	b, err := Open("cpu")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		dt   DType
		bhsd bool // outputs allocated as [B, H, N, D] buffers viewed as [B, N, H, D]
		bias bool
	}{
		{"fp32 contiguous", Float32, false, false},
		{"bf16 bhsd outputs", BFloat16, true, false},
		{"fp16 bias", Float16, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(5, 6))
			q, k, v := randomTensor(rng, tc.dt, 2, 37, 4, 24), randomTensor(rng, tc.dt, 2, 41, 2, 24), randomTensor(rng, tc.dt, 2, 41, 2, 16)
			dO := randomTensor(rng, tc.dt, 2, 37, 4, 16)
			opt := Options{Causal: true}
			if tc.bias {
				opt.Bias = &Bias{Tensor: randomTensor(rng, Float32, 1, 4, 37, 41), RequiresGrad: true}
			}
			fw, err := ForwardOn(b, q, k, v, opt) // Forward, and Backward with its outputs
			if err != nil {
				t.Fatal(err)
			}
			want := fw.Result
			wantG, err := fw.Backward(dO)
			if err != nil {
				t.Fatal(err)
			}
			alloc := func(dt DType, shape ...int) Tensor {
				if !tc.bhsd || len(shape) != 4 {
					x := New(dt, shape...)
					x.Fill(float32(math.NaN())) // poison that must be overwritten
					return x
				}
				x, err := attn.BHSD(New(dt, shape[0], shape[2], shape[1], shape[3]))
				if err != nil {
					t.Fatal(err)
				}
				return x
			}
			res := Result{O: alloc(tc.dt, want.O.Shape...), LSE: alloc(Float32, want.LSE.Shape...)}
			if err := ForwardInto(b, q, k, v, res, opt); err != nil {
				t.Fatalf("ForwardInto: %v", err)
			}
			g := Gradients{DQ: alloc(tc.dt, q.Shape...), DK: alloc(tc.dt, k.Shape...), DV: alloc(tc.dt, v.Shape...)}
			if tc.bias {
				db := alloc(Float32, opt.Bias.Tensor.Shape...)
				g.DBias = &db
			}
			if err := BackwardInto(b, q, k, v, res.O, res.LSE, dO, g, opt); err != nil {
				t.Fatalf("BackwardInto: %v", err)
			}
			pairs := []struct {
				name      string
				got, want Tensor
			}{{"O", res.O, want.O}, {"LSE", res.LSE, want.LSE}, {"dQ", g.DQ, wantG.DQ}, {"dK", g.DK, wantG.DK}, {"dV", g.DV, wantG.DV}}
			if tc.bias {
				pairs = append(pairs, struct {
					name      string
					got, want Tensor
				}{"dBias", *g.DBias, *wantG.DBias})
			}
			for _, x := range pairs {
				if !slices.Equal(x.got.Bytes(), x.want.Bytes()) {
					t.Errorf("%s differs from the allocating form's", x.name)
				}
			}
		})
	}
}

// TestIntoFormErrors checks that outputs of the wrong shape, dtype or
// layout, a missing dBias and a nil backend fail with the right sentinel.
func TestIntoFormErrors(t *testing.T) {
	b, _ := Open("cpu")
	rng := rand.New(rand.NewPCG(1, 2))
	q, k, v := randomTensor(rng, Float32, 1, 8, 2, 4), randomTensor(rng, Float32, 1, 8, 2, 4), randomTensor(rng, Float32, 1, 8, 2, 4)
	good := Result{O: New(Float32, 1, 8, 2, 4), LSE: New(Float32, 1, 2, 8)}
	short := New(Float32, 10)
	short.Shape, short.Strides = []int{1, 8, 2, 4}, nil
	for _, tc := range []struct {
		name string
		run  func() error
		want error
	}{
		{"o shape", func() error {
			return ForwardInto(b, q, k, v, Result{O: New(Float32, 1, 8, 2, 5), LSE: good.LSE}, Options{})
		}, ErrShape},
		{"o dtype", func() error {
			return ForwardInto(b, q, k, v, Result{O: New(BFloat16, 1, 8, 2, 4), LSE: good.LSE}, Options{})
		}, ErrDType},
		{"lse dtype", func() error { return ForwardInto(b, q, k, v, Result{O: good.O, LSE: New(Float16, 1, 2, 8)}, Options{}) }, ErrDType},
		{"o storage too short", func() error { return ForwardInto(b, q, k, v, Result{O: short, LSE: good.LSE}, Options{}) }, ErrLayout},
		{"nil backend", func() error { return ForwardInto(nil, q, k, v, good, Options{}) }, ErrOption},
		{"dq shape", func() error {
			g := Gradients{DQ: New(Float32, 1, 8, 2, 3), DK: New(Float32, k.Shape...), DV: New(Float32, v.Shape...)}
			return BackwardInto(b, q, k, v, good.O, good.LSE, good.O, g, Options{})
		}, ErrShape},
		{"dbias missing", func() error {
			g := Gradients{DQ: New(Float32, q.Shape...), DK: New(Float32, k.Shape...), DV: New(Float32, v.Shape...)}
			opt := Options{Bias: &Bias{Tensor: New(Float32, 1, 1, 8, 8), RequiresGrad: true}}
			return BackwardInto(b, q, k, v, good.O, good.LSE, good.O, g, opt)
		}, ErrOption},
	} {
		if err := tc.run(); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want an error wrapping %v", tc.name, err, tc.want)
		}
	}
}
