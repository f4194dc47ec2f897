package cuda

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"unsafe"

	"github.com/ebitengine/purego"
)

// Environment variables that steer the search for CUDA libraries and headers.
const (
	// EnvCUDAHome names a CUDA toolkit directory searched before all others
	// (its lib64, lib, targets/x86_64-linux/lib and include directories).
	EnvCUDAHome = "FLASHATTN_CUDA_HOME"
	// EnvLibCUDA, when set, is the exact path of the driver library to load;
	// nothing else is tried.
	EnvLibCUDA = "FLASHATTN_LIBCUDA"
	// EnvNVRTC, when set, is the exact path of the NVRTC library to load;
	// nothing else is tried.
	EnvNVRTC = "FLASHATTN_NVRTC"
	// EnvCacheDir overrides the directory of the compile cache.
	EnvCacheDir = "FLASHATTN_CACHE_DIR"
)

// driverSonames are the names of the CUDA driver library. The unversioned
// libcuda.so is deliberately absent: in a toolkit it is the link-time stub.
var driverSonames = []string{"libcuda.so.1"}

// nvrtcSonames are the names under which NVRTC is installed by toolkits,
// distributions and Python wheels, newest first.
var nvrtcSonames = []string{"libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2"}

// searchEnv is what the library search reads from the outside world; tests
// replace it to make the search deterministic.
type searchEnv struct {
	getenv func(string) string
	glob   func(string) ([]string, error)
}

// osEnv is the search environment of the running process.
func osEnv() searchEnv {
	return searchEnv{getenv: os.Getenv, glob: filepath.Glob}
}

// toolkitDirs returns the CUDA toolkit directories to search, in order:
// FLASHATTN_CUDA_HOME, CUDA_HOME, CUDA_PATH, /usr/local/cuda.
func toolkitDirs(env searchEnv) []string {
	var dirs []string
	for _, v := range []string{EnvCUDAHome, "CUDA_HOME", "CUDA_PATH"} {
		if d := env.getenv(v); d != "" {
			dirs = append(dirs, d)
		}
	}
	dirs = append(dirs, "/usr/local/cuda")
	return dedupe(dirs)
}

// toolkitLibDirs returns the library directories inside toolkit dir d.
func toolkitLibDirs(d string) []string {
	return []string{
		filepath.Join(d, "lib64"),
		filepath.Join(d, "lib"),
		filepath.Join(d, "targets", "x86_64-linux", "lib"),
	}
}

// systemLibDirs are the distribution's library directories.
var systemLibDirs = []string{"/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"}

// pythonSitePackages returns the site-packages directories of common Python
// installations that exist on this machine.
func pythonSitePackages(env searchEnv) []string {
	var patterns []string
	for _, v := range []string{"VIRTUAL_ENV", "CONDA_PREFIX"} {
		if p := env.getenv(v); p != "" {
			patterns = append(patterns, filepath.Join(p, "lib", "python3*", "site-packages"))
		}
	}
	if h := env.getenv("HOME"); h != "" {
		patterns = append(patterns, filepath.Join(h, ".local", "lib", "python3*", "site-packages"))
	}
	patterns = append(patterns,
		"/usr/local/lib/python3*/site-packages",
		"/usr/local/lib/python3*/dist-packages",
		"/usr/lib/python3*/site-packages",
		"/usr/lib/python3/dist-packages",
		"/opt/conda/lib/python3*/site-packages",
	)
	var dirs []string
	for _, p := range patterns {
		m, err := env.glob(p)
		if err != nil {
			continue
		}
		sort.Sort(sort.Reverse(sort.StringSlice(m))) // newest Python first
		dirs = append(dirs, m...)
	}
	return dedupe(dirs)
}

// nvidiaWheelDirs returns, for each site-packages directory, the places
// where NVIDIA's Python wheels put their libraries (sub = "lib") or headers
// (sub = "include").
func nvidiaWheelDirs(env searchEnv, sub string, pkgs ...string) []string {
	var dirs []string
	for _, sp := range pythonSitePackages(env) {
		for _, p := range pkgs {
			dirs = append(dirs, filepath.Join(sp, "nvidia", p, sub))
		}
	}
	return dirs
}

// driverCandidates returns, in search order, what is tried to load the
// driver: absolute paths, or bare sonames for the dynamic loader's own
// search (LD_LIBRARY_PATH, the ld.so cache, the default directories).
func driverCandidates(env searchEnv) []string {
	return libCandidates(env, EnvLibCUDA, driverSonames, func() []string {
		dirs := append([]string{"/usr/local/nvidia/lib64", "/usr/local/nvidia/lib"}, systemLibDirs...)
		return append(dirs, "/usr/lib/wsl/lib")
	})
}

// nvrtcCandidates returns, in search order, what is tried to load NVRTC.
func nvrtcCandidates(env searchEnv) []string {
	return libCandidates(env, EnvNVRTC, nvrtcSonames, func() []string {
		return append(append([]string{}, systemLibDirs...), nvidiaWheelDirs(env, "lib", "cuda_nvrtc", "cu13", "cu12")...)
	})
}

// libCandidates returns, in search order, what is tried to load a library
// of sonames: the path in the environment variable override alone when it
// is set, else the sonames in each toolkit's library directories, the bare
// sonames, then the sonames in each of dirs().
func libCandidates(env searchEnv, override string, sonames []string, dirs func() []string) []string {
	if p := env.getenv(override); p != "" {
		return []string{p}
	}
	var c []string
	for _, d := range toolkitDirs(env) {
		c = append(c, joinAll(toolkitLibDirs(d), sonames)...)
	}
	c = append(c, sonames...)
	c = append(c, joinAll(dirs(), sonames)...)
	return dedupe(c)
}

// includeCandidates returns the directories searched for cuda_fp16.h, in
// order: the toolkit NVRTC was loaded from (libDir's parents), the toolkit
// directories, the wheels' include directories and /usr/include.
func includeCandidates(env searchEnv, libDir string) []string {
	var c []string
	if libDir != "" {
		c = append(c,
			filepath.Join(libDir, "..", "include"),
			filepath.Join(libDir, "..", "..", "include"),
			filepath.Join(libDir, "..", "..", "..", "include"))
	}
	for _, d := range toolkitDirs(env) {
		c = append(c, filepath.Join(d, "include"))
	}
	c = append(c, "/usr/include")
	c = append(c, nvidiaWheelDirs(env, "include", "cuda_runtime", "cu13", "cu12")...)
	return dedupe(c)
}

// findIncludeDir returns the first candidate directory that holds
// cuda_fp16.h, or "" when none does.
func findIncludeDir(cands []string) string {
	for _, d := range cands {
		if fileExists(filepath.Join(d, "cuda_fp16.h")) {
			return d
		}
	}
	return ""
}

// joinAll returns every dir/name pair, dirs outermost.
func joinAll(dirs, names []string) []string {
	out := make([]string, 0, len(dirs)*len(names))
	for _, d := range dirs {
		for _, n := range names {
			out = append(out, filepath.Join(d, n))
		}
	}
	return out
}

// dedupe removes repeated entries (after filepath.Clean for paths) and keeps
// the first occurrence's position.
func dedupe(s []string) []string {
	seen := make(map[string]bool, len(s))
	out := s[:0:0]
	for _, v := range s {
		k := v
		if strings.ContainsRune(v, '/') {
			k = filepath.Clean(v)
		}
		if seen[k] {
			continue
		}
		seen[k] = true
		out = append(out, k)
	}
	return out
}

// fileExists reports whether path names an existing file (following links).
func fileExists(path string) bool {
	st, err := os.Stat(path)
	return err == nil && !st.IsDir()
}

// dlopenFlags are the flags every library is opened with.
const dlopenFlags = purego.RTLD_NOW | purego.RTLD_GLOBAL

// library is an opened shared library.
type library struct {
	handle uintptr
	path   string // what was opened: an absolute path or a soname
}

// openFirst opens the first candidate that loads. Candidates under a
// "stubs" directory are skipped: those are link-time stubs, not libraries
// that work. It returns the attempts, one entry each, for error messages.
func openFirst(cands []string) (*library, []string) {
	var tried []string
	for _, c := range cands {
		abs := strings.ContainsRune(c, '/')
		if abs && strings.Contains(c, "/stubs/") {
			tried = append(tried, c+" (stub, skipped)")
			continue
		}
		if abs && !fileExists(c) {
			tried = append(tried, c)
			continue
		}
		h, err := purego.Dlopen(c, dlopenFlags)
		if err != nil {
			tried = append(tried, fmt.Sprintf("%s (%v)", c, err))
			continue
		}
		return &library{handle: h, path: c}, tried
	}
	return nil, tried
}

// notFoundError returns sentinel wrapped with the list of attempts.
func notFoundError(sentinel error, tried []string) error {
	if len(tried) == 0 {
		return fmt.Errorf("%w: nothing to try", sentinel)
	}
	return fmt.Errorf("%w: tried %s", sentinel, strings.Join(tried, ", "))
}

// symbols resolves each name into the uintptr that ptrs maps it to. It
// returns an error naming every missing symbol.
func (l *library) symbols(ptrs map[string]*uintptr) error {
	var missing []string
	for name, p := range ptrs {
		s, err := purego.Dlsym(l.handle, name)
		if err != nil || s == 0 {
			missing = append(missing, name)
			continue
		}
		*p = s
	}
	if len(missing) > 0 {
		sort.Strings(missing)
		return fmt.Errorf("%s lacks %s", l.path, strings.Join(missing, ", "))
	}
	return nil
}

// optionalSymbol returns the address of name, or 0 when l lacks it.
func (l *library) optionalSymbol(name string) uintptr {
	s, err := purego.Dlsym(l.handle, name)
	if err != nil {
		return 0
	}
	return s
}

// loadedPath returns the file that the process mapped for a library whose
// file name starts with base (read from /proc/self/maps), or "" when it is
// not found. It resolves which file a bare soname loaded.
func loadedPath(base string) string {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		i := strings.IndexByte(line, '/')
		if i < 0 {
			continue
		}
		p := line[i:]
		if strings.HasPrefix(filepath.Base(p), base) {
			return p
		}
	}
	return ""
}

// preloadBuiltins opens the libnvrtc-builtins library that sits beside an
// NVRTC loaded from dir, so that NVRTC's own dlopen of it by soname finds it
// even when dir is not on the loader's path. Failures are ignored: NVRTC
// then searches on its own.
func preloadBuiltins(dir string) {
	m, _ := filepath.Glob(filepath.Join(dir, "libnvrtc-builtins.so*"))
	// Longest (most specific) file names first.
	sort.Slice(m, func(i, j int) bool { return len(m[i]) > len(m[j]) })
	for _, p := range m {
		if _, err := purego.Dlopen(p, dlopenFlags); err == nil {
			return
		}
	}
}

// ccall calls the C function fn with integer and pointer arguments and
// returns the integer result register. Pointers converted to uintptr in the
// call expression are kept alive and in place for the call's duration.
//
//go:uintptrescapes
func ccall(fn uintptr, args ...uintptr) uintptr {
	r, _, _ := purego.SyscallN(fn, args...)
	return r
}

// goString copies the NUL-terminated C string at p.
func goString(p *byte) string {
	if p == nil {
		return ""
	}
	n := 0
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(p, n))
}

// cstrings holds NUL-terminated copies of Go strings and an array of
// pointers to them, on the Go heap, for C functions that take char**.
type cstrings struct {
	bufs [][]byte
	ptrs []uintptr
}

// newCStrings copies ss. It is not inlined so that its allocations are
// always on the heap, where they do not move.
//
//go:noinline
func newCStrings(ss []string) *cstrings {
	c := &cstrings{bufs: make([][]byte, len(ss)), ptrs: make([]uintptr, len(ss)+1)}
	for i, s := range ss {
		b := make([]byte, len(s)+1)
		copy(b, s)
		c.bufs[i] = b
		c.ptrs[i] = uintptr(unsafe.Pointer(&b[0]))
	}
	return c
}

// array returns the address of the pointer array (0 for no strings).
func (c *cstrings) array() uintptr {
	if len(c.bufs) == 0 {
		return 0
	}
	return uintptr(unsafe.Pointer(&c.ptrs[0]))
}

// heapBytes returns a zeroed byte slice of length n that is guaranteed to be
// allocated on the heap (n must be > 0).
//
//go:noinline
func heapBytes(n int) []byte {
	return make([]byte, n)
}

// cstring returns a NUL-terminated heap copy of s.
func cstring(s string) []byte {
	b := heapBytes(len(s) + 1)
	copy(b, s)
	return b
}
