package cp

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/flashattn/flashattn/attn"
)

// HybridDegree returns the all-to-all degree A of the Hybrid scheme over p
// ranks for hkv key/value heads: groups when positive, else the largest
// divisor of hkv that divides p (their greatest common divisor). A must
// divide both, so that the R = p/A groups are equal and each rank of a
// group keeps whole groups of query heads with their key heads; otherwise
// it fails with an error wrapping attn.ErrUnsupported (attn.ErrOption for
// a negative groups or p < 1).
func HybridDegree(groups, hkv, p int) (int, error) {
	if groups < 0 || p < 1 || hkv < 1 {
		return 0, attn.Errorf(attn.ErrOption, "cp: hybrid all-to-all degree %d over %d ranks with %d key/value heads", groups, p, hkv)
	}
	a := groups
	if a == 0 {
		a = gcd(hkv, p)
	}
	if p%a != 0 || hkv%a != 0 {
		return 0, attn.Errorf(attn.ErrUnsupported,
			"cp: hybrid over %d ranks with all-to-all degree %d: the degree must divide both the ranks and the %d key/value heads",
			p, a, hkv)
	}
	return a, nil
}

// gcd returns the greatest common divisor of two positive integers.
func gcd(a, b int) int {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// hybridComms are one rank's sub-groups of the Hybrid scheme: rank
// r = j·A + i of P = A·R is member i of group j (the A ranks
// j·A … j·A+A−1, which trade heads) and rank j of ring i (the R ranks
// i, A+i, 2A+i, …, which pass K/V).
type hybridComms struct {
	degree      int
	group, ring Transport
}

// close closes the sub-groups that need it.
func (c *hybridComms) close() error {
	var errs []error
	for _, t := range []Transport{c.group, c.ring} {
		if cl, ok := t.(io.Closer); ok {
			errs = append(errs, cl.Close())
		}
	}
	return errors.Join(errs...)
}

// Close releases the sub-groups the Hybrid scheme split from the
// Transport (NCCL communicators); the Transport itself stays the
// caller's. An Attention that never ran Hybrid has nothing to release.
func (a *Attention) Close() error {
	if a.hybrid == nil {
		return nil
	}
	err := a.hybrid.close()
	a.hybrid = nil
	return err
}

// hybridComms returns this rank's sub-groups for hkv key/value heads,
// splitting them from the Transport on first use (and again when the
// degree changes). Every rank makes the same calls in the same order, so
// the splits, collectives of the whole group, match.
func (a *Attention) hybridComms(ctx context.Context, hkv int) (*hybridComms, error) {
	p, r := a.Transport.Size(), a.Transport.Rank()
	deg, err := HybridDegree(a.Groups, hkv, p)
	if err != nil {
		return nil, err
	}
	if a.hybrid != nil && a.hybrid.degree == deg {
		return a.hybrid, nil
	}
	if err := a.Close(); err != nil {
		return nil, err
	}
	j, i := r/deg, r%deg
	c := &hybridComms{degree: deg}
	if c.group, err = SplitGroup(ctx, a.Transport, j, i); err != nil {
		return nil, fmt.Errorf("cp: hybrid all-to-all groups of %d: %w", deg, err)
	}
	if c.ring, err = SplitGroup(ctx, a.Transport, i, j); err != nil {
		c.close()
		return nil, fmt.Errorf("cp: hybrid rings of %d: %w", p/deg, err)
	}
	a.hybrid = c
	return c, nil
}

// hybridStage is what the steps of one hybrid call share: the heads
// exchange within the group, the ring across groups, and the problems the
// ring sees (this group's heads; its local sequence is the group's).
type hybridStage struct {
	h        *heads
	ring     *Attention
	rlp, rgp *attn.Problem
}

// newHybrid prepares a hybrid call. Under the Zigzag layout the A shards of
// a group, gathered in the heads exchange's order, are exactly ring rank
// j's zigzag shard over R ranks (chunks j and 2R−1−j of 2R), and likewise
// for Contiguous; so the ring runs unchanged on the gathered sequence.
func (a *Attention) newHybrid(ctx context.Context, lp, gp *attn.Problem) (*hybridStage, error) {
	c, err := a.hybridComms(ctx, lp.Hkv)
	if err != nil {
		return nil, err
	}
	deg := c.degree
	group := &Attention{Backend: a.Backend, Transport: c.group, Layout: a.Layout, Scheme: AllToAll}
	h := &heads{a: group, p: deg, r: c.group.Rank()}
	rlp, rgp := *lp, *gp
	rlp.N, rlp.M = lp.N*deg, lp.M*deg
	rlp.H, rlp.Hkv, rgp.H, rgp.Hkv = lp.H/deg, lp.Hkv/deg, gp.H/deg, gp.Hkv/deg
	rgp.Opt = h.options(gp)
	rlp.Opt = rgp.Opt
	ring := &Attention{Backend: a.Backend, Transport: c.ring, Layout: a.Layout, Scheme: Ring}
	return &hybridStage{h: h, ring: ring, rlp: &rlp, rgp: &rgp}, nil
}

// hybridForward trades this rank's sequence shard for its group's sequence
// of 1/A of the heads, runs the ring forward across the groups on those
// heads, and trades O and the LSE back.
func (a *Attention) hybridForward(ctx context.Context, lp, gp *attn.Problem, q, k, v attn.Tensor) (attn.Result, error) {
	st, err := a.newHybrid(ctx, lp, gp)
	if err != nil {
		return attn.Result{}, err
	}
	in, err := st.h.allToHeads(ctx, []attn.Tensor{q, k, v}, []int{1, 1, 1}, []int{2, 2, 2})
	if err != nil {
		return attn.Result{}, err
	}
	res, err := st.ring.ringForward(ctx, st.rlp, st.rgp, in[0], in[1], in[2])
	if err != nil {
		return attn.Result{}, err
	}
	var out attn.Result
	if out.O, err = st.h.toSeq(ctx, res.O, 1, 2); err != nil {
		return attn.Result{}, err
	}
	out.LSE, err = st.h.toSeq(ctx, res.LSE, 2, 1)
	return out, err
}

// hybridBackward trades q, k, v, O, the LSE and dO as the forward does,
// runs the ring backward across the groups (dK and dV travel the ring
// back to their owners in float32), and trades dQ, dK and dV back.
func (a *Attention) hybridBackward(ctx context.Context, lp, gp *attn.Problem, q, k, v, o, lse, dO attn.Tensor) (attn.Gradients, error) {
	st, err := a.newHybrid(ctx, lp, gp)
	if err != nil {
		return attn.Gradients{}, err
	}
	in, err := st.h.allToHeads(ctx, []attn.Tensor{q, k, v, o, lse, dO}, []int{1, 1, 1, 1, 2, 1}, []int{2, 2, 2, 2, 1, 2})
	if err != nil {
		return attn.Gradients{}, err
	}
	g, err := st.ring.ringBackward(ctx, st.rlp, st.rgp, in[0], in[1], in[2], in[3], in[4], in[5])
	if err != nil {
		return attn.Gradients{}, err
	}
	var out attn.Gradients
	if out.DQ, err = st.h.toSeq(ctx, g.DQ, 1, 2); err != nil {
		return attn.Gradients{}, err
	}
	if out.DK, err = st.h.toSeq(ctx, g.DK, 1, 2); err != nil {
		return attn.Gradients{}, err
	}
	out.DV, err = st.h.toSeq(ctx, g.DV, 1, 2)
	return out, err
}

// ringPlace returns how strategy s runs rank r of p for kv key/value
// heads as ring steps: the number of steps, and the ring size and rank
// whose plan gives the rank's calls at each step (0, 0 for all-to-all,
// one call in one step).
func (s Strategy) ringPlace(hkv, p, r int) (steps, ringP, ringR int, err error) {
	switch s.Scheme {
	case Ring:
		return p, p, r, nil
	case Hybrid:
		deg, err := HybridDegree(s.Groups, hkv, p)
		if err != nil {
			return 0, 0, 0, err
		}
		return p / deg, p / deg, r / deg, nil
	}
	return 1, 0, 0, nil
}

// headsTraffic adds to e the all-to-alls of the heads exchange within
// groups of a ranks (all P ranks for all-to-all): the inputs trade
// sequence shards for head shards and the outputs trade back. Each rank
// holds 1/P of every tensor and sends (a−1)/a of that; nothing overlaps.
func (pr *Profile) headsTraffic(e *Estimate, g *attn.Problem, elem int64, a int) {
	p, ga := int64(e.P), int64(a)
	n, m := tokens(g)
	h, hkv, dk, dv := int64(g.H), int64(g.Hkv), int64(g.DK), int64(g.DV)
	q, k, v, o, lse := n*h*dk*elem, m*hkv*dk*elem, m*hkv*dv*elem, n*h*dv*elem, n*h*4
	in, out := []int64{q, k, v}, []int64{o, lse}
	if e.Backward {
		in, out = []int64{q, k, v, o, lse, o}, []int64{q, k, v}
	}
	for _, x := range append(in, out...) {
		if a > 1 {
			b := x / p / ga * (ga - 1)
			e.Exposed += pr.linkTime(b)
			e.Sent += b
		}
	}
}

// estimateHybrid fills e for hybrid: the heads exchange within groups of A
// (as all-to-all, on A ranks), then the ring of R = P/A groups on the
// group's 1/A of the heads, whose steps every member of a group runs
// alike, then the exchange back. The profile has one link, so the
// exchanges within and across groups share its bandwidth and latency.
func (pr *Profile) estimateHybrid(e *Estimate, g *attn.Problem, elem int64, rates []Rate, factor float64) error {
	deg, err := HybridDegree(e.Strategy.Groups, g.Hkv, e.P)
	if err != nil {
		return err
	}
	sub := *g
	sub.H, sub.Hkv = g.H/deg, g.Hkv/deg
	ring := Estimate{Strategy: Strategy{Layout: e.Strategy.Layout, Scheme: Ring}, P: e.P / deg, Backward: e.Backward}
	if err := pr.estimateRing(&ring, &sub, elem, rates, factor); err != nil {
		return err
	}
	pr.headsTraffic(e, g, elem, deg)
	e.Steps = ring.Steps
	e.Compute = ring.Compute
	e.Time = ring.Time + e.Exposed
	e.Exposed += ring.Exposed
	e.Work = ring.Work * float64(deg)
	e.Calls = ring.Calls * deg
	e.Sent += ring.Sent
	return nil
}
