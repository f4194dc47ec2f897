package cp

import (
	"cmp"
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"sync"

	"github.com/flashattn/flashattn/attn"
)

// GroupSplitter is a Transport that can split its group into sub-groups,
// as ncclCommSplit does. The in-process transport implements it; NCCL does
// where the library has ncclCommSplit (2.18 or newer).
type GroupSplitter interface {
	// SplitGroup is a collective of the group: every rank calls it, in the
	// same order relative to the group's other collectives. The ranks that
	// pass the same color (≥ 0) form a new group, ranked there by key and
	// then by their rank in this group. The new group is a Transport of
	// its own, used like this one and by the same goroutine; aborting
	// either group aborts both. A sub-group that implements io.Closer is
	// the caller's to close.
	SplitGroup(ctx context.Context, color, key int) (Transport, error)
}

// SplitGroup splits t's group into sub-groups by color, ordered by key
// (see GroupSplitter). A transport that cannot split fails with an error
// wrapping attn.ErrUnsupported; a negative color with attn.ErrOption.
func SplitGroup(ctx context.Context, t Transport, color, key int) (Transport, error) {
	s, ok := t.(GroupSplitter)
	if !ok {
		return nil, attn.Errorf(attn.ErrUnsupported, "cp: a %T transport cannot split its group into sub-groups", t)
	}
	return s.SplitGroup(ctx, color, key)
}

// members gathers every rank's color and key through t and returns the
// ranks of t's group whose color is color, in their order in the new
// group (by key, then by rank).
func members(ctx context.Context, t Transport, color, key int) ([]int, error) {
	if color < 0 {
		return nil, attn.Errorf(attn.ErrOption, "cp: rank %d: split color %d: every rank joins a sub-group (color ≥ 0)", t.Rank(), color)
	}
	p := t.Size()
	send, recv := make([]byte, 16), make([]byte, 16*p)
	binary.LittleEndian.PutUint64(send, uint64(color))
	binary.LittleEndian.PutUint64(send[8:], uint64(key))
	if err := t.AllGather(ctx, send, recv); err != nil {
		return nil, fmt.Errorf("cp: split: %w", err)
	}
	type place struct{ rank, key int }
	var in []place
	for r := range p {
		if int(binary.LittleEndian.Uint64(recv[16*r:])) == color {
			in = append(in, place{r, int(binary.LittleEndian.Uint64(recv[16*r+8:]))})
		}
	}
	slices.SortStableFunc(in, func(a, b place) int { return cmp.Compare(a.key, b.key) })
	out := make([]int, len(in))
	for i, pl := range in {
		out[i] = pl.rank
	}
	return out, nil
}

// abortState is the abort of an in-process group and its sub-groups.
type abortState struct {
	once    sync.Once
	aborted chan struct{} // closed by abort, after cause is set
	cause   error
}

// abort records cause and fails every pending and later operation.
func (a *abortState) abort(cause error) {
	a.once.Do(func() {
		a.cause = cause
		close(a.aborted)
	})
}

// newLocalGroup returns the state of an in-process group of p ranks with
// the given abort state.
func newLocalGroup(p int, ab *abortState) *localGroup {
	g := &localGroup{size: p, abortState: ab, boxes: make([][]chan message, p)}
	for s := range g.boxes {
		g.boxes[s] = make([]chan message, p)
		for d := range g.boxes[s] {
			g.boxes[s][d] = make(chan message, mailboxDepth)
		}
	}
	return g
}

// splitKey names one sub-group being formed: the split's sequence number
// in the parent group and the color.
type splitKey struct{ seq, color int }

// splitEntry is a sub-group being formed and how many members have yet to
// take it.
type splitEntry struct {
	g    *localGroup
	left int
}

// splitTable holds the sub-groups being formed, so that the first member
// to arrive makes each and the others find it.
type splitTable struct {
	mu      sync.Mutex
	pending map[splitKey]*splitEntry
}

// take returns the sub-group of key with size members, making it when it
// is the first to ask.
func (st *splitTable) take(k splitKey, size int, ab *abortState) *localGroup {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.pending == nil {
		st.pending = map[splitKey]*splitEntry{}
	}
	e, ok := st.pending[k]
	if !ok {
		e = &splitEntry{g: newLocalGroup(size, ab), left: size}
		st.pending[k] = e
	}
	if e.left--; e.left == 0 {
		delete(st.pending, k)
	}
	return e.g
}

// SplitGroup splits the in-process group (see GroupSplitter): the ranks
// learn each other's colors and keys through an all-gather on this group,
// and the sub-group shares its abort.
func (t *localRank) SplitGroup(ctx context.Context, color, key int) (Transport, error) {
	seq := t.nsplit
	t.nsplit++
	ms, err := members(ctx, t, color, key)
	if err != nil {
		return nil, t.fail(err)
	}
	sub := t.g.splits.take(splitKey{seq, color}, len(ms), t.g.abortState)
	return &localRank{g: sub, rank: slices.Index(ms, t.rank)}, nil
}
