package kernels

import "encoding/binary"

// The forward's staging copy: rows of 16-bit tensors whose head dim is not
// a multiple of 8 elements start only 2-byte aligned, so the forward would
// load them element by element. The pack kernel copies such a tensor into
// workspace rows of StagedDim elements (zero beyond the head dim), which the
// forward then reads with 16-byte asynchronous copies.

// PackKernel is the name of the kernel in PackSource.
const PackKernel = "fa_pack_rows"

// PackThreads is the block size of the pack kernel; each warp copies one row.
const PackThreads = 128

// PackRowsPerBlock is the number of rows one block of the pack kernel copies
// (grid x = ceil(rows / PackRowsPerBlock)).
const PackRowsPerBlock = PackThreads / 32

// StagedDim returns the row length in elements of a staging copy of a
// 16-bit tensor with head dim d: d rounded up to a multiple of 8 (16 bytes).
func StagedDim(d int) int { return (d + 7) / 8 * 8 }

// PackSource is the CUDA source of the pack kernel. It copies bit patterns,
// so one module serves fp16 and bf16.
const PackSource = `// Staging copy of a 16-bit [B, rows, heads, D] tensor (any strides, feature dim contiguous) into a
// contiguous [B, rows, heads, DS] buffer, DS = D rounded up to 8 elements, zero beyond D.
// grid (ceil(rows / 4), heads, B), 128 threads; warp w of a block copies row 4·blockIdx.x + w, its
// lanes taking consecutive elements.
typedef unsigned short u16;
struct PackParams {
  const u16* src;        // element (b, r, h, 0) at src + b*sb + r*sr + h*sh
  u16* dst;              // element (b, r, h, 0) at dst + ((b*rows + r)*heads + h)*ds
  long long sb, sr, sh;  // source strides in elements
  int rows, heads, d, ds;
};
extern "C" __global__ void __launch_bounds__(128) ` + PackKernel + `(const PackParams p) {
  const int r = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  const int h = blockIdx.y, b = blockIdx.z;
  if (r >= p.rows) return;
  const u16* s = p.src + b * p.sb + r * p.sr + h * p.sh;
  u16* o = p.dst + ((long long)(b * (long long)p.rows + r) * p.heads + h) * p.ds;
  for (int i = lane; i < p.ds; i += 32) o[i] = i < p.d ? s[i] : (u16)0;
}
`

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
