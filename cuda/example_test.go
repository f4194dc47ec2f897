package cuda_test

import (
	"fmt"
	"log"

	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// This example compiles a kernel with NVRTC, launches it on a buffer and
// reads the result back. It prints nothing on a machine without a GPU.
func Example() {
	dev, err := cuda.Open(0)
	if cuda.Unavailable(err) {
		return
	} else if err != nil {
		log.Fatal(err)
	}
	defer dev.Close()

	mod, err := dev.Compile(cuda.CompileRequest{Name: "scale.cu", Source: `
struct Params { float* x; int n; float s; };
extern "C" __global__ void scale(Params p) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < p.n) p.x[i] *= p.s;
}`})
	if err != nil {
		log.Fatal(err) // a *cuda.CompileError carries NVRTC's log
	}
	f, err := mod.Function("scale")
	if err != nil {
		log.Fatal(err)
	}
	x := []float32{1, 2, 3}
	buf, err := dev.Alloc(int64(4 * len(x)))
	if err != nil {
		log.Fatal(err)
	}
	defer buf.Free()
	if err := dev.CopyToDevice(buf, 0, cuda.AsBytes(x)); err != nil {
		log.Fatal(err)
	}
	// The argument's bytes, laid out as the C struct Params (kernels.CStruct).
	type params struct {
		x uint64
		n int32
		s float32
	}
	args := kernels.NewCStruct("Params", 0,
		kernels.CPtr("float*", "x", "", func(p *params) uint64 { return p.x }),
		kernels.CI32("int", "n", "", func(p *params) int32 { return p.n }),
		kernels.CF32("s", "", func(p *params) float32 { return p.s }),
	).Pack(&params{x: buf.Ptr(), n: int32(len(x)), s: 2})
	if err := dev.Launch(f, [3]uint32{1, 1, 1}, [3]uint32{256, 1, 1}, 0, nil, args); err != nil {
		log.Fatal(err)
	}
	if err := dev.CopyFromDevice(cuda.AsBytes(x), buf, 0); err != nil {
		log.Fatal(err)
	}
	fmt.Println(x, mod.Stats.CacheHit)
}

// This example page-locks a Go slice so that an asynchronous copy reads it
// in place by DMA, and unlocks it once the stream has run the copy. It
// prints nothing on a machine without a GPU.
func ExampleDevice_RegisterHost() {
	dev, err := cuda.Open(0)
	if cuda.Unavailable(err) {
		return
	} else if err != nil {
		log.Fatal(err)
	}
	defer dev.Close()
	s, err := dev.NewStream()
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()

	x := make([]float32, 1<<20)
	for i := range x {
		x[i] = float32(i)
	}
	reg, err := dev.RegisterHost(cuda.AsBytes(x))
	if err != nil {
		log.Fatal(err)
	}
	buf, err := dev.Alloc(int64(4 * len(x)))
	if err != nil {
		log.Fatal(err)
	}
	defer buf.Free()
	if err := dev.CopyToDeviceAsync(buf, 0, cuda.AsBytes(x), s); err != nil {
		log.Fatal(err)
	}
	// x must stay unchanged and locked until the copy has run.
	if err := s.Synchronize(); err != nil {
		log.Fatal(err)
	}
	if err := reg.Unregister(); err != nil {
		log.Fatal(err)
	}
	back := make([]float32, len(x))
	if err := dev.CopyFromDevice(cuda.AsBytes(back), buf, 0); err != nil {
		log.Fatal(err)
	}
	fmt.Println(back[len(back)-1])
}
