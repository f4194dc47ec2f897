package cp

import (
	"context"
	"slices"

	"github.com/flashattn/flashattn/attn"
)

// heads holds what the all-to-all exchanges of one call share.
type heads struct {
	a    *Attention
	p, r int
}

// newHeads checks that the key heads split evenly over the ranks: the
// degree of head parallelism is capped by Hkv, so that each rank keeps
// whole groups of query heads with their key heads.
func (a *Attention) newHeads(lp *attn.Problem) (*heads, error) {
	p := a.Transport.Size()
	if lp.Hkv%p != 0 {
		return nil, attn.Errorf(attn.ErrUnsupported,
			"cp: all-to-all over %d ranks needs the %d key/value heads to split evenly (the degree is capped by Hkv; use the ring)",
			p, lp.Hkv)
	}
	return &heads{a: a, p: p, r: a.Transport.Rank()}, nil
}

// options returns the global options for this rank's heads: under
// dropout its heads draw their part of the global problem's mask.
func (h *heads) options(gp *attn.Problem) attn.Options {
	o := gp.Opt
	if o.Dropout > 0 {
		o.DropoutAt = dropoutOrigin(gp.Opt, 0, 0, h.r*(gp.H/h.p), gp.H)
	}
	return o
}

// segments returns a contiguous tensor of P segments of shape seg and the
// view of each segment.
func segments(dt attn.DType, seg []int, p int) (attn.Tensor, []attn.Tensor, error) {
	n, err := attn.CheckShape("segment", seg)
	if err != nil {
		return attn.Tensor{}, nil, err
	}
	all, err := attn.NewChecked(dt, append([]int{p}, seg...)...)
	if err != nil {
		return attn.Tensor{}, nil, err
	}
	views := make([]attn.Tensor, p)
	for t := range views {
		views[t] = all
		views[t].Shape = slices.Clone(seg)
		views[t].Strides = attn.ContiguousStrides(seg)
		views[t].Offset = t * n
	}
	return all, views, nil
}

// allToAll allocates P send and P receive segments of shape seg, lets
// fill write the send segments (segment t goes to rank t), exchanges them
// and returns the receive segments (segment t came from rank t).
func (h *heads) allToAll(ctx context.Context, dt attn.DType, seg []int, fill func(send []attn.Tensor) error) ([]attn.Tensor, error) {
	send, sendSeg, err := segments(dt, seg, h.p)
	if err != nil {
		return nil, err
	}
	recv, recvSeg, err := segments(dt, seg, h.p)
	if err != nil {
		return nil, err
	}
	if err := fill(sendSeg); err != nil {
		return nil, err
	}
	if err := h.a.Transport.AllToAll(ctx, bytesOf(send), bytesOf(recv)); err != nil {
		return nil, err
	}
	return recvSeg, nil
}

// toHeads turns this rank's sequence shard x (sequence along seqAxis,
// every head along headAxis) into the whole sequence, in global order, of
// this rank's 1/P of the heads.
func (h *heads) toHeads(ctx context.Context, x attn.Tensor, seqAxis, headAxis int) (attn.Tensor, error) {
	hl := x.Shape[headAxis] / h.p
	seg := slices.Clone(x.Shape)
	seg[headAxis] = hl
	recvSeg, err := h.allToAll(ctx, x.DType, seg, func(send []attn.Tensor) error {
		for t := range h.p {
			if err := attn.CopyInto(send[t], narrow(x, headAxis, t*hl, hl)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return attn.Tensor{}, err
	}
	shape := slices.Clone(seg)
	n := x.Shape[seqAxis]
	shape[seqAxis] = n * h.p
	out, err := attn.NewChecked(x.DType, shape...)
	if err != nil {
		return attn.Tensor{}, err
	}
	c := n * h.p / h.a.Layout.numChunks(h.p)
	for t := range h.p {
		for _, ch := range chunksFor(h.a.Layout, h.p, t, c) {
			if err := attn.CopyInto(narrow(out, seqAxis, ch.global, ch.n), narrow(recvSeg[t], seqAxis, ch.local, ch.n)); err != nil {
				return attn.Tensor{}, err
			}
		}
	}
	return out, nil
}

// toSeq is the inverse of toHeads: from the whole sequence of this rank's
// heads y back to this rank's sequence shard of every head.
func (h *heads) toSeq(ctx context.Context, y attn.Tensor, seqAxis, headAxis int) (attn.Tensor, error) {
	hl := y.Shape[headAxis]
	n := y.Shape[seqAxis] / h.p
	seg := slices.Clone(y.Shape)
	seg[seqAxis] = n
	c := y.Shape[seqAxis] / h.a.Layout.numChunks(h.p)
	recvSeg, err := h.allToAll(ctx, y.DType, seg, func(send []attn.Tensor) error {
		for t := range h.p {
			for _, ch := range chunksFor(h.a.Layout, h.p, t, c) {
				if err := attn.CopyInto(narrow(send[t], seqAxis, ch.local, ch.n), narrow(y, seqAxis, ch.global, ch.n)); err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		return attn.Tensor{}, err
	}
	shape := slices.Clone(seg)
	shape[headAxis] = hl * h.p
	out, err := attn.NewChecked(y.DType, shape...)
	if err != nil {
		return attn.Tensor{}, err
	}
	for t := range h.p {
		if err := attn.CopyInto(narrow(out, headAxis, t*hl, hl), recvSeg[t]); err != nil {
			return attn.Tensor{}, err
		}
	}
	return out, nil
}

// allToHeads applies toHeads to each tensor in order.
func (h *heads) allToHeads(ctx context.Context, xs []attn.Tensor, seqAxis, headAxis []int) ([]attn.Tensor, error) {
	out := make([]attn.Tensor, len(xs))
	for i, x := range xs {
		var err error
		if out[i], err = h.toHeads(ctx, x, seqAxis[i], headAxis[i]); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// headsForward gathers the sequence and scatters the heads of q, k and v,
// attends over the whole sequence of this rank's heads with the global
// options, and scatters O and the LSE back to sequence shards.
func (a *Attention) headsForward(ctx context.Context, lp, gp *attn.Problem, q, k, v attn.Tensor) (attn.Result, error) {
	h, err := a.newHeads(lp)
	if err != nil {
		return attn.Result{}, err
	}
	in, err := h.allToHeads(ctx, []attn.Tensor{q, k, v}, []int{1, 1, 1}, []int{2, 2, 2})
	if err != nil {
		return attn.Result{}, err
	}
	res, err := a.Backend.Forward(in[0], in[1], in[2], h.options(gp))
	if err != nil {
		return attn.Result{}, err
	}
	var out attn.Result
	if out.O, err = h.toSeq(ctx, res.O, 1, 2); err != nil {
		return attn.Result{}, err
	}
	out.LSE, err = h.toSeq(ctx, res.LSE, 2, 1)
	return out, err
}

// headsBackward gathers the sequence of q, k, v, O, the LSE and dO for this
// rank's heads, runs the backward over the whole sequence, and scatters
// dQ, dK and dV back to sequence shards. Each gradient is computed whole
// on one rank: nothing is summed across ranks.
func (a *Attention) headsBackward(ctx context.Context, lp, gp *attn.Problem, q, k, v, o, lse, dO attn.Tensor) (attn.Gradients, error) {
	h, err := a.newHeads(lp)
	if err != nil {
		return attn.Gradients{}, err
	}
	in, err := h.allToHeads(ctx, []attn.Tensor{q, k, v, o, lse, dO}, []int{1, 1, 1, 1, 2, 1}, []int{2, 2, 2, 2, 1, 2})
	if err != nil {
		return attn.Gradients{}, err
	}
	g, err := a.Backend.Backward(in[0], in[1], in[2], in[3], in[4], in[5], h.options(gp))
	if err != nil {
		return attn.Gradients{}, err
	}
	var out attn.Gradients
	if out.DQ, err = h.toSeq(ctx, g.DQ, 1, 2); err != nil {
		return attn.Gradients{}, err
	}
	if out.DK, err = h.toSeq(ctx, g.DK, 1, 2); err != nil {
		return attn.Gradients{}, err
	}
	out.DV, err = h.toSeq(ctx, g.DV, 1, 2)
	return out, err
}
