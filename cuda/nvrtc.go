package cuda

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"
)

// nvrtcAPI holds the entry points of libnvrtc.
type nvrtcAPI struct {
	lib *library

	nvrtcVersion, nvrtcCreateProgram, nvrtcDestroyProgram, nvrtcCompileProgram uintptr
	nvrtcGetPTXSize, nvrtcGetPTX, nvrtcGetCUBINSize, nvrtcGetCUBIN             uintptr
	nvrtcGetProgramLogSize, nvrtcGetProgramLog                                 uintptr
	nvrtcGetNumSupportedArchs, nvrtcGetSupportedArchs                          uintptr // optional

	errorString func(int32) string // nvrtcGetErrorString
}

// Compiler compiles CUDA C++ with NVRTC. It is safe for concurrent use.
type Compiler struct {
	api          *nvrtcAPI
	path         string // the NVRTC library that was loaded
	major, minor int
	include      string // the directory holding cuda_fp16.h, or ""
}

var (
	nvrtcMu     sync.Mutex
	nvrtcLoaded *Compiler
)

// NewCompiler loads NVRTC (once per process; later calls return the same
// Compiler) and locates the CUDA headers for -I. It fails with an error
// wrapping ErrNoNVRTC that lists every place tried when no NVRTC loads.
// See the package documentation for the search order.
func NewCompiler() (*Compiler, error) {
	nvrtcMu.Lock()
	defer nvrtcMu.Unlock()
	if nvrtcLoaded != nil {
		return nvrtcLoaded, nil
	}
	env := osEnv()
	c, err := loadNVRTCFrom(nvrtcCandidates(env), env)
	if err != nil {
		return nil, err
	}
	nvrtcLoaded = c
	return c, nil
}

// loadNVRTCFrom opens the first loadable candidate, resolves its symbols
// and finds the header directory.
func loadNVRTCFrom(cands []string, env searchEnv) (*Compiler, error) {
	lib, tried := openFirst(cands)
	if lib == nil {
		return nil, notFoundError(ErrNoNVRTC, tried)
	}
	a := &nvrtcAPI{lib: lib}
	if err := lib.symbols(map[string]*uintptr{
		"nvrtcVersion":           &a.nvrtcVersion,
		"nvrtcCreateProgram":     &a.nvrtcCreateProgram,
		"nvrtcDestroyProgram":    &a.nvrtcDestroyProgram,
		"nvrtcCompileProgram":    &a.nvrtcCompileProgram,
		"nvrtcGetPTXSize":        &a.nvrtcGetPTXSize,
		"nvrtcGetPTX":            &a.nvrtcGetPTX,
		"nvrtcGetCUBINSize":      &a.nvrtcGetCUBINSize,
		"nvrtcGetCUBIN":          &a.nvrtcGetCUBIN,
		"nvrtcGetProgramLogSize": &a.nvrtcGetProgramLogSize,
		"nvrtcGetProgramLog":     &a.nvrtcGetProgramLog,
	}); err != nil {
		return nil, fmt.Errorf("%w: %v (NVRTC older than 11.1?)", ErrNoNVRTC, err)
	}
	a.nvrtcGetNumSupportedArchs = lib.optionalSymbol("nvrtcGetNumSupportedArchs")
	a.nvrtcGetSupportedArchs = lib.optionalSymbol("nvrtcGetSupportedArchs")
	if s := lib.optionalSymbol("nvrtcGetErrorString"); s != 0 {
		purego.RegisterFunc(&a.errorString, s)
	}
	c := &Compiler{api: a, path: lib.path}
	if !filepath.IsAbs(c.path) {
		if p := loadedPath("libnvrtc.so"); p != "" {
			c.path = p
		}
	}
	if filepath.IsAbs(c.path) {
		preloadBuiltins(filepath.Dir(c.path))
	}
	var major, minor int32
	if r := ccall(a.nvrtcVersion, uintptr(unsafe.Pointer(&major)), uintptr(unsafe.Pointer(&minor))); int32(r) != 0 {
		return nil, fmt.Errorf("%w: nvrtcVersion in %s failed: %s", ErrNoNVRTC, c.path, a.resultName(int32(r)))
	}
	c.major, c.minor = int(major), int(minor)
	libDir := ""
	if filepath.IsAbs(c.path) {
		libDir = filepath.Dir(c.path)
	}
	c.include = findIncludeDir(includeCandidates(env, libDir))
	return c, nil
}

// nvrtcResultNames are the nvrtcResult names, for when nvrtcGetErrorString
// is missing.
var nvrtcResultNames = []string{
	"NVRTC_SUCCESS", "NVRTC_ERROR_OUT_OF_MEMORY", "NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
	"NVRTC_ERROR_INVALID_INPUT", "NVRTC_ERROR_INVALID_PROGRAM", "NVRTC_ERROR_INVALID_OPTION",
	"NVRTC_ERROR_COMPILATION", "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
	"NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION", "NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION",
	"NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID", "NVRTC_ERROR_INTERNAL_ERROR",
}

// resultName returns the name of an nvrtcResult.
func (a *nvrtcAPI) resultName(r int32) string {
	if a.errorString != nil {
		if s := a.errorString(r); s != "" {
			return s
		}
	}
	if r >= 0 && int(r) < len(nvrtcResultNames) {
		return nvrtcResultNames[r]
	}
	return fmt.Sprintf("nvrtcResult(%d)", r)
}

// Path returns the NVRTC library that was loaded.
func (c *Compiler) Path() string { return c.path }

// Version returns NVRTC's version, such as 13, 0.
func (c *Compiler) Version() (major, minor int) { return c.major, c.minor }

// VersionString returns NVRTC's version as "major.minor".
func (c *Compiler) VersionString() string { return fmt.Sprintf("%d.%d", c.major, c.minor) }

// IncludeDir returns the directory holding cuda_fp16.h that every
// compilation gets as -I, or "" when none was found.
func (c *Compiler) IncludeDir() string { return c.include }

// SupportedArchs returns the real architectures NVRTC can compile for, such
// as [50 52 ... 90], or nil when this NVRTC cannot tell.
func (c *Compiler) SupportedArchs() []int {
	a := c.api
	if a.nvrtcGetNumSupportedArchs == 0 || a.nvrtcGetSupportedArchs == 0 {
		return nil
	}
	var n int32
	if ccall(a.nvrtcGetNumSupportedArchs, uintptr(unsafe.Pointer(&n))) != 0 || n <= 0 {
		return nil
	}
	archs := make([]int32, n)
	if ccall(a.nvrtcGetSupportedArchs, uintptr(unsafe.Pointer(&archs[0]))) != 0 {
		return nil
	}
	out := make([]int, n)
	for i, v := range archs {
		out[i] = int(v)
	}
	return out
}

// CompileRequest is one CUDA C++ translation unit to compile with NVRTC.
type CompileRequest struct {
	// Name is the source's file name, used in NVRTC's messages and for the
	// saved source, such as "attn_fwd.cu". Empty means "kernel.cu".
	Name string
	// Source is the CUDA C++ source text.
	Source string
	// Options are further NVRTC options, such as "-DBLOCK_M=128",
	// "--use_fast_math", "-lineinfo" or "--maxrregcount=128". The package
	// always passes --gpu-architecture, --std=c++17, -default-device and
	// -I for the CUDA headers.
	Options []string
	// Arch is the target real architecture, such as "sm_80" or "sm_90a".
	// Device.Compile fills it with the device's; Compiler.Compile needs it.
	Arch string
	// ArchSpecific asks for the architecture-specific target ("sm_90a"
	// instead of "sm_90"), needed for instructions such as wgmma and
	// setmaxnreg. The image then runs only on that exact architecture.
	ArchSpecific bool
	// PTX asks for PTX (for the virtual architecture compute_XY) instead of
	// a cubin; the driver then compiles it when the module is loaded.
	PTX bool
	// Verbose passes --ptxas-options=-v, so that the log holds ptxas's
	// resource report (registers, shared memory, stack frame, spills),
	// parsed into CompileStats.Resources. It has no effect with PTX.
	Verbose bool
	// IncludeDirs are further directories for -I, searched before the CUDA
	// headers.
	IncludeDirs []string
	// NoCache skips the disk cache: the source is compiled and the result
	// is neither read from nor written to the cache.
	NoCache bool
}

// CompileStats describes how a module's image was produced.
type CompileStats struct {
	// Name is the request's file name.
	Name string
	// Target is the NVRTC target, such as "sm_90a" or "compute_80".
	Target string
	// NVRTCVersion is the version of the NVRTC that compiled, "major.minor".
	NVRTCVersion string
	// Options are all options given to NVRTC.
	Options []string
	// Key is the cache key: the hex SHA-256 of the source, the options, the
	// target and the NVRTC version.
	Key string
	// CacheHit reports that the image came from the disk cache.
	CacheHit bool
	// CompileTime is the time NVRTC took, or the time to read the cache on
	// a hit.
	CompileTime time.Duration
	// LoadTime is the time cuModuleLoadDataEx took (zero from
	// Compiler.Compile, which loads nothing).
	LoadTime time.Duration
	// SourcePath is where the source was written for inspection, or "".
	SourcePath string
	// CachePath is the image's file in the cache, or "" when not cached.
	CachePath string
	// Log is NVRTC's program log: warnings, and ptxas's report with Verbose.
	Log string
	// Resources is ptxas's report per kernel, parsed from Log (Verbose only).
	Resources []KernelResources
}

// Compiled is the output of a compilation.
type Compiled struct {
	// Image is the cubin, or the NUL-terminated PTX text when PTX was asked.
	Image []byte
	// PTX reports that Image is PTX.
	PTX bool
	// Stats describes the compilation.
	Stats CompileStats
}

// archRE matches a real architecture name.
var archRE = regexp.MustCompile(`^sm_([0-9]+)(a|f)?$`)

// target returns the NVRTC --gpu-architecture value for req.
func (req *CompileRequest) target() (string, error) {
	m := archRE.FindStringSubmatch(req.Arch)
	if m == nil {
		return "", argErrorf("architecture %q (want sm_XY or sm_XYa)", req.Arch)
	}
	suffix := m[2]
	if req.ArchSpecific {
		suffix = "a"
	}
	if req.PTX {
		return "compute_" + m[1] + suffix, nil
	}
	return "sm_" + m[1] + suffix, nil
}

// options returns the full NVRTC option list for req.
func (c *Compiler) options(req *CompileRequest, target string) []string {
	opts := []string{"--gpu-architecture=" + target, "--std=c++17", "-default-device"}
	for _, d := range req.IncludeDirs {
		opts = append(opts, "-I"+d)
	}
	if c.include != "" {
		opts = append(opts, "-I"+c.include)
	}
	opts = append(opts, req.Options...)
	if req.Verbose && !req.PTX {
		// NVRTC 12.9 and later keep their own compile cache, and a hit in
		// it skips ptxas and so its report: bypass it.
		if c.major > 12 || (c.major == 12 && c.minor >= 9) {
			opts = append(opts, "--no-cache")
		}
		opts = append(opts, "--ptxas-options=-v")
	}
	return opts
}

// Compile compiles req with NVRTC, or returns the image from the disk cache
// when the same source, options, target and NVRTC version were compiled
// before. A failed compilation returns a *CompileError (wrapping ErrCompile)
// with NVRTC's full log and the path where the source was written.
func (c *Compiler) Compile(req CompileRequest) (*Compiled, error) {
	return c.compile(req, false)
}

// compile implements Compile; force skips reading the cache (but writes it).
func (c *Compiler) compile(req CompileRequest, force bool) (*Compiled, error) {
	if strings.TrimSpace(req.Source) == "" {
		return nil, argErrorf("empty source")
	}
	if req.Name == "" {
		req.Name = "kernel.cu"
	}
	target, err := req.target()
	if err != nil {
		return nil, err
	}
	opts := c.options(&req, target)
	st := CompileStats{
		Name:         req.Name,
		Target:       target,
		NVRTCVersion: c.VersionString(),
		Options:      opts,
		Key:          cacheKey(req.Source, opts, target, req.PTX, c.VersionString()),
	}
	ext := ".cubin"
	if req.PTX {
		ext = ".ptx"
	}
	start := time.Now()
	dir, dirErr := cacheDir()
	useCache := !req.NoCache && dirErr == nil
	if useCache {
		st.CachePath = filepath.Join(dir, st.Key+ext)
		if !force {
			if img, err := os.ReadFile(st.CachePath); err == nil && len(img) > 0 {
				log, _ := os.ReadFile(filepath.Join(dir, st.Key+".log"))
				st.CacheHit = true
				st.CompileTime = time.Since(start)
				st.Log = string(log)
				st.Resources = ParseResources(st.Log)
				st.SourcePath = c.saveSource(dir, dirErr, st.Key, req.Source)
				return &Compiled{Image: img, PTX: req.PTX, Stats: st}, nil
			}
		}
	}
	st.SourcePath = c.saveSource(dir, dirErr, st.Key, req.Source)
	img, log, res, err := c.run(req.Source, req.Name, opts, req.PTX)
	st.CompileTime = time.Since(start)
	st.Log = log
	if err != nil {
		return nil, err
	}
	if res != 0 {
		return nil, &CompileError{Name: req.Name, Arch: target, Result: c.api.resultName(res),
			Options: opts, Log: log, SourcePath: st.SourcePath}
	}
	st.Resources = ParseResources(log)
	if useCache {
		// The log goes first, so that a visible image always has its log.
		if err := writeFileAtomic(filepath.Join(dir, st.Key+".log"), []byte(log)); err == nil {
			if err := writeFileAtomic(st.CachePath, img); err != nil {
				st.CachePath = ""
			}
		} else {
			st.CachePath = ""
		}
	}
	return &Compiled{Image: img, PTX: req.PTX, Stats: st}, nil
}

// saveSource writes the source as <key>.cu in the cache directory (or, when
// that is unusable, in a flashattn-kernels directory under os.TempDir) and
// returns its path, or "" when it could not be written.
func (c *Compiler) saveSource(dir string, dirErr error, key, src string) string {
	if dirErr != nil {
		dir = filepath.Join(os.TempDir(), "flashattn-kernels")
	}
	p := filepath.Join(dir, key+".cu")
	if fileExists(p) {
		return p
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return ""
	}
	if err := writeFileAtomic(p, []byte(src)); err != nil {
		return ""
	}
	return p
}

// run compiles one program. It returns the image, the log and NVRTC's
// compilation result (non-zero: the source did not compile); err reports a
// failure of NVRTC itself.
func (c *Compiler) run(src, name string, opts []string, ptx bool) (img []byte, log string, res int32, err error) {
	a := c.api
	csrc, cname := cstring(src), cstring(name)
	var prog uintptr
	r := int32(ccall(a.nvrtcCreateProgram, uintptr(unsafe.Pointer(&prog)), addr(csrc), addr(cname), 0, 0, 0))
	runtime.KeepAlive(csrc)
	runtime.KeepAlive(cname)
	if r != 0 {
		return nil, "", 0, fmt.Errorf("%w: nvrtcCreateProgram(%s): %s", ErrCompile, name, a.resultName(r))
	}
	defer func() { ccall(a.nvrtcDestroyProgram, uintptr(unsafe.Pointer(&prog))) }()
	copts := newCStrings(opts)
	res = int32(ccall(a.nvrtcCompileProgram, prog, uintptr(len(opts)), copts.array()))
	runtime.KeepAlive(copts)
	var n uint64
	if r := int32(ccall(a.nvrtcGetProgramLogSize, prog, uintptr(unsafe.Pointer(&n)))); r == 0 && n > 1 {
		buf := heapBytes(int(n))
		if int32(ccall(a.nvrtcGetProgramLog, prog, addr(buf))) == 0 {
			log = strings.TrimRight(string(buf), "\x00")
		}
	}
	if res != 0 {
		return nil, log, res, nil
	}
	sizeFn, getFn, what := a.nvrtcGetCUBINSize, a.nvrtcGetCUBIN, "CUBIN"
	if ptx {
		sizeFn, getFn, what = a.nvrtcGetPTXSize, a.nvrtcGetPTX, "PTX"
	}
	n = 0
	if r := int32(ccall(sizeFn, prog, uintptr(unsafe.Pointer(&n)))); r != 0 || n == 0 {
		return nil, log, 0, fmt.Errorf("%w: nvrtcGet%sSize(%s): %s", ErrCompile, what, name, a.resultName(r))
	}
	img = heapBytes(int(n))
	if r := int32(ccall(getFn, prog, addr(img))); r != 0 {
		return nil, log, 0, fmt.Errorf("%w: nvrtcGet%s(%s): %s", ErrCompile, what, name, a.resultName(r))
	}
	return img, log, 0, nil
}

// Compile compiles req for this device with the process's NVRTC (see
// NewCompiler and Compiler.Compile; an empty req.Arch means the device's
// architecture) and loads the image. If a cached image fails to load, the
// source is compiled again and the cache entry replaced. Module.Stats
// reports cache use and times.
func (d *Device) Compile(req CompileRequest) (*Module, error) {
	c, err := NewCompiler()
	if err != nil {
		return nil, err
	}
	if req.Arch == "" {
		req.Arch = d.Arch()
	}
	out, err := c.Compile(req)
	if err != nil {
		return nil, err
	}
	m, err := d.LoadModule(out.Image)
	if err != nil && out.Stats.CacheHit {
		if out, err = c.compile(req, true); err != nil {
			return nil, err
		}
		m, err = d.LoadModule(out.Image)
	}
	if err != nil {
		return nil, fmt.Errorf("load %s (%s): %w", req.Name, out.Stats.Target, err)
	}
	load := m.Stats.LoadTime
	m.Stats = out.Stats
	m.Stats.LoadTime = load
	return m, nil
}
