package conformance

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/philox"
)

// dropoutFraction checks the kept fraction of a large dropout mask and that
// the mask is exactly the Philox mapping of package philox. With q = 0 every
// key of a row has probability 1/M, and with v the identity (DV = M), O[i, j]
// is the dropped probability of key j: 1/M·256/T if kept (T = 212 of 256
// at p = 0.17: the scale of the p the mask resolves, 1 − T/256), else 0.
func dropoutFraction(t *testing.T, b attn.Backend, dt attn.DType, cfg Config) {
	const p = 0.17
	nb, n, m, h, hkv := 2, 256, 256, 4, 2
	if cfg.Short {
		n = 128
	}
	r := rand.New(rand.NewPCG(17, uint64(dt)))
	q := attn.New(dt, nb, n, h, 16)
	k := randTensor(r, dt, contiguous, 1, nb, m, hkv, 16)
	v := attn.New(dt, nb, m, hkv, m)
	for bi := 0; bi < nb; bi++ {
		for j := 0; j < m; j++ {
			for kh := 0; kh < hkv; kh++ {
				v.Set(1, bi, j, kh, j)
			}
		}
	}
	opt := attn.Options{Dropout: p, Seed: 0x5eed_0000_1234, Offset: 9}
	res, ref := forwardWithReference(t, b, cfg, q, k, v, opt)
	checkTensor(t, "O", res.O, dt, ref.Problem.OutputShape())
	if t.Failed() {
		return
	}
	th, err := philox.Threshold(p)
	if err != nil {
		t.Fatal(err)
	}
	want := philox.Scale(th) / float64(m)
	kept := 0
	for i, x := range res.O.Float64s() {
		if (x != 0) != (ref.O[i] != 0) {
			t.Fatalf("O[%d] = %v, oracle %v: the keep mask differs from the Philox mapping", i, x, ref.O[i])
		}
		if x == 0 {
			continue
		}
		kept++
		if math.Abs(x-want) > 2*UnitRoundoff(dt)*want+1e-6*want {
			t.Fatalf("O[%d] = %v, want a kept value of %v", i, x, want)
		}
	}
	frac, keep := float64(kept)/float64(len(ref.O)), float64(th)/philox.Levels
	if math.Abs(frac-keep) > 0.01 {
		t.Errorf("kept fraction %.4f, want T/256 = %.4f ± 0.01", frac, keep)
	}
}

// repeatBitIdentical runs the same deterministic problem many times and
// requires bit-identical outputs.
func repeatBitIdentical(t *testing.T, b attn.Backend, dt attn.DType, cfg Config) {
	repeats := 50
	if cfg.Short {
		repeats = 3
	}
	tc := testCase{name: "repeat", b: 2, n: 150, m: 140, h: 4, hkv: 2, dk: 40, dv: 24,
		opt:   attn.Options{Causal: true, Dropout: 0.1, Seed: 3, Softcap: 8, Deterministic: true},
		biasB: 1, biasH: 4, biasGrad: true}
	q, k, v, dO, opt := tc.inputs(dt)
	var first []attn.Tensor
	for rep := 0; rep < repeats; rep++ {
		res, err := b.Forward(q, k, v, opt)
		if err != nil {
			unsupported(t, err, cfg)
			t.Fatalf("Forward: %v", err)
		}
		g, err := b.Backward(q, k, v, res.O, res.LSE, dO, opt)
		if err != nil {
			unsupported(t, err, cfg)
			t.Fatalf("Backward: %v", err)
		}
		if g.DBias == nil {
			t.Fatal("dBias missing")
		}
		outs := []attn.Tensor{res.O, res.LSE, g.DQ, g.DK, g.DV, *g.DBias}
		if rep == 0 {
			first = outs
			continue
		}
		for i, name := range []string{"O", "LSE", "dQ", "dK", "dV", "dBias"} {
			if at := firstBitDifference(first[i], outs[i]); at >= 0 {
				t.Fatalf("repeat %d: %s differs from the first run at element %d", rep, name, at)
			}
		}
	}
}

// firstBitDifference returns the first logical index where a and b differ
// bit for bit, or -1.
func firstBitDifference(a, b attn.Tensor) int {
	x, y := a.Float32s(), b.Float32s()
	if len(x) != len(y) {
		return 0
	}
	for i := range x {
		if math.Float32bits(x[i]) != math.Float32bits(y[i]) {
			return i
		}
	}
	return -1
}

// badInputs checks that every class of invalid input is rejected by both
// Forward and Backward with an error wrapping the right sentinel.
func badInputs(t *testing.T, b attn.Backend) {
	f32 := func(shape ...int) attn.Tensor { return attn.New(attn.Float32, shape...) }
	type in struct {
		q, k, v, o, lse, dO attn.Tensor
		opt                 attn.Options
	}
	base := func() in {
		return in{q: f32(1, 4, 2, 8), k: f32(1, 5, 1, 8), v: f32(1, 5, 1, 8),
			o: f32(1, 4, 2, 8), lse: f32(1, 2, 4), dO: f32(1, 4, 2, 8)}
	}
	packed := func() in {
		x := in{q: f32(6, 2, 8), k: f32(7, 1, 8), v: f32(7, 1, 8), o: f32(6, 2, 8), lse: f32(2, 6), dO: f32(6, 2, 8)}
		x.opt.CuSeqlensQ, x.opt.CuSeqlensK = []int32{0, 2, 6}, []int32{0, 4, 7}
		return x
	}
	with := func(x in, f func(*in)) in { f(&x); return x }
	inf, nan := math.Inf(1), math.NaN()
	tests := []struct {
		name     string
		x        in
		want     error
		backOnly bool // invalid only for Backward
	}{
		{"H not a multiple of Hkv", with(base(), func(x *in) { x.k, x.v = f32(1, 5, 3, 8), f32(1, 5, 3, 8) }), attn.ErrShape, false},
		{"q/k head dims differ", with(base(), func(x *in) { x.k = f32(1, 5, 1, 7) }), attn.ErrShape, false},
		{"k/v lengths differ", with(base(), func(x *in) { x.v = f32(1, 6, 1, 8) }), attn.ErrShape, false},
		{"k/v heads differ", with(base(), func(x *in) { x.v = f32(1, 5, 2, 8) }), attn.ErrShape, false},
		{"batch sizes differ", with(base(), func(x *in) { x.k, x.v = f32(2, 5, 1, 8), f32(2, 5, 1, 8) }), attn.ErrShape, false},
		{"rank 3 without cu_seqlens", with(base(), func(x *in) { x.q = f32(4, 2, 8) }), attn.ErrShape, false},
		{"dtypes differ", with(base(), func(x *in) { x.k = attn.New(attn.Float16, 1, 5, 1, 8) }), attn.ErrDType, false},
		{"invalid dtype", with(base(), func(x *in) { x.q.DType = attn.DType(7) }), attn.ErrDType, false},
		{"dropout negative", with(base(), func(x *in) { x.opt.Dropout = -0.1 }), attn.ErrOption, false},
		{"dropout 1", with(base(), func(x *in) { x.opt.Dropout = 1 }), attn.ErrOption, false},
		{"dropout NaN", with(base(), func(x *in) { x.opt.Dropout = nan }), attn.ErrOption, false},
		{"head dim 0", with(base(), func(x *in) { x.q, x.k = f32(1, 4, 2, 0), f32(1, 5, 1, 0) }), attn.ErrShape, false},
		{"head dim 513", with(base(), func(x *in) { x.q, x.k = f32(1, 4, 2, 513), f32(1, 5, 1, 513) }), attn.ErrShape, false},
		{"value head dim 0", with(base(), func(x *in) { x.v, x.o, x.dO = f32(1, 5, 1, 0), f32(1, 4, 2, 0), f32(1, 4, 2, 0) }), attn.ErrShape, false},
		{"value head dim 513", with(base(), func(x *in) { x.v, x.o, x.dO = f32(1, 5, 1, 513), f32(1, 4, 2, 513), f32(1, 4, 2, 513) }), attn.ErrShape, false},
		{"scale NaN", with(base(), func(x *in) { x.opt.Scale = nan }), attn.ErrOption, false},
		{"scale Inf", with(base(), func(x *in) { x.opt.Scale = inf }), attn.ErrOption, false},
		{"softcap Inf", with(base(), func(x *in) { x.opt.Softcap = inf }), attn.ErrOption, false},
		{"softcap NaN", with(base(), func(x *in) { x.opt.Softcap = nan }), attn.ErrOption, false},
		{"softcap negative", with(base(), func(x *in) { x.opt.Softcap = -1 }), attn.ErrOption, false},
		{"align invalid", with(base(), func(x *in) { x.opt.Causal, x.opt.Align = true, attn.Align(5) }), attn.ErrOption, false},
		{"bias keys", with(base(), func(x *in) { x.opt.Bias = &attn.Bias{Tensor: f32(1, 1, 4, 6)} }), attn.ErrShape, false},
		{"bias batch", with(base(), func(x *in) { x.opt.Bias = &attn.Bias{Tensor: f32(3, 1, 4, 5)} }), attn.ErrShape, false},
		{"bias heads", with(base(), func(x *in) { x.opt.Bias = &attn.Bias{Tensor: f32(1, 3, 4, 5), RequiresGrad: true} }), attn.ErrShape, false},
		{"bias rank", with(base(), func(x *in) { x.opt.Bias = &attn.Bias{Tensor: f32(2, 4, 5)} }), attn.ErrShape, false},
		{"bias layout", with(base(), func(x *in) {
			t := f32(1, 1, 4, 5)
			t.F32 = t.F32[:19]
			x.opt.Bias = &attn.Bias{Tensor: t}
		}), attn.ErrLayout, false},
		{"bias with packed batch", with(packed(), func(x *in) { x.opt.Bias = &attn.Bias{Tensor: f32(1, 1, 4, 4)} }), attn.ErrUnsupported, false},
		{"cu_seqlens decreasing", with(packed(), func(x *in) { x.opt.CuSeqlensQ = []int32{0, 4, 2, 6}; x.opt.CuSeqlensK = []int32{0, 1, 4, 7} }), attn.ErrOption, false},
		{"cu_seqlens not from 0", with(packed(), func(x *in) { x.opt.CuSeqlensQ = []int32{1, 2, 6} }), attn.ErrOption, false},
		{"cu_seqlens wrong total", with(packed(), func(x *in) { x.opt.CuSeqlensK = []int32{0, 4, 8} }), attn.ErrOption, false},
		{"cu_seqlens only q", with(packed(), func(x *in) { x.opt.CuSeqlensK = nil }), attn.ErrOption, false},
		{"cu_seqlens lengths differ", with(packed(), func(x *in) { x.opt.CuSeqlensK = []int32{0, 1, 4, 7} }), attn.ErrOption, false},
		{"cu_seqlens too short", with(packed(), func(x *in) { x.opt.CuSeqlensQ, x.opt.CuSeqlensK = []int32{0}, []int32{0} }), attn.ErrOption, false},
		{"overlapping strides", with(base(), func(x *in) { x.q.Strides = []int{64, 8, 4, 1} }), attn.ErrLayout, false},
		{"strides past the data", with(base(), func(x *in) { x.k.Strides = []int{40, 8, 8, 1}; x.k.Offset = 1 }), attn.ErrLayout, false},
		{"storage too short", with(base(), func(x *in) { x.v.F32 = x.v.F32[:39] }), attn.ErrLayout, false},
		{"negative stride", with(base(), func(x *in) { x.q.Strides = []int{64, 16, 8, -1} }), attn.ErrLayout, false},
		{"negative offset", with(base(), func(x *in) { x.q.Offset = -1 }), attn.ErrLayout, false},
		{"offset near MaxInt", with(base(), func(x *in) { x.q.Offset = math.MaxInt - 10 }), attn.ErrLayout, false},
		{"stride 2^62 overflows", with(base(), func(x *in) { x.k.Strides = []int{40, 1 << 62, 8, 1} }), attn.ErrLayout, false},
		{"negative size from New", with(base(), func(x *in) { x.v = f32(1, 5, -1, 8) }), attn.ErrShape, false},
		{"element count overflows", with(base(), func(x *in) { x.q = f32(1<<20, 1<<20, 1<<20, 8) }), attn.ErrShape, false},
		{"dO offset near MaxInt", with(base(), func(x *in) { x.dO.Offset = math.MaxInt - 10 }), attn.ErrLayout, true},
		{"lse stride overflows", with(base(), func(x *in) { x.lse.Strides = []int{8, 4, 1 << 62} }), attn.ErrLayout, true},
		{"storage of the wrong type", with(base(), func(x *in) { x.q.DType = attn.Float16; x.k.DType, x.v.DType = attn.Float16, attn.Float16 }), attn.ErrDType, false},
		{"dO shape", with(base(), func(x *in) { x.dO = f32(1, 4, 2, 9) }), attn.ErrShape, true},
		{"o shape", with(base(), func(x *in) { x.o = f32(1, 3, 2, 8) }), attn.ErrShape, true},
		{"lse shape", with(base(), func(x *in) { x.lse = f32(1, 4, 2) }), attn.ErrShape, true},
		{"packed lse shape", with(packed(), func(x *in) { x.lse = f32(6, 2) }), attn.ErrShape, true},
		{"lse dtype", with(base(), func(x *in) { x.lse = attn.New(attn.Float16, 1, 2, 4) }), attn.ErrDType, true},
		{"dO dtype", with(base(), func(x *in) { x.dO = attn.New(attn.BFloat16, 1, 4, 2, 8) }), attn.ErrDType, true},
		{"o dtype", with(base(), func(x *in) { x.o = attn.New(attn.Float16, 1, 4, 2, 8) }), attn.ErrDType, true},
		{"dO overlapping", with(base(), func(x *in) { x.dO.Strides = []int{0, 0, 0, 1} }), attn.ErrLayout, true},
		{"lse past the data", with(base(), func(x *in) { x.lse.Offset = 2 }), attn.ErrLayout, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			x := tc.x
			if !tc.backOnly {
				_, err := b.Forward(x.q, x.k, x.v, x.opt)
				if !errors.Is(err, tc.want) {
					t.Errorf("Forward: error %v, want one wrapping %q", err, tc.want)
				}
			}
			_, err := b.Backward(x.q, x.k, x.v, x.o, x.lse, x.dO, x.opt)
			if !errors.Is(err, tc.want) {
				t.Errorf("Backward: error %v, want one wrapping %q", err, tc.want)
			}
		})
	}
	// The base inputs themselves are valid: the failures above are the
	// mutations' doing.
	t.Run("valid base", func(t *testing.T) {
		for _, x := range []in{base(), packed()} {
			if _, err := b.Forward(x.q, x.k, x.v, x.opt); err != nil {
				t.Errorf("Forward: %v", err)
			}
			if _, err := b.Backward(x.q, x.k, x.v, x.o, x.lse, x.dO, x.opt); err != nil {
				t.Errorf("Backward: %v", err)
			}
		}
	})
}
