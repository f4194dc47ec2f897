package cp

import (
	"context"
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
// float64 oracle ref (accuracyError) and reports a failure through t.
func within(t *testing.T, name string, dt attn.DType, factor float64, got, ref, naive []float64) {
	t.Helper()
	if err := accuracyError(name, dt, factor, got, ref, naive); err != nil {
		t.Error(err)
	}
}

// accuracyError applies FlashAttention's accuracy criterion to got
// against the float64 oracle ref: for float32 a relative error below
// 1e-5, otherwise at most factor times the error of the naive computation
// in dt plus one unit roundoff of the reference's scale. LSE values of
// −inf must match exactly and are left out of the error.
func accuracyError(name string, dt attn.DType, factor float64, got, ref, naive []float64) error {
	if len(got) != len(ref) {
		return fmt.Errorf("%s: %d elements, want %d", name, len(got), len(ref))
	}
	var g, r, n []float64
	for i := range ref {
		if math.IsInf(ref[i], -1) || math.IsInf(got[i], -1) {
			if ref[i] != got[i] {
				return fmt.Errorf("%s[%d] = %v, oracle %v", name, i, got[i], ref[i])
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
		return fmt.Errorf("%s: max error %.3g at %d (got %v, oracle %v) exceeds the bound %.3g", name, e, at, g[at], r[at], bound)
	}
	return nil
}

// oracle holds the float64 oracle's outputs and gradients of one problem
// and, for a dtype other than float32, those of the naive computation in
// it (empty for float32, whose criterion needs none).
type oracle struct {
	ref, naive   *cpu.RefOutput
	refG, naiveG *cpu.RefGrads
}

// newOracle computes the oracle of q, k, v and dO under opt in dt.
func newOracle(t *testing.T, dt attn.DType, q, k, v, dO attn.Tensor, opt attn.Options) oracle {
	t.Helper()
	o := oracle{naive: &cpu.RefOutput{}, naiveG: &cpu.RefGrads{}}
	var err error
	if o.ref, err = cpu.Reference(q, k, v, opt); err == nil {
		o.refG, err = cpu.ReferenceBackward(q, k, v, dO, opt)
	}
	if err == nil && dt != attn.Float32 {
		if o.naive, err = cpu.NaiveForward(dt, q, k, v, opt); err == nil {
			o.naiveG, err = cpu.NaiveBackward(dt, q, k, v, dO, opt)
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	return o
}

// errs applies the accuracy criterion (accuracyError; factor 2 for the
// outputs, 3 for the gradients) to outputs and gradients computed in dt,
// named what, and returns the failures joined.
func (o oracle) errs(what string, dt attn.DType, res attn.Result, g attn.Gradients) error {
	return errors.Join(accuracyError(what+" O", dt, 2, res.O.Float64s(), o.ref.O, o.naive.O),
		accuracyError(what+" LSE", dt, 2, res.LSE.Float64s(), o.ref.LSE, o.naive.LSE),
		accuracyError(what+" dQ", dt, 3, g.DQ.Float64s(), o.refG.DQ, o.naiveG.DQ),
		accuracyError(what+" dK", dt, 3, g.DK.Float64s(), o.refG.DK, o.naiveG.DK),
		accuracyError(what+" dV", dt, 3, g.DV.Float64s(), o.refG.DV, o.naiveG.DV))
}

// check reports the failures of errs through t.
func (o oracle) check(t *testing.T, what string, dt attn.DType, res attn.Result, g attn.Gradients) {
	t.Helper()
	if err := o.errs(what, dt, res, g); err != nil {
		t.Error(err)
	}
}

// accCase is one global problem of the accuracy table.
type accCase struct {
	name            string
	b, n, m, h, hkv int
	dk, dv          int
	opt             attn.Options
}

// variant is one way of running a problem with context parallelism:
// on the device (Sim.OnDevice) or on in-process ranks.
type variant struct {
	scheme   Scheme
	layout   Layout
	onDevice bool
}

func (v variant) String() string {
	s := fmt.Sprintf("%v-%v", v.scheme, v.layout)
	if v.scheme == Ring && v.layout == Zigzag {
		s = "zigzag"
	}
	if v.onDevice {
		s += "-device"
	}
	return s
}

var (
	ranks    = []int{1, 2, 3, 4, 6, 8}
	variants = []variant{{Ring, Contiguous, false}, {Ring, Zigzag, false}, {AllToAll, Contiguous, false}, {AllToAll, Zigzag, false},
		{Hybrid, Zigzag, false}, {Hybrid, Contiguous, false}}
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
		{"dropout-causal", 2, 48, 48, 4, 4, 16, 16, attn.Options{Causal: true, Dropout: 0.2, Seed: 7, Offset: 3}},
		{"dropout-placed-window-gqa", 1, 48, 96, 8, 8, 8, 16, attn.Options{Window: &attn.Window{Left: 20, Right: 2},
			Dropout: 0.3, Seed: 11, DropoutAt: &attn.DropoutOrigin{Query: 5, Key: 3, Head: 2, Heads: 12}}},
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
	checkSplits(t, dt, q, k, v, dO, tc.opt, ranks)
}

// checkSplits runs q, k, v and dO (global inputs in dt, padded or packed)
// through every variant on each number of ranks and compares outputs and
// gradients with the float64 oracle; all-to-all beyond the key heads must
// be refused with attn.ErrUnsupported.
func checkSplits(t *testing.T, dt attn.DType, q, k, v, dO attn.Tensor, opt attn.Options, ranks []int) {
	t.Helper()
	checkSplitsOn(t, cpu.New(), variants, dt, q, k, v, dO, opt, ranks)
}

// checkSplitsOn is checkSplits on backend b (shared by the ranks) and the
// variants vs.
func checkSplitsOn(t *testing.T, b attn.Backend, vs []variant, dt attn.DType, q, k, v, dO attn.Tensor, opt attn.Options, ranks []int) {
	t.Helper()
	hkv := k.Shape[k.Rank()-2]
	or := newOracle(t, dt, q, k, v, dO, opt)
	ref, refG, naive, naiveG := or.ref, or.refG, or.naive, or.naiveG
	for _, vr := range vs {
		for _, p := range ranks {
			t.Run(fmt.Sprintf("%v/P=%d", vr, p), func(t *testing.T) {
				sim := &Sim{Backend: b, P: p, Layout: vr.layout, Scheme: vr.scheme, Timeout: testTimeout, OnDevice: vr.onDevice}
				res, err := sim.Forward(q, k, v, opt)
				if vr.scheme == Hybrid && opt.CuSeqlensQ != nil {
					if !errors.Is(err, attn.ErrUnsupported) {
						t.Fatalf("hybrid on a packed batch: error %v, want ErrUnsupported", err)
					}
					return
				}
				if vr.scheme == AllToAll && hkv%p != 0 {
					if !errors.Is(err, attn.ErrUnsupported) {
						t.Fatalf("all-to-all with %d key heads on %d ranks: error %v, want ErrUnsupported", hkv, p, err)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				within(t, "O", dt, 2, res.O.Float64s(), ref.O, naive.O)
				within(t, "LSE", dt, 2, res.LSE.Float64s(), ref.LSE, naive.LSE)
				g, err := sim.Backward(q, k, v, res.O, res.LSE, dO, opt)
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

func TestRefused(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	q, k, v := normal(r, attn.Float32, 1, 48, 2, 8), normal(r, attn.Float32, 1, 48, 2, 8), normal(r, attn.Float32, 1, 48, 2, 8)
	odd := normal(r, attn.Float32, 1, 50, 2, 8)
	bias := attn.Bias{Tensor: normal(r, attn.Float32, 1, 1, 48, 48)}
	packed := normal(r, attn.Float32, 48, 2, 8)
	cu := []int32{0, 20, 48}
	for _, tc := range []struct {
		name    string
		sim     Sim
		q, k, v attn.Tensor
		opt     attn.Options
		want    error
	}{
		{"contiguous uneven", Sim{P: 4}, odd, odd, odd, attn.Options{}, attn.ErrShape},
		{"zigzag uneven", Sim{P: 5, Layout: Zigzag}, q, k, v, attn.Options{}, attn.ErrShape},
		{"zigzag uneven keys", Sim{P: 2, Layout: Zigzag}, q, odd, odd, attn.Options{}, attn.ErrShape},
		{"all-to-all beyond the key heads", Sim{P: 4, Scheme: AllToAll}, q, k, v, attn.Options{}, attn.ErrUnsupported},
		{"bias", Sim{P: 2}, q, k, v, attn.Options{Bias: &bias}, attn.ErrUnsupported},
		{"dropout origin out of range", Sim{P: 2}, q, k, v, attn.Options{Dropout: 0.1, DropoutAt: &attn.DropoutOrigin{Head: 1, Heads: 2}}, attn.ErrOption},
		{"varlen uneven", Sim{P: 3}, packed, packed, packed, attn.Options{CuSeqlensQ: cu, CuSeqlensK: cu}, attn.ErrShape},
		{"varlen bias", Sim{P: 2}, packed, packed, packed, attn.Options{CuSeqlensQ: cu, CuSeqlensK: cu, Bias: &bias}, attn.ErrUnsupported},
		{"no ranks", Sim{P: 0}, q, k, v, attn.Options{}, attn.ErrOption},
		{"bad layout", Sim{P: 2, Layout: 9}, q, k, v, attn.Options{}, attn.ErrOption},
		{"bad scheme", Sim{P: 2, Scheme: 9}, q, k, v, attn.Options{}, attn.ErrOption},
		{"bad shapes", Sim{P: 2}, q, normal(r, attn.Float32, 1, 48, 2, 4), v, attn.Options{}, attn.ErrShape},
		{"on device, not CUDA", Sim{P: 2, OnDevice: true}, q, k, v, attn.Options{}, attn.ErrUnsupported},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.sim.Backend, tc.sim.Timeout = cpu.New(), testTimeout
			_, err := tc.sim.Forward(tc.q, tc.k, tc.v, tc.opt)
			if !errors.Is(err, tc.want) {
				t.Errorf("Forward: error %v, want one wrapping %v", err, tc.want)
			}
			o := normal(r, attn.Float32, tc.q.Shape...)
			lse := normal(r, attn.Float32, 1, 2, tc.q.Shape[1])
			_, err = tc.sim.Backward(tc.q, tc.k, tc.v, o, lse, o, tc.opt)
			if !errors.Is(err, tc.want) {
				t.Errorf("Backward: error %v, want one wrapping %v", err, tc.want)
			}
		})
	}
}

// failing is a backend that fails on its call number failAt (counted from
// 0) and otherwise defers to the CPU backend.
type failing struct {
	failAt, calls int
}

var errBackend = errors.New("backend failed")

func (f *failing) Name() string { return "failing" }

func (f *failing) fail() error {
	f.calls++
	if f.calls-1 == f.failAt {
		return errBackend
	}
	return nil
}

func (f *failing) Forward(q, k, v attn.Tensor, opt attn.Options) (attn.Result, error) {
	if err := f.fail(); err != nil {
		return attn.Result{}, err
	}
	return cpu.New().Forward(q, k, v, opt)
}

func (f *failing) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	if err := f.fail(); err != nil {
		return attn.Gradients{}, err
	}
	return cpu.New().Backward(q, k, v, o, lse, dO, opt)
}

// TestRankErrorPropagates checks that when one rank fails (its backend, or
// its inputs) the others return errors wrapping ErrAborted instead of
// waiting for it.
func TestRankErrorPropagates(t *testing.T) {
	const p = 4
	r := rand.New(rand.NewPCG(5, 6))
	shape := []int{1, 12, 4, 8}
	q, k, v, o, dO := normal(r, attn.Float32, shape...), normal(r, attn.Float32, shape...), normal(r, attn.Float32, shape...),
		normal(r, attn.Float32, shape...), normal(r, attn.Float32, shape...)
	lse := normal(r, attn.Float32, 1, 4, 12)
	for _, scheme := range []Scheme{Ring, AllToAll} {
		for _, backward := range []bool{false, true} {
			for _, failAt := range []int{-1, 0, 2} { // -1: rank 1's inputs are malformed
				if scheme == AllToAll && failAt > 0 {
					continue // one backend call per rank
				}
				name := fmt.Sprintf("%v/backward=%v/fail-at=%d", scheme, backward, failAt)
				t.Run(name, func(t *testing.T) {
					ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
					defer cancel()
					errs := make([]error, p)
					err := Run(ctx, p, func(ctx context.Context, tr Transport) error {
						a := &Attention{Backend: cpu.New(), Transport: tr, Layout: Zigzag, Scheme: scheme}
						myQ := q
						if tr.Rank() == 1 {
							if failAt < 0 {
								myQ = normal(r, attn.Float32, 1, 12, 4, 7)
							} else {
								a.Backend = &failing{failAt: failAt}
							}
						}
						var err error
						if backward {
							_, err = a.Backward(ctx, myQ, k, v, o, lse, dO, attn.Options{Causal: true})
						} else {
							_, err = a.Forward(ctx, myQ, k, v, attn.Options{Causal: true})
						}
						errs[tr.Rank()] = err
						return err
					})
					if ctx.Err() != nil {
						t.Fatalf("the ranks waited until the test's deadline: %v", err)
					}
					want := errBackend
					if failAt < 0 {
						want = attn.ErrShape
					}
					if !errors.Is(err, want) {
						t.Fatalf("Run: %v, want an error wrapping %v", err, want)
					}
					for rank, e := range errs {
						if rank != 1 && e != nil && !errors.Is(e, ErrAborted) {
							t.Errorf("rank %d: %v does not wrap ErrAborted", rank, e)
						}
					}
				})
			}
		}
	}
}
