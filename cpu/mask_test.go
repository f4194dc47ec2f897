package cpu_test

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
)

// TestWindowSidesNearMaxInt checks that window sides up to MaxInt mean
// what they say: a side wider than the sequences is unbounded, so the
// forward and backward with such a window are bit-identical to those of
// the equivalent mask, on the fast backend and the float64 reference, and
// the two agree.
func TestWindowSidesNearMaxInt(t *testing.T) {
	const mx = math.MaxInt
	win := func(l, r int) *attn.Window { return &attn.Window{Left: l, Right: r} }
	tl, br := attn.AlignTopLeft, attn.AlignBottomRight
	tests := []struct {
		name      string
		opt, same attn.Options
	}{
		{"{0, MaxInt}", attn.Options{Window: win(0, mx)}, attn.Options{Window: win(0, -1)}},
		{"{MaxInt, MaxInt}", attn.Options{Window: win(mx, mx)}, attn.Options{}},
		{"{MaxInt, 0}", attn.Options{Window: win(mx, 0)}, attn.Options{Causal: true}},
		{"{MaxInt, 0} top-left", attn.Options{Window: win(mx, 0), Align: tl}, attn.Options{Causal: true, Align: tl}},
		{"{MaxInt-1, 3}", attn.Options{Window: win(mx-1, 3)}, attn.Options{Window: win(-1, 3)}},
		{"{2, MaxInt/2} top-left", attn.Options{Window: win(2, mx/2), Align: tl}, attn.Options{Window: win(2, -1), Align: tl}},
		{"causal {MaxInt, MaxInt}", attn.Options{Causal: true, Window: win(mx, mx), Align: br}, attn.Options{Causal: true}},
		{"causal {5, MaxInt} top-left", attn.Options{Causal: true, Window: win(5, mx), Align: tl}, attn.Options{Causal: true, Window: win(5, -1), Align: tl}},
	}
	r := rand.New(rand.NewPCG(20, 2))
	b := cpu.New()
	for _, sz := range [][2]int{{40, 70}, {70, 40}, {65, 65}} {
		n, m := sz[0], sz[1]
		q, k, v := randTensor(r, attn.Float32, 1, n, 2, 16), randTensor(r, attn.Float32, 1, m, 1, 16), randTensor(r, attn.Float32, 1, m, 1, 16)
		dO := randTensor(r, attn.Float32, 1, n, 2, 16)
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				res, g := forwardBackward(t, b, q, k, v, dO, tc.opt)
				want, wantG := forwardBackward(t, b, q, k, v, dO, tc.same)
				for _, x := range []struct {
					name      string
					got, want attn.Tensor
				}{{"O", res.O, want.O}, {"LSE", res.LSE, want.LSE}, {"dQ", g.DQ, wantG.DQ}, {"dK", g.DK, wantG.DK}, {"dV", g.DV, wantG.DV}} {
					if !bitsEqual(x.got, x.want) {
						t.Errorf("n=%d m=%d: %s differs from that of the equivalent mask", n, m, x.name)
					}
				}
				ref, err := cpu.Reference(q, k, v, tc.opt)
				if err != nil {
					t.Fatal(err)
				}
				refSame, err := cpu.Reference(q, k, v, tc.same)
				if err != nil {
					t.Fatal(err)
				}
				for i := range ref.LSE {
					if ref.LSE[i] != refSame.LSE[i] {
						t.Fatalf("n=%d m=%d: reference LSE[%d] = %v, %v with the equivalent mask", n, m, i, ref.LSE[i], refSame.LSE[i])
					}
				}
				if e := maxDiff(res.O.Float64s(), ref.O); !(e <= 1e-5) {
					t.Errorf("n=%d m=%d: O differs from the reference by %g", n, m, e)
				}
				if e := maxDiff(res.LSE.Float64s(), ref.LSE); !(e <= 1e-5) {
					t.Errorf("n=%d m=%d: LSE differs from the reference by %g", n, m, e)
				}
			})
		}
	}
}

// maxDiff returns the largest |a[i] − b[i]|, counting equal infinities as
// 0 and NaN as +Inf.
func maxDiff(a, b []float64) float64 {
	var e float64
	for i := range a {
		if a[i] == b[i] {
			continue
		}
		d := math.Abs(a[i] - b[i])
		if math.IsNaN(d) {
			return math.Inf(1)
		}
		e = max(e, d)
	}
	return e
}

// forwardBackward runs b's forward and backward on q, k, v and dO with opt,
// failing the test on an error.
func forwardBackward(t *testing.T, b attn.Backend, q, k, v, dO attn.Tensor, opt attn.Options) (attn.Result, attn.Gradients) {
	t.Helper()
	var g attn.Gradients
	res, err := b.Forward(q, k, v, opt)
	if err == nil {
		g, err = b.Backward(q, k, v, res.O, res.LSE, dO, opt)
	}
	if err != nil {
		t.Fatal(err)
	}
	return res, g
}
