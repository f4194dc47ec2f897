package cuda

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
)

// TestMain points the compile cache at a fresh temporary directory, so that
// tests measure cold compiles and never touch the user's cache, and closes
// the shared test device at the end.
func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "flashattn-cuda-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Setenv(EnvCacheDir, dir)
	code := m.Run()
	if sharedDev != nil {
		if err := sharedDev.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "close:", err)
			code = 1
		}
	}
	os.RemoveAll(dir)
	os.Exit(code)
}

var (
	sharedOnce sync.Once
	sharedDev  *Device
	sharedErr  error
)

// short returns the first line of err's message, cut to 160 characters, for
// one-line skip reasons.
func short(err error) string {
	s, _, _ := strings.Cut(err.Error(), "\n")
	if len(s) > 160 {
		s = s[:160] + "…"
	}
	return s
}

// testDevice returns the shared device 0, skipping the test when this
// machine has no usable CUDA driver or GPU.
func testDevice(t testing.TB) *Device {
	t.Helper()
	sharedOnce.Do(func() { sharedDev, sharedErr = Open(0) })
	if Unavailable(sharedErr) {
		t.Skipf("no CUDA GPU: %s", short(sharedErr))
	}
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return sharedDev
}

// testCompiler returns the process's NVRTC, skipping the test when none is
// installed.
func testCompiler(t testing.TB) *Compiler {
	t.Helper()
	c, err := NewCompiler()
	if err != nil {
		t.Skipf("NVRTC not found: %s", short(err))
	}
	return c
}

// vecAddSource is a kernel that takes its arguments as one struct.
const vecAddSource = `
struct VecAddParams {
	const float* a;
	const float* b;
	float* c;
	int n;
	float alpha;
};

// c = a + alpha * b
extern "C" __global__ void vecadd(VecAddParams p) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < p.n) p.c[i] = p.a[i] + p.alpha * p.b[i];
}
`

// vecAddParams packs VecAddParams.
func vecAddParams(a, b, c *Buffer, n int, alpha float32) []byte {
	var p ParamBuffer
	p.Ptr(a.Ptr())
	p.Ptr(b.Ptr())
	p.Ptr(c.Ptr())
	p.I32(int32(n))
	p.F32(alpha)
	return p.Bytes()
}
