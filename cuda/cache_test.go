package cuda

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

func TestCacheKey(t *testing.T) {
	base := func() (string, []string, string, bool, string) {
		return "src", []string{"--gpu-architecture=sm_90", "-DX=1"}, "sm_90", false, "13.0"
	}
	k0 := cacheKey(base())
	if len(k0) != 64 {
		t.Fatalf("key %q is not hex SHA-256", k0)
	}
	if k0 != cacheKey(base()) {
		t.Fatal("key is not stable")
	}
	tests := []struct {
		name string
		key  string
	}{
		{"source", cacheKey("src ", []string{"--gpu-architecture=sm_90", "-DX=1"}, "sm_90", false, "13.0")},
		{"option value", cacheKey("src", []string{"--gpu-architecture=sm_90", "-DX=2"}, "sm_90", false, "13.0")},
		{"option order", cacheKey("src", []string{"-DX=1", "--gpu-architecture=sm_90"}, "sm_90", false, "13.0")},
		{"option split", cacheKey("src", []string{"--gpu-architecture=sm_90-DX=1"}, "sm_90", false, "13.0")},
		{"extra option", cacheKey("src", []string{"--gpu-architecture=sm_90", "-DX=1", ""}, "sm_90", false, "13.0")},
		{"arch", cacheKey("src", []string{"--gpu-architecture=sm_90", "-DX=1"}, "sm_90a", false, "13.0")},
		{"ptx", cacheKey("src", []string{"--gpu-architecture=sm_90", "-DX=1"}, "sm_90", true, "13.0")},
		{"nvrtc version", cacheKey("src", []string{"--gpu-architecture=sm_90", "-DX=1"}, "sm_90", false, "12.8")},
		{"source/option boundary", cacheKey("src--gpu-architecture=sm_90", []string{"-DX=1"}, "sm_90", false, "13.0")},
	}
	seen := map[string]string{k0: "base"}
	for _, tt := range tests {
		if prev, ok := seen[tt.key]; ok {
			t.Errorf("changing %s gives the key of %s", tt.name, prev)
		}
		seen[tt.key] = tt.name
	}
}

func TestWriteFileAtomic(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "k.cubin")
	// Many writers of the same entry, as several processes compiling the
	// same kernel at once: the file must always be one writer's whole data.
	const writers = 16
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for i := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			data := bytes.Repeat([]byte{byte('a' + i)}, 64<<10)
			for range 20 {
				if err := writeFileAtomic(path, data); err != nil {
					errs <- err
					return
				}
				got, err := os.ReadFile(path)
				if err != nil {
					errs <- err
					return
				}
				if len(got) != len(data) || !bytes.Equal(got, bytes.Repeat(got[:1], len(got))) {
					errs <- fmt.Errorf("read a mixed or partial file of %d bytes", len(got))
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != "k.cubin" {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("directory holds %v, want only k.cubin (no temporary files)", names)
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o644 {
		t.Errorf("mode %v, err %v", st.Mode(), err)
	}
	if err := writeFileAtomic(filepath.Join(dir, "missing", "x"), []byte("x")); err == nil {
		t.Error("write into a missing directory succeeded")
	}
}

func TestCacheDir(t *testing.T) {
	d := filepath.Join(t.TempDir(), "a", "b")
	t.Setenv(EnvCacheDir, d)
	got, err := CacheDir()
	if err != nil || got != d {
		t.Fatalf("CacheDir = %q, %v; want %q", got, err, d)
	}
	if st, err := os.Stat(d); err != nil || !st.IsDir() {
		t.Errorf("cache dir not created: %v", err)
	}
	t.Setenv(EnvCacheDir, "")
	t.Setenv("XDG_CACHE_HOME", filepath.Join(t.TempDir(), "xdg"))
	got, err = CacheDir()
	if err != nil || !strings.HasSuffix(got, filepath.Join("xdg", "flashattn", "kernels")) {
		t.Errorf("default CacheDir = %q, %v", got, err)
	}
}
