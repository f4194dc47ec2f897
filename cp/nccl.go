package cp

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// DefaultNCCLTimeout bounds an NCCL operation (creating a communicator,
// enqueuing a group, waiting for a stream) whose context has no deadline.
const DefaultNCCLTimeout = 5 * time.Minute

// DeviceSpan is Len bytes of device memory at byte offset Off of Buf. A
// span of length 0 may have a nil Buf.
type DeviceSpan struct {
	Buf      *cuda.Buffer
	Off, Len int64
}

// DeviceSend is one message of a grouped device exchange: Data goes to
// rank Peer.
type DeviceSend struct {
	Peer int
	Data DeviceSpan
}

// DeviceRecv is one message of a grouped device exchange: Data, whose
// length must equal the length the peer sends, is filled from rank Peer.
type DeviceRecv struct {
	Peer int
	Data DeviceSpan
}

// DeviceTransport moves device memory between the ranks of a
// communication group, each rank on its own GPU. It keeps Transport's
// rules (collectives called by every rank in the same order with the same
// sizes, the messages of one exchange issued as one group, messages
// between two ranks matched in order) but its operations are stream
// ordered, as NCCL's are: ExchangeOn, AllToAllOn and AllGatherOn enqueue
// the transfer on stream s (nil: the transport's own stream) after the
// work already there, and return before it has run; the buffers must stay
// untouched until the stream has passed it. Wait waits for a stream while
// watching the group for errors, so that a peer's failure or a transfer
// that never completes ends with an error instead of a hang.
//
// The transport's own Transport methods (NCCL implements both interfaces)
// stage host bytes through device memory and complete before returning;
// they let the byte-level algorithms of this package run across processes
// unchanged.
type DeviceTransport interface {
	// Rank returns this rank's index in [0, Size()).
	Rank() int
	// Size returns the number of ranks in the group.
	Size() int
	// Device returns the GPU this rank's buffers must live on.
	Device() *cuda.Device
	// ExchangeOn enqueues the sends and receives as one group on s.
	ExchangeOn(ctx context.Context, s *cuda.Stream, sends []DeviceSend, recvs []DeviceRecv) error
	// AllToAllOn enqueues an all-to-all on s: send and recv have the same
	// length, a multiple of Size(); part t of send goes to rank t, and part
	// t of recv is filled by rank t.
	AllToAllOn(ctx context.Context, s *cuda.Stream, send, recv DeviceSpan) error
	// AllGatherOn enqueues an all-gather on s: part t of recv, which is
	// Size() times as long as send, is filled with rank t's send.
	AllGatherOn(ctx context.Context, s *cuda.Stream, send, recv DeviceSpan) error
	// Wait returns when everything enqueued on s so far has completed.
	Wait(ctx context.Context, s *cuda.Stream) error
	// Abort makes every pending and later operation fail with an error
	// wrapping ErrAborted and cause.
	Abort(cause error)
}

// NCCL is one rank's communicator of an NCCL group: a DeviceTransport on
// its GPU and, by staging through device memory, a Transport. Every NCCL
// call that needs the GPU's context runs on the cuda.Device's executor
// thread (cuda.Device.Do). Communicators made by NewNCCL are non-blocking
// (NCCL 2.14 or newer): creating one and enqueuing a group return at once
// and the communicator is polled (ncclCommGetAsyncError) until it is
// ready, with a deadline. An error NCCL reports, or a deadline that
// passes, aborts the communicator (ncclCommAbort); later operations fail
// with ErrAborted. Operations are used by one goroutine at a time; Abort
// may be called from any goroutine. Close it when done.
type NCCL struct {
	api        *ncclAPI
	dev        *cuda.Device
	comm       *uintptr // the ncclComm_t, in a heap cell NCCL may write to
	cfg        *ncclConfig
	rank, size int
	blocking   bool
	timeout    time.Duration
	stream     *cuda.Stream
	group      *ncclGroup

	scratch *cuda.Buffer // staging memory of the Transport methods

	// mu is held for reading around each NCCL call on comm and for
	// writing while the communicator is torn down.
	mu       sync.RWMutex
	aborted  atomic.Bool // no more calls: the group was aborted
	released atomic.Bool // ncclCommAbort was called
	closed   bool
}

// ncclGroup ties the communicators one process created together, so that
// aborting one aborts all (Transport.Abort's contract).
type ncclGroup struct {
	once  sync.Once
	cause error
	mu    sync.Mutex // guards comms, which SplitGroup extends
	comms []*NCCL
}

var (
	_ Transport       = (*NCCL)(nil)
	_ DeviceTransport = (*NCCL)(nil)
)

// newCommCell returns a heap cell for an ncclComm_t.
//
//go:noinline
func newCommCell() *uintptr { return new(uintptr) }

// checkGroupShape validates a rank and a group size.
func checkGroupShape(rank, size int) error {
	if size < 1 {
		return attn.Errorf(attn.ErrOption, "cp: a group needs at least one rank, got %d", size)
	}
	return checkPeer(rank, size)
}

// NewNCCL joins rank of an NCCL group of size ranks on dev (one process
// per GPU): every rank calls it with the same id, which rank 0 made with
// NewNCCLUniqueID. It returns when every rank has joined, or fails when
// ctx ends (DefaultNCCLTimeout without a deadline), aborting what it
// started. It fails with an error wrapping ErrNoNCCL when NCCL does not
// load, attn.ErrOption for a bad rank or size, and ErrNCCL when NCCL
// fails. With an NCCL older than 2.14 the communicator is blocking and
// its creation cannot be interrupted.
func NewNCCL(ctx context.Context, dev *cuda.Device, id NCCLUniqueID, rank, size int) (*NCCL, error) {
	if dev == nil {
		return nil, attn.Errorf(attn.ErrOption, "cp: NewNCCL needs a device")
	}
	if err := checkGroupShape(rank, size); err != nil {
		return nil, err
	}
	a, err := loadNCCL()
	if err != nil {
		return nil, err
	}
	n := &NCCL{api: a, dev: dev, comm: newCommCell(), rank: rank, size: size, timeout: DefaultNCCLTimeout}
	n.group = &ncclGroup{comms: []*NCCL{n}}
	arg := ncclUniqueIDArg{internal: id}
	ctx, cancel := n.bound(ctx)
	defer cancel()
	op := fmt.Sprintf("rank %d of %d: ncclCommInitRank", rank, size)
	if a.commInitRankCfg != nil {
		n.cfg = newNCCLConfig()
		var r NCCLResult
		if err := dev.Do(func() error {
			r = NCCLResult(a.commInitRankCfg(n.comm, int32(size), arg, int32(rank), n.cfg))
			return nil
		}); err != nil {
			return nil, fmt.Errorf("cp: %s: %w", op, err)
		}
		if r != NCCLSuccess && r != NCCLInProgress {
			return nil, a.err(op+"Config", r, 0)
		}
		if err := n.settle(ctx, op); err != nil {
			n.destroy()
			return nil, err
		}
	} else {
		n.blocking = true
		done := make(chan error, 1)
		go func() {
			done <- dev.Do(func() error {
				return a.check(op, uintptr(a.commInitRank(n.comm, int32(size), arg, int32(rank))), 0)
			})
		}()
		select {
		case err := <-done:
			if err != nil {
				return nil, err
			}
		case <-ctx.Done():
			return nil, fmt.Errorf("cp: %s: %w (the blocking init of this NCCL cannot be interrupted)", op, context.Cause(ctx))
		}
	}
	if err := n.finish(); err != nil {
		n.destroy()
		return nil, err
	}
	return n, nil
}

// NewNCCLAll makes one communicator per device, a group of len(devs)
// ranks driven by this process: rank r runs on devs[r] and is used from
// its own goroutine (see Run). It takes a unique id (ncclGetUniqueId, as
// OpenNCCL's rank 0 does) and creates every rank in one NCCL group on an
// OS thread of its own: ncclGroupStart, then for each rank its device's
// context made current on that thread (cuda.Device.MakeCurrent) and
// ncclCommInitRankConfig, then ncclGroupEnd. The communicators are
// non-blocking, like NewNCCL's, and are polled until ready; an NCCL error,
// or ctx ending first (DefaultNCCLTimeout without a deadline), aborts
// them all. With an NCCL older than 2.14 (no ncclCommInitRankConfig) each
// rank is made by ncclCommInitRank instead, the communicators are
// blocking, and their creation cannot be interrupted: at the deadline
// NewNCCLAll returns, and what the group made is aborted when it returns.
// Aborting one communicator aborts all. It fails like NewNCCL, and with
// attn.ErrOption when a device is nil or repeated.
func NewNCCLAll(ctx context.Context, devs []*cuda.Device) ([]*NCCL, error) {
	if len(devs) == 0 {
		return nil, attn.Errorf(attn.ErrOption, "cp: NewNCCLAll needs at least one device")
	}
	seen := map[*cuda.Device]bool{}
	for i, d := range devs {
		if d == nil || seen[d] {
			return nil, attn.Errorf(attn.ErrOption, "cp: NewNCCLAll: device %d is nil or repeated", i)
		}
		seen[d] = true
	}
	a, err := loadNCCL()
	if err != nil {
		return nil, err
	}
	id, err := a.uniqueID()
	if err != nil {
		return nil, err
	}
	comms := newProcessGroup(a, devs)
	if err := initGroup(ctx, comms, id, func(r int) error { return devs[r].MakeCurrent() }); err != nil {
		return nil, err
	}
	for _, n := range comms {
		if err := n.finish(); err != nil {
			n.destroy()
			for _, m := range comms {
				m.Close() // the streams made so far; the communicators are aborted
			}
			return nil, err
		}
	}
	return comms, nil
}

// newProcessGroup returns the communicators, not yet created, of a group
// of len(devs) ranks in this process, rank r on devs[r], sharing one abort
// group.
func newProcessGroup(a *ncclAPI, devs []*cuda.Device) []*NCCL {
	g := &ncclGroup{}
	for r, d := range devs {
		g.comms = append(g.comms, &NCCL{api: a, dev: d, comm: newCommCell(), rank: r, size: len(devs),
			timeout: DefaultNCCLTimeout, group: g})
	}
	return g.comms
}

// initGroup creates comms (rank r at comms[r], all of one group) with the
// unique id in one NCCL group, issued by groupInit on a new OS thread that
// ends with it; current(r) makes rank r's device current on the calling
// thread. It then waits until every non-blocking communicator is ready. An
// NCCL error, a device that cannot be made current, or ctx ending first
// (the communicators' timeout without a deadline) aborts the group; a
// blocking group still inside NCCL at the deadline is aborted when its
// calls return.
func initGroup(ctx context.Context, comms []*NCCL, id NCCLUniqueID, current func(rank int) error) error {
	a, size := comms[0].api, len(comms)
	var cfg *ncclConfig
	if a.commInitRankCfg != nil {
		cfg = newNCCLConfig()
	}
	for _, n := range comms {
		n.cfg, n.blocking = cfg, cfg == nil
	}
	ctx, cancel := comms[0].bound(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		// The thread keeps the last device current: it ends with the
		// goroutine instead of returning to the scheduler.
		runtime.LockOSThread()
		done <- groupInit(a, comms, id, cfg, current)
	}()
	select {
	case err := <-done:
		if err != nil {
			comms[0].destroy()
			return err
		}
	case <-ctx.Done():
		go func() {
			<-done
			comms[0].destroy()
		}()
		err := fmt.Errorf("cp: creating %d ranks in one NCCL group: %w", size, context.Cause(ctx))
		if cfg == nil {
			err = fmt.Errorf("%w (the blocking init of this NCCL cannot be interrupted)", err)
		}
		return err
	}
	for _, n := range comms {
		if err := n.settle(ctx, fmt.Sprintf("rank %d of %d: ncclCommInitRankConfig", n.rank, size)); err != nil {
			return err
		}
	}
	return nil
}

// groupInit issues, on the calling goroutine's locked thread, the group
// that creates comms: ncclGroupStart, current(r) and rank r's
// ncclCommInitRankConfig with cfg (ncclCommInitRank when cfg is nil) for
// each rank, ncclGroupEnd. Every device is made current once before the
// group starts, so that a device that cannot be (a closed one) fails before
// any rank exists. The group is closed even after a failed call inside
// it; after a failed NCCL call, NCCL starts none of the group's ranks.
func groupInit(a *ncclAPI, comms []*NCCL, id NCCLUniqueID, cfg *ncclConfig, current func(rank int) error) error {
	size := len(comms)
	for r := range comms {
		if err := current(r); err != nil {
			return fmt.Errorf("cp: rank %d of %d: %w", r, size, err)
		}
	}
	if err := a.check(fmt.Sprintf("ncclGroupStart (%d ranks)", size), ncall(a.groupStart), 0); err != nil {
		return err
	}
	arg := ncclUniqueIDArg{internal: id}
	var failed error
	for r, n := range comms {
		op := fmt.Sprintf("rank %d of %d: ncclCommInitRank", r, size)
		if err := current(r); err != nil {
			failed = fmt.Errorf("cp: %s: %w", op, err)
			break
		}
		if cfg == nil {
			if err := a.check(op, uintptr(a.commInitRank(n.comm, int32(size), arg, int32(r))), 0); err != nil {
				failed = err
				break
			}
			continue
		}
		if res := NCCLResult(a.commInitRankCfg(n.comm, int32(size), arg, int32(r), cfg)); res != NCCLSuccess && res != NCCLInProgress {
			failed = a.err(op+"Config", res, 0)
			break
		}
	}
	res := result(ncall(a.groupEnd))
	if failed != nil {
		return failed
	}
	if res != NCCLSuccess && res != NCCLInProgress {
		return a.err(fmt.Sprintf("ncclGroupEnd (%d ranks)", size), res, 0)
	}
	return nil
}

// finish checks a new communicator's size and makes its stream.
func (n *NCCL) finish() error {
	var count int32
	if err := n.call("ncclCommCount", func(c uintptr) uintptr {
		return ncall(n.api.commCount, c, uintptr(unsafe.Pointer(&count)))
	}); err != nil {
		return err
	}
	if int(count) != n.size {
		return fmt.Errorf("cp: rank %d: NCCL made a group of %d ranks, not %d: %w", n.rank, count, n.size, ErrNCCL)
	}
	s, err := n.dev.NewStream()
	if err != nil {
		return fmt.Errorf("cp: rank %d: stream: %w", n.rank, err)
	}
	n.stream = s
	return nil
}

// Rank returns this rank's index.
func (n *NCCL) Rank() int { return n.rank }

// Size returns the number of ranks in the group.
func (n *NCCL) Size() int { return n.size }

// Device returns the communicator's GPU.
func (n *NCCL) Device() *cuda.Device { return n.dev }

// Stream returns the communicator's own stream, used when an operation is
// given a nil stream.
func (n *NCCL) Stream() *cuda.Stream { return n.stream }

// SetTimeout sets how long an operation whose context has no deadline may
// take before the communicator is aborted (DefaultNCCLTimeout at first).
// d ≤ 0 restores the default.
func (n *NCCL) SetTimeout(d time.Duration) {
	if d <= 0 {
		d = DefaultNCCLTimeout
	}
	n.timeout = d
}

// bound returns ctx, given the communicator's timeout when it has no
// deadline.
func (n *NCCL) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeoutCause(ctx, n.timeout,
		fmt.Errorf("no progress within %v: %w", n.timeout, context.DeadlineExceeded))
}

// call runs one NCCL call on the communicator (any thread) unless it is
// aborted or closed, and checks its result.
func (n *NCCL) call(op string, fn func(comm uintptr) uintptr) error {
	n.mu.RLock()
	defer n.mu.RUnlock()
	if err := n.usable(op); err != nil {
		return err
	}
	return n.api.check(fmt.Sprintf("rank %d: %s", n.rank, op), fn(*n.comm), *n.comm)
}

// usable returns an error when the communicator can take no more calls
// (n.mu held).
func (n *NCCL) usable(op string) error {
	if n.aborted.Load() {
		return fmt.Errorf("cp: rank %d: %s: %w: %w", n.rank, op, ErrAborted, n.group.cause)
	}
	if n.closed {
		return attn.Errorf(attn.ErrOption, "cp: rank %d: %s: the communicator is closed", n.rank, op)
	}
	return nil
}

// asyncError returns the communicator's state (ncclCommGetAsyncError):
// ncclSuccess, ncclInProgress, or the error that broke it.
func (n *NCCL) asyncError(op string) (NCCLResult, error) {
	var st int32
	err := n.call(op+": ncclCommGetAsyncError", func(c uintptr) uintptr {
		return ncall(n.api.commGetAsyncError, c, uintptr(unsafe.Pointer(&st)))
	})
	return NCCLResult(st), err
}

// poll calls ready until it reports true, checking the communicator's
// asynchronous error in between. An error, or ctx ending, aborts the
// group.
func (n *NCCL) poll(ctx context.Context, op string, ready func(state NCCLResult) (bool, error)) error {
	wait := 20 * time.Microsecond
	for {
		st, err := n.asyncError(op)
		if err != nil {
			return n.fail(err)
		}
		if st != NCCLSuccess && st != NCCLInProgress {
			n.mu.RLock()
			e := n.api.err(fmt.Sprintf("rank %d: %s", n.rank, op), st, *n.comm)
			n.mu.RUnlock()
			return n.fail(e)
		}
		ok, err := ready(st)
		if err != nil {
			return n.fail(fmt.Errorf("cp: rank %d: %s: %w", n.rank, op, err))
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return n.fail(fmt.Errorf("cp: rank %d: %s: %w", n.rank, op, context.Cause(ctx)))
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Millisecond)
	}
}

// settle waits until a non-blocking communicator has finished what was
// started (its state leaves ncclInProgress).
func (n *NCCL) settle(ctx context.Context, op string) error {
	if n.blocking {
		return nil
	}
	return n.poll(ctx, op, func(st NCCLResult) (bool, error) { return st == NCCLSuccess, nil })
}

// fail aborts the group with err and returns err.
func (n *NCCL) fail(err error) error {
	if !errors.Is(err, ErrAborted) {
		n.Abort(err)
	}
	return err
}

// Abort aborts every communicator of the group (ncclCommAbort, each on a
// thread of its own so that it can interrupt a blocked call): pending and
// later operations fail with an error wrapping ErrAborted and cause. The
// other processes of the group see the abort as an NCCL error or a
// timeout. Aborting an aborted group does nothing.
func (n *NCCL) Abort(cause error) {
	g := n.group
	g.once.Do(func() {
		g.cause = cause
		g.mu.Lock()
		comms := slices.Clone(g.comms)
		g.mu.Unlock()
		for _, c := range comms {
			c.aborted.Store(true)
		}
		var wg sync.WaitGroup
		for _, c := range comms {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c.abortComm()
			}()
		}
		wg.Wait()
	})
}

// abortComm calls ncclCommAbort on a fresh locked thread. It waits up to a
// second for calls in flight to leave; a call still inside NCCL then is
// blocked, and the abort is what releases it. It gives up waiting for the
// abort itself after the communicator's timeout.
func (n *NCCL) abortComm() {
	if n.comm == nil || *n.comm == 0 || n.api == nil || !n.released.CompareAndSwap(false, true) {
		return
	}
	locked := false
	for range 1000 {
		if n.mu.TryLock() {
			locked = true
			break
		}
		time.Sleep(time.Millisecond)
	}
	if locked {
		defer n.mu.Unlock()
		if n.closed {
			return
		}
		n.closed = true
	}
	comm := *n.comm
	done := make(chan struct{})
	go func() {
		runtime.LockOSThread() // the thread ends with the goroutine
		ncall(n.api.commAbort, comm)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(n.timeout):
	}
}

// destroy releases a communicator that failed to start (ncclCommAbort
// frees it whatever its state).
func (n *NCCL) destroy() {
	n.Abort(fmt.Errorf("cp: rank %d: the communicator failed to start", n.rank))
}

// Close waits for the communicator's work (ncclCommFinalize, when the
// library has it), destroys it and frees its stream and staging memory.
// Closing an aborted communicator releases what is left; closing twice
// does nothing.
func (n *NCCL) Close() error {
	var errs []error
	if !n.aborted.Load() {
		ctx, cancel := n.bound(context.Background())
		errs = append(errs, n.finalize(ctx))
		cancel()
	}
	n.mu.Lock()
	if !n.closed && !n.aborted.Load() && n.released.CompareAndSwap(false, true) {
		n.closed = true
		comm := *n.comm
		errs = append(errs, n.dev.Do(func() error {
			return n.api.check(fmt.Sprintf("rank %d: ncclCommDestroy", n.rank), ncall(n.api.commDestroy, comm), 0)
		}))
	}
	n.closed = true
	n.mu.Unlock()
	if n.scratch != nil {
		errs = append(errs, n.scratch.Free())
		n.scratch = nil
	}
	if n.stream != nil {
		errs = append(errs, n.stream.Close())
		n.stream = nil
	}
	return errors.Join(errs...)
}

// finalize flushes the communicator's pending work (ncclCommFinalize).
func (n *NCCL) finalize(ctx context.Context) error {
	if n.api.commFinalize == 0 {
		return nil
	}
	var r uintptr
	n.mu.RLock()
	err := n.usable("ncclCommFinalize")
	if err == nil {
		comm := *n.comm
		err = n.dev.Do(func() error { r = ncall(n.api.commFinalize, comm); return nil })
	}
	n.mu.RUnlock()
	if err != nil {
		return err
	}
	if res := result(r); res != NCCLSuccess && res != NCCLInProgress {
		return n.fail(n.api.err(fmt.Sprintf("rank %d: ncclCommFinalize", n.rank), res, 0))
	}
	return n.settle(ctx, "ncclCommFinalize")
}

// streamHandle returns s's handle, or the communicator's stream's for nil.
func (n *NCCL) streamHandle(s *cuda.Stream) uintptr {
	if s == nil {
		s = n.stream
	}
	return s.Handle()
}

// spanPtr returns the device address of sp after checking it.
func (n *NCCL) spanPtr(sp DeviceSpan, what string) (uintptr, error) {
	if err := checkSpan(sp, what); err != nil {
		return 0, err
	}
	if sp.Len == 0 {
		return 0, nil
	}
	if sp.Buf.Device() != n.dev {
		return 0, attn.Errorf(attn.ErrOption, "cp: %s lives on %v, the communicator on %v", what, sp.Buf.Device(), n.dev)
	}
	p := sp.Buf.Ptr()
	if p == 0 {
		return 0, attn.Errorf(attn.ErrOption, "cp: %s: the buffer was freed", what)
	}
	return uintptr(p + uint64(sp.Off)), nil
}

// checkSpan validates a span's offset and length against its buffer.
func checkSpan(sp DeviceSpan, what string) error {
	if sp.Off < 0 || sp.Len < 0 {
		return attn.Errorf(attn.ErrShape, "cp: %s: offset %d, length %d", what, sp.Off, sp.Len)
	}
	if sp.Len == 0 {
		return nil
	}
	if sp.Buf == nil {
		return attn.Errorf(attn.ErrOption, "cp: %s: %d bytes of a nil buffer", what, sp.Len)
	}
	if sp.Off > sp.Buf.Size()-sp.Len {
		return attn.Errorf(attn.ErrShape, "cp: %s: bytes [%d, %d) outside a buffer of %d", what, sp.Off, sp.Off+sp.Len, sp.Buf.Size())
	}
	return nil
}

// p2p is one resolved send or receive.
type p2p struct {
	recv  bool
	peer  int
	ptr   uintptr
	bytes int64
}

// resolve checks the messages of an exchange and returns them resolved,
// sends first, zero-length ones left out (both sides of a message have
// the same length, so both leave it out).
func (n *NCCL) resolve(sends []DeviceSend, recvs []DeviceRecv) ([]p2p, error) {
	var ops []p2p
	var err error
	for i, s := range sends {
		if ops, err = n.resolveOne(ops, false, i, s.Peer, s.Data); err != nil {
			return nil, err
		}
	}
	for i, r := range recvs {
		if ops, err = n.resolveOne(ops, true, i, r.Peer, r.Data); err != nil {
			return nil, err
		}
	}
	return ops, nil
}

// resolveOne checks message i of an exchange and appends it to ops unless
// it is empty.
func (n *NCCL) resolveOne(ops []p2p, recv bool, i, peer int, sp DeviceSpan) ([]p2p, error) {
	what := fmt.Sprintf("send %d", i)
	if recv {
		what = fmt.Sprintf("receive %d", i)
	}
	if err := checkPeer(peer, n.size); err != nil {
		return nil, fmt.Errorf("cp: rank %d: %s: %w", n.rank, what, err)
	}
	p, err := n.spanPtr(sp, what)
	if err != nil || sp.Len == 0 {
		return ops, err
	}
	return append(ops, p2p{recv: recv, peer: peer, ptr: p, bytes: sp.Len}), nil
}

// ncclUint8 is ncclDataType_t's ncclUint8: every transfer counts bytes.
const ncclUint8 = 1

// enqueue issues fn's calls between ncclGroupStart and ncclGroupEnd on
// the executor thread, then waits for a non-blocking communicator to
// accept the group.
func (n *NCCL) enqueue(ctx context.Context, op string, fn func(comm uintptr) error) error {
	ctx, cancel := n.bound(ctx)
	defer cancel()
	if err := ctx.Err(); err != nil {
		return n.fail(fmt.Errorf("cp: rank %d: %s: %w", n.rank, op, context.Cause(ctx)))
	}
	n.mu.RLock()
	err := n.usable(op)
	if err == nil {
		comm := *n.comm
		a := n.api
		name := fmt.Sprintf("rank %d: %s", n.rank, op)
		err = n.dev.Do(func() error {
			if err := a.check(name+": ncclGroupStart", ncall(a.groupStart), comm); err != nil {
				return err
			}
			ferr := fn(comm)
			// The group is always closed, even after a failed call inside it.
			r := result(ncall(a.groupEnd))
			if ferr != nil {
				return ferr
			}
			if r != NCCLSuccess && r != NCCLInProgress {
				return a.err(name+": ncclGroupEnd", r, comm)
			}
			return nil
		})
	}
	n.mu.RUnlock()
	if err != nil {
		return n.fail(err)
	}
	return n.settle(ctx, op)
}

// issue enqueues resolved sends and receives inside an open group
// (executor thread).
func (n *NCCL) issue(op string, comm, stream uintptr, ops []p2p) error {
	a := n.api
	for _, o := range ops {
		fn, what := a.send, "ncclSend"
		if o.recv {
			fn, what = a.recv, "ncclRecv"
		}
		if err := a.check(fmt.Sprintf("rank %d: %s: %s(peer %d, %d bytes)", n.rank, op, what, o.peer, o.bytes),
			ncall(fn, o.ptr, uintptr(o.bytes), ncclUint8, uintptr(o.peer), comm, stream), comm); err != nil {
			return err
		}
	}
	return nil
}

// ExchangeOn enqueues the sends and receives on s as one NCCL group
// (ncclGroupStart, ncclSend/ncclRecv, ncclGroupEnd). A bad peer or span
// fails with attn.ErrOption or attn.ErrShape and aborts the group.
func (n *NCCL) ExchangeOn(ctx context.Context, s *cuda.Stream, sends []DeviceSend, recvs []DeviceRecv) error {
	return n.exchangeOn(ctx, "exchange", s, sends, recvs)
}

// exchangeOn checks and enqueues the messages of operation op.
func (n *NCCL) exchangeOn(ctx context.Context, op string, s *cuda.Stream, sends []DeviceSend, recvs []DeviceRecv) error {
	ops, err := n.resolve(sends, recvs)
	if err != nil {
		return n.fail(err)
	}
	if len(ops) == 0 {
		return nil
	}
	stream := n.streamHandle(s)
	return n.enqueue(ctx, op, func(comm uintptr) error { return n.issue(op, comm, stream, ops) })
}

// checkAllToAll validates the lengths of an all-to-all among size ranks.
func checkAllToAll(send, recv int64, size int) error {
	if send != recv || send%int64(size) != 0 {
		return attn.Errorf(attn.ErrShape, "cp: all-to-all of %d bytes into %d among %d ranks", send, recv, size)
	}
	return nil
}

// checkAllGather validates the lengths of an all-gather among size ranks.
func checkAllGather(send, recv int64, size int) error {
	if recv != send*int64(size) {
		return attn.Errorf(attn.ErrShape, "cp: all-gather of %d bytes into %d among %d ranks", send, recv, size)
	}
	return nil
}

// AllToAllOn enqueues an all-to-all on s as one group of a send and a
// receive per rank.
func (n *NCCL) AllToAllOn(ctx context.Context, s *cuda.Stream, send, recv DeviceSpan) error {
	if err := checkAllToAll(send.Len, recv.Len, n.size); err != nil {
		return n.fail(err)
	}
	part := send.Len / int64(n.size)
	sends := make([]DeviceSend, n.size)
	recvs := make([]DeviceRecv, n.size)
	for t := range n.size {
		off := int64(t) * part
		sends[t] = DeviceSend{Peer: t, Data: DeviceSpan{Buf: send.Buf, Off: send.Off + off, Len: part}}
		recvs[t] = DeviceRecv{Peer: t, Data: DeviceSpan{Buf: recv.Buf, Off: recv.Off + off, Len: part}}
	}
	return n.exchangeOn(ctx, "all-to-all", s, sends, recvs)
}

// AllGatherOn enqueues an all-gather on s (ncclAllGather).
func (n *NCCL) AllGatherOn(ctx context.Context, s *cuda.Stream, send, recv DeviceSpan) error {
	if err := checkAllGather(send.Len, recv.Len, n.size); err != nil {
		return n.fail(err)
	}
	sp, err := n.spanPtr(send, "all-gather send")
	if err != nil {
		return n.fail(err)
	}
	rp, err := n.spanPtr(recv, "all-gather receive")
	if err != nil {
		return n.fail(err)
	}
	if send.Len == 0 {
		return nil
	}
	stream := n.streamHandle(s)
	return n.enqueue(ctx, "all-gather", func(comm uintptr) error {
		return n.api.check(fmt.Sprintf("rank %d: ncclAllGather(%d bytes)", n.rank, send.Len),
			ncall(n.api.allGather, sp, rp, uintptr(send.Len), ncclUint8, comm, stream), comm)
	})
}

// Wait returns when the work enqueued on s (nil: the communicator's
// stream) has completed. It polls the stream and the communicator's
// asynchronous error; an NCCL error, or ctx ending first
// (DefaultNCCLTimeout or SetTimeout's without a deadline), aborts the
// group and is returned.
func (n *NCCL) Wait(ctx context.Context, s *cuda.Stream) error {
	if s == nil {
		s = n.stream
	}
	ctx, cancel := n.bound(ctx)
	defer cancel()
	return n.poll(ctx, "wait", func(NCCLResult) (bool, error) { return s.Done() })
}

// staging returns the communicator's device staging buffer, at least
// bytes long.
func (n *NCCL) staging(bytes int64) (*cuda.Buffer, error) {
	if n.scratch != nil && n.scratch.Size() >= bytes {
		return n.scratch, nil
	}
	if n.scratch != nil {
		if err := n.scratch.Free(); err != nil {
			return nil, err
		}
		n.scratch = nil
	}
	const grain = 1 << 20
	b, err := n.dev.Alloc((bytes + grain - 1) / grain * grain)
	if err != nil {
		return nil, err
	}
	n.scratch = b
	return b, nil
}

// staged copies ins into a staging buffer (each at its offset), runs
// enqueue on the communicator's stream, waits, and copies the regions of
// outs back.
func (n *NCCL) staged(ctx context.Context, op string, total int64, ins, outs []stagedBytes, enqueue func(buf *cuda.Buffer) error) error {
	n.mu.RLock()
	err := n.usable(op)
	n.mu.RUnlock()
	if err != nil || total == 0 {
		return err
	}
	buf, err := n.staging(total)
	if err != nil {
		return n.fail(fmt.Errorf("cp: rank %d: %s: %w", n.rank, op, err))
	}
	for _, in := range ins {
		if len(in.data) > 0 {
			if err := n.dev.CopyToDevice(buf, in.off, in.data); err != nil {
				return n.fail(fmt.Errorf("cp: rank %d: %s: %w", n.rank, op, err))
			}
		}
	}
	if err := enqueue(buf); err != nil {
		return err
	}
	if err := n.Wait(ctx, nil); err != nil {
		return err
	}
	for _, out := range outs {
		if len(out.data) > 0 {
			if err := n.dev.CopyFromDevice(out.data, buf, out.off); err != nil {
				return n.fail(fmt.Errorf("cp: rank %d: %s: %w", n.rank, op, err))
			}
		}
	}
	return nil
}

// stagedBytes is host memory and its place in the staging buffer.
type stagedBytes struct {
	data []byte
	off  int64
}

// Exchange sends and receives host bytes as one NCCL group, staged
// through device memory; it returns when all have completed.
func (n *NCCL) Exchange(ctx context.Context, sends []Send, recvs []Recv) error {
	var ins, outs []stagedBytes
	var dsends []DeviceSend
	var drecvs []DeviceRecv
	var total int64
	for _, s := range sends {
		ins = append(ins, stagedBytes{s.Data, total})
		dsends = append(dsends, DeviceSend{Peer: s.Peer, Data: DeviceSpan{Off: total, Len: int64(len(s.Data))}})
		total += int64(len(s.Data))
	}
	for _, r := range recvs {
		outs = append(outs, stagedBytes{r.Data, total})
		drecvs = append(drecvs, DeviceRecv{Peer: r.Peer, Data: DeviceSpan{Off: total, Len: int64(len(r.Data))}})
		total += int64(len(r.Data))
	}
	if err := checkMessages(n.rank, n.size, sends, recvs); err != nil {
		return n.fail(err)
	}
	return n.staged(ctx, "exchange", total, ins, outs, func(buf *cuda.Buffer) error {
		for i := range dsends {
			dsends[i].Data.Buf = buf
		}
		for i := range drecvs {
			drecvs[i].Data.Buf = buf
		}
		return n.ExchangeOn(ctx, nil, dsends, drecvs)
	})
}

// AllToAll runs an all-to-all of host bytes, staged through device memory.
func (n *NCCL) AllToAll(ctx context.Context, send, recv []byte) error {
	l := int64(len(send))
	if err := checkAllToAll(l, int64(len(recv)), n.size); err != nil {
		return n.fail(err)
	}
	return n.staged(ctx, "all-to-all", 2*l, []stagedBytes{{send, 0}}, []stagedBytes{{recv, l}}, func(buf *cuda.Buffer) error {
		return n.AllToAllOn(ctx, nil, DeviceSpan{buf, 0, l}, DeviceSpan{buf, l, l})
	})
}

// AllGather runs an all-gather of host bytes, staged through device
// memory.
func (n *NCCL) AllGather(ctx context.Context, send, recv []byte) error {
	l, lr := int64(len(send)), int64(len(recv))
	if err := checkAllGather(l, lr, n.size); err != nil {
		return n.fail(err)
	}
	return n.staged(ctx, "all-gather", l+lr, []stagedBytes{{send, 0}}, []stagedBytes{{recv, l}}, func(buf *cuda.Buffer) error {
		return n.AllGatherOn(ctx, nil, DeviceSpan{buf, 0, l}, DeviceSpan{buf, l, lr})
	})
}

// Barrier returns when every rank has entered it: an all-gather of one
// byte per rank.
func (n *NCCL) Barrier(ctx context.Context) error {
	return n.AllGather(ctx, []byte{byte(n.rank)}, make([]byte, n.size))
}

// OpenNCCL joins the NCCL group described by env with dev: rank 0 makes the
// unique id and hands it to the others through env's rendezvous (Share),
// then every rank calls NewNCCL. ctx bounds both steps.
func OpenNCCL(ctx context.Context, env Env, dev *cuda.Device) (*NCCL, error) {
	var blob []byte
	if env.Rank == 0 {
		id, err := NewNCCLUniqueID()
		if err != nil {
			return nil, err
		}
		blob = id[:]
	}
	got, err := env.Share(ctx, blob)
	if err != nil {
		return nil, err
	}
	var id NCCLUniqueID
	if len(got) != len(id) {
		return nil, fmt.Errorf("cp: rank %d: the NCCL unique id from rank 0 has %d bytes, not %d: %w", env.Rank, len(got), len(id), ErrRendezvous)
	}
	copy(id[:], got)
	return NewNCCL(ctx, dev, id, env.Rank, env.Size)
}
