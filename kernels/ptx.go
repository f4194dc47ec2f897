package kernels

import (
	"fmt"
	"strings"

	"github.com/flashattn/flashattn/attn"
)

// cTypes is the start of every generated module: short integer type names
// and DEV, the qualifier of every device function.
const cTypes = `typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

#define DEV static __device__ __forceinline__
`

// The functions below write the inline-PTX wrappers both generators use,
// each under the name its generator (and the host emulator standing in for
// it) gives it. They need cTypes.

// ptxEx2 returns name(x) = 2^x (ex2.approx.ftz.f32).
func ptxEx2(name string) string {
	return fmt.Sprintf("DEV float %s(float x) { float y; asm(\"ex2.approx.ftz.f32 %%0, %%1;\" : \"=f\"(y) : \"f\"(x)); return y; }\n", name)
}

// tanhApprox is the name of the hardware tanh wrapper (ptxTanh) in every
// module that has it; the host emulator defines a function of that name.
const tanhApprox = "tanh_approx"

// ptxTanh returns tanh_approx(x) = tanh(x) by tanh.approx.f32 (sm_75 and
// later; PTX ISA, "Floating Point Instructions: tanh": maximum relative
// error 2^-11 over the whole range, subnormal inputs passed through,
// ±Inf to ±1, NaN to NaN). The asm is volatile so that each call stays
// where the generator put it, between its score and its uses: moved by
// the compiler, the calls cost the register-bound backward variants spills
// (NVRTC 12.4, sm_90a, bf16 D = 128 with a window, softcap, bias, dBias
// and dropout: 488 bytes, 136 volatile; docs/kernels/backward.md).
func ptxTanh() string {
	return "// tanh by the hardware approximation (relative error at most 2^-11): bf16's softcap\n" +
		"DEV float " + tanhApprox + "(float x) { float y; asm volatile(\"tanh.approx.f32 %0, %1;\" : \"=f\"(y) : \"f\"(x)); return y; }\n"
}

// warpIndex is the C++ expression of the calling thread's warp index (tid:
// its index in the block), broadcast from the warp's lane 0 by a shuffle
// that every lane of the warp must reach. The value is tid >> 5; the
// broadcast tells the compiler that it is the same across the warp, so that
// it keeps the warp and warpgroup indices and what derives from them (the
// warpgroup products' matrix descriptors above all) in uniform registers
// instead of computing them per lane and converting them before every
// product.
const warpIndex = "__shfl_sync(0xffffffffu, tid >> 5, 0)"

// softcapTanh returns the function the kernels of element type dt apply
// in the softcap s → c·tanh(s/c), the same in the forward, the backward and
// their non-finite paths, so that the backward's recomputed P matches the
// forward's LSE. bf16 takes the hardware approximation (ptxTanh): its
// bound, 2^-11 relative, is an eighth of the unit roundoff (2^-8) to which
// the naive baseline rounds each softcapped score. fp16 and fp32 take
// CUDA's tanhf (a few ulps): fp16's unit roundoff is 2^-11 itself, and
// with a tanh at that bound the forward's LSE missed the criterion
// (twice the naive error, row by row) at a score near 20
// (docs/kernels/forward.md, "Softcap"); fp32's criterion is relative to
// naive fp32 arithmetic.
func softcapTanh(dt attn.DType) string {
	if dt == attn.BFloat16 {
		return tanhApprox
	}
	return "tanhf"
}

// ptxLdmatrixDoc describes the ldmatrix wrappers.
const ptxLdmatrixDoc = "// ldmatrix: four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.\n"

// ptxLdmatrix returns name(r, addr): ldmatrix of n (2 or 4) 8x8 b16
// matrices from shared address addr, transposed when trans, into r[n] or,
// when scalars, into the references r0..r(n-1).
func ptxLdmatrix(name string, n int, trans, scalars bool) string {
	var params, regs, outs []string
	for i := 0; i < n; i++ {
		r := fmt.Sprintf("r[%d]", i)
		if scalars {
			r = fmt.Sprintf("r%d", i)
			params = append(params, "u32& "+r)
		}
		regs = append(regs, fmt.Sprintf("%%%d", i))
		outs = append(outs, fmt.Sprintf("\"=r\"(%s)", r))
	}
	if !scalars {
		params = []string{fmt.Sprintf("u32 (&r)[%d]", n)}
	}
	tr := ""
	if trans {
		tr = ".trans"
	}
	return fmt.Sprintf(`DEV void %s(%s, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x%d%s.shared.b16 {%s}, [%%%d];\n"
               : %s : "r"(addr));
}
`, name, strings.Join(params, ", "), n, tr, strings.Join(regs, ","), n, strings.Join(outs, ", "))
}

// ptxStmatrixTrans is the device function stsm_x4_t(addr, r0, r1, r2,
// r3): stmatrix of four 8x8 b16 matrices, transposed, into shared memory;
// lanes 8i..8i+7 give the row addresses of stored matrix i, and each
// lane's register ri holds row lane/4, columns 2(lane%4) and +1 of matrix
// i as a fragment, which lands as that column of the stored rows.
const ptxStmatrixTrans = `// stmatrix .trans: register fragment i (row lane/4, columns 2(lane%4), +1) stored transposed as the
// 8x8 b16 matrix whose rows lanes 8i..8i+7 address (16 bytes each).
DEV void stsm_x4_t(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
`

// ptxMMA returns name(d, a, b0, b1): d += a·b on the tensor cores with fp32
// accumulators; m16n8k16 for fp16 and bf16 inputs, m16n8k8 tf32 for fp32.
func ptxMMA(name string, dt attn.DType) string {
	shape, ty, doc := "m16n8k8", "tf32", "A[16x8] · B[8x8], tf32"
	switch dt {
	case attn.BFloat16:
		shape, ty, doc = "m16n8k16", "bf16", "A[16x16] · B[16x8], bf16"
	case attn.Float16:
		shape, ty, doc = "m16n8k16", "f16", "A[16x16] · B[16x8], f16"
	}
	return fmt.Sprintf(`// D[16x8] += %[3]s inputs, fp32 accumulators
DEV void %[4]s(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.%[1]s.row.col.f32.%[2]s.%[2]s.f32 {%%0,%%1,%%2,%%3}, {%%4,%%5,%%6,%%7}, {%%8,%%9}, {%%0,%%1,%%2,%%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
`, shape, ty, doc, name)
}

// ptxTF32Split returns name(x, hi, lo), the split x = hi + lo with
// hi = tf32(x) and lo = tf32(x - hi); x is a float, or its bits when bits.
func ptxTF32Split(name string, bits bool) string {
	param, x := "float x", "x"
	if bits {
		param, x = "u32 x", "__uint_as_float(x)"
	}
	return fmt.Sprintf(`// split-tf32: x = hi + lo with hi = tf32(x), lo = tf32(x - hi)
DEV void %s(%s, u32& hi, u32& lo) {
  asm("cvt.rna.tf32.f32 %%0, %%1;" : "=r"(hi) : "f"(%s));
  const float r = %s - __uint_as_float(hi);
  asm("cvt.rna.tf32.f32 %%0, %%1;" : "=r"(lo) : "f"(r));
}
`, name, param, x, x)
}

// mmaSplitTF32 returns name(d, ah, al, bh0, bh1, bl0, bl1): d += a·b in
// split-tf32 through the m16n8k8 wrapper mma (three products, the small
// terms first). It holds no PTX of its own.
func mmaSplitTF32(name, mma string) string {
	return fmt.Sprintf(`// D += A·B in split-tf32: lo·hi + hi·lo + hi·hi (the small terms first)
DEV void %[1]s(float (&d)[4], const u32 (&ah)[4], const u32 (&al)[4], u32 bh0, u32 bh1, u32 bl0, u32 bl1) {
  %[2]s(d, al, bh0, bh1);
  %[2]s(d, ah, bl0, bl1);
  %[2]s(d, ah, bh0, bh1);
}
`, name, mma)
}

// cpAsync describes one cp.async wrapper.
type cpAsync struct {
	name    string
	bytes   int  // 4, 8 or 16 bytes per copy (16 bypasses L1: .cg)
	generic bool // dst is a generic pointer into shared memory (converted with smem_u32), else a shared address
	zfill   bool // a source-size operand n: bytes past n are zero-filled
	memory  bool // a "memory" clobber orders the copy against the compiler's shared-memory accesses
}

// ptxCpAsync returns the wrapper c.
func ptxCpAsync(c cpAsync) string {
	cache := "ca"
	if c.bytes == 16 {
		cache = "cg"
	}
	params, ops, args := "u32 dst, const void* src", "[%0], [%1], ", `"r"(dst), "l"(src)`
	if c.generic {
		params, args = "void* dst, const void* src", `"r"(smem_u32(dst)), "l"(src)`
	}
	ops += fmt.Sprint(c.bytes)
	if c.zfill {
		params += ", u32 n"
		ops += ", %2"
		args += `, "r"(n)`
	}
	return fmt.Sprintf("DEV void %s(%s) {\n  asm volatile(\"cp.async.%s.shared.global %s;\\n\" ::%s%s);\n}\n",
		c.name, params, cache, ops, args, clobber(c.memory))
}

// ptxCpCommit returns name(), which commits the pending cp.async copies as
// one group.
func ptxCpCommit(name string, memory bool) string {
	return fmt.Sprintf("DEV void %s() { asm volatile(\"cp.async.commit_group;\\n\" ::%s); }\n", name, clobber(memory))
}

// ptxCpWait returns name(), which waits until at most n committed groups
// are pending; n < 0 makes it a template on N.
func ptxCpWait(name string, n int, memory bool) string {
	if n < 0 {
		return fmt.Sprintf("template <int N> DEV void %s() { asm volatile(\"cp.async.wait_group %%0;\\n\" ::\"n\"(N)%s); }\n", name, clobber(memory))
	}
	return fmt.Sprintf("DEV void %s() { asm volatile(\"cp.async.wait_group %d;\\n\" ::%s); }\n", name, n, clobber(memory))
}

// bitsToF32 are the device functions that read the bits of a bf16 or
// fp16 element as a float (bf16_to_f32, f16_to_f32).
const bitsToF32 = `DEV float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
DEV float f16_to_f32(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
`

// bitsToF32Func returns the bitsToF32 function that converts the bits of
// a 16-bit bias of kind b.
func bitsToF32Func(b BiasKind) string {
	if b == BiasF16 {
		return "f16_to_f32"
	}
	return "bf16_to_f32"
}

// ptxPrefetchL1 returns name(p), a hint that brings the cache line at
// global address p into L1 (prefetch.global.L1): no register waits for it.
func ptxPrefetchL1(name string) string {
	return fmt.Sprintf("DEV void %s(const void* p) { asm volatile(\"prefetch.global.L1 [%%0];\\n\" ::\"l\"(p)); }\n", name)
}

// clobber returns the clobber list of an asm statement with operands.
func clobber(memory bool) string {
	if memory {
		return ` : "memory"`
	}
	return ""
}
