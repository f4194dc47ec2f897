package kernels

// Odd head dims read in place over flat rows (Variant.Flat and
// BwdVariant.Flat): what a layout needs, the tensor maps over a position's
// concatenated heads, and the device function that clears a tile's
// columns outside its shifted head. The forward and the backward share
// them.

// FlatFits reports whether head dims dk and dv leave the room a Flat
// variant needs past them in their 16-padded widths (seven columns: the
// largest shift).
func FlatFits(dk, dv int) bool {
	return (dk+15)/16*16-dk >= 7 && (dv+15)/16*16-dv >= 7
}

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

// zeroColsSource is zero_cols, the device function that clears the columns
// of a flat row's swizzled tile outside its head.
const zeroColsSource = `// zero_cols zeroes columns [0, sh) and [sh + d, dp) of rows [0, R) of the 128-byte-swizzled 16-bit tile
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
