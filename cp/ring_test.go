package cp

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
)

// interval is a time interval of one rank's activity.
type interval struct{ from, to time.Time }

// overlaps reports whether two intervals share a moment.
func (s interval) overlaps(o interval) bool { return s.from.Before(o.to) && o.from.Before(s.to) }

// slowLink is one rank's transport that holds every exchange for delay
// and records when each exchange that sends a message of gradLen bytes
// (the dK/dV buffer) ran.
type slowLink struct {
	Transport
	delay   time.Duration
	gradLen int
	mu      sync.Mutex
	grads   []interval
}

// Exchange delays the exchange and records it.
func (l *slowLink) Exchange(ctx context.Context, sends []Send, recvs []Recv) error {
	from := time.Now()
	time.Sleep(l.delay)
	err := l.Transport.Exchange(ctx, sends, recvs)
	if slices.ContainsFunc(sends, func(s Send) bool { return len(s.Data) == l.gradLen }) {
		l.mu.Lock()
		l.grads = append(l.grads, interval{from, time.Now()})
		l.mu.Unlock()
	}
	return err
}

// stamped is one rank's backend that records when each backward call ran,
// each lasting at least hold.
type stamped struct {
	attn.Backend
	hold  time.Duration
	calls []interval
}

// Backward runs and records one call.
func (b *stamped) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	from := time.Now()
	g, err := b.Backend.Backward(q, k, v, o, lse, dO, opt)
	time.Sleep(b.hold)
	b.calls = append(b.calls, interval{from, time.Now()})
	return g, err
}

// simPass runs the forward and the backward of one problem through sim.
func simPass(t *testing.T, sim *Sim, q, k, v, dO attn.Tensor, opt attn.Options) (attn.Result, attn.Gradients) {
	t.Helper()
	sim.Timeout = testTimeout
	res, err := sim.Forward(q, k, v, opt)
	var g attn.Gradients
	if err == nil {
		g, err = sim.Backward(q, k, v, res.O, res.LSE, dO, opt)
	}
	if err != nil {
		t.Fatal(err)
	}
	return res, g
}

// ringCase is one problem of the ring backward's tests: strategy s on p
// ranks, b×n queries and keys of h query and hkv key heads of dim 8.
type ringCase struct {
	name         string
	s            Strategy
	p            int
	dt           attn.DType
	b, n, h, hkv int
	opt          attn.Options
}

// TestRingBackwardOverlapsGradients checks that the ring backward sends
// each step's dK/dV while the next step's blocks compute: with a link that
// holds every exchange, each dK/dV exchange but the last hop overlaps a
// backend call of the same rank, and the gradients equal those over the
// plain in-process transport bit for bit.
func TestRingBackwardOverlapsGradients(t *testing.T) {
	r := rand.New(rand.NewPCG(31, 32))
	for _, tc := range []ringCase{
		{"ring-full", RingStrategy, 3, attn.Float32, 1, 48, 2, 2, attn.Options{}},
		{"zigzag-causal", ZigzagStrategy, 4, attn.Float32, 1, 48, 2, 2, attn.Options{Causal: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const d = 8
			b, n, h := tc.b, tc.n, tc.h
			q, k, v, dO := normal(r, tc.dt, b, n, h, d), normal(r, tc.dt, b, n, h, d),
				normal(r, tc.dt, b, n, h, d), normal(r, tc.dt, b, n, h, d)
			sim := tc.s.Sim(cpu.New(), tc.p)
			res, want := simPass(t, sim, q, k, v, dO, tc.opt)
			links, backends := make([]*slowLink, tc.p), make([]*stamped, tc.p)
			sim.wrap = func(rank int, be attn.Backend, tr Transport) (attn.Backend, Transport) {
				gradLen := 4 * b * n / tc.p * h * 2 * d // float32 dK and dV of one shard
				links[rank] = &slowLink{Transport: tr, delay: 20 * time.Millisecond, gradLen: gradLen}
				backends[rank] = &stamped{Backend: be, hold: 5 * time.Millisecond}
				return backends[rank], links[rank]
			}
			got, err := sim.Backward(q, k, v, res.O, res.LSE, dO, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			for i, pair := range [][2]attn.Tensor{{got.DQ, want.DQ}, {got.DK, want.DK}, {got.DV, want.DV}} {
				if !slices.Equal(pair[0].Float32s(), pair[1].Float32s()) {
					t.Errorf("%s differs from the run over the plain transport", []string{"dQ", "dK", "dV"}[i])
				}
			}
			for rank, l := range links {
				if len(l.grads) != tc.p {
					t.Fatalf("rank %d sent dK/dV in %d exchanges, want %d (one per step after the first, and the last hop)", rank, len(l.grads), tc.p)
				}
				for s, ex := range l.grads[:tc.p-1] {
					if !slices.ContainsFunc(backends[rank].calls, ex.overlaps) {
						t.Errorf("rank %d: the dK/dV exchange of step %d overlaps none of the rank's %d backend calls", rank, s+1, len(backends[rank].calls))
					}
				}
			}
		})
	}
}

// TestRingBackwardSumOrder checks the order in which the ring backward
// sums dK and dV in float32: the gradients of each K/V block equal, bit
// for bit, the sum of the planned calls' gradients taken in ring order
// (the owner's calls of step 0, then those of each next rank at the next
// step, each step's calls in plan order), replayed here one call at a
// time.
func TestRingBackwardSumOrder(t *testing.T) {
	r := rand.New(rand.NewPCG(33, 34))
	for _, tc := range []ringCase{
		{"ring-full-f32", RingStrategy, 3, attn.Float32, 2, 48, 2, 2, attn.Options{}},
		{"zigzag-causal-gqa-bf16", ZigzagStrategy, 4, attn.BFloat16, 2, 48, 4, 2, attn.Options{Causal: true}},
		{"ring-window-dropout", RingStrategy, 4, attn.Float32, 2, 48, 2, 2,
			attn.Options{Window: &attn.Window{Left: 9, Right: 4}, Dropout: 0.2, Seed: 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const d = 8
			b := tc.b
			q, dO := normal(r, tc.dt, b, tc.n, tc.h, d), normal(r, tc.dt, b, tc.n, tc.h, d)
			k, v := normal(r, tc.dt, b, tc.n, tc.hkv, d), normal(r, tc.dt, b, tc.n, tc.hkv, d)
			be := cpu.New()
			res, got := simPass(t, tc.s.Sim(be, tc.p), q, k, v, dO, tc.opt)
			gp, err := attn.NewProblem(q, k, v, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			gp.ResolveMask()
			shard := func(x attn.Tensor, axis, rank int) attn.Tensor {
				sh, err := Shard(x, axis, tc.s.Layout, tc.p, rank)
				if err != nil {
					t.Fatal(err)
				}
				return sh
			}
			m := tc.n / tc.p
			nk := b * m * tc.hkv * d
			dks, dvs := make([]attn.Tensor, tc.p), make([]attn.Tensor, tc.p)
			for owner := range tc.p {
				acc := make([]float32, 2*nk)
				ko, vo := shard(k, 1, owner), shard(v, 1, owner)
				for s := range tc.p {
					rank := (owner + s) % tc.p
					tasks, err := layoutRing(tc.s.Layout, gp, tc.p, rank).tasks(s)
					if err != nil {
						t.Fatal(err)
					}
					qr, or, lr, dr := shard(q, 1, rank), shard(res.O, 1, rank), shard(res.LSE, 2, rank), shard(dO, 1, rank)
					for _, tk := range tasks {
						g, err := be.Backward(narrow(qr, 1, tk.q0, tk.nq), narrow(ko, 1, tk.k0, tk.nk), narrow(vo, 1, tk.k0, tk.nk),
							narrow(or, 1, tk.q0, tk.nq), narrow(lr, 2, tk.q0, tk.nq), narrow(dr, 1, tk.q0, tk.nq), taskOptions(gp, tk))
						if err != nil {
							t.Fatal(err)
						}
						addRows(acc[:nk], m, tk.k0, g.DK)
						addRows(acc[nk:], m, tk.k0, g.DV)
					}
				}
				if dks[owner], err = fromF32(tc.dt, acc[:nk], ko.Shape...); err != nil {
					t.Fatal(err)
				}
				if dvs[owner], err = fromF32(tc.dt, acc[nk:], vo.Shape...); err != nil {
					t.Fatal(err)
				}
			}
			for i, pair := range []struct {
				got    attn.Tensor
				shards []attn.Tensor
			}{{got.DK, dks}, {got.DV, dvs}} {
				want, err := Unshard(pair.shards, 1, tc.s.Layout)
				if err != nil {
					t.Fatal(err)
				}
				g, w := pair.got.Float32s(), want.Float32s()
				for j := range g {
					if g[j] != w[j] {
						t.Errorf("%s[%d] = %v, the replayed sum gives %v", []string{"dK", "dV"}[i], j, g[j], w[j])
						break
					}
				}
			}
		})
	}
}
