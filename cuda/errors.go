package cuda

import (
	"errors"
	"fmt"
	"strings"
)

// Sentinel errors. Every error this package returns wraps at least one of
// them; test with errors.Is.
var (
	// ErrCUDA reports a failed CUDA driver call. The concrete error is an
	// *Error that carries the CUresult code, its name and its description.
	ErrCUDA = errors.New("cuda: driver call failed")
	// ErrNoDriver reports that no usable libcuda.so.1 could be loaded. The
	// error text lists every place that was tried.
	ErrNoDriver = errors.New("cuda: no CUDA driver found")
	// ErrNoDevice reports that the driver loaded but no usable GPU answered:
	// cuInit failed (no device, no kernel module, driver too old) or the
	// ordinal is out of range.
	ErrNoDevice = errors.New("cuda: no usable CUDA device")
	// ErrNoNVRTC reports that no NVRTC library could be loaded. The error
	// text lists every place that was tried.
	ErrNoNVRTC = errors.New("cuda: no NVRTC found")
	// ErrCompile reports a failed run-time compilation. The concrete error is
	// a *CompileError carrying NVRTC's log and the path of the source.
	ErrCompile = errors.New("cuda: kernel compilation failed")
	// ErrClosed reports use of a device, buffer, stream, event, module or
	// graph after it was closed or freed.
	ErrClosed = errors.New("cuda: use of closed object")
	// ErrArgument reports an invalid argument detected before any driver
	// call: a range outside a buffer, an object of another device, a nil
	// function, a zero grid.
	ErrArgument = errors.New("cuda: invalid argument")
)

// Unavailable reports whether err says that CUDA cannot be used on this
// machine at all (ErrNoDriver or ErrNoDevice), as opposed to a failure of
// an operation on a working device. Tests use it to decide whether to skip.
func Unavailable(err error) bool {
	return errors.Is(err, ErrNoDriver) || errors.Is(err, ErrNoDevice)
}

// Result is a CUresult code returned by a CUDA driver API call.
type Result int32

// Success is CUDA_SUCCESS.
const Success Result = 0

// Selected CUresult codes that callers may want to test for.
const (
	ErrorInvalidValue         Result = 1
	ErrorOutOfMemory          Result = 2
	ErrorNotInitialized       Result = 3
	ErrorStubLibrary          Result = 34
	ErrorNoDevice             Result = 100
	ErrorInvalidDevice        Result = 101
	ErrorInvalidImage         Result = 200
	ErrorInvalidContext       Result = 201
	ErrorNoBinaryForGPU       Result = 209
	ErrorInvalidPTX           Result = 218
	ErrorUnsupportedPTX       Result = 222
	ErrorNotFound             Result = 500
	ErrorNotReady             Result = 600
	ErrorIllegalAddress       Result = 700
	ErrorLaunchOutOfResources Result = 701
	ErrorHostMemoryRegistered Result = 712
	ErrorLaunchFailed         Result = 719
	ErrorNotPermitted         Result = 800
	ErrorNotSupported         Result = 801
	ErrorStreamCaptureInvalid Result = 901
	ErrorUnknown              Result = 999
)

// resultNames maps CUresult codes to their names as spelled in cuda.h. It
// is used when the driver's cuGetErrorName is not available.
var resultNames = map[Result]string{
	0:   "CUDA_SUCCESS",
	1:   "CUDA_ERROR_INVALID_VALUE",
	2:   "CUDA_ERROR_OUT_OF_MEMORY",
	3:   "CUDA_ERROR_NOT_INITIALIZED",
	4:   "CUDA_ERROR_DEINITIALIZED",
	5:   "CUDA_ERROR_PROFILER_DISABLED",
	6:   "CUDA_ERROR_PROFILER_NOT_INITIALIZED",
	7:   "CUDA_ERROR_PROFILER_ALREADY_STARTED",
	8:   "CUDA_ERROR_PROFILER_ALREADY_STOPPED",
	34:  "CUDA_ERROR_STUB_LIBRARY",
	46:  "CUDA_ERROR_DEVICE_UNAVAILABLE",
	100: "CUDA_ERROR_NO_DEVICE",
	101: "CUDA_ERROR_INVALID_DEVICE",
	102: "CUDA_ERROR_DEVICE_NOT_LICENSED",
	200: "CUDA_ERROR_INVALID_IMAGE",
	201: "CUDA_ERROR_INVALID_CONTEXT",
	202: "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
	205: "CUDA_ERROR_MAP_FAILED",
	206: "CUDA_ERROR_UNMAP_FAILED",
	207: "CUDA_ERROR_ARRAY_IS_MAPPED",
	208: "CUDA_ERROR_ALREADY_MAPPED",
	209: "CUDA_ERROR_NO_BINARY_FOR_GPU",
	210: "CUDA_ERROR_ALREADY_ACQUIRED",
	211: "CUDA_ERROR_NOT_MAPPED",
	212: "CUDA_ERROR_NOT_MAPPED_AS_ARRAY",
	213: "CUDA_ERROR_NOT_MAPPED_AS_POINTER",
	214: "CUDA_ERROR_ECC_UNCORRECTABLE",
	215: "CUDA_ERROR_UNSUPPORTED_LIMIT",
	216: "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
	217: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
	218: "CUDA_ERROR_INVALID_PTX",
	219: "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT",
	220: "CUDA_ERROR_NVLINK_UNCORRECTABLE",
	221: "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
	222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
	223: "CUDA_ERROR_JIT_COMPILATION_DISABLED",
	224: "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY",
	300: "CUDA_ERROR_INVALID_SOURCE",
	301: "CUDA_ERROR_FILE_NOT_FOUND",
	302: "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
	303: "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
	304: "CUDA_ERROR_OPERATING_SYSTEM",
	400: "CUDA_ERROR_INVALID_HANDLE",
	401: "CUDA_ERROR_ILLEGAL_STATE",
	500: "CUDA_ERROR_NOT_FOUND",
	600: "CUDA_ERROR_NOT_READY",
	700: "CUDA_ERROR_ILLEGAL_ADDRESS",
	701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
	702: "CUDA_ERROR_LAUNCH_TIMEOUT",
	703: "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING",
	704: "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
	705: "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
	708: "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
	709: "CUDA_ERROR_CONTEXT_IS_DESTROYED",
	710: "CUDA_ERROR_ASSERT",
	711: "CUDA_ERROR_TOO_MANY_PEERS",
	712: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
	713: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
	714: "CUDA_ERROR_HARDWARE_STACK_ERROR",
	715: "CUDA_ERROR_ILLEGAL_INSTRUCTION",
	716: "CUDA_ERROR_MISALIGNED_ADDRESS",
	717: "CUDA_ERROR_INVALID_ADDRESS_SPACE",
	718: "CUDA_ERROR_INVALID_PC",
	719: "CUDA_ERROR_LAUNCH_FAILED",
	720: "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
	800: "CUDA_ERROR_NOT_PERMITTED",
	801: "CUDA_ERROR_NOT_SUPPORTED",
	802: "CUDA_ERROR_SYSTEM_NOT_READY",
	803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
	804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
	805: "CUDA_ERROR_MPS_CONNECTION_FAILED",
	806: "CUDA_ERROR_MPS_RPC_FAILURE",
	807: "CUDA_ERROR_MPS_SERVER_NOT_READY",
	808: "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
	809: "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
	810: "CUDA_ERROR_MPS_CLIENT_TERMINATED",
	900: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
	901: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
	902: "CUDA_ERROR_STREAM_CAPTURE_MERGE",
	903: "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
	904: "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
	905: "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
	906: "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
	907: "CUDA_ERROR_CAPTURED_EVENT",
	908: "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
	909: "CUDA_ERROR_TIMEOUT",
	910: "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
	911: "CUDA_ERROR_EXTERNAL_DEVICE",
	912: "CUDA_ERROR_INVALID_CLUSTER_SIZE",
	999: "CUDA_ERROR_UNKNOWN",
}

// Name returns the CUresult name of r as spelled in cuda.h, such as
// "CUDA_ERROR_OUT_OF_MEMORY", or "CUresult(N)" for a code this package does
// not know.
func (r Result) Name() string {
	if s, ok := resultNames[r]; ok {
		return s
	}
	return fmt.Sprintf("CUresult(%d)", int32(r))
}

// String returns r's name and numeric code, such as "CUDA_ERROR_OUT_OF_MEMORY (2)".
func (r Result) String() string {
	return fmt.Sprintf("%s (%d)", r.Name(), int32(r))
}

// Error is a failed CUDA driver call. It wraps ErrCUDA; errors from cuInit
// and from cuDeviceGet with a bad ordinal also wrap ErrNoDevice.
type Error struct {
	// Op is the driver function that failed, with a short description of
	// its arguments, such as "cuMemAlloc_v2(1024 bytes)".
	Op string
	// Code is the CUresult the driver returned.
	Code Result
	// Name is the CUresult's name, from cuGetErrorName when the driver
	// provides it.
	Name string
	// Message is the driver's description of the code (cuGetErrorString),
	// followed by any log the driver produced (for example a JIT error log).
	Message string

	also error // an extra sentinel wrapped besides ErrCUDA, or nil
}

// Error formats the failure as "cuda: OP: NAME (CODE): MESSAGE".
func (e *Error) Error() string {
	name := e.Name
	if name == "" {
		name = e.Code.Name()
	}
	var b strings.Builder
	b.WriteString("cuda: ")
	if e.Op != "" {
		b.WriteString(e.Op)
		b.WriteString(": ")
	}
	fmt.Fprintf(&b, "%s (%d)", name, int32(e.Code))
	if e.Message != "" {
		b.WriteString(": ")
		b.WriteString(e.Message)
	}
	return b.String()
}

// Unwrap returns ErrCUDA and, where it applies, ErrNoDevice or ErrNoDriver.
func (e *Error) Unwrap() []error {
	if e.also != nil {
		return []error{ErrCUDA, e.also}
	}
	return []error{ErrCUDA}
}

// CompileError is a failed NVRTC compilation. It wraps ErrCompile.
type CompileError struct {
	// Name is the program's file name as given in the request.
	Name string
	// Arch is the target, such as "sm_90a" or "compute_80".
	Arch string
	// Result is the NVRTC result name, such as "NVRTC_ERROR_COMPILATION".
	Result string
	// Options are the NVRTC options the compilation ran with.
	Options []string
	// Log is NVRTC's complete program log.
	Log string
	// SourcePath is where the source was written for inspection, or "" if it
	// could not be written.
	SourcePath string
}

// Error formats the failure with the full NVRTC log.
func (e *CompileError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "cuda: compile %s for %s: %s", e.Name, e.Arch, e.Result)
	if e.SourcePath != "" {
		fmt.Fprintf(&b, " (source: %s)", e.SourcePath)
	}
	if log := strings.TrimSpace(e.Log); log != "" {
		b.WriteString("\n")
		b.WriteString(log)
	}
	return b.String()
}

// Unwrap returns ErrCompile.
func (e *CompileError) Unwrap() error { return ErrCompile }

// argErrorf returns an error wrapping ErrArgument.
func argErrorf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrArgument, fmt.Sprintf(format, args...))
}

// usableOn checks that an object (what: "buffer", "stream", …) of device
// owner may be used on d: an error wrapping ErrArgument when it belongs to
// another device, one wrapping ErrClosed with the text gone when closed is
// set.
func usableOn(d, owner *Device, what string, closed bool, gone string) error {
	if owner != d {
		return argErrorf("%s of device %d used on device %d", what, owner.ordinal, d.ordinal)
	}
	if closed {
		return closedErrorf("%s", gone)
	}
	return nil
}

// closedErrorf returns an error wrapping ErrClosed.
func closedErrorf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrClosed, fmt.Sprintf(format, args...))
}
