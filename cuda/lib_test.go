package cuda

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// fakeEnv returns a search environment with the given variables and a glob
// that matches nothing except the patterns in globs.
func fakeEnv(vars map[string]string, globs map[string][]string) searchEnv {
	return searchEnv{
		getenv: func(k string) string { return vars[k] },
		glob:   func(p string) ([]string, error) { return globs[p], nil },
	}
}

func TestDriverCandidatesOrder(t *testing.T) {
	tests := []struct {
		name  string
		vars  map[string]string
		first []string // the first candidates, in order
		also  []string // must appear, in this relative order, after first
	}{
		{
			name:  "defaults",
			vars:  nil,
			first: []string{"/usr/local/cuda/lib64/libcuda.so.1", "/usr/local/cuda/lib/libcuda.so.1"},
			also:  []string{"libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"},
		},
		{
			name:  "flashattn home first, then CUDA_HOME, CUDA_PATH",
			vars:  map[string]string{EnvCUDAHome: "/opt/fa", "CUDA_HOME": "/opt/ch", "CUDA_PATH": "/opt/cp"},
			first: []string{"/opt/fa/lib64/libcuda.so.1"},
			also:  []string{"/opt/ch/lib64/libcuda.so.1", "/opt/cp/lib64/libcuda.so.1", "/usr/local/cuda/lib64/libcuda.so.1", "libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1"},
		},
		{
			name:  "exact override",
			vars:  map[string]string{EnvLibCUDA: "/x/libcuda.so.1", EnvCUDAHome: "/opt/fa"},
			first: []string{"/x/libcuda.so.1"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := driverCandidates(fakeEnv(tt.vars, nil))
			if len(got) < len(tt.first) || !slices.Equal(got[:len(tt.first)], tt.first) {
				t.Fatalf("candidates start %v, want %v", got, tt.first)
			}
			if tt.vars[EnvLibCUDA] != "" && len(got) != 1 {
				t.Errorf("override gave %d candidates, want 1", len(got))
			}
			checkOrder(t, got, tt.also)
			for _, c := range got {
				if filepath.Base(c) == "libcuda.so" {
					t.Errorf("candidate %s is the link-time stub name", c)
				}
			}
		})
	}
}

// checkOrder fails unless every entry of want occurs in got, in want's order.
func checkOrder(t *testing.T, got, want []string) {
	t.Helper()
	last := -1
	for _, w := range want {
		i := slices.Index(got, w)
		if i < 0 {
			t.Errorf("candidate %s missing from %v", w, got)
			continue
		}
		if i < last {
			t.Errorf("candidate %s at %d comes before an earlier expected one at %d", w, i, last)
		}
		last = i
	}
}

func TestNVRTCCandidatesOrder(t *testing.T) {
	site := "/usr/local/lib/python3.12/dist-packages"
	env := fakeEnv(map[string]string{"CUDA_HOME": "/opt/ch"},
		map[string][]string{"/usr/local/lib/python3*/dist-packages": {site}})
	got := nvrtcCandidates(env)
	checkOrder(t, got, []string{
		"/opt/ch/lib64/libnvrtc.so",
		"/opt/ch/lib64/libnvrtc.so.13",
		"/usr/local/cuda/lib64/libnvrtc.so",
		"libnvrtc.so",
		"libnvrtc.so.12",
		"libnvrtc.so.11.2",
		"/usr/lib/x86_64-linux-gnu/libnvrtc.so",
		site + "/nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
		site + "/nvidia/cu13/lib/libnvrtc.so.13",
	})
	if o := nvrtcCandidates(fakeEnv(map[string]string{EnvNVRTC: "/y/libnvrtc.so.13"}, nil)); !slices.Equal(o, []string{"/y/libnvrtc.so.13"}) {
		t.Errorf("override gave %v", o)
	}
}

func TestIncludeCandidates(t *testing.T) {
	got := includeCandidates(fakeEnv(map[string]string{EnvCUDAHome: "/opt/fa"}, nil), "/opt/tk/lib64")
	checkOrder(t, got, []string{"/opt/tk/include", "/opt/fa/include", "/usr/local/cuda/include", "/usr/include"})

	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	for _, d := range []string{a, b} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(b, "cuda_fp16.h"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if got := findIncludeDir([]string{a, b}); got != b {
		t.Errorf("findIncludeDir = %q, want %q", got, b)
	}
	if got := findIncludeDir([]string{a}); got != "" {
		t.Errorf("findIncludeDir without header = %q, want empty", got)
	}
}

func TestNoDriver(t *testing.T) {
	empty := t.TempDir()
	bogus := filepath.Join(t.TempDir(), "libcuda.so.1")
	if err := os.WriteFile(bogus, []byte("not a shared object"), 0o644); err != nil {
		t.Fatal(err)
	}
	stub := filepath.Join(t.TempDir(), "stubs", "libcuda.so.1")
	tests := []struct {
		name  string
		cands []string
		want  []string // substrings of the message
	}{
		{"empty dir", []string{filepath.Join(empty, "libcuda.so.1")},
			[]string{"cuda: no CUDA driver found: tried " + filepath.Join(empty, "libcuda.so.1")}},
		{"not a library", []string{bogus}, []string{bogus + " ("}},
		{"stub skipped", []string{stub}, []string{stub + " (stub, skipped)"}},
		{"nothing", nil, []string{"nothing to try"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := loadDriverFrom(tt.cands)
			if !errors.Is(err, ErrNoDriver) || !Unavailable(err) {
				t.Fatalf("err = %v, want ErrNoDriver", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("message %q lacks %q", err, w)
				}
			}
		})
	}
}

func TestNoDriverThroughEnv(t *testing.T) {
	p := filepath.Join(t.TempDir(), "libcuda.so.1")
	env := fakeEnv(map[string]string{EnvLibCUDA: p}, nil)
	_, err := loadDriverFrom(driverCandidates(env))
	if !errors.Is(err, ErrNoDriver) || err.Error() != "cuda: no CUDA driver found: tried "+p {
		t.Fatalf("err = %v", err)
	}
	// With nothing loaded yet in this process, the public entry points
	// report the same.
	driverMu.Lock()
	loaded := driverLoaded != nil
	driverMu.Unlock()
	if loaded {
		t.Log("driver already loaded in this process; public path not retested")
		return
	}
	t.Setenv(EnvLibCUDA, p)
	if _, err := Open(0); !errors.Is(err, ErrNoDriver) {
		t.Errorf("Open with %s=%s: err = %v, want ErrNoDriver", EnvLibCUDA, p, err)
	}
	if _, err := Driver(); !errors.Is(err, ErrNoDriver) {
		t.Errorf("Driver: err = %v, want ErrNoDriver", err)
	}
}

func TestNoNVRTC(t *testing.T) {
	dir := t.TempDir()
	env := fakeEnv(map[string]string{EnvCUDAHome: dir, EnvNVRTC: filepath.Join(dir, "libnvrtc.so")}, nil)
	_, err := loadNVRTCFrom(nvrtcCandidates(env), env)
	if !errors.Is(err, ErrNoNVRTC) {
		t.Fatalf("err = %v, want ErrNoNVRTC", err)
	}
	if want := "cuda: no NVRTC found: tried " + filepath.Join(dir, "libnvrtc.so"); err.Error() != want {
		t.Errorf("message %q, want %q", err, want)
	}
	// Every candidate of an empty toolkit is missing.
	_, tried := openFirst(joinAll(toolkitLibDirs(dir), nvrtcSonames))
	if len(tried) != 3*len(nvrtcSonames) {
		t.Errorf("tried %d candidates, want %d", len(tried), 3*len(nvrtcSonames))
	}
}

func TestDedupe(t *testing.T) {
	got := dedupe([]string{"/a/b/../c", "/a/c", "x.so", "x.so", "/a/c/"})
	if want := []string{"/a/c", "x.so"}; !slices.Equal(got, want) {
		t.Errorf("dedupe = %v, want %v", got, want)
	}
}

func TestCStrings(t *testing.T) {
	c := newCStrings([]string{"--std=c++17", "", "-I/usr/include"})
	if len(c.ptrs) != 4 || c.ptrs[3] != 0 {
		t.Fatalf("pointer array %v not NUL-terminated", c.ptrs)
	}
	for i, want := range []string{"--std=c++17", "", "-I/usr/include"} {
		if got := goString(&c.bufs[i][0]); got != want {
			t.Errorf("string %d = %q, want %q", i, got, want)
		}
	}
	if newCStrings(nil).array() != 0 {
		t.Error("empty list gives a non-nil array")
	}
}
