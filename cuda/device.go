package cuda

import (
	"bytes"
	"fmt"
	"runtime"
	"sync"
	"time"
	"unsafe"
)

// DeviceAttribute is a CUdevice_attribute, for Device.Attribute.
type DeviceAttribute int32

// Device attributes that this package reads; any other CUdevice_attribute
// value from cuda.h may be passed to Device.Attribute as well.
const (
	AttrMaxThreadsPerBlock               DeviceAttribute = 1
	AttrMaxSharedMemoryPerBlock          DeviceAttribute = 8
	AttrWarpSize                         DeviceAttribute = 10
	AttrMaxRegistersPerBlock             DeviceAttribute = 12
	AttrClockRate                        DeviceAttribute = 13
	AttrMultiprocessorCount              DeviceAttribute = 16
	AttrMemoryClockRate                  DeviceAttribute = 36
	AttrGlobalMemoryBusWidth             DeviceAttribute = 37
	AttrL2CacheSize                      DeviceAttribute = 38
	AttrMaxThreadsPerMultiprocessor      DeviceAttribute = 39
	AttrComputeCapabilityMajor           DeviceAttribute = 75
	AttrComputeCapabilityMinor           DeviceAttribute = 76
	AttrMaxSharedMemoryPerMultiprocessor DeviceAttribute = 81
	AttrMaxRegistersPerMultiprocessor    DeviceAttribute = 82
	AttrMaxSharedMemoryPerBlockOptin     DeviceAttribute = 97
)

// Device is one CUDA GPU with its primary context. Every driver call for the
// device runs on one goroutine locked to its OS thread, on which the context
// is current; the methods hand closures to it and wait for the result, so
// they are safe for concurrent use by multiple goroutines.
type Device struct {
	api     *driverAPI
	ordinal int
	dev     int32   // CUdevice
	ctx     uintptr // CUcontext (the device's primary context, or the caller's: see OpenContext)
	primary bool    // ctx is the primary context this Device retained (released at Close)

	name         string
	major, minor int
	sms          int
	smemBlock    int
	smemOptin    int
	smemSM       int
	l2           int
	totalMem     int64
	warp         int

	mu     sync.RWMutex // held for reading by each call in flight, for writing by Close
	closed bool
	work   chan func()

	// Executor-thread state: touched only by closures running on the
	// executor goroutine.
	live   map[resourceKey]func() // resources to destroy at Close
	launch *launchScratch
}

// resourceKind tells live resources of different kinds apart.
type resourceKind uint8

const (
	resBuffer resourceKind = iota
	resHost
	resRegistered
	resStream
	resEvent
	resModule
	resGraph
)

// resourceKey identifies a live driver object owned by a Device.
type resourceKey struct {
	kind   resourceKind
	handle uintptr
}

// Open initializes the CUDA driver (on first use), retains the primary
// context of device ordinal and starts the device's executor goroutine.
// It fails with an error wrapping ErrNoDriver when no driver library loads
// and ErrNoDevice when the driver finds no usable device or ordinal is out
// of range. Close the device when done.
func Open(ordinal int) (*Device, error) {
	a, err := driver()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 {
		return nil, argErrorf("device ordinal %d", ordinal)
	}
	return start(&Device{api: a, ordinal: ordinal, primary: true})
}

// start starts d's executor and waits for its setup.
func start(d *Device) (*Device, error) {
	d.work = make(chan func(), 64)
	d.live = make(map[resourceKey]func())
	d.launch = new(launchScratch)
	ready := make(chan error, 1)
	go d.serve(ready)
	if err := <-ready; err != nil {
		return nil, err
	}
	return d, nil
}

// serve is the executor: it locks its OS thread, makes the context current
// on it and runs closures from d.work until the channel closes. The thread
// is never unlocked, so it exits with the goroutine.
func (d *Device) serve(ready chan<- error) {
	runtime.LockOSThread()
	if err := d.setup(); err != nil {
		ready <- err
		return
	}
	ready <- nil
	d.loop()
}

// spinWindow is how long the executor and a waiting caller poll for the
// next request or the result before they block. A blocked goroutine locked
// to its thread takes several microseconds to wake, which would dominate
// short calls such as launches; polling keeps bursts of calls fast. With
// GOMAXPROCS 1 nobody polls.
const spinWindow = 50 * time.Microsecond

// loop runs requests until d.work is closed (executor thread).
func (d *Device) loop() {
	spin := runtime.GOMAXPROCS(0) > 1
	for {
		f, ok := d.next(spin)
		if !ok {
			return
		}
		f()
	}
}

// next returns the next request, polling for spinWindow before blocking.
func (d *Device) next(spin bool) (func(), bool) {
	if spin {
		deadline := time.Now().Add(spinWindow)
		for i := 0; ; i++ {
			select {
			case f, ok := <-d.work:
				return f, ok
			default:
			}
			if i%64 == 63 && time.Now().After(deadline) {
				break
			}
		}
	}
	f, ok := <-d.work
	return f, ok
}

// setup runs on the executor thread: it retains the primary context (or,
// for OpenContext, finds the device of the caller's context), makes the
// context current and reads the device's properties.
func (d *Device) setup() error {
	a := d.api
	if !d.primary {
		if err := a.check("cuCtxSetCurrent(caller's context)", ccall(a.cuCtxSetCurrent, d.ctx)); err != nil {
			return err
		}
		if err := a.check("cuCtxGetDevice", ccall(a.cuCtxGetDevice, uintptr(unsafe.Pointer(&d.dev)))); err != nil {
			return err
		}
		d.ordinal = int(d.dev)
		return d.readProperties()
	}
	if err := a.check(fmt.Sprintf("cuDeviceGet(%d)", d.ordinal),
		ccall(a.cuDeviceGet, uintptr(unsafe.Pointer(&d.dev)), uintptr(d.ordinal))); err != nil {
		err.(*Error).also = ErrNoDevice
		return err
	}
	if err := a.check("cuDevicePrimaryCtxRetain",
		ccall(a.cuDevicePrimaryCtxRetain, uintptr(unsafe.Pointer(&d.ctx)), uintptr(d.dev))); err != nil {
		return err
	}
	if err := a.check("cuCtxSetCurrent", ccall(a.cuCtxSetCurrent, d.ctx)); err != nil {
		ccall(a.cuDevicePrimaryCtxRelease, uintptr(d.dev))
		return err
	}
	if err := d.readProperties(); err != nil {
		ccall(a.cuDevicePrimaryCtxRelease, uintptr(d.dev))
		return err
	}
	return nil
}

// readProperties fills the cached device properties (executor thread).
func (d *Device) readProperties() error {
	a := d.api
	name := make([]byte, 256)
	if err := a.check("cuDeviceGetName", ccall(a.cuDeviceGetName,
		uintptr(unsafe.Pointer(&name[0])), uintptr(len(name)), uintptr(d.dev))); err != nil {
		return err
	}
	if i := bytes.IndexByte(name, 0); i >= 0 {
		name = name[:i]
	}
	d.name = string(name)
	var total uint64
	if err := a.check("cuDeviceTotalMem_v2", ccall(a.cuDeviceTotalMem,
		uintptr(unsafe.Pointer(&total)), uintptr(d.dev))); err != nil {
		return err
	}
	d.totalMem = int64(total)
	for _, q := range []struct {
		attr DeviceAttribute
		dst  *int
	}{
		{AttrComputeCapabilityMajor, &d.major},
		{AttrComputeCapabilityMinor, &d.minor},
		{AttrMultiprocessorCount, &d.sms},
		{AttrMaxSharedMemoryPerBlock, &d.smemBlock},
		{AttrMaxSharedMemoryPerBlockOptin, &d.smemOptin},
		{AttrMaxSharedMemoryPerMultiprocessor, &d.smemSM},
		{AttrL2CacheSize, &d.l2},
		{AttrWarpSize, &d.warp},
	} {
		v, err := d.attribute(q.attr)
		if err != nil {
			return err
		}
		*q.dst = v
	}
	return nil
}

// attribute reads one device attribute (executor thread).
func (d *Device) attribute(attr DeviceAttribute) (int, error) {
	var v int32
	err := d.api.check(fmt.Sprintf("cuDeviceGetAttribute(%d)", attr), ccall(d.api.cuDeviceGetAttribute,
		uintptr(unsafe.Pointer(&v)), uintptr(attr), uintptr(d.dev)))
	return int(v), err
}

// callResult carries a closure's outcome back to the caller.
type callResult struct {
	err      error
	panicked any
	didPanic bool
}

// do runs fn on the executor thread and returns its error. A panic in fn is
// re-raised in the caller. It fails with ErrClosed after Close.
func (d *Device) do(fn func() error) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return closedErrorf("device %d is closed", d.ordinal)
	}
	done := make(chan callResult, 1)
	d.work <- func() {
		var res callResult
		defer func() {
			if p := recover(); p != nil {
				res.panicked, res.didPanic = p, true
			}
			done <- res
		}()
		res.err = fn()
	}
	res := wait(done)
	if res.didPanic {
		panic(res.panicked)
	}
	return res.err
}

// wait returns the result from done, polling for spinWindow (yielding to
// other goroutines between polls) before it blocks.
func wait(done chan callResult) callResult {
	if runtime.GOMAXPROCS(0) > 1 {
		deadline := time.Now().Add(spinWindow)
		for i := 0; ; i++ {
			select {
			case res := <-done:
				return res
			default:
			}
			if i%16 == 15 {
				if time.Now().After(deadline) {
					break
				}
				runtime.Gosched()
			}
		}
	}
	return <-done
}

// track records a live resource to destroy at Close (executor thread).
func (d *Device) track(kind resourceKind, h uintptr, destroy func()) {
	d.live[resourceKey{kind, h}] = destroy
}

// untrack forgets a resource destroyed explicitly (executor thread).
func (d *Device) untrack(kind resourceKind, h uintptr) {
	delete(d.live, resourceKey{kind, h})
}

// Close destroys every resource still open on the device (graphs, modules,
// events, streams, buffers) that was created through it (not borrowed
// ones), releases the primary context (not a context passed to
// OpenContext) and stops the executor. Later calls on the device or its objects fail with ErrClosed.
// Closing a closed device returns nil.
func (d *Device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	errc := make(chan error, 1)
	d.work <- func() {
		// Destroy in dependency order: graphs and modules before the
		// memory and streams they may refer to.
		for _, kind := range []resourceKind{resGraph, resModule, resEvent, resStream, resBuffer, resHost, resRegistered} {
			for k, destroy := range d.live {
				if k.kind == kind {
					destroy()
					delete(d.live, k)
				}
			}
		}
		if !d.primary {
			errc <- nil // the caller's context stays the caller's
			return
		}
		errc <- d.api.check("cuDevicePrimaryCtxRelease_v2", ccall(d.api.cuDevicePrimaryCtxRelease, uintptr(d.dev)))
	}
	err := <-errc
	close(d.work)
	return err
}

// Ordinal returns the device's ordinal as passed to Open.
func (d *Device) Ordinal() int { return d.ordinal }

// Name returns the device's product name, such as "NVIDIA H200".
func (d *Device) Name() string { return d.name }

// ComputeCapability returns the device's compute capability, such as 9, 0.
func (d *Device) ComputeCapability() (major, minor int) { return d.major, d.minor }

// Arch returns the device's real architecture name for NVRTC, such as
// "sm_90".
func (d *Device) Arch() string { return fmt.Sprintf("sm_%d%d", d.major, d.minor) }

// SMCount returns the number of streaming multiprocessors.
func (d *Device) SMCount() int { return d.sms }

// SharedMemoryPerBlock returns the shared memory a block may use without
// opting in, in bytes (48 KiB on current GPUs).
func (d *Device) SharedMemoryPerBlock() int { return d.smemBlock }

// SharedMemoryPerBlockOptin returns the most shared memory a block may use
// after Function.SetMaxDynamicSharedMemory raises its limit, in bytes.
func (d *Device) SharedMemoryPerBlockOptin() int { return d.smemOptin }

// SharedMemoryPerSM returns the shared memory of one multiprocessor in bytes.
func (d *Device) SharedMemoryPerSM() int { return d.smemSM }

// L2CacheSize returns the L2 cache size in bytes.
func (d *Device) L2CacheSize() int { return d.l2 }

// WarpSize returns the warp size in threads.
func (d *Device) WarpSize() int { return d.warp }

// TotalMemory returns the device's global memory in bytes.
func (d *Device) TotalMemory() int64 { return d.totalMem }

// String describes the device, such as "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)".
func (d *Device) String() string {
	return fmt.Sprintf("%s (%s, %d SMs, %.1f GiB)", d.name, d.Arch(), d.sms, float64(d.totalMem)/(1<<30))
}

// Attribute reads any CUdevice_attribute of the device.
func (d *Device) Attribute(attr DeviceAttribute) (int, error) {
	var v int
	err := d.do(func() error {
		var err error
		v, err = d.attribute(attr)
		return err
	})
	return v, err
}

// MemInfo returns the free and total device memory in bytes.
func (d *Device) MemInfo() (free, total int64, err error) {
	err = d.do(func() error {
		var f, t uint64
		err := d.api.check("cuMemGetInfo_v2", ccall(d.api.cuMemGetInfo,
			uintptr(unsafe.Pointer(&f)), uintptr(unsafe.Pointer(&t))))
		free, total = int64(f), int64(t)
		return err
	})
	return free, total, err
}

// Synchronize waits until all work submitted to the device has finished
// (cuCtxSynchronize) and returns the first asynchronous error, if any.
func (d *Device) Synchronize() error {
	return d.do(func() error {
		return d.api.check("cuCtxSynchronize", ccall(d.api.cuCtxSynchronize))
	})
}
