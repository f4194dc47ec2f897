package cp

import (
	"fmt"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/gpu"
)

// The cost of splitting on one GPU. A ring split of one call over P
// virtual ranks lays each rank's shards out in device memory (its query
// chunks, and the K/V chunks its block holds when it visits another
// rank), then enqueues, step by step and rank by rank, the attention
// calls the host ring plans for that step (ring.tasks, the same code) on
// views of those shards. In the forward each call writes its partial
// result into a slot of its own, and after the last step one kernel per
// rank combines the rank's slots into its O and LSE (each partial read
// once, no float32 accumulator written at every step); in the backward
// each call is followed by the kernel that adds its gradients into the
// float32 accumulators of dQ and of the K/V block's owner. Everything runs on one stream, so the sum of
// its kernel times is the compute a real P-GPU run spreads over its GPUs,
// communication aside. The operations go through devOps: package gpu's
// backend on a stream, or in tests a host implementation over the same
// device tensor views.

// devOps are the device operations of a split run on one device. Every
// tensor is a gpu.DeviceTensor view; the operations are enqueued in order.
type devOps interface {
	// alloc returns a contiguous tensor (contents undefined).
	alloc(dt attn.DType, shape ...int) (gpu.DeviceTensor, error)
	// copy copies src into dst, of one dtype and shape, both dense.
	copy(dst, src gpu.DeviceTensor) error
	// forward computes o and lse of q, k, v under opt (ForwardDevice).
	forward(q, k, v, o, lse gpu.DeviceTensor, opt attn.Options) error
	// backward computes dq, dk, dv (BackwardDevice).
	backward(q, k, v, o, lse, dO, dq, dk, dv gpu.DeviceTensor, opt attn.Options) error
	// reset, add and finish are the backward's merge kernels
	// (gpu.Backend.ResetAccumulator, AddGradient, FinishAccumulator).
	reset(a gpu.Accumulator) error
	add(a gpu.Accumulator, r0 int, g gpu.DeviceTensor) error
	finish(a gpu.Accumulator, out gpu.DeviceTensor, lse *gpu.DeviceTensor) error
	// combine folds the forward's partial results, parts [K, B, n, H, D]
	// and partsLSE [K, B, H, n], into o and lse
	// (gpu.Backend.CombineForward).
	combine(parts, partsLSE, o, lse gpu.DeviceTensor) error
	// clearLSE sets every element of lse, a float32 tensor filling its
	// buffer, to −inf: partial rows that saw no key.
	clearLSE(lse gpu.DeviceTensor) error
}

// opKind selects the operations a split pass enqueues, so that the
// attention calls and the merge kernels can be timed apart.
type opKind uint8

const (
	opAttention opKind = 1 << iota // the attention calls (and the forward's slot clears before them)
	opMerge                        // the merge kernels: the forward's combines, the backward's resets, gradient adds and finishes
	opAll       = opAttention | opMerge
)

// devStep is the work of one rank at one ring step: the owner of the K/V
// block it holds, the attention calls the ring plans for it and the
// forward's slot of the first (the others follow).
type devStep struct {
	rank, owner int
	tasks       []task
	slot        int
}

// devPlan returns the steps of a ring split of gp (mask resolved) over p
// ranks with layout l, step-major (plan[s][r]): at step s rank r holds the
// block of ring.owner(s) and makes the calls of ring.tasks(s), the host
// ring's own plan.
func devPlan(gp *attn.Problem, l Layout, p int) ([][]devStep, error) {
	plan := make([][]devStep, p)
	slots := make([]int, p)
	for s := range p {
		for r := range p {
			g := layoutRing(l, gp, p, r)
			ts, err := g.tasks(s)
			if err != nil {
				return nil, fmt.Errorf("cp: rank %d, step %d: %w", r, s, err)
			}
			plan[s] = append(plan[s], devStep{rank: r, owner: g.owner(s), tasks: ts, slot: slots[r]})
			slots[r] += len(ts)
		}
	}
	return plan, nil
}

// devSplit is one global problem laid out for a ring split over p virtual
// ranks on one device: every rank's shards in tensors of its own.
type devSplit struct {
	ops    devOps
	gp     *attn.Problem
	dt     attn.DType
	p      int
	layout Layout
	plan   [][]devStep
	// q, k, v are each rank's shards: [B, N/P, H, DK], [B, M/P, Hkv, DK]
	// and [B, M/P, Hkv, DV].
	q, k, v []gpu.DeviceTensor
	// o and lse are each rank's forward results ([B, N/P, H, DV],
	// [B, H, N/P]): the forward's outputs, the backward's inputs.
	o, lse []gpu.DeviceTensor
	// partsO and partsLSE are each rank's forward slots, [K, B, N/P, H,
	// DV] and [K, B, H, N/P]: the partial result of the rank's k-th call
	// in slot k, at the call's rows; clearFirst marks the ranks whose
	// slots hold rows no call writes (their LSE is cleared to −inf first).
	partsO, partsLSE []gpu.DeviceTensor
	clearFirst       []bool
	dO, dq, dk, dv   []gpu.DeviceTensor // the backward's per-rank shards
	dqAcc, dkAcc     []gpu.Accumulator
	dvAcc            []gpu.Accumulator
	partDQ, partDK   gpu.DeviceTensor
	partDV           gpu.DeviceTensor
	calls, launches  int // attention calls and merge kernels of the last pass
}

// deviceProblem returns the global problem of the split of contiguous
// device tensors q [B, N, H, DK], k [B, M, Hkv, DK], v [B, M, Hkv, DV]
// under opt, its options resolved (attn.Problem.Resolve). It refuses with
// attn.ErrUnsupported what the device split does not take: a packed
// batch, a bias. Under dropout each call places its mask in the global
// problem's (Options.DropoutAt); the CUDA backend takes key origins that
// are multiples of 16.
func deviceProblem(q, k, v gpu.DeviceTensor, opt attn.Options) (*attn.Problem, error) {
	if packed(opt) {
		return nil, attn.Errorf(attn.ErrUnsupported, "cp: a packed batch split on one device")
	}
	if err := unsupported(opt); err != nil {
		return nil, err
	}
	for _, x := range []struct {
		name string
		t    gpu.DeviceTensor
	}{{"q", q}, {"k", k}, {"v", v}} {
		if x.t.DType != q.DType || len(x.t.Shape) != 4 {
			return nil, attn.Errorf(attn.ErrShape, "cp: %s: %v %v, want [B, seq, heads, dim] in %v", x.name, x.t.DType, x.t.Shape, q.DType)
		}
		if !dense(x.t) {
			return nil, attn.Errorf(attn.ErrLayout, "cp: %s: strides %v: the device split takes contiguous inputs", x.name, x.t.Strides)
		}
	}
	gp := &attn.Problem{B: q.Shape[0], N: q.Shape[1], H: q.Shape[2], DK: q.Shape[3], M: k.Shape[1], Hkv: k.Shape[2], DV: v.Shape[3], Opt: opt}
	if k.Shape[0] != gp.B || v.Shape[0] != gp.B || k.Shape[3] != gp.DK || v.Shape[1] != gp.M || v.Shape[2] != gp.Hkv {
		return nil, attn.Errorf(attn.ErrShape, "cp: q %v, k %v, v %v do not fit [B, N, H, DK], [B, M, Hkv, DK], [B, M, Hkv, DV]", q.Shape, k.Shape, v.Shape)
	}
	if err := gp.Resolve(); err != nil {
		return nil, fmt.Errorf("cp: %w", err)
	}
	return gp, nil
}

// dense reports whether t's elements fill one contiguous run of its
// buffer in row-major order (dims of size 1 aside).
func dense(t gpu.DeviceTensor) bool {
	if t.Strides == nil {
		return true
	}
	want := 1
	for d := len(t.Shape) - 1; d >= 0; d-- {
		if t.Shape[d] > 1 && t.Strides[d] != want {
			return false
		}
		want *= t.Shape[d]
	}
	return true
}

// newDevSplit lays the global inputs q, k, v (contiguous device tensors)
// out for a split by strategy st (ring or zigzag) over p ranks on ops:
// each rank's shards are copied into tensors of their own, and its
// accumulators and the partial results' scratch are allocated.
func newDevSplit(ops devOps, st Strategy, p int, q, k, v gpu.DeviceTensor, opt attn.Options) (*devSplit, error) {
	if st.Scheme != Ring {
		return nil, attn.Errorf(attn.ErrUnsupported, "cp: the device split runs ring and zigzag, not %v", st)
	}
	gp, err := deviceProblem(q, k, v, opt)
	if err != nil {
		return nil, err
	}
	if err := st.Check(gp.N, gp.M, gp.Hkv, p); err != nil {
		return nil, err
	}
	nq, nk := gp.N/p, gp.M/p
	plan, err := devPlan(gp, st.Layout, p)
	if err == nil {
		err = checkPlan(plan, nq, nk)
	}
	if err != nil {
		return nil, err
	}
	x := &devSplit{ops: ops, gp: gp, dt: q.DType, p: p, layout: st.Layout, plan: plan}
	for _, in := range []struct {
		t      gpu.DeviceTensor
		shards *[]gpu.DeviceTensor
	}{{q, &x.q}, {k, &x.k}, {v, &x.v}} {
		if *in.shards, err = x.shardOf(in.t, 1); err != nil {
			return nil, err
		}
	}
	if x.o, err = x.allocRanks(x.dt, gp.B, nq, gp.H, gp.DV); err != nil {
		return nil, err
	}
	if x.lse, err = x.allocRanks(attn.Float32, gp.B, gp.H, nq); err != nil {
		return nil, err
	}
	err = x.allocSlots()
	return x, err
}

// allocSlots allocates each rank's forward slots, one per call of the
// rank, and marks the ranks whose slots a call covers only in part.
func (x *devSplit) allocSlots() error {
	gp := x.gp
	nq := gp.N / x.p
	x.clearFirst = make([]bool, x.p)
	for _, steps := range x.plan {
		for _, st := range steps {
			for _, t := range st.tasks {
				x.clearFirst[st.rank] = x.clearFirst[st.rank] || t.q0 != 0 || t.nq != nq
			}
		}
	}
	x.partsO, x.partsLSE = make([]gpu.DeviceTensor, x.p), make([]gpu.DeviceTensor, x.p)
	for r, last := range x.plan[x.p-1] {
		k := last.slot + len(last.tasks) // the rank's calls (devPlan numbers their slots)
		var err error
		if x.partsO[r], err = x.ops.alloc(x.dt, k, gp.B, nq, gp.H, gp.DV); err != nil {
			return err
		}
		if x.partsLSE[r], err = x.ops.alloc(attn.Float32, k, gp.B, gp.H, nq); err != nil {
			return err
		}
	}
	return nil
}

// partial returns the views of rank r's slot k at the rows of call t:
// where the call writes its O and LSE.
func (x *devSplit) partial(r, k int, t task) (o, lse gpu.DeviceTensor) {
	return view(slotOf(x.partsO[r], k), 1, t.q0, t.nq), view(slotOf(x.partsLSE[r], k), 2, t.q0, t.nq)
}

// slotOf returns slot k of t, a tensor of slots along its first axis, as
// a tensor of the other axes.
func slotOf(t gpu.DeviceTensor, k int) gpu.DeviceTensor {
	v := view(t, 0, k, 1)
	v.Shape, v.Strides = v.Shape[1:], v.Strides[1:]
	return v
}

// clearSlots enqueues the clear of rank r's slot LSEs when some of their
// rows no call writes.
func (x *devSplit) clearSlots(ops devOps, r int) error {
	if !x.clearFirst[r] || x.partsLSE[r].NumElements() == 0 {
		return nil
	}
	return ops.clearLSE(x.partsLSE[r])
}

// allocRanks allocates one tensor of the shape per rank.
func (x *devSplit) allocRanks(dt attn.DType, shape ...int) ([]gpu.DeviceTensor, error) {
	out := make([]gpu.DeviceTensor, x.p)
	for r := range out {
		var err error
		if out[r], err = x.ops.alloc(dt, shape...); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// accumulators allocates one float32 gradient accumulator [B, n, h, d]
// per rank.
func (x *devSplit) accumulators(n, h, d int) ([]gpu.Accumulator, error) {
	out := make([]gpu.Accumulator, x.p)
	for r := range out {
		o, err := x.ops.alloc(attn.Float32, x.gp.B, n, h, d)
		if err != nil {
			return nil, err
		}
		out[r].O = o
	}
	return out, nil
}

// shardOf allocates every rank's shard of the global tensor t, whose
// sequence runs along axis, and copies its chunks in.
func (x *devSplit) shardOf(t gpu.DeviceTensor, axis int) ([]gpu.DeviceTensor, error) {
	shape := append([]int(nil), t.Shape...)
	shape[axis] /= x.p
	out, err := x.allocRanks(t.DType, shape...)
	if err != nil {
		return nil, err
	}
	return out, x.copyChunks(t, out, axis, false)
}

// copyChunks copies between the global tensor g and the ranks' shards,
// whose sequence runs along axis: each chunk of each rank, for every index
// of the dims before axis, in one dense copy (into the shards, or back
// into g with unshard set).
func (x *devSplit) copyChunks(g gpu.DeviceTensor, shards []gpu.DeviceTensor, axis int, unshard bool) error {
	c := g.Shape[axis] / x.layout.numChunks(x.p)
	outer := 1
	for _, n := range g.Shape[:axis] {
		outer *= n
	}
	for r, sh := range shards {
		for _, ch := range chunksFor(x.layout, x.p, r, c) {
			for i := range outer {
				gv, sv := g, sh
				rem := i
				for d := axis - 1; d >= 0; d-- {
					at := rem % g.Shape[d]
					rem /= g.Shape[d]
					var err error
					if gv, err = gv.Narrow(d, at, 1); err == nil {
						sv, err = sv.Narrow(d, at, 1)
					}
					if err != nil {
						return err
					}
				}
				gv, err := gv.Narrow(axis, ch.global, ch.n)
				if err == nil {
					sv, err = sv.Narrow(axis, ch.local, ch.n)
				}
				if err == nil {
					if unshard {
						err = x.ops.copy(gv, sv)
					} else {
						err = x.ops.copy(sv, gv)
					}
				}
				if err != nil {
					return fmt.Errorf("cp: rank %d, chunk at %d: %w", r, ch.global, err)
				}
			}
		}
	}
	return nil
}

// checkPlan reports whether every planned call lies inside the ranks'
// shards (nq query rows, nk keys), so that its views exist.
func checkPlan(plan [][]devStep, nq, nk int) error {
	for s, steps := range plan {
		for _, st := range steps {
			for _, t := range st.tasks {
				if t.q0 < 0 || t.nq < 0 || t.q0 > nq-t.nq || t.k0 < 0 || t.nk < 0 || t.k0 > nk-t.nk {
					return fmt.Errorf("cp: rank %d, step %d: a call on rows [%d, +%d) and keys [%d, +%d) outside shards of %d and %d",
						st.rank, s, t.q0, t.nq, t.k0, t.nk, nq, nk)
				}
			}
		}
	}
	return nil
}

// view returns the rows [start, start+n) of t along axis: a planned call's
// rows, inside t (checkPlan), a slot of a partial result, or its first rows.
func view(t gpu.DeviceTensor, axis, start, n int) gpu.DeviceTensor {
	v, _ := t.Narrow(axis, start, n) // (in range: see checkPlan)
	return v
}

// forward enqueues the forward of every rank and step: the clear of the
// slots that need one, then for each planned call the attention of the
// rank's query rows against the visiting block's keys into its slot;
// last, each rank's slots combined into its O and LSE. kinds selects what
// is enqueued: the clears go with the calls, so that the combines alone
// read the slots as the last calls left them.
func (x *devSplit) forward(kinds opKind) error {
	x.calls, x.launches = 0, 0
	if kinds&opAttention != 0 {
		for r := range x.p {
			if err := x.clearSlots(x.ops, r); err != nil {
				return err
			}
		}
		for s, steps := range x.plan {
			for _, st := range steps {
				for i, t := range st.tasks {
					o, lse := x.partial(st.rank, st.slot+i, t)
					x.calls++
					err := x.ops.forward(view(x.q[st.rank], 1, t.q0, t.nq), view(x.k[st.owner], 1, t.k0, t.nk), view(x.v[st.owner], 1, t.k0, t.nk),
						o, lse, taskOptions(x.gp, t))
					if err != nil {
						return fmt.Errorf("cp: rank %d, step %d: %w", st.rank, s, err)
					}
				}
			}
		}
	}
	for r := range x.p {
		if err := x.mergeOp(kinds, func() error { return x.ops.combine(x.partsO[r], x.partsLSE[r], x.o[r], x.lse[r]) }); err != nil {
			return fmt.Errorf("cp: rank %d: %w", r, err)
		}
	}
	return nil
}

// mergeOp runs op, a merge kernel, when kinds holds merges, and counts it.
func (x *devSplit) mergeOp(kinds opKind, op func() error) error {
	if kinds&opMerge == 0 {
		return nil
	}
	x.launches++
	return op()
}

// global is a global tensor of a split: its name, and the dtype and shape
// it must have.
type global struct {
	name  string
	t     gpu.DeviceTensor
	dt    attn.DType
	shape []int
}

// global returns the global tensor t named name (q, k, v, o, lse, dO, dq,
// dk or dv) with the dtype and shape it has in x's problem.
func (x *devSplit) global(name string, t gpu.DeviceTensor) global {
	gp := x.gp
	g := global{name: name, t: t, dt: x.dt}
	switch name {
	case "q", "dq":
		g.shape = []int{gp.B, gp.N, gp.H, gp.DK}
	case "k", "dk":
		g.shape = []int{gp.B, gp.M, gp.Hkv, gp.DK}
	case "v", "dv":
		g.shape = []int{gp.B, gp.M, gp.Hkv, gp.DV}
	case "lse":
		g.dt, g.shape = attn.Float32, []int{gp.B, gp.H, gp.N}
	default: // o, dO
		g.shape = []int{gp.B, gp.N, gp.H, gp.DV}
	}
	return g
}

// checkGlobals returns an error wrapping attn.ErrShape for the first of gs
// that is not contiguous with its dtype and shape.
func checkGlobals(gs ...global) error {
	for _, g := range gs {
		if g.t.DType != g.dt || !sameInts(g.t.Shape, g.shape) || !dense(g.t) {
			return attn.Errorf(attn.ErrShape, "cp: %s: %v %v, want contiguous %v in %v", g.name, g.t.DType, g.t.Shape, g.shape, g.dt)
		}
	}
	return nil
}

// setBackward prepares the backward: the forward's global o and lse and
// the global dO (contiguous) are sharded, and the gradients' accumulators
// and scratch allocated (once).
func (x *devSplit) setBackward(o, lse, dO gpu.DeviceTensor) error {
	gp := x.gp
	if err := checkGlobals(x.global("o", o), x.global("lse", lse), x.global("dO", dO)); err != nil {
		return err
	}
	if err := x.copyChunks(o, x.o, 1, false); err != nil {
		return err
	}
	if err := x.copyChunks(lse, x.lse, 2, false); err != nil {
		return err
	}
	if x.dO != nil {
		return x.copyChunks(dO, x.dO, 1, false)
	}
	var err error
	if x.dO, err = x.shardOf(dO, 1); err != nil {
		return err
	}
	nq, nk := gp.N/x.p, gp.M/x.p
	for _, g := range []struct {
		out   *[]gpu.DeviceTensor
		acc   *[]gpu.Accumulator
		part  *gpu.DeviceTensor
		shape []int
	}{{&x.dq, &x.dqAcc, &x.partDQ, []int{nq, gp.H, gp.DK}}, {&x.dk, &x.dkAcc, &x.partDK, []int{nk, gp.Hkv, gp.DK}},
		{&x.dv, &x.dvAcc, &x.partDV, []int{nk, gp.Hkv, gp.DV}}} {
		full := append([]int{gp.B}, g.shape...)
		if *g.out, err = x.allocRanks(x.dt, full...); err != nil {
			return err
		}
		if *g.acc, err = x.accumulators(g.shape[0], g.shape[1], g.shape[2]); err != nil {
			return err
		}
		if *g.part, err = x.ops.alloc(x.dt, full...); err != nil {
			return err
		}
	}
	return nil
}

// sameInts reports whether a and b hold the same values.
func sameInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// backward enqueues the backward of every rank and step (setBackward
// first): for each planned call, the backward of the rank's query rows
// against the visiting block into the partial gradients, then dQ added
// into the rank's accumulator and dK, dV into those of the block's owner,
// so that each owner's sums run in the host ring's order (its own step 0,
// then each next rank's); last, every accumulator finished into the
// ranks' dQ, dK and dV. kinds selects what is enqueued.
func (x *devSplit) backward(kinds opKind) error {
	if x.dO == nil {
		return attn.Errorf(attn.ErrOption, "cp: the device split's backward needs setBackward first")
	}
	x.calls, x.launches = 0, 0
	accs := [][]gpu.Accumulator{x.dqAcc, x.dkAcc, x.dvAcc}
	for _, as := range accs {
		for _, a := range as {
			if err := x.mergeOp(kinds, func() error { return x.ops.reset(a) }); err != nil {
				return err
			}
		}
	}
	for s, steps := range x.plan {
		for _, st := range steps {
			r, w := st.rank, st.owner
			for _, t := range st.tasks {
				dq, dk, dv := view(x.partDQ, 1, 0, t.nq), view(x.partDK, 1, 0, t.nk), view(x.partDV, 1, 0, t.nk)
				if kinds&opAttention != 0 {
					x.calls++
					err := x.ops.backward(view(x.q[r], 1, t.q0, t.nq), view(x.k[w], 1, t.k0, t.nk), view(x.v[w], 1, t.k0, t.nk),
						view(x.o[r], 1, t.q0, t.nq), view(x.lse[r], 2, t.q0, t.nq), view(x.dO[r], 1, t.q0, t.nq), dq, dk, dv, taskOptions(x.gp, t))
					if err != nil {
						return fmt.Errorf("cp: rank %d, step %d: %w", r, s, err)
					}
				}
				for _, a := range []struct {
					acc gpu.Accumulator
					r0  int
					g   gpu.DeviceTensor
				}{{x.dqAcc[r], t.q0, dq}, {x.dkAcc[w], t.k0, dk}, {x.dvAcc[w], t.k0, dv}} {
					if err := x.mergeOp(kinds, func() error { return x.ops.add(a.acc, a.r0, a.g) }); err != nil {
						return fmt.Errorf("cp: rank %d, step %d: %w", r, s, err)
					}
				}
			}
		}
	}
	for i, outs := range [][]gpu.DeviceTensor{x.dq, x.dk, x.dv} {
		for r, out := range outs {
			if err := x.mergeOp(kinds, func() error { return x.ops.finish(accs[i][r], out, nil) }); err != nil {
				return err
			}
		}
	}
	return nil
}

// unshard copies the ranks' shards of a result back into the global
// tensor g (contiguous), whose sequence runs along axis.
func (x *devSplit) unshard(g gpu.DeviceTensor, shards []gpu.DeviceTensor, axis int) error {
	return x.copyChunks(g, shards, axis, true)
}
