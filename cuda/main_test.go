package cuda

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/flashattn/flashattn/kernels"
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

// ptrsArgs holds the arguments of the tests' kernels: up to three
// pointers, then the 64-bit, 32-bit and float scalars their structs
// declare (argsOf lists which).
type ptrsArgs struct {
	p   [3]uint64
	i64 int64
	i32 int32
	f32 float32
}

// argsOf returns the CStruct of a test kernel's argument: nptr pointers,
// then a long long if i64, an int if i32, a float if f32.
func argsOf(nptr int, i64, i32, f32 bool) *kernels.CStruct[ptrsArgs] {
	var fs []kernels.CField[ptrsArgs]
	for i := range nptr {
		fs = append(fs, kernels.CPtr("void*", fmt.Sprintf("p%d", i), "", func(a *ptrsArgs) uint64 { return a.p[i] }))
	}
	if i64 {
		fs = append(fs, kernels.CI64("long long", "l", "", func(a *ptrsArgs) int64 { return a.i64 }))
	}
	if i32 {
		fs = append(fs, kernels.CI32("int", "n", "", func(a *ptrsArgs) int32 { return a.i32 }))
	}
	if f32 {
		fs = append(fs, kernels.CF32("f", "", func(a *ptrsArgs) float32 { return a.f32 }))
	}
	return kernels.NewCStruct("Args", 0, fs...)
}

// vecAddParams packs VecAddParams.
func vecAddParams(a, b, c *Buffer, n int, alpha float32) []byte {
	return argsOf(3, false, true, true).Pack(&ptrsArgs{p: [3]uint64{a.Ptr(), b.Ptr(), c.Ptr()}, i32: int32(n), f32: alpha})
}
