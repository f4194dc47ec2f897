package cp

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
)

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
		{"dropout", Sim{P: 2}, q, k, v, attn.Options{Dropout: 0.1}, attn.ErrUnsupported},
		{"varlen", Sim{P: 2}, packed, packed, packed, attn.Options{CuSeqlensQ: cu, CuSeqlensK: cu}, attn.ErrUnsupported},
		{"no ranks", Sim{P: 0}, q, k, v, attn.Options{}, attn.ErrOption},
		{"bad layout", Sim{P: 2, Layout: 9}, q, k, v, attn.Options{}, attn.ErrOption},
		{"bad scheme", Sim{P: 2, Scheme: 9}, q, k, v, attn.Options{}, attn.ErrOption},
		{"bad shapes", Sim{P: 2}, q, normal(r, attn.Float32, 1, 48, 2, 4), v, attn.Options{}, attn.ErrShape},
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
