package cuda

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"unsafe"
)

// Buffer is an allocation of device memory. Free it explicitly; a buffer
// that becomes unreachable unfreed is freed by a cleanup that hands the
// cuMemFree to the device's executor, as a backstop only.
type Buffer struct {
	dev      *Device
	ptr      uint64
	size     int64
	freed    atomic.Bool
	cleanup  runtime.Cleanup
	borrowed bool // the caller's memory (BorrowBuffer): Free only forgets it
}

// Alloc allocates bytes of device memory (cuMemAlloc). The contents are
// undefined. bytes must be positive.
func (d *Device) Alloc(bytes int64) (*Buffer, error) {
	if bytes <= 0 {
		return nil, argErrorf("alloc of %d bytes", bytes)
	}
	var p uint64
	if err := d.createTracked(fmt.Sprintf("cuMemAlloc_v2(%d bytes)", bytes), d.api.cuMemAlloc, d.api.cuMemFree, resBuffer, unsafe.Pointer(&p), uintptr(bytes)); err != nil {
		return nil, err
	}
	b := &Buffer{dev: d, ptr: p, size: bytes}
	b.cleanup = runtime.AddCleanup(b, func(h freeHandle) { go h.free() }, freeHandle{d, resBuffer, uintptr(p)})
	return b, nil
}

// createTracked calls the driver's create (named name) with out and arg;
// create writes a new handle to out (a CUstream, CUevent, device pointer or
// host pointer: one machine word), which is then tracked as a resource of
// kind that destroy releases.
func (d *Device) createTracked(name string, create, destroy uintptr, kind resourceKind, out unsafe.Pointer, arg uintptr) error {
	return d.do(func() error {
		if err := d.api.check(name, ccall(create, uintptr(out), arg)); err != nil {
			return err
		}
		h := *(*uintptr)(out)
		d.track(kind, h, func() { ccall(destroy, h) })
		return nil
	})
}

// freeHandle is what a cleanup needs to free a resource; it must not refer
// to the object whose cleanup it belongs to.
type freeHandle struct {
	dev    *Device
	kind   resourceKind
	handle uintptr
}

// free destroys the resource on the executor thread; errors are dropped
// (the resource may already be gone with its closed device).
func (h freeHandle) free() {
	_ = h.dev.do(func() error {
		if destroy, ok := h.dev.live[resourceKey{h.kind, h.handle}]; ok {
			destroy()
			h.dev.untrack(h.kind, h.handle)
		}
		return nil
	})
}

// Free releases the device memory (cuMemFree). Freeing twice, or after the
// device was closed (which freed it), returns nil. Freeing a borrowed buffer
// (BorrowBuffer) only ends its use through b; the memory stays the
// caller's.
func (b *Buffer) Free() error {
	if b == nil {
		return nil
	}
	if b.borrowed {
		b.freed.Store(true)
		return nil
	}
	return b.dev.release(&b.freed, &b.cleanup, resBuffer, uintptr(b.ptr), "cuMemFree_v2", b.dev.api.cuMemFree)
}

// release frees a tracked resource once: the first call stops its cleanup,
// forgets it and calls the driver's free function fn on the executor; later
// calls, and calls after the device was closed (which freed it), return nil.
func (d *Device) release(freed *atomic.Bool, cleanup *runtime.Cleanup, kind resourceKind, handle uintptr, op string, fn uintptr) error {
	if !freed.CompareAndSwap(false, true) {
		return nil
	}
	cleanup.Stop()
	return d.destroy(kind, handle, op, fn)
}

// destroy forgets the tracked resource handle of kind and calls the
// driver's destroy function fn (named op) on it on the executor; after the
// device was closed (which destroyed it) it returns nil.
func (d *Device) destroy(kind resourceKind, handle uintptr, op string, fn uintptr) error {
	return ignoreClosed(d.do(func() error {
		d.untrack(kind, handle)
		return d.api.check(op, ccall(fn, handle))
	}))
}

// Ptr returns the buffer's device address (a CUdeviceptr), for kernel
// parameters. It returns 0 after Free.
func (b *Buffer) Ptr() uint64 {
	if b.freed.Load() {
		return 0
	}
	return b.ptr
}

// Size returns the buffer's size in bytes.
func (b *Buffer) Size() int64 { return b.size }

// Device returns the device the buffer lives on.
func (b *Buffer) Device() *Device { return b.dev }

// span checks that [off, off+n) lies inside b and that b belongs to d and is
// not freed, and returns the device address of off.
func (b *Buffer) span(d *Device, off, n int64) (uint64, error) {
	if b == nil {
		return 0, argErrorf("nil buffer")
	}
	if err := usableOn(d, b.dev, "buffer", b.freed.Load(), "buffer freed"); err != nil {
		return 0, err
	}
	if off < 0 || n < 0 || off > b.size || n > b.size-off {
		return 0, argErrorf("range [%d, %d) outside buffer of %d bytes", off, off+n, b.size)
	}
	return b.ptr + uint64(off), nil
}

// streamHandle returns s's CUstream (0, the legacy default stream, for nil)
// after checking that s belongs to d and is open.
func (d *Device) streamHandle(s *Stream) (uintptr, error) {
	if s == nil {
		return 0, nil
	}
	if err := usableOn(d, s.dev, "stream", s.closed.Load(), "stream closed"); err != nil {
		return 0, err
	}
	return s.h, nil
}

// addr returns the address of p's first byte, or 0 for an empty slice.
func addr(p []byte) uintptr {
	if len(p) == 0 {
		return 0
	}
	return uintptr(unsafe.Pointer(&p[0]))
}

// hostCopy calls the driver's copy fn (named name) with args on the
// device's thread; host is the Go memory one side of the copy uses, kept
// alive until the call returns.
func (d *Device) hostCopy(name string, fn uintptr, host []byte, args ...uintptr) error {
	return d.do(func() error {
		err := d.api.check(fmt.Sprintf("%s(%d bytes)", name, len(host)), ccall(fn, args...))
		runtime.KeepAlive(host)
		return err
	})
}

// CopyToDevice copies src into dst starting at byte offset off and returns
// when the copy has finished (cuMemcpyHtoD on the legacy default stream,
// which waits for earlier work on blocking streams).
func (d *Device) CopyToDevice(dst *Buffer, off int64, src []byte) error {
	p, err := dst.span(d, off, int64(len(src)))
	if err != nil || len(src) == 0 {
		return err
	}
	return d.hostCopy("cuMemcpyHtoD_v2", d.api.cuMemcpyHtoD, src, uintptr(p), addr(src), uintptr(len(src)))
}

// CopyFromDevice copies len(dst) bytes from src starting at byte offset off
// into dst and returns when the copy has finished.
func (d *Device) CopyFromDevice(dst []byte, src *Buffer, off int64) error {
	p, err := src.span(d, off, int64(len(dst)))
	if err != nil || len(dst) == 0 {
		return err
	}
	return d.hostCopy("cuMemcpyDtoH_v2", d.api.cuMemcpyDtoH, dst, addr(dst), uintptr(p), uintptr(len(dst)))
}

// CopyDeviceToDevice copies n bytes from src at srcOff to dst at dstOff and
// returns when the copy has finished.
func (d *Device) CopyDeviceToDevice(dst *Buffer, dstOff int64, src *Buffer, srcOff int64, n int64) error {
	pd, err := dst.span(d, dstOff, n)
	if err != nil {
		return err
	}
	ps, err := src.span(d, srcOff, n)
	if err != nil || n == 0 {
		return err
	}
	return d.do(func() error {
		if err := d.api.check(fmt.Sprintf("cuMemcpyDtoD_v2(%d bytes)", n),
			ccall(d.api.cuMemcpyDtoD, uintptr(pd), uintptr(ps), uintptr(n))); err != nil {
			return err
		}
		// cuMemcpyDtoD may return before the copy finished.
		return d.syncLegacy()
	})
}

// asyncSpan returns the address of b's bytes [off, off+n) and s's CUstream
// for an asynchronous copy, after checking both.
func (d *Device) asyncSpan(b *Buffer, off, n int64, s *Stream) (uint64, uintptr, error) {
	p, err := b.span(d, off, n)
	if err != nil {
		return 0, 0, err
	}
	sh, err := d.streamHandle(s)
	return p, sh, err
}

// CopyToDeviceAsync enqueues a copy of src into dst at off on stream s (nil:
// the legacy default stream). With pinned memory (HostBuffer.Bytes) the copy
// runs asynchronously and src must stay unchanged until the stream reaches
// it; with ordinary Go memory the driver stages src before returning.
func (d *Device) CopyToDeviceAsync(dst *Buffer, off int64, src []byte, s *Stream) error {
	p, sh, err := d.asyncSpan(dst, off, int64(len(src)), s)
	if err != nil || len(src) == 0 {
		return err
	}
	return d.hostCopy("cuMemcpyHtoDAsync_v2", d.api.cuMemcpyHtoDAsync, src, uintptr(p), addr(src), uintptr(len(src)), sh)
}

// CopyFromDeviceAsync enqueues a copy from src at off into dst on stream s
// (nil: the legacy default stream). dst must be pinned memory
// (HostBuffer.Bytes) for the copy to be asynchronous; with ordinary Go
// memory the call returns after the copy finished. With pinned memory, read
// dst only after synchronizing the stream.
func (d *Device) CopyFromDeviceAsync(dst []byte, src *Buffer, off int64, s *Stream) error {
	p, sh, err := d.asyncSpan(src, off, int64(len(dst)), s)
	if err != nil || len(dst) == 0 {
		return err
	}
	return d.hostCopy("cuMemcpyDtoHAsync_v2", d.api.cuMemcpyDtoHAsync, dst, addr(dst), uintptr(p), uintptr(len(dst)), sh)
}

// CopyDeviceToDeviceAsync enqueues a copy of n bytes from src at srcOff to
// dst at dstOff on stream s (nil: the legacy default stream).
func (d *Device) CopyDeviceToDeviceAsync(dst *Buffer, dstOff int64, src *Buffer, srcOff int64, n int64, s *Stream) error {
	pd, err := dst.span(d, dstOff, n)
	if err != nil {
		return err
	}
	ps, err := src.span(d, srcOff, n)
	if err != nil {
		return err
	}
	sh, err := d.streamHandle(s)
	if err != nil || n == 0 {
		return err
	}
	return d.do(func() error {
		return d.api.check(fmt.Sprintf("cuMemcpyDtoDAsync_v2(%d bytes)", n),
			ccall(d.api.cuMemcpyDtoDAsync, uintptr(pd), uintptr(ps), uintptr(n), sh))
	})
}

// Memset8 sets every byte of b to value and returns when done.
func (d *Device) Memset8(b *Buffer, value byte) error {
	p, err := b.span(d, 0, sizeOf(b))
	if err != nil {
		return err
	}
	return d.do(func() error {
		if err := d.api.check("cuMemsetD8_v2", ccall(d.api.cuMemsetD8, uintptr(p), uintptr(value), uintptr(b.size))); err != nil {
			return err
		}
		return d.syncLegacy()
	})
}

// Memset32 sets every 32-bit word of b to value (for example 0x7fc00000, a
// float32 NaN) and returns when done. b's size must be a multiple of 4.
func (d *Device) Memset32(b *Buffer, value uint32) error {
	p, n, err := d.words(b)
	if err != nil {
		return err
	}
	return d.do(func() error {
		if err := d.api.check("cuMemsetD32_v2", ccall(d.api.cuMemsetD32, uintptr(p), uintptr(value), uintptr(n))); err != nil {
			return err
		}
		return d.syncLegacy()
	})
}

// Memset8Async enqueues setting every byte of b to value on stream s (nil:
// the legacy default stream).
func (d *Device) Memset8Async(b *Buffer, value byte, s *Stream) error {
	p, sh, err := d.asyncSpan(b, 0, sizeOf(b), s)
	if err != nil {
		return err
	}
	return d.do(func() error {
		return d.api.check("cuMemsetD8Async", ccall(d.api.cuMemsetD8Async, uintptr(p), uintptr(value), uintptr(b.size), sh))
	})
}

// Memset32Async enqueues setting every 32-bit word of b to value on stream s
// (nil: the legacy default stream). b's size must be a multiple of 4.
func (d *Device) Memset32Async(b *Buffer, value uint32, s *Stream) error {
	p, n, err := d.words(b)
	if err != nil {
		return err
	}
	sh, err := d.streamHandle(s)
	if err != nil {
		return err
	}
	return d.do(func() error {
		return d.api.check("cuMemsetD32Async", ccall(d.api.cuMemsetD32Async, uintptr(p), uintptr(value), uintptr(n), sh))
	})
}

// words checks b for a 32-bit memset and returns its address and word count.
func (d *Device) words(b *Buffer) (uint64, int64, error) {
	p, err := b.span(d, 0, sizeOf(b))
	if err != nil {
		return 0, 0, err
	}
	if b.size%4 != 0 {
		return 0, 0, argErrorf("32-bit memset of a %d-byte buffer", b.size)
	}
	return p, b.size / 4, nil
}

// HostBuffer is page-locked (pinned) host memory, which asynchronous copies
// can read and write while the host goes on. Free it explicitly; a cleanup
// frees it as a backstop only.
type HostBuffer struct {
	dev     *Device
	p       unsafe.Pointer
	size    int
	freed   atomic.Bool
	cleanup runtime.Cleanup
}

// AllocHost allocates bytes of pinned host memory (cuMemAllocHost).
func (d *Device) AllocHost(bytes int) (*HostBuffer, error) {
	if bytes <= 0 {
		return nil, argErrorf("host alloc of %d bytes", bytes)
	}
	var p unsafe.Pointer
	if err := d.createTracked(fmt.Sprintf("cuMemAllocHost_v2(%d bytes)", bytes), d.api.cuMemAllocHost, d.api.cuMemFreeHost, resHost, unsafe.Pointer(&p), uintptr(bytes)); err != nil {
		return nil, err
	}
	hb := &HostBuffer{dev: d, p: p, size: bytes}
	hb.cleanup = runtime.AddCleanup(hb, func(h freeHandle) { go h.free() }, freeHandle{d, resHost, uintptr(p)})
	return hb, nil
}

// Bytes returns the pinned memory as a byte slice, or nil after Free. The
// slice must not be used after Free or after the device is closed.
func (h *HostBuffer) Bytes() []byte {
	if h.freed.Load() {
		return nil
	}
	return unsafe.Slice((*byte)(h.p), h.size)
}

// Size returns the buffer's size in bytes.
func (h *HostBuffer) Size() int { return h.size }

// Free releases the pinned memory (cuMemFreeHost). Freeing twice, or after
// the device was closed, returns nil.
func (h *HostBuffer) Free() error {
	if h == nil {
		return nil
	}
	return h.dev.release(&h.freed, &h.cleanup, resHost, uintptr(h.p), "cuMemFreeHost", h.dev.api.cuMemFreeHost)
}

// HostPageSize is the granularity of page-locking: RegisterHost locks
// whole pages of this size.
const HostPageSize = 4096

// HostPages returns the page-aligned range [lo, hi) of the pages that hold
// b's bytes (b not empty): the pages RegisterHost locks for b.
func HostPages(b []byte) (lo, hi uintptr) {
	base := uintptr(unsafe.Pointer(&b[0]))
	return base &^ (HostPageSize - 1), (base + uintptr(len(b)) + HostPageSize - 1) &^ (HostPageSize - 1)
}

// HostRegistration is host memory the caller owns (Go memory included),
// page-locked for the device by RegisterHost so that asynchronous copies
// to and from it run as direct DMA, with no staging.
type HostRegistration struct {
	dev      *Device
	p        uintptr
	size     int
	released atomic.Bool
	cleanup  runtime.Cleanup // none: the caller unregisters
}

// RegisterHost page-locks the pages that hold b (cuMemHostRegister_v2):
// from the page that holds b's first byte to the page that holds its last.
// While registered, copies with b as the host side run as direct DMA,
// asynchronous to the host. The caller keeps b alive and unregisters it
// (Unregister) before it frees b or its pages are reused; a page locked
// twice fails with an *Error of code ErrorHostMemoryRegistered. An empty b
// is an ErrArgument.
func (d *Device) RegisterHost(b []byte) (*HostRegistration, error) {
	if len(b) == 0 {
		return nil, argErrorf("host registration of 0 bytes")
	}
	lo, hi := HostPages(b)
	r := &HostRegistration{dev: d, p: lo, size: int(hi - lo)}
	err := d.do(func() error {
		name := fmt.Sprintf("cuMemHostRegister_v2(%d bytes)", r.size)
		if err := d.api.check(name, ccall(d.api.cuMemHostRegister, lo, uintptr(r.size), 0)); err != nil {
			return err
		}
		d.track(resRegistered, lo, func() { ccall(d.api.cuMemHostUnregister, lo) })
		return nil
	})
	if err != nil {
		return nil, err
	}
	return r, nil
}

// Range returns the locked pages' first address and their length in bytes.
func (r *HostRegistration) Range() (addr uintptr, bytes int) { return r.p, r.size }

// Unregister unlocks the pages (cuMemHostUnregister). No copy may still be
// using them. Unregistering twice, or after the device was closed (which
// unregistered them), returns nil.
func (r *HostRegistration) Unregister() error {
	if r == nil {
		return nil
	}
	return r.dev.release(&r.released, &r.cleanup, resRegistered, r.p, "cuMemHostUnregister", r.dev.api.cuMemHostUnregister)
}

// AsBytes views a slice of plain values (numbers, or structs of numbers) as
// its bytes, without copying, for the copy functions.
func AsBytes[T any](s []T) []byte {
	if len(s) == 0 {
		return nil
	}
	var zero T
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), len(s)*int(unsafe.Sizeof(zero)))
}

// syncLegacy waits for the legacy default stream, on which the synchronous
// copies and memsets run (executor thread).
func (d *Device) syncLegacy() error {
	return d.api.check("cuStreamSynchronize(default stream)", ccall(d.api.cuStreamSynchronize, 0))
}

// sizeOf returns b's size, or 0 for a nil buffer.
func sizeOf(b *Buffer) int64 {
	if b == nil {
		return 0
	}
	return b.size
}
