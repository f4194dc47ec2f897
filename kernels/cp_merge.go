package kernels

import (
	"fmt"
	"math/bits"

	"github.com/flashattn/flashattn/attn"
)

// The merge kernels of context parallelism. A forward split over key
// blocks (a ring step's blocks) gives, for each block, a partial O of the
// attention dtype and its LSE; they fold into a float32 accumulator
// through their LSE with the overflow-safe formula of package cp's host
// merge, O = w1·O1 + w2·O2 with w_x = exp(LSE_x − LSE) and LSE = m +
// log(exp(LSE1 − m) + exp(LSE2 − m)), m = max(LSE1, LSE2), the row
// scalars in double precision. A backward split over key blocks gives
// partial gradients that add up in a float32 accumulator. One module per
// element type holds five kernels that share one argument (MergeParams):
//
//   - MergeResetKernel: accumulator rows set to O = 0 and LSE = −inf (no key
//     seen yet), or to 0 for a gradient accumulator (no LSE);
//   - MergeKernel: a partial forward result merged into accumulator rows;
//   - MergeAddKernel: a partial gradient added into accumulator rows;
//   - MergeFinishKernel: accumulator rows rounded to the element type (and
//     their LSE copied), the result of the whole call;
//   - MergeCombineKernel: every partial forward result of a call at once
//     (slots of one tensor) folded into the finished result, without an
//     accumulator: each partial is read once and nothing float32 is
//     written.
//
// The LSE is the natural-log one the forward kernels write (LSE =
// (max·scale·log2 e + log2 l)·ln 2, −inf for a row that saw no key).

// Names of the merge kernels (MergeSource).
const (
	MergeResetKernel   = "fa_cp_reset"
	MergeKernel        = "fa_cp_merge"
	MergeAddKernel     = "fa_cp_add"
	MergeFinishKernel  = "fa_cp_finish"
	MergeCombineKernel = "fa_cp_combine"
)

// MergeKernels lists the kernels of a merge module.
var MergeKernels = []string{MergeResetKernel, MergeKernel, MergeAddKernel, MergeFinishKernel, MergeCombineKernel}

// MergeThreads is the block size of the merge kernels.
const MergeThreads = 256

// MergeChunk is the number of consecutive feature elements one thread of a
// merge kernel handles.
const MergeChunk = 8

// MergeParams are the arguments of the merge kernels; MergeParams.Pack
// gives the C struct's layout. Every tensor is addressed by element
// strides, its feature dim contiguous: src [B, Rows, H, D] of the element
// type and its LSE [B, H, Rows] (float32), the float32 accumulator [B, n,
// H, D] and its LSE [B, H, n], whose row R0+i pairs with row i of src and
// dst, and dst [B, Rows, H, D] of the element type with its LSE [B, H,
// Rows]. MergeCombineKernel reads Slots partial results: slot k is src
// and its LSE moved by k·SlotStride and k·SlotLSEStride elements. A kernel
// reads and writes only the tensors it names (see MergeSource); the others
// may be 0.
type MergeParams struct {
	Src, SrcLSE, Acc, AccLSE, Dst, DstLSE uint64 // device addresses of element 0 (AccLSE 0: a gradient accumulator)
	// Strides in elements: batch, row, head for the [B, rows, H, D]
	// tensors; batch, head, row for the LSEs.
	SrcStrides, SrcLSEStrides, AccStrides, AccLSEStrides, DstStrides, DstLSEStrides [3]int64
	SlotStride, SlotLSEStride                                                       int64 // elements between slots (combine)
	B, Rows, H, D, R0                                                               int32
	Slots                                                                           int32 // partial results (combine)
	// Shift is log2 of the threads per row (MergeLaunch); Vec selects whole
	// 16-byte loads and stores (every row of every tensor 16-byte aligned,
	// D a multiple of MergeChunk).
	Shift int32
	Vec   bool
}

// mergeParamsStruct is the layout of the C struct MergeParams.
var mergeParamsStruct = func() *CStruct[MergeParams] {
	type P = MergeParams
	ptr := func(ctype, name, doc string, get func(*P) uint64) CField[P] { return CPtr(ctype, name, doc, get) }
	str := func(name, doc string, get func(*P) *[3]int64) []CField[P] {
		return []CField[P]{
			CI64("long long", name+"_sb", "", func(p *P) int64 { return get(p)[0] }),
			CI64("long long", name+"_s1", "", func(p *P) int64 { return get(p)[1] }).Joined(),
			CI64("long long", name+"_s2", doc, func(p *P) int64 { return get(p)[2] }).Joined(),
		}
	}
	fields := []CField[P]{
		ptr("const T*", "src", "[B, rows, H, D]: a partial O or gradient", func(p *P) uint64 { return p.Src }),
		ptr("const float*", "src_lse", "[B, H, rows]: the partial O's LSE", func(p *P) uint64 { return p.SrcLSE }),
		ptr("float*", "acc", "[B, n, H, D]: the accumulator", func(p *P) uint64 { return p.Acc }),
		ptr("float*", "acc_lse", "[B, H, n]: its LSE (null: a gradient accumulator)", func(p *P) uint64 { return p.AccLSE }),
		ptr("T*", "dst", "[B, rows, H, D]: the finished result", func(p *P) uint64 { return p.Dst }),
		ptr("float*", "dst_lse", "[B, H, rows]: its LSE", func(p *P) uint64 { return p.DstLSE }),
	}
	fields = append(fields, str("src", "strides (elements): batch, row, head", func(p *P) *[3]int64 { return &p.SrcStrides })...)
	fields = append(fields, str("src_lse", "batch, head, row", func(p *P) *[3]int64 { return &p.SrcLSEStrides })...)
	fields = append(fields, str("acc", "batch, row, head", func(p *P) *[3]int64 { return &p.AccStrides })...)
	fields = append(fields, str("acc_lse", "batch, head, row", func(p *P) *[3]int64 { return &p.AccLSEStrides })...)
	fields = append(fields, str("dst", "batch, row, head", func(p *P) *[3]int64 { return &p.DstStrides })...)
	fields = append(fields, str("dst_lse", "batch, head, row", func(p *P) *[3]int64 { return &p.DstLSEStrides })...)
	fields = append(fields,
		CI64("long long", "slot_s", "", func(p *P) int64 { return p.SlotStride }),
		CI64("long long", "slot_lse_s", "elements between the slots of src and src_lse (combine)", func(p *P) int64 { return p.SlotLSEStride }).Joined(),
	)
	fields = append(fields,
		CI32("int", "b", "", func(p *P) int32 { return p.B }),
		CI32("int", "rows", "", func(p *P) int32 { return p.Rows }).Joined(),
		CI32("int", "h", "", func(p *P) int32 { return p.H }).Joined(),
		CI32("int", "d", "", func(p *P) int32 { return p.D }).Joined(),
		CI32("int", "r0", "accumulator row of row 0", func(p *P) int32 { return p.R0 }).Joined(),
		CI32("int", "slots", "partial results (combine)", func(p *P) int32 { return p.Slots }),
		CI32("int", "shift", "log2 threads per row", func(p *P) int32 { return p.Shift }),
		CI32("int", "vec", "16-byte loads and stores", func(p *P) int32 {
			if p.Vec {
				return 1
			}
			return 0
		}).Joined(),
	)
	s := NewCStruct("MergeParams", 0, fields...)
	s.TypeWidth, s.DocColumn = 12, 52
	return s
}()

// Pack returns the params in the layout of the C struct MergeParams.
func (p MergeParams) Pack() []byte { return mergeParamsStruct.Pack(&p) }

// MergeLaunch returns the number of blocks of a merge kernel over rows ×
// heads × batch rows of d elements (the grid's x; 0: nothing to launch)
// and the Shift of its parameters: each row takes the least power of two
// of threads that covers its ceil(d/MergeChunk) chunks, MergeThreads/2^shift
// rows to a block.
func MergeLaunch(batch, rows, heads, d int) (blocks int64, shift int32) {
	chunks := max(1, (d+MergeChunk-1)/MergeChunk)
	shift = int32(bits.Len(uint(chunks - 1)))
	perBlock := int64(MergeThreads >> shift)
	n := int64(batch) * int64(rows) * int64(heads)
	return (n + perBlock - 1) / perBlock, shift
}

// MergeMaxD is the largest feature dim the merge kernels take: a row's
// chunks fit one block.
const MergeMaxD = MergeThreads * MergeChunk

// MergeSource returns the CUDA source of the merge module for element type
// dt (of the partial results and the finished ones; accumulators and LSEs
// are float32). It fails with an error wrapping attn.ErrDType for a type
// the kernels do not take.
func MergeSource(dt attn.DType) (string, error) {
	if dt != attn.Float32 && dt != attn.Float16 && dt != attn.BFloat16 {
		return "", attn.Errorf(attn.ErrDType, "merge kernels: element type %v", dt)
	}
	var include string
	switch dt {
	case attn.Float16:
		include = "#include <cuda_fp16.h>\n"
	case attn.BFloat16:
		include = "#include <cuda_bf16.h>\n"
	}
	return fmt.Sprintf(mergeTemplate, dt, include, bwdCType(dt), bwdConvFuncs("t", dt), PrimitivesBegin, PrimitivesEnd,
		mergeParamsStruct.Decl(), mergeParamsStruct.SizeAssert(), MergeThreads, MergeChunk,
		MergeResetKernel, MergeKernel, MergeAddKernel, MergeFinishKernel, cTypes, MergeCombineKernel), nil
}

// mergeTemplate is the merge module: %[1]v the element type, %[2]s its
// header, %[3]s its C type, %[4]s its conversions, %[5]s and %[6]s the
// (empty) primitives block, %[7]s and %[8]s the parameter struct, %[9]d
// MergeThreads, %[10]d MergeChunk, %[11]s … %[14]s and %[16]s the kernel names,
// %[15]s the basic types.
const mergeTemplate = `// flashattn context-parallel merge kernels, element type %[1]v.
// Generated by package kernels (cp_merge.go).
//
// Tensors (strides in elements; the feature dim D contiguous):
//   src     [B, rows, H, D]  T      a partial result of rows [0, rows): one key block's O, or a gradient
//   src_lse [B, H, rows]     float  the partial O's LSE (natural log; -inf: the row saw no key there)
//   acc     [B, n, H, D]     float  the accumulator; its row r0 + i pairs with row i of src and dst
//   acc_lse [B, H, n]        float  the accumulator's LSE (-inf: no key yet); null for a gradient
//   dst     [B, rows, H, D]  T      the finished result
//   dst_lse [B, H, rows]     float  its LSE
//   slots   src and src_lse moved by k·slot_s and k·slot_lse_s: partial result k of a combine
// Threads: one thread per chunk of %[10]d consecutive elements of a row (b, i, h), 2^shift threads
// per row (the least power of two covering ceil(D/%[10]d) chunks), %[9]d/2^shift rows per block, the
// rows ordered (b, h, i) so that the LSEs of a block's rows are consecutive in memory.
%[2]s
%[15]stypedef %[3]s T;
%[4]s#define NEG_INF __int_as_float(0xff800000)
#define MERGE_THREADS %[9]d
#define CHUNK %[10]d
%[5]s
%[6]s
%[7]s%[8]s
// MergeRow is one thread's place: row (b, h, i) of the launch, its chunk c of CHUNK elements (n of
// them inside D), and ok when both exist.
struct MergeRow {
  bool ok;
  int b, h, i, c, n;
};

DEV MergeRow merge_row(const MergeParams& p) {
  const int per = 1 << p.shift;  // threads per row
  const i64 row = (i64)blockIdx.x * (MERGE_THREADS >> p.shift) + (threadIdx.x >> p.shift);
  MergeRow r;
  r.c = (int)(threadIdx.x & (per - 1));
  r.n = min(CHUNK, p.d - CHUNK * r.c);
  r.ok = row < (i64)p.b * p.h * p.rows && r.n > 0;
  const i64 t = row / p.rows;  // (b, h)
  r.i = (int)(row - t * p.rows);
  r.h = (int)(t %% p.h);
  r.b = (int)(t / p.h);
  return r;
}

// load_chunk reads the n elements of a chunk at p as floats: whole 16-byte loads when vec (then n is
// CHUNK and p 16-byte aligned), element by element otherwise (x zero past n).
template <class E, class Cvt>
DEV void load_chunk(const E* p, int n, bool vec, float (&x)[CHUNK], Cvt cvt) {
  if (vec) {
    __align__(16) E v[CHUNK];
#pragma unroll
    for (int k = 0; k < (int)(CHUNK * sizeof(E) / 16); k++) reinterpret_cast<uint4*>(v)[k] = reinterpret_cast<const uint4*>(p)[k];
#pragma unroll
    for (int j = 0; j < CHUNK; j++) x[j] = cvt(v[j]);
    return;
  }
#pragma unroll
  for (int j = 0; j < CHUNK; j++) x[j] = j < n ? cvt(p[j]) : 0.f;
}

// store_chunk writes the n floats of a chunk at p, converted by cvt, as load_chunk reads them.
template <class E, class Cvt>
DEV void store_chunk(E* p, int n, bool vec, const float (&x)[CHUNK], Cvt cvt) {
  if (vec) {
    __align__(16) E v[CHUNK];
#pragma unroll
    for (int j = 0; j < CHUNK; j++) v[j] = cvt(x[j]);
#pragma unroll
    for (int k = 0; k < (int)(CHUNK * sizeof(E) / 16); k++) reinterpret_cast<uint4*>(p)[k] = reinterpret_cast<const uint4*>(v)[k];
    return;
  }
  for (int j = 0; j < n; j++) p[j] = cvt(x[j]);
}

// The conversions load_chunk and store_chunk apply: T to float, float to float, float to T.
struct FromT {
  __device__ __forceinline__ float operator()(T x) const { return t_to_f(x); }
};
struct Same {
  __device__ __forceinline__ float operator()(float x) const { return x; }
};
struct ToT {
  __device__ __forceinline__ T operator()(float x) const { return t_from_f(x); }
};

// The addresses of a thread's chunk in the [B, rows, H, D] tensors and of its row's LSEs.
#define SRC(r) (p.src + (i64)(r).b * p.src_sb + (i64)(r).i * p.src_s1 + (i64)(r).h * p.src_s2 + CHUNK * (r).c)
#define ACC(r) (p.acc + (i64)(r).b * p.acc_sb + (i64)(p.r0 + (r).i) * p.acc_s1 + (i64)(r).h * p.acc_s2 + CHUNK * (r).c)
#define DST(r) (p.dst + (i64)(r).b * p.dst_sb + (i64)(r).i * p.dst_s1 + (i64)(r).h * p.dst_s2 + CHUNK * (r).c)
#define SRC_LSE(r) (p.src_lse + (i64)(r).b * p.src_lse_sb + (i64)(r).h * p.src_lse_s1 + (i64)(r).i * p.src_lse_s2)
#define ACC_LSE(r) (p.acc_lse + (i64)(r).b * p.acc_lse_sb + (i64)(r).h * p.acc_lse_s1 + (i64)(p.r0 + (r).i) * p.acc_lse_s2)
#define DST_LSE(r) (p.dst_lse + (i64)(r).b * p.dst_lse_sb + (i64)(r).h * p.dst_lse_s1 + (i64)(r).i * p.dst_lse_s2)

// %[11]s: accumulator rows [r0, r0 + rows) set to 0, their LSE (when acc_lse is set) to -inf.
extern "C" __global__ void __launch_bounds__(MERGE_THREADS) %[11]s(const MergeParams p) {
  const MergeRow r = merge_row(p);
  if (!r.ok) return;
  float z[CHUNK];
#pragma unroll
  for (int j = 0; j < CHUNK; j++) z[j] = 0.f;
  store_chunk(ACC(r), r.n, p.vec, z, Same());
  if (p.acc_lse && r.c == 0) *ACC_LSE(r) = NEG_INF;
}

// %[12]s: the partial result src (O of one key block) and its LSE merged into accumulator rows
// [r0, r0 + rows). A partial row whose LSE is -inf saw no key and leaves its row as it was; an
// accumulator row still at -inf takes the partial row as it is; otherwise, with l1 the accumulator's
// LSE and l2 the partial's, in double precision:
//   m = max(l1, l2), e_x = exp(l_x - m) <= 1, s = e1 + e2,
//   O = (e1/s)·O_acc + (e2/s)·O_src, LSE = m + log(s),
// the weights e_x/s being exp(l_x - LSE). One of e1, e2 is exp(0) = 1, so one exponential does:
// d = (l1 - m) + (l2 - m) is the other's exponent, -|l1 - l2|, and NaN where either LSE is NaN or
// m is +inf (inf - inf), as the formula gives. Nothing overflows for any gap between the LSEs, and a
// NaN (in an LSE or in O) stays NaN.
extern "C" __global__ void __launch_bounds__(MERGE_THREADS) %[12]s(const MergeParams p) {
  const MergeRow r = merge_row(p);
  // every thread of a row reads both LSEs before the row's first thread writes the new one
  float l1 = NEG_INF, l2 = NEG_INF;
  if (r.ok) {
    l2 = *SRC_LSE(r);
    l1 = *ACC_LSE(r);
  }
  __syncthreads();
  if (!r.ok || l2 == NEG_INF) return;
  float x[CHUNK];
  load_chunk(SRC(r), r.n, p.vec, x, FromT());
  float* a = ACC(r);
  if (l1 == NEG_INF) {
    store_chunk(a, r.n, p.vec, x, Same());
    if (r.c == 0) *ACC_LSE(r) = l2;
    return;
  }
  const double d1 = l1, d2 = l2;
  const double m = d1 > d2 ? d1 : d2;
  const double e = exp((d1 - m) + (d2 - m)), s = 1.0 + e;  // e: the lesser LSE's e_x
  const double w = 1.0 / s, w1 = d1 >= d2 ? w : e * w, w2 = d1 >= d2 ? e * w : w;
  float y[CHUNK];
  load_chunk(a, r.n, p.vec, y, Same());
#pragma unroll
  for (int j = 0; j < CHUNK; j++) y[j] = (float)(w1 * (double)y[j] + w2 * (double)x[j]);
  store_chunk(a, r.n, p.vec, y, Same());
  if (r.c == 0) *ACC_LSE(r) = (float)(m + log1p(e));
}

// %[13]s: the partial gradient src added into accumulator rows [r0, r0 + rows), in float.
extern "C" __global__ void __launch_bounds__(MERGE_THREADS) %[13]s(const MergeParams p) {
  const MergeRow r = merge_row(p);
  if (!r.ok) return;
  float x[CHUNK], y[CHUNK];
  load_chunk(SRC(r), r.n, p.vec, x, FromT());
  float* a = ACC(r);
  load_chunk(a, r.n, p.vec, y, Same());
#pragma unroll
  for (int j = 0; j < CHUNK; j++) y[j] += x[j];
  store_chunk(a, r.n, p.vec, y, Same());
}

// %[14]s: accumulator rows [r0, r0 + rows) rounded to T (to nearest, ties to even) into dst, and,
// when acc_lse is set, their LSE copied into dst_lse.
extern "C" __global__ void __launch_bounds__(MERGE_THREADS) %[14]s(const MergeParams p) {
  const MergeRow r = merge_row(p);
  if (!r.ok) return;
  float y[CHUNK];
  load_chunk(ACC(r), r.n, p.vec, y, Same());
  store_chunk(DST(r), r.n, p.vec, y, ToT());
  if (p.acc_lse && p.dst_lse && r.c == 0) *DST_LSE(r) = *ACC_LSE(r);
}

// %[16]s: the partial results of slots [0, slots), each of rows [0, rows) of one key block, folded at
// once into dst rows [0, rows) and dst_lse: the result of merging them one by one into an accumulator
// (%[12]s, in slot order) and finishing it (%[14]s), without the accumulator. A slot row whose LSE is
// -inf saw no key and is not read; a row no slot saw gets O = 0 and LSE = -inf; a row one slot saw
// takes that slot's row as it is; otherwise, with m the largest LSE, in double precision:
//   e_k = exp(l_k - m) <= 1, s = sum_k e_k, O = sum_k (e_k/s)·O_k, LSE = m + log(s).
// A NaN LSE or an m of +inf (inf - inf) makes e_k, s and so the row NaN, as the pairwise merge does.
extern "C" __global__ void __launch_bounds__(MERGE_THREADS) %[16]s(const MergeParams p) {
  const MergeRow r = merge_row(p);
  if (!r.ok) return;
  const float* lse = SRC_LSE(r);  // the row's LSE in slot 0
  const T* src = SRC(r);          // the thread's chunk in slot 0
  // pass 1: the largest LSE (fmaxf skips NaN; pass 2 catches it), the slots that saw a key
  float m = NEG_INF;
  int seen = 0, last = 0;
  for (int k = 0; k < p.slots; k++) {
    const float l = lse[(i64)k * p.slot_lse_s];
    if (l == NEG_INF) continue;
    m = fmaxf(m, l);
    seen++;
    last = k;
  }
  float y[CHUNK];
  float out_lse;
  if (seen <= 1) {  // no slot: O = 0, LSE = -inf; one slot: its row as it is
    if (seen == 0) {
#pragma unroll
      for (int j = 0; j < CHUNK; j++) y[j] = 0.f;
      out_lse = NEG_INF;
    } else {
      load_chunk(src + (i64)last * p.slot_s, r.n, p.vec, y, FromT());
      out_lse = lse[(i64)last * p.slot_lse_s];
    }
  } else {
    // pass 2: y = sum_k e_k·O_k unnormalized (e_k <= 1), then scaled by 1/s
#pragma unroll
    for (int j = 0; j < CHUNK; j++) y[j] = 0.f;
    double s = 0.0;
    for (int k = 0; k < p.slots; k++) {
      const float l = lse[(i64)k * p.slot_lse_s];
      if (l == NEG_INF) continue;
      const double e = exp((double)l - (double)m);
      s += e;
      float x[CHUNK];
      load_chunk(src + (i64)k * p.slot_s, r.n, p.vec, x, FromT());
      const float ef = (float)e;
#pragma unroll
      for (int j = 0; j < CHUNK; j++) y[j] = fmaf(ef, x[j], y[j]);
    }
    const float inv = (float)(1.0 / s);
#pragma unroll
    for (int j = 0; j < CHUNK; j++) y[j] *= inv;
    out_lse = (float)((double)m + log(s));
  }
  store_chunk(DST(r), r.n, p.vec, y, ToT());
  if (r.c == 0) *DST_LSE(r) = out_lse;
}
`
