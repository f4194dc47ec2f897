package gpu

import (
	"fmt"
	"sync"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// fillArgs is the fill kernel's argument: the span to fill, its element
// count, the seed and the element type.
type fillArgs struct {
	p, n, seed uint64
	dtype      attn.DType
}

// fillArgsStruct is the layout of fillArgs, declared in fillSource.
var fillArgsStruct = kernels.NewCStruct("FillArgs", 0,
	kernels.CU64("u64", "p", "", func(a *fillArgs) uint64 { return a.p }),
	kernels.CU64("u64", "n", "", func(a *fillArgs) uint64 { return a.n }),
	kernels.CU64("u64", "seed", "", func(a *fillArgs) uint64 { return a.seed }),
	kernels.CI32("int", "dtype", "", func(a *fillArgs) int32 { return int32(a.dtype) }),
	kernels.CI32("int", "pad", "", func(*fillArgs) int32 { return 0 }),
)

// fillSource fills device memory with the pseudo-random values of
// FillValue (one thread per element, grid-stride).
var fillSource = `
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
` + fillArgsStruct.OneLineDecl() + `
static __device__ __forceinline__ float fill_value(u64 i, u64 seed, int bits) {
  u64 h = (i ^ seed) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  const int r = (int)(h >> (64 - bits));
  return (float)(2 * r - ((1 << bits) - 1)) / (float)(1 << bits);
}
// dtype: 0 fp32, 1 fp16, 2 bf16 (attn.DType)
extern "C" __global__ void fill_random(const FillArgs a) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += stride) {
    if (a.dtype == 0) {
      ((float*)a.p)[i] = fill_value(i, a.seed, 10);
    } else if (a.dtype == 1) {
      u16 h;
      asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(fill_value(i, a.seed, 10)));
      ((u16*)a.p)[i] = h;
    } else {
      ((u16*)a.p)[i] = (u16)(__float_as_uint(fill_value(i, a.seed, 7)) >> 16);
    }
  }
}
`

// FillValue returns the value FillRandom writes at element i (counted from
// the tensor's first element) for seed: an odd multiple of 2^-10 (2^-7 for
// bf16) in (−1, 1), exactly representable in dt, never zero.
func FillValue(dt attn.DType, seed uint64, i int64) float32 {
	bits := 10
	if dt == attn.BFloat16 {
		bits = 7
	}
	h := (uint64(i) ^ seed) * 0x9E3779B97F4A7C15
	h ^= h >> 29
	h *= 0xBF58476D1CE4E5B9
	h ^= h >> 32
	r := int(h >> (64 - bits))
	return float32(2*r-(1<<bits-1)) / float32(int(1)<<bits)
}

type filler struct {
	once sync.Once
	fn   *cuda.Function
	err  error
}

// FillRandom enqueues on s the fill of the storage span of t (from its first
// to its last element, gaps included) with FillValue(t.DType, seed, i).
func (b *Backend) FillRandom(s *cuda.Stream, t DeviceTensor, seed uint64) error {
	if t.NumElements() == 0 {
		return nil
	}
	b.fill.once.Do(func() {
		mod, err := b.dev.Compile(cuda.CompileRequest{Name: "fill_random.cu", Source: fillSource})
		if err != nil {
			b.fill.err = fmt.Errorf("gpu: compile fill kernel: %w", err)
			return
		}
		b.fill.fn, b.fill.err = mod.Function("fill_random")
	})
	if b.fill.err != nil {
		return b.fill.err
	}
	if err := t.check("fill", t.DType, len(t.Shape), false); err != nil {
		return err
	}
	st := t.strides()
	n := int64(1)
	for d, sz := range t.Shape {
		n += int64(sz-1) * int64(st[d])
	}
	args := fillArgsStruct.Pack(&fillArgs{p: t.ptr(), n: uint64(n), seed: seed, dtype: t.DType})
	blocks := uint32(min((n+255)/256, 65535*4))
	return b.dev.Launch(b.fill.fn, [3]uint32{blocks, 1, 1}, [3]uint32{256, 1, 1}, 0, s, args)
}
