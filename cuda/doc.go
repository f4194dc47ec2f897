// Package cuda drives NVIDIA GPUs from Go without cgo: it loads the CUDA
// driver (libcuda.so.1) and NVRTC at run time with purego, so programs build
// with CGO_ENABLED=0 and need no CUDA installation to build or to run on
// machines without a GPU (where Open fails with an error wrapping
// ErrNoDriver or ErrNoDevice).
//
// # Devices and threads
//
// A CUDA context is current per OS thread, and goroutines move between
// threads. Open therefore starts, for each Device, one goroutine locked to
// its OS thread (runtime.LockOSThread) on which the device's primary context
// is made current; every driver call of the device runs there, handed over
// as a closure on a channel. All methods are safe for concurrent use; calls
// from many goroutines are serialized on the executor. Close destroys what
// is still open on the device (graphs, modules, events, streams, memory),
// releases the context and stops the executor.
//
// # Memory, streams, events, graphs
//
// Device.Alloc returns a Buffer of device memory; free it with Buffer.Free
// (a cleanup frees unreachable buffers as a backstop only). Synchronous
// copies and memsets run on the legacy default stream and return when done;
// the Async variants take a *Stream (nil means the legacy default stream).
// AllocHost gives pinned host memory for truly asynchronous copies;
// RegisterHost page-locks memory the caller already has (Go memory
// included) for the same, until HostRegistration.Unregister. Events
// mark points in a stream and time them (ElapsedMs); NewEventNoTiming makes
// one for ordering only. Stream.WaitEvent makes a stream wait for an event
// another recorded; during a capture such a record and wait fork the
// capture onto the waiting stream, and a second pair joins it back.
// Stream.BeginCapture
// and EndCapture record a stream's work into a Graph that Launch replays
// with one call.
//
// Capture on a stream from NewStreamNonBlocking: a capturing stream that
// synchronizes with the legacy default stream makes every synchronous copy
// fail the capture. As all of a device's calls run on one thread, use
// CaptureRelaxed when other goroutines may use the device during a capture.
//
// # Kernels
//
// Device.Compile compiles CUDA C++ with NVRTC to a cubin for the device's
// architecture (sm_XY, or sm_XYa with CompileRequest.ArchSpecific) and loads
// it; Module.Function finds a kernel, and Device.Launch runs it. A kernel
// takes one struct parameter whose bytes Launch passes with
// CU_LAUNCH_PARAM_BUFFER_POINTER; kernels.CStruct builds those bytes with
// the C++ layout. Every compile gets --std=c++17, -default-device and -I for the
// directory that holds cuda_fp16.h. A failed compile returns a *CompileError
// with NVRTC's full log and the path of the saved source.
//
// Compiled images are cached on disk under os.UserCacheDir()/flashattn/
// kernels (FLASHATTN_CACHE_DIR overrides it), keyed by the SHA-256 of the
// source, the options, the target and the NVRTC version. Entries are written
// to a temporary file and renamed, so concurrent processes can share the
// cache. Module.Stats reports whether a compile hit the cache and how long
// compiling and loading took; with CompileRequest.Verbose it also holds
// ptxas's resource report (registers, shared memory, spills).
//
// # Finding the libraries
//
// The driver, libcuda.so.1, is searched in: FLASHATTN_LIBCUDA (an exact
// path; nothing else is tried when it is set); the lib64, lib and
// targets/x86_64-linux/lib directories of FLASHATTN_CUDA_HOME, CUDA_HOME,
// CUDA_PATH and /usr/local/cuda; the dynamic loader's own search
// (LD_LIBRARY_PATH, the ld.so cache); /usr/local/nvidia/lib64; and
// /usr/lib/x86_64-linux-gnu, /usr/lib64, /usr/lib, /usr/lib/wsl/lib. The
// toolkit's link-time stub (stubs/libcuda.so) is never loaded.
//
// NVRTC is searched under the names libnvrtc.so, libnvrtc.so.13,
// libnvrtc.so.12 and libnvrtc.so.11.2 in: FLASHATTN_NVRTC (an exact path);
// the same toolkit directories; the loader's search; the system library
// directories; and the nvidia/cuda_nvrtc/lib, nvidia/cu13/lib and
// nvidia/cu12/lib directories of Python's site-packages (virtualenv, conda,
// user, /usr/local and /usr installations). The libnvrtc-builtins library
// beside the NVRTC that loaded is opened first, so NVRTC finds it even when
// its directory is not on the loader's path. Headers (cuda_fp16.h) are
// looked for beside that NVRTC's toolkit, then in the toolkit directories,
// /usr/include and the wheels' include directories.
//
// # Errors
//
// A failed driver call returns an *Error with the CUresult code, its name
// and the driver's description; it wraps ErrCUDA. Other errors wrap
// ErrNoDriver, ErrNoDevice, ErrNoNVRTC, ErrCompile, ErrClosed or
// ErrArgument; test with errors.Is. Unavailable tells "no CUDA here" from a
// failure on a working GPU.
//
// # Example
//
//	dev, err := cuda.Open(0)
//	if cuda.Unavailable(err) {
//		return // no GPU on this machine
//	} else if err != nil {
//		return err
//	}
//	defer dev.Close()
//
//	mod, err := dev.Compile(cuda.CompileRequest{Name: "scale.cu", Source: `
//	struct Params { float* x; int n; float s; };
//	extern "C" __global__ void scale(Params p) {
//		int i = blockIdx.x * blockDim.x + threadIdx.x;
//		if (i < p.n) p.x[i] *= p.s;
//	}`})
//	if err != nil {
//		return err // a *cuda.CompileError carries NVRTC's log
//	}
//	f, err := mod.Function("scale")
//	...
//	x := []float32{1, 2, 3}
//	buf, err := dev.Alloc(int64(4 * len(x)))
//	defer buf.Free()
//	err = dev.CopyToDevice(buf, 0, cuda.AsBytes(x))
//
//	type params struct {
//		x uint64
//		n int32
//		s float32
//	}
//	args := kernels.NewCStruct("Params", 0,
//		kernels.CPtr("float*", "x", "", func(p *params) uint64 { return p.x }),
//		kernels.CI32("int", "n", "", func(p *params) int32 { return p.n }),
//		kernels.CF32("s", "", func(p *params) float32 { return p.s }),
//	).Pack(&params{x: buf.Ptr(), n: int32(len(x)), s: 2})
//	err = dev.Launch(f, [3]uint32{1, 1, 1}, [3]uint32{256, 1, 1}, 0, nil, args)
//	err = dev.CopyFromDevice(cuda.AsBytes(x), buf, 0) // x is now 2, 4, 6
package cuda
