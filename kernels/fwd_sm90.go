package kernels

import (
	"fmt"
	"strings"

	"github.com/flashattn/flashattn/attn"
)

// The Hopper forward kernel (Variant.WGMMA, sm_90a).
//
// Each warpgroup owns 64 query rows (BM = 64 · warpgroups) and runs both
// products on the warpgroup tensor-core instructions: S = Q·Kᵀ with Q and K
// read from shared memory, O += P·V with P from registers. Tiles sit in
// shared memory in the layout those instructions read without conflicts: a
// row of 64 elements (128 bytes) per "atom" row, 16-byte chunk c of row r at
// chunk c ^ (r mod 8), wider head dims as several atoms one after the other.
// cp.async writes them that way, or, with Variant.TMA, the tensor memory
// accelerator (tma.go: one thread issues bulk copies of whole 64-column
// boxes that land swizzled, and the warps wait on an mbarrier per tile); a
// matrix descriptor names the swizzle.
//
// Schedule (per key block t, walked from the last block down, K and V each
// double-buffered):
//
//	top:    V(t) and K(t+1) have landed; start K(t+2) and V(t+1)
//	issue:  S' = Q·K(t+1)ᵀ, then O += P(t)·V(t), both asynchronous
//	wait S': mask and softmax of block t+1 while P(t)·V(t) runs: P(t+1), and
//	        each row's rescale factor
//	wait PV: O *= rescale
//
// so the softmax of one block overlaps the P·V product of the one before.
// The element-wise code (masks, softcap, bias, dropout, the online softmax
// and the epilogue) is the mma.sync kernel's: the accumulator layout per
// warp is the same, with 16 rows per warp (MT = 1).

// hopperGeom fills the shared-memory map of a WGMMA variant: Q, two K and
// two V buffers, each a whole number of 64-column atoms, plus 1024 bytes so
// that the kernel can align the tiles to the swizzle's 1024-byte period.
//
// With WarpsN = 2 the two warpgroups of a row group share its 64 query rows
// and split the work of each key block both ways: warpgroup w computes S for
// keys w·BN/2 .. (w+1)·BN/2 − 1 (half of the Q·Kᵀ product each), the row
// maxima are exchanged through shared memory (red), each writes its half of
// P into a shared P tile (two buffers of 64 rows × 128 bytes, swizzled), and
// each computes O += P·V for the whole block over half the value columns, a
// whole number of atoms each (DV padded to 128). Row sums stay per warpgroup
// until the epilogue adds them.
func (g *geom) hopperGeom(v Variant) {
	g.ntS = v.BlockN / 8
	g.sp, g.red = 0, 0
	if v.WarpsN == 2 {
		g.dvp = fwdHopperSplitDV(v.DV)
		g.ntO = g.dvp / 16
		g.ntS = v.BlockN / 16
		g.sp = 2 * 64 * 128
		g.red = 2 * v.BlockM * 4
	}
	g.vch = g.dvp * g.esz / 16
	g.ka = swizzleAtoms(g.dkp)
	g.va = swizzleAtoms(g.dvp)
	g.sq = g.ka * v.BlockM * 128
	if v.DoubleQ {
		g.sq *= 2 // [2][KATOMS][BM][64]: the tiles' Q buffers, used in turn
	}
	g.sk = 2 * g.ka * v.BlockN * 128
	g.sv = 2 * g.va * v.BlockN * 128
	if v.StoreO {
		g.so = g.va * v.BlockM * 128 // [warpgroups][VATOMS][64][64]: each warpgroup's O
	}
	if v.BiasStaged {
		g.sb = 2 * v.BlockM * v.BlockN * 2 // [2][BM][BN] 16-bit: the current and the next key block's bias
	}
	if v.ProducerDropout {
		g.skeep = 2 * keepStageBytes(v)
	}
	g.smem = g.sq + g.sk + g.sv + g.so + g.sb + g.sp + g.red + g.skeep + 1024
	if v.TMA {
		g.smem += tmaBarrierBytes
	}
	if v.WarpSpecialized {
		g.threads += 128 // the producer warpgroup
		g.smem += tmaBarrierBytes
		if v.ProducerDropout {
			g.smem += tmaBarrierBytes // the keep stages' barriers
		}
	}
}

// validateHopper reports what the WGMMA kernel cannot do.
func (v Variant) validateHopper() error {
	if v.DType != attn.BFloat16 && v.DType != attn.Float16 {
		return attn.Errorf(attn.ErrUnsupported, "kernels: WGMMA forward of %v (16-bit types only)", v.DType)
	}
	if v.LoadBytes != 16 {
		return attn.Errorf(attn.ErrUnsupported, "kernels: WGMMA forward with %d-byte loads (16 only)", v.LoadBytes)
	}
	rowsOK := v.WarpsN == 1 && v.WarpsM%4 == 0 && v.WarpsM <= 12 || v.WarpsN == 2 && v.WarpsM == 4
	if !rowsOK || v.BlockM != 16*v.WarpsM {
		return attn.Errorf(attn.ErrShape, "kernels: WGMMA forward wants 1 to 3 warpgroups of 64 rows, or one row group of two warpgroups (WarpsM %d, WarpsN %d, BlockM %d)", v.WarpsM, v.WarpsN, v.BlockM)
	}
	if v.WarpsN == 2 && (v.BlockN%16 != 0 || v.BlockN > 64) {
		return attn.Errorf(attn.ErrShape, "kernels: WGMMA forward with two warpgroups per row group wants BlockN a multiple of 16, at most 64 (the P tile is one 128-byte atom wide), not %d", v.BlockN)
	}
	if v.Stages != 2 || v.QInRegs {
		return attn.Errorf(attn.ErrShape, "kernels: WGMMA forward wants 2 stages and Q in shared memory")
	}
	if g := v.geom(); v.WarpsN == 1 && g.dvp > 320 || v.WarpsN == 2 && g.dvp > 512 {
		return attn.Errorf(attn.ErrUnsupported, "kernels: WGMMA forward of DV=%d with %d warpgroups per row group (at most 320 value columns with one, 256 each with two)", v.DV, v.WarpsN)
	}
	return nil
}

// hopperSource writes the whole module of a WGMMA variant.
func (x *gen) hopperSource() {
	x.prelude()
	x.raw(cParams())
	if x.v.TMA {
		x.raw(x.v.tmaParamsDecl())
	}
	x.hopperConstants()
	x.ptx()
	x.p("%s (Hopper)", PrimitivesBegin)
	x.raw(wgmmaPrimitives())
	if x.v.TMA {
		x.raw(tmaPrimitives())
	}
	if x.v.WarpSpecialized || x.v.StoreO {
		x.raw(WarpSpecializedPrimitives())
	}
	if x.v.StoreO {
		x.raw(tmaStorePrimitive)
	}
	for _, pr := range x.v.HopperProducts() {
		x.raw(pr.source(x.v.DType))
	}
	x.p("%s", PrimitivesEnd)
	if x.v.PolyExp > 0 {
		x.raw(ex2Poly)
	}
	if x.v.TMA {
		x.raw(tmaLoaders())
	}
	x.swizzledLoader()
	x.raw(rowOutSource)
	if x.v.Flat {
		x.raw(zeroColsSource)
	}
	if x.v.FlatStaged {
		x.raw(flatStagedHeadSource)
	}
	x.hopperProducts()
	x.dropoutFuncs()
	x.hopperKernel()
}

// HopperProducts returns the warpgroup product wrappers of a WGMMA
// variant: S = Q·Kᵀ (wgmma_s) and O += P·V (wgmma_o; with two warpgroups
// per row group P from the shared P tile, K-major, else from registers;
// past 256 value columns in two parts, wgmma_o2 the rest, as one product
// instruction has at most 256).
func (v Variant) HopperProducts() []WGMMAProduct {
	g := v.geom()
	ps := []WGMMAProduct{{Name: "wgmma_s", N: g.ntS * 8}}
	switch n := g.dvp / v.WarpsN; {
	case v.WarpsN == 2:
		return append(ps, WGMMAProduct{Name: "wgmma_o", N: n, TB: true})
	case n > 256:
		return append(ps, WGMMAProduct{Name: "wgmma_o", N: 256, TB: true, RegA: true}, WGMMAProduct{Name: "wgmma_o2", N: n - 256, TB: true, RegA: true})
	default:
		return append(ps, WGMMAProduct{Name: "wgmma_o", N: n, TB: true, RegA: true})
	}
}

// hopperConstants writes the compile-time geometry of a WGMMA variant.
func (x *gen) hopperConstants() {
	v, g := x.v, x.g
	x.p("")
	x.p("// ---- tile geometry (compile-time); Hopper kernel: warpgroup products on swizzled tiles")
	x.p("constexpr int BM = %d;        // query rows per CTA (64 per warpgroup)", v.BlockM)
	x.p("constexpr int BN = %d;        // keys per tile", v.BlockN)
	x.p("constexpr int WM = %d;        // warps along the query rows (16 rows each)", v.WarpsM)
	x.p("constexpr int WN = %d;        // warpgroups sharing a row group, each with BN/WN keys of S and DVP/WN value columns of O", v.WarpsN)
	if v.WarpSpecialized {
		x.p("constexpr int NTHREADS = %d; // threads per CTA (%d compute warpgroups and a producer)", g.threads, g.warps/4)
	} else {
		x.p("constexpr int NTHREADS = %d; // threads per CTA (%d warpgroups)", g.threads, g.warps/4)
	}
	x.p("constexpr int MT = 1;         // m16 row tiles per warp")
	x.p("constexpr int DKP = %d;       // q/k head dim padded (zero-filled) to a multiple of 16", g.dkp)
	x.p("constexpr int DVP = %d;       // v head dim padded to a multiple of 16 (128 with WN = 2)", g.dvp)
	x.p("constexpr int ESZ = %d;       // bytes per element of q, k, v, o (%v)", g.esz, v.DType)
	x.p("constexpr int DT = %d;        // element type: 1 fp16, 2 bf16", int(v.DType))
	x.p("constexpr int KCH = %d;       // 16-byte chunks per row of the Q and K tiles", g.kch)
	x.p("constexpr int VCH = %d;       // 16-byte chunks per row of the V tile", g.vch)
	x.p("constexpr int KATOMS = %d;    // 64-column swizzle atoms per Q/K row", g.ka)
	x.p("constexpr int VATOMS = %d;    // 64-column swizzle atoms per V row", g.va)
	x.p("constexpr int NT_S = %d;      // 8-key column blocks of this warpgroup's S", g.ntS)
	x.p("constexpr int NT_O = %d;      // 8-column blocks of this warpgroup's O", g.ntO)
	x.p("constexpr int KSTEPS = %d;    // k16 steps of S = Q·Kᵀ over DKP", g.dkp/16)
	x.p("constexpr int PSTEPS = %d;    // k16 steps of O += P·V over the BN keys", v.BlockN/16)
	x.p("constexpr int LB = 16;        // bytes per global load (cp.async)")
	x.p("constexpr int K_STAGE = %d;   // bytes of one K buffer [KATOMS][BN][64]", g.ka*v.BlockN*128)
	x.p("constexpr int V_STAGE = %d;   // bytes of one V buffer [VATOMS][BN][64]", g.va*v.BlockN*128)
	if v.WarpsN == 2 {
		x.p("constexpr int P_STAGE = %d;  // bytes of one P buffer [BM][64] (BN <= 64 keys used)", g.sp/2)
		x.p("// shared memory map (bytes, from a 1024-byte-aligned base): Q [KATOMS][BM][64] | K [2][KATOMS][BN][64] | V [2][VATOMS][BN][64] | P [2][BM][64] | red [WN][BM] floats")
	} else if v.DoubleQ {
		x.p("// shared memory map (bytes, from a 1024-byte-aligned base): Q [2][KATOMS][BM][64] | K [2][KATOMS][BN][64] | V [2][VATOMS][BN][64]")
	} else {
		x.p("// shared memory map (bytes, from a 1024-byte-aligned base): Q [KATOMS][BM][64] | K [2][KATOMS][BN][64] | V [2][VATOMS][BN][64]")
	}
	x.p("constexpr int SQ_OFF = 0;")
	if v.DoubleQ {
		x.p("constexpr int Q_STAGE = %d;  // bytes of one Q buffer [KATOMS][BM][64]; two, a persistent CTA's tiles using them in turn", g.sq/2)
	}
	x.p("constexpr int SK_OFF = %d;", g.sq)
	x.p("constexpr int SV_OFF = %d;", g.sq+g.sk)
	if v.WarpsN == 2 {
		x.p("constexpr int SP_OFF = %d;", g.sq+g.sk+g.sv)
		x.p("constexpr int RED_OFF = %d;", g.sq+g.sk+g.sv+g.sp)
	}
	if v.StoreO {
		x.p("constexpr int SO_OFF = %d;  // [warpgroups][VATOMS][64][64]: each warpgroup's O for the tensor-map store", g.sq+g.sk+g.sv)
	}
	if v.BiasStaged {
		x.p("constexpr int SB_OFF = %d;  // [2][warpgroups][BN/64][64][64] 16-bit, swizzled (sw_off): the staged bias of the current and the next key block", g.sq+g.sk+g.sv+g.so)
	}
	tiles := g.sq + g.sk + g.sv + g.so + g.sb + g.sp + g.red // the tiles' bytes, the keep stages after them
	if v.TMA {
		x.p("constexpr int BAR_OFF = %d;  // mbarriers of the TMA tiles: Q, K buffers 0 and 1, V buffers 0 and 1", tiles+g.skeep)
	}
	if v.WarpSpecialized {
		x.wsConstants()
		x.keepConstants(tiles)
	}
	x.p("constexpr int SMEM_BYTES = %d;  // including 1024 bytes of alignment slack", g.smem)
	x.p("")
}

// swizzledLoader writes the global → shared tile loader of the Hopper
// kernel: cp.async of 16-byte chunks into the 128-byte-swizzled layout.
func (x *gen) swizzledLoader() {
	x.raw(`// ---- global -> shared: a [ROWS x CH·16 bytes] tile by cp.async into the swizzled layout
// [CH/8 atoms][ROWS][128 bytes], chunk c of row r at atom c/8, row r, chunk (c mod 8) ^ (r mod 8).
// src points at row 0 of the tile, stride is the row stride in bytes; rows >= valid and bytes
// >= dbytes of a row are zero-filled (src-size 0 reads nothing, whatever the address).
template <int ROWS, int CH>
DEV u32 sw_off(int r, int c) { return (u32)((c >> 3) * ROWS * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4)); }
template <int ROWS, int CH>
DEV void load_sw(u32 dst, const char* src, i64 stride, int valid, int dbytes, int tid) {
  // CPR threads per row (a power of two >= CH; the threads past CH idle) copy chunk c of rows
  // r0, r0 + RSTEP, ...; when RSTEP is a multiple of 8 every row of a thread has the same swizzle
  constexpr int CPR = CH <= 4 ? 4 : CH <= 8 ? 8 : CH <= 16 ? 16 : CH <= 32 ? 32 : 64;
  constexpr int RSTEP = NTHREADS / CPR;
  constexpr int PASSES = (ROWS + RSTEP - 1) / RSTEP;
  static_assert(NTHREADS % CPR == 0, "threads per row");
  const int r0 = tid / CPR, c = tid % CPR;
  if (CH < CPR && c >= CH) return;
  const char* s = src + r0 * stride + c * 16;
  const i64 step = RSTEP * stride;
  const bool col = c * 16 < dbytes;
#pragma unroll
  for (int it = 0; it < PASSES; ++it) {
    const int r = r0 + it * RSTEP;
    const u32 off = RSTEP % 8 == 0 ? sw_off<ROWS, CH>(r0, c) + it * RSTEP * 128 : sw_off<ROWS, CH>(r, c);
    if (ROWS % RSTEP == 0 || r < ROWS) cp_async(dst + off, s, col && r < valid ? 16 : 0);
    s += step;
  }
}

`)
}

// hopperProducts writes the two warpgroup products of one key block.
func (x *gen) hopperProducts() {
	x.raw(`// ---- S[64 x BN/WN] = Q[64 x DKP] · K[BN/WN x DKP]ᵀ for this warpgroup, KSTEPS k16 steps.
// dq, dk: descriptors of the warpgroup's first Q row and of its first K row in the buffer; step kk reads
// columns 16kk.. : atom kk/4, byte 32·(kk mod 4) of the 128-byte row.
DEV void qk_wgmma(float (&s)[NT_S][4], u64 dq, u64 dk) {
  opaque(dq);  // the step descriptors are formed here, not hoisted out of the loop into registers
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk)
    wgmma_s(s, dq + (u64)(((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4),
            dk + (u64)(((kk >> 2) * BN * 128 + (kk & 3) * 32) >> 4), kk > 0);
}
`)
	switch {
	case x.v.WarpsN == 2:
		x.raw(`// ---- O[64 x DVP/WN] += P[64 x BN] · V[BN x DVP/WN]: PSTEPS k16 steps over the keys; P from
// the shared P tile (both warpgroups' keys), step kk at byte 32·kk of its 128-byte rows; V (rows
// of keys, value columns contiguous) read transposed, step kk 2048 bytes further
DEV void pv_wgmma(float (&o)[NT_O][4], u64 dp, u64 dv) {
  opaque(dp);
  opaque(dv);
#pragma unroll
  for (int kk = 0; kk < PSTEPS; ++kk) wgmma_o(o, dp + (u64)((kk * 32) >> 4), dv + (u64)((kk * 16 * 128) >> 4), 1);
}
`)
		return
	case x.g.ntO > 32:
		x.raw(`// ---- O[64 x DVP] += P[64 x BN] · V[BN x DVP]: PSTEPS k16 steps over the keys; P from
// registers, V (rows of keys, value columns contiguous) read transposed; step kk reads keys
// 16kk.. : 2048 bytes further
DEV void pv_wgmma(float (&o)[NT_O][4], const u32 (&pf)[PSTEPS][4], u64 dv) {
  // more than 256 columns: columns 0..255 and 256.. (from atom 4) as two products
  float (&oa)[32][4] = *reinterpret_cast<float (*)[32][4]>(&o[0]);
  float (&ob)[NT_O - 32][4] = *reinterpret_cast<float (*)[NT_O - 32][4]>(&o[32]);
#pragma unroll
  for (int kk = 0; kk < PSTEPS; ++kk) {
    wgmma_o(oa, pf[kk], dv + (u64)((kk * 16 * 128) >> 4));
    wgmma_o2(ob, pf[kk], dv + (u64)((4 * BN * 128 + kk * 16 * 128) >> 4));
  }
}
`)
	default:
		x.raw(`// ---- O[64 x DVP] += P[64 x BN] · V[BN x DVP]: PSTEPS k16 steps over the keys; P from
// registers, V (rows of keys, value columns contiguous) read transposed; step kk reads keys
// 16kk.. : 2048 bytes further
DEV void pv_wgmma(float (&o)[NT_O][4], const u32 (&pf)[PSTEPS][4], u64 dv) {
#pragma unroll
  for (int kk = 0; kk < PSTEPS; ++kk) wgmma_o(o, pf[kk], dv + (u64)((kk * 16 * 128) >> 4));
}
`)
	}
	x.raw(`// ---- S block (fp32, accumulator layout) -> P fragments (the A operand of pv_wgmma): the
// accumulator of two adjacent 8-key blocks is the register A layout of one k16 step
DEV void pack_p(u32 (&pf)[PSTEPS][4], const float (&s)[NT_S][4]) {
#pragma unroll
  for (int kk = 0; kk < PSTEPS; ++kk) {
    pf[kk][0] = pack2(s[2 * kk][0], s[2 * kk][1]);          // (row g,   keys 2c..)
    pf[kk][1] = pack2(s[2 * kk][2], s[2 * kk][3]);          // (row g+8, keys 2c..)
    pf[kk][2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);  // (row g,   keys 8+2c..)
    pf[kk][3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);  // (row g+8, keys 8+2c..)
  }
}

`)
}

// hopperKernel writes the entry point of a WGMMA variant.
func (x *gen) hopperKernel() {
	v := x.v
	split := v.WarpsN == 2
	x.raw(x.biasFuncs())
	x.nfFixupFuncs()
	if v.TMA {
		x.p("extern \"C\" __global__ void __launch_bounds__(NTHREADS, %d) %s(const __grid_constant__ TmaParams tp) {", v.MinBlocks, KernelName)
		x.raw("  const Params& p = tp.p;\n")
	} else {
		x.p("extern \"C\" __global__ void __launch_bounds__(NTHREADS, %d) %s(const Params p) {", v.MinBlocks, KernelName)
	}
	x.raw(`  extern __shared__ __align__(1024) unsigned char smem[];
  // the swizzle repeats every 1024 bytes: every tile starts on a 1024-byte boundary
  const u32 s_base = (smem_addr(smem) + 1023u) & ~1023u;
  const u32 sQ = s_base + SQ_OFF;  // [KATOMS][BM][64]
  const u32 sK = s_base + SK_OFF;  // [2][KATOMS][BN][64]
  const u32 sV = s_base + SV_OFF;  // [2][VATOMS][BN][64]
  const int tid = threadIdx.x, lane = tid & 31, warp = ` + x.v.warpIndexExpr() + `;
  const int wm = warp % WM;        // warp position: 16 query rows
  const int wn = warp / WM;        // warpgroup of the row group: value columns dv0 .. dv0 + DVP/WN - 1
  const int wg = wm >> 2;          // row group: rows 64·wg .. 64·wg + 63 of the block
`)
	if split {
		x.raw(`  const int key0 = wn * (BN / WN); // first key of this warpgroup's half of S
  const u32 sP = s_base + SP_OFF;  // [2][BM][64]: P of the current and of the next block
  float* red = (float*)(smem + (s_base - smem_addr(smem)) + RED_OFF);  // [WN][BM] row statistics
`)
	} else {
		x.raw("  constexpr int key0 = 0;          // (one warpgroup per row group: all keys of S)\n")
	}
	x.raw(`  const int dv0 = wn * (DVP / WN); // first value column of this warpgroup in O
  const int g = lane >> 2, c = lane & 3;  // accumulator fragment: row group g, column pair c
  const int wrow0 = wm * 16;              // first block row of this warp
  (void)wn; (void)key0; (void)dv0;
`)
	if v.Persistent {
		// the tiles of a persistent CTA: the producer's loop, then the compute warpgroups' loop
		// around the body of one tile
		x.wsPersistentPrologue()
		y := &gen{v: v, g: x.g}
		y.hopperTile("kv0")
		x.raw(indentLines(y.b.String(), "  "))
		x.raw("  }\n")
		x.pingPongEnd()
		x.storeOWait()
		x.raw("}\n")
		return
	}
	x.hopperTile("0")
	x.storeOWait()
	x.raw("}\n")
}

// hopperTile writes the work of one tile (BM query rows of one head and
// batch element) of the Hopper kernel, from its coordinates to its
// epilogue. first names the index of its first K and V buffers' tiles in
// the CTA's sequence of loads ("0", or kv0 for a persistent CTA's later
// tiles): buffer first & 1, phase first / 2.
func (x *gen) hopperTile(first string) {
	v := x.v
	split := v.WarpsN == 2
	x.ctaSetup()
	x.raw(`  // ---- matrix descriptors: Q (this warpgroup's 64 rows) and K (from its first key), K-major;
  // V, N-major (the next 64 value columns BN·128 bytes further: leading byte offset); 8-row
  // groups 1024 bytes apart
  const u64 dq = sw128_desc(` + x.qBuffer().buf + ` + wg * 64 * 128, 16, 1024);
  const u64 dk = sw128_desc(sK + key0 * 128, 16, 1024);
  const u64 dv = sw128_desc(sV + dv0 / 64 * BN * 128, BN * 128, 1024);  // from this warpgroup's first value column
`)
	if split {
		x.raw("  const u64 dp = sw128_desc(sP, 16, 1024);  // P tile, K-major (keys contiguous)\n")
	} else {
		x.raw("  u32 pf[PSTEPS][4];     // P of the current block (16-bit pairs): the A operand of O += P·V\n")
	}
	x.raw(`  float alpha_r[MT][2];  // per-row rescale of O for the next block (deferred)

`)
	x.hopperPrologueLoads()
	x.pingPongStart(false)
	x.raw(`  {
    const int n0 = (nb_hi - 1) * BN;  // first key of the block
    float s[MT][NT_S][4];
`)
	x.pingPong("    ", ppTurn)
	dk0, buf0 := "dk", "0"
	if first != "0" {
		dk0, buf0 = fmt.Sprintf("dk + (u64)(((%s & 1) * K_STAGE) >> 4)", first), first+" & 1"
	}
	x.p(`    wgmma_fence();
    qk_wgmma(s[0], dq, %s);
    wgmma_commit();`, dk0)
	x.pingPong("    ", ppPass)
	x.blockBias("    ", first, "n0", "nb_hi - 2 >= nb_lo")
	x.earlyDropBits("    ", "n0", first)
	x.raw(`    wgmma_wait<0>();
    fence_acc(s[0]);
`)
	x.wsRelease("    ", "K", buf0)
	x.releaseQ("    ", "nb_hi - 1 == nb_lo")
	x.blockSoftmax("    ")
	if split {
		x.storePSwizzled("    ", "0")
	} else {
		x.raw("    pack_p(pf, s[0]);\n")
	}
	x.p(`  }

  // ---- main loop over key blocks, last to first
  for (int nb = nb_hi - 1, it = %s; nb >= nb_lo; --nb, ++it) {
    const int buf = it & 1;  // buffer of K(nb) and V(nb)`, first)
	x.hopperLoopLoads()
	pv := "pv_wgmma(o[0], pf, dv + (u64)((buf * V_STAGE) >> 4));"
	if split {
		pv = "pv_wgmma(o[0], dp + (u64)((buf * P_STAGE) >> 4), dv + (u64)((buf * V_STAGE) >> 4));"
	}
	waitK, waitV := "", ""
	if v.TMA {
		waitK = "      mbar_wait(barK + 8 * (buf ^ 1), ((it + 1) >> 1) & 1);  // K(nb - 1) landed\n"
		waitV = "      mbar_wait(barV + 8 * buf, (it >> 1) & 1);  // V(nb) landed\n"
	}
	x.raw(`    fence_acc(o[0]);
    if (nb > nb_lo) {  // a next block exists (uniform over the CTA)
      float s[MT][NT_S][4];  // S of the next block, then its P
` + waitK)
	x.pingPong("      ", ppTurn)
	x.raw(`      wgmma_fence();
      qk_wgmma(s[0], dq, dk + (u64)(((buf ^ 1) * K_STAGE) >> 4));
      wgmma_commit();
`)
	x.rescaleEarly("      ")
	x.raw(waitV)
	x.p("      %s", pv)
	x.raw("      wgmma_commit();\n")
	x.pingPong("      ", ppPass)
	x.blockBias("      ", "it + 1", "(nb - 1) * BN", "nb - 2 >= nb_lo")
	x.earlyDropBits("      ", "(nb - 1) * BN", "it + 1")
	x.raw(`      wgmma_wait<1>();  // S of the next block is done; P·V of this one still runs
      fence_acc(s[0]);
`)
	x.wsRelease("      ", "K", "buf ^ 1")
	x.releaseQ("      ", "nb - 1 == nb_lo")
	x.raw("      const int n0 = (nb - 1) * BN;  // first key of the next block\n")
	x.blockSoftmax("      ")
	if split {
		x.storePSwizzled("      ", "buf ^ 1")
	}
	x.raw("      wgmma_wait<0>();  // P·V of this block is done\n")
	x.wsRelease("      ", "V", "buf")
	x.raw("      fence_acc(o[0]);\n")
	if !v.EarlyRescale {
		x.raw(indentLines(x.rescaleO(), "      "))
	}
	if !split {
		x.raw("      pack_p(pf, s[0]);\n")
	}
	x.raw("    } else {  // the last block: P·V only\n" + waitV)
	x.pingPong("      ", ppTurn)
	x.rescaleEarly("      ")
	if !v.EarlyRescale {
		x.raw("      wgmma_fence();\n")
	}
	x.p("      %s", pv)
	x.raw("      wgmma_commit();\n")
	x.pingPong("      ", ppPassLast)
	x.raw("      wgmma_wait<0>();\n")
	if v.Persistent {
		x.wsRelease("      ", "V", "buf") // the next tile's loads reuse it
	}
	x.raw(`      fence_acc(o[0]);
    }
  }
`)
	if v.Persistent {
		x.wsTileDone()
	} else {
		x.recomputeCoords()
	}
	x.epilogue()
	if v.WarpSpecialized {
		x.wsVote()
	} else {
		x.nfFixup()
	}
}

// rescaleO returns the statement block that rescales O by each row's
// factor of the block whose softmax ran last (alpha_r); with LazyRescale
// only in a warp one of whose rows moved its reference (a factor other
// than 1).
func (x *gen) rescaleO() string {
	mul := `#pragma unroll
for (int nt = 0; nt < NT_O; ++nt) {  // ---- O *= alpha (the rescale of the block whose softmax ran last)
  o[0][nt][0] *= alpha_r[0][0];
  o[0][nt][1] *= alpha_r[0][0];
  o[0][nt][2] *= alpha_r[0][1];
  o[0][nt][3] *= alpha_r[0][1];
}
`
	if !x.v.LazyRescale {
		return mul
	}
	return "if (__any_sync(FULL_MASK, alpha_r[0][0] != 1.f || alpha_r[0][1] != 1.f)) {  // lazy rescale: some row of this warp moved its reference\n" +
		indentLines(mul, "  ") + "}\n"
}

// rescaleEarly writes, for a variant with EarlyRescale, the rescale of O
// while S = Q·Kᵀ runs on the tensor cores, just before O += P·V is issued,
// and the fence that product needs after O's registers were written (the
// first block's factor is 0, and O is still 0 then).
func (x *gen) rescaleEarly(indent string) {
	if !x.v.EarlyRescale {
		return
	}
	x.raw(indentLines(x.rescaleO(), indent) + indent + "wgmma_fence();  // O's registers were written\n")
}

// storePSwizzled writes, for two warpgroups per row group, this
// warpgroup's half of P (16-bit pairs) into P buffer buf, in the swizzled
// layout the P·V product reads, then fences it for that product.
func (x *gen) storePSwizzled(indent, buf string) {
	x.raw(indentLines(strings.ReplaceAll(`// ---- P (this warpgroup's keys) -> shared P tile [BM][64], chunk c of row r at c ^ (r mod 8)
#pragma unroll
for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = wrow0 + g + 8 * hf, col = key0 + nt * 8 + 2 * c;
    sts32(sP + (BUF) * P_STAGE + sw_off<BM, 8>(r, col >> 3) + (col & 7) * ESZ,
          pack2(s[0][nt][2 * hf], s[0][nt][2 * hf + 1]));
  }
fence_proxy_async();  // P is read by the asynchronous proxy after the next barrier
`, "BUF", buf), indent))
}

// indentLines prefixes every non-empty line of s, except preprocessor
// lines, with indent.
func indentLines(s, indent string) string {
	var b strings.Builder
	for _, l := range strings.SplitAfter(s, "\n") {
		if l != "" && l != "\n" && !strings.HasPrefix(l, "#") {
			b.WriteString(indent)
		}
		b.WriteString(l)
	}
	return b.String()
}

// blockBias writes the bias of the scores of K tile num's key block (its
// first key n0) for the softmax, under the block's S product: read from
// the stage (BiasStaged), or loaded ahead from global memory
// (biasPrefetch; next: the condition under which the block after it
// exists, whose rows biasNextPrefetch brings into L1).
func (x *gen) blockBias(indent, num, n0, next string) {
	if x.v.BiasStaged {
		x.biasStageRead(indent, num)
		return
	}
	x.biasNextPrefetch(indent, n0, next)
	x.biasPrefetch(indent, n0)
}

// biasNextPrefetched reports whether the Hopper forward prefetches the
// next key block's bias rows into L1 (biasNextPrefetch): a bias read from
// global memory, whose loads issued under the block's S product are not
// back when it is at small key tiles (ncu's long-scoreboard stalls on the
// conversions after them).
func (x *gen) biasNextPrefetched() bool {
	v := x.v
	return v.WGMMA && v.Bias != BiasNone && !v.BiasStaged
}

// biasNextPrefetch writes, where biasNextPrefetched, the prefetch into L1
// of the bias rows of the key block after the one whose first key is n0
// (the blocks run last first: first key n0 − BN; next, the condition under
// which it exists): the lanes of column pair 0 one line at its first key
// in each of their rows.
func (x *gen) biasNextPrefetch(indent, n0, next string) {
	if !x.biasNextPrefetched() {
		return
	}
	x.raw(indentLines(fmt.Sprintf(`// ---- the next key block's bias rows into L1, so that its loads find them there
if ((%[2]s) && c == 0) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      if (brow[mt][hf] != nullptr) prefetch_l1(brow[mt][hf] + (i64)((%[1]s) - BN + key0) * bias_km);
}
`, n0, next), indent))
}

// biasPrefetch writes, for a variant with a bias, the loads of the bias of
// the key block whose first key is n0 (an expression) into bpre, this
// thread's elements in the layout of s, issued while the block's S product
// runs so that their latency hides under it; transform then adds them.
func (x *gen) biasPrefetch(indent, n0 string) {
	if x.v.Bias == BiasNone {
		return
	}
	x.raw(indentLines(fmt.Sprintf(`// ---- the bias of this block's scores, loaded while S runs (0 past the keys)
float bpre[MT][NT_S][4];
{
  const int nb0 = %s;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
%s        bpre[mt][nt][e] = br != nullptr && j < m ? bias_load(br + j * bias_km) : 0.f;
      }
}
`, n0, indentLines(biasElement("nb0"), "        ")), indent))
}

// blockSoftmax writes the element-wise stage of one key block whose first key
// is n0 and whose scores are in s: score transform, mask, online softmax
// (rescale deferred into alpha_r), dropout. The shared writers indent for
// the mma.sync kernel's loop body (4 spaces); indent is where this block
// sits, and the lines move by the difference.
func (x *gen) blockSoftmax(indent string) {
	y := &gen{v: x.v, g: x.g}
	y.raw("    (void)n0;\n")
	y.transform()
	y.maskBoundary()
	y.maskApply()
	if x.v.splitKeys() {
		y.softmaxPartialMax()
		y.raw("    __syncthreads();  // both warpgroups' row maxima are in red\n")
	}
	y.softmaxUpdate(true)
	switch {
	case x.v.ProducerDropout:
		y.raw("    apply_keep_words(s, dkeep);  // ---- dropout, by the keep warps' bits\n")
	case x.v.EarlyDropout:
		y.raw("    apply_keep(s, dkeep);  // ---- dropout, by the bits drawn before the wait\n")
	case x.v.Dropout:
		y.raw("    apply_dropout(s, p, m0 + wrow0 + p.drop_q0, n0 + key0 + p.drop_k0, (u32)(b * p.drop_heads + p.drop_h0 + h), lane);  // ---- dropout\n")
	}
	x.raw(indentLines(y.b.String(), strings.Repeat(" ", max(0, len(indent)-4))))
}

// loadSW returns the statement that loads block nb of K or V into buffer buf.
func (x *gen) loadSW(t, buf, nb string) string {
	if t == "K" {
		return fmt.Sprintf("load_sw<BN, KCH>(sK + (%s) * K_STAGE, gK + (i64)(%s) * BN * k_rs, k_rs, m - (%s) * BN, p.d_k * ESZ, tid);", buf, nb, nb)
	}
	return fmt.Sprintf("load_sw<BN, VCH>(sV + (%s) * V_STAGE, gV + (i64)(%s) * BN * v_rs, v_rs, m - (%s) * BN, p.d_v * ESZ, tid);", buf, nb, nb)
}

// hopperPrologueLoads writes the loads before the first product: Q, K and V
// of the first key block and K of the second, then the wait for Q and the
// first K.
func (x *gen) hopperPrologueLoads() {
	if x.v.Persistent {
		x.wsPersistentWaits()
		return
	}
	if x.v.WarpSpecialized {
		x.wsPrologue()
		x.flatZeroQ()
		return
	}
	if !x.v.TMA {
		x.raw("  // ---- prologue: Q, K and V of the first block, K of the second\n")
		x.p("  load_sw<BM, KCH>(sQ, gQ, q_rs, rows, p.d_k * ESZ, tid);")
		x.p("  %s", x.loadSW("K", "0", "nb_hi - 1"))
		x.p("  cp_commit();")
		x.p("  %s", x.loadSW("V", "0", "nb_hi - 1"))
		x.p("  if (nb_hi - 2 >= nb_lo) %s", x.loadSW("K", "1", "nb_hi - 2"))
		x.raw(`  cp_commit();
  cp_wait<1>();  // Q and K of the first block
  fence_proxy_async();
  __syncthreads();
`)
		return
	}
	x.raw(`  // ---- mbarriers of the TMA tiles. K(j) and V(j), j = nb_hi-1-s, go to buffer s & 1 and
  // complete phase s >> 1 of that buffer's barrier: a wait on K or V number s waits for parity (s >> 1) & 1
  const u32 barQ = s_base + BAR_OFF, barK = barQ + 8, barV = barQ + 24;  // buffer b: barK + 8b, barV + 8b
  if (tid == 0) {
    mbar_init(barQ, 1);
    mbar_init(barK, 1);
    mbar_init(barK + 8, 1);
    mbar_init(barV, 1);
    mbar_init(barV + 8, 1);
    mbar_fence_init();
  }
  __syncthreads();
`)
	x.raw(x.tmaCoords())
	x.raw(fmt.Sprintf(`  // ---- prologue: Q, K and V of the first block, K of the second (one thread issues the copies)
  if (tid == 0) {
    %s
    %s
    %s
    if (nb_hi - 2 >= nb_lo) %s
  }
`, x.tmaTile("BM", "KATOMS", "sQ", "mq_", "barQ", "m0"), x.tmaTile("BN", "KATOMS", "sK", "mk_", "barK", "(nb_hi - 1) * BN"),
		x.tmaTile("BN", "VATOMS", "sV", "mv_", "barV", "(nb_hi - 1) * BN"), x.tmaTile("BN", "KATOMS", "sK + K_STAGE", "mk_", "barK + 8", "(nb_hi - 2) * BN")))
	x.raw(`  mbar_wait(barQ, 0);  // Q
  mbar_wait(barK, 0);  // K of the first block
`)
	x.flatZeroQ()
}

// flatZeroQ writes, for a kernel reading flat rows, the zeroing of Q's
// columns outside the head once Q has landed.
func (x *gen) flatZeroQ() {
	if !x.v.Flat {
		return
	}
	x.p(`  // ---- flat rows: Q's columns outside [sq_, sq_ + d_k) hold the neighbouring heads' elements (or
  // zeros); zero them, so that S = Q·Kᵀ takes nothing from K's columns there
  zero_cols<BM>(smem + (s_base - smem_addr(smem)) + SQ_OFF, sq_, p.d_k, DKP, tid, %s);
  fence_proxy_async();
  %s`, x.computeThreads(), x.computeSync())
}

// tmaCoords writes the tensor-map coordinates of the CTA's tiles: the map
// (mq_, mk_, mv_), head index (hq_, hk_, hv_) and first column (cq_, ck_,
// cv_) of the boxes of Q, K and V; with Flat, the head index is 0 and the
// column is flat_shift columns before the head's start in the concatenated
// heads (a multiple of 16 where the head fits after it, else of 8), and
// sq_, sk_, sv_ are the shifts of Q, K (the same: one query head per key
// head) and V. With FlatStaged, a head whose shift would run past the padded
// width takes the staging copies' maps instead (shift 0, its index among
// the staged heads).
func (x *gen) tmaCoords() string {
	if !x.v.Flat {
		s := `  // tensor-map coordinates: (column, row, head, batch)
  const TensorMap *mq_ = &tp.q, *mk_ = &tp.k, *mv_ = &tp.v;
  const int hq_ = h, hk_ = kvh, hv_ = kvh, cq_ = 0, ck_ = 0, cv_ = 0;
`
		if x.v.Varlen {
			s += `  // a packed batch: the maps span every sequence's rows (batch extent 1), the sequence's rows start at
  // qs and ks; rows past the sequence are the next one's, masked (keys) or never stored (queries)
  const int qrow_ = (int)qs, krow_ = (int)ks;
`
		}
		return s
	}
	s := `  // tensor-map coordinates (column, row, head, batch) over flat rows: head h's elements start at column
  // h·d_k of its position's row; the boxes start flat_shift columns before it (at a multiple of 16 or 8),
  // so the tile holds the head shifted right by sq_ (Q; K by sk_, the same with one query head per key
  // head) or sv_ (V) columns
`
	if !x.v.FlatStaged {
		return s + fmt.Sprintf(`  const TensorMap *mq_ = &tp.q, *mk_ = &tp.k, *mv_ = &tp.v;
  const int hq_ = 0, hk_ = 0, hv_ = 0;
  const int sq_ = flat_shift(h, p.d_k, %[1]d), sk_ = flat_shift(kvh, p.d_k, %[1]d), sv_ = flat_shift(kvh, p.d_v, %[2]d);
  const int cq_ = h * p.d_k - sq_, ck_ = kvh * p.d_k - sk_, cv_ = kvh * p.d_v - sv_;
  (void)sv_;
`, FlatWidth(x.v.DK), FlatWidth(x.v.DV))
	}
	return s + fmt.Sprintf(`  // ... unless the shift would run past the padded width (FlatWidth: %[1]d columns for q and k, %[2]d for
  // v): such a head comes from the staging copies, which hold only those heads, in order, zero past the
  // head dim (FlatStagedHeads)
  const unsigned selk_ = flat_staged_mask(p.d_k, %[1]d), selv_ = flat_staged_mask(p.d_v, %[2]d);
  const bool stk = (selk_ >> (h & 7)) & 1u, stv = (selv_ >> (kvh & 7)) & 1u;  // (h = kvh: one query head per key head)
  const TensorMap *mq_ = stk ? &tp.qs : &tp.q, *mk_ = stk ? &tp.ks : &tp.k, *mv_ = stv ? &tp.vs : &tp.v;
  const int hq_ = stk ? selected_heads(h, selk_) : 0, hk_ = stk ? selected_heads(kvh, selk_) : 0;
  const int hv_ = stv ? selected_heads(kvh, selv_) : 0;
  const int sq_ = stk ? 0 : flat_shift(h, p.d_k, %[1]d), sk_ = stk ? 0 : flat_shift(kvh, p.d_k, %[1]d);
  const int sv_ = stv ? 0 : flat_shift(kvh, p.d_v, %[2]d);
  const int cq_ = stk ? 0 : h * p.d_k - sq_, ck_ = stk ? 0 : kvh * p.d_k - sk_, cv_ = stv ? 0 : kvh * p.d_v - sv_;
  (void)sv_;
  // the launch may have started before the pack kernel that makes the copies finished (LaunchEarly): a
  // block that reads them waits for it; the others read q, k and v, which were written before the pack
  if (stk || stv) griddep_wait();
`, FlatWidth(x.v.DK), FlatWidth(x.v.DV))
}

// tmaTile returns the call of tma_tile that loads a tile of rows rows and
// atoms column atoms into dst from map m (mq_, mk_ or mv_: its head and
// column coordinates hq_, cq_, …) on barrier bar, from row row of the
// sequence: in a packed batch (Varlen) from the sequence's first row in the
// map (qrow_ or krow_) and batch 0.
func (x *gen) tmaTile(rows, atoms, dst, m, bar, row string) string {
	t := strings.TrimSuffix(strings.TrimPrefix(m, "m"), "_") // q, k or v
	batch := "b"
	if x.v.Varlen {
		first := "krow_"
		if t == "q" {
			first = "qrow_"
		}
		row, batch = first+" + "+row, "0"
	}
	return fmt.Sprintf("tma_tile<%s, %s>(%s, %s, %s, %s, h%s_, %s, c%s_);", rows, atoms, dst, m, bar, row, t, batch, t)
}

// hopperLoopLoads writes the top of a main-loop iteration: once every
// warpgroup is done with K(nb) and V(nb + 1), their buffers take K(nb - 2)
// and V(nb - 1).
func (x *gen) hopperLoopLoads() {
	if x.v.WarpSpecialized {
		return // the producer warpgroup loads (fwd_sm90_ws.go)
	}
	if !x.v.TMA {
		x.raw(`    cp_wait<0>();            // V(nb) and K(nb - 1) landed
    fence_proxy_async();
    __syncthreads();         // ... for every thread; and every warpgroup is done with K(nb), V(nb + 1)
`)
		if x.v.WarpsN == 2 {
			x.raw("                             // (and with P(nb + 1)); P(nb) is whole\n")
		}
		x.p("    if (nb - 2 >= nb_lo) %s", x.loadSW("K", "buf", "nb - 2"))
		x.p("    if (nb - 1 >= nb_lo) %s", x.loadSW("V", "buf ^ 1", "nb - 1"))
		x.raw("    cp_commit();\n")
		return
	}
	x.raw(`    __syncthreads();  // every warpgroup is done with K(nb) and V(nb + 1)`)
	if x.v.WarpsN == 2 {
		x.raw(" (and with P(nb + 1)); P(nb) is whole")
	}
	x.raw(fmt.Sprintf(`
    if (tid == 0) {
      if (nb - 2 >= nb_lo) %s
      if (nb - 1 >= nb_lo) %s
    }
`, x.tmaTile("BN", "KATOMS", "sK + buf * K_STAGE", "mk_", "barK + 8 * buf", "(nb - 2) * BN"),
		x.tmaTile("BN", "VATOMS", "sV + (buf ^ 1) * V_STAGE", "mv_", "barV + 8 * (buf ^ 1)", "(nb - 1) * BN")))
}
