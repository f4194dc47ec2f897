package cuda

import (
	"fmt"
	"path/filepath"
	"sync"
	"unsafe"
)

// driverAPI holds the entry points of libcuda.so.1.
type driverAPI struct {
	lib  *library
	path string // the file that was loaded, resolved when possible

	cuInit, cuDriverGetVersion, cuGetErrorName, cuGetErrorString                           uintptr
	cuDeviceGetCount, cuDeviceGet, cuDeviceGetName, cuDeviceGetAttribute, cuDeviceTotalMem uintptr
	cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRelease, cuCtxSetCurrent, cuCtxSynchronize uintptr
	cuCtxGetDevice                                                                         uintptr
	cuMemAlloc, cuMemFree, cuMemGetInfo, cuMemAllocHost, cuMemFreeHost                     uintptr
	cuMemHostRegister, cuMemHostUnregister                                                 uintptr
	cuMemcpyHtoD, cuMemcpyDtoH, cuMemcpyDtoD                                               uintptr
	cuMemcpyHtoDAsync, cuMemcpyDtoHAsync, cuMemcpyDtoDAsync                                uintptr
	cuMemsetD8, cuMemsetD32, cuMemsetD8Async, cuMemsetD32Async                             uintptr
	cuStreamCreate, cuStreamDestroy, cuStreamSynchronize, cuStreamWaitEvent, cuStreamQuery uintptr
	cuEventCreate, cuEventDestroy, cuEventRecord, cuEventSynchronize, cuEventQuery         uintptr
	cuEventElapsedTime                                                                     uintptr
	cuModuleLoadDataEx, cuModuleUnload, cuModuleGetFunction                                uintptr
	cuFuncGetAttribute, cuFuncSetAttribute, cuLaunchKernel                                 uintptr
	cuStreamBeginCapture, cuStreamEndCapture, cuGraphInstantiateWithFlags                  uintptr
	cuGraphLaunch, cuGraphExecDestroy, cuGraphDestroy                                      uintptr
}

// symbolTable maps each driver symbol to its field in a.
func (a *driverAPI) symbolTable() map[string]*uintptr {
	return map[string]*uintptr{
		"cuInit":                       &a.cuInit,
		"cuDriverGetVersion":           &a.cuDriverGetVersion,
		"cuGetErrorName":               &a.cuGetErrorName,
		"cuGetErrorString":             &a.cuGetErrorString,
		"cuDeviceGetCount":             &a.cuDeviceGetCount,
		"cuDeviceGet":                  &a.cuDeviceGet,
		"cuDeviceGetName":              &a.cuDeviceGetName,
		"cuDeviceGetAttribute":         &a.cuDeviceGetAttribute,
		"cuDeviceTotalMem_v2":          &a.cuDeviceTotalMem,
		"cuDevicePrimaryCtxRetain":     &a.cuDevicePrimaryCtxRetain,
		"cuDevicePrimaryCtxRelease_v2": &a.cuDevicePrimaryCtxRelease,
		"cuCtxSetCurrent":              &a.cuCtxSetCurrent,
		"cuCtxSynchronize":             &a.cuCtxSynchronize,
		"cuCtxGetDevice":               &a.cuCtxGetDevice,
		"cuMemAlloc_v2":                &a.cuMemAlloc,
		"cuMemFree_v2":                 &a.cuMemFree,
		"cuMemGetInfo_v2":              &a.cuMemGetInfo,
		"cuMemAllocHost_v2":            &a.cuMemAllocHost,
		"cuMemFreeHost":                &a.cuMemFreeHost,
		"cuMemHostRegister_v2":         &a.cuMemHostRegister,
		"cuMemHostUnregister":          &a.cuMemHostUnregister,
		"cuMemcpyHtoD_v2":              &a.cuMemcpyHtoD,
		"cuMemcpyDtoH_v2":              &a.cuMemcpyDtoH,
		"cuMemcpyDtoD_v2":              &a.cuMemcpyDtoD,
		"cuMemcpyHtoDAsync_v2":         &a.cuMemcpyHtoDAsync,
		"cuMemcpyDtoHAsync_v2":         &a.cuMemcpyDtoHAsync,
		"cuMemcpyDtoDAsync_v2":         &a.cuMemcpyDtoDAsync,
		"cuMemsetD8_v2":                &a.cuMemsetD8,
		"cuMemsetD32_v2":               &a.cuMemsetD32,
		"cuMemsetD8Async":              &a.cuMemsetD8Async,
		"cuMemsetD32Async":             &a.cuMemsetD32Async,
		"cuStreamCreate":               &a.cuStreamCreate,
		"cuStreamDestroy_v2":           &a.cuStreamDestroy,
		"cuStreamSynchronize":          &a.cuStreamSynchronize,
		"cuStreamWaitEvent":            &a.cuStreamWaitEvent,
		"cuStreamQuery":                &a.cuStreamQuery,
		"cuEventCreate":                &a.cuEventCreate,
		"cuEventDestroy_v2":            &a.cuEventDestroy,
		"cuEventRecord":                &a.cuEventRecord,
		"cuEventSynchronize":           &a.cuEventSynchronize,
		"cuEventQuery":                 &a.cuEventQuery,
		"cuEventElapsedTime":           &a.cuEventElapsedTime,
		"cuModuleLoadDataEx":           &a.cuModuleLoadDataEx,
		"cuModuleUnload":               &a.cuModuleUnload,
		"cuModuleGetFunction":          &a.cuModuleGetFunction,
		"cuFuncGetAttribute":           &a.cuFuncGetAttribute,
		"cuFuncSetAttribute":           &a.cuFuncSetAttribute,
		"cuLaunchKernel":               &a.cuLaunchKernel,
		"cuStreamBeginCapture_v2":      &a.cuStreamBeginCapture,
		"cuStreamEndCapture":           &a.cuStreamEndCapture,
		"cuGraphInstantiateWithFlags":  &a.cuGraphInstantiateWithFlags,
		"cuGraphLaunch":                &a.cuGraphLaunch,
		"cuGraphExecDestroy":           &a.cuGraphExecDestroy,
		"cuGraphDestroy":               &a.cuGraphDestroy,
	}
}

var (
	driverMu     sync.Mutex
	driverLoaded *driverAPI // set once the driver loaded and cuInit succeeded
)

// loadDriverFrom opens the first loadable candidate and resolves the
// driver's symbols. It does not call cuInit.
func loadDriverFrom(cands []string) (*driverAPI, error) {
	lib, tried := openFirst(cands)
	if lib == nil {
		return nil, notFoundError(ErrNoDriver, tried)
	}
	a := &driverAPI{lib: lib, path: lib.path}
	if !filepath.IsAbs(lib.path) {
		if p := loadedPath("libcuda.so"); p != "" {
			a.path = p
		}
	}
	if err := lib.symbols(a.symbolTable()); err != nil {
		return nil, fmt.Errorf("%w: %v (driver too old?)", ErrNoDriver, err)
	}
	return a, nil
}

// driver returns the process's driver, loading it and calling cuInit on
// first use. Failures are not remembered: a later call searches again.
func driver() (*driverAPI, error) {
	driverMu.Lock()
	defer driverMu.Unlock()
	if driverLoaded != nil {
		return driverLoaded, nil
	}
	a, err := loadDriverFrom(driverCandidates(osEnv()))
	if err != nil {
		return nil, err
	}
	if err := a.init(); err != nil {
		return nil, err
	}
	driverLoaded = a
	return a, nil
}

// init calls cuInit(0) and classifies its failure.
func (a *driverAPI) init() error {
	r := Result(int32(ccall(a.cuInit, 0)))
	switch r {
	case Success:
		return nil
	case ErrorStubLibrary:
		e := a.err("cuInit in "+a.path, r)
		e.also = ErrNoDriver
		return e
	default:
		e := a.err("cuInit in "+a.path, r)
		e.also = ErrNoDevice
		return e
	}
}

// err returns the *Error for a failed call, with the driver's name and
// description of r.
func (a *driverAPI) err(op string, r Result) *Error {
	e := &Error{Op: op, Code: r}
	var p *byte
	if ccall(a.cuGetErrorName, uintptr(r), uintptr(unsafe.Pointer(&p))) == 0 && p != nil {
		e.Name = goString(p)
	}
	p = nil
	if ccall(a.cuGetErrorString, uintptr(r), uintptr(unsafe.Pointer(&p))) == 0 && p != nil {
		e.Message = goString(p)
	}
	return e
}

// check returns nil for CUDA_SUCCESS and an *Error otherwise. r is the raw
// return register of a driver call; only its low 32 bits are the CUresult.
func (a *driverAPI) check(op string, r uintptr) error {
	if res := Result(int32(r)); res != Success {
		return a.err(op, res)
	}
	return nil
}

// DriverInfo describes the loaded CUDA driver.
type DriverInfo struct {
	// Path is the driver library that was loaded.
	Path string
	// Version is the CUDA version the driver supports, encoded as
	// 1000*major + 10*minor (for example 13000 for CUDA 13.0).
	Version int
	// Devices is the number of CUDA devices visible to the process.
	Devices int
}

// Driver loads the CUDA driver (if not yet loaded), initializes it and
// describes it. It fails with an error wrapping ErrNoDriver when no driver
// library loads and ErrNoDevice when cuInit fails.
func Driver() (DriverInfo, error) {
	a, err := driver()
	if err != nil {
		return DriverInfo{}, err
	}
	var v, n int32
	if err := a.check("cuDriverGetVersion", ccall(a.cuDriverGetVersion, uintptr(unsafe.Pointer(&v)))); err != nil {
		return DriverInfo{}, err
	}
	if err := a.check("cuDeviceGetCount", ccall(a.cuDeviceGetCount, uintptr(unsafe.Pointer(&n)))); err != nil {
		return DriverInfo{}, err
	}
	return DriverInfo{Path: a.path, Version: int(v), Devices: int(n)}, nil
}
