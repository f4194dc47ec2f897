package kernels

import (
	"fmt"
	"strings"
)

// The Hopper dQ kernel (the separate algorithm, BwdVariant.WGMMA without
// AtomicDQ); bwd_dkdv_sm90.go describes the dK/dV kernel and the shared
// swizzled layout.

// bwdHopperDQTile returns the tile of the Hopper dQ kernel (the separate
// algorithm): two warpgroups of 64 query rows, BN keys a step (fewer past
// head dim 128, where q, dO and two stages of k and v fill shared memory).
func (v BwdVariant) bwdHopperDQTile() BwdTile {
	// as many keys as one warpgroup of the dK/dV kernel: 64, or 32 past 128
	return BwdTile{BlockM: 128, BlockN: v.bwdHopperTile().BlockN / 2, Warps: v.bwdHopperTile().Warps, Stages: 2, MinBlocks: 1}
}

// bwdHopperDQLayout is the shared-memory map of the Hopper dQ kernel (every
// tile 1024-byte aligned from a base the kernel aligns).
func (v BwdVariant) bwdHopperDQLayout() bwdSmemLayout {
	ka, va := swizzleAtoms(v.DKPad()), swizzleAtoms(v.DVPad())
	t := v.bwdHopperDQTile()
	var l bwdSmemLayout
	add := l.addSwizzled
	add("sQ", ka*t.BlockM*128)   // [KATOMS][BM][64]
	add("sdO", va*t.BlockM*128)  // [VATOMS][BM][64]
	add("sK", 2*ka*t.BlockN*128) // [2][KATOMS][BN][64]
	add("sV", 2*va*t.BlockN*128) // [2][VATOMS][BN][64]
	add("sL", t.BlockM*4)        // [BM] LSE2
	add("sD", t.BlockM*4)        // [BM] Delta
	if v.TMA {
		l.add("bar", 16) // [2] mbarriers: stage s of k and v landed
	}
	if v.WarpSpecialized {
		l.add("empty", 16) // [2] mbarriers: stage s released by every compute warp
	}
	l.alignSlack()
	return l
}

// dqKernelHopper writes BwdDQKernel for WGMMA variants: the separate dQ
// algorithm with warpgroup products. Warpgroup w owns query rows 64w ..
// 64w+63 of the block; for every visible key block it recomputes S and dP
// (both operands from shared memory), P and dS with the element-wise code of
// the other kernels, and adds dS·K with dS straight from registers (the
// accumulator of two 8-key blocks is the A operand of one k16 step). No
// atomics: bit-for-bit deterministic.
func (g *bwdGen) dqKernelHopper(b *strings.Builder) {
	g.ws = g.v.WarpSpecialized
	defer func() { g.ws = false }()
	v := g.v
	t := v.bwdHopperDQTile()
	l := v.bwdHopperDQLayout()
	dkp, dvp := v.DKPad(), v.DVPad()
	ka, va := swizzleAtoms(dkp), swizzleAtoms(dvp)
	fmt.Fprintf(b, `// dQ (separate algorithm, Hopper warpgroup products): one block per (query block of %[1]d rows,
// batch, query head), warpgroup w owning rows 64w .. 64w+63; loops over the visible key blocks
// recomputing S, P and dP; dQ += dS·K with dS from registers; no atomics.
// grid (ceil(N/%[1]d), B, H), 256 threads, %[2]d bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(%[6]d, 1) %[3]s(%[4]s) {
%[5]s`, t.BlockM, l.total, BwdDQKernel, g.hopperArg(), g.hopperArgAlias(), 32*t.Warps)
	g.hopperPreamble(b, t, l, "K_STAGE", ka*t.BlockN*128, "V_STAGE", va*t.BlockN*128, "k and v")
	g.wsBwdConstants(b, false)
	fmt.Fprintf(b, `  const u32 sQ = s0 + %d, sdO = s0 + %d, sK = s0 + %d, sV = s0 + %d;
  float* sL = reinterpret_cast<float*>(smem + %d);
  float* sD = reinterpret_cast<float*>(smem + %d);
`, l.off["sQ"], l.off["sdO"], l.off["sK"], l.off["sV"], l.off["sL"], l.off["sD"])
	if g.ws {
		g.wsBwdBarriers(b, l, 1, "NCOMPUTE / 32", "the producer thread's k and v tiles landed")
	} else {
		g.tmaBarriers(b, l, "k and v", 2)
	}
	g.dqKeyRange(b)
	switch {
	case g.ws:
		g.wsDQProducer(b)
	default:
		g.loadKV(b)
	}
	tq := bwdWarpTile{Wm: 8, Wn: 1, TM: 16, TN: dkp, MT: 1, NT: dkp / 8, Warps: 8}
	b.WriteString("  " + strings.ReplaceAll(tq.accDecl("accQ"), "\n", "\n  "))
	qa, da, ql, dl := g.in("q").at("i0", "h"), g.in("do").at("i0", "h"), "", ""
	if v.Flat {
		b.WriteString(`// flat rows: q and dO tiles from flat_shift columns before the head's start, the head shifted right
  // by sq_ (q; with one query head per key head also k and dQ) and sdo_ (dO, v) columns
  const int sq_ = flat_shift(h, DK, DKP), sdo_ = flat_shift(h, DV, DVP);
  `)
		qa, da, ql, dl = "("+qa+") - sq_", "("+da+") - sdo_", ", sq_ + DK", ", sdo_ + DV"
	}
	firstKV, landed := "\n    load_kv(0, 0);", ""
	if g.ws {
		// the producer loads every step's k and v; q, dO and the statistics must have landed
		firstKV = ""
		landed = "  cp_async_wait0();\n  fence_proxy_async();\n  bar_sync(1, NCOMPUTE);  // q, dO, LSE2 and Delta in shared memory for both warpgroups\n"
	}
	fmt.Fprintf(b, `if (njb > 0) {
    load_sw<BM, KCH, DK, NTH>(sQ, %s, %s, n - i0%s);
    load_sw<BM, VCH, DV, NTH>(sdO, %s, %s, n - i0%s);
    const long long so = b * p.stat_sb + h * p.stat_sh + qr0 + i0;
    load_stats<BM, NTH>(sL, sD, p.lse2 + so, p.delta + so, n - i0);%s
    cp_async_commit();%s
  }
%s  // ---- matrix descriptors: this warpgroup's 64 rows of q and dO (K-major)
  const u64 dq = sw128_desc(sQ + wg * 64 * 128, 16, 1024), ddo = sw128_desc(sdO + wg * 64 * 128, 16, 1024);
  for (int it = 0; it < njb; ++it) {
    const int st = it & 1;
    const int j0 = (jb0 + it) * BN;
`, qa, g.in("q").sr, ql, da, g.in("do").sr, dl, firstKV, g.flatZero("sQ", "BM", "DKP", "sq_", "DK", "sdO", "BM", "DVP", "sdo_", "DV"), landed)
	if g.ws {
		b.WriteString("    mbar_wait(bar + 8 * st, (it >> 1) & 1);  // k and v of step it (the producer's)\n")
	} else {
		g.lockstepStepStart(b, 2, "load_kv", "njb")
	}
	g.fullMask(b)
	wgScores(b, "wg_s", "this warpgroup's 64 queries x BN keys (K and V K-major)",
		"      const u64 dk = sw128_desc(sK + st * K_STAGE, 16, 1024), dv = sw128_desc(sV + st * V_STAGE, 16, 1024);\n",
		"dq", "dk", "ddo", "dv", "BM", "BN", t.BlockN/8, "")
	fmt.Fprintf(b, "    u32 dsp[1][%d][2];  // dS of this warpgroup's rows, 16-bit pairs: the A operand of dQ += dS·K\n", t.BlockN/8)
	st := bwdWarpTile{Wm: 8, Wn: 1, TM: 16, TN: t.BlockN, MT: 1, NT: t.BlockN / 8, Warps: 8}
	g.probs(b, st, "sL", "sD", false)
	b.WriteString("    wgmma_wait<0>();  // dP\n    fence_acc(accP[0]);\n")
	g.dsRegs = true
	g.dsFromDP(b, st, false)
	g.dsRegs = false
	b.WriteString(`    // ---- dQ += dS·K over the BN keys: K read N-major (the next 64 columns BN·128 bytes further)
    {
      const u64 dkn = sw128_desc(sK + st * K_STAGE, BN * 128, 1024);
      fence_acc(accQ[0]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const u32 a[4] = {dsp[0][2 * kk][0], dsp[0][2 * kk][1], dsp[0][2 * kk + 1][0], dsp[0][2 * kk + 1][1]};
        wg_rq(accQ[0], a, dkn + (u64)((kk * 2048) >> 4));
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_acc(accQ[0]);
    }
`)
	if g.ws {
		b.WriteString(`    __syncwarp();
    if (lane == 0) mbar_arrive(empty + 8 * st);  // this warp is done with step it's k and v
`)
	}
	b.WriteString(`  }
  T* gq = p.dq + b * p.dq_sb + (qr0 + i0) * p.dq_sr + h * p.dq_sh;
`)
	if v.Vector {
		bwdStoreAcc(b, tq, "accQ", "gq", "p.dq_sr", "n - i0", "DK", "p.scale")
		nfQueryCheck(b, g.ws)
		b.WriteString("}\n")
		return
	}
	fmt.Fprintf(b, `  // ---- dQ through shared memory (rows of an odd head dim allow no paired stores): a row-major tile
  // [BM][DKP + 8] over the free tiles, then one warp a row
  constexpr int PQ = DKP + 8;
  T* sgq = reinterpret_cast<T*>(smem);
  static_assert(BM * PQ * 2 <= %d, "the staged gradient exceeds the tiles");
  %s  // every warpgroup is done with the tiles
`, l.tileBytes(), g.computeSync())
	bwdStoreAcc(b, tq, "accQ", "sgq", "PQ", "n - i0", "DK", "p.scale", bwdStoreOpt{Shift: g.flatName("sq_"), Shared: true})
	b.WriteString("  " + g.computeSync() + "\n")
	bwdRowsOut(b, "sgq", "PQ", "gq", "p.dq_sr", "BM", "n - i0", "DK")
	nfQueryCheck(b, g.ws)
	b.WriteString("}\n")
}
