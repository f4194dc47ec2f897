package kernels

import (
	"encoding/binary"
	"fmt"
)

// The staging copies: rows of 16-bit tensors whose head dim is not a
// multiple of 8 elements start only 2-byte aligned, so the kernels would
// load them element by element. The pack kernel copies such a tensor into
// workspace rows of StagedDim elements (zero beyond the head dim), which the
// forward then reads with 16-byte asynchronous copies; the backward's pack
// kernel does the same with the shared device code of stageSource.

// PackKernel is the name of the kernel in PackSource.
const PackKernel = "fa_pack_rows"

// PackSharedBytes is the dynamic shared memory of a pack kernel launch:
// the source address of each of a block's (row, head) pairs.
const PackSharedBytes = PackRowsPerBlock * 8

// PackThreads is the block size of the pack kernel.
const PackThreads = 256

// PackRowsPerBlock is the number of (row, head) pairs one block of the pack
// kernel copies (see PackGrid).
const PackRowsPerBlock = 128

// StagedRowBytes is the granule of a staging copy's row, forward and
// backward: one 32-byte L2 sector, so that every row starts on a sector.
// Rows of a multiple of 16 bytes only would start mid-sector every other
// row, and the kernel reading them moves a sector more per such row (the
// forward at D = 200, 400-byte rows, took 7 % longer than at 208 with the
// same kernel; ncu read the L2 at 46.6 % of its throughput against 35.9 %).
const StagedRowBytes = 32

// StagedDim returns the row length in elements of a staging copy of a
// 16-bit tensor with head dim d: d rounded up to StagedRowBytes.
func StagedDim(d int) int { return roundUp(d, StagedRowBytes/2) }

// stageSource holds the device functions of every staging copy. A copy
// moves 16-byte chunks: each comes out of the (at most two) aligned 16-byte
// blocks of the source that it overlaps, so a row that starts only 2-byte
// aligned is still read with 16-byte loads. Bytes at or past a row's end are
// never read except as part of an aligned block that ends within the row,
// and the first block of a row starts at most 14 bytes before it, inside the
// same 16-byte aligned block (allocations are at least 16-byte aligned).
const stageSource = `// stage_block returns the 16 bytes at the 16-byte aligned address blk, zero from end on: one 16-byte
// load when the block ends at or before end, 2-byte loads of the bytes before end otherwise.
__device__ __forceinline__ uint4 stage_block(const unsigned char* blk, const unsigned char* end) {
  if (blk + 16 <= end) return *reinterpret_cast<const uint4*>(blk);
  unsigned w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; i++)
    if (blk + 2 * i < end) w[i >> 1] |= (unsigned)*reinterpret_cast<const unsigned short*>(blk + 2 * i) << (16 * (i & 1));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// stage_chunk returns bytes [16c, 16c + 16) of the row that starts at s (2-byte aligned) and ends at
// end, zero from end on. The row's byte offset within a 16-byte block (sh, even, the same for every
// chunk of the row) selects the chunk's bytes from the two aligned blocks it overlaps.
__device__ __forceinline__ uint4 stage_chunk(const unsigned char* s, const unsigned char* end, int c) {
  const unsigned char* a = s + 16 * c;
  const int sh = (int)(reinterpret_cast<unsigned long long>(a) & 15ull);
  const uint4 x = stage_block(a - sh, end);
  if (sh == 0) return x;
  const uint4 y = stage_block(a - sh + 16, end);
  const unsigned w[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
  const int q = sh >> 2;  // whole words to skip
  unsigned o[4];
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const unsigned lo = q == 0 ? w[k] : q == 1 ? w[k + 1] : q == 2 ? w[k + 2] : w[k + 3];
    const unsigned hi = q == 0 ? w[k + 1] : q == 1 ? w[k + 2] : q == 2 ? w[k + 3] : w[k + 4];
    o[k] = (sh & 2) ? (lo >> 16) | (hi << 16) : lo;  // a half-word more to skip
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// stage_rows_by copies rows [0, nrows) of nb bytes, row r from src(r) into dst(r) (rows of nbs bytes,
// a multiple of 16, 16-byte aligned), zero from byte nb on. The block's NTH threads take the rows'
// 16-byte chunks in turn, SU at a time: all SU chunks' loads are issued before any store, so that
// each thread keeps several loads in flight.
constexpr int SU = 2;
template <int NTH, class Dst, class Src>
__device__ __forceinline__ void stage_rows_by(Dst dst, Src src, int nrows, int nb, int nbs) {
  const int cpr = nbs >> 4, items = nrows * cpr;
  for (int t0 = threadIdx.x; t0 < items; t0 += SU * NTH) {
    uint4 x[SU];
#pragma unroll
    for (int u = 0; u < SU; u++) {
      const int t = t0 + u * NTH, r = (int)((unsigned)t / (unsigned)cpr), c = t - r * cpr;
      if (t < items) {
        const unsigned char* s = src(r);
        x[u] = stage_chunk(s, s + nb, c);
      }
    }
#pragma unroll
    for (int u = 0; u < SU; u++) {
      const int t = t0 + u * NTH, r = (int)((unsigned)t / (unsigned)cpr), c = t - r * cpr;
      if (t < items) *reinterpret_cast<uint4*>(dst(r) + 16 * c) = x[u];
    }
  }
}

// stage_rows is stage_rows_by for rows at a fixed stride: row r at src + r·ssr, into dst + r·dsr.
template <int NTH>
__device__ __forceinline__ void stage_rows(unsigned char* dst, long long dsr, const unsigned char* src, long long ssr,
                                           int nrows, int nb, int nbs) {
  stage_rows_by<NTH>([=](int r) { return dst + r * dsr; }, [=](int r) { return src + r * ssr; }, nrows, nb, nbs);
}
`

// PackSource is the CUDA source of the pack kernel. It copies bit patterns,
// so one module serves fp16 and bf16.
var PackSource = fmt.Sprintf(`// Staging copy of a 16-bit [B, rows, heads, D] tensor (any strides, feature dim contiguous) into a
// contiguous [B, rows, heads, DS] buffer, DS = D rounded up to 16 elements, zero beyond D.
// grid (ceil(rows·heads / %[1]d), B), %[2]d threads. A block copies %[1]d consecutive (row, head) pairs
// f = row·heads + head of one batch element: consecutive in the buffer and, for the usual contiguous
// layout, in the source too, so that both sides stream whole cache lines. Its threads take 16-byte
// chunks.
typedef unsigned short u16;
struct PackParams {
  const u16* src;        // element (b, r, h, 0) at src + b*sb + r*sr + h*sh
  u16* dst;              // element (b, r, h, 0) at dst + ((b*rows + r)*heads + h)*ds
  long long sb, sr, sh;  // source strides in elements
  int rows, heads, d, ds;
};
%[3]s
extern "C" __global__ void __launch_bounds__(%[2]d) %[4]s(const PackParams p) {
  const long long f0 = (long long)blockIdx.x * %[1]d, nf = (long long)p.rows * p.heads;
  const int b = blockIdx.y, n = (int)min((long long)%[1]d, nf - f0);
  const u16* s = p.src + b * p.sb;
  u16* o = p.dst + (b * nf + f0) * p.ds;
  // source address of each pair of the block, one division per pair instead of one per chunk
  // (dynamic shared memory, PackSharedBytes)
  extern __shared__ __align__(16) unsigned char smem[];
  const unsigned char** row_src = reinterpret_cast<const unsigned char**>(smem);
  for (int i = threadIdx.x; i < n; i += %[2]d) {
    const long long f = f0 + i, r = f / p.heads, h = f - r * p.heads;
    row_src[i] = reinterpret_cast<const unsigned char*>(s + r * p.sr + h * p.sh);
  }
  __syncthreads();
  stage_rows_by<%[2]d>(
      [=](int i) { return reinterpret_cast<unsigned char*>(o + (long long)i * p.ds); },
      [&](int i) { return row_src[i]; },
      n, 2 * p.d, 2 * p.ds);
}
`, PackRowsPerBlock, PackThreads, stageSource, PackKernel)

// PackGrid returns the grid of the pack kernel for a tensor of batch
// elements of rows × heads rows each.
func PackGrid(rows, heads, batch int) [3]uint32 {
	f := int64(rows) * int64(heads)
	return [3]uint32{uint32((f + PackRowsPerBlock - 1) / PackRowsPerBlock), uint32(batch), 1}
}

// PackParams are the arguments of the pack kernel; Bytes gives the C
// struct's layout.
type PackParams struct {
	Src, Dst                           uint64 // device addresses of the source tensor's element 0 and of the staging buffer
	BatchStride, RowStride, HeadStride int64  // source strides in elements
	Rows, Heads, D, DS                 int32  // rows per batch element, heads, head dim, staged row length
}

// Bytes returns the params in the layout of the C struct PackParams.
func (p PackParams) Bytes() []byte {
	b := make([]byte, 56)
	le := binary.LittleEndian
	le.PutUint64(b[0:], p.Src)
	le.PutUint64(b[8:], p.Dst)
	le.PutUint64(b[16:], uint64(p.BatchStride))
	le.PutUint64(b[24:], uint64(p.RowStride))
	le.PutUint64(b[32:], uint64(p.HeadStride))
	le.PutUint32(b[40:], uint32(p.Rows))
	le.PutUint32(b[44:], uint32(p.Heads))
	le.PutUint32(b[48:], uint32(p.D))
	le.PutUint32(b[52:], uint32(p.DS))
	return b
}
