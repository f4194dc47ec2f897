package cp

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"

	"github.com/flashattn/flashattn/attn"
)

// mailboxDepth is the number of messages one ordered pair of ranks may
// have in flight; an Exchange posts at most a few per peer.
const mailboxDepth = 16

// message is one send in flight: a copy of the sender's bytes and the
// channel on which the receiver reports the outcome (nil: delivered).
type message struct {
	data []byte
	done chan error
}

// localGroup is the shared state of an in-process communication group.
// The sub-groups split from a group share its abort state, so that an
// abort anywhere reaches every operation of every rank.
type localGroup struct {
	size  int
	boxes [][]chan message // boxes[src][dst], FIFO per ordered pair
	*abortState
	splits splitTable // the sub-groups being formed (see SplitGroup)
}

// localRank is one rank's Transport of an in-process group.
type localRank struct {
	g      *localGroup
	rank   int
	nsplit int // the SplitGroup calls so far
}

// NewLocal returns the p Transports of a new in-process communication
// group: rank r is element r. The ranks exchange host memory through
// channels, each message copied once; they are meant to run in separate
// goroutines (see Run). It fails with an error wrapping attn.ErrOption when
// p < 1.
func NewLocal(p int) ([]Transport, error) {
	if p < 1 {
		return nil, attn.Errorf(attn.ErrOption, "cp: a group needs at least one rank, got %d", p)
	}
	g := newLocalGroup(p, &abortState{aborted: make(chan struct{})})
	ts := make([]Transport, p)
	for r := range ts {
		ts[r] = &localRank{g: g, rank: r}
	}
	return ts, nil
}

// Rank returns this rank's index.
func (t *localRank) Rank() int { return t.rank }

// Size returns the number of ranks in the group.
func (t *localRank) Size() int { return t.g.size }

// Abort aborts the whole group with cause.
func (t *localRank) Abort(cause error) { t.g.abort(cause) }

// fail aborts the group with err and returns err; the failing rank reports
// its own error, the others ErrAborted.
func (t *localRank) fail(err error) error {
	t.g.abort(err)
	return err
}

// interrupted returns the error for an operation stopped by ctx or by an
// abort, and aborts the group when ctx was the reason.
func (t *localRank) interrupted(ctx context.Context, op string) error {
	select {
	case <-t.g.aborted:
		return fmt.Errorf("cp: rank %d: %s: %w: %w", t.rank, op, ErrAborted, t.g.cause)
	default:
	}
	return t.fail(fmt.Errorf("cp: rank %d: %s: %w", t.rank, op, context.Cause(ctx)))
}

// Exchange posts every send, then fills every receive, then waits until
// each send has been received.
func (t *localRank) Exchange(ctx context.Context, sends []Send, recvs []Recv) error {
	g := t.g
	select {
	case <-g.aborted:
		return t.interrupted(ctx, "exchange")
	default:
	}
	if ctx.Err() != nil {
		return t.interrupted(ctx, "exchange")
	}
	if err := checkMessages(t.rank, g.size, sends, recvs); err != nil {
		return t.fail(err)
	}
	done := make([]chan error, len(sends))
	for i, s := range sends {
		m := message{data: append([]byte(nil), s.Data...), done: make(chan error, 1)}
		done[i] = m.done
		select {
		case g.boxes[t.rank][s.Peer] <- m:
		case <-g.aborted:
			return t.interrupted(ctx, "send")
		case <-ctx.Done():
			return t.interrupted(ctx, "send")
		}
	}
	for _, r := range recvs {
		var m message
		select {
		case m = <-g.boxes[r.Peer][t.rank]:
		case <-g.aborted:
			return t.interrupted(ctx, "receive")
		case <-ctx.Done():
			return t.interrupted(ctx, "receive")
		}
		if len(m.data) != len(r.Data) {
			err := attn.Errorf(attn.ErrShape, "cp: rank %d receives %d bytes from rank %d, which sent %d",
				t.rank, len(r.Data), r.Peer, len(m.data))
			m.done <- err
			return t.fail(err)
		}
		copy(r.Data, m.data)
		m.done <- nil
	}
	for i, d := range done {
		select {
		case err := <-d:
			if err != nil {
				return fmt.Errorf("cp: rank %d: send to rank %d: %w", t.rank, sends[i].Peer, err)
			}
		case <-g.aborted:
			return t.interrupted(ctx, "send")
		case <-ctx.Done():
			return t.interrupted(ctx, "send")
		}
	}
	return nil
}

// AllToAll exchanges the Size() parts of send and recv with every rank.
func (t *localRank) AllToAll(ctx context.Context, send, recv []byte) error {
	p := t.g.size
	if len(send) != len(recv) || len(send)%p != 0 {
		return t.fail(attn.Errorf(attn.ErrShape, "cp: rank %d: all-to-all of %d bytes into %d: both must be one multiple of the %d ranks",
			t.rank, len(send), len(recv), p))
	}
	part := len(send) / p
	sends, recvs := make([]Send, p), make([]Recv, p)
	for r := range p {
		sends[r] = Send{Peer: r, Data: send[r*part : (r+1)*part]}
		recvs[r] = Recv{Peer: r, Data: recv[r*part : (r+1)*part]}
	}
	return t.Exchange(ctx, sends, recvs)
}

// AllGather gathers every rank's send into recv, in rank order.
func (t *localRank) AllGather(ctx context.Context, send, recv []byte) error {
	p := t.g.size
	if len(recv) != p*len(send) {
		return t.fail(attn.Errorf(attn.ErrShape, "cp: rank %d: all-gather of %d bytes into %d: want %d ranks × %d",
			t.rank, len(send), len(recv), p, len(send)))
	}
	part := len(send)
	sends, recvs := make([]Send, p), make([]Recv, p)
	for r := range p {
		sends[r] = Send{Peer: r, Data: send}
		recvs[r] = Recv{Peer: r, Data: recv[r*part : (r+1)*part]}
	}
	return t.Exchange(ctx, sends, recvs)
}

// Barrier exchanges an empty message with every rank.
func (t *localRank) Barrier(ctx context.Context) error {
	p := t.g.size
	sends, recvs := make([]Send, p), make([]Recv, p)
	for r := range p {
		sends[r] = Send{Peer: r}
		recvs[r] = Recv{Peer: r}
	}
	return t.Exchange(ctx, sends, recvs)
}

// Run runs fn on the p ranks of a new in-process group (NewLocal), each in
// its own goroutine, and returns when all have returned. The first rank to
// fail aborts the group and cancels the context the others see, so none is
// left waiting; Run returns the error that caused the abort, naming its
// rank, rather than the others' errors, which wrap ErrAborted and are its
// consequences. A panic in fn is
// returned as an error. It fails with an error wrapping attn.ErrOption when
// p < 1.
func Run(ctx context.Context, p int, fn func(ctx context.Context, t Transport) error) error {
	ts, err := NewLocal(p)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var (
		mu    sync.Mutex
		first error
		wg    sync.WaitGroup
	)
	for r, t := range ts {
		wg.Go(func() {
			err := runRank(ctx, r, t, fn)
			if err == nil {
				return
			}
			mu.Lock()
			if first == nil || errors.Is(first, ErrAborted) && !errors.Is(err, ErrAborted) {
				first = err
			}
			mu.Unlock()
			t.Abort(err)
			cancel(err)
		})
	}
	wg.Wait()
	return first
}

// runRank calls fn for rank r, turning a panic into an error.
func runRank(ctx context.Context, r int, t Transport, fn func(context.Context, Transport) error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("cp: rank %d panicked: %v\n%s", r, v, debug.Stack())
		}
	}()
	if err := fn(ctx, t); err != nil {
		if errors.Is(err, ErrAborted) {
			return err
		}
		return fmt.Errorf("cp: rank %d: %w", r, err)
	}
	return nil
}
