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

// overlapWait is how long a dK/dV exchange waits for its rank's backend
// to run a call, and a step's first call for its step's exchange to
// start, before each gives up: long enough for any scheduler, reached only
// when the ring waits for the exchange before it computes.
const overlapWait = 10 * time.Second

// slowLink is one rank's transport. Each exchange that sends a message of
// gradLen bytes (the dK/dV buffer), but the last hop to the owner (the
// steps-th), is held until the rank's backend runs a call (one running
// already, or one that starts), and whether that happened is recorded: an
// exchange can then only complete alongside a computation, whatever the
// machine's load.
type slowLink struct {
	Transport
	be         *stamped
	gradLen    int
	steps      int
	overlapped []bool
}

// Exchange holds a dK/dV exchange as described and then runs it.
func (l *slowLink) Exchange(ctx context.Context, sends []Send, recvs []Recv) error {
	l.be.exchangeEntered()
	if slices.ContainsFunc(sends, func(s Send) bool { return len(s.Data) == l.gradLen }) && len(l.overlapped) < l.steps-1 {
		l.overlapped = append(l.overlapped, l.be.busyOrStarts(overlapWait))
	}
	return l.Transport.Exchange(ctx, sends, recvs)
}

// stamped is one rank's backend that tracks its running backward calls
// and meets its link: the first call of each ring step (a call on the
// other K/V buffer than the call before) waits until the step's exchange
// has started. The ring starts that exchange before the step computes,
// but its goroutine may run only after the step's calls have all ended on
// a loaded machine; the wait makes the exchange and the step's first call
// meet whatever the scheduling.
type stamped struct {
	attn.Backend
	mu      sync.Mutex
	active  int
	started chan struct{} // closed (and replaced) when a call starts
	step    int           // the ring step of the last call, from 0
	lastKV  *float32      // the K buffer of the last call
	entered int           // exchanges started so far
	entry   chan struct{} // closed (and replaced) when an exchange starts
}

func newStamped(b attn.Backend) *stamped {
	return &stamped{Backend: b, started: make(chan struct{}), step: -1, entry: make(chan struct{})}
}

// exchangeEntered records that an exchange has started.
func (b *stamped) exchangeEntered() {
	b.mu.Lock()
	b.entered++
	close(b.entry)
	b.entry = make(chan struct{})
	b.mu.Unlock()
}

// Backward runs one call, counted as running while it runs; the first
// call of a step first waits (at most overlapWait) for the step's
// exchange to start.
func (b *stamped) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	b.mu.Lock()
	b.active++
	close(b.started)
	b.started = make(chan struct{})
	if kv := &k.F32[0]; kv != b.lastKV {
		b.lastKV = kv
		b.step++
	}
	timeout := time.After(overlapWait)
	for b.entered <= b.step {
		entry := b.entry
		b.mu.Unlock()
		select {
		case <-entry:
		case <-timeout:
			b.mu.Lock()
			b.entered = b.step + 1 // give up on this step's exchange
			continue
		}
		b.mu.Lock()
	}
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		b.active--
		b.mu.Unlock()
	}()
	return b.Backend.Backward(q, k, v, o, lse, dO, opt)
}

// busyOrStarts reports whether a call is running now or one starts within d.
func (b *stamped) busyOrStarts(d time.Duration) bool {
	b.mu.Lock()
	if b.active > 0 {
		b.mu.Unlock()
		return true
	}
	ch := b.started
	b.mu.Unlock()
	select {
	case <-ch:
		return true
	case <-time.After(d):
		return false
	}
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
// holds each dK/dV exchange but the last hop until the rank's backend runs
// a call, every such exchange finds one (a ring that waited for the
// exchange before computing would not), and the gradients equal those over
// the plain in-process transport bit for bit.
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
				backends[rank] = newStamped(be)
				links[rank] = &slowLink{Transport: tr, be: backends[rank], gradLen: gradLen, steps: tc.p}
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
				if len(l.overlapped) != tc.p-1 {
					t.Fatalf("rank %d sent dK/dV in %d exchanges before the last hop, want %d (one per step after the first)", rank, len(l.overlapped), tc.p-1)
				}
				for s, ok := range l.overlapped {
					if !ok {
						t.Errorf("rank %d: the dK/dV exchange of step %d ran with no backend call of the rank (waited %v)", rank, s+1, overlapWait)
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
				dks[owner] = attn.FromFloat32(tc.dt, acc[:nk], ko.Shape...)
				dvs[owner] = attn.FromFloat32(tc.dt, acc[nk:], vo.Shape...)
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
