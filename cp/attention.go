package cp

import (
	"context"
	"strconv"

	"github.com/flashattn/flashattn/attn"
)

// Attention computes attention with context parallelism on one rank of a
// communication group. Every rank of the group calls Forward (Backward)
// with its own shards, in the same order, with the same options; the
// shards are those Shard cuts with Layout: q [B, N/P, H, DK], k
// [B, M/P, Hkv, DK], v [B, M/P, Hkv, DV], O and dO [B, N/P, H, DV], the
// LSE [B, H, N/P], where N and M are the global sequence lengths. The
// options are those of the global problem (the mask and its alignment
// refer to global positions). The results are this rank's shards of the
// global results, equal to single-device attention within rounding.
//
// A packed variable-length batch passes the global cu_seqlens in opt; the
// shards are those ShardPacked cuts (q [totalQ/P, H, DK], k and v
// [totalK/P, Hkv, D], O and dO [totalQ/P, H, DV], the LSE [H, totalQ/P]),
// rank r holding its chunks of every sequence, with the offsets
// LocalCuSeqlens returns.
//
// Dropout draws the mask of the global problem (keyed by global positions
// and heads through attn.Options.DropoutAt), so it needs a backend that
// implements DropoutAt (the CPU backend; the CUDA backend at key origins
// that are multiples of 16). Not supported yet (an error wrapping
// attn.ErrUnsupported): an additive bias.
type Attention struct {
	// Backend computes each rank's local attention blocks.
	Backend attn.Backend
	// Transport connects this rank to the others.
	Transport Transport
	// Layout is the way the sequences are sharded.
	Layout Layout
	// Scheme is the way the work is shared.
	Scheme Scheme
	// Groups is the all-to-all degree A of the Hybrid scheme: 0 picks the
	// largest divisor of Hkv that divides P (see HybridDegree).
	Groups int

	hybrid *hybridComms // the Hybrid scheme's sub-groups, made on first use
}

// setup validates the shards and options of one call and returns the local
// problem and the global one (sizes and resolved mask).
func (a *Attention) setup(q, k, v attn.Tensor, opt attn.Options) (lp, gp *attn.Problem, err error) {
	if a.Backend == nil || a.Transport == nil {
		return nil, nil, attn.Errorf(attn.ErrOption, "cp: Attention needs a Backend and a Transport")
	}
	if a.Scheme != Ring && a.Scheme != AllToAll && a.Scheme != Hybrid {
		return nil, nil, attn.Errorf(attn.ErrOption, "cp: scheme %d is not ring, all-to-all or hybrid", int(a.Scheme))
	}
	p, r := a.Transport.Size(), a.Transport.Rank()
	if err := a.Layout.check(p, r); err != nil {
		return nil, nil, err
	}
	if packed(opt) {
		return a.setupPacked(q, k, v, opt)
	}
	if err := unsupported(opt); err != nil {
		return nil, nil, err
	}
	lp, err = attn.NewProblem(q, k, v, opt)
	if err != nil {
		return nil, nil, err
	}
	per := a.Layout.numChunks(p) / p
	if lp.N%per != 0 || lp.M%per != 0 {
		return nil, nil, attn.Errorf(attn.ErrShape, "cp: shards of %d queries and %d keys are not %d equal %v chunks: uneven shards",
			lp.N, lp.M, per, a.Layout)
	}
	g := *lp
	if g.N > maxInt/p || g.M > maxInt/p {
		return nil, nil, attn.Errorf(attn.ErrShape, "cp: %d ranks × shards of %d queries and %d keys overflow int", p, lp.N, lp.M)
	}
	g.N, g.M = lp.N*p, lp.M*p
	g.ResolveMask()
	return lp, &g, nil
}

// unsupported returns an error wrapping attn.ErrUnsupported for the
// options context parallelism does not handle yet.
func unsupported(opt attn.Options) error {
	if opt.Bias != nil {
		return attn.Errorf(attn.ErrUnsupported, "cp: an additive bias with context parallelism")
	}
	return nil
}

// maxInt is the largest int.
const maxInt = int(^uint(0) >> 1)

// Forward computes this rank's shard of O and of the LSE. An error on any
// rank aborts the group, so that the other ranks return an error too
// instead of waiting; the same holds for Backward.
func (a *Attention) Forward(ctx context.Context, q, k, v attn.Tensor, opt attn.Options) (attn.Result, error) {
	lp, gp, err := a.setup(q, k, v, opt)
	if err != nil {
		return attn.Result{}, a.abort(err)
	}
	var res attn.Result
	if lp.Varlen {
		res, err = a.packedForward(ctx, lp, gp, q, k, v)
	} else if a.Scheme == AllToAll {
		res, err = a.headsForward(ctx, lp, gp, q, k, v)
	} else if a.Scheme == Hybrid {
		res, err = a.hybridForward(ctx, lp, gp, q, k, v)
	} else {
		res, err = a.ringForward(ctx, lp, gp, q, k, v)
	}
	return res, a.abort(err)
}

// abort aborts the group when err is not nil, and returns err.
func (a *Attention) abort(err error) error {
	if err != nil && a.Transport != nil {
		a.Transport.Abort(err)
	}
	return err
}

// Backward computes this rank's shards of dQ, dK and dV from its shards of
// q, k, v, of the forward's O and LSE, and of dO; opt is the forward's.
func (a *Attention) Backward(ctx context.Context, q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	lp, gp, err := a.setup(q, k, v, opt)
	if err == nil {
		err = lp.CheckBackward(q, o, lse, dO)
	}
	if err != nil {
		return attn.Gradients{}, a.abort(err)
	}
	var g attn.Gradients
	if lp.Varlen {
		g, err = a.packedBackward(ctx, lp, gp, q, k, v, o, lse, dO)
	} else if a.Scheme == AllToAll {
		g, err = a.headsBackward(ctx, lp, gp, q, k, v, o, lse, dO)
	} else if a.Scheme == Hybrid {
		g, err = a.hybridBackward(ctx, lp, gp, q, k, v, o, lse, dO)
	} else {
		g, err = a.ringBackward(ctx, lp, gp, q, k, v, o, lse, dO)
	}
	return g, a.abort(err)
}

// taskOptions returns the backend options of one block: the global scale,
// softcap and dropout, the block's window aligned top-left and cu_seqlens
// (packed batches), and under dropout the block's place in the global
// problem.
func taskOptions(gp *attn.Problem, t task) attn.Options {
	o := gp.Opt
	opt := attn.Options{Scale: gp.Scale, Softcap: o.Softcap, Align: attn.AlignTopLeft, Window: t.window,
		Deterministic: o.Deterministic, Dropout: o.Dropout, Seed: o.Seed, Offset: o.Offset,
		CuSeqlensQ: t.cuQ, CuSeqlensK: t.cuK}
	if o.Dropout > 0 {
		opt.DropoutAt = dropoutOrigin(o, t.gq0, t.gk0, 0, 0)
	}
	return opt
}

// dropoutOrigin returns the dropout origin of a call whose first query,
// key and head are at query, key and head of the global problem of heads
// query heads (0: the call's own), itself placed by o.DropoutAt.
func dropoutOrigin(o attn.Options, query, key, head, heads int) *attn.DropoutOrigin {
	d := attn.DropoutOrigin{Query: query, Key: key, Head: head, Heads: heads}
	if b := o.DropoutAt; b != nil {
		d.Query += b.Query
		d.Key += b.Key
		d.Head += b.Head
		if b.Heads != 0 {
			d.Heads = b.Heads
		}
	}
	return &d
}

// Scheme is the way the ranks share the work of one attention call.
type Scheme int

const (
	// Ring keeps each rank's queries in place and passes the K/V blocks
	// around the ring of ranks, one hop per step, merging the partial
	// outputs through their LSE; with the Zigzag layout a causal mask gives
	// every rank the same work.
	Ring Scheme = iota
	// AllToAll (DeepSpeed's Ulysses) trades sequence shards for head
	// shards with one all-to-all, so that each rank attends over the whole
	// sequence for Hkv/P key heads, and trades back. P must divide Hkv.
	AllToAll
	// Hybrid splits the P = A·R ranks into R groups of A consecutive
	// ranks: all-to-all within each group trades its sequence shards for
	// 1/A of the heads, a ring of R across the groups passes K/V for those
	// heads, and all-to-all trades back. A divides Hkv and P.
	Hybrid
)

// String returns "ring", "all-to-all" or "hybrid".
func (s Scheme) String() string {
	return name([]string{"ring", "all-to-all", "hybrid"}, "Scheme", int(s))
}

// name returns names[i], or kind(i) when i is out of range.
func name(names []string, kind string, i int) string {
	if i >= 0 && i < len(names) {
		return names[i]
	}
	return kind + "(" + strconv.Itoa(i) + ")"
}
