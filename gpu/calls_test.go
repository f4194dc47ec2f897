package gpu

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// counted runs f with the validation and plan counters on and returns the
// counts.
func counted(f func() error) (validations, plans int64, err error) {
	c := &callCounts{}
	callCounter.Store(c)
	defer callCounter.Store(nil)
	err = f()
	return c.validations.Load(), c.plans.Load(), err
}

// TestCallsValidateAndPlanOnce counts the validations of the arguments and
// the plans of the launches of every entry of the forward and the
// backward, host and device forms, allocating and Into forms, with and
// without staging copies (D = 64: none; D = 59: the host path's and
// DeviceOptions.Staging's): one of each per call.
func TestCallsValidateAndPlanOnce(t *testing.T) {
	b := fwdBackend(t)
	s := testStream(t, b.dev)
	for _, d := range []int{64, 59} {
		t.Run(fmt.Sprintf("d%d", d), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(d), 3))
			const dt = attn.BFloat16
			const B, N, H = 1, 100, 16
			q, k, v, dO := randTensor(rng, dt, 1, B, N, H, d), randTensor(rng, dt, 1, B, N, H, d), randTensor(rng, dt, 1, B, N, H, d), randTensor(rng, dt, 1, B, N, H, d)
			opt := attn.Options{Causal: true}
			res, err := b.Forward(q, k, v, opt)
			if err != nil {
				t.Fatal(err)
			}
			tb := newTestBufs(t, b)
			dq, dk, dv, ddO := tb.upload(q), tb.upload(k), tb.upload(v), tb.upload(dO)
			o, lse := tb.alloc(dt, B, N, H, d), tb.alloc(attn.Float32, B, H, N)
			gq, gk, gv := tb.alloc(dt, B, N, H, d), tb.alloc(dt, B, N, H, d), tb.alloc(dt, B, N, H, d)
			dopt := DeviceOptions{Options: opt}
			need, err := b.PrepareForward(dq, dk, dv, o, lse, dopt)
			if err != nil {
				t.Fatal(err)
			}
			staged := dopt
			if need > 0 {
				staged.Staging = tb.alloc(attn.Float32, int(need+3)/4).Buf
			}
			_, wsBytes, err := b.PrepareBackward(dq, dk, dv, o, lse, ddO, gq, gk, gv, BackwardOptions{DeviceOptions: dopt})
			if err != nil {
				t.Fatal(err)
			}
			bopt := BackwardOptions{DeviceOptions: dopt, Workspace: tb.alloc(attn.Float32, int(wsBytes+3)/4).Buf}
			calls := []struct {
				name string
				f    func() error
			}{
				{"Forward", func() error { _, err := b.Forward(q, k, v, opt); return err }},
				{"ForwardInto", func() error {
					return b.ForwardInto(q, k, v, attn.Result{O: attn.New(dt, res.O.Shape...), LSE: attn.New(attn.Float32, res.LSE.Shape...)}, opt)
				}},
				{"Backward", func() error { _, err := b.Backward(q, k, v, res.O, res.LSE, dO, opt); return err }},
				{"BackwardInto", func() error {
					g := attn.Gradients{DQ: attn.New(dt, q.Shape...), DK: attn.New(dt, k.Shape...), DV: attn.New(dt, v.Shape...)}
					return b.BackwardInto(q, k, v, res.O, res.LSE, dO, g, opt)
				}},
				{"PrepareForward", func() error { _, err := b.PrepareForward(dq, dk, dv, o, lse, dopt); return err }},
				{"ForwardDevice", func() error { return b.ForwardDevice(s, dq, dk, dv, o, lse, dopt) }},
				{"ForwardDevice staged", func() error { return b.ForwardDevice(s, dq, dk, dv, o, lse, staged) }},
				{"Variant", func() error { _, err := b.Variant(dq, dk, dv, o, lse, staged); return err }},
				{"PrepareBackward", func() error {
					_, _, err := b.PrepareBackward(dq, dk, dv, o, lse, ddO, gq, gk, gv, bopt)
					return err
				}},
				{"BackwardDevice", func() error { _, err := b.BackwardDevice(s, dq, dk, dv, o, lse, ddO, gq, gk, gv, bopt); return err }},
			}
			for _, c := range calls {
				vs, ps, err := counted(c.f)
				if err != nil {
					t.Fatalf("%s: %v", c.name, err)
				}
				if vs != 1 || ps != 1 {
					t.Errorf("%s: %d validations and %d plans, want one of each", c.name, vs, ps)
				}
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
		})
	}
}
