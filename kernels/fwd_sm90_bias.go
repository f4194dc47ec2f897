package kernels

import "fmt"

// The staged bias of the Hopper forward (Variant.BiasStaged). The producer
// thread loads each key block's bias tile — BM query rows by the block's BN
// keys, 16-bit — into one of two shared buffers with the tensor memory
// accelerator, right after the block's K tile: one box of [64 rows][64
// keys] a compute warpgroup and 64-key atom, in the 128-byte swizzle of the
// kernel's other tiles (sw_off: chunk c of row r at c ^ (r mod 8) within
// its atom), so that a warp's reads of its accumulator elements fall on 32
// distinct banks; BN a multiple of 64 fills whole atoms. Rows past the
// queries and keys past the keys come in as zeros (out-of-bounds fill).
// The buffers have full and empty barriers like K's and V's: tile g (the
// K tile's number) goes to buffer g mod 2, completing phase g / 2 of its
// full barrier; each compute warp arrives on the buffer's empty barrier
// once it has read its elements, and the producer waits for that before
// loading tile g + 2 into it. The compute warps issue no copy and meet on
// no barrier for it.
//
// The bias's tensor map (Variant.BiasTMATensor: dims key, row, head,
// batch; a broadcast head or batch dim has extent 1 and coordinate 0) is
// encoded on the host, which stages no bias the encoder refuses.

// biasStageRowsOK reports whether v's key tile fills whole swizzle atoms
// (BlockN a multiple of 64).
func biasStageRowsOK(v Variant) bool { return v.BlockN%64 == 0 }

// biasStageBarriers returns the declarations of the bias buffers' full
// and empty barriers (after the pipeline's own: barQ and emptyK).
func (x *gen) biasStageBarriers() string {
	if !x.v.BiasStaged {
		return ""
	}
	return `  const u32 barB = barQ + 40, emptyB = emptyK + 48;  // the bias buffers' full and empty barriers: buffer b at + 8b
`
}

// biasStageBarrierInit returns the initialization of the bias buffers'
// barriers (thread 0, with the others').
func (x *gen) biasStageBarrierInit() string {
	if !x.v.BiasStaged {
		return ""
	}
	return `      mbar_init(barB + 8 * i, 1);
      mbar_init(emptyB + 8 * i, NCOMPUTE / 32);
`
}

// biasStageLoad returns the producer's load of tile g's bias (the key
// block of K tile g, whose first key is key0, an expression) into bias
// buffer g & 1, once tile g − 2 released it; indent before each line.
func (x *gen) biasStageLoad(indent, key0 string) string {
	if !x.v.BiasStaged {
		return ""
	}
	return indentLines(fmt.Sprintf(`// the bias of the same block: tile g's, once tile g - 2 released its buffer; a box of [64 rows][64 keys]
// a compute warpgroup and key atom
if (g >= 2) mbar_wait(emptyB + 8 * (g & 1), ((g >> 1) - 1) & 1);
mbar_expect_tx(barB + 8 * (g & 1), BM * BN * 2);
#pragma unroll
for (int w = 0; w < BM / 64; ++w)
  tma_rows<64, BN / 64>(s_base + SB_OFF + (g & 1) * (BM * BN * 2) + w * (64 * BN * 2), &tp.bias, barB + 8 * (g & 1),
                        m0 + 64 * w, %s, %s);
`, biasMapCoords("h", "b"), key0), indent)
}

// biasStageRead writes, for the key block of tile num (an expression: the
// K tile's number), the wait for its staged bias, the reads of this
// thread's elements into bpre (the layout of s) and the warp's release of
// the buffer. One ldmatrix.x4 reads four 8×8 blocks of the tile — rows 0–7
// and 8–15 of the warp's 16 by two 8-key chunks — and hands each lane
// exactly the pairs of its accumulator fragment (row g of a block, keys 2c
// and 2c + 1): lanes 8i..8i+7 address the rows of block i, so a warp needs
// one address a load where the 32-bit loads took one a pair, each with its
// swizzle.
func (x *gen) biasStageRead(indent, num string) {
	cvt := bitsToF32Func(x.v.Bias)
	x.raw(indentLines(fmt.Sprintf(`// ---- the bias of this block's scores, loaded into shared memory by the producer
float bpre[MT][NT_S][4];
{
  const int bg = %[1]s;  // the block's tile number: its bias buffer bg & 1, phase bg >> 1
  mbar_wait(barB + 8 * (bg & 1), (bg >> 1) & 1);  // the block's bias tile landed
  const u32 sb = s_base + SB_OFF + (bg & 1) * (BM * BN * 2) + wg * (64 * BN * 2);
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
  __syncwarp();
  if (lane == 0) mbar_arrive(emptyB + 8 * (bg & 1));  // this warp is done with bias buffer bg & 1
}
`, num, cvt), indent))
}
