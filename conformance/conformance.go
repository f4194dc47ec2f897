package conformance

import (
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
)

// Config selects what Run covers. Tolerances are not configurable: they
// follow the accuracy criterion of the package documentation.
type Config struct {
	// DTypes lists the element types to test; nil means fp32, fp16 and bf16.
	DTypes []attn.DType
	// Short runs a quick subset: small shapes, a few of each feature, and
	// fewer repeats.
	Short bool
	// AllowUnsupported lets the backend answer attn.ErrUnsupported for a
	// valid case; the case is then skipped with the backend's message.
	// Otherwise ErrUnsupported fails the case.
	AllowUnsupported bool
}

func (c Config) dtypes() []attn.DType {
	if c.DTypes == nil {
		return []attn.DType{attn.Float32, attn.Float16, attn.BFloat16}
	}
	return c.DTypes
}

// Run runs the whole suite against backend b as subtests of t.
func Run(t *testing.T, b attn.Backend, cfg Config) {
	t.Run("accuracy", func(t *testing.T) {
		for _, tc := range cases() {
			if cfg.Short && !tc.short {
				continue
			}
			t.Run(tc.name, func(t *testing.T) {
				for _, dt := range cfg.dtypes() {
					if tc.dtypes != nil && !slices.Contains(tc.dtypes, dt) {
						continue
					}
					t.Run(dt.String(), func(t *testing.T) { tc.check(t, b, dt, cfg) })
				}
			})
		}
	})
	t.Run("dropout-fraction", func(t *testing.T) {
		for _, dt := range cfg.dtypes() {
			t.Run(dt.String(), func(t *testing.T) { dropoutFraction(t, b, dt, cfg) })
		}
	})
	t.Run("nan", func(t *testing.T) {
		for _, dt := range cfg.dtypes() {
			t.Run(dt.String(), func(t *testing.T) { nanPropagation(t, b, dt, cfg) })
		}
	})
	t.Run("repeat", func(t *testing.T) {
		for _, dt := range cfg.dtypes() {
			t.Run(dt.String(), func(t *testing.T) { repeatBitIdentical(t, b, dt, cfg) })
		}
	})
	t.Run("errors", func(t *testing.T) { badInputs(t, b) })
}

// testCase is one attention problem of the accuracy table.
type testCase struct {
	name            string
	b, n, m, h, hkv int
	dk, dv          int
	seqQ, seqK      []int // segment lengths of a packed batch (b, n, m unused)
	lay             layout
	opt             attn.Options // without Bias
	biasB, biasH    int          // bias shape [biasB, biasH, N, M]; 0: no bias
	biasGrad        bool
	short           bool         // part of the Short subset
	dtypes          []attn.DType // the dtypes it runs in (nil: every dtype of the Config)
}

func cases() []testCase {
	bias := func(tc testCase, bb, bh int, grad bool) testCase {
		tc.biasB, tc.biasH, tc.biasGrad = bb, bh, grad
		return tc
	}
	tl, br := attn.AlignTopLeft, attn.AlignBottomRight
	cs := []testCase{
		{name: "basic", b: 2, n: 64, m: 64, h: 4, hkv: 4, dk: 64, dv: 64, short: true},
		{name: "seqlen-1", b: 2, n: 1, m: 1, h: 2, hkv: 1, dk: 32, dv: 32, short: true},
		{name: "seqlen-3", b: 2, n: 3, m: 3, h: 2, hkv: 2, dk: 16, dv: 16, opt: attn.Options{Causal: true}},
		{name: "113x203", b: 1, n: 113, m: 203, h: 2, hkv: 1, dk: 64, dv: 64, short: true},
		{name: "203x113-causal", b: 1, n: 203, m: 113, h: 2, hkv: 2, dk: 64, dv: 64, opt: attn.Options{Causal: true}},
		{name: "1023x1024", b: 1, n: 1023, m: 1024, h: 1, hkv: 1, dk: 32, dv: 32},
		{name: "1024x1023-causal", b: 1, n: 1024, m: 1023, h: 1, hkv: 1, dk: 32, dv: 32, opt: attn.Options{Causal: true, Align: tl}},
		{name: "dk1", b: 1, n: 37, m: 41, h: 2, hkv: 2, dk: 1, dv: 1, short: true},
		{name: "dk59", b: 1, n: 65, m: 70, h: 2, hkv: 1, dk: 59, dv: 59},
		{name: "dk111", b: 1, n: 70, m: 65, h: 2, hkv: 2, dk: 111, dv: 111},
		{name: "dk127", b: 1, n: 66, m: 66, h: 2, hkv: 1, dk: 127, dv: 127, opt: attn.Options{Causal: true}},
		{name: "dk199", b: 1, n: 40, m: 72, h: 2, hkv: 2, dk: 199, dv: 199},
		{name: "dk257", b: 1, n: 65, m: 33, h: 1, hkv: 1, dk: 257, dv: 257, short: true},
		{name: "dk512", b: 1, n: 70, m: 70, h: 2, hkv: 1, dk: 512, dv: 512},
		{name: "dk40-dv72", b: 2, n: 50, m: 90, h: 2, hkv: 2, dk: 40, dv: 72, short: true},
		{name: "dk128-dv24", b: 1, n: 90, m: 50, h: 2, hkv: 1, dk: 128, dv: 24, opt: attn.Options{Causal: true}},
		{name: "dk3-dv512", b: 1, n: 20, m: 30, h: 1, hkv: 1, dk: 3, dv: 512},
		{name: "gqa-6:1", b: 1, n: 80, m: 80, h: 6, hkv: 1, dk: 32, dv: 32, opt: attn.Options{Causal: true}, short: true},
		{name: "gqa-6:2", b: 2, n: 70, m: 130, h: 6, hkv: 2, dk: 24, dv: 40},
		{name: "gqa-8:1", b: 1, n: 130, m: 70, h: 8, hkv: 1, dk: 16, dv: 16, opt: attn.Options{Causal: true, Align: tl}},
		{name: "causal-n>m-bottom-right", b: 1, n: 150, m: 70, h: 2, hkv: 1, dk: 32, dv: 32, opt: attn.Options{Causal: true, Align: br}, short: true},
		{name: "causal-n>m-top-left", b: 1, n: 150, m: 70, h: 2, hkv: 1, dk: 32, dv: 32, opt: attn.Options{Causal: true, Align: tl}},
		{name: "causal-n<m-bottom-right", b: 1, n: 70, m: 150, h: 2, hkv: 2, dk: 32, dv: 32, opt: attn.Options{Causal: true, Align: br}},
		{name: "causal-n<m-top-left", b: 1, n: 70, m: 150, h: 2, hkv: 2, dk: 32, dv: 32, opt: attn.Options{Causal: true, Align: tl}, short: true},
		{name: "window", b: 1, n: 150, m: 150, h: 2, hkv: 1, dk: 32, dv: 32, opt: attn.Options{Window: &attn.Window{Left: 16, Right: 8}}, short: true},
		{name: "window-left-only-n>m", b: 1, n: 180, m: 100, h: 2, hkv: 2, dk: 32, dv: 32, opt: attn.Options{Window: &attn.Window{Left: 20, Right: -1}}},
		{name: "window-right-only-top-left", b: 1, n: 100, m: 180, h: 2, hkv: 2, dk: 32, dv: 32, opt: attn.Options{Window: &attn.Window{Left: -1, Right: 30}, Align: tl}},
		{name: "window+causal-n>m", b: 1, n: 200, m: 120, h: 2, hkv: 1, dk: 32, dv: 32, opt: attn.Options{Causal: true, Window: &attn.Window{Left: 40, Right: 10}}},
		{name: "window-0-0", b: 1, n: 70, m: 70, h: 1, hkv: 1, dk: 16, dv: 16, opt: attn.Options{Window: &attn.Window{Left: 0, Right: 0}}},
		{name: "window-maxint-right-n>m", b: 1, n: 90, m: 60, h: 2, hkv: 1, dk: 32, dv: 32, opt: attn.Options{Window: &attn.Window{Left: 0, Right: math.MaxInt}}, short: true},
		{name: "window-maxint-both-causal-top-left", b: 1, n: 60, m: 90, h: 2, hkv: 2, dk: 32, dv: 32,
			opt: attn.Options{Causal: true, Window: &attn.Window{Left: math.MaxInt, Right: math.MaxInt}, Align: tl}},
		{name: "window-maxint-both", b: 1, n: 70, m: 70, h: 1, hkv: 1, dk: 16, dv: 16, opt: attn.Options{Window: &attn.Window{Left: math.MaxInt, Right: math.MaxInt}}},
		{name: "varlen-window-maxint-left", h: 2, hkv: 1, dk: 16, dv: 16, seqQ: []int{20, 0, 70}, seqK: []int{30, 5, 50},
			opt: attn.Options{Window: &attn.Window{Left: math.MaxInt - 1, Right: 3}}},
		{name: "all-masked-top-rows", b: 2, n: 100, m: 30, h: 2, hkv: 1, dk: 16, dv: 24, opt: attn.Options{Causal: true}, short: true},
		{name: "softcap", b: 1, n: 90, m: 90, h: 2, hkv: 2, dk: 64, dv: 64, opt: attn.Options{Softcap: 2, Scale: 0.5}, short: true},
		{name: "softcap-causal-gqa", b: 1, n: 70, m: 100, h: 4, hkv: 2, dk: 48, dv: 48, opt: attn.Options{Softcap: 30, Scale: 1, Causal: true}},
		bias(testCase{name: "bias-full", b: 2, n: 70, m: 90, h: 2, hkv: 1, dk: 32, dv: 32, short: true}, 2, 2, true),
		bias(testCase{name: "bias-batch-broadcast", b: 2, n: 70, m: 90, h: 4, hkv: 2, dk: 32, dv: 32}, 1, 4, true),
		bias(testCase{name: "bias-head-broadcast", b: 2, n: 90, m: 70, h: 4, hkv: 2, dk: 32, dv: 32, opt: attn.Options{Causal: true}}, 2, 1, true),
		bias(testCase{name: "bias-full-broadcast", b: 2, n: 70, m: 70, h: 3, hkv: 1, dk: 32, dv: 32, short: true}, 1, 1, true),
		bias(testCase{name: "bias-no-grad", b: 1, n: 70, m: 70, h: 2, hkv: 2, dk: 32, dv: 32}, 1, 2, false),
		bias(testCase{name: "bias+softcap+window", b: 1, n: 80, m: 80, h: 2, hkv: 1, dk: 32, dv: 32,
			opt: attn.Options{Softcap: 3, Window: &attn.Window{Left: 10, Right: 10}}}, 1, 2, true),
		{name: "dropout", b: 2, n: 90, m: 90, h: 2, hkv: 2, dk: 32, dv: 32, opt: attn.Options{Dropout: 0.1, Seed: 42, Offset: 3}, short: true},
		{name: "dropout-causal-gqa", b: 1, n: 100, m: 130, h: 4, hkv: 1, dk: 40, dv: 24, opt: attn.Options{Dropout: 0.3, Seed: 1<<40 + 7, Causal: true}},
		bias(testCase{name: "dropout+bias+softcap", b: 2, n: 60, m: 70, h: 2, hkv: 1, dk: 32, dv: 32,
			opt: attn.Options{Dropout: 0.2, Seed: 9, Softcap: 5}}, 1, 1, true),
		{name: "varlen", h: 4, hkv: 2, dk: 32, dv: 32, seqQ: []int{5, 0, 17, 90, 1, 64}, seqK: []int{7, 3, 0, 80, 1, 64}, short: true},
		{name: "varlen-causal-dropout", h: 2, hkv: 1, dk: 40, dv: 48, seqQ: []int{70, 0, 3, 130}, seqK: []int{50, 0, 9, 130},
			opt: attn.Options{Causal: true, Dropout: 0.15, Seed: 5}},
		{name: "varlen-window-top-left", h: 3, hkv: 3, dk: 16, dv: 16, seqQ: []int{0, 100, 33}, seqK: []int{10, 60, 0},
			opt: attn.Options{Window: &attn.Window{Left: 8, Right: 4}, Align: tl}},
		{name: "strided-bhnd", b: 2, n: 70, m: 90, h: 4, hkv: 2, dk: 32, dv: 40, lay: headsMajor, opt: attn.Options{Causal: true}, short: true},
		{name: "strided-gapped", b: 2, n: 40, m: 50, h: 2, hkv: 1, dk: 24, dv: 16, lay: gapped, short: true},
		bias(testCase{name: "strided-gapped-bias-softcap", b: 2, n: 40, m: 50, h: 2, hkv: 2, dk: 24, dv: 16, lay: gapped,
			opt: attn.Options{Softcap: 4, Causal: true}}, 2, 1, true),
		{name: "strided-varlen", h: 2, hkv: 1, dk: 16, dv: 24, seqQ: []int{30, 0, 45}, seqK: []int{20, 5, 45}, lay: headsMajor},
		{name: "strided-varlen-gapped", h: 2, hkv: 2, dk: 16, dv: 24, seqQ: []int{30, 45}, seqK: []int{60, 45}, lay: gapped,
			opt: attn.Options{Causal: true}},
	}
	return append(cs, randomCases(randomCount, randomSeed, randomShort)...)
}

// shapes returns the shapes of q, k, v and dO of tc and its options
// without the bias (the cu_seqlens of a packed batch set).
func (tc testCase) shapes() (qs, ks, vs, os []int, opt attn.Options) {
	opt = tc.opt
	qs, ks, vs, os = []int{tc.b, tc.n, tc.h, tc.dk}, []int{tc.b, tc.m, tc.hkv, tc.dk}, []int{tc.b, tc.m, tc.hkv, tc.dv}, []int{tc.b, tc.n, tc.h, tc.dv}
	if tc.seqQ != nil {
		opt.CuSeqlensQ, opt.CuSeqlensK = cumulative(tc.seqQ), cumulative(tc.seqK)
		tq, tk := int(opt.CuSeqlensQ[len(tc.seqQ)]), int(opt.CuSeqlensK[len(tc.seqK)])
		qs, ks, vs, os = []int{tq, tc.h, tc.dk}, []int{tk, tc.hkv, tc.dk}, []int{tk, tc.hkv, tc.dv}, []int{tq, tc.h, tc.dv}
	}
	return qs, ks, vs, os, opt
}

// inputs builds the tensors and options of tc in dtype dt.
func (tc testCase) inputs(dt attn.DType) (q, k, v, dO attn.Tensor, opt attn.Options) {
	h := fnv.New64a()
	h.Write([]byte(tc.name))
	r := rand.New(rand.NewPCG(h.Sum64(), uint64(dt)+1))
	qs, ks, vs, os, opt := tc.shapes()
	q = randTensor(r, dt, tc.lay, 1, qs...)
	k = randTensor(r, dt, tc.lay, 1, ks...)
	v = randTensor(r, dt, tc.lay, 1, vs...)
	dO = randTensor(r, dt, tc.lay, 1, os...)
	if tc.biasB > 0 {
		opt.Bias = &attn.Bias{Tensor: randTensor(r, dt, tc.lay, 1, tc.biasB, tc.biasH, tc.n, tc.m), RequiresGrad: tc.biasGrad}
	}
	return q, k, v, dO, opt
}

// unsupported reports whether err is ErrUnsupported and the config allows
// it, skipping the test in that case.
func unsupported(t *testing.T, err error, cfg Config) {
	t.Helper()
	if errors.Is(err, attn.ErrUnsupported) && cfg.AllowUnsupported {
		t.Skipf("backend: %v", err)
	}
}

// forwardWithReference runs the backend's forward and the float64 oracle's
// on q, k, v with opt; it skips an unsupported case when cfg allows and
// fails the test on any other error.
func forwardWithReference(t *testing.T, b attn.Backend, cfg Config, q, k, v attn.Tensor, opt attn.Options) (attn.Result, *cpu.RefOutput) {
	t.Helper()
	res, err := b.Forward(q, k, v, opt)
	if err != nil {
		unsupported(t, err, cfg)
		t.Fatalf("Forward: %v", err)
	}
	ref, err := cpu.Reference(q, k, v, opt)
	if err != nil {
		t.Fatalf("Reference: %v", err)
	}
	return res, ref
}

// check runs one case in one dtype: forward and backward against the oracle.
func (tc testCase) check(t *testing.T, b attn.Backend, dt attn.DType, cfg Config) {
	q, k, v, dO, opt := tc.inputs(dt)
	inputs := []attn.Tensor{q, k, v, dO}
	if opt.Bias != nil {
		inputs = append(inputs, opt.Bias.Tensor)
	}
	before := snapshot(inputs)
	defer func() {
		if !sameStorage(before, snapshot(inputs)) {
			t.Errorf("the backend modified its inputs (or the gaps between their elements)")
		}
	}()
	res, ref := forwardWithReference(t, b, cfg, q, k, v, opt)
	var naive *cpu.RefOutput
	if dt != attn.Float32 {
		var err error
		if naive, err = cpu.NaiveForward(dt, q, k, v, opt); err != nil {
			t.Fatalf("NaiveForward: %v", err)
		}
	}
	p := ref.Problem
	checkTensor(t, "O", res.O, dt, p.OutputShape())
	checkTensor(t, "LSE", res.LSE, attn.Float32, p.LSEShape())
	if t.Failed() {
		return
	}
	o := res.O.Float64s()
	lse := res.LSE.Float64s()
	compare(t, "O", dt, 2, o, ref.O, naiveOf(naive, func(n *cpu.RefOutput) []float64 { return n.O }))
	compareLSE(t, dt, lse, ref.LSE, naiveOf(naive, func(n *cpu.RefOutput) []float64 { return n.LSE }))
	masked := maskedRows(p, ref.LSE)
	checkMaskedRows(t, "O", p, masked, o, p.DV)

	g, err := b.Backward(q, k, v, res.O, res.LSE, dO, opt)
	if err != nil {
		unsupported(t, err, cfg)
		t.Fatalf("Backward: %v", err)
	}
	refG, err := cpu.ReferenceBackward(q, k, v, dO, opt)
	if err != nil {
		t.Fatalf("ReferenceBackward: %v", err)
	}
	var naiveG *cpu.RefGrads
	if dt != attn.Float32 {
		if naiveG, err = cpu.NaiveBackward(dt, q, k, v, dO, opt); err != nil {
			t.Fatalf("NaiveBackward: %v", err)
		}
	}
	ng := func(f func(*cpu.RefGrads) []float64) []float64 {
		if naiveG == nil {
			return nil
		}
		return f(naiveG)
	}
	checkTensor(t, "dQ", g.DQ, dt, q.Shape)
	checkTensor(t, "dK", g.DK, dt, k.Shape)
	checkTensor(t, "dV", g.DV, dt, v.Shape)
	wantDBias := opt.Bias != nil && opt.Bias.RequiresGrad
	switch {
	case wantDBias && g.DBias == nil:
		t.Errorf("dBias missing although the bias requires its gradient")
	case !wantDBias && g.DBias != nil:
		t.Errorf("dBias returned although no bias gradient was asked for")
	case wantDBias:
		checkTensor(t, "dBias", *g.DBias, opt.Bias.Tensor.DType, opt.Bias.Tensor.Shape)
	}
	if t.Failed() {
		return
	}
	dq := g.DQ.Float64s()
	compare(t, "dQ", dt, 3, dq, refG.DQ, ng(func(n *cpu.RefGrads) []float64 { return n.DQ }))
	compare(t, "dK", dt, 3, g.DK.Float64s(), refG.DK, ng(func(n *cpu.RefGrads) []float64 { return n.DK }))
	compare(t, "dV", dt, 3, g.DV.Float64s(), refG.DV, ng(func(n *cpu.RefGrads) []float64 { return n.DV }))
	if wantDBias {
		compare(t, "dBias", dt, 3, g.DBias.Float64s(), refG.DBias, ng(func(n *cpu.RefGrads) []float64 { return n.DBias }))
	}
	checkMaskedRows(t, "dQ", p, masked, dq, p.DK)
}

func naiveOf(n *cpu.RefOutput, f func(*cpu.RefOutput) []float64) []float64 {
	if n == nil {
		return nil
	}
	return f(n)
}

// checkTensor checks dtype, shape and that every element is finite.
func checkTensor(t *testing.T, name string, x attn.Tensor, dt attn.DType, shape []int) {
	t.Helper()
	if x.DType != dt {
		t.Errorf("%s dtype %v, want %v", name, x.DType, dt)
		return
	}
	if fmt.Sprint(x.Shape) != fmt.Sprint(shape) {
		t.Errorf("%s shape %v, want %v", name, x.Shape, shape)
		return
	}
	if err := x.CheckLayout(name); err != nil {
		t.Errorf("%s: %v", name, err)
		return
	}
	for i, v := range x.Float64s() {
		if math.IsNaN(v) || (math.IsInf(v, 0) && !(name == "LSE" && math.IsInf(v, -1))) {
			t.Errorf("%s[%d] = %v: not written or not finite", name, i, v)
			return
		}
	}
}

// UnitRoundoff returns the unit roundoff u of dt: 2^-11 for fp16, 2^-8 for
// bf16, 2^-24 for fp32. The accuracy criterion adds u·max(1, max|ref|) to its
// bound.
func UnitRoundoff(dt attn.DType) float64 {
	switch dt {
	case attn.Float16:
		return 1.0 / (1 << 11)
	case attn.BFloat16:
		return 1.0 / (1 << 8)
	}
	return 1.0 / (1 << 24)
}

// MaxError returns the largest |a[i]-b[i]| (NaN when any difference is NaN)
// and its index, and the largest |b[i]|: the error of a result a against
// the reference b, and the reference's magnitude.
func MaxError(a, b []float64) (e float64, at int, mag float64) {
	for i := range a {
		if d := math.Abs(a[i] - b[i]); d > e || math.IsNaN(d) {
			e, at = d, i
		}
		mag = max(mag, math.Abs(b[i]))
	}
	return e, at, mag
}

// compare applies the accuracy criterion to got against the oracle ref;
// naive is the naive baseline (nil for fp32).
func compare(t *testing.T, name string, dt attn.DType, factor float64, got, ref, naive []float64) {
	t.Helper()
	if len(got) != len(ref) {
		t.Errorf("%s: %d elements, want %d", name, len(got), len(ref))
		return
	}
	e, at, mag := MaxError(got, ref)
	scale := max(mag, 1) // the inputs are standard normal: 1 is their scale
	var bound float64
	if dt == attn.Float32 {
		bound = 1e-5 * scale
	} else {
		ne, _, _ := MaxError(naive, ref)
		bound = factor*ne + UnitRoundoff(dt)*scale
	}
	if !(e <= bound) {
		t.Errorf("%s: max error %.3g at %d (got %v, oracle %v) exceeds the bound %.3g (max |oracle| %.3g)",
			name, e, at, got[at], ref[at], bound, mag)
	}
}

// compareLSE checks the LSE: -Inf exactly where the oracle has it, and the
// finite values within the criterion.
func compareLSE(t *testing.T, dt attn.DType, got, ref, naive []float64) {
	t.Helper()
	var g, r, n []float64
	for i := range ref {
		if math.IsInf(ref[i], -1) != math.IsInf(got[i], -1) {
			t.Errorf("LSE[%d] = %v, oracle %v", i, got[i], ref[i])
			return
		}
		if !math.IsInf(ref[i], -1) {
			g, r = append(g, got[i]), append(r, ref[i])
			if naive != nil {
				n = append(n, naive[i])
			}
		}
	}
	e, at, mag := MaxError(g, r)
	bound := 1e-5 * max(1, mag)
	if naive != nil {
		ne, _, _ := MaxError(n, r)
		bound = max(bound, 2*ne)
	}
	if !(e <= bound) {
		t.Errorf("LSE: max error %.3g (got %v, oracle %v) exceeds the bound %.3g", e, g[at], r[at], bound)
	}
}

// maskedRows returns, for every (row, head) of the output layout, whether the
// row sees no key, from the oracle's LSE.
func maskedRows(p *attn.Problem, lse []float64) []bool {
	rows := attn.NumElements(p.OutputShape()) / p.DV // [rows·H]
	m := make([]bool, rows)
	for b := 0; b < p.B; b++ {
		q0, n, _, _ := p.Segment(b)
		for h := 0; h < p.H; h++ {
			for i := 0; i < n; i++ {
				var li, oi int
				if p.Varlen {
					li, oi = h*p.TotalQ+q0+i, (q0+i)*p.H+h
				} else {
					li, oi = (b*p.H+h)*p.N+i, (b*p.N+i)*p.H+h
				}
				m[oi] = math.IsInf(lse[li], -1)
			}
		}
	}
	return m
}

// checkMaskedRows checks that rows that see no key are exactly zero in x
// (O or dQ, with head dimension d).
func checkMaskedRows(t *testing.T, name string, p *attn.Problem, masked []bool, x []float64, d int) {
	t.Helper()
	for r, m := range masked {
		if !m {
			continue
		}
		for _, v := range x[r*d : (r+1)*d] {
			if v != 0 {
				t.Errorf("%s: row %d sees no key but holds %v, want 0", name, r, v)
				return
			}
		}
	}
}

// snapshot returns the bit patterns of the whole storage of each tensor,
// gaps included.
func snapshot(ts []attn.Tensor) [][]uint32 {
	out := make([][]uint32, len(ts))
	for i, t := range ts {
		if t.DType == attn.Float32 {
			for _, x := range t.F32 {
				out[i] = append(out[i], math.Float32bits(x))
			}
			continue
		}
		for _, x := range t.Bits {
			out[i] = append(out[i], uint32(x))
		}
	}
	return out
}

func sameStorage(a, b [][]uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if len(a[i]) != len(b[i]) {
			return false
		}
		for j := range a[i] {
			if a[i][j] != b[i][j] {
				return false
			}
		}
	}
	return true
}
