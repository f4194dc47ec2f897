package kernels

import (
	"fmt"
	"strings"

	"github.com/flashattn/flashattn/attn"
)

// The Hopper dK/dV kernel (BwdVariant.WGMMA, sm_90a).
//
// A block owns BN = 128 keys of one (batch, key head) and two warpgroups,
// warpgroup w owning keys 64w .. 64w + 63. For every query head of the group
// and every query block of BM = 64 rows that sees the keys:
//
//	S  = Q·Kᵀ, dP = dO·Vᵀ     warpgroup w: the 64 queries × its 64 keys
//	                          (both operands from shared memory, K-major)
//	P, dS                      the mma.sync kernel's element-wise code
//	                          (masks, softcap, bias, dropout), written to
//	                          shared memory in the swizzled layout
//	dV += Pᵀ·dO, dK += dSᵀ·Q   warpgroup w: its 64 keys; Pᵀ and dSᵀ read
//	                          transposed from shared memory
//	dQ += dS·K (AtomicDQ)      the block's dS over all 128 keys times K,
//	                          split by columns of dQ over the warpgroups
//	                          (one warpgroup when DK is not 128), added to
//	                          the fp32 accumulator with vector atomics
//
// Every product is a warpgroup instruction (wgmma.mma_async); dK and dV
// stay in registers for the whole loop. Tiles in shared memory use the
// forward's 128-byte swizzle (see hopper.go): rows of 64 elements, 16-byte
// chunk c of row r at chunk c ^ (r mod 8), wider rows as several such atoms.

// Tile of the Hopper dK/dV kernel.
const (
	bwdHopperBM = 64  // query rows per step
	bwdHopperBN = 128 // keys per block (64 per warpgroup)
)

// bwdHopperTile is the dK/dV tile of WGMMA variants.
var bwdHopperTile = BwdTile{BlockM: bwdHopperBM, BlockN: bwdHopperBN, Warps: 8, Stages: 2, MinBlocks: 1}

// BwdHopperOK reports whether the Hopper dK/dV kernel can run a backward
// of v's dtype, head dims and load kind (ignoring v.WGMMA itself): 16-bit
// elements, rows read with 16-byte copies (Vector or Staged), padded head
// dims of at most 128 (dK and dV of 64 keys stay in one warpgroup's
// registers), and no tile override.
func BwdHopperOK(v BwdVariant) bool {
	return (v.DType == attn.BFloat16 || v.DType == attn.Float16) && (v.Vector || v.Staged) &&
		v.DKPad() <= 128 && v.DVPad() <= 128 && v.Tiles.DKDV.BlockM == 0
}

// bwdHopperLayout is the shared-memory map of the Hopper dK/dV kernel:
// every tile starts on a 1024-byte boundary (the swizzle's period) from a
// base the kernel aligns, hence 1024 bytes of slack.
func (v BwdVariant) bwdHopperLayout() bwdSmemLayout {
	ka, va := (v.DKPad()+63)/64, (v.DVPad()+63)/64
	bm, bn := bwdHopperBM, bwdHopperBN
	var l bwdSmemLayout
	add := func(name string, bytes int) {
		l.add(name, (bytes+1023)/1024*1024)
	}
	add("sK", ka*bn*128)     // [KATOMS][BN][64]
	add("sV", va*bn*128)     // [VATOMS][BN][64]
	add("sQ", 2*ka*bm*128)   // [2][KATOMS][BM][64]
	add("sdO", 2*va*bm*128)  // [2][VATOMS][BM][64]
	add("sP", bn/64*bm*128)  // [BN/64][BM][64]
	add("sdS", bn/64*bm*128) // [BN/64][BM][64]
	add("sL", 2*bm*4)        // [2][BM] LSE2
	add("sD", 2*bm*4)        // [2][BM] Delta
	l.total += 1024
	return l
}

// hopperPrelude writes the device functions only the Hopper kernel uses.
func (g *bwdGen) hopperPrelude(b *strings.Builder) {
	v := g.v
	b.WriteString(PrimitivesBegin + " (Hopper)\n")
	b.WriteString(ptxCpAsync(cpAsync{name: "cp_async_sw", bytes: 16, zfill: true, memory: true}))
	b.WriteString(wgmmaPrimitives())
	kq := v.DKPad()
	if kq == 128 {
		kq = 64 // dQ split over the two warpgroups
	}
	b.WriteString(wgmmaSS("wg_s", v.DType, 64))                      // S, dP: 64 queries x 64 keys
	b.WriteString(wgmmaSST("wg_dv", v.DType, v.DVPad(), true, true)) // dV += Pᵀ·dO
	if v.DKPad() != v.DVPad() {
		b.WriteString(wgmmaSST("wg_dk", v.DType, v.DKPad(), true, true)) // dK += dSᵀ·Q
	}
	if v.AtomicDQ {
		b.WriteString(wgmmaSST("wg_dq", v.DType, kq, false, true)) // dQ = dS·K
	}
	b.WriteString(PrimitivesEnd + "\n")
	b.WriteString(`// sw_off is the byte offset of 16-byte chunk c of row r in a swizzled tile of ROWS rows:
// atom c/8, row r, chunk (c mod 8) ^ (r mod 8).
template <int ROWS>
DEV u32 sw_off(int r, int c) { return (u32)((c >> 3) * ROWS * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4)); }
// sw_elem is the element offset of (row i, column j) in a swizzled 16-bit tile of ROWS rows.
template <int ROWS>
DEV int sw_elem(int i, int j) { return (j >> 6) * ROWS * 64 + i * 64 + ((((j & 63) >> 3) ^ (i & 7)) << 3) + (j & 7); }
// load_sw copies rows [0, R) of a head slice (row r at g + r*rs) into the swizzled tile at shared
// address s; rows >= rlim and columns >= D read as zero (16-byte copies, CH chunks a row).
template <int R, int CH, int D, int NTH>
DEV void load_sw(u32 s, const T* g, long long rs, int rlim) {
  constexpr int TOT = R * CH;
#pragma unroll
  for (int it = 0; it < (TOT + NTH - 1) / NTH; ++it) {
    const int c = it * NTH + threadIdx.x;
    if (TOT % NTH == 0 || c < TOT) {
      const int r = c / CH, ch = c % CH;
      const bool ok = r < rlim && ch * 8 < D;
      cp_async_sw(s + sw_off<R>(r, ch), ok ? (const void*)(g + r * rs + ch * 8) : (const void*)g, ok ? 16 : 0);
    }
  }
}
`)
}

// dkdvKernelHopper writes BwdDKDVKernel for WGMMA variants.
func (g *bwdGen) dkdvKernelHopper(b *strings.Builder) {
	v := g.v
	t := bwdHopperTile
	l := v.bwdHopperLayout()
	dkp, dvp := v.DKPad(), v.DVPad()
	ka, va := (dkp+63)/64, (dvp+63)/64
	split := dkp == 128 // dQ columns split over the warpgroups
	fmt.Fprintf(b, `// dK/dV (Hopper, warpgroup products): one block per (key block of %[1]d keys, batch, key head); loops
// over the query heads of the group and the query blocks that see the keys; warpgroup w owns keys
// 64w .. 64w+63, whose dK and dV stay in its registers and are written once.
// grid (ceil(M/%[1]d), B, Hkv), 256 threads, %[2]d bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(256, 1) %[3]s(const BwdParams p) {
  constexpr int BM = %[4]d, BN = %[1]d, NTH = 256;
  constexpr int DK = %[5]d, DV = %[6]d, DKP = %[7]d, DVP = %[8]d;
  constexpr int KCH = DKP / 8, VCH = DVP / 8;  // 16-byte chunks of a q/k row and of a dO/v row
  constexpr int Q_STAGE = %[9]d, DO_STAGE = %[10]d;  // bytes of one stage of the q and dO tiles
  (void)DK; (void)DV;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int wg = warp >> 2;  // warpgroup: keys 64·wg .. 64·wg + 63 of the block
  (void)tid; (void)g; (void)t4;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // the swizzle repeats every 1024 bytes: tiles start on 1024-byte boundaries
  unsigned char* smem = smem_raw + (((smem_u32(smem_raw) + 1023u) & ~1023u) - smem_u32(smem_raw));
  const u32 s0 = smem_u32(smem);
`, t.BlockN, l.total, BwdDKDVKernel, t.BlockM, v.DK, v.DV, dkp, dvp, ka*t.BlockM*128, va*t.BlockM*128)
	for _, name := range []string{"sK", "sV", "sQ", "sdO"} {
		fmt.Fprintf(b, "  const u32 %s = s0 + %d;\n", name, l.off[name])
	}
	fmt.Fprintf(b, `  T* sP = reinterpret_cast<T*>(smem + %d);    // P  [BN/64][BM][64], swizzled
  T* sdS = reinterpret_cast<T*>(smem + %d);   // dS [BN/64][BM][64], swizzled
  float* sL = reinterpret_cast<float*>(smem + %d);
  float* sD = reinterpret_cast<float*>(smem + %d);
  const u32 sPa = s0 + %d, sdSa = s0 + %d;
`, l.off["sP"], l.off["sdS"], l.off["sL"], l.off["sD"], l.off["sP"], l.off["sdS"])
	g.dkdvQueryRange(b)
	fmt.Fprintf(b, `  const T* gk = %s;
  const T* gv = %s;
  // stage s of the query-side tiles for iteration it: q, dO, LSE2, Delta rows
  auto load_q = [&](int it, int s) {
    const int hq = kvh * G + it / nib, iq = (ib0 + it %% nib) * BM;
    load_sw<BM, KCH, DK, NTH>(sQ + s * Q_STAGE, %s, %s, n - iq);
    load_sw<BM, VCH, DV, NTH>(sdO + s * DO_STAGE, %s, %s, n - iq);
    const long long so = b * p.stat_sb + hq * p.stat_sh + qr0 + iq;
    load_stats<BM, NTH>(sL + s * BM, sD + s * BM, p.lse2 + so, p.delta + so, n - iq);
  };
`, g.in("k").at("j0", "kvh"), g.in("v").at("j0", "kvh"),
		g.in("q").at("iq", "hq"), g.in("q").sr, g.in("do").at("iq", "hq"), g.in("do").sr)
	tdk := bwdWarpTile{Wm: 8, Wn: 1, TM: 16, TN: dkp, MT: 1, NT: dkp / 8, Warps: 8}
	tdv := bwdWarpTile{Wm: 8, Wn: 1, TM: 16, TN: dvp, MT: 1, NT: dvp / 8, Warps: 8}
	b.WriteString("  " + strings.ReplaceAll(tdk.accDecl("accdK"), "\n", "\n  "))
	b.WriteString(strings.ReplaceAll(tdv.accDecl("accdV"), "\n", "\n  "))
	fmt.Fprintf(b, `if (iters > 0) {
    load_sw<BN, KCH, DK, NTH>(sK, gk, %s, m - j0);
    load_sw<BN, VCH, DV, NTH>(sV, gv, %s, m - j0);
    load_q(0, 0);
    cp_async_commit();
  }
  // ---- matrix descriptors (128-byte swizzle; 8-row groups 1024 bytes apart)
  // S = Q·Kᵀ, dP = dO·Vᵀ: this warpgroup's 64 rows of K and V, K-major
  const u64 dKs = sw128_desc(sK + wg * 64 * 128, 16, 1024), dVs = sw128_desc(sV + wg * 64 * 128, 16, 1024);
  // dV += Pᵀ·dO, dK += dSᵀ·Q: this warpgroup's 64 columns (keys) of P and dS, read M-major
  const u64 dPt = sw128_desc(sPa + wg * BM * 128, 16, 1024), dSt = sw128_desc(sdSa + wg * BM * 128, 16, 1024);
`, g.in("k").sr, g.in("v").sr)
	if v.AtomicDQ {
		if split {
			b.WriteString(`  // dQ = dS·K: dS K-major (atoms of 64 keys BM·128 bytes apart); K read N-major from this
  // warpgroup's 64 columns of dQ (the next 64 columns BN·128 bytes further)
  const int dq0 = wg * 64;  // first dQ column of this warpgroup
  const u64 dSk = sw128_desc(sdSa, 16, 1024), dKn = sw128_desc(sK + wg * BN * 128, BN * 128, 1024);
`)
		} else {
			b.WriteString(`  // dQ = dS·K (warpgroup 0 alone): dS K-major (atoms of 64 keys BM·128 bytes apart); K read N-major
  constexpr int dq0 = 0;
  const u64 dSk = sw128_desc(sdSa, 16, 1024), dKn = sw128_desc(sK, BN * 128, 1024);
`)
		}
	}
	b.WriteString(`  for (int it = 0; it < iters; ++it) {
    const int st = it & 1;
    const int h = kvh * G + it / nib, i0 = (ib0 + it % nib) * BM;
    cp_async_wait0();
    fence_proxy_async();
    __syncthreads();  // tile it landed for every thread; every warpgroup is done with iteration it-1
    if (it + 1 < iters) { load_q(it + 1, st ^ 1); cp_async_commit(); }
`)
	g.fullMask(b)
	b.WriteString(`    // ---- S = Q·Kᵀ and dP = dO·Vᵀ: 64 queries x this warpgroup's 64 keys
    float accS[1][8][4], accP[1][8][4];
    {
      const u64 dq = sw128_desc(sQ + st * Q_STAGE, 16, 1024), ddo = sw128_desc(sdO + st * DO_STAGE, 16, 1024);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DKP / 16; ++kk)
        wg_s(accS[0], dq + (u64)(((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4), dKs + (u64)(((kk >> 2) * BN * 128 + (kk & 3) * 32) >> 4), kk > 0);
#pragma unroll
      for (int kk = 0; kk < DVP / 16; ++kk)
        wg_s(accP[0], ddo + (u64)(((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4), dVs + (u64)(((kk >> 2) * BN * 128 + (kk & 3) * 32) >> 4), kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_acc(accS[0]);
      fence_acc(accP[0]);
    }
`)
	st := bwdWarpTile{Wm: 4, Wn: 2, TM: 16, TN: 64, MT: 1, NT: 8, Warps: 8}
	g.tileAt = func(tile string) string { return tile + " + sw_elem<BM>(il, jl)" }
	g.probs(b, st, "(sL + st * BM)", "(sD + st * BM)", true)
	g.dsFromDP(b, st, true)
	g.tileAt = nil
	b.WriteString(`    fence_proxy_async();
    __syncthreads();  // P and dS of all 128 keys in shared memory
    // ---- dV += Pᵀ·dO, dK += dSᵀ·Q over the BM queries: this warpgroup's keys; dO and Q read N-major
    {
      const u64 ddo = sw128_desc(sdO + st * DO_STAGE, BM * 128, 1024), dq = sw128_desc(sQ + st * Q_STAGE, BM * 128, 1024);
      fence_acc(accdV[0]);
      fence_acc(accdK[0]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        wg_dv(accdV[0], dPt + (u64)((kk * 2048) >> 4), ddo + (u64)((kk * 2048) >> 4), 1);
`)
	dk := "wg_dk"
	if dkp == dvp {
		dk = "wg_dv"
	}
	fmt.Fprintf(b, "        %s(accdK[0], dSt + (u64)((kk * 2048) >> 4), dq + (u64)((kk * 2048) >> 4), 1);\n      }\n      wgmma_commit();\n    }\n", dk)
	if v.AtomicDQ {
		cond := ""
		nq := dkp
		if split {
			nq = 64
		} else {
			cond = "if (wg == 0) "
		}
		fmt.Fprintf(b, `    // ---- dQ += dS·K over the block's %[1]d keys (columns dq0 .. dq0 + %[2]d), added to the fp32 accumulator
    %[3]s{
      float accQ[%[4]d][4];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        wg_dq(accQ, dSk + (u64)(((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4), dKn + (u64)((kk * 2048) >> 4), kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_acc(accQ);
      float* gq = p.dqacc + b * p.dqa_sb + (qr0 + i0) * p.dqa_sr + h * p.dqa_sh + dq0;
#pragma unroll
      for (int nt = 0; nt < %[4]d; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int il = (warp & 3) * 16 + g + hh * 8, jl = nt * 8 + 2 * t4;
          if (i0 + il < n && dq0 + jl < DK) red_add_pair(gq + il * p.dqa_sr + jl, accQ[nt][2 * hh], accQ[nt][2 * hh + 1]);
        }
    }
`, t.BlockN, nq, cond, nq/8)
	}
	b.WriteString(`    wgmma_wait<0>();
    fence_acc(accdV[0]);
    fence_acc(accdK[0]);
  }
  T* gdk = p.dk + b * p.dk_sb + (kr0 + j0) * p.dk_sr + kvh * p.dk_sh;
  T* gdv = p.dv + b * p.dv_sb + (kr0 + j0) * p.dv_sr + kvh * p.dv_sh;
`)
	bwdStoreAcc(b, tdk, "accdK", "gdk", "p.dk_sr", "m - j0", "DK", "p.scale")
	bwdStoreAcc(b, tdv, "accdV", "gdv", "p.dv_sr", "m - j0", "DV", "1.f")
	b.WriteString("}\n\n")
}
