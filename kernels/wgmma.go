package kernels

import (
	"fmt"
	"strings"

	"github.com/flashattn/flashattn/attn"
)

// Warpgroup matrix products (sm_90a). A warpgroup is four consecutive warps
// (128 threads) starting at a warp index divisible by 4; wgmma.mma_async
// multiplies a 64×16 A tile by a 16×N B tile into a 64×N fp32 accumulator
// spread over the warpgroup's registers: thread (warp w, lane 4g + c) holds,
// for every 8-column block j, rows 16w + g and 16w + g + 8, columns 8j + 2c and
// 8j + 2c + 1, exactly the C layout of mma.sync m16n8 repeated N/8 times. A
// comes from shared memory (a matrix descriptor) or from registers (then in
// the A layout of mma.sync m16n8k16 per warp); B always from shared memory.
//
// The products are asynchronous: wgmma.fence orders earlier register writes
// before them, commit_group closes a group, wait_group N waits until at most
// N groups are pending. ptxas allocates the registers and knows that the
// accumulators and A registers of a product in flight stay live until its
// wait; the empty asm statements of fence_acc keep the compiler from moving
// accumulator accesses across the product.

// wgmmaPrimitives returns the descriptor, fence, commit and wait wrappers.
func wgmmaPrimitives() string {
	return `// ---- warpgroup matrix products (sm_90a)
// Shared-memory matrix descriptor of a tile stored with the 128-byte swizzle (16-byte chunk c of
// the 128-byte row r of each 1024-byte-aligned atom at chunk c ^ (r mod 8)): start address, leading
// and stride byte offsets (each >> 4), swizzle mode 1 (128 B) in bits 62-63.
DEV u64 sw128_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3ffffu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}
DEV void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
DEV void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> DEV void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// shared memory written through the generic proxy (cp.async, st.shared) before the async proxy
// (wgmma) reads it: each writing thread fences, then the CTA synchronizes
DEV void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// hide a value from the optimizer: what is computed from it is computed after this point (keeps
// loop-invariant descriptor sums from being hoisted into registers for the whole loop)
DEV void opaque(u64& v) { asm volatile("" : "+l"(v)); }
// pin an accumulator's registers so that no access moves across a product in flight
template <int NT> DEV void fence_acc(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
`
}

// WGMMAProduct describes one warpgroup product wrapper of a generated
// module: D[64×N] (+)= A[64×16]·B[16×N] on an accumulator d[N/8][4]. TA
// and TB say that the operand is stored transposed (A M-major: k rows of m;
// B N-major: k rows of n) rather than K-major; RegA that A comes from
// registers (Name(d, a, db), always accumulating, B read N-major) rather
// than through a descriptor (Name(d, da, db, acc)).
type WGMMAProduct struct {
	Name         string
	N            int
	TA, TB, RegA bool
}

// source returns the wrapper's CUDA source for 16-bit elements dt.
func (p WGMMAProduct) source(dt attn.DType) string {
	if p.RegA {
		return wgmmaRS(p.Name, dt, p.N)
	}
	return wgmmaSST(p.Name, dt, p.N, p.TA, p.TB)
}

// wgmmaTypeSuffix returns the PTX input type of a 16-bit element type.
func wgmmaTypeSuffix(dt attn.DType) string {
	if dt == attn.Float16 {
		return "f16"
	}
	return "bf16"
}

// accOperands returns the "+f" operand list of an N-column accumulator
// d[N/8][4] and the matching "%0, ..., %(N/2-1)" register list.
func accOperands(n int) (ops, regs string) {
	var o, r []string
	for j := 0; j < n/8; j++ {
		for e := 0; e < 4; e++ {
			o = append(o, fmt.Sprintf(`"+f"(d[%d][%d])`, j, e))
			r = append(r, fmt.Sprintf("%%%d", 4*j+e))
		}
	}
	return strings.Join(o, ", "), strings.Join(r, ", ")
}

// wgmmaSST returns name(d, da, db, acc): d[64×n] (= or +=, acc ≠ 0 adds)
// A·B with A (64×16) and B (16×n) both read through shared-memory
// descriptors, each K-major or stored transposed: tA, A M-major (k rows of
// m contiguous elements); tB, B N-major (k rows of n).
func wgmmaSST(name string, dt attn.DType, n int, tA, tB bool) string {
	ops, regs := accOperands(n)
	k := n / 2
	ty := wgmmaTypeSuffix(dt)
	major := func(t bool, mn string) string {
		if t {
			return mn + "-major"
		}
		return "K-major"
	}
	return fmt.Sprintf(`// D[64x%[1]d] (+)= A[64x16] · B[16x%[1]d], A (%[10]s) and B (%[11]s) from shared memory; acc = 0 overwrites D
DEV void %[2]s(float (&d)[%[3]d][4], u64 da, u64 db, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %%%[6]d, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n%[1]dk16.f32.%[7]s.%[7]s {%[4]s}, %%%[8]d, %%%[9]d, p, 1, 1, %[12]d, %[13]d;\n}\n"
               : %[5]s
               : "l"(da), "l"(db), "r"(acc));
}
`, n, name, n/8, regs, ops, k+2, ty, k, k+1, major(tA, "M"), major(tB, "N"), b2i(tA), b2i(tB))
}

// wgmmaRS returns name(d, a, db): d[64×n] += A·B with A (64×16) from
// registers (four per thread, the mma.sync A layout per warp) and B (16×n)
// from shared memory stored N-major (k rows of n contiguous elements), read
// transposed.
func wgmmaRS(name string, dt attn.DType, n int) string {
	ops, regs := accOperands(n)
	k := n / 2
	ty := wgmmaTypeSuffix(dt)
	return fmt.Sprintf(`// D[64x%[1]d] += A[64x16] · B[16x%[1]d], A from registers, B from shared memory stored N-major (transposed read)
DEV void %[2]s(float (&d)[%[3]d][4], const u32 (&a)[4], u64 db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %%%[6]d, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n%[1]dk16.f32.%[7]s.%[7]s {%[4]s}, {%%%[8]d, %%%[9]d, %%%[10]d, %%%[11]d}, %%%[12]d, p, 1, 1, 1;\n}\n"
               : %[5]s
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
`, n, name, n/8, regs, ops, k+5, ty, k, k+1, k+2, k+3, k+4)
}
