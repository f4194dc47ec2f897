package cp

import (
	"context"
	"fmt"
	"slices"

	"github.com/flashattn/flashattn/attn"
)

// A packed variable-length batch (attn.Options CuSeqlensQ and CuSeqlensK
// set) is split sequence by sequence: each sequence is cut into the
// layout's chunks, and rank r holds its chunks of every sequence,
// concatenated in sequence order. Every rank then holds 1/P of every
// sequence, so the local cumulative offsets are the global ones divided by
// P, the same on every rank.

// packed reports whether opt describes a packed variable-length batch.
func packed(opt attn.Options) bool { return opt.CuSeqlensQ != nil || opt.CuSeqlensK != nil }

// checkCu validates cu (called name in messages) as the cumulative
// offsets of a packed batch whose every sequence cuts into the equal
// chunks of layout l over p ranks: an error wrapping attn.ErrOption for
// malformed offsets, attn.ErrShape for a sequence that does not cut
// evenly (shards are never uneven).
func checkCu(name string, cu []int32, l Layout, p int) error {
	if len(cu) < 2 || cu[0] != 0 {
		return attn.Errorf(attn.ErrOption, "cp: %s %v: want B+1 ≥ 2 cumulative offsets from 0", name, cu)
	}
	c := l.numChunks(p)
	for s := range len(cu) - 1 {
		n := int(cu[s+1]) - int(cu[s])
		if n < 0 {
			return attn.Errorf(attn.ErrOption, "cp: %s not non-decreasing: [%d] = %d < [%d] = %d", name, s+1, cu[s+1], s, cu[s])
		}
		if n%c != 0 {
			return attn.Errorf(attn.ErrShape, "cp: %s: sequence %d of length %d cannot be cut into %d equal chunks (%v layout, %d ranks): uneven shards",
				name, s, n, c, l, p)
		}
	}
	return nil
}

// LocalCuSeqlens returns the cumulative segment offsets of each rank's
// shard of a packed batch whose global offsets are cu, split with layout
// l over p ranks: every rank holds 1/p of every sequence (empty sequences
// stay empty), so the offsets are cu/p on every rank. It fails with an
// error wrapping attn.ErrShape when a sequence's length is not a multiple
// of the number of chunks (P, or 2P for Zigzag), and attn.ErrOption for
// malformed offsets or a bad layout or p.
func LocalCuSeqlens(cu []int32, l Layout, p int) ([]int32, error) {
	if err := l.check(p, 0); err != nil {
		return nil, err
	}
	if err := checkCu("cu_seqlens", cu, l, p); err != nil {
		return nil, err
	}
	out := make([]int32, len(cu))
	for i, x := range cu {
		out[i] = x / int32(p)
	}
	return out, nil
}

// packedChunks returns the chunks of rank r's shard of a packed batch of
// valid offsets cu: local offsets in the rank's packed shard, global ones
// in the packed batch, in local order.
func packedChunks(l Layout, cu []int32, p, r int) []chunk {
	c := l.numChunks(p)
	var out []chunk
	for s := range len(cu) - 1 {
		n := int(cu[s+1] - cu[s])
		if n == 0 {
			continue
		}
		for _, ch := range chunksFor(l, p, r, n/c) {
			out = append(out, chunk{local: int(cu[s])/p + ch.local, global: int(cu[s]) + ch.global, n: ch.n})
		}
	}
	return out
}

// PackedPositions returns, in local order, the position inside its own
// sequence of each token that rank r of p holds of a packed batch with
// offsets cu (the token at local index i of sequence s sits at packed
// index cu[s] + pos[i] of the batch). Errors are those of LocalCuSeqlens,
// and attn.ErrOption for a rank outside [0, p).
func PackedPositions(l Layout, cu []int32, p, r int) ([]int, error) {
	if err := l.check(p, r); err != nil {
		return nil, err
	}
	if err := checkCu("cu_seqlens", cu, l, p); err != nil {
		return nil, err
	}
	pos := make([]int, 0, int(cu[len(cu)-1])/p)
	for s := range len(cu) - 1 {
		n := int(cu[s+1] - cu[s])
		if n == 0 {
			continue
		}
		for _, ch := range chunksFor(l, p, r, n/l.numChunks(p)) {
			for i := range ch.n {
				pos = append(pos, ch.global+i)
			}
		}
	}
	return pos, nil
}

// checkPackedLen reports whether t holds the packed batch cu along axis.
func checkPackedLen(name string, t attn.Tensor, axis int, total int) error {
	if t.Shape[axis] != total {
		return attn.Errorf(attn.ErrShape, "cp: %s: %d tokens along axis %d of shape %v, but the cu_seqlens hold %d",
			name, t.Shape[axis], axis, t.Shape, total)
	}
	return nil
}

// ShardPacked returns a contiguous copy of rank r's shard of the packed
// tensor t, whose tokens run along axis (0 for q, k, v, O and their
// gradients, [total, H, D]; 1 for the LSE, [H, total]), cut sequence by
// sequence at the offsets cu: rank r's chunks of each sequence in
// sequence order, with the offsets LocalCuSeqlens returns. It fails with
// an error wrapping attn.ErrShape when a sequence does not cut into equal
// chunks (uneven shards are refused), t's length along axis is not the
// offsets' total or axis is out of range, attn.ErrOption for malformed
// offsets, a bad layout or rank, and the error of t.CheckLayout for a
// malformed t.
func ShardPacked(t attn.Tensor, axis int, cu []int32, l Layout, p, r int) (attn.Tensor, error) {
	if err := checkAxis("shard", t, axis); err != nil {
		return attn.Tensor{}, err
	}
	if err := l.check(p, r); err != nil {
		return attn.Tensor{}, err
	}
	if err := checkCu("cu_seqlens", cu, l, p); err != nil {
		return attn.Tensor{}, err
	}
	if err := checkPackedLen("shard", t, axis, int(cu[len(cu)-1])); err != nil {
		return attn.Tensor{}, err
	}
	shape := slices.Clone(t.Shape)
	shape[axis] /= p
	out, err := attn.NewChecked(t.DType, shape...)
	if err != nil {
		return attn.Tensor{}, err
	}
	for _, ch := range packedChunks(l, cu, p, r) {
		if err := attn.CopyInto(narrow(out, axis, ch.local, ch.n), narrow(t, axis, ch.global, ch.n)); err != nil {
			return attn.Tensor{}, err
		}
	}
	return out, nil
}

// UnshardPacked reassembles the packed shards of all ranks, shards[r]
// being rank r's as ShardPacked cuts it, into one contiguous packed tensor
// with offsets cu whose tokens run along axis. The shards must share
// dtype and shape; it fails with an error wrapping attn.ErrShape
// (attn.ErrDType) when they do not, when there are none, when a sequence
// does not cut into equal chunks or the shards do not hold 1/P of the
// offsets' total, and attn.ErrOption for malformed offsets.
func UnshardPacked(shards []attn.Tensor, axis int, cu []int32, l Layout) (attn.Tensor, error) {
	if err := checkShards(shards, axis, l); err != nil {
		return attn.Tensor{}, err
	}
	p := len(shards)
	if err := checkCu("cu_seqlens", cu, l, p); err != nil {
		return attn.Tensor{}, err
	}
	total := int(cu[len(cu)-1])
	if err := checkPackedLen("unshard", shards[0], axis, total/p); err != nil {
		return attn.Tensor{}, err
	}
	shape := slices.Clone(shards[0].Shape)
	shape[axis] = total
	out, err := attn.NewChecked(shards[0].DType, shape...)
	if err != nil {
		return attn.Tensor{}, err
	}
	for r, s := range shards {
		for _, ch := range packedChunks(l, cu, p, r) {
			if err := attn.CopyInto(narrow(out, axis, ch.global, ch.n), narrow(s, axis, ch.local, ch.n)); err != nil {
				return attn.Tensor{}, err
			}
		}
	}
	return out, nil
}

// shardInput returns rank r's shard of t: a padded tensor (cu nil) whose
// sequence runs along axis, or a packed one with offsets cu, which lacks
// the batch dimension, so that its tokens run along axis−1.
func shardInput(t attn.Tensor, axis int, cu []int32, l Layout, p, r int) (attn.Tensor, error) {
	if cu == nil {
		return Shard(t, axis, l, p, r)
	}
	return ShardPacked(t, axis-1, cu, l, p, r)
}

// unshardOutput is the inverse of shardInput.
func unshardOutput(shards []attn.Tensor, axis int, cu []int32, l Layout) (attn.Tensor, error) {
	if cu == nil {
		return Unshard(shards, axis, l)
	}
	return UnshardPacked(shards, axis-1, cu, l)
}

// CheckPacked reports whether strategy s can split a packed batch with
// query and key offsets cuQ and cuK and hkv key/value heads over p ranks,
// as Check does for a padded batch: every sequence, queries and keys,
// must cut into the layout's equal chunks (else an error wrapping
// attn.ErrShape naming the sequence), and the other conditions are
// Check's.
func (s Strategy) CheckPacked(cuQ, cuK []int32, hkv, p int) error {
	if err := s.Check(0, 0, hkv, p); err != nil {
		return err
	}
	for _, x := range []struct {
		name string
		cu   []int32
	}{{"cu_seqlens_q", cuQ}, {"cu_seqlens_k", cuK}} {
		if err := checkCu(x.name, x.cu, s.Layout, p); err != nil {
			return fmt.Errorf("%v: %w", s, err)
		}
	}
	return nil
}

// localCu returns the local offsets of the global offsets cu (nil stays
// nil, for attn.NewProblem to report).
func localCu(name string, cu []int32, l Layout, p int) ([]int32, error) {
	if cu == nil {
		return nil, nil
	}
	if err := checkCu(name, cu, l, p); err != nil {
		return nil, err
	}
	return LocalCuSeqlens(cu, l, p)
}

// longest returns the length of the longest segment of valid offsets cu.
func longest(cu []int32) int {
	n := 0
	for s := range len(cu) - 1 {
		n = max(n, int(cu[s+1]-cu[s]))
	}
	return n
}

// setupPacked is setup for a packed batch: opt holds the global offsets,
// the shards hold 1/P of every sequence with the local ones. It returns
// the local problem and the global one.
func (a *Attention) setupPacked(q, k, v attn.Tensor, opt attn.Options) (lp, gp *attn.Problem, err error) {
	p := a.Transport.Size()
	local := opt
	if local.CuSeqlensQ, err = localCu("cu_seqlens_q", opt.CuSeqlensQ, a.Layout, p); err != nil {
		return nil, nil, err
	}
	if local.CuSeqlensK, err = localCu("cu_seqlens_k", opt.CuSeqlensK, a.Layout, p); err != nil {
		return nil, nil, err
	}
	if lp, err = attn.NewProblem(q, k, v, local); err != nil {
		return nil, nil, err
	}
	g := *lp
	g.Opt = opt
	g.TotalQ, g.TotalK = int(opt.CuSeqlensQ[len(opt.CuSeqlensQ)-1]), int(opt.CuSeqlensK[len(opt.CuSeqlensK)-1])
	g.N, g.M = longest(opt.CuSeqlensQ), longest(opt.CuSeqlensK)
	g.ResolveMask()
	return lp, &g, nil
}

// packedForward is Forward for a packed batch, which runs through the
// code of a padded one (see asPadded).
func (a *Attention) packedForward(ctx context.Context, lp, gp *attn.Problem, q, k, v attn.Tensor) (attn.Result, error) {
	b, bp, err := a.asPadded(lp)
	if err != nil {
		return attn.Result{}, err
	}
	q, k, v = addBatch(q), addBatch(k), addBatch(v)
	var res attn.Result
	if a.Scheme == AllToAll {
		res, err = b.headsForward(ctx, bp, gp, q, k, v)
	} else {
		res, err = b.ringForward(ctx, bp, gp, q, k, v)
	}
	if err != nil {
		return attn.Result{}, err
	}
	return attn.Result{O: dropBatch(res.O), LSE: dropBatch(res.LSE)}, nil
}

// packedBackward is Backward for a packed batch, as packedForward.
func (a *Attention) packedBackward(ctx context.Context, lp, gp *attn.Problem, q, k, v, o, lse, dO attn.Tensor) (attn.Gradients, error) {
	b, bp, err := a.asPadded(lp)
	if err != nil {
		return attn.Gradients{}, err
	}
	q, k, v, o, lse, dO = addBatch(q), addBatch(k), addBatch(v), addBatch(o), addBatch(lse), addBatch(dO)
	var g attn.Gradients
	if a.Scheme == AllToAll {
		g, err = b.headsBackward(ctx, bp, gp, q, k, v, o, lse, dO)
	} else {
		g, err = b.ringBackward(ctx, bp, gp, q, k, v, o, lse, dO)
	}
	if err != nil {
		return attn.Gradients{}, err
	}
	return attn.Gradients{DQ: dropBatch(g.DQ), DK: dropBatch(g.DK), DV: dropBatch(g.DV)}, nil
}

// asPadded returns the Attention and the local problem with which the
// code of a padded batch runs the packed local problem lp: it sees the
// local packed tensors as one batch element of all their tokens (views
// [1, total, H, D], LSE [1, H, total]), and the backend, a packedBackend,
// turns each call back into a packed one. The ring's tasks carry the
// cu_seqlens that separate the sequences (packedTasks). The all-to-all
// exchanges as for the Contiguous layout, which places rank t's local
// tokens at t·(total/P) in rank order, and the backend reorders them
// into the global packed order, so that every sequence is whole for the
// global packed call (the global cu_seqlens), and back. Another scheme
// fails with an error wrapping attn.ErrUnsupported.
func (a *Attention) asPadded(lp *attn.Problem) (*Attention, *attn.Problem, error) {
	b := *a
	pb := packedBackend{Backend: a.Backend}
	switch a.Scheme {
	case Ring:
	case AllToAll:
		pb.regroup, pb.layout, pb.p = true, a.Layout, a.Transport.Size()
		b.Layout = Contiguous
	default:
		return nil, nil, attn.Errorf(attn.ErrUnsupported, "cp: packed variable-length batches with the %v scheme", a.Scheme)
	}
	b.Backend = pb
	return &b, &attn.Problem{B: 1, N: lp.TotalQ, M: lp.TotalK, H: lp.H, Hkv: lp.Hkv, DK: lp.DK, DV: lp.DV}, nil
}

// addBatch returns t viewed with a leading dimension of size 1.
func addBatch(t attn.Tensor) attn.Tensor {
	st := t.Strides
	if st == nil {
		st = attn.ContiguousStrides(t.Shape)
	}
	v := t
	v.Shape = append([]int{1}, t.Shape...)
	v.Strides = append([]int{max(1, attn.NumElements(t.Shape))}, st...)
	return v
}

// dropBatch returns t, whose leading dimension has size 1, viewed without
// it.
func dropBatch(t attn.Tensor) attn.Tensor {
	st := t.Strides
	if st == nil {
		st = attn.ContiguousStrides(t.Shape)
	}
	v := t
	v.Shape = slices.Clone(t.Shape[1:])
	v.Strides = slices.Clone(st[1:])
	return v
}

// packedBackend is the backend of a packed batch run as a padded one (see
// asPadded): its calls get tensors of one batch element ([1, total, H, D],
// LSE [1, H, total]) and the packed call's cu_seqlens in the options; it
// drops that dimension for the backend's packed call and restores it on
// the results. With regroup set, the tokens arrive in rank order (rank t's
// shard of layout over p ranks at t·(total/p)), and it reorders them into
// the packed order of the cu_seqlens for the call, and the results back.
type packedBackend struct {
	attn.Backend
	regroup bool
	layout  Layout
	p       int
}

// in returns the backend's view of an input whose tokens run along axis
// (after the batch dimension is dropped) with offsets cu.
func (b packedBackend) in(t attn.Tensor, axis int, cu []int32) (attn.Tensor, error) {
	t = dropBatch(t)
	if !b.regroup {
		return t, nil
	}
	return regroup(t, axis, cu, b.layout, b.p, true)
}

// out is the inverse of in, for a result.
func (b packedBackend) out(t attn.Tensor, axis int, cu []int32) (attn.Tensor, error) {
	if b.regroup {
		var err error
		if t, err = regroup(t, axis, cu, b.layout, b.p, false); err != nil {
			return attn.Tensor{}, err
		}
	}
	return addBatch(t), nil
}

// ins applies in to each tensor: queries' tokens (and those of O and dO)
// along axis 0 with offsets cuQ, keys' along axis 0 with cuK, the LSE's
// along axis 1 with cuQ.
func (b packedBackend) ins(xs []attn.Tensor, roles string, cuQ, cuK []int32) ([]attn.Tensor, error) {
	out := make([]attn.Tensor, len(xs))
	for i, x := range xs {
		axis, cu := 0, cuQ
		switch roles[i] {
		case 'k':
			cu = cuK
		case 'l':
			axis = 1
		}
		var err error
		if out[i], err = b.in(x, axis, cu); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// Forward runs the packed call.
func (b packedBackend) Forward(q, k, v attn.Tensor, opt attn.Options) (attn.Result, error) {
	cq, ck := opt.CuSeqlensQ, opt.CuSeqlensK
	in, err := b.ins([]attn.Tensor{q, k, v}, "qkk", cq, ck)
	if err != nil {
		return attn.Result{}, err
	}
	res, err := b.Backend.Forward(in[0], in[1], in[2], opt)
	if err != nil {
		return attn.Result{}, err
	}
	if res.O, err = b.out(res.O, 0, cq); err != nil {
		return attn.Result{}, err
	}
	res.LSE, err = b.out(res.LSE, 1, cq)
	return res, err
}

// Backward runs the packed call's backward.
func (b packedBackend) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	cq, ck := opt.CuSeqlensQ, opt.CuSeqlensK
	in, err := b.ins([]attn.Tensor{q, k, v, o, lse, dO}, "qkkqlq", cq, ck)
	if err != nil {
		return attn.Gradients{}, err
	}
	g, err := b.Backend.Backward(in[0], in[1], in[2], in[3], in[4], in[5], opt)
	if err != nil {
		return attn.Gradients{}, err
	}
	var out attn.Gradients
	if out.DQ, err = b.out(g.DQ, 0, cq); err != nil {
		return attn.Gradients{}, err
	}
	if out.DK, err = b.out(g.DK, 0, ck); err != nil {
		return attn.Gradients{}, err
	}
	out.DV, err = b.out(g.DV, 0, ck)
	return out, err
}

// seqTask is a task of one sequence s of a packed batch, in the local
// packed coordinates of the rank's queries and the visiting block's keys.
type seqTask struct {
	task
	s int
}

// packedTasks returns the backend calls of the ring step in which rank r
// of p holds the K/V block of rank owner, for the packed global problem
// gp. Each sequence is planned alone, as a padded problem of its own
// lengths (plan: blocks wholly masked skipped, partly masked ones trimmed
// with a top-left window). Without dropout, the tasks sharing a window
// whose query and key ranges both follow one another become one packed
// call, whose cu_seqlens give each task a segment and fill the gaps with
// segments of queries without keys or keys without queries (rows that see
// no key there, and contribute nothing); the backend applies one window
// to every segment, so tasks of different windows are different calls.
// Under dropout each task is a call of its own whose cu_seqlens hold
// empty segments before its own, so that it keeps its sequence's batch
// index in the mask, and whose attn.Options.DropoutAt places it at the
// sequence's positions: the mask is the global problem's, exactly.
func packedTasks(gp *attn.Problem, l Layout, p, r, owner int) ([]task, error) {
	cq, ck := gp.Opt.CuSeqlensQ, gp.Opt.CuSeqlensK
	c := l.numChunks(p)
	var all []seqTask
	for s := range len(cq) - 1 {
		n, m := int(cq[s+1]-cq[s]), int(ck[s+1]-ck[s])
		if n == 0 || m == 0 {
			continue
		}
		g := *gp
		g.N, g.M = n, m
		qs, ks := chunksFor(l, p, r, n/c), chunksFor(l, p, owner, m/c)
		for i := range qs {
			qs[i].local += int(cq[s]) / p
		}
		for i := range ks {
			ks[i].local += int(ck[s]) / p
		}
		ts, err := plan(&g, qs, ks)
		if err != nil {
			return nil, fmt.Errorf("sequence %d: %w", s, err)
		}
		for _, t := range ts {
			all = append(all, seqTask{t, s})
		}
	}
	if gp.Opt.Dropout > 0 {
		out := make([]task, len(all))
		for i, t := range all {
			out[i] = t.task
			out[i].cuQ, out[i].cuK = placeSegment(t.s, t.nq), placeSegment(t.s, t.nk)
		}
		return out, nil
	}
	return packTasks(all), nil
}

// placeSegment returns the cu_seqlens of s empty segments followed by one
// of n tokens.
func placeSegment(s, n int) []int32 {
	cu := make([]int32, s+2)
	cu[s+1] = int32(n)
	return cu
}

// packTasks gathers tasks, in order, into packed calls: each joins the
// first call of the same window whose last query and key end at or before
// its own start, or begins a new call.
func packTasks(all []seqTask) []task {
	var groups [][]task
	for _, t := range all {
		joined := false
		for i, g := range groups {
			last := g[len(g)-1]
			if sameWindow(last.window, t.window) && last.q0+last.nq <= t.q0 && last.k0+last.nk <= t.k0 {
				groups[i] = append(g, t.task)
				joined = true
				break
			}
		}
		if !joined {
			groups = append(groups, []task{t.task})
		}
	}
	out := make([]task, len(groups))
	for i, g := range groups {
		out[i] = packCall(g)
	}
	return out
}

// packCall returns the one packed call of tasks g (in increasing order of
// queries and of keys, one window): it spans their queries and keys, and
// its cu_seqlens give each task a segment, a gap of queries a segment
// without keys and a gap of keys a segment without queries.
func packCall(g []task) task {
	first, last := g[0], g[len(g)-1]
	t := task{q0: first.q0, nq: last.q0 + last.nq - first.q0, k0: first.k0, nk: last.k0 + last.nk - first.k0, window: first.window}
	t.cuQ, t.cuK = []int32{0}, []int32{0}
	qe, ke := first.q0, first.k0 // ends of what the segments cover
	seg := func(q1, k1 int) {
		t.cuQ = append(t.cuQ, int32(q1-t.q0))
		t.cuK = append(t.cuK, int32(k1-t.k0))
		qe, ke = q1, k1
	}
	for _, m := range g {
		if m.q0 > qe {
			seg(m.q0, ke)
		}
		if m.k0 > ke {
			seg(qe, m.k0)
		}
		seg(m.q0+m.nq, m.k0+m.nk)
	}
	return t
}

// sameWindow reports whether two task windows mask alike.
func sameWindow(a, b *attn.Window) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// regroup reorders the tokens of x along axis, a packed batch with
// offsets cu laid out by layout l over p ranks: from rank order (rank
// t's shard at t·(total/P)) to the global packed order when toGlobal is
// set, else back.
func regroup(x attn.Tensor, axis int, cu []int32, l Layout, p int, toGlobal bool) (attn.Tensor, error) {
	out, err := attn.NewChecked(x.DType, x.Shape...)
	if err != nil {
		return attn.Tensor{}, err
	}
	per := x.Shape[axis] / p
	for t := range p {
		for _, ch := range packedChunks(l, cu, p, t) {
			src, dst := t*per+ch.local, ch.global
			if !toGlobal {
				src, dst = dst, src
			}
			if err := attn.CopyInto(narrow(out, axis, dst, ch.n), narrow(x, axis, src, ch.n)); err != nil {
				return attn.Tensor{}, err
			}
		}
	}
	return out, nil
}
