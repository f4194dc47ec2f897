package cuda

import (
	"errors"
	"math"
	"sync/atomic"
	"unsafe"
)

// Stream is a CUDA stream: work enqueued on it runs in order. A nil *Stream
// passed to an operation means the legacy default stream.
type Stream struct {
	dev      *Device
	h        uintptr // CUstream
	closed   atomic.Bool
	borrowed bool // the caller's stream (BorrowStream): Close only forgets it
}

// Stream creation flags.
const (
	streamDefault     = 0x0 // CU_STREAM_DEFAULT: synchronizes with the legacy default stream
	streamNonBlocking = 0x1 // CU_STREAM_NON_BLOCKING
)

// NewStream creates a stream that synchronizes with the legacy default
// stream (CU_STREAM_DEFAULT), so the synchronous copies see the results of
// kernels launched on it.
func (d *Device) NewStream() (*Stream, error) { return d.newStream(streamDefault) }

// NewStreamNonBlocking creates a stream that does not synchronize with the
// legacy default stream (CU_STREAM_NON_BLOCKING). Synchronize it (or use the
// Async copies on it) before reading its results with the synchronous copies.
func (d *Device) NewStreamNonBlocking() (*Stream, error) { return d.newStream(streamNonBlocking) }

func (d *Device) newStream(flags uint32) (*Stream, error) {
	s := &Stream{dev: d}
	if err := d.createTracked("cuStreamCreate", d.api.cuStreamCreate, d.api.cuStreamDestroy, resStream, unsafe.Pointer(&s.h), uintptr(flags)); err != nil {
		return nil, err
	}
	return s, nil
}

// Handle returns the raw CUstream, for code that calls other CUDA libraries.
func (s *Stream) Handle() uintptr { return s.h }

// Synchronize waits until all work enqueued on the stream has finished and
// returns the first asynchronous error, if any.
func (s *Stream) Synchronize() error {
	h, err := s.dev.streamHandle(s)
	if err != nil {
		return err
	}
	return s.dev.do(func() error {
		return s.dev.api.check("cuStreamSynchronize", ccall(s.dev.api.cuStreamSynchronize, h))
	})
}

// Done reports whether all work enqueued on the stream has finished,
// without waiting.
func (s *Stream) Done() (bool, error) {
	h, err := s.dev.streamHandle(s)
	if err != nil {
		return false, err
	}
	return s.dev.query("cuStreamQuery", s.dev.api.cuStreamQuery, h)
}

// WaitEvent makes later work on the stream wait until e's recorded work has
// finished (cuStreamWaitEvent); the host does not wait.
func (s *Stream) WaitEvent(e *Event) error {
	h, err := s.dev.streamHandle(s)
	if err != nil {
		return err
	}
	eh, err := e.handle(s.dev)
	if err != nil {
		return err
	}
	return s.dev.do(func() error {
		return s.dev.api.check("cuStreamWaitEvent", ccall(s.dev.api.cuStreamWaitEvent, h, eh, 0))
	})
}

// Close destroys the stream (cuStreamDestroy) once its work has finished.
// Closing twice returns nil. Closing a borrowed stream (BorrowStream) only
// ends its use through s; the stream stays the caller's.
func (s *Stream) Close() error {
	if s == nil || !s.closed.CompareAndSwap(false, true) || s.borrowed {
		return nil
	}
	return s.dev.destroy(resStream, s.h, "cuStreamDestroy_v2", s.dev.api.cuStreamDestroy)
}

// query runs a cuXxxQuery function: true for done, false for
// CUDA_ERROR_NOT_READY, an error otherwise.
func (d *Device) query(op string, fn, h uintptr) (bool, error) {
	var done bool
	err := d.do(func() error {
		r := Result(int32(ccall(fn, h)))
		switch r {
		case Success:
			done = true
			return nil
		case ErrorNotReady:
			return nil
		}
		return d.api.err(op, r)
	})
	return done, err
}

// ignoreClosed maps ErrClosed (the device was closed, which destroyed the
// object already) to nil.
func ignoreClosed(err error) error {
	if errors.Is(err, ErrClosed) {
		return nil
	}
	return err
}

// Event is a CUDA event: a marker in a stream that the host or other streams
// can wait for, and whose timestamps give elapsed device time.
type Event struct {
	dev    *Device
	h      uintptr // CUevent
	closed atomic.Bool
}

// Event creation flags.
const (
	eventDefault       = 0x0 // CU_EVENT_DEFAULT
	eventDisableTiming = 0x2 // CU_EVENT_DISABLE_TIMING
)

// NewEvent creates an event with timing enabled (CU_EVENT_DEFAULT).
func (d *Device) NewEvent() (*Event, error) { return d.newEvent(eventDefault) }

// NewEventNoTiming creates an event without timestamps
// (CU_EVENT_DISABLE_TIMING), for ordering only: one stream records it and
// others wait for it (Stream.WaitEvent), which the driver handles more
// cheaply than a timing event. ElapsedMs fails on it.
func (d *Device) NewEventNoTiming() (*Event, error) { return d.newEvent(eventDisableTiming) }

func (d *Device) newEvent(flags uintptr) (*Event, error) {
	e := &Event{dev: d}
	if err := d.createTracked("cuEventCreate", d.api.cuEventCreate, d.api.cuEventDestroy, resEvent, unsafe.Pointer(&e.h), flags); err != nil {
		return nil, err
	}
	return e, nil
}

// handle returns e's CUevent after checking it belongs to d and is open.
func (e *Event) handle(d *Device) (uintptr, error) {
	if e == nil {
		return 0, argErrorf("nil event")
	}
	if err := usableOn(d, e.dev, "event", e.closed.Load(), "event closed"); err != nil {
		return 0, err
	}
	return e.h, nil
}

// Record enqueues the event on stream s (nil: the legacy default stream).
func (e *Event) Record(s *Stream) error {
	h, err := e.handle(e.dev)
	if err != nil {
		return err
	}
	sh, err := e.dev.streamHandle(s)
	if err != nil {
		return err
	}
	return e.dev.do(func() error {
		return e.dev.api.check("cuEventRecord", ccall(e.dev.api.cuEventRecord, h, sh))
	})
}

// Synchronize waits until the work recorded before the event has finished.
func (e *Event) Synchronize() error {
	h, err := e.handle(e.dev)
	if err != nil {
		return err
	}
	return e.dev.do(func() error {
		return e.dev.api.check("cuEventSynchronize", ccall(e.dev.api.cuEventSynchronize, h))
	})
}

// Done reports whether the work recorded before the event has finished,
// without waiting.
func (e *Event) Done() (bool, error) {
	h, err := e.handle(e.dev)
	if err != nil {
		return false, err
	}
	return e.dev.query("cuEventQuery", e.dev.api.cuEventQuery, h)
}

// Close destroys the event. Closing twice returns nil.
func (e *Event) Close() error {
	if e == nil || !e.closed.CompareAndSwap(false, true) {
		return nil
	}
	return e.dev.destroy(resEvent, e.h, "cuEventDestroy_v2", e.dev.api.cuEventDestroy)
}

// ElapsedMs returns the device time in milliseconds between two recorded
// events (cuEventElapsedTime; resolution about half a microsecond). Both
// events must have completed: synchronize end first.
func ElapsedMs(start, end *Event) (float32, error) {
	if start == nil || end == nil {
		return 0, argErrorf("nil event")
	}
	d := start.dev
	sh, err := start.handle(d)
	if err != nil {
		return 0, err
	}
	eh, err := end.handle(d)
	if err != nil {
		return 0, err
	}
	var ms float32
	err = d.do(func() error {
		var bits uint32
		err := d.api.check("cuEventElapsedTime", ccall(d.api.cuEventElapsedTime, uintptr(unsafe.Pointer(&bits)), sh, eh))
		ms = math.Float32frombits(bits)
		return err
	})
	return ms, err
}

// CaptureMode is a CUstreamCaptureMode: which CUDA calls are prohibited
// while a stream is being captured.
type CaptureMode int32

// Stream capture modes.
const (
	// CaptureGlobal prohibits unsafe calls (such as synchronous copies)
	// from any thread while the capture runs.
	CaptureGlobal CaptureMode = 0
	// CaptureThreadLocal prohibits unsafe calls only on the capturing
	// thread. All of a Device's calls run on its executor thread, so for
	// this package it acts as CaptureGlobal does for one device.
	CaptureThreadLocal CaptureMode = 1
	// CaptureRelaxed prohibits nothing; the caller must avoid calls that
	// would break the capture.
	CaptureRelaxed CaptureMode = 2
)

// BeginCapture starts capturing the work enqueued on s into a graph instead
// of running it (cuStreamBeginCapture_v2). Only a stream created with
// NewStream or NewStreamNonBlocking can be captured. While capturing, do
// not use the synchronous copies, memsets or Synchronize on the device.
func (s *Stream) BeginCapture(mode CaptureMode) error {
	if s == nil {
		return argErrorf("the legacy default stream cannot be captured")
	}
	h, err := s.dev.streamHandle(s)
	if err != nil {
		return err
	}
	return s.dev.do(func() error {
		return s.dev.api.check("cuStreamBeginCapture_v2", ccall(s.dev.api.cuStreamBeginCapture, h, uintptr(mode)))
	})
}

// EndCapture ends the capture started by BeginCapture and instantiates the
// captured work as an executable graph (cuStreamEndCapture,
// cuGraphInstantiateWithFlags).
func (s *Stream) EndCapture() (*Graph, error) {
	if s == nil {
		return nil, argErrorf("the legacy default stream cannot be captured")
	}
	h, err := s.dev.streamHandle(s)
	if err != nil {
		return nil, err
	}
	d := s.dev
	g := &Graph{dev: d}
	err = d.do(func() error {
		var graph, exec uintptr
		if err := d.api.check("cuStreamEndCapture", ccall(d.api.cuStreamEndCapture, h, uintptr(unsafe.Pointer(&graph)))); err != nil {
			return err
		}
		if err := d.api.check("cuGraphInstantiateWithFlags", ccall(d.api.cuGraphInstantiateWithFlags,
			uintptr(unsafe.Pointer(&exec)), graph, 0)); err != nil {
			ccall(d.api.cuGraphDestroy, graph)
			return err
		}
		g.graph, g.exec = graph, exec
		d.track(resGraph, exec, func() {
			ccall(d.api.cuGraphExecDestroy, exec)
			ccall(d.api.cuGraphDestroy, graph)
		})
		return nil
	})
	if err != nil {
		return nil, err
	}
	return g, nil
}

// Graph is an instantiated CUDA graph captured from a stream; Launch replays
// the captured work with the arguments it was captured with.
type Graph struct {
	dev         *Device
	graph, exec uintptr // CUgraph, CUgraphExec
	closed      atomic.Bool
}

// Launch enqueues one replay of the graph on stream s (nil: the legacy
// default stream).
func (g *Graph) Launch(s *Stream) error {
	if g.closed.Load() {
		return closedErrorf("graph closed")
	}
	sh, err := g.dev.streamHandle(s)
	if err != nil {
		return err
	}
	return g.dev.do(func() error {
		return g.dev.api.check("cuGraphLaunch", ccall(g.dev.api.cuGraphLaunch, g.exec, sh))
	})
}

// Close destroys the executable graph and the graph. Closing twice returns nil.
func (g *Graph) Close() error {
	if g == nil || !g.closed.CompareAndSwap(false, true) {
		return nil
	}
	d := g.dev
	return ignoreClosed(d.do(func() error {
		d.untrack(resGraph, g.exec)
		err := d.api.check("cuGraphExecDestroy", ccall(d.api.cuGraphExecDestroy, g.exec))
		if err2 := d.api.check("cuGraphDestroy", ccall(d.api.cuGraphDestroy, g.graph)); err == nil {
			err = err2
		}
		return err
	}))
}
