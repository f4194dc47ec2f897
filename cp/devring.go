package cp

import (
	"fmt"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/gpu"
)

// The ring on one device. P virtual ranks share one device; each has a
// compute stream and a communication stream. At step s rank r runs the
// calls the host ring plans for that step (ring.tasks, through devPlan)
// on its compute stream against the K/V block it holds, while its
// communication stream copies the block its predecessor holds into r's
// other K/V buffer: the block of step s+1, device to device, overlapping
// the step. The forward writes every call's partial result into a slot
// of the rank's (devSplit) on the compute stream and combines the slots
// after the last step. The
// backward sends K/V round again; the float32 dK/dV accumulator of the
// block a rank holds travels with the block, one step behind it (the
// communication stream copies the predecessor's accumulator in while the
// step's first backward call computes), and reaches the block's owner
// one hop after the last step, so every element's sums run in the host
// ring's order: the owner's calls of step 0, then those of each next rank.
//
// Events order the streams, and only where a buffer passes from one to
// another (at step s, prev = r−1 and next = r+1 around the ring):
//
//   - a step's calls read a K/V buffer, and add into a travelling
//     accumulator, only after its copy landed (kvLanded(r, s),
//     accLanded(r, s)); a step without calls (its block wholly masked)
//     does not wait for its K/V, but still for its accumulator, which it
//     passes on as it came;
//   - a copy reads its source only after the source landed or was
//     finished (kvLanded(prev, s), computed(prev, s−1));
//   - a copy overwrites a buffer only after the calls that read it
//     (computed(r, s−1), when step s−1 had calls) and the copy that read
//     it on to the next rank (kvLanded(next, s), accLanded(next, s−1); the
//     latter waited for the adds into it) finished;
//   - a pass forks every stream from the origin stream (the one the
//     shards are written on) and joins them back, so that consecutive
//     passes, and what the origin does between them, are ordered.
//
// No other wait is needed: the tests check every wait against a schedule
// checker that leaves each out in turn. Each wait names an event recorded
// earlier in the same pass, which the ring checks, so that a pass also
// captures into one CUDA graph.

// streamID names a stream of streamOps; 0 is the origin stream, on which
// the devOps methods of streamOps itself enqueue.
type streamID int

// eventID names an event of streamOps.
type eventID int

// streamOps are devOps on several streams of one device, ordered by
// events: operations enqueued on one stream run in order, those of
// different streams may run at the same time.
type streamOps interface {
	devOps // enqueued on the origin stream (0)
	// newStream returns a new stream.
	newStream() (streamID, error)
	// newEvent returns a new event, for ordering only.
	newEvent() (eventID, error)
	// on returns the operations enqueued on stream s (alloc allocates as
	// the origin's does).
	on(s streamID) devOps
	// record enqueues event e on stream s: e completes once the work
	// enqueued on s before it has finished. Recording e again moves it.
	record(e eventID, s streamID) error
	// wait makes the work enqueued on s after the call wait until the
	// last record of e enqueued before the call has completed
	// (cuStreamWaitEvent; no record yet: no wait).
	wait(s streamID, e eventID) error
}

// evKind is what an event of the ring marks.
type evKind uint8

const (
	evStart     evKind = iota // a pass's start, on the origin stream
	evComputed                // rank r's calls (and adds) of step s, on its compute stream
	evKVLanded                // the K/V block of rank r's step s, copied in on its communication stream
	evAccLanded               // the dK/dV accumulator of rank r's step s, copied in on its communication stream
	evEnd                     // stream r's work of a pass (r is the stream here)
)

// evKey names one event of the ring.
type evKey struct {
	kind evKind
	r, s int
}

// devRing is a devSplit run as a ring on streams: per rank a compute and
// a communication stream, K/V double buffers and, in the backward,
// double-buffered travelling dK/dV accumulators.
type devRing struct {
	*devSplit
	so         streamOps
	cs, ms     []streamID            // each rank's compute and communication streams
	cops, mops []devOps              // the operations on them
	kbuf, vbuf [][2]gpu.DeviceTensor // each rank's K/V buffers: step s ≥ 1 reads buffer s%2
	partsDQ    []gpu.DeviceTensor    // each rank's partial gradients
	partsDK    []gpu.DeviceTensor
	partsDV    []gpu.DeviceTensor
	tk, tv     [][2]gpu.Accumulator // each rank's travelling dK, dV accumulators
	events     map[evKey]eventID
	recorded   map[eventID]bool // the events recorded in this pass
}

// newDevRing lays the problem out as newDevSplit does on so's origin
// stream and adds each rank's streams and K/V buffers.
func newDevRing(so streamOps, st Strategy, p int, q, k, v gpu.DeviceTensor, opt attn.Options) (*devRing, error) {
	x, err := newDevSplit(so, st, p, q, k, v, opt)
	if err != nil {
		return nil, err
	}
	g := &devRing{devSplit: x, so: so, events: map[evKey]eventID{}}
	for range p {
		if err := g.addStream(&g.cs, &g.cops); err != nil {
			return nil, err
		}
		if p == 1 {
			continue // one rank has nothing to copy
		}
		if err := g.addStream(&g.ms, &g.mops); err != nil {
			return nil, err
		}
	}
	gp := x.gp
	nk := gp.M / p
	g.kbuf, g.vbuf = make([][2]gpu.DeviceTensor, p), make([][2]gpu.DeviceTensor, p)
	for r := range p {
		// step s ≥ 1 reads buffer s%2: buffer 1 from P = 2, buffer 0 from P = 3
		for s := 1; s < min(p, 3); s++ {
			if g.kbuf[r][s%2], err = so.alloc(x.dt, gp.B, nk, gp.Hkv, gp.DK); err != nil {
				return nil, err
			}
			if g.vbuf[r][s%2], err = so.alloc(x.dt, gp.B, nk, gp.Hkv, gp.DV); err != nil {
				return nil, err
			}
		}
	}
	return g, nil
}

// addStream appends a new stream to ids and its operations to ops.
func (g *devRing) addStream(ids *[]streamID, ops *[]devOps) error {
	s, err := g.so.newStream()
	if err != nil {
		return err
	}
	*ids, *ops = append(*ids, s), append(*ops, g.so.on(s))
	return nil
}

// perRank returns a scratch tensor per rank: first, rank 0's, and one of
// the shape allocated for each other rank.
func (g *devRing) perRank(first gpu.DeviceTensor, dt attn.DType, shape ...int) ([]gpu.DeviceTensor, error) {
	out := []gpu.DeviceTensor{first}
	for range g.p - 1 {
		t, err := g.so.alloc(dt, shape...)
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	return out, nil
}

// setBackward prepares the backward as devSplit.setBackward does and adds
// each rank's partial gradients and second travelling accumulators (the
// first are the split's dK and dV accumulators).
func (g *devRing) setBackward(o, lse, dO gpu.DeviceTensor) error {
	if err := g.devSplit.setBackward(o, lse, dO); err != nil || g.tk != nil {
		return err
	}
	gp := g.gp
	nq, nk := gp.N/g.p, gp.M/g.p
	var err error
	if g.partsDQ, err = g.perRank(g.devSplit.partDQ, g.dt, gp.B, nq, gp.H, gp.DK); err != nil {
		return err
	}
	if g.partsDK, err = g.perRank(g.devSplit.partDK, g.dt, gp.B, nk, gp.Hkv, gp.DK); err != nil {
		return err
	}
	if g.partsDV, err = g.perRank(g.devSplit.partDV, g.dt, gp.B, nk, gp.Hkv, gp.DV); err != nil {
		return err
	}
	tk, tv := make([][2]gpu.Accumulator, g.p), make([][2]gpu.Accumulator, g.p)
	for r := range g.p {
		tk[r][0], tv[r][0] = g.dkAcc[r], g.dvAcc[r]
		if g.p == 1 {
			continue
		}
		if tk[r][1].O, err = g.so.alloc(attn.Float32, gp.B, nk, gp.Hkv, gp.DK); err != nil {
			return err
		}
		if tv[r][1].O, err = g.so.alloc(attn.Float32, gp.B, nk, gp.Hkv, gp.DV); err != nil {
			return err
		}
	}
	g.tk, g.tv = tk, tv
	return nil
}

// streams returns every stream of the ranks: the compute streams, then
// the communication streams.
func (g *devRing) streams() []streamID { return append(append([]streamID(nil), g.cs...), g.ms...) }

// record records the event of k on stream s.
func (g *devRing) record(k evKey, s streamID) error {
	e, ok := g.events[k]
	if !ok {
		var err error
		if e, err = g.so.newEvent(); err != nil {
			return err
		}
		g.events[k] = e
	}
	g.recorded[e] = true
	return g.so.record(e, s)
}

// await makes stream s wait for the event of k, which must have been
// recorded earlier in this pass.
func (g *devRing) await(s streamID, k evKey) error {
	e, ok := g.events[k]
	if !ok || !g.recorded[e] {
		return fmt.Errorf("cp: device ring: a wait for event %+v not recorded in this pass", k)
	}
	return g.so.wait(s, e)
}

// begin starts a pass: every stream of the ranks waits for the origin's
// work so far.
func (g *devRing) begin() error {
	g.recorded = map[eventID]bool{}
	start := evKey{kind: evStart}
	if err := g.record(start, 0); err != nil {
		return err
	}
	for _, s := range g.streams() {
		if err := g.await(s, start); err != nil {
			return err
		}
	}
	return nil
}

// end ends a pass: the origin waits for every stream of the ranks.
func (g *devRing) end() error {
	for _, s := range g.streams() {
		k := evKey{kind: evEnd, r: int(s)}
		if err := g.record(k, s); err != nil {
			return err
		}
		if err := g.await(0, k); err != nil {
			return err
		}
	}
	return nil
}

// kvAt returns the K and V rank r holds at step s: its own shards at step
// 0, buffer s%2 later.
func (g *devRing) kvAt(r, s int) (k, v gpu.DeviceTensor) {
	if s == 0 {
		return g.k[r], g.v[r]
	}
	return g.kbuf[r][s%2], g.vbuf[r][s%2]
}

// neighbours returns the ranks before and after r.
func (g *devRing) neighbours(r int) (prev, next int) { return (r + g.p - 1) % g.p, (r + 1) % g.p }

// pullKV enqueues on rank r's communication stream the copy of the block
// its predecessor holds at step s into r's buffer of step s+1.
func (g *devRing) pullKV(r, s int) error {
	prev, next := g.neighbours(r)
	m := g.ms[r]
	var waits []evKey
	if s >= 1 {
		waits = append(waits, evKey{evKVLanded, prev, s}) // the source landed
	}
	if s >= 2 {
		// the destination, buffer (s+1)%2 = (s−1)%2, was read by r's calls
		// of step s−1 (if any) and copied on by next's pull of step s−1
		if len(g.plan[s-1][r].tasks) > 0 {
			waits = append(waits, evKey{evComputed, r, s - 1})
		}
		waits = append(waits, evKey{evKVLanded, next, s})
	}
	for _, k := range waits {
		if err := g.await(m, k); err != nil {
			return err
		}
	}
	sk, sv := g.kvAt(prev, s)
	if err := g.mops[r].copy(g.kbuf[r][(s+1)%2], sk); err != nil {
		return err
	}
	if err := g.mops[r].copy(g.vbuf[r][(s+1)%2], sv); err != nil {
		return err
	}
	return g.record(evKey{evKVLanded, r, s + 1}, m)
}

// pullAcc enqueues on rank r's communication stream the copy of the dK/dV
// accumulator its predecessor held at step s−1 (1 ≤ s ≤ P) into r's
// accumulator of step s (s = P: the last hop, to the block's owner).
func (g *devRing) pullAcc(r, s int) error {
	prev, next := g.neighbours(r)
	m := g.ms[r]
	waits := []evKey{{evComputed, prev, s - 1}} // the source's adds are done
	if s >= 2 {
		// the destination, accumulator s%2, was copied on by next's pull
		// of step s−1, which waited for r's adds of step s−2 into it
		waits = append(waits, evKey{evAccLanded, next, s - 1})
	}
	for _, k := range waits {
		if err := g.await(m, k); err != nil {
			return err
		}
	}
	if err := g.mops[r].copy(g.tk[r][s%2].O, g.tk[prev][(s-1)%2].O); err != nil {
		return err
	}
	if err := g.mops[r].copy(g.tv[r][s%2].O, g.tv[prev][(s-1)%2].O); err != nil {
		return err
	}
	return g.record(evKey{evAccLanded, r, s}, m)
}

// forward enqueues the ring forward of every rank: at each step the
// step's calls on the rank's compute stream, each into its slot, while
// the communication streams copy the next blocks in; last, each rank's
// slots combined into its O and LSE.
func (g *devRing) forward() error {
	if err := g.begin(); err != nil {
		return err
	}
	for s, steps := range g.plan {
		for r, st := range steps {
			if err := g.forwardStep(r, s, st.tasks); err != nil {
				return fmt.Errorf("cp: device ring: rank %d, step %d: %w", r, s, err)
			}
		}
		if err := g.pullAll(s); err != nil {
			return err
		}
	}
	return g.end()
}

// pullAll enqueues every rank's K/V copy of step s (none at the last).
func (g *devRing) pullAll(s int) error {
	if s == g.p-1 {
		return nil
	}
	for r := range g.p {
		if err := g.pullKV(r, s); err != nil {
			return fmt.Errorf("cp: device ring: rank %d, K/V of step %d: %w", r, s+1, err)
		}
	}
	return nil
}

// forwardStep enqueues rank r's calls of step s on its compute stream.
func (g *devRing) forwardStep(r, s int, tasks []task) error {
	c, cs := g.cops[r], g.cs[r]
	if s == 0 {
		if err := g.clearSlots(c, r); err != nil {
			return err
		}
	} else if err := g.awaitKV(r, s, tasks); err != nil {
		return err
	}
	k, v := g.kvAt(r, s)
	for i, t := range tasks {
		o, lse := g.partial(r, g.plan[s][r].slot+i, t)
		if err := c.forward(view(g.q[r], 1, t.q0, t.nq), view(k, 1, t.k0, t.nk), view(v, 1, t.k0, t.nk), o, lse, taskOptions(g.gp, t)); err != nil {
			return err
		}
	}
	if s == g.p-1 {
		if err := c.combine(g.partsO[r], g.partsLSE[r], g.o[r], g.lse[r]); err != nil {
			return err
		}
	}
	return g.record(evKey{evComputed, r, s}, cs)
}

// awaitKV makes rank r's compute stream wait for the K/V block of step s
// ≥ 1, unless the step has no calls (its block is wholly masked).
func (g *devRing) awaitKV(r, s int, tasks []task) error {
	if len(tasks) == 0 {
		return nil
	}
	return g.await(g.cs[r], evKey{evKVLanded, r, s})
}

// backward enqueues the ring backward of every rank (setBackward first):
// at each step the travelling accumulators come in, then the step's
// calls run on the compute streams, each followed by the add of its dQ
// into the rank's accumulator and of its dK, dV into the travelling ones,
// while the next K/V blocks come in; after the last step the accumulators
// hop to their owners and every accumulator is finished into the ranks'
// dQ, dK and dV.
func (g *devRing) backward() error {
	if g.tk == nil {
		return attn.Errorf(attn.ErrOption, "cp: the device ring's backward needs setBackward first")
	}
	if err := g.begin(); err != nil {
		return err
	}
	for s, steps := range g.plan {
		for r := range g.p {
			if s == 0 {
				break // step 0's accumulators start here
			}
			if err := g.pullAcc(r, s); err != nil {
				return fmt.Errorf("cp: device ring: rank %d, dK/dV of step %d: %w", r, s, err)
			}
		}
		for r, st := range steps {
			if err := g.backwardStep(r, s, st.tasks); err != nil {
				return fmt.Errorf("cp: device ring: rank %d, step %d: %w", r, s, err)
			}
		}
		if err := g.pullAll(s); err != nil {
			return err
		}
	}
	for r := range g.p {
		if err := g.finishKV(r); err != nil {
			return fmt.Errorf("cp: device ring: rank %d, dK/dV: %w", r, err)
		}
	}
	return g.end()
}

// backwardStep enqueues rank r's calls of step s on its compute stream.
// The adds into the travelling accumulator wait for its copy; a step
// without calls waits for it all the same, so that it passes on complete.
func (g *devRing) backwardStep(r, s int, tasks []task) error {
	c, cs := g.cops[r], g.cs[r]
	at := s % 2
	landed := s == 0
	if s == 0 {
		for _, a := range []gpu.Accumulator{g.dqAcc[r], g.tk[r][0], g.tv[r][0]} {
			if err := c.reset(a); err != nil {
				return err
			}
		}
	} else if err := g.awaitKV(r, s, tasks); err != nil {
		return err
	}
	k, v := g.kvAt(r, s)
	for _, t := range tasks {
		dq, dk, dv := view(g.partsDQ[r], 1, 0, t.nq), view(g.partsDK[r], 1, 0, t.nk), view(g.partsDV[r], 1, 0, t.nk)
		err := c.backward(view(g.q[r], 1, t.q0, t.nq), view(k, 1, t.k0, t.nk), view(v, 1, t.k0, t.nk),
			view(g.o[r], 1, t.q0, t.nq), view(g.lse[r], 2, t.q0, t.nq), view(g.dO[r], 1, t.q0, t.nq), dq, dk, dv, taskOptions(g.gp, t))
		if err == nil {
			err = c.add(g.dqAcc[r], t.q0, dq)
		}
		if err == nil && !landed {
			err, landed = g.await(cs, evKey{evAccLanded, r, s}), true
		}
		if err == nil {
			err = c.add(g.tk[r][at], t.k0, dk)
		}
		if err == nil {
			err = c.add(g.tv[r][at], t.k0, dv)
		}
		if err != nil {
			return err
		}
	}
	if !landed {
		if err := g.await(cs, evKey{evAccLanded, r, s}); err != nil {
			return err
		}
	}
	if s == g.p-1 {
		if err := c.finish(g.dqAcc[r], g.dq[r], nil); err != nil {
			return err
		}
	}
	return g.record(evKey{evComputed, r, s}, cs)
}

// finishKV enqueues the last hop of the accumulator rank r's predecessor
// holds after the last step (that of r's own block) and finishes it into
// r's dK and dV on r's compute stream.
func (g *devRing) finishKV(r int) error {
	at := 0
	if g.p > 1 {
		at = g.p % 2
		if err := g.pullAcc(r, g.p); err != nil {
			return err
		}
		if err := g.await(g.cs[r], evKey{evAccLanded, r, g.p}); err != nil {
			return err
		}
	}
	if err := g.cops[r].finish(g.tk[r][at], g.dk[r], nil); err != nil {
		return err
	}
	return g.cops[r].finish(g.tv[r][at], g.dv[r], nil)
}
