package cp

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/flashattn/flashattn/cuda"
)

// Environment variables read by the NCCL layer.
const (
	// EnvNCCL, when set, is the exact path of the NCCL library to load;
	// nothing else is tried.
	EnvNCCL = "FLASHATTN_NCCL"
	// EnvNCCLLibrary is read like EnvNCCL when EnvNCCL is not set.
	EnvNCCLLibrary = "NCCL_LIBRARY"
)

var (
	// ErrNoNCCL reports that no NCCL library (libnccl.so.2) could be
	// loaded, or that the one found lacks a function this package needs.
	ErrNoNCCL = errors.New("NCCL library not available")
	// ErrNCCL is wrapped by every *NCCLError: an NCCL call failed.
	ErrNCCL = errors.New("NCCL call failed")
)

// NCCLResult is an ncclResult_t.
type NCCLResult int32

// The results NCCL returns.
const (
	NCCLSuccess            NCCLResult = 0
	NCCLUnhandledCudaError NCCLResult = 1
	NCCLSystemError        NCCLResult = 2
	NCCLInternalError      NCCLResult = 3
	NCCLInvalidArgument    NCCLResult = 4
	NCCLInvalidUsage       NCCLResult = 5
	NCCLRemoteError        NCCLResult = 6
	NCCLInProgress         NCCLResult = 7
)

// ncclResultNames are the C names of the results.
var ncclResultNames = map[NCCLResult]string{
	NCCLSuccess:            "ncclSuccess",
	NCCLUnhandledCudaError: "ncclUnhandledCudaError",
	NCCLSystemError:        "ncclSystemError",
	NCCLInternalError:      "ncclInternalError",
	NCCLInvalidArgument:    "ncclInvalidArgument",
	NCCLInvalidUsage:       "ncclInvalidUsage",
	NCCLRemoteError:        "ncclRemoteError",
	NCCLInProgress:         "ncclInProgress",
}

// String returns the C name of r, or "ncclResult(N)" for a code this
// package does not know.
func (r NCCLResult) String() string {
	if s, ok := ncclResultNames[r]; ok {
		return s
	}
	return fmt.Sprintf("ncclResult(%d)", int32(r))
}

// NCCLError is a failed NCCL call. It wraps ErrNCCL.
type NCCLError struct {
	// Op names the call and what it was doing.
	Op string
	// Code is what NCCL returned (or what ncclCommGetAsyncError reported).
	Code NCCLResult
	// Message is ncclGetErrorString(Code); Detail is ncclGetLastError,
	// NCCL's description of the last failure, when the library has it.
	Message, Detail string
}

// Error renders the call, the code and NCCL's descriptions.
func (e *NCCLError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "cp: %s: %v", e.Op, e.Code)
	if e.Message != "" {
		fmt.Fprintf(&b, " (%s)", e.Message)
	}
	if e.Detail != "" {
		fmt.Fprintf(&b, ": %s", strings.TrimSpace(e.Detail))
	}
	return b.String()
}

// Unwrap returns ErrNCCL.
func (e *NCCLError) Unwrap() error { return ErrNCCL }

// ncclSoname is the name the NCCL library is installed under.
const ncclSoname = "libnccl.so.2"

// ncclLibDirs are the directories, outside Python, where NCCL is installed:
// CUDA toolkits, the distribution, the NVIDIA container runtime.
var ncclLibDirs = []string{
	"/usr/local/cuda/lib64", "/usr/local/cuda/lib", "/usr/local/cuda/targets/x86_64-linux/lib",
	"/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
	"/usr/local/nvidia/lib64", "/usr/local/nvidia/lib",
}

// ncclWheelPatterns are glob patterns, below a prefix that holds Python
// installations, of where the nvidia-nccl wheel (which PyTorch depends on)
// and older PyTorch wheels put the library.
var ncclWheelPatterns = []string{
	"lib/python3*/site-packages/nvidia/nccl/lib",
	"lib/python3*/dist-packages/nvidia/nccl/lib",
	"lib/python3*/site-packages/torch/lib",
	"lib/python3*/dist-packages/torch/lib",
}

// ncclCandidates returns, in search order, what is tried to load NCCL:
// absolute paths, or the bare soname for the dynamic loader's own search.
// getenv and glob are the outside world (os.Getenv and filepath.Glob).
func ncclCandidates(getenv func(string) string, glob func(string) ([]string, error)) []string {
	for _, v := range []string{EnvNCCL, EnvNCCLLibrary} {
		if p := getenv(v); p != "" {
			return []string{p}
		}
	}
	var out []string
	seen := map[string]bool{}
	add := func(p string) {
		if strings.ContainsRune(p, '/') {
			p = filepath.Clean(p)
		}
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	// Toolkits named by the environment come first, then the loader.
	for _, v := range []string{"NCCL_HOME", "NCCL_ROOT", "FLASHATTN_CUDA_HOME", "CUDA_HOME", "CUDA_PATH"} {
		if d := getenv(v); d != "" {
			add(filepath.Join(d, "lib64", ncclSoname))
			add(filepath.Join(d, "lib", ncclSoname))
		}
	}
	add(ncclSoname)
	for _, d := range ncclLibDirs {
		add(filepath.Join(d, ncclSoname))
	}
	// Python installations: the active environments, the user's, the
	// system's and conda's, newest Python first within each.
	var prefixes []string
	for _, v := range []string{"VIRTUAL_ENV", "CONDA_PREFIX"} {
		if p := getenv(v); p != "" {
			prefixes = append(prefixes, p)
		}
	}
	if h := getenv("HOME"); h != "" {
		prefixes = append(prefixes, filepath.Join(h, ".local"))
	}
	prefixes = append(prefixes, "/usr/local", "/usr", "/opt/conda")
	for _, pre := range prefixes {
		for _, pat := range ncclWheelPatterns {
			dirs, err := glob(filepath.Join(pre, pat))
			if err != nil {
				continue
			}
			sort.Sort(sort.Reverse(sort.StringSlice(dirs)))
			for _, d := range dirs {
				add(filepath.Join(d, ncclSoname))
			}
		}
	}
	return out
}

// ncclAPI holds the entry points of the loaded NCCL library.
type ncclAPI struct {
	path    string
	version int

	getVersion, getUniqueID, commDestroy, commAbort            uintptr
	getErrorString, commGetAsyncError, commCount, commCuDevice uintptr
	groupStart, groupEnd, send, recv, allGather                uintptr
	commInitRankSym                                            uintptr
	// Optional: 0 when the library lacks them (ncclCommSplit came with
	// NCCL 2.18).
	commFinalize, getLastError, commInitRankConfigSym, commSplit uintptr

	// The communicator constructors take the 128-byte unique id by value,
	// which purego's RegisterFunc passes as the C ABI wants.
	commInitRank    func(comm *uintptr, nranks int32, id ncclUniqueIDArg, rank int32) int32
	commInitRankCfg func(comm *uintptr, nranks int32, id ncclUniqueIDArg, rank int32, cfg *ncclConfig) int32
}

// ncclUniqueIDArg is ncclUniqueId as a C struct argument.
type ncclUniqueIDArg struct{ internal [NCCLUniqueIDBytes]byte }

// ncclConfig is the prefix of ncclConfig_t that NCCL 2.14 defined. Its size
// field tells NCCL how much of it the caller filled; NCCL gives the rest
// of a newer ncclConfig_t its defaults.
type ncclConfig struct {
	size     uint64
	magic    uint32
	version  uint32
	blocking int32
	_        int32
}

// ncclConfigFilled is the number of bytes of ncclConfig that are set:
// size, magic, version and blocking.
const ncclConfigFilled = 20

// newNCCLConfig returns the configuration of a non-blocking communicator,
// on the heap so that NCCL may keep reading it during an asynchronous init.
//
//go:noinline
func newNCCLConfig() *ncclConfig {
	return &ncclConfig{size: ncclConfigFilled, magic: 0xcafebeef, version: 21400, blocking: 0}
}

// symbols maps each NCCL symbol to its field; the optional ones are
// marked.
func (a *ncclAPI) symbols() (required, optional map[string]*uintptr) {
	required = map[string]*uintptr{
		"ncclGetVersion":        &a.getVersion,
		"ncclGetUniqueId":       &a.getUniqueID,
		"ncclCommInitRank":      &a.commInitRankSym,
		"ncclCommDestroy":       &a.commDestroy,
		"ncclCommAbort":         &a.commAbort,
		"ncclGetErrorString":    &a.getErrorString,
		"ncclCommGetAsyncError": &a.commGetAsyncError,
		"ncclCommCount":         &a.commCount,
		"ncclCommCuDevice":      &a.commCuDevice,
		"ncclGroupStart":        &a.groupStart,
		"ncclGroupEnd":          &a.groupEnd,
		"ncclSend":              &a.send,
		"ncclRecv":              &a.recv,
		"ncclAllGather":         &a.allGather,
	}
	optional = map[string]*uintptr{
		"ncclCommFinalize":       &a.commFinalize,
		"ncclGetLastError":       &a.getLastError,
		"ncclCommInitRankConfig": &a.commInitRankConfigSym,
		"ncclCommSplit":          &a.commSplit,
	}
	return required, optional
}

var (
	ncclMu     sync.Mutex
	ncclLoaded *ncclAPI
)

// loadNCCL returns the process's NCCL library, loading it on first use. It
// sets NCCL_NVLS_ENABLE=0 in the process environment first, always: NVLink
// multicast (NVLS) stays off. Failures are not remembered.
func loadNCCL() (*ncclAPI, error) {
	ncclMu.Lock()
	defer ncclMu.Unlock()
	if ncclLoaded != nil {
		return ncclLoaded, nil
	}
	if err := os.Setenv("NCCL_NVLS_ENABLE", "0"); err != nil {
		return nil, fmt.Errorf("cp: setting NCCL_NVLS_ENABLE=0: %w", err)
	}
	a, err := openNCCL(ncclCandidates(os.Getenv, filepath.Glob))
	if err != nil {
		return nil, err
	}
	ncclLoaded = a
	return a, nil
}

// openNCCL loads the first candidate that opens and resolves its symbols.
func openNCCL(cands []string) (*ncclAPI, error) {
	lib, err := cuda.OpenLibrary(cands, ErrNoNCCL)
	if err != nil {
		if len(cands) == 0 {
			return nil, fmt.Errorf("cp: %w", err)
		}
		return nil, fmt.Errorf("cp: %w (set %s to its path)", err, EnvNCCL)
	}
	a := &ncclAPI{path: lib.Path()}
	required, optional := a.symbols()
	if err := lib.Symbols(required); err != nil {
		return nil, fmt.Errorf("cp: %w: %v (NCCL older than 2.7?)", ErrNoNCCL, err)
	}
	for name, p := range optional {
		*p = lib.OptionalSymbol(name)
	}
	purego.RegisterFunc(&a.commInitRank, a.commInitRankSym)
	if a.commInitRankConfigSym != 0 {
		purego.RegisterFunc(&a.commInitRankCfg, a.commInitRankConfigSym)
	}
	var v int32
	if r := NCCLResult(int32(ncall(a.getVersion, uintptr(unsafe.Pointer(&v))))); r != NCCLSuccess {
		return nil, a.err("ncclGetVersion", r, 0)
	}
	a.version = int(v)
	return a, nil
}

// ncall calls the C function fn with integer and pointer arguments and
// returns the integer result register. Pointers converted to uintptr in
// the call expression stay alive and in place for the call's duration.
//
//go:uintptrescapes
func ncall(fn uintptr, args ...uintptr) uintptr {
	r, _, _ := purego.SyscallN(fn, args...)
	return r
}

// result converts a raw return register into an NCCLResult (its low 32
// bits).
func result(r uintptr) NCCLResult { return NCCLResult(int32(r)) }

// err returns the *NCCLError of a failed call on comm (0: none), with
// NCCL's descriptions.
func (a *ncclAPI) err(op string, r NCCLResult, comm uintptr) *NCCLError {
	e := &NCCLError{Op: op, Code: r}
	if p := ncall(a.getErrorString, uintptr(r)); p != 0 {
		e.Message = cString(p)
	}
	if a.getLastError != 0 {
		if p := ncall(a.getLastError, comm); p != 0 {
			e.Detail = cString(p)
		}
	}
	return e
}

// check returns nil for ncclSuccess and an *NCCLError otherwise.
func (a *ncclAPI) check(op string, r uintptr, comm uintptr) error {
	if res := result(r); res != NCCLSuccess {
		return a.err(op, res, comm)
	}
	return nil
}

// cString copies the NUL-terminated C string at p (NCCL's own, static
// memory).
func cString(p uintptr) string {
	base := *(*unsafe.Pointer)(unsafe.Pointer(&p)) // C memory, outside the Go heap
	n := 0
	for n < 4096 && *(*byte)(unsafe.Add(base, n)) != 0 {
		n++
	}
	return string(unsafe.Slice((*byte)(base), n))
}

// NCCLUniqueIDBytes is the size of an NCCL unique id.
const NCCLUniqueIDBytes = 128

// NCCLUniqueID identifies a communicator being created: rank 0 makes one
// with NewNCCLUniqueID and hands it to the other ranks (see
// Env.Share) before they all call NewNCCL.
type NCCLUniqueID [NCCLUniqueIDBytes]byte

// NewNCCLUniqueID returns a new unique id (ncclGetUniqueId). It fails with
// an error wrapping ErrNoNCCL when NCCL does not load.
func NewNCCLUniqueID() (NCCLUniqueID, error) {
	a, err := loadNCCL()
	if err != nil {
		return NCCLUniqueID{}, err
	}
	return a.uniqueID()
}

// uniqueID returns a new unique id (ncclGetUniqueId).
func (a *ncclAPI) uniqueID() (NCCLUniqueID, error) {
	buf := new(NCCLUniqueID)
	if err := a.check("ncclGetUniqueId", ncall(a.getUniqueID, uintptr(unsafe.Pointer(buf))), 0); err != nil {
		return NCCLUniqueID{}, err
	}
	return *buf, nil
}

// NCCLVersion loads NCCL and returns its version code (for example 22703
// for 2.27.3) and the library's path. It fails with an error wrapping
// ErrNoNCCL when NCCL does not load.
func NCCLVersion() (version int, path string, err error) {
	a, err := loadNCCL()
	if err != nil {
		return 0, "", err
	}
	return a.version, a.path, nil
}
