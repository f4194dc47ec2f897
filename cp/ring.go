package cp

import (
	"context"
	"fmt"

	"github.com/flashattn/flashattn/attn"
)

// kvPair is one K/V block in flight: contiguous [B, m, Hkv, DK] and
// [B, m, Hkv, DV] tensors.
type kvPair struct{ k, v attn.Tensor }

// newKV returns zero-filled K/V buffers shaped like k and v.
func newKV(k, v attn.Tensor) (kvPair, error) {
	kb, err := attn.NewChecked(k.DType, k.Shape...)
	if err != nil {
		return kvPair{}, err
	}
	vb, err := attn.NewChecked(v.DType, v.Shape...)
	return kvPair{kb, vb}, err
}

// ring holds what the steps of one ring call share.
type ring struct {
	a      *Attention
	gp     *attn.Problem
	p, r   int
	qs     []chunk // this rank's query chunks
	kchunk int     // keys per chunk
}

func (a *Attention) newRing(lp, gp *attn.Problem) *ring {
	p, r := a.Transport.Size(), a.Transport.Rank()
	c := a.Layout.numChunks(p)
	return &ring{a: a, gp: gp, p: p, r: r, qs: chunksFor(a.Layout, p, r, gp.N/c), kchunk: gp.M / c}
}

// owner returns the rank whose K/V block this rank holds at step s.
func (g *ring) owner(s int) int { return (g.r - s + g.p) % g.p }

// tasks returns the backend calls of step s.
func (g *ring) tasks(s int) ([]task, error) {
	if g.gp.Varlen {
		return packedTasks(g.gp, g.a.Layout, g.p, g.r, g.owner(s))
	}
	return plan(g.gp, g.qs, chunksFor(g.a.Layout, g.p, g.owner(s), g.kchunk))
}

// exchange sends the given buffers to the next rank of the ring and fills
// the receive buffers from the previous one, as one group.
func (g *ring) exchange(ctx context.Context, send, recv [][]byte) error {
	next, prev := (g.r+1)%g.p, (g.r+g.p-1)%g.p
	sends, recvs := make([]Send, len(send)), make([]Recv, len(recv))
	for i := range send {
		sends[i] = Send{Peer: next, Data: send[i]}
	}
	for i := range recv {
		recvs[i] = Recv{Peer: prev, Data: recv[i]}
	}
	return g.a.Transport.Exchange(ctx, sends, recvs)
}

// start starts one grouped exchange of send to the next rank and recv from
// the previous one while the caller computes; the returned function waits
// for it. The send buffers are only read meanwhile.
func (g *ring) start(ctx context.Context, send, recv [][]byte) func() error {
	done := make(chan error, 1)
	go func() { done <- g.exchange(ctx, send, recv) }()
	return func() error { return <-done }
}

// carry is what travels the ring one step behind the K/V blocks (the
// backward's dK/dV): send(s), when not nil, goes to the next rank and
// recv(s) is filled from the previous one by the exchange in flight
// during step s, and fold(s) runs once that exchange has completed.
type carry struct {
	bufs func(s int) (send, recv []byte)
	fold func(s int)
}

// steps runs the P steps of a ring: at step s it calls work for each task
// of the step with the K/V block of rank owner(s), while one grouped
// exchange sends that block on to the next rank and receives the next
// one (and, with c, c's buffers of step s); once the exchange has
// completed it calls c.fold(s). On an error it aborts the group before
// waiting for the exchange in flight, so that the exchange cannot wait
// forever.
func (g *ring) steps(ctx context.Context, k, v attn.Tensor, work func(t task, kv kvPair) error, c *carry) error {
	cur, err := newKV(k, v)
	if err != nil {
		return err
	}
	if err := attn.CopyInto(cur.k, k); err != nil {
		return err
	}
	if err := attn.CopyInto(cur.v, v); err != nil {
		return err
	}
	next := kvPair{}
	if g.p > 1 {
		if next, err = newKV(k, v); err != nil {
			return err
		}
	}
	for s := range g.p {
		var send, recv [][]byte
		if s < g.p-1 {
			send, recv = [][]byte{bytesOf(cur.k), bytesOf(cur.v)}, [][]byte{bytesOf(next.k), bytesOf(next.v)}
		}
		if c != nil {
			if cs, cr := c.bufs(s); cs != nil {
				send, recv = append(send, cs), append(recv, cr)
			}
		}
		wait := func() error { return nil }
		if len(send) > 0 {
			wait = g.start(ctx, send, recv)
		}
		if err := g.step(s, cur, work); err != nil {
			g.a.Transport.Abort(err)
			wait()
			return fmt.Errorf("cp: rank %d, ring step %d: %w", g.r, s, err)
		}
		if err := wait(); err != nil {
			return err
		}
		if c != nil {
			c.fold(s)
		}
		cur, next = next, cur
	}
	return nil
}

// step calls work for each task of step s.
func (g *ring) step(s int, kv kvPair, work func(t task, kv kvPair) error) error {
	tasks, err := g.tasks(s)
	if err != nil {
		return err
	}
	for _, t := range tasks {
		if err := work(t, kv); err != nil {
			return err
		}
	}
	return nil
}

// ringForward runs the ring forward: the partial results of every step's
// blocks merge into a float32 accumulator, rounded to q's dtype once.
func (a *Attention) ringForward(ctx context.Context, lp, gp *attn.Problem, q, k, v attn.Tensor) (attn.Result, error) {
	g := a.newRing(lp, gp)
	acc := newAccum(lp.B, lp.N, lp.H, lp.DV)
	err := g.steps(ctx, k, v, func(t task, kv kvPair) error {
		res, err := a.Backend.Forward(narrow(q, 1, t.q0, t.nq), narrow(kv.k, 1, t.k0, t.nk), narrow(kv.v, 1, t.k0, t.nk),
			taskOptions(gp, t))
		if err == nil {
			acc.merge(res, t.q0)
		}
		return err
	}, nil)
	if err != nil {
		return attn.Result{}, err
	}
	return acc.result(q.DType)
}

// ringBackward runs the ring backward. K/V travel the ring again; each
// block's backward uses the final O and LSE, so that it recomputes the
// exact probabilities and Delta = rowsum(dO∘O) of the whole problem, and
// returns that block's exact share of the gradients. dQ accumulates here;
// dK and dV accumulate in float32 buffers that travel the ring one step
// behind their block, in the exchange that carries the next K/V block, so
// that they cross the link while the next block computes: at step s the
// rank computes its block's gradients while the buffer holding the
// block's sum so far arrives, then adds them to it, call by call in the
// order of the step's plan; the buffer reaches its owner one hop after
// the last step. The order of the float32 sums of every element is thus
// fixed by the plan alone: the owner's calls of step 0, then those of
// each next rank in ring order.
func (a *Attention) ringBackward(ctx context.Context, lp, gp *attn.Problem, q, k, v, o, lse, dO attn.Tensor) (attn.Gradients, error) {
	g := a.newRing(lp, gp)
	dq := make([]float32, lp.B*lp.N*lp.H*lp.DK)
	nk, nv := lp.B*lp.M*lp.Hkv*lp.DK, lp.B*lp.M*lp.Hkv*lp.DV
	// dkv[s%2] is the buffer of step s's block: zero at step 0, received
	// from the previous rank at later steps while step s computes.
	dkv := [2][]float32{make([]float32, nk+nv), make([]float32, nk+nv)}
	type share struct {
		k0     int
		dk, dv attn.Tensor
	}
	var pending []share // the step's dK/dV, added once its buffer is here
	c := &carry{
		bufs: func(s int) (send, recv []byte) {
			if s == 0 {
				return nil, nil
			}
			return f32Bytes(dkv[(s-1)%2]), f32Bytes(dkv[s%2])
		},
		fold: func(s int) {
			acc := dkv[s%2]
			for _, x := range pending {
				addRows(acc[:nk], lp.M, x.k0, x.dk)
				addRows(acc[nk:], lp.M, x.k0, x.dv)
			}
			pending = pending[:0]
		},
	}
	err := g.steps(ctx, k, v, func(t task, kv kvPair) error {
		gr, err := a.Backend.Backward(narrow(q, 1, t.q0, t.nq), narrow(kv.k, 1, t.k0, t.nk), narrow(kv.v, 1, t.k0, t.nk),
			narrow(o, 1, t.q0, t.nq), narrow(lse, 2, t.q0, t.nq), narrow(dO, 1, t.q0, t.nq), taskOptions(gp, t))
		if err != nil {
			return err
		}
		addRows(dq, lp.N, t.q0, gr.DQ)
		pending = append(pending, share{t.k0, gr.DK, gr.DV})
		return nil
	}, c)
	if err != nil {
		return attn.Gradients{}, err
	}
	final := dkv[(g.p-1)%2]
	if g.p > 1 {
		// The last hop: the buffers of the last step go to their owners.
		final = dkv[g.p%2]
		if err := g.exchange(ctx, [][]byte{f32Bytes(dkv[(g.p-1)%2])}, [][]byte{f32Bytes(final)}); err != nil {
			return attn.Gradients{}, fmt.Errorf("cp: rank %d, dK/dV to their owner: %w", g.r, err)
		}
	}
	dt := q.DType
	return attn.Gradients{
		DQ: attn.FromFloat32(dt, dq, q.Shape...),
		DK: attn.FromFloat32(dt, final[:nk], k.Shape...),
		DV: attn.FromFloat32(dt, final[nk:], v.Shape...),
	}, nil
}
