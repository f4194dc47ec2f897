package kernels

import "math/bits"

// Odd head dims read in place over flat rows (Variant.Flat and
// BwdVariant.Flat): what a layout needs, the tensor maps over a position's
// concatenated heads, and the device function that clears a tile's
// columns outside its shifted head. The forward and the backward share
// them.

// FlatRowsOK reports whether a 16-bit tensor of heads heads of d elements
// (element strides head, row and batch; batches batch elements; element 0
// at device address ptr) can be read over flat rows: heads contiguous
// (head stride d) from a 16-byte aligned start, a multiple of 8 elements
// to a position's heads (so that a 16-byte copy starting inside them ends
// inside them), and positions and batch elements whole 16-byte units apart.
func FlatRowsOK(ptr uint64, heads, d int, head, row, batch int64, batches int) bool {
	return head == int64(d) && ptr%16 == 0 && int64(heads)*int64(d)%8 == 0 && row%8 == 0 && (batches <= 1 || batch%8 == 0)
}

// OverFlatRows returns t's tensor map over flat rows for head dim d: the
// heads of a position are one row of Heads·d columns, the head dim of the
// map has extent one.
func (t TMATensor) OverFlatRows(d int) TMATensor {
	t.Cols, t.Heads = t.Heads*uint64(d), 1
	t.Strides[1] = TMAStride(1, 0, 2)
	return t
}

// zeroColsSource holds flat_shift, where a head's tile starts within its
// box over flat rows, and zero_cols, the device function that clears the
// columns of a flat row's swizzled tile outside its head.
const zeroColsSource = `// flat_shift returns the column at which head h (head dim d) starts in its tiles over flat rows, whose
// boxes start at column h·d - flat_shift: h·d mod 16 where the head then ends within the padded width
// w (the boxes start on 32 bytes, whole L2 sectors: rows that start on 16 bytes read slower; see
// docs/kernels/odd-dims.md), else h·d mod 8 (16 bytes, what the accelerator needs)
DEV int flat_shift(int h, int d, int w) {
  const int s = (h * d) & 15;
  return s + d <= w ? s : s & 7;
}
// zero_cols zeroes columns [0, sh) and [sh + d, dp) of rows [0, R) of the 128-byte-swizzled 16-bit tile
// [atoms][R][64] at tile (threads tid of nth): a flat row's tile holds its head from column sh, its
// neighbours' elements around it
template <int R>
DEV void zero_cols(unsigned char* tile, int sh, int d, int dp, int tid, int nth) {
  const int w = dp - d;  // columns to zero in a row
  for (int i = tid; i < R * w; i += nth) {
    const int r = i / w, k = i - r * w, col = k < sh ? k : d + k;  // [0, sh) then [sh + d, dp)
    *reinterpret_cast<unsigned short*>(tile + (col >> 6) * R * 128 + r * 128 + ((((col & 63) >> 3) ^ (r & 7)) << 4) + (col & 7) * 2) = 0;
  }
}
`

// rowOutSource is row_out, the device function with which one warp writes
// a 16-bit row staged in shared memory to a global row of any alignment
// (the Hopper forward's O and the Hopper backward's gradients of odd head
// dims).
const rowOutSource = `// row_out writes the d 16-bit elements of the shared row srow to the global row orow (one warp, lane
// lane): 4-byte stores, a 2-byte store at either end where the row's alignment needs one
DEV void row_out(unsigned char* orow, const unsigned short* srow, int d, int lane) {
  const int e0 = (int)((reinterpret_cast<unsigned long long>(orow) >> 1) & 1);  // 1: the row starts 2 bytes past 4
  if (e0 == 1 && lane == 0) *reinterpret_cast<unsigned short*>(orow) = srow[0];
  for (int e = e0 + 2 * lane; e + 1 < d; e += 64)
    *reinterpret_cast<unsigned int*>(orow + 2 * e) = (unsigned int)srow[e] | ((unsigned int)srow[e + 1] << 16);
  if (((d - e0) & 1) && lane == 0) *reinterpret_cast<unsigned short*>(orow + 2 * (d - 1)) = srow[d - 1];
}
`

// FlatStagedHeads returns which heads of head dim d a Flat variant cannot
// read in place: bit r is set when heads h ≡ r (mod 8), whose tiles start
// (h·d mod 8) columns into their 16-byte unit, would run past FlatWidth(d).
// Zero: every head fits. A FlatStaged variant reads the heads it selects
// from staging copies that hold only them (FlatStagedCount, in order of h:
// head h sits at FlatStagedCount(h, mask) among them).
func FlatStagedHeads(d int) uint8 {
	var m uint8
	for r := 0; r < 8; r++ {
		if r*d%8+d > FlatWidth(d) {
			m |= 1 << r
		}
	}
	return m
}

// FlatStagedCount returns how many of heads 0 .. heads-1 mask selects
// (bit h mod 8).
func FlatStagedCount(heads int, mask uint8) int {
	n := heads / 8 * bits.OnesCount8(mask)
	return n + bits.OnesCount8(mask&uint8(1<<(heads%8)-1))
}

// selectedHeadsSource holds the device functions of a head selection by a
// mask of head classes h mod 8 (FlatStagedHeads' selection): the pack
// kernel's copies of the selected heads only, and the FlatStaged forward's
// index of a staged head among them.
const selectedHeadsSource = `// selected_head returns head j of those whose index mod 8 has its bit set in hmask, in order of index
// (FlatStagedHeads' selection): heads 8q + r, r a set bit, the j-th of them
__device__ __forceinline__ int selected_head(int j, unsigned hmask) {
  const int per8 = __popc(hmask), q = j / per8;
  int k = j - q * per8, r = 0;
  for (; r < 8; r++)
    if ((hmask >> r) & 1u) {
      if (k == 0) break;
      k--;
    }
  return 8 * q + r;
}

// selected_heads returns how many of heads 0 .. heads-1 hmask selects (all of them when hmask is 0):
// for a selected head h, selected_heads(h, hmask) is its place among the selected (FlatStagedCount)
__device__ __forceinline__ int selected_heads(int heads, unsigned hmask) {
  return hmask ? (heads >> 3) * __popc(hmask) + __popc(hmask & ((1u << (heads & 7)) - 1u)) : heads;
}
`

// flatStagedHeadSource is selectedHeadsSource and flat_staged_mask, the
// kernel's FlatStagedHeads, with which the FlatStaged forward finds a
// staged head's place in the copies, and griddep_wait, with which the
// blocks of staged heads wait for the pack kernel when the forward was
// launched early after it (cuda.Device.LaunchEarly).
const flatStagedHeadSource = selectedHeadsSource + `
// flat_staged_mask returns the head classes h mod 8 whose shift (h·d mod 8) runs past the padded width
// w: bit r set when (r·d mod 8) + d > w (FlatStagedHeads)
DEV unsigned flat_staged_mask(int d, int w) {
  unsigned m = 0u;
#pragma unroll
  for (int r = 0; r < 8; r++)
    if (((r * d) & 7) + d > w) m |= 1u << r;
  return m;
}

// griddep_wait waits until the kernel this one was launched early after (a programmatic dependent launch
// behind the pack kernel that makes the staging copies) has finished and its writes are visible; without
// such a launch it returns at once
DEV void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
`
