package cuda

import "fmt"

// Foreign handles: a program that drives CUDA itself (through its own
// bindings, another library, or purego) hands flashattn its context, its
// device memory and its streams as raw driver handles. The wrappers below
// use them without taking ownership: nothing here frees, destroys or
// releases what the caller created.

// OpenContext returns a Device that runs every driver call with ctx, a
// CUcontext the caller created (cuCtxCreate) or retained
// (cuDevicePrimaryCtxRetain), current on its executor thread. The device
// ordinal is the context's device. Close destroys what was created through
// the Device (buffers from Alloc, streams from NewStream, modules, …) and
// leaves ctx to the caller, who must keep it alive until then. It fails
// with an error wrapping ErrNoDriver when no driver loads, and with the
// driver's error when ctx is not a valid context.
func OpenContext(ctx uintptr) (*Device, error) {
	a, err := driver()
	if err != nil {
		return nil, err
	}
	if ctx == 0 {
		return nil, argErrorf("OpenContext: nil CUcontext")
	}
	return start(&Device{api: a, ctx: ctx})
}

// BorrowBuffer wraps size bytes of device memory at ptr (a CUdeviceptr the
// caller allocated in d's context, by cuMemAlloc, cuMemAllocAsync, a
// framework's allocator, …) as a Buffer, so that device tensors can view it
// without a copy. Free only ends the Buffer's use; the caller frees the
// memory, after the last work enqueued on it has finished. The range is
// not checked against the caller's allocation: it must lie inside one.
func (d *Device) BorrowBuffer(ptr uint64, size int64) (*Buffer, error) {
	if ptr == 0 || size <= 0 {
		return nil, argErrorf("BorrowBuffer: pointer %#x, %d bytes", ptr, size)
	}
	if ptr+uint64(size) < ptr {
		return nil, argErrorf("BorrowBuffer: %d bytes at %#x pass the end of the address space", size, ptr)
	}
	return &Buffer{dev: d, ptr: ptr, size: size, borrowed: true}, nil
}

// BorrowStream wraps h, a CUstream the caller created in d's context (or
// 0, the legacy default stream; CU_STREAM_PER_THREAD, 2, is not accepted,
// since the executor's thread is not the caller's), as a Stream on which
// flashattn enqueues work. Close only ends the Stream's use; the caller
// destroys the stream.
func (d *Device) BorrowStream(h uintptr) (*Stream, error) {
	if h == streamPerThread {
		return nil, argErrorf("BorrowStream: the per-thread default stream belongs to the calling thread; pass a created stream")
	}
	return &Stream{dev: d, h: h, borrowed: true}, nil
}

// streamPerThread is CU_STREAM_PER_THREAD.
const streamPerThread = 0x2

// Do runs fn on d's executor thread, where d's context is current, and
// returns fn's error: for calls into other libraries that act on the
// calling thread's current context (NCCL, cuBLAS, …). fn must not call
// methods of d or of its objects, which would wait for the executor that
// is running fn, and should return promptly: every other call on d waits
// for it. It fails with ErrClosed after Close and with ErrArgument for a
// nil fn.
func (d *Device) Do(fn func() error) error {
	if fn == nil {
		return argErrorf("Do: nil function")
	}
	return d.do(fn)
}

// MakeCurrent makes d's context current on the calling OS thread
// (cuCtxSetCurrent), for a library call sequence that must run on one
// thread while it moves between devices: an NCCL group that creates one
// communicator per device, for example. The calling goroutine must be
// locked to its thread (runtime.LockOSThread) and should stay locked until
// it exits, so that the thread, which keeps the context current, ends with
// it instead of serving other goroutines. d must stay open while the
// context is used. For calls on one device, use Do. It fails with
// ErrClosed after Close and with the driver's error otherwise.
func (d *Device) MakeCurrent() error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return closedErrorf("device %d is closed", d.ordinal)
	}
	return d.api.check(fmt.Sprintf("cuCtxSetCurrent(device %d)", d.ordinal), ccall(d.api.cuCtxSetCurrent, d.ctx))
}
