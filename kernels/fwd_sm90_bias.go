package kernels

import "fmt"

// The staged bias of the Hopper forward (Variant.BiasStaged). Each compute
// warpgroup copies its 64 rows of a key block's bias, a [64][BN] tile of
// 16-bit values, into one of two shared buffers with cp.async, one key
// block ahead: the copy of block nb − 1 is issued while block nb is
// computed, so that its latency hides under a whole step instead of under
// one S product. A thread copies the 16-byte chunks (tid mod 128) + 128k
// of the tile, BN/8 chunks a row, into the layout of the kernel's other
// swizzled tiles (sw_off: 64-key atoms, chunk c of row r at c ^ (r mod 8)
// within its atom), so that a warp's reads of its accumulator elements
// fall on 32 distinct banks; BN a multiple of 64 fills whole atoms. Rows
// past the block's queries and keys past m are zero-filled. Before
// reading a block's tile the warpgroup waits for its own copies and meets
// on named barrier 6 + wg, which also orders its last reads of the other
// buffer before the copies of the next block into it.

// biasStageRowsOK reports whether v's key tile fills whole swizzle atoms
// (BlockN a multiple of 64).
func biasStageRowsOK(v Variant) bool { return v.BlockN%64 == 0 }

// biasStageCopy writes the copies of key block blk's bias (an expression)
// into buffer blk & 1, committed as one group. The address of the tile's
// first bias row (the same in every thread of the CTA) and the bytes
// between rows (a 32-bit int: gpu's biasStageable stages no bias whose rows
// are 2 GiB or more apart) are computed once a block, so that each copy's
// source is one wide multiply-add from them rather than the (batch, head,
// row, key) sum of 64-bit products; they are not kept through the main
// loop, where their registers spilled (NVRTC 12.4).
func (x *gen) biasStageCopy(indent, blk string) {
	x.raw(indentLines(fmt.Sprintf(`// ---- stage the bias of key block %[1]s into its buffer: this warpgroup's 64 rows, zeros past the rows and keys
{
  const int sblk = %[1]s, sj0 = sblk * BN;
  const u32 sdst = s_base + SB_OFF + (sblk & 1) * (BM * BN * 2) + wg * (64 * BN * 2);
  const char* const bias_tile = (const char*)p.bias + ((i64)b * p.bias_sb + (i64)h * p.bias_sh + (i64)m0 * p.bias_sn) * 2;  // the tile's first row
  const int bias_rs = (int)p.bias_sn * 2;  // bytes between rows
#pragma unroll
  for (int k = 0; k < 64 * (BN / 8) / 128; ++k) {
    const int q = (tid & 127) + 128 * k, r = q / (BN / 8), ch = q %% (BN / 8);
    const int row = 64 * wg + r, j = sj0 + 8 * ch;
    const bool ok = row < rows && j < m;
    const char* src = ok ? bias_tile + (i64)row * bias_rs + 2 * j : (const char*)p.bias;
    cp_async(sdst + sw_off<64, BN / 8>(r, ch), src, ok ? (u32)min(16, (m - j) * 2) : 0u);
  }
  cp_commit();
}
`, blk), indent))
}

// biasStageRead writes, for key block blk (an expression; next, the
// condition under which block blk − 1 exists), the wait for the block's
// staged bias, the reads of this thread's elements into bpre (the layout
// of s), and the copies of block blk − 1 into the other buffer. One
// ldmatrix.x4 reads four 8×8 blocks of the tile — rows 0–7 and 8–15 of the
// warp's 16 by two 8-key chunks — and hands each lane exactly the pairs of
// its accumulator fragment (row g of a block, keys 2c and 2c + 1): lanes
// 8i..8i+7 address the rows of block i, so a warp needs one address a
// load where the 32-bit loads took one a pair, each with its swizzle.
func (x *gen) biasStageRead(indent, blk, next string) {
	cvt := bitsToF32Func(x.v.Bias)
	x.raw(indentLines(fmt.Sprintf(`// ---- the bias of this block's scores, staged in shared memory one block ahead
float bpre[MT][NT_S][4];
{
  cp_wait<0>();
  bar_sync(6 + wg, 128);  // this warpgroup's copies of the block landed; its reads of the other buffer are done
  const u32 sb = s_base + SB_OFF + ((%[1]s) & 1) * (BM * BN * 2) + wg * (64 * BN * 2);
  // this lane's row of ldmatrix block lane >> 3: blocks 0, 2 rows 0–7 and 1, 3 rows 8–15 of the warp's 16; blocks 2, 3 one chunk on
  const int lr = (wm & 3) * 16 + 8 * ((lane >> 3) & 1) + (lane & 7), lch = lane >> 4;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT_S; nt += 2) {  // keys key0 + 8nt .. + 15
      u32 r[4];
      ldsm4(r, sb + sw_off<64, BN / 8>(lr + mt * 16, ((key0 + nt * 8) >> 3) + lch));
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // block i: row half i & 1, chunk nt + (i >> 1); keys 2c and 2c + 1 of row g
        bpre[mt][nt + (i >> 1)][2 * (i & 1)] = %[2]s((u16)r[i]);
        bpre[mt][nt + (i >> 1)][2 * (i & 1) + 1] = %[2]s((u16)(r[i] >> 16));
      }
    }
}
if (%[3]s) {
`, blk, cvt, next), indent))
	x.biasStageCopy(indent+"  ", "("+blk+") - 1")
	x.raw(indent + "}\n")
}
