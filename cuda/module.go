package cuda

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"
)

// Module is a loaded CUDA module (a cubin, fatbin or PTX image) whose
// kernels are looked up with Function.
type Module struct {
	dev    *Device
	h      uintptr // CUmodule
	closed atomic.Bool

	// Stats describes how the module's image was produced and loaded. For
	// modules from LoadModule only LoadTime is set.
	Stats CompileStats
}

// JIT option codes (CUjit_option) used to capture the driver's error log.
const (
	jitErrorLogBuffer          = 5 // CU_JIT_ERROR_LOG_BUFFER
	jitErrorLogBufferSizeBytes = 6 // CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES
)

// jitOptions is the option block for cuModuleLoadDataEx, on the Go heap.
type jitOptions struct {
	opts [2]int32
	vals [2]uintptr
	log  []byte
}

// newJITOptions allocates an option block that asks for the JIT error log.
//
//go:noinline
func newJITOptions() *jitOptions {
	j := &jitOptions{log: heapBytes(16 << 10)}
	j.opts = [2]int32{jitErrorLogBuffer, jitErrorLogBufferSizeBytes}
	j.vals = [2]uintptr{uintptr(unsafe.Pointer(&j.log[0])), uintptr(len(j.log))}
	return j
}

// isBinaryImage reports whether image is an ELF cubin or a fatbin rather
// than PTX text.
func isBinaryImage(image []byte) bool {
	return bytes.HasPrefix(image, []byte("\x7fELF")) || bytes.HasPrefix(image, []byte{0x50, 0xed, 0x55, 0xba})
}

// LoadModule loads a module from an image: a cubin or fatbin, or PTX text
// (which the driver compiles for the device; a terminating NUL is added
// when missing). A load error carries the driver's JIT log in its Message.
func (d *Device) LoadModule(image []byte) (*Module, error) {
	if len(image) == 0 {
		return nil, argErrorf("empty module image")
	}
	start := time.Now()
	var h uintptr
	err := d.do(func() error {
		var err error
		h, err = d.loadModule(image)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &Module{dev: d, h: h, Stats: CompileStats{LoadTime: time.Since(start)}}, nil
}

// loadModule runs cuModuleLoadDataEx (executor thread).
func (d *Device) loadModule(image []byte) (uintptr, error) {
	data := image
	if !isBinaryImage(image) && image[len(image)-1] != 0 {
		data = heapBytes(len(image) + 1)
		copy(data, image)
	}
	j := newJITOptions()
	var h uintptr
	r := ccall(d.api.cuModuleLoadDataEx, uintptr(unsafe.Pointer(&h)), uintptr(unsafe.Pointer(&data[0])),
		uintptr(len(j.opts)), uintptr(unsafe.Pointer(&j.opts[0])), uintptr(unsafe.Pointer(&j.vals[0])))
	runtime.KeepAlive(data)
	runtime.KeepAlive(j)
	if res := Result(int32(r)); res != Success {
		e := d.api.err(fmt.Sprintf("cuModuleLoadDataEx(%d bytes)", len(image)), res)
		n := min(int(j.vals[1]), len(j.log))
		if log := strings.TrimSpace(string(bytes.TrimRight(j.log[:n], "\x00"))); log != "" {
			e.Message += "\n" + log
		}
		return 0, e
	}
	d.track(resModule, h, func() { ccall(d.api.cuModuleUnload, h) })
	return h, nil
}

// Close unloads the module (cuModuleUnload). Its functions must not be
// launched afterwards. Closing twice returns nil.
func (m *Module) Close() error {
	if m == nil || !m.closed.CompareAndSwap(false, true) {
		return nil
	}
	return m.dev.destroy(resModule, m.h, "cuModuleUnload", m.dev.api.cuModuleUnload)
}

// Function is a kernel of a loaded module.
type Function struct {
	mod  *Module
	h    uintptr // CUfunction
	name string
}

// Function looks up the kernel called name (its extern "C" name, or its
// mangled C++ name).
func (m *Module) Function(name string) (*Function, error) {
	if m.closed.Load() {
		return nil, closedErrorf("module closed")
	}
	d := m.dev
	f := &Function{mod: m, name: name}
	cname := cstring(name)
	err := d.do(func() error {
		err := d.api.check(fmt.Sprintf("cuModuleGetFunction(%q)", name), ccall(d.api.cuModuleGetFunction,
			uintptr(unsafe.Pointer(&f.h)), m.h, uintptr(unsafe.Pointer(&cname[0]))))
		runtime.KeepAlive(cname)
		return err
	})
	if err != nil {
		return nil, err
	}
	return f, nil
}

// Name returns the kernel's name as looked up.
func (f *Function) Name() string { return f.name }

// FuncAttribute is a CUfunction_attribute.
type FuncAttribute int32

// Function attributes (CUfunction_attribute).
const (
	FuncMaxThreadsPerBlock         FuncAttribute = 0
	FuncSharedSizeBytes            FuncAttribute = 1
	FuncConstSizeBytes             FuncAttribute = 2
	FuncLocalSizeBytes             FuncAttribute = 3
	FuncNumRegs                    FuncAttribute = 4
	FuncPTXVersion                 FuncAttribute = 5
	FuncBinaryVersion              FuncAttribute = 6
	FuncMaxDynamicSharedSizeBytes  FuncAttribute = 8
	FuncPreferredSharedMemCarveout FuncAttribute = 9
)

// handle checks that f is usable on d.
func (f *Function) handle(d *Device) (uintptr, error) {
	if f == nil {
		return 0, argErrorf("nil function")
	}
	if f.mod.dev != d {
		return 0, argErrorf("function of device %d used on device %d", f.mod.dev.ordinal, d.ordinal)
	}
	if f.mod.closed.Load() {
		return 0, closedErrorf("module of function %s closed", f.name)
	}
	return f.h, nil
}

// Attribute reads a function attribute (cuFuncGetAttribute).
func (f *Function) Attribute(attr FuncAttribute) (int, error) {
	d := f.mod.dev
	h, err := f.handle(d)
	if err != nil {
		return 0, err
	}
	var v int32
	err = d.do(func() error {
		return d.api.check(fmt.Sprintf("cuFuncGetAttribute(%s, %d)", f.name, attr),
			ccall(d.api.cuFuncGetAttribute, uintptr(unsafe.Pointer(&v)), uintptr(attr), h))
	})
	return int(v), err
}

// SetAttribute sets a function attribute (cuFuncSetAttribute).
func (f *Function) SetAttribute(attr FuncAttribute, value int) error {
	d := f.mod.dev
	h, err := f.handle(d)
	if err != nil {
		return err
	}
	return d.do(func() error {
		return d.api.check(fmt.Sprintf("cuFuncSetAttribute(%s, %d, %d)", f.name, attr, value),
			ccall(d.api.cuFuncSetAttribute, h, uintptr(attr), uintptr(int32(value))))
	})
}

// SetMaxDynamicSharedMemory allows launches of f with up to bytes of
// dynamic shared memory (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES).
// Launches asking for more than 48 KiB need it; the most a block can have
// is Device.SharedMemoryPerBlockOptin minus f's static shared memory.
func (f *Function) SetMaxDynamicSharedMemory(bytes int) error {
	return f.SetAttribute(FuncMaxDynamicSharedSizeBytes, bytes)
}

// FuncAttributes are the resource figures of a compiled kernel, for reports.
type FuncAttributes struct {
	NumRegs               int // registers per thread
	LocalBytes            int // local memory per thread (stack frame and spills)
	SharedBytes           int // static shared memory per block
	ConstBytes            int // user constant memory
	MaxThreadsPerBlock    int // the most threads a block of this kernel can have
	MaxDynamicSharedBytes int // the current dynamic shared memory limit
	PTXVersion            int // PTX virtual architecture, such as 90
	BinaryVersion         int // binary architecture, such as 90
}

// Attributes reads f's resource figures.
func (f *Function) Attributes() (FuncAttributes, error) {
	var a FuncAttributes
	for _, q := range []struct {
		attr FuncAttribute
		dst  *int
	}{
		{FuncNumRegs, &a.NumRegs},
		{FuncLocalSizeBytes, &a.LocalBytes},
		{FuncSharedSizeBytes, &a.SharedBytes},
		{FuncConstSizeBytes, &a.ConstBytes},
		{FuncMaxThreadsPerBlock, &a.MaxThreadsPerBlock},
		{FuncMaxDynamicSharedSizeBytes, &a.MaxDynamicSharedBytes},
		{FuncPTXVersion, &a.PTXVersion},
		{FuncBinaryVersion, &a.BinaryVersion},
	} {
		v, err := f.Attribute(q.attr)
		if err != nil {
			return FuncAttributes{}, err
		}
		*q.dst = v
	}
	return a, nil
}

// launchScratch holds the argument block of cuLaunchKernel's extra array
// and cuLaunchKernelEx's configuration. It lives on the heap (reached from
// the Device) and is used only on the executor thread, one launch at a
// time.
type launchScratch struct {
	args [1]uintptr // kernelParams: the address of the single parameter's bytes
	buf  []byte
	cfg  []byte // CUlaunchConfig, then one CUlaunchAttribute (launchConfigBytes + launchAttrBytes)
}

// The layout of cuLaunchKernelEx's CUlaunchConfig (grid and block dims,
// shared bytes, stream, attribute array, attribute count) and of one
// CUlaunchAttribute (id, padding, a 64-byte value union).
const (
	launchConfigBytes = 56
	launchAttrBytes   = 72
	// launchAttrProgrammaticSerialization is
	// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION.
	launchAttrProgrammaticSerialization = 6
)

// LaunchEarly is Launch with programmatic dependent launch (compute
// capability 9.0 and later): f may start before the kernel enqueued just
// before it on s has finished, once every block of that kernel has run
// griddepcontrol.launch_dependents or exited. Blocks of f that read what
// that kernel writes must first run griddepcontrol.wait, which returns once
// it has finished and its writes are visible; the work enqueued before it
// has finished when f starts. A driver without cuLaunchKernelEx (before
// CUDA 12) launches f as Launch does, after the kernel before it.
func (d *Device) LaunchEarly(f *Function, grid, block [3]uint32, sharedBytes uint32, s *Stream, params []byte) error {
	fn := d.api.lib.optionalSymbol("cuLaunchKernelEx")
	if fn == 0 {
		return d.Launch(f, grid, block, sharedBytes, s, params)
	}
	return d.launchVia(f, grid, block, sharedBytes, s, params, "cuLaunchKernelEx", func(ls *launchScratch, h, sh, args uintptr) uintptr {
		if ls.cfg == nil {
			ls.cfg = heapBytes(launchConfigBytes + launchAttrBytes)
		}
		cfg := ls.cfg
		putEarlyLaunchConfig(cfg, grid, block, sharedBytes, sh, uint64(uintptr(unsafe.Pointer(&cfg[launchConfigBytes]))))
		return ccall(fn, uintptr(unsafe.Pointer(&cfg[0])), h, args, 0)
	})
}

// putEarlyLaunchConfig writes into cfg (launchConfigBytes +
// launchAttrBytes) a CUlaunchConfig for grid, block, sharedBytes and
// stream sh whose one attribute, at device-visible address attrAddr (that
// of cfg[launchConfigBytes:]), allows programmatic stream serialization.
func putEarlyLaunchConfig(cfg []byte, grid, block [3]uint32, sharedBytes uint32, sh uintptr, attrAddr uint64) {
	clear(cfg[:launchConfigBytes+launchAttrBytes])
	le := binary.LittleEndian
	for i, v := range []uint32{grid[0], grid[1], grid[2], block[0], block[1], block[2], sharedBytes} {
		le.PutUint32(cfg[4*i:], v)
	}
	le.PutUint64(cfg[32:], uint64(sh)) // hStream, after 4 bytes of padding
	le.PutUint64(cfg[40:], attrAddr)   // attrs
	le.PutUint32(cfg[48:], 1)          // numAttrs
	attr := cfg[launchConfigBytes:]
	le.PutUint32(attr[0:], launchAttrProgrammaticSerialization) // id, then 4 bytes of padding
	le.PutUint32(attr[8:], 1)                                   // value.programmaticStreamSerializationAllowed
}

// launchVia checks a launch's dims, resolves the driver handles of f and s,
// copies params into the scratch, and runs call (the driver's launch entry,
// named op in errors) on the executor with them: the code Launch and
// LaunchEarly share. The error message is formatted only on failure.
func (d *Device) launchVia(f *Function, grid, block [3]uint32, sharedBytes uint32, s *Stream, params []byte, op string,
	call func(ls *launchScratch, h, sh, args uintptr) uintptr) error {
	h, err := f.handle(d)
	if err != nil {
		return err
	}
	for i := 0; i < 3; i++ {
		if grid[i] == 0 || block[i] == 0 {
			return argErrorf("launch of %s with grid %v, block %v", f.name, grid, block)
		}
	}
	sh, err := d.streamHandle(s)
	if err != nil {
		return err
	}
	return d.do(func() error {
		ls := d.launch
		r := call(ls, h, sh, ls.setParams(params))
		runtime.KeepAlive(ls)
		runtime.KeepAlive(params)
		if Result(int32(r)) == Success {
			return nil
		}
		return d.api.check(fmt.Sprintf("%s(%s, grid %v, block %v, smem %d)", op, f.name, grid, block, sharedBytes), r)
	})
}

// setParams copies a launch's parameter bytes into the scratch and returns
// the kernelParams array that points at them (0 for none).
//
// kernelParams (not the extra array's raw buffer): the driver copies the
// parameter to the offset the kernel declares, which for a parameter
// aligned past 16 bytes (a struct holding tensor maps, 64) need not be the
// start of the parameter space.
func (ls *launchScratch) setParams(params []byte) uintptr {
	if len(params) == 0 {
		return 0
	}
	if cap(ls.buf) < len(params) {
		ls.buf = heapBytes(max(len(params), 256))
	}
	copy(ls.buf[:cap(ls.buf)], params)
	ls.args[0] = uintptr(unsafe.Pointer(&ls.buf[0]))
	return uintptr(unsafe.Pointer(&ls.args[0]))
}

// Launch enqueues kernel f on stream s (nil: the legacy default stream)
// with grid blocks of block threads and sharedBytes of dynamic shared
// memory. params holds the bytes of the kernel's single parameter (a
// struct, laid out as the C++ compiler lays it out; see kernels.CStruct); it is
// copied during the call, so the caller may reuse it on return. A kernel
// without parameters takes nil. Errors from the kernel's execution show up
// at the next synchronizing call.
func (d *Device) Launch(f *Function, grid, block [3]uint32, sharedBytes uint32, s *Stream, params []byte) error {
	return d.launchVia(f, grid, block, sharedBytes, s, params, "cuLaunchKernel", func(_ *launchScratch, h, sh, args uintptr) uintptr {
		return ccall(d.api.cuLaunchKernel, h,
			uintptr(grid[0]), uintptr(grid[1]), uintptr(grid[2]),
			uintptr(block[0]), uintptr(block[1]), uintptr(block[2]),
			uintptr(sharedBytes), sh, args, 0)
	})
}
