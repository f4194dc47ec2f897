package cp

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/flashattn/flashattn/attn"
)

// Split is the measured cost of splitting one call over P in-process
// ranks on one device, where the ranks' backend calls run one after
// another: what each rank computed at each step and what it sent.
type Split struct {
	// Strategy, P and Backward say what was measured.
	Strategy Strategy
	P        int
	Backward bool
	// Steps[s][r] is the backend time of rank r at step s (a ring has P
	// steps, all-to-all one, hybrid R = P/A).
	Steps [][]time.Duration
	// Calls is the number of backend calls over all ranks.
	Calls int
	// Work is the backend time of all ranks together: the kernels a real
	// P-device run spreads over its devices.
	Work time.Duration
	// Critical is the sum over steps of the slowest rank's backend time:
	// the compute time of a P-device run whose communication is hidden.
	Critical time.Duration
	// Wall is the wall-clock time of the whole simulated call, merging,
	// copies and in-process communication included.
	Wall time.Duration
	// Sent[r] is the bytes rank r sent to other ranks, in Messages[r]
	// messages.
	Sent     []int64
	Messages []int
}

// StepTime returns Critical divided by the number of steps.
func (s Split) StepTime() time.Duration {
	if len(s.Steps) == 0 {
		return 0
	}
	return s.Critical / time.Duration(len(s.Steps))
}

// MaxSent returns the most bytes any rank sent.
func (s Split) MaxSent() int64 {
	if len(s.Sent) == 0 {
		return 0
	}
	return slices.Max(s.Sent)
}

// Add returns the split of two passes run one after the other (a forward
// and its backward): the steps, calls, times and bytes add up.
func (s Split) Add(o Split) Split {
	out := s
	out.Steps = append(slices.Clone(s.Steps), o.Steps...)
	out.Calls += o.Calls
	out.Work += o.Work
	out.Critical += o.Critical
	out.Wall += o.Wall
	out.Sent, out.Messages = slices.Clone(s.Sent), slices.Clone(s.Messages)
	for r := range min(len(out.Sent), len(o.Sent)) {
		out.Sent[r] += o.Sent[r]
		out.Messages[r] += o.Messages[r]
	}
	return out
}

// meter is one rank's backend in a measured split: it runs one call at a
// time across all ranks (mu is shared) and records each call's time.
type meter struct {
	b     attn.Backend
	mu    *sync.Mutex
	calls []time.Duration
}

// Name returns the metered backend's name.
func (m *meter) Name() string { return m.b.Name() }

// Forward times one forward call.
func (m *meter) Forward(q, k, v attn.Tensor, opt attn.Options) (attn.Result, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	t0 := time.Now()
	res, err := m.b.Forward(q, k, v, opt)
	m.calls = append(m.calls, time.Since(t0))
	return res, err
}

// Backward times one backward call.
func (m *meter) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	t0 := time.Now()
	g, err := m.b.Backward(q, k, v, o, lse, dO, opt)
	m.calls = append(m.calls, time.Since(t0))
	return g, err
}

// counted is one rank's transport in a measured split: it counts the bytes
// and messages it sends to other ranks. The ring sends from a goroutine of
// its own, hence the atomics. A sub-group split from it counts into it
// (root).
type counted struct {
	Transport
	sent, msgs atomic.Int64
	root       *counted // where the counts go; nil: here
}

// add counts n bytes in m messages.
func (c *counted) add(n, m int64) {
	if c.root != nil {
		c = c.root
	}
	c.sent.Add(n)
	c.msgs.Add(m)
}

// Exchange counts the sends to other ranks.
func (c *counted) Exchange(ctx context.Context, sends []Send, recvs []Recv) error {
	for _, s := range sends {
		if s.Peer != c.Rank() {
			c.add(int64(len(s.Data)), 1)
		}
	}
	return c.Transport.Exchange(ctx, sends, recvs)
}

// AllToAll counts the parts sent to other ranks.
func (c *counted) AllToAll(ctx context.Context, send, recv []byte) error {
	if p := c.Size(); p > 1 {
		c.add(int64(len(send)/p*(p-1)), int64(p-1))
	}
	return c.Transport.AllToAll(ctx, send, recv)
}

// AllGather counts a copy of send per other rank.
func (c *counted) AllGather(ctx context.Context, send, recv []byte) error {
	if p := c.Size(); p > 1 {
		c.add(int64(len(send)*(p-1)), int64(p-1))
	}
	return c.Transport.AllGather(ctx, send, recv)
}

// SplitGroup splits the counted transport's group; the sub-group counts
// into this one. The split's own exchange of colors is not counted: it
// happens once per communicator, not per call.
func (c *counted) SplitGroup(ctx context.Context, color, key int) (Transport, error) {
	sub, err := SplitGroup(ctx, c.Transport, color, key)
	if err != nil {
		return nil, err
	}
	root := c
	if c.root != nil {
		root = c.root
	}
	return &counted{Transport: sub, root: root}, nil
}

// MeasureSplit runs one call of strategy s over p in-process ranks on b
// (the forward of q, k, v, or with backward set the backward, which needs
// the forward's o and lse and dO) with every backend call timed and run
// one at a time, as on one device, and returns what it measured with the
// call's outputs (res for the forward, g for the backward). The problem
// must suit the strategy (Strategy.Check, or CheckPacked for a packed
// batch).
func MeasureSplit(b attn.Backend, s Strategy, p int, backward bool, q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (sp Split, res attn.Result, g attn.Gradients, err error) {
	if b == nil {
		return Split{}, res, g, attn.Errorf(attn.ErrOption, "cp: MeasureSplit needs a backend")
	}
	gp, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return Split{}, res, g, err
	}
	if gp.Varlen {
		err = s.CheckPacked(opt.CuSeqlensQ, opt.CuSeqlensK, gp.Hkv, p)
	} else {
		err = s.Check(gp.N, gp.M, gp.Hkv, p)
	}
	if err != nil {
		return Split{}, res, g, err
	}
	var mu sync.Mutex
	meters, trans := make([]*meter, p), make([]*counted, p)
	sim := s.Sim(b, p)
	sim.wrap = func(r int, b attn.Backend, t Transport) (attn.Backend, Transport) {
		meters[r], trans[r] = &meter{b: b, mu: &mu}, &counted{Transport: t}
		return meters[r], trans[r]
	}
	t0 := time.Now()
	if backward {
		g, err = sim.Backward(q, k, v, o, lse, dO, opt)
	} else {
		res, err = sim.Forward(q, k, v, opt)
	}
	wall := time.Since(t0)
	if err != nil {
		return Split{}, res, g, err
	}
	sp = Split{Strategy: s, P: p, Backward: backward, Wall: wall, Sent: make([]int64, p), Messages: make([]int, p)}
	if err := sp.attribute(gp, meters); err != nil {
		return Split{}, res, g, err
	}
	for r, t := range trans {
		sp.Sent[r], sp.Messages[r] = t.sent.Load(), int(t.msgs.Load())
	}
	return sp, res, g, nil
}

// attribute assigns each rank's call times to steps: a ring rank (and a
// hybrid rank, in its ring of groups) runs the planned calls of each step
// in order, an all-to-all rank one call.
func (sp *Split) attribute(gp *attn.Problem, meters []*meter) error {
	p := sp.P
	steps, _, _, err := sp.Strategy.ringPlace(gp.Hkv, p, 0)
	if err != nil {
		return err
	}
	sp.Steps = make([][]time.Duration, steps)
	for s := range sp.Steps {
		sp.Steps[s] = make([]time.Duration, p)
	}
	g := *gp
	g.ResolveMask()
	for r, m := range meters {
		if m == nil {
			return fmt.Errorf("cp: rank %d did not run", r)
		}
		calls := m.calls
		_, rp, rr, _ := sp.Strategy.ringPlace(gp.Hkv, p, r)
		for s := range steps {
			n := len(calls)
			if rp > 0 {
				tasks, err := layoutRing(sp.Strategy.Layout, &g, rp, rr).tasks(s)
				if err != nil {
					return err
				}
				n = len(tasks)
			}
			if n > len(calls) {
				return fmt.Errorf("cp: rank %d made %d backend calls, fewer than planned", r, len(m.calls))
			}
			for _, d := range calls[:n] {
				sp.Steps[s][r] += d
				sp.Work += d
			}
			sp.Calls += n
			calls = calls[n:]
		}
		if len(calls) > 0 {
			return fmt.Errorf("cp: rank %d made %d backend calls, more than planned", r, len(m.calls))
		}
	}
	for _, st := range sp.Steps {
		sp.Critical += slices.Max(st)
	}
	return nil
}
