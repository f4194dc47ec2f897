package cuda

import (
	"bytes"
	"errors"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
)

func TestCompileCUBIN(t *testing.T) {
	c := testCompiler(t)
	t.Logf("NVRTC %s at %s, headers %q", c.VersionString(), c.Path(), c.IncludeDir())
	req := CompileRequest{Name: "vecadd.cu", Source: vecAddSource, Arch: "sm_80", Verbose: true}
	out, err := c.Compile(req)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(out.Image, []byte("\x7fELF")) || out.PTX {
		t.Fatalf("image is not a cubin: % x", out.Image[:min(8, len(out.Image))])
	}
	st := out.Stats
	if st.CacheHit || st.Target != "sm_80" || st.NVRTCVersion != c.VersionString() || len(st.Key) != 64 {
		t.Errorf("stats %+v", st)
	}
	if len(st.Resources) != 1 || st.Resources[0].Name != "vecadd" || st.Resources[0].Registers <= 0 {
		t.Errorf("resources %+v from log %q", st.Resources, st.Log)
	}
	src, err := os.ReadFile(st.SourcePath)
	if err != nil || string(src) != vecAddSource {
		t.Errorf("saved source at %q: %v", st.SourcePath, err)
	}
	t.Logf("cold compile %v, %d bytes, %+v", st.CompileTime, len(out.Image), st.Resources)

	again, err := c.Compile(req)
	if err != nil {
		t.Fatal(err)
	}
	if !again.Stats.CacheHit || !bytes.Equal(again.Image, out.Image) || again.Stats.Key != st.Key {
		t.Errorf("second compile: hit %v, same image %v", again.Stats.CacheHit, bytes.Equal(again.Image, out.Image))
	}
	if !slices.Equal(again.Stats.Resources, st.Resources) {
		t.Errorf("cached resources %+v, want %+v", again.Stats.Resources, st.Resources)
	}
	t.Logf("cache hit in %v", again.Stats.CompileTime)

	req.NoCache = true
	fresh, err := c.Compile(req)
	if err != nil {
		t.Fatal(err)
	}
	if fresh.Stats.CacheHit || fresh.Stats.CachePath != "" {
		t.Errorf("NoCache compile used the cache: %+v", fresh.Stats)
	}

	req.NoCache = false
	req.Options = []string{"-DUNUSED=1"}
	other, err := c.Compile(req)
	if err != nil {
		t.Fatal(err)
	}
	if other.Stats.CacheHit || other.Stats.Key == st.Key {
		t.Error("a different option list hit the same cache entry")
	}
}

func TestCompilePTXAndHeaders(t *testing.T) {
	c := testCompiler(t)
	src := `
#include <cuda_fp16.h>
#include <cuda_bf16.h>
struct P { const __half* x; __nv_bfloat16* y; int n; };
extern "C" __global__ void convert(P p) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < p.n) p.y[i] = __float2bfloat16(__half2float(p.x[i]) * 2.0f);
}
`
	if c.IncludeDir() == "" {
		t.Skip("no cuda_fp16.h found for NVRTC")
	}
	tests := []struct {
		name   string
		req    CompileRequest
		target string
		check  func([]byte) bool
	}{
		{"cubin", CompileRequest{Name: "convert.cu", Source: src, Arch: "sm_80"}, "sm_80",
			func(b []byte) bool { return bytes.HasPrefix(b, []byte("\x7fELF")) }},
		{"ptx", CompileRequest{Name: "convert.cu", Source: src, Arch: "sm_80", PTX: true}, "compute_80",
			func(b []byte) bool { return bytes.Contains(b, []byte(".entry convert")) && b[len(b)-1] == 0 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, err := c.Compile(tt.req)
			if err != nil {
				t.Fatal(err)
			}
			if out.Stats.Target != tt.target || !tt.check(out.Image) || out.PTX != tt.req.PTX {
				t.Errorf("target %s, image starts %q", out.Stats.Target, out.Image[:min(40, len(out.Image))])
			}
		})
	}
}

func TestCompileErrors(t *testing.T) {
	c := testCompiler(t)
	bad := "extern \"C\" __global__ void k(int* p) {\n\tp[0] = undefined_name;\n}\n"
	_, err := c.Compile(CompileRequest{Name: "bad.cu", Source: bad, Arch: "sm_80"})
	var ce *CompileError
	if !errors.Is(err, ErrCompile) || !errors.As(err, &ce) {
		t.Fatalf("err = %v, want a *CompileError", err)
	}
	if ce.Result != "NVRTC_ERROR_COMPILATION" || !strings.Contains(ce.Log, "undefined_name") ||
		!strings.Contains(ce.Log, "bad.cu(2)") || !strings.Contains(err.Error(), ce.Log[:20]) {
		t.Errorf("compile error %+v", ce)
	}
	if src, rerr := os.ReadFile(ce.SourcePath); rerr != nil || string(src) != bad {
		t.Errorf("source for inspection at %q: %v", ce.SourcePath, rerr)
	}

	_, err = c.Compile(CompileRequest{Name: "opt.cu", Source: vecAddSource, Arch: "sm_80", Options: []string{"--no-such-option"}})
	if !errors.As(err, &ce) || ce.Result != "NVRTC_ERROR_INVALID_OPTION" {
		t.Errorf("bad option: %v", err)
	}

	for _, req := range []CompileRequest{
		{Source: vecAddSource, Arch: "80"},
		{Source: vecAddSource, Arch: ""},
		{Source: "  ", Arch: "sm_80"},
	} {
		if _, err := c.Compile(req); !errors.Is(err, ErrArgument) {
			t.Errorf("request %+v: err = %v, want ErrArgument", req, err)
		}
	}
}

func TestCompileTarget(t *testing.T) {
	tests := []struct {
		req  CompileRequest
		want string
	}{
		{CompileRequest{Arch: "sm_90"}, "sm_90"},
		{CompileRequest{Arch: "sm_90", ArchSpecific: true}, "sm_90a"},
		{CompileRequest{Arch: "sm_90a"}, "sm_90a"},
		{CompileRequest{Arch: "sm_90", PTX: true}, "compute_90"},
		{CompileRequest{Arch: "sm_90", PTX: true, ArchSpecific: true}, "compute_90a"},
		{CompileRequest{Arch: "sm_100f"}, "sm_100f"},
		{CompileRequest{Arch: "sm_120", ArchSpecific: true}, "sm_120a"},
	}
	for _, tt := range tests {
		got, err := tt.req.target()
		if err != nil || got != tt.want {
			t.Errorf("%+v: target %q, %v; want %q", tt.req, got, err, tt.want)
		}
	}
	c := &Compiler{include: "/inc"}
	req := CompileRequest{Arch: "sm_90", ArchSpecific: true, Verbose: true, Options: []string{"-DA=1"}, IncludeDirs: []string{"/mine"}}
	got := c.options(&req, "sm_90a")
	want := []string{"--gpu-architecture=sm_90a", "--std=c++17", "-default-device", "-I/mine", "-I/inc", "-DA=1", "--ptxas-options=-v"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("options %q, want %q", got, want)
	}
	c.major, c.minor = 12, 9 // NVRTC's own cache would hide ptxas's report
	got = c.options(&req, "sm_90a")
	want = append(want[:len(want)-1], "--no-cache", "--ptxas-options=-v")
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("options for NVRTC 12.9 %q, want %q", got, want)
	}
}

func TestCompileConcurrent(t *testing.T) {
	c := testCompiler(t)
	t.Setenv(EnvCacheDir, t.TempDir())
	const n = 6
	images := make([][]byte, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Two programs, each compiled by three goroutines at once into
			// the same cold cache.
			out, err := c.Compile(CompileRequest{Name: "vecadd.cu", Source: vecAddSource, Arch: "sm_80",
				Options: []string{"-DVARIANT=" + string(rune('0'+i%2))}})
			if err == nil {
				images[i] = out.Image
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if !bytes.Equal(images[i], images[i%2]) {
			t.Errorf("compile %d gave a different image than compile %d of the same program", i, i%2)
		}
	}
	dir, _ := CacheDir()
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.Contains(e.Name(), ".tmp-") {
			t.Errorf("temporary file %s left in the cache", e.Name())
		}
	}
}
