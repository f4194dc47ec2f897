package cp

import (
	"context"
	"errors"
	"fmt"

	"github.com/flashattn/flashattn/attn"
)

// ErrAborted reports an operation that could not complete because the
// communication group was aborted: a rank failed, gave up or timed out.
// The error that caused the abort is wrapped too.
var ErrAborted = errors.New("communication group aborted")

// Send is one message of a grouped exchange: Data goes to rank Peer.
type Send struct {
	Peer int
	Data []byte
}

// Recv is one message of a grouped exchange: Data, whose length must equal
// the length the peer sends, is filled from rank Peer.
type Recv struct {
	Peer int
	Data []byte
}

// Transport moves bytes between the ranks of a communication group of
// Size ranks. Its operations follow NCCL's rules so that an implementation
// on NCCL can keep them: every rank calls the collectives (AllToAll,
// AllGather, Barrier) in the same order with the same sizes; the sends and
// receives of one Exchange are issued together as one group (NCCL's
// ncclGroupStart/End), so a ring of exchanges cannot deadlock; messages
// between two ranks are matched in the order they were issued. Buffers
// belong to the caller again when the call returns.
//
// Every operation returns an error when ctx ends (wrapping ctx.Err()),
// when sizes do not match (wrapping attn.ErrShape), or when the group has
// been aborted (wrapping ErrAborted); after an error the group is in an
// unknown state and should be aborted. A Transport is used by one goroutine
// at a time.
type Transport interface {
	// Rank returns this rank's index in [0, Size()).
	Rank() int
	// Size returns the number of ranks in the group.
	Size() int
	// Exchange sends and receives the given messages as one group and
	// returns when all of them have completed.
	Exchange(ctx context.Context, sends []Send, recvs []Recv) error
	// AllToAll splits send into Size() equal parts, sends part t to rank t
	// and fills part t of recv with what rank t sent to this rank. send
	// and recv have the same length, a multiple of Size().
	AllToAll(ctx context.Context, send, recv []byte) error
	// AllGather fills part t of recv, which is Size() times as long as
	// send, with rank t's send.
	AllGather(ctx context.Context, send, recv []byte) error
	// Barrier returns when every rank has entered it.
	Barrier(ctx context.Context) error
	// Abort makes every pending and later operation of every rank of the
	// group fail with an error wrapping ErrAborted and cause. Aborting an
	// aborted group does nothing.
	Abort(cause error)
}

// checkPeer returns an error unless peer is a rank of a group of size ranks.
func checkPeer(peer, size int) error {
	if peer < 0 || peer >= size {
		return attn.Errorf(attn.ErrOption, "cp: peer %d outside the group of %d ranks", peer, size)
	}
	return nil
}

// checkMessages returns an error unless every peer of an exchange by rank
// is a rank of a group of size ranks.
func checkMessages(rank, size int, sends []Send, recvs []Recv) error {
	for _, s := range sends {
		if err := checkPeer(s.Peer, size); err != nil {
			return fmt.Errorf("cp: rank %d: send: %w", rank, err)
		}
	}
	for _, r := range recvs {
		if err := checkPeer(r.Peer, size); err != nil {
			return fmt.Errorf("cp: rank %d: receive: %w", rank, err)
		}
	}
	return nil
}
