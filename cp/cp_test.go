package cp

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/conformance"
	"github.com/flashattn/flashattn/cpu"
)

// normal returns a tensor of dt and shape with standard normal elements.
func normal(r *rand.Rand, dt attn.DType, shape ...int) attn.Tensor {
	x := make([]float32, attn.NumElements(shape))
	for i := range x {
		x[i] = float32(r.NormFloat64())
	}
	return attn.FromFloat32(dt, x, shape...)
}

// within applies FlashAttention's accuracy criterion to got against the
// float64 oracle ref: for float32 a relative error below 1e-5, otherwise
// at most factor times the error of the naive computation in dt plus one
// unit roundoff of the reference's scale. LSE values of −inf must match
// exactly and are left out of the error.
func within(t *testing.T, name string, dt attn.DType, factor float64, got, ref, naive []float64) {
	t.Helper()
	if len(got) != len(ref) {
		t.Errorf("%s: %d elements, want %d", name, len(got), len(ref))
		return
	}
	var g, r, n []float64
	for i := range ref {
		if math.IsInf(ref[i], -1) || math.IsInf(got[i], -1) {
			if ref[i] != got[i] {
				t.Errorf("%s[%d] = %v, oracle %v", name, i, got[i], ref[i])
				return
			}
			continue
		}
		g, r = append(g, got[i]), append(r, ref[i])
		if naive != nil {
			n = append(n, naive[i])
		}
	}
	e, at, mag := conformance.MaxError(g, r)
	bound := 1e-5 * max(1, mag)
	if dt != attn.Float32 {
		ne, _, _ := conformance.MaxError(n, r)
		bound = factor*ne + conformance.UnitRoundoff(dt)*max(1, mag)
	}
	if !(e <= bound) {
		t.Errorf("%s: max error %.3g at %d (got %v, oracle %v) exceeds the bound %.3g", name, e, at, g[at], r[at], bound)
	}
}

// accCase is one global problem of the accuracy table.
type accCase struct {
	name            string
	b, n, m, h, hkv int
	dk, dv          int
	opt             attn.Options
}

// variant is one way of running a problem with context parallelism.
type variant struct {
	scheme Scheme
	layout Layout
}

func (v variant) String() string {
	if v.scheme == Ring && v.layout == Zigzag {
		return "zigzag"
	}
	return fmt.Sprintf("%v-%v", v.scheme, v.layout)
}

var (
	ranks    = []int{1, 2, 3, 4, 8}
	variants = []variant{{Ring, Contiguous}, {Ring, Zigzag}, {AllToAll, Contiguous}, {AllToAll, Zigzag}}
	// Lengths are multiples of 48 = 3·16, so that every P here and its 2P
	// zigzag chunks divide them.
	accCases = []accCase{
		{"full", 2, 48, 48, 4, 4, 16, 16, attn.Options{}},
		{"causal-top-left-gqa", 1, 48, 48, 4, 2, 16, 16, attn.Options{Causal: true, Align: attn.AlignTopLeft}},
		{"causal-bottom-right-n<m-dk!=dv", 1, 48, 96, 4, 4, 8, 16, attn.Options{Causal: true}},
		{"causal-bottom-right-n>m-gqa3", 1, 96, 48, 6, 2, 16, 8, attn.Options{Causal: true}},
		{"causal-top-left-n>m", 1, 96, 48, 2, 2, 16, 16, attn.Options{Causal: true, Align: attn.AlignTopLeft}},
		{"window-mqa", 1, 48, 48, 4, 1, 16, 16, attn.Options{Window: &attn.Window{Left: 5, Right: 3}}},
		{"causal-window-softcap", 1, 48, 96, 2, 2, 16, 16, attn.Options{Causal: true, Window: &attn.Window{Left: 7, Right: -1}, Softcap: 5}},
		{"causal-24-heads", 1, 48, 48, 24, 24, 8, 8, attn.Options{Causal: true, Align: attn.AlignTopLeft}},
	}
)

// TestMatchesSingleDevice checks that every scheme and layout on P
// in-process ranks gives outputs and gradients equal to the single-device
// oracle within the accuracy criterion.
func TestMatchesSingleDevice(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, tc := range accCases {
		t.Run(tc.name, func(t *testing.T) {
			for _, dt := range []attn.DType{attn.Float32, attn.BFloat16} {
				t.Run(dt.String(), func(t *testing.T) { checkCase(t, r, tc, dt) })
			}
		})
	}
}

func checkCase(t *testing.T, r *rand.Rand, tc accCase, dt attn.DType) {
	q := normal(r, dt, tc.b, tc.n, tc.h, tc.dk)
	k := normal(r, dt, tc.b, tc.m, tc.hkv, tc.dk)
	v := normal(r, dt, tc.b, tc.m, tc.hkv, tc.dv)
	dO := normal(r, dt, tc.b, tc.n, tc.h, tc.dv)
	ref, err := cpu.Reference(q, k, v, tc.opt)
	if err != nil {
		t.Fatal(err)
	}
	refG, err := cpu.ReferenceBackward(q, k, v, dO, tc.opt)
	if err != nil {
		t.Fatal(err)
	}
	naive, naiveG := &cpu.RefOutput{}, &cpu.RefGrads{}
	if dt != attn.Float32 {
		if naive, err = cpu.NaiveForward(dt, q, k, v, tc.opt); err != nil {
			t.Fatal(err)
		}
		if naiveG, err = cpu.NaiveBackward(dt, q, k, v, dO, tc.opt); err != nil {
			t.Fatal(err)
		}
	}
	for _, vr := range variants {
		for _, p := range ranks {
			t.Run(fmt.Sprintf("%v/P=%d", vr, p), func(t *testing.T) {
				sim := &Sim{Backend: cpu.New(), P: p, Layout: vr.layout, Scheme: vr.scheme, Timeout: testTimeout}
				res, err := sim.Forward(q, k, v, tc.opt)
				if vr.scheme == AllToAll && tc.hkv%p != 0 {
					if !errors.Is(err, attn.ErrUnsupported) {
						t.Fatalf("all-to-all with %d key heads on %d ranks: error %v, want ErrUnsupported", tc.hkv, p, err)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				within(t, "O", dt, 2, res.O.Float64s(), ref.O, naive.O)
				within(t, "LSE", dt, 2, res.LSE.Float64s(), ref.LSE, naive.LSE)
				g, err := sim.Backward(q, k, v, res.O, res.LSE, dO, tc.opt)
				if err != nil {
					t.Fatal(err)
				}
				within(t, "dQ", dt, 3, g.DQ.Float64s(), refG.DQ, naiveG.DQ)
				within(t, "dK", dt, 3, g.DK.Float64s(), refG.DK, naiveG.DK)
				within(t, "dV", dt, 3, g.DV.Float64s(), refG.DV, naiveG.DV)
			})
		}
	}
}
