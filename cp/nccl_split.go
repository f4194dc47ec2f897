package cp

import (
	"context"
	"fmt"
	"unsafe"

	"github.com/flashattn/flashattn/attn"
)

var _ GroupSplitter = (*NCCL)(nil)

// SplitGroup splits the communicator's group with ncclCommSplit (NCCL 2.18
// or newer): the ranks that pass the same color (≥ 0) form a new
// communicator, ranked by key and then by their rank here, on the same
// device, with the parent's configuration (blocking or not) and timeout
// and a stream of its own. It is a collective of the whole group. The
// colors and keys are first gathered through the group (the same
// placement the in-process transport computes), so that the new rank and
// size are known and checked. The new communicator belongs to the
// caller, who closes it; it joins the parent's abort group, so that
// aborting either aborts both. With an older library it fails with an
// error wrapping attn.ErrUnsupported; use a transport per sub-group made
// with NewNCCL then.
func (n *NCCL) SplitGroup(ctx context.Context, color, key int) (Transport, error) {
	if n.api == nil || n.api.commSplit == 0 {
		version := 0
		if n.api != nil {
			version = n.api.version
		}
		return nil, attn.Errorf(attn.ErrUnsupported, "cp: rank %d: NCCL %d has no ncclCommSplit (it needs 2.18 or newer)", n.rank, version)
	}
	ms, err := members(ctx, n, color, key)
	if err != nil {
		return nil, n.fail(err)
	}
	rank := -1
	for i, r := range ms {
		if r == n.rank {
			rank = i
		}
	}
	sub := &NCCL{api: n.api, dev: n.dev, comm: newCommCell(), rank: rank, size: len(ms), blocking: n.blocking,
		timeout: n.timeout, group: n.group}
	op := fmt.Sprintf("rank %d: ncclCommSplit(color %d, key %d)", n.rank, color, key)
	var r uintptr
	n.mu.RLock()
	err = n.usable("ncclCommSplit")
	if err == nil {
		parent := *n.comm
		// A nil configuration inherits the parent's.
		err = n.dev.Do(func() error {
			r = ncall(n.api.commSplit, parent, uintptr(int32(color)), uintptr(int32(key)), uintptr(unsafe.Pointer(sub.comm)), 0)
			return nil
		})
	}
	n.mu.RUnlock()
	if err != nil {
		return nil, n.fail(err)
	}
	if res := result(r); res != NCCLSuccess && res != NCCLInProgress {
		return nil, n.fail(n.api.err(op, res, 0))
	}
	g := n.group
	g.mu.Lock()
	g.comms = append(g.comms, sub)
	g.mu.Unlock()
	if n.aborted.Load() {
		sub.aborted.Store(true)
		sub.abortComm()
		return nil, fmt.Errorf("cp: %s: %w: %w", op, ErrAborted, g.cause)
	}
	ctx, cancel := sub.bound(ctx)
	defer cancel()
	if err := sub.settle(ctx, op); err != nil {
		return nil, err
	}
	if err := sub.finish(); err != nil {
		return nil, sub.fail(err)
	}
	return sub, nil
}
