package cp

import (
	"slices"

	"github.com/flashattn/flashattn/attn"
)

// Layout says which parts of a sequence each of the P ranks holds. The
// sequence is cut into equal chunks; a rank's shard is its chunks
// concatenated in increasing order of position.
type Layout int

const (
	// Contiguous cuts the sequence into P chunks; rank r holds chunk r.
	Contiguous Layout = iota
	// Zigzag cuts the sequence into 2P chunks; rank r holds chunks r and
	// 2P−1−r, so that under a causal mask every rank has the same work.
	Zigzag
)

// String returns "contiguous" or "zigzag".
func (l Layout) String() string { return name([]string{"contiguous", "zigzag"}, "Layout", int(l)) }

// numChunks returns the number of chunks a sequence is cut into for p ranks.
func (l Layout) numChunks(p int) int {
	if l == Zigzag {
		return 2 * p
	}
	return p
}

// chunksOf returns the chunks rank r holds, in local order.
func (l Layout) chunksOf(p, r int) []int {
	if l == Zigzag {
		return []int{r, 2*p - 1 - r}
	}
	return []int{r}
}

// check validates l, p and r.
func (l Layout) check(p, r int) error {
	if l != Contiguous && l != Zigzag {
		return attn.Errorf(attn.ErrOption, "cp: layout %d is neither contiguous nor zigzag", int(l))
	}
	if p < 1 || r < 0 || r >= p {
		return attn.Errorf(attn.ErrOption, "cp: rank %d of %d ranks", r, p)
	}
	return nil
}

// chunkLen returns the length of one chunk of a sequence of n for p ranks,
// or an error wrapping attn.ErrShape when the chunks would be uneven.
func (l Layout) chunkLen(n, p int) (int, error) {
	c := l.numChunks(p)
	if n < 0 || n%c != 0 {
		return 0, attn.Errorf(attn.ErrShape, "cp: a sequence of %d cannot be cut into %d equal chunks (%v layout, %d ranks): uneven shards",
			n, c, l, p)
	}
	return n / c, nil
}

// Positions returns the global positions, in local order, of the n/P
// elements that rank r of p holds of a sequence of n. It fails with an
// error wrapping attn.ErrShape when n is not a multiple of the number of
// chunks (P, or 2P for Zigzag), and attn.ErrOption for an unknown layout or
// a rank outside [0, p).
func Positions(l Layout, n, p, r int) ([]int, error) {
	if err := l.check(p, r); err != nil {
		return nil, err
	}
	c, err := l.chunkLen(n, p)
	if err != nil {
		return nil, err
	}
	pos := make([]int, 0, n/p)
	for _, ch := range l.chunksOf(p, r) {
		for i := range c {
			pos = append(pos, ch*c+i)
		}
	}
	return pos, nil
}

// narrow returns the view of t whose index along axis runs over
// [start, start+n).
func narrow(t attn.Tensor, axis, start, n int) attn.Tensor {
	st := t.Strides
	if st == nil {
		st = attn.ContiguousStrides(t.Shape)
	}
	v := t
	v.Shape = slices.Clone(t.Shape)
	v.Shape[axis] = n
	v.Strides = st
	v.Offset = t.Offset + start*st[axis]
	return v
}

// checkAxis validates a tensor and a sequence axis of it.
func checkAxis(name string, t attn.Tensor, axis int) error {
	if err := t.CheckLayout(name); err != nil {
		return err
	}
	if axis < 0 || axis >= t.Rank() {
		return attn.Errorf(attn.ErrShape, "cp: %s: axis %d of a tensor of shape %v", name, axis, t.Shape)
	}
	return nil
}

// Shard returns a contiguous copy of rank r's shard of t, whose sequence
// runs along axis (1 for q, k, v, O and their gradients, [B, N, H, D]; 2
// for the LSE, [B, H, N]). It fails with an error wrapping attn.ErrShape
// when the length along axis is not a multiple of the number of chunks
// (uneven shards are refused) or axis is out of range, attn.ErrOption for a
// bad layout or rank, and the error of t.CheckLayout for a malformed t.
func Shard(t attn.Tensor, axis int, l Layout, p, r int) (attn.Tensor, error) {
	if err := checkAxis("shard", t, axis); err != nil {
		return attn.Tensor{}, err
	}
	if err := l.check(p, r); err != nil {
		return attn.Tensor{}, err
	}
	c, err := l.chunkLen(t.Shape[axis], p)
	if err != nil {
		return attn.Tensor{}, err
	}
	shape := slices.Clone(t.Shape)
	shape[axis] = t.Shape[axis] / p
	out, err := attn.NewChecked(t.DType, shape...)
	if err != nil {
		return attn.Tensor{}, err
	}
	for i, ch := range l.chunksOf(p, r) {
		if err := attn.CopyInto(narrow(out, axis, i*c, c), narrow(t, axis, ch*c, c)); err != nil {
			return attn.Tensor{}, err
		}
	}
	return out, nil
}

// checkShards validates the shards of all ranks for reassembly along axis:
// at least one, a valid layout for their number, and one dtype and shape.
func checkShards(shards []attn.Tensor, axis int, l Layout) error {
	p := len(shards)
	if p == 0 {
		return attn.Errorf(attn.ErrShape, "cp: unshard: no shards")
	}
	if err := l.check(p, 0); err != nil {
		return err
	}
	for r, s := range shards {
		if err := checkAxis("unshard", s, axis); err != nil {
			return err
		}
		if s.DType != shards[0].DType {
			return attn.Errorf(attn.ErrDType, "cp: unshard: shard %d is %v, shard 0 %v", r, s.DType, shards[0].DType)
		}
		if !slices.Equal(s.Shape, shards[0].Shape) {
			return attn.Errorf(attn.ErrShape, "cp: unshard: shard %d has shape %v, shard 0 %v", r, s.Shape, shards[0].Shape)
		}
	}
	return nil
}

// Unshard reassembles the shards of all ranks, shards[r] being rank r's,
// into one contiguous tensor whose sequence runs along axis. The shards
// must share dtype and shape; it fails with an error wrapping attn.ErrShape
// (attn.ErrDType) when they do not, when there are none, or when the
// shard length is not a multiple of the chunks per rank.
func Unshard(shards []attn.Tensor, axis int, l Layout) (attn.Tensor, error) {
	if err := checkShards(shards, axis, l); err != nil {
		return attn.Tensor{}, err
	}
	p := len(shards)
	per := l.numChunks(p) / p
	n := shards[0].Shape[axis]
	if n%per != 0 {
		return attn.Tensor{}, attn.Errorf(attn.ErrShape, "cp: unshard: %d elements per shard is not %d equal chunks", n, per)
	}
	c := n / per
	shape := slices.Clone(shards[0].Shape)
	shape[axis] = n * p
	out, err := attn.NewChecked(shards[0].DType, shape...)
	if err != nil {
		return attn.Tensor{}, err
	}
	for r, s := range shards {
		for i, ch := range l.chunksOf(p, r) {
			if err := attn.CopyInto(narrow(out, axis, ch*c, c), narrow(s, axis, i*c, c)); err != nil {
				return attn.Tensor{}, err
			}
		}
	}
	return out, nil
}
