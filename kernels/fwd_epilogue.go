package kernels

import "fmt"

// epilogueEmpty writes the early exit of a CTA whose rows see no key at
// all: O = 0 and LSE = −inf for its valid rows.
func (x *gen) epilogueEmpty() {
	x.raw(`  if (nb_hi <= nb_lo) {  // ---- no row of this CTA sees a key: O = 0, LSE = -inf
`)
	x.outputBases("    ")
	threads := "NTHREADS"
	if x.v.Persistent {
		threads = "NCOMPUTE" // the producer warpgroup runs a loop of its own
	}
	x.p(`    for (int idx = tid; idx < rows * p.d_v; idx += %s) {
      const int r = idx / p.d_v, d = idx - r * p.d_v;
      store_elem(gO + r * o_rs + (i64)d * ESZ, 0.f);
    }`, threads)
	if x.v.LSE {
		x.p("    for (int r = tid; r < rows; r += %s) gL[r * p.lse_sn] = NEG_INF;", threads)
	}
	x.p("    %s\n  }", x.tileExit())
}

// outputBases writes the global addresses of the CTA's first O row and LSE
// entry (computed where needed, so that they take no registers in the main loop).
func (x *gen) outputBases(indent string) {
	x.raw(indent + "char* gO = (char*)p.o + ((i64)b * p.o_sb + (qs + m0) * p.o_sn + (i64)h * p.o_sh) * ESZ;\n")
	if x.v.LSE {
		x.raw(indent + "float* gL = (float*)p.lse + (i64)b * p.lse_sb + (i64)h * p.lse_sh + (qs + m0) * p.lse_sn;\n")
	}
}

// quadRowSum opens the loop over a thread's rows that sums each row's l
// over its quad (the four lanes that hold the row).
const quadRowSum = `#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float l = row_sum[mt][hf];
      l += __shfl_xor_sync(FULL_MASK, l, 1);
      l += __shfl_xor_sync(FULL_MASK, l, 2);
`

// epilogue writes the final normalization and the stores of O and LSE:
// O = acc / l (times 256/T under dropout), LSE = (max·SC + log2 l)·ln 2;
// a row with l = 0 (no visible key) gets O = 0 and LSE = −inf, a row with
// a NaN score (a NaN in its query or in a key it sees: l is NaN) O = NaN
// and LSE = NaN. Each thread folds the O values it writes into nf_o, the
// flag nfFixup votes on.
func (x *gen) epilogue() {
	v := x.v
	x.raw("\n  // ---- epilogue: row sums over the quad (and the key halves), O = acc / l, LSE = ln(sum exp)\n")
	x.outputBases("  ")
	if v.splitKeys() {
		x.raw("  __syncthreads();  // every warp is done with the row-maximum exchange\n" + quadRowSum + `      if (c == 0) red[wn * BM + wrow0 + mt * 16 + g + 8 * hf] = l;
    }
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < WN; ++w) l += red[w * BM + wrow0 + mt * 16 + g + 8 * hf];
      row_sum[mt][hf] = l;
    }
`)
	} else {
		x.raw(quadRowSum + `      row_sum[mt][hf] = l;
    }
`)
	}
	dscale := "1.f"
	if v.Dropout {
		dscale = "p.drop_scale"
	}
	x.raw("  float nf_o = 0.f;  // x·0 summed over the O values this thread writes: NaN when one is not finite (fwd_mask.go)\n")
	if v.StoreO {
		x.epilogueTMAStore(dscale)
		return
	}
	// a persistent CTA's producer loads the next tile's Q, K and V into the tiles while this one's
	// epilogue runs: its O goes out from registers, element by element where rows allow no pairs
	viaShared := v.WGMMA && !v.Persistent && v.BlockM*(x.g.dvp+8)*2 <= x.g.smem-1024
	if viaShared {
		x.epilogueViaShared(dscale)
		if v.Flat {
			return // O always goes through shared memory
		}
	}
	y := &gen{v: v, g: x.g}
	y.p(`#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = wrow0 + mt * 16 + g + 8 * hf;  // row within the block
      const float l = row_sum[mt][hf];
      const float inv = l == 0.f ? 0.f : %s / l;  // l = 0: no visible key; NaN: a NaN score
      if (r < rows) {
        char* orow = gO + r * o_rs;
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) {
          const int d = dv0 + nt * 8 + 2 * c;
          const float a0 = o[mt][nt][2 * hf] * inv, a1 = o[mt][nt][2 * hf + 1] * inv;
          nf_o = fmaf(a0, 0.f, fmaf(a1, 0.f, nf_o));
          if (p.o_vec2 && d + 1 < p.d_v) {
            store_pair(orow + d * ESZ, a0, a1);
          } else {
            if (d < p.d_v) store_elem(orow + d * ESZ, a0);
            if (d + 1 < p.d_v) store_elem(orow + (d + 1) * ESZ, a1);
          }
        }`, dscale)
	if v.LSE {
		y.p("        if (%s) %s", x.lseWriter(), lseStore("mt"))
	}
	y.raw("      }\n    }\n")
	if viaShared {
		x.raw("  else {\n" + indentLines(y.b.String(), "  ") + "  }\n")
		return
	}
	x.raw(y.b.String())
}

// lseWriter returns the condition that selects the one thread writing a
// row's LSE: the first of the fragment's column pairs, in the first warp
// column (or warpgroup) of the row.
func (x *gen) lseWriter() string {
	if x.v.WarpsN > 1 {
		return "c == 0 && wn == 0"
	}
	return "c == 0"
}

// lseStore returns the statement storing row r's LSE (natural log) from
// its maximum (row tile mt, half hf) and its sum l; −inf for a row that
// saw no key (l = 0), NaN for a row with a NaN score (l is NaN: the
// maximum ignores NaN, the sum does not).
func lseStore(mt string) string {
	return fmt.Sprintf("gL[r * p.lse_sn] = l == 0.f ? NEG_INF : (row_max[%s][hf] * SC + log2f(l)) * LN2;", mt)
}

// epilogueViaShared writes, for the Hopper kernel, the store of O for rows
// that allow no paired stores (p.o_vec2 = 0: an odd head dim or stride):
// the fragments' element stores would write each 8-column block of eight
// rows as scattered 2-byte pieces, so O goes through shared memory (the
// tiles' space, free after the loop; not in a persistent kernel, whose
// producer fills it with the next tile's tiles by then) and each warp writes whole rows with
// 4-byte stores, a 2-byte store at either end where the row's alignment
// needs one (over flat rows always). The caller checks that the staged
// tile fits the kernel's shared memory, and writes the other stores as the
// else branch of the block this leaves open to one.
func (x *gen) epilogueViaShared(dscale string) {
	lse := ""
	if x.v.LSE {
		lse = "\n        if (" + x.lseWriter() + " && r < rows) " + lseStore("0")
	}
	cond, shift := "if (!p.o_vec2) ", ""
	if x.v.Flat {
		// O's columns sit shifted by V's: always through shared memory, read from column sv_
		cond, shift = "", " + sv_"
	}
	x.p(`  %s{  // ---- O through shared memory, rows written whole
    constexpr int OP = DVP + 8;  // row pitch of the staged O tile (16-bit elements)
    u16* so = (u16*)(smem + (s_base - smem_addr(smem)));  // [BM][OP], over the Q/K/V tiles
    %s  // every warp is done with the tiles
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = wrow0 + g + 8 * hf;  // row within the block
      const float l = row_sum[0][hf];
      const float inv = l == 0.f ? 0.f : %s / l;  // l = 0: no visible key; NaN: a NaN score
      float nf = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT_O; ++nt) {
        const float a0 = o[0][nt][2 * hf] * inv, a1 = o[0][nt][2 * hf + 1] * inv;
        nf = fmaf(a0, 0.f, fmaf(a1, 0.f, nf));
        *(u32*)(so + r * OP + dv0 + nt * 8 + 2 * c) = pack2(a0, a1);
      }
      if (r < rows) nf_o += nf;%s
    }
    %s
    for (int r = warp; r < rows; r += %s / 32) row_out((unsigned char*)(gO + r * o_rs), so + r * OP%s, p.d_v, lane);
  }`, cond, x.computeSync(), dscale, lse, x.computeSync(), x.computeThreads(), shift)
}

// tmaStorePrimitive is the bulk tensor store of a StoreO kernel (and of a
// DBiasStore backward's dK/dV kernel): one box of a tensor map from shared
// memory, in the issuing thread's bulk group (WarpSpecializedPrimitives'
// bulk_commit and bulk_wait close and retire it).
const tmaStorePrimitive = `// box (c0.., c1.., c2, c3) of the tensor map at generic address map from the swizzled shared tile at
// src (1024-byte aligned); the parts outside the tensor are not written
DEV void tma_store_4d(const TensorMap* map, u32 src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
               ::"l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src) : "memory");
}
`

// tmaReduceAddPrimitive is the bulk tensor reduce-add of a DBiasReduce
// backward's dK/dV kernel: one box from shared memory added element by
// element into the tensor, in the element type of the map (E names it for
// the reader; the copy engine takes it from the map), in the issuing
// thread's bulk group.
const tmaReduceAddPrimitive = `// box (c0.., c1.., c2, c3) of the tensor map at generic address map += the swizzled shared tile at src
// (1024-byte aligned), element by element in the map's element type E, each element's add atomic; the parts
// outside the tensor are dropped
template <typename E>
DEV void tma_reduce_add_4d(const TensorMap* map, u32 src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
               ::"l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src) : "memory");
}
`

// epilogueTMAStore writes, for a StoreO kernel, the stores of O (scaled by
// dscale / l) and LSE: each warpgroup writes its 64 rows of O in bf16/fp16
// into its staging tile ([VATOMS][64][64], the 128-byte swizzle of the
// map's boxes), and its first thread issues one bulk tensor store per atom
// after the warpgroup's named barrier (4 + wg); the copy engine clips rows
// past N and columns past DV. Before writing the tile, that thread waits
// until its last stores (a persistent CTA's previous tile) are done reading
// it. LSE is stored by the threads, as in the other epilogues.
func (x *gen) epilogueTMAStore(dscale string) {
	lse := ""
	if x.v.LSE {
		lse = "\n      if (" + x.lseWriter() + " && r < rows) " + lseStore("0")
	}
	x.p(`  {  // ---- O by the tensor memory accelerator: this warpgroup's 64 rows through its staging tile
    const u32 so = s_base + SO_OFF + wg * (VATOMS * 64 * 128);  // [VATOMS][64][64], swizzled
    const bool issuer = (tid & 127) == 0;  // the warpgroup's first thread issues its stores
    if (issuer) bulk_wait_read<0>();       // its last stores no longer read the tile
    bar_sync(4 + wg, 128);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = wrow0 + g + 8 * hf, rl = r & 63;  // row within the block, within the warpgroup's 64
      const float l = row_sum[0][hf];
      const float inv = l == 0.f ? 0.f : %s / l;  // l = 0: no visible key; NaN: a NaN score
      float nf = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT_O; ++nt) {
        const int d = nt * 8 + 2 * c;  // value column (the pair d, d + 1)
        const float a0 = o[0][nt][2 * hf] * inv, a1 = o[0][nt][2 * hf + 1] * inv;
        nf = fmaf(a0, 0.f, fmaf(a1, 0.f, nf));
        sts32(so + sw_off<64, VCH>(rl, d >> 3) + (d & 7) * ESZ, pack2(a0, a1));  // row rl, 16-byte chunk d / 8
      }
      if (r < rows) nf_o += nf;%s
    }
    fence_proxy_async();  // the tile's stores, before the copy engine reads them
    bar_sync(4 + wg, 128);
    if (issuer) {
#pragma unroll
      for (int a = 0; a < VATOMS; ++a) tma_store_4d(&tp.o, so + a * (64 * 128), a * 64, m0 + 64 * wg, h, b);
      bulk_commit();
    }
  }`, dscale, lse)
}

// storeOWait writes, for a StoreO kernel, the end of the kernel's stores:
// each warpgroup's issuing thread waits until its bulk stores are complete
// before the CTA ends (its shared memory must outlive their reads).
func (x *gen) storeOWait() {
	if x.v.StoreO {
		x.raw("  if ((threadIdx.x & 127) == 0 && threadIdx.x < " + x.computeThreads() + ") bulk_wait<0>();  // this warpgroup's O stores complete\n")
	}
}
