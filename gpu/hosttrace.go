package gpu

import (
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/flashattn/flashattn/cuda"
)

// Tracing the host path: a HostTrace attached to a Backend
// (SetHostTrace) receives, for every host-tensor call, where its wall time
// went on the calling goroutine (HostPhase, which partition it) and how
// long the stream spent copying and computing (StreamPhase, timed by CUDA
// events, overlapping the host phases). Without a trace a call reads no
// clock and records no event: each boundary is a nil check.

// HostPhase is a phase of a host-path call on the calling goroutine. The
// phases of a call partition its wall time.
type HostPhase int

// The host phases, in the order a call meets them.
const (
	// HostPlan is validating the arguments and planning the launches
	// (loading a kernel module on its first use included).
	HostPlan HostPhase = iota
	// HostAlloc is taking device buffers from the pool (and, on first use,
	// allocating the pinned staging slots).
	HostAlloc
	// HostToPinned is copying input bytes from Go memory into a pinned
	// staging slot (and gathering strided inputs first).
	HostToPinned
	// HostRegister is page-locking Go memory for the copies to DMA in
	// place, and unlocking it at the end (Backend.HostRegister).
	HostRegister
	// HostEnqueue is handing copies, kernels and trace events to the
	// stream.
	HostEnqueue
	// HostWait is waiting: for a staging slot the stream still copies, for
	// the last copy back, or for another goroutine's host-path call.
	HostWait
	// PinnedToHost is copying output bytes from a staging slot into Go
	// memory (and scattering strided outputs).
	PinnedToHost
	// HostOutputs is waiting for the output tensors that Forward and
	// Backward allocate on other goroutines while the inputs upload.
	HostOutputs
	// HostOther is the rest: returning buffers to the pool, bookkeeping.
	HostOther
	// NumHostPhases is the number of host phases.
	NumHostPhases
)

// hostPhaseNames are the phases' short names.
var hostPhaseNames = [NumHostPhases]string{"plan", "alloc", "host→pinned", "register", "enqueue", "wait", "pinned→host", "outputs", "other"}

// String returns the phase's short name, such as "host→pinned".
func (p HostPhase) String() string {
	if p >= 0 && p < NumHostPhases {
		return hostPhaseNames[p]
	}
	return fmt.Sprintf("HostPhase(%d)", int(p))
}

// StreamPhase is a kind of work on the host path's stream, timed with CUDA
// events; stream work overlaps the host phases.
type StreamPhase int

// The stream phases.
const (
	// StreamToDevice is the DMA of staging slots into device memory.
	StreamToDevice StreamPhase = iota
	// StreamKernels is the pass's kernels (staging packs, attention, the
	// non-finite check).
	StreamKernels
	// StreamFromDevice is the DMA of device memory into staging slots.
	StreamFromDevice
	// NumStreamPhases is the number of stream phases.
	NumStreamPhases
)

// streamPhaseNames are the stream phases' short names.
var streamPhaseNames = [NumStreamPhases]string{"H2D DMA", "kernels", "D2H DMA"}

// String returns the phase's short name, such as "H2D DMA".
func (p StreamPhase) String() string {
	if p >= 0 && p < NumStreamPhases {
		return streamPhaseNames[p]
	}
	return fmt.Sprintf("StreamPhase(%d)", int(p))
}

// HostCall is the breakdown of one host-path call.
type HostCall struct {
	// Op names the entry: "forward", "forward into", "backward" or
	// "backward into".
	Op string
	// Wall is the call's time from its entry until its outputs are in Go
	// memory and its device buffers back in the pool; Host partitions it.
	Wall time.Duration
	Host [NumHostPhases]time.Duration
	// Stream is the stream time of each kind of work, Span the stream time
	// from the start of the first traced work to the end of the last.
	Stream [NumStreamPhases]time.Duration
	Span   time.Duration
	// ToDevice and FromDevice are the bytes copied over the link each way.
	ToDevice, FromDevice int64
	// Staged is the part of them that went through the pinned staging
	// slots; the rest went in place (Backend.Pin, Backend.HostRegister).
	Staged int64
	// StreamErr is why the stream times are missing (zero), if they are:
	// a trace event that could not be recorded or read. The call itself
	// succeeded.
	StreamErr error
}

// Idle returns the time within Span when the stream ran none of the traced
// work: it was waiting for the host.
func (c HostCall) Idle() time.Duration {
	idle := c.Span
	for _, d := range c.Stream {
		idle -= d
	}
	return idle
}

// HostTrace collects the breakdowns of the host-path calls of the backends
// it is attached to (Backend.SetHostTrace). It is safe for concurrent use.
type HostTrace struct {
	mu    sync.Mutex
	calls []HostCall
}

// Calls returns the breakdowns recorded so far, oldest first.
func (t *HostTrace) Calls() []HostCall {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Clone(t.calls)
}

// Reset forgets the recorded breakdowns.
func (t *HostTrace) Reset() {
	t.mu.Lock()
	t.calls = nil
	t.mu.Unlock()
}

// add records one breakdown.
func (t *HostTrace) add(c HostCall) {
	t.mu.Lock()
	t.calls = append(t.calls, c)
	t.mu.Unlock()
}

// MedianCall returns, of calls, the call of op whose wall time is the
// median (the upper one for an even count): one real call, whose phases
// add up to its wall time. ok is false when no call is of op.
func MedianCall(calls []HostCall, op string) (c HostCall, ok bool) {
	var of []HostCall
	for _, x := range calls {
		if x.Op == op {
			of = append(of, x)
		}
	}
	if len(of) == 0 {
		return HostCall{}, false
	}
	slices.SortStableFunc(of, func(a, b HostCall) int { return int(a.Wall - b.Wall) })
	return of[len(of)/2], true
}

// SetHostTrace makes the backend's host-path calls (Forward, Backward,
// ForwardInto, BackwardInto) record their breakdowns into t from their
// next entry on; nil stops it. A traced call records a pair of CUDA events
// around each staging copy and around its kernels (counted as
// HostEnqueue), and after its wall time is taken waits for its last event
// to read the stream times.
func (b *Backend) SetHostTrace(t *HostTrace) { b.trace.Store(t) }

// traceCall returns the recorder of a call of op, nil when no trace is
// attached.
func (b *Backend) traceCall(op string) *callRecorder {
	t := b.trace.Load()
	if t == nil {
		return nil
	}
	return newCallRecorder(t, op, time.Now, &eventMarks{dev: b.dev, pool: &b.traceEvents})
}

// streamMarker places marks on a stream and reads the stream time between
// them once the last one has passed.
type streamMarker interface {
	// mark records a mark on s after the work enqueued so far and returns
	// its index; marks count from 0 in each call.
	mark(s *cuda.Stream) (int, error)
	// wait returns when the last mark has passed.
	wait() error
	// elapsed returns the stream time from mark i to mark j.
	elapsed(i, j int) (time.Duration, error)
}

// markedSpan is stream work of one phase between two marks.
type markedSpan struct {
	phase    StreamPhase
	from, to int
}

// callRecorder records one call's breakdown. Its methods do nothing on a
// nil recorder, the untraced call.
type callRecorder struct {
	trace *HostTrace
	now   func() time.Time
	marks streamMarker
	start time.Time
	last  time.Time // the end of the last lap
	call  HostCall
	spans []markedSpan
	nmark int // marks recorded
	err   error
}

// newCallRecorder starts recording a call of op now, with the clock now
// and the stream marks of marks.
func newCallRecorder(t *HostTrace, op string, now func() time.Time, marks streamMarker) *callRecorder {
	start := now()
	return &callRecorder{trace: t, now: now, marks: marks, start: start, last: start, call: HostCall{Op: op}}
}

// lap gives the time since the previous lap to phase p.
func (r *callRecorder) lap(p HostPhase) {
	if r == nil {
		return
	}
	t := r.now()
	r.call.Host[p] += t.Sub(r.last)
	r.last = t
}

// begin marks the start of stream work on s and returns the mark, -1 when
// stream timing has stopped.
func (r *callRecorder) begin(s *cuda.Stream) int {
	if r == nil || r.err != nil {
		return -1
	}
	i, err := r.marks.mark(s)
	if err != nil {
		r.err = fmt.Errorf("gpu: host trace: %w", err)
		return -1
	}
	r.nmark = i + 1
	return i
}

// end marks the end of stream work of phase p on s that began at mark
// from and moved bytes over the link.
func (r *callRecorder) end(s *cuda.Stream, p StreamPhase, from int, bytes int64) {
	if r == nil {
		return
	}
	switch p {
	case StreamToDevice:
		r.call.ToDevice += bytes
	case StreamFromDevice:
		r.call.FromDevice += bytes
	}
	if from < 0 {
		return
	}
	to := r.begin(s)
	if to < 0 {
		return
	}
	r.spans = append(r.spans, markedSpan{p, from, to})
}

// staged counts bytes copied through the pinned staging slots.
func (r *callRecorder) staged(bytes int64) {
	if r != nil {
		r.call.Staged += bytes
	}
}

// finish closes a call that succeeded: the time since the last lap goes to
// HostOther and ends the wall time; then the stream times are read and
// the breakdown is added to the trace.
func (r *callRecorder) finish() {
	if r == nil {
		return
	}
	r.lap(HostOther)
	r.call.Wall = r.last.Sub(r.start)
	if r.err == nil && r.nmark > 0 {
		r.err = r.readStream()
	}
	if r.err != nil {
		r.call.StreamErr = r.err
		r.call.Stream, r.call.Span = [NumStreamPhases]time.Duration{}, 0
	}
	r.trace.add(r.call)
}

// readStream waits for the last mark and fills the stream times.
func (r *callRecorder) readStream() error {
	if err := r.marks.wait(); err != nil {
		return fmt.Errorf("gpu: host trace: %w", err)
	}
	span, err := r.marks.elapsed(0, r.nmark-1)
	if err != nil {
		return fmt.Errorf("gpu: host trace: %w", err)
	}
	r.call.Span = span
	for _, sp := range r.spans {
		d, err := r.marks.elapsed(sp.from, sp.to)
		if err != nil {
			return fmt.Errorf("gpu: host trace: %w", err)
		}
		r.call.Stream[sp.phase] += d
	}
	return nil
}

// eventMarks are a call's marks as CUDA events from the backend's pool,
// which grows to the most marks a call has needed; the pool is used under
// the backend's hostMu.
type eventMarks struct {
	dev  *cuda.Device
	pool *[]*cuda.Event
	n    int
}

// mark records the next event of the pool on s.
func (m *eventMarks) mark(s *cuda.Stream) (int, error) {
	if m.n == len(*m.pool) {
		e, err := m.dev.NewEvent()
		if err != nil {
			return 0, err
		}
		*m.pool = append(*m.pool, e)
	}
	if err := (*m.pool)[m.n].Record(s); err != nil {
		return 0, err
	}
	m.n++
	return m.n - 1, nil
}

// wait waits for the last recorded event.
func (m *eventMarks) wait() error {
	if m.n == 0 {
		return nil
	}
	return (*m.pool)[m.n-1].Synchronize()
}

// elapsed returns the stream time between events i and j.
func (m *eventMarks) elapsed(i, j int) (time.Duration, error) {
	ms, err := cuda.ElapsedMs((*m.pool)[i], (*m.pool)[j])
	return time.Duration(float64(ms) * float64(time.Millisecond)), err
}
