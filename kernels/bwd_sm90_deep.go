package kernels

import (
	"fmt"
	"strings"
)

// The deep Hopper backward kernels: padded head dims from 257 to 512
// (BwdVariant.WGMMA with bwdHopperDeep), where neither sharing of the
// other Hopper kernels fits. dK and dV of 64 keys at D = 512 alone would
// fill the register file, so a block owns BN = 32 keys; a warpgroup
// product's rows are 64, so dK and dV are computed transposed, head-dim
// columns as rows:
//
//	S  = Q·Kᵀ, dP = dO·Vᵀ   warpgroup w: the BM = 64 queries × keys
//	                        16w .. 16w+15, both operands K-major from
//	                        shared memory (the two product groups committed
//	                        apart, so that P is computed while dP runs)
//	P, dS                    the other kernels' element-wise code (masks,
//	                        softcap, bias and dBias, dropout), stored to
//	                        shared memory in the swizzled layout
//	dVᵀ += dOᵀ·P             warpgroup 0: every 64-column slice of dV
//	                        (dOᵀ read M-major, P N-major)
//	dKᵀ += Qᵀ·dS             warpgroup 1: every slice of dK
//
// so each warpgroup keeps one of the two gradients, 64·ceil(D/64) × 32
// fp32, in its registers for the whole loop: 128 a thread at D = 512.
// Shared memory holds k and v, P and dS, and two stages of q and dO where
// they fit (padded head dims up to 320), so that step it+1's tiles load
// while step it computes; otherwise one, and a step's loads wait for the
// products of the step before.
//
// The dQ kernel (the separate algorithm; the atomic one would need dQ's
// registers too) owns BM = 64 queries and steps over BN = 32 keys: S, dP,
// P and dS as above, with the query tiles loaded once and the key tiles
// every step (two stages where they fit: up to 384), then dQ += dS·K with dS from shared memory (K-major) and K
// N-major, warpgroup w owning one share of dQ's columns, split on a
// 64-column boundary (bwdDeepDQCols).

// bwdHopperDeep reports whether v's Hopper kernels are the deep ones
// (padded head dims past 256; BwdHopperOK takes both past 256 or neither).
func (v BwdVariant) bwdHopperDeep() bool { return v.DKPad() > 256 }

// BwdHopperDeep reports whether the Hopper kernels of v (as BwdHopperOK
// takes them, v.WGMMA set or not) are the deep ones of head dims past 256.
func BwdHopperDeep(v BwdVariant) bool {
	v.WGMMA = true
	return v.bwdHopperDeep()
}

// Tile of both deep kernels: query rows and keys a step.
const (
	bwdDeepBM = 64
	bwdDeepBN = 32
)

// bwdDeepTile returns the tile of the deep dK/dV kernel (dkdv) or dQ
// kernel: 64 queries by 32 keys, two warpgroups, two stages of the
// streamed tiles where shared memory holds them.
func (v BwdVariant) bwdDeepTile(dkdv bool) BwdTile {
	stages := 1
	if v.bwdDeepLayoutStages(dkdv, 2).withSlack() <= MaxSharedBytes {
		stages = 2
	}
	return BwdTile{BlockM: bwdDeepBM, BlockN: bwdDeepBN, Warps: 8, Stages: stages, MinBlocks: 1}
}

// bwdDeepLayout is the shared-memory map of the deep dK/dV kernel (dkdv)
// or dQ kernel with its tile's stages.
func (v BwdVariant) bwdDeepLayout(dkdv bool) bwdSmemLayout {
	return v.bwdDeepLayoutStages(dkdv, v.bwdDeepTile(dkdv).Stages)
}

// bwdDeepLayoutStages is the shared-memory map of a deep kernel with
// stages stages of its streamed tiles (the dK/dV kernel's q, dO and their
// row statistics; the dQ kernel's k and v), every tile on a 1024-byte
// boundary from a base the kernel aligns. The staged gradients of the
// kernels' ends reuse the tiles from the start.
func (v BwdVariant) bwdDeepLayoutStages(dkdv bool, stages int) bwdSmemLayout {
	ka, va := swizzleAtoms(v.DKPad()), swizzleAtoms(v.DVPad())
	sq, sk := stages, 1 // stages of the query-side and key-side tiles
	if !dkdv {
		sq, sk = 1, stages
	}
	var l bwdSmemLayout
	add := l.addSwizzled
	add("sQ", sq*ka*bwdDeepBM*128)  // [stages][KATOMS][BM][64]
	add("sdO", sq*va*bwdDeepBM*128) // [stages][VATOMS][BM][64]
	add("sK", sk*ka*bwdDeepBN*128)  // [stages][KATOMS][BN][64]
	add("sV", sk*va*bwdDeepBN*128)  // [stages][VATOMS][BN][64]
	add("sP", bwdDeepBM*128)        // [BM][64]: keys 0 .. BN-1 used
	add("sdS", bwdDeepBM*128)       // [BM][64]
	add("sL", sq*bwdDeepBM*4)       // [stages][BM] LSE2
	add("sD", sq*bwdDeepBM*4)       // [stages][BM] Delta
	if v.TMA {
		l.add("bar", 16) // [2] mbarriers: stage s of the streamed tiles landed
	}
	l.alignSlack()
	return l
}

// stagedStores reports whether v's Hopper kernels store their gradients
// through row-major tiles in shared memory, one warp a row (stage_pair,
// row_out): rows of an odd head dim, which allow no paired stores, and
// the deep kernels, whose dK and dV come transposed.
func (v BwdVariant) stagedStores() bool { return !v.Vector || v.bwdHopperDeep() }

// bwdDeepDQCols returns the columns of the deep dQ kernel's product on
// each warpgroup (n: half of the 64-column atoms, rounded up) and the
// first of them on warpgroup 1 (from: its product ends with the last
// atom). Both warpgroups run the same product, since a branch around a
// warpgroup product makes ptxas serialize them all; with an odd number of
// atoms they overlap by one, which warpgroup 1 does not store.
func (v BwdVariant) bwdDeepDQCols() (n, from int) {
	a := swizzleAtoms(v.DKPad())
	h := (a + 1) / 2
	return h * 64, (a - h) * 64
}

// bwdDeepTails reports whether v's deep kernels zero the tails of their
// tiles' last 64-column atoms (the columns from the padded head dim on): a
// padded dim short of a whole atom, loaded by cp.async, which never writes
// those columns, while the transposed products read whole atoms (the
// tensor memory accelerator fills them with zeros).
func (v BwdVariant) bwdDeepTails() bool {
	return v.bwdHopperDeep() && !v.TMA && (v.DKPad()%64 != 0 || v.DVPad()%64 != 0)
}

// bwdDeepProducts returns the warpgroup product wrappers of the deep
// kernels: S and dP (wg_s, 16 keys), the transposed dK and dV slices
// (wg_t32: 64 columns × 32 keys) and the two shares of dQ (wg_nN).
func (v BwdVariant) bwdDeepProducts() []WGMMAProduct {
	n, _ := v.bwdDeepDQCols()
	return []WGMMAProduct{{Name: "wg_s", N: bwdDeepBN / 2}, {Name: "wg_t32", N: bwdDeepBN, TA: true, TB: true},
		{Name: fmt.Sprintf("wg_n%d", n), N: n, TB: true}}
}

// deepTiles writes the shared-memory addresses of the deep kernels' tiles
// (the dK/dV kernel's with dkdv), the barriers of the streamed ones
// (stages of them) and, where they need it, the zeroing of the tiles'
// atom tails (bwdDeepTails).
func (g *bwdGen) deepTiles(b *strings.Builder, l bwdSmemLayout, dkdv bool, stages int) {
	fmt.Fprintf(b, `  const u32 sQ = s0 + %d, sdO = s0 + %d, sK = s0 + %d, sV = s0 + %d;
  T* sP = reinterpret_cast<T*>(smem + %d);    // P  [BM][64], swizzled
  T* sdS = reinterpret_cast<T*>(smem + %d);   // dS [BM][64], swizzled
  float* sL = reinterpret_cast<float*>(smem + %d);
  float* sD = reinterpret_cast<float*>(smem + %d);
  const u32 sPa = s0 + %d, sdSa = s0 + %d;
  (void)sPa;
`, l.off["sQ"], l.off["sdO"], l.off["sK"], l.off["sV"], l.off["sP"], l.off["sdS"], l.off["sL"], l.off["sD"], l.off["sP"], l.off["sdS"])
	g.tmaBarriers(b, l, "the streamed tiles", stages)
	if !g.v.bwdDeepTails() {
		return
	}
	sq, sk := stages, 1
	if !dkdv {
		sq, sk = 1, stages
	}
	ka, va := swizzleAtoms(g.v.DKPad()), swizzleAtoms(g.v.DVPad())
	b.WriteString("  // the atom tails past the padded head dims, zeroed once (the first step's fence and barrier publish them)\n")
	for _, x := range []struct {
		tile, rows            string // the tile and its rows' name
		n, stages, pad, atoms int    // its rows, stages, padded head dim and atoms
	}{
		{"sQ", "BM", bwdDeepBM, sq, g.v.DKPad(), ka}, {"sdO", "BM", bwdDeepBM, sq, g.v.DVPad(), va},
		{"sK", "BN", bwdDeepBN, sk, g.v.DKPad(), ka}, {"sV", "BN", bwdDeepBN, sk, g.v.DVPad(), va},
	} {
		if x.pad%64 == 0 {
			continue
		}
		for s := 0; s < x.stages; s++ {
			fmt.Fprintf(b, "  zero_cols<%s>(smem + (%s - s0) + %d, 0, %d, %d, tid, NTH);\n", x.rows, x.tile, s*x.atoms*x.n*128, x.pad, x.atoms*64)
		}
	}
}

// deepScores writes S and dP of a deep kernel's step (the 64 queries ×
// this warpgroup's 16 keys) from this step's q, dO, k and v tiles (shared
// addresses sq, sdo, sk, sv) and LSE2 and Delta rows (sl, sd), then P and
// dS into their shared tiles; the dK/dV kernel (dkdv) also stores P and
// writes the dBias scratch.
func (g *bwdGen) deepScores(b *strings.Builder, dkdv bool, sq, sdo, sk, sv, sl, sd string) {
	g.fullMask(b)
	wgScores(b, "wg_s", "the BM queries x this warpgroup's BN/2 keys", fmt.Sprintf(`      u64 dq = sw128_desc(%s, 16, 1024), ddo = sw128_desc(%s, 16, 1024);
      u64 dk = sw128_desc(%s + wg * (BN / 2) * 128, 16, 1024), dv = sw128_desc(%s + wg * (BN / 2) * 128, 16, 1024);
      %s
`, sq, sdo, sk, sv, deepOpaque("dq", "ddo", "dk", "dv")), "dq", "dk", "ddo", "dv", "BM", "BN", bwdDeepBN/16, "")
	st := bwdWarpTile{Wm: 4, Wn: 2, TM: 16, TN: bwdDeepBN / 2, MT: 1, NT: bwdDeepBN / 16, Warps: 8}
	g.tileAt = func(tile string) string { return tile + " + sw_elem<BM>(il, jl)" }
	g.probs(b, st, sl, sd, dkdv)
	b.WriteString("    wgmma_wait<0>();  // dP\n    fence_acc(accP[0]);\n")
	g.dsFromDP(b, st, dkdv)
	g.tileAt = nil
	b.WriteString(`    fence_proxy_async();
    __syncthreads();  // P and dS of all BN keys stored, before the products that read them
`)
}

// deepOpaque returns the statement that hides the descriptors names from
// the compiler's loop-invariant hoisting (opaque): each product step's
// descriptor (base + a constant) is then formed where the step issues,
// instead of all of a product's steps (32 at D = 512, 64-bit each) living
// in registers across the loop over query blocks, as the forward's
// products found (docs/kernels/forward.md).
func deepOpaque(names ...string) string {
	var b strings.Builder
	for i, n := range names {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "opaque(%s);", n)
	}
	return b.String() + "  // the step descriptors are formed per step, not hoisted into registers"
}

// dkdvKernelHopperDeep writes BwdDKDVKernel for deep variants.
func (g *bwdGen) dkdvKernelHopperDeep(b *strings.Builder) {
	v := g.v
	t := v.bwdDeepTile(true)
	l := v.bwdDeepLayout(true)
	dkp, dvp := v.DKPad(), v.DVPad()
	ka, va := swizzleAtoms(dkp), swizzleAtoms(dvp)
	fmt.Fprintf(b, `// dK/dV (Hopper, head dims past 256): one block per (key block of %[1]d keys, batch, key head); loops
// over the query heads of the group and the query blocks that see the keys; warpgroup 0 keeps dVᵀ,
// warpgroup 1 dKᵀ (head-dim columns as rows, 64 a slice) in its registers, written once through
// shared memory; %[6]d stage(s) of q and dO. grid (ceil(M/%[1]d), B, Hkv), 256 threads, %[2]d bytes
// of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(256, 1) %[3]s(%[4]s) {
%[5]s`, t.BlockN, l.total, BwdDKDVKernel, g.hopperArg(), g.hopperArgAlias(), t.Stages)
	g.hopperPreamble(b, t, l, "Q_STAGE", ka*t.BlockM*128, "DO_STAGE", va*t.BlockM*128, "q and dO")
	fmt.Fprintf(b, "  constexpr int KSL = %d, VSL = %d;  // 64-column slices of dK (warpgroup 1) and dV (warpgroup 0)\n", ka, va)
	g.deepTiles(b, l, true, t.Stages)
	g.dkdvQueryRange(b)
	fmt.Fprintf(b, `  const T* gk = %s;
  const T* gv = %s;
`, g.in("k").at("j0", "kvh"), g.in("v").at("j0", "kvh"))
	g.loadQ(b)
	ms := max(ka, va)
	fmt.Fprintf(b, `  // this warpgroup's gradient, transposed: acc[slice][key block of 8][4] (rows: 64 columns of the
  // slice; columns: the BN keys), dVᵀ on warpgroup 0, dKᵀ on warpgroup 1
  %[6]sconst int nsl = wg ? KSL : VSL;  // this warpgroup's slices
  (void)nsl;
  if (iters > 0) {
    load_sw<BN, KCH, DK, NTH>(sK, gk, %[2]s, m - j0);
    load_sw<BN, VCH, DV, NTH>(sV, gv, %[3]s, m - j0);%[4]s
    cp_async_commit();
  }
%[7]s    const int st = %[5]s;
`, ms, g.in("k").sr, g.in("v").sr, firstLoad(t.Stages, "load_q"), stageOf(t.Stages),
		strings.ReplaceAll(bwdWarpTile{MT: ms, NT: bwdDeepBN / 8}.accDecl("acc"), "\n", "\n  "), stepLoop("  ", "h", "i0", "0"))
	g.lockstepStepStart(b, t.Stages, "load_q", "iters")
	g.deepScores(b, true, "sQ + st * Q_STAGE", "sdO + st * DO_STAGE", "sK", "sV", "(sL + st * BM)", "(sD + st * BM)")
	fmt.Fprintf(b, `    // ---- dVᵀ += dOᵀ·P (warpgroup 0) or dKᵀ += Qᵀ·dS (warpgroup 1), slice by slice over the BM queries:
    // A is the slice's atom of dO or q read M-major, B the P or dS tile read N-major
    {
      u64 da = sw128_desc(wg ? sQ + st * Q_STAGE : sdO + st * DO_STAGE, 16, 1024), db = sw128_desc(wg ? sdSa : sPa, BM * 128, 1024);
      %[2]s
#pragma unroll
      for (int sl = 0; sl < %[1]d; ++sl) fence_acc(acc[sl]);
      wgmma_fence();
#pragma unroll
      for (int sl = 0; sl < %[1]d; ++sl) {
        // past this warpgroup's slices (dK and dV of different widths) the last one again, whose
        // columns are never stored: a branch around a warpgroup product would serialize them all
        const int ss = sl < nsl ? sl : nsl - 1;
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
          wg_t32(acc[sl], da + (u64)((ss * BM * 128 + kk * 2048) >> 4), db + (u64)((kk * 2048) >> 4), 1);
      }
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int sl = 0; sl < %[1]d; ++sl) fence_acc(acc[sl]);
    }
  }
`, ms, deepOpaque("da", "db"))
	fmt.Fprintf(b, `  // ---- dK and dV through shared memory: row-major tiles [BN][DKP + 8] and [BN][DVP + 8] over the free
  // tiles (element (column c, key j) of a transposed slice goes to row j), then one warp a row
  constexpr int PK = DKP + 8, PV = DVP + 8;
  T* sgk = reinterpret_cast<T*>(smem);
  T* sgv = sgk + BN * PK;
  static_assert(BN * (PK + PV) * 2 <= %[1]d, "the staged gradients exceed the tiles");
  __syncthreads();  // every warpgroup is done with the tiles
  {
    T* sg = wg ? sgk : sgv;
    const int pitch = wg ? PK : PV, cols = wg ? DKP : DVP;
    const float f = wg ? p.scale : 1.f;
#pragma unroll
    for (int sl = 0; sl < %[2]d; ++sl)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = sl * 64 + (warp & 3) * 16 + g + (e >> 1) * 8, j = nt * 8 + 2 * t4 + (e & 1);
          if (c < cols) sg[j * pitch + c] = t_from_f(acc[sl][nt][e] * f);
        }
  }
  __syncthreads();
  T* gdk = p.dk + b * p.dk_sb + (kr0 + j0) * p.dk_sr + kvh * p.dk_sh;
  T* gdv = p.dv + b * p.dv_sb + (kr0 + j0) * p.dv_sr + kvh * p.dv_sh;
`, l.tileBytes(), ms)
	bwdRowsOut(b, "sgk", "PK", "gdk", "p.dk_sr", "BN", "m - j0", "DK")
	bwdRowsOut(b, "sgv", "PV", "gdv", "p.dv_sr", "BN", "m - j0", "DV")
	nfKeysCheck(b, false, nfAll("acc")...)
	b.WriteString("}\n\n")
}

// dqKernelHopperDeep writes BwdDQKernel for deep variants.
func (g *bwdGen) dqKernelHopperDeep(b *strings.Builder) {
	v := g.v
	t := v.bwdDeepTile(false)
	l := v.bwdDeepLayout(false)
	dkp, dvp := v.DKPad(), v.DVPad()
	ka, va := swizzleAtoms(dkp), swizzleAtoms(dvp)
	nc, from := v.bwdDeepDQCols()
	fmt.Fprintf(b, `// dQ (separate algorithm, Hopper, head dims past 256): one block per (query block of %[1]d rows,
// batch, query head); loops over the visible key blocks of %[6]d keys recomputing S, P and dP, each
// warpgroup for 16 of the keys; dQ += dS·K with dS from shared memory, each warpgroup %[7]d of dQ's
// columns (warpgroup 0 from column 0, warpgroup 1 from column %[9]d, storing those from %[7]d); no
// atomics; %[8]d stage(s) of k and v.
// grid (ceil(N/%[1]d), B, H), 256 threads, %[2]d bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(256, 1) %[3]s(%[4]s) {
%[5]s`, t.BlockM, l.total, BwdDQKernel, g.hopperArg(), g.hopperArgAlias(), t.BlockN, nc, t.Stages, from)
	g.hopperPreamble(b, t, l, "K_STAGE", ka*t.BlockN*128, "V_STAGE", va*t.BlockN*128, "k and v")
	g.deepTiles(b, l, false, t.Stages)
	g.dqKeyRange(b)
	g.loadKV(b)
	fmt.Fprintf(b, `  // dQ of the block's BM rows, %[1]d columns a warpgroup: from column 0 on warpgroup 0, from %[2]d on warpgroup 1
  %[3]sif (njb > 0) {
    load_sw<BM, KCH, DK, NTH>(sQ, %[4]s, %[5]s, n - i0);
    load_sw<BM, VCH, DV, NTH>(sdO, %[6]s, %[7]s, n - i0);
    const long long so = b * p.stat_sb + h * p.stat_sh + qr0 + i0;
    load_stats<BM, NTH>(sL, sD, p.lse2 + so, p.delta + so, n - i0);%[8]s
    cp_async_commit();
  }
  for (int it = 0; it < njb; ++it) {
    const int j0 = (jb0 + it) * BN;
    const int st = %[9]s;
`, nc, from, strings.ReplaceAll(bwdWarpTile{MT: 1, NT: nc / 8}.accDecl("accQ"), "\n", "\n  "), g.in("q").at("i0", "h"), g.in("q").sr, g.in("do").at("i0", "h"), g.in("do").sr, firstLoad(t.Stages, "load_kv"), stageOf(t.Stages))
	g.lockstepStepStart(b, t.Stages, "load_kv", "njb")
	g.deepScores(b, false, "sQ", "sdO", "sK + st * K_STAGE", "sV + st * V_STAGE", "sL", "sD")
	fmt.Fprintf(b, `    // ---- dQ += dS·K over the BN keys: dS K-major, K N-major from this warpgroup's first column (the
    // same product on both warpgroups, no branch around it)
    {
      const u64 dsk = sw128_desc(sdSa, 16, 1024);
      const u64 dkn = sw128_desc(sK + st * K_STAGE + (wg ? %[3]d * BN * 128 : 0), BN * 128, 1024);
      fence_acc(accQ[0]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        wg_n%[1]d(*reinterpret_cast<float(*)[%[2]d][4]>(&accQ[0][0][0]), dsk + (u64)(((kk & 3) * 32) >> 4), dkn + (u64)((kk * 2048) >> 4), 1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_acc(accQ[0]);
    }
  }
`, nc, nc/8, from/64)
	fmt.Fprintf(b, `  // ---- dQ through shared memory: a row-major tile [BM][DKP + 8] over the free tiles, then one warp a row
  constexpr int PQ = DKP + 8;
  T* sgq = reinterpret_cast<T*>(smem);
  static_assert(BM * PQ * 2 <= %d, "the staged gradient exceeds the tiles");
  __syncthreads();  // every warpgroup is done with the tiles
  if (wg == 0) {  // columns 0 .. %d
`, l.tileBytes(), nc-1)
	bwdStoreWarpgroup(b, "accQ", nc, "sgq", "PQ", "BM", "DK", "p.scale", 0, bwdStoreOpt{Shared: true})
	fmt.Fprintf(b, "  } else {  // columns %d .. (the overlap with warpgroup 0 left to it)\n", nc)
	bwdStoreWarpgroup(b, "accQ", nc, "sgq", "PQ", "BM", "DK", "p.scale", from, bwdStoreOpt{Shared: true, From: nc - from})
	b.WriteString(`  }
  __syncthreads();
  T* gq = p.dq + b * p.dq_sb + (qr0 + i0) * p.dq_sr + h * p.dq_sh;
`)
	bwdRowsOut(b, "sgq", "PQ", "gq", "p.dq_sr", "BM", "n - i0", "DK")
	nfQueryCheck(b, false)
	b.WriteString("}\n")
}

// firstLoad returns, for a kernel with two stages of its streamed tiles,
// the statement that loads step 0's (load, a lambda of (it, stage)) into
// stage 0 before the loop; with one stage, nothing.
func firstLoad(stages int, load string) string {
	if stages == 1 {
		return ""
	}
	return "\n    " + load + "(0, 0);"
}
