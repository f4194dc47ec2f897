package flashattn

import (
	"errors"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/flashattn/flashattn/cpu"
)

// checkAgainstReference compares a forward's O and LSE and the gradients
// of dO with the float64 reference under opt.
func checkAgainstReference(t *testing.T, q, k, v, dO Tensor, res Result, g Gradients, opt Options) {
	t.Helper()
	ref, err := cpu.Reference(q, k, v, opt)
	if err != nil {
		t.Fatal(err)
	}
	closeTo(t, "O", res.O.Float64s(), ref.O)
	closeTo(t, "LSE", res.LSE.Float64s(), ref.LSE)
	refG, err := cpu.ReferenceBackward(q, k, v, dO, opt)
	if err != nil {
		t.Fatal(err)
	}
	closeTo(t, "dQ", g.DQ.Float64s(), refG.DQ)
	closeTo(t, "dK", g.DK.Float64s(), refG.DK)
	closeTo(t, "dV", g.DV.Float64s(), refG.DV)
	if opt.Bias != nil && opt.Bias.RequiresGrad {
		if g.DBias == nil {
			t.Fatal("no dBias")
		}
		closeTo(t, "dBias", g.DBias.Float64s(), refG.DBias)
	}
}

// TestForwardedBackward runs the contract form on the CPU backend and
// checks its gradients against the float64 reference under the forward's
// options, after the caller has changed every option it holds: the
// backward must use the forward's options, not the caller's.
func TestForwardedBackward(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	b, err := Open("cpu")
	if err != nil {
		t.Fatal(err)
	}
	bias := randomTensor(rng, Float32, 1, 4, 9, 6)
	tests := []struct {
		name          string
		b, n, m, h, g int
		dk, dv        int
		opt           func() Options
	}{
		{"causal gqa", 1, 9, 6, 4, 2, 16, 12, func() Options { return Options{Causal: true} }},
		{"window top-left", 2, 8, 8, 2, 1, 4, 4, func() Options {
			return Options{Window: &Window{Left: 2, Right: 1}, Align: AlignTopLeft}
		}},
		{"bias with gradient", 1, 9, 6, 4, 4, 8, 8, func() Options {
			return Options{Bias: &Bias{Tensor: bias, RequiresGrad: true}, Softcap: 2}
		}},
		{"dropout", 2, 7, 9, 2, 2, 8, 5, func() Options { return Options{Dropout: 0.3, Seed: 11, Offset: 4} }},
		{"packed with an empty segment", 1, 8, 10, 2, 1, 8, 8, func() Options {
			return Options{Causal: true, Dropout: 0.2, Seed: 5, CuSeqlensQ: []int32{0, 3, 3, 8}, CuSeqlensK: []int32{0, 4, 4, 10}}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			shape := func(bb, s, h, d int) []int {
				if tc.opt().CuSeqlensQ != nil {
					return []int{s, h, d}
				}
				return []int{bb, s, h, d}
			}
			q := randomTensor(rng, Float32, shape(tc.b, tc.n, tc.h, tc.dk)...)
			k := randomTensor(rng, Float32, shape(tc.b, tc.m, tc.h/tc.g, tc.dk)...)
			v := randomTensor(rng, Float32, shape(tc.b, tc.m, tc.h/tc.g, tc.dv)...)
			dO := randomTensor(rng, Float32, shape(tc.b, tc.n, tc.h, tc.dv)...)
			opt := tc.opt()
			fw, err := ForwardOn(b, q, k, v, opt)
			if err != nil {
				t.Fatal(err)
			}
			// The caller reuses its Options for something else.
			opt.Causal = !opt.Causal
			opt.Dropout, opt.Seed, opt.Offset = 0.5, opt.Seed+1, opt.Offset+1
			opt.Align = AlignTopLeft - opt.Align
			if opt.Window != nil {
				opt.Window.Left, opt.Window.Right = 0, 0
			}
			if opt.Bias != nil {
				opt.Bias.RequiresGrad = false
			}
			if opt.CuSeqlensQ != nil {
				opt.CuSeqlensQ[1], opt.CuSeqlensK[1] = 2, 2
			}
			g, err := fw.Backward(dO)
			if err != nil {
				t.Fatal(err)
			}
			checkAgainstReference(t, q, k, v, dO, fw.Result, g, tc.opt())
			if got := fw.Options(); got.Causal != tc.opt().Causal || got.Seed != tc.opt().Seed || got.Offset != tc.opt().Offset {
				t.Errorf("Options() = %+v, want the forward's %+v", got, tc.opt())
			}
		})
	}
}

// TestForwardedKeepsItsOutputs checks that reassigning the exported O and
// LSE of a Forwarded does not change its backward.
func TestForwardedKeepsItsOutputs(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	b, _ := Open("cpu")
	q := randomTensor(rng, Float32, 1, 6, 2, 8)
	dO := randomTensor(rng, Float32, 1, 6, 2, 8)
	fw, err := ForwardOn(b, q, q, q, Options{Causal: true})
	if err != nil {
		t.Fatal(err)
	}
	want, err := fw.Backward(dO)
	if err != nil {
		t.Fatal(err)
	}
	fw.O, fw.LSE = New(Float32, 1, 6, 2, 8), New(Float32, 1, 2, 6)
	got, err := fw.Backward(dO)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got.DQ.Float32s(), want.DQ.Float32s()) {
		t.Error("dQ changed after reassigning O and LSE")
	}
}

func TestForwardOnErrors(t *testing.T) {
	q := New(Float32, 1, 4, 2, 8)
	b, _ := Open("cpu")
	tests := []struct {
		name string
		b    Backend
		k    Tensor
		opt  Options
		want error
	}{
		{"nil backend", nil, q, Options{}, ErrOption},
		{"bad dropout", b, q, Options{Dropout: 1.5}, ErrOption},
		{"bad shape", b, New(Float32, 1, 4, 2, 7), Options{}, ErrShape},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fw, err := ForwardOn(tc.b, q, tc.k, q, tc.opt)
			if !errors.Is(err, tc.want) || fw != nil {
				t.Fatalf("ForwardOn = %v, %v; want nil, an error wrapping %v", fw, err, tc.want)
			}
		})
	}
	fw, err := ForwardOn(b, q, q, q, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fw.Backward(New(Float32, 1, 4, 2, 9)); !errors.Is(err, ErrShape) {
		t.Errorf("Backward with a dO of the wrong shape: %v, want ErrShape", err)
	}
}

// TestGeneratorForwardBackward draws two forwards with dropout from one
// generator: their masks differ, and each contract-form backward
// reproduces its own forward's mask (checked against the float64
// reference with that forward's pair, and not with the other's).
func TestGeneratorForwardBackward(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	b, _ := Open("cpu")
	q := randomTensor(rng, Float32, 2, 12, 2, 8)
	k := randomTensor(rng, Float32, 2, 16, 2, 8)
	v := randomTensor(rng, Float32, 2, 16, 2, 8)
	dO := randomTensor(rng, Float32, 2, 12, 2, 8)
	gen := NewGenerator(2024)
	opt := Options{Causal: true, Dropout: 0.25}

	var fws [2]*Forwarded
	for i := range fws {
		fw, err := ForwardOn(b, q, k, v, gen.Draw(opt))
		if err != nil {
			t.Fatal(err)
		}
		fws[i] = fw
	}
	if a, c := fws[0].Options(), fws[1].Options(); a.Seed == c.Seed && a.Offset == c.Offset {
		t.Fatalf("both forwards used the pair (%d, %d)", a.Seed, a.Offset)
	}
	if slices.Equal(fws[0].O.Float32s(), fws[1].O.Float32s()) {
		t.Fatal("two forwards drawn from one generator have the same output: the same mask")
	}
	for i, fw := range fws {
		g, err := fw.Backward(dO)
		if err != nil {
			t.Fatal(err)
		}
		checkAgainstReference(t, q, k, v, dO, fw.Result, g, fw.Options())
		// The other forward's pair gives other gradients: the check above
		// tells the masks apart.
		other, err := cpu.ReferenceBackward(q, k, v, dO, fws[1-i].Options())
		if err != nil {
			t.Fatal(err)
		}
		if maxAbsDiff(g.DQ.Float64s(), other.DQ) < 1e-2 {
			t.Fatalf("forward %d: dQ also matches the other forward's mask", i)
		}
	}
}

func maxAbsDiff(a, b []float64) float64 {
	m := 0.0
	for i := range a {
		m = max(m, a[i]-b[i], b[i]-a[i])
	}
	return m
}

// TestGradientsInInputLayout runs the backward on strided views (a
// [B, H, N, D] buffer through BHSD, a packed batch held head-major, a
// feature dim that is not innermost) on the CPU backend: the gradients hold
// the values of the same inputs made contiguous, bit for bit, and are laid
// out in memory like their inputs.
func TestGradientsInInputLayout(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	b, _ := Open("cpu")
	bhsd := func(dt DType, bb, h, s, d int) Tensor {
		v, err := BHSD(randomTensor(rng, dt, bb, h, s, d))
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	permuted := func(dt DType, perm []int, shape ...int) Tensor {
		v, err := Permute(randomTensor(rng, dt, shape...), perm...)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	tests := []struct {
		name       string
		q, k, v, o func() Tensor // o: a tensor shaped like dO
		opt        Options
	}{
		{"BHSD fp32 gqa causal",
			func() Tensor { return bhsd(Float32, 2, 4, 9, 8) }, func() Tensor { return bhsd(Float32, 2, 2, 7, 8) },
			func() Tensor { return bhsd(Float32, 2, 2, 7, 6) }, func() Tensor { return bhsd(Float32, 2, 4, 9, 6) },
			Options{Causal: true}},
		{"BHSD bf16 dropout",
			func() Tensor { return bhsd(BFloat16, 1, 2, 70, 16) }, func() Tensor { return bhsd(BFloat16, 1, 2, 80, 16) },
			func() Tensor { return bhsd(BFloat16, 1, 2, 80, 16) }, func() Tensor { return bhsd(BFloat16, 1, 2, 70, 16) },
			Options{Dropout: 0.1, Seed: 3}},
		{"BHSD fp16",
			func() Tensor { return bhsd(Float16, 2, 3, 5, 4) }, func() Tensor { return bhsd(Float16, 2, 3, 5, 4) },
			func() Tensor { return bhsd(Float16, 2, 3, 5, 4) }, func() Tensor { return bhsd(Float16, 2, 3, 5, 4) },
			Options{}},
		{"packed head-major",
			func() Tensor { return permuted(Float32, []int{1, 0, 2}, 2, 10, 8) },
			func() Tensor { return permuted(Float32, []int{1, 0, 2}, 1, 12, 8) },
			func() Tensor { return permuted(Float32, []int{1, 0, 2}, 1, 12, 8) },
			func() Tensor { return permuted(Float32, []int{1, 0, 2}, 2, 10, 8) },
			Options{CuSeqlensQ: []int32{0, 4, 10}, CuSeqlensK: []int32{0, 5, 12}}},
		{"feature dim outermost",
			func() Tensor { return permuted(Float32, []int{1, 2, 3, 0}, 8, 1, 6, 2) },
			func() Tensor { return permuted(Float32, []int{1, 2, 3, 0}, 8, 1, 6, 2) },
			func() Tensor { return permuted(Float32, []int{1, 2, 3, 0}, 8, 1, 6, 2) },
			func() Tensor { return permuted(Float32, []int{1, 2, 3, 0}, 8, 1, 6, 2) },
			Options{Causal: true}},
	}
	contiguous := func(x Tensor) Tensor { return FromFloat32(x.DType, x.Float32s(), x.Shape...) }
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			q, k, v, dO := tc.q(), tc.k(), tc.v(), tc.o()
			fw, err := ForwardOn(b, q, k, v, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			g, err := fw.Backward(dO)
			if err != nil {
				t.Fatal(err)
			}
			fwc, err := ForwardOn(b, contiguous(q), contiguous(k), contiguous(v), tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			want, err := fwc.Backward(contiguous(dO))
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range []struct {
				name      string
				got, want Tensor
				in        Tensor
			}{{"dQ", g.DQ, want.DQ, q}, {"dK", g.DK, want.DK, k}, {"dV", g.DV, want.DV, v}} {
				if !slices.Equal(c.got.Shape, c.in.Shape) {
					t.Fatalf("%s shape %v, want %v", c.name, c.got.Shape, c.in.Shape)
				}
				if ws := NewLike(c.in.DType, c.in).Strides; !slices.Equal(c.got.Strides, ws) {
					t.Errorf("%s strides %v, want %v (its input's memory order)", c.name, c.got.Strides, ws)
				}
				if err := c.got.CheckLayout(c.name); err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(c.got.Float32s(), c.want.Float32s()) {
					t.Errorf("%s differs from the gradient of contiguous inputs", c.name)
				}
			}
			if len(q.Shape) == 4 && q.Strides[3] == 1 {
				// A BHSD view's gradient, viewed back, is a contiguous [B, H, N, D] tensor.
				back, err := ToBHSD(g.DQ)
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(back.Strides, NewLike(Float32, New(Float32, back.Shape...)).Strides) {
					t.Errorf("ToBHSD(dQ) strides %v, want contiguous", back.Strides)
				}
			}
		})
	}
}
