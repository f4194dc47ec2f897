package kernels

import (
	"fmt"
	"strings"

	"github.com/flashattn/flashattn/attn"
)

// What the Hopper backward kernels share: which variants they take, their
// warpgroup products, the device functions only they use, and the helpers
// of flat rows, tensor maps and barriers.

// BwdHopperOK reports whether the Hopper backward kernels can run a backward
// of v's dtype, head dims and load kind (ignoring v.WGMMA itself): 16-bit
// elements, rows read with 16-byte copies (Vector, Staged or Flat), padded head
// dims both at most 128, both from 129 to 256 or both from 257 to 512 (the
// deep kernels, bwd_sm90_deep.go), and no tile override.
func BwdHopperOK(v BwdVariant) bool {
	dk, dv := v.DKPad(), v.DVPad()
	dims := dk <= 128 && dv <= 128 || dk > 128 && dv > 128 && dk <= 256 && dv <= 256 || dk > 256 && dv > 256
	return (v.DType == attn.BFloat16 || v.DType == attn.Float16) && (v.Vector || v.Staged || v.Flat) && dims && v.Tiles.DKDV.BlockM == 0
}

// HopperProducts returns the warpgroup product wrappers of v's Hopper
// kernels (v.WGMMA): S and dP (wg_s: 64 queries x BN/2 keys in the dK/dV
// kernel, x BN keys in the dQ kernel, the same count), dV += Pᵀ·dO and
// dK += dSᵀ·Q (wg_tN), the atomic dQ = dS·K (wg_nN; transposed, wg_qt:
// dQᵀ = Kᵀ·dSᵀ over a step of 80 queries) and the separate
// dQ += dS·K with dS from registers (wg_rq).
func (v BwdVariant) HopperProducts() []WGMMAProduct {
	if v.bwdHopperDeep() {
		return v.bwdDeepProducts()
	}
	dkp, bn := v.DKPad(), v.bwdHopperTile().BlockN
	nv, nk, nq := v.bwdHopperCols()
	ps := []WGMMAProduct{{Name: "wg_s", N: bn / 2}, {Name: fmt.Sprintf("wg_t%d", nv), N: nv, TA: true, TB: true}}
	if nk != nv {
		ps = append(ps, WGMMAProduct{Name: fmt.Sprintf("wg_t%d", nk), N: nk, TA: true, TB: true})
	}
	if r := dkp - 128; v.bwdHopperCrossed() && r != 128 {
		ps = append(ps, WGMMAProduct{Name: fmt.Sprintf("wg_t%d", r), N: r, TA: true, TB: true})
	}
	switch {
	case v.bwdDQTransposed():
		ps = append(ps, WGMMAProduct{Name: "wg_qt", N: v.bwdHopperTile().BlockM, TA: true})
	case v.AtomicDQ:
		ps = append(ps, WGMMAProduct{Name: fmt.Sprintf("wg_n%d", nq), N: nq, TB: true})
	}
	ps = append(ps, v.keyRowsProducts()...)
	return append(ps, WGMMAProduct{Name: "wg_rq", N: dkp, TB: true, RegA: true})
}

// loadQ writes load_q(it, s), the loads of the Hopper dK/dV kernel's
// query-side tiles of step it into stage s: q and dO by the tensor memory
// accelerator (TMA variants) or by cp.async, LSE2 and Delta rows by
// cp.async.
func (g *bwdGen) loadQ(b *strings.Builder) {
	if g.v.TMA {
		fmt.Fprintf(b, `  // stage s of the query-side tiles for iteration it: q and dO by the tensor memory accelerator (one
  // thread; rows past the sequence and columns past the head dim come as zeros), LSE2 and Delta rows
  // by cp.async
  constexpr int QA = %d, DA = %d;  // 64-column atoms of q and dO loaded (the rest are never read)
  auto load_q = [&](int it, int s) {
    const int hq = kvh * G + it / nib, iq = (ib0 + it %% nib) * BM;
    if (tid == 0) {
%[3]s    }
    const long long so = b * p.stat_sb + hq * p.stat_sh + qr0 + iq;
    load_stats<BM, NTH>(sL + s * BM, sD + s * BM, p.lse2 + so, p.delta + so, n - iq);
  };
`, swizzleAtoms(g.v.DKPad()), swizzleAtoms(g.v.DVPad()), g.qStageTMA("      "))
		return
	}
	fmt.Fprintf(b, `  // stage s of the query-side tiles for iteration it: q, dO, LSE2, Delta rows
  auto load_q = [&](int it, int s) {
    const int hq = kvh * G + it / nib, iq = (ib0 + it %% nib) * BM;
    load_sw<BM, KCH, DK, NTH>(sQ + s * Q_STAGE, %s, %s, n - iq);
    load_sw<BM, VCH, DV, NTH>(sdO + s * DO_STAGE, %s, %s, n - iq);
    const long long so = b * p.stat_sb + hq * p.stat_sh + qr0 + iq;
    load_stats<BM, NTH>(sL + s * BM, sD + s * BM, p.lse2 + so, p.delta + so, n - iq);
  };
`, g.in("q").at("iq", "hq"), g.in("q").sr, g.in("do").at("iq", "hq"), g.in("do").sr)
}

// loadKV writes load_kv(it, s), the loads of the Hopper dQ kernel's
// key-side tiles of step it into stage s: k and v by the tensor memory
// accelerator (TMA variants) or by cp.async.
func (g *bwdGen) loadKV(b *strings.Builder) {
	if g.v.TMA {
		fmt.Fprintf(b, `  // stage s of the key-side tiles for step it: k and v by the tensor memory accelerator (one thread;
  // rows past the sequence and columns past the head dim come as zeros)
  auto load_kv = [&](int it, int s) {
    const int jk = (jb0 + it) * BN;
    if (tid == 0) {
%s    }
  };
`, g.kvStageTMA("      "))
		return
	}
	fmt.Fprintf(b, `  auto load_kv = [&](int it, int s) {
    const int jk = (jb0 + it) * BN;
    load_sw<BN, KCH, DK, NTH>(sK + s * K_STAGE, %s, %s, m - jk);
    load_sw<BN, VCH, DV, NTH>(sV + s * V_STAGE, %s, %s, m - jk);
  };
`, g.in("k").at("jk", "kvh"), g.in("k").sr, g.in("v").at("jk", "kvh"), g.in("v").sr)
}

// wgScores writes one warpgroup's S = A·Bᵀ and dP = C·Dᵀ (S = Q·Kᵀ and dP
// = dO·Vᵀ, or transposed, Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ) into accS and accP
// (nt blocks of 8 columns each) with the product wrapper prod, every
// operand K-major: the descriptors
// named sa, sb, pa, pb, those not in scope declared by decl inside the
// block, the A tiles with aRows rows an atom and the B tiles bRows (BM for
// the query-side tiles, BN for the key-side ones); the two products
// committed apart and S waited for, so that P is computed while dP still
// runs; inFlight is code that runs while both products do, before the
// wait. what describes the tile in a comment.
func wgScores(b *strings.Builder, prod, what, decl, sa, sb, pa, pb, aRows, bRows string, nt int, inFlight string) {
	fmt.Fprintf(b, `    // ---- S = Q·Kᵀ and dP = dO·Vᵀ: %[1]s
    float accS[1][%[2]d][4], accP[1][%[2]d][4];
    {
%[3]s      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DKP / 16; ++kk)
        %[10]s(accS[0], %[4]s + (u64)(((kk >> 2) * %[8]s * 128 + (kk & 3) * 32) >> 4), %[5]s + (u64)(((kk >> 2) * %[9]s * 128 + (kk & 3) * 32) >> 4), kk > 0);
      wgmma_commit();  // S
#pragma unroll
      for (int kk = 0; kk < DVP / 16; ++kk)
        %[10]s(accP[0], %[6]s + (u64)(((kk >> 2) * %[8]s * 128 + (kk & 3) * 32) >> 4), %[7]s + (u64)(((kk >> 2) * %[9]s * 128 + (kk & 3) * 32) >> 4), kk > 0);
      wgmma_commit();  // dP
%[11]s      wgmma_wait<1>();  // S is done; dP still runs while P is computed
      fence_acc(accS[0]);
    }
`, what, nt, decl, sa, sb, pa, pb, aRows, bRows, prod, inFlight)
}

// hopperPrelude writes the device functions only the Hopper kernel uses.
func (g *bwdGen) hopperPrelude(b *strings.Builder) {
	v := g.v
	if v.TMA {
		b.WriteString(v.bwdTMADecl())
	}
	b.WriteString(PrimitivesBegin + " (Hopper)\n")
	b.WriteString(ptxCpAsync(cpAsync{name: "cp_async_sw", bytes: 16, zfill: true, memory: true}))
	if g.keyRowsBiasPrefetched() {
		b.WriteString(ptxPrefetchL1("prefetch_l1"))
	}
	b.WriteString(wgmmaPrimitives())
	for _, pr := range v.HopperProducts() {
		b.WriteString(pr.source(v.DType))
	}
	if v.TMA {
		b.WriteString(tmaPrimitives())
	}
	if v.BulkDQ || v.WarpSpecialized {
		b.WriteString(WarpSpecializedPrimitives())
	}
	switch v.DBiasPath {
	case DBiasStore:
		b.WriteString(tmaStorePrimitive)
	case DBiasReduce:
		b.WriteString(tmaStorePrimitive + tmaReduceAddPrimitive)
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
// address s; rows >= rlim and chunks from column dlim (D, or a flat row's shift + D) on read as zero
// (16-byte copies, CH chunks a row).
template <int R, int CH, int D, int NTH>
DEV void load_sw(u32 s, const T* g, long long rs, int rlim, int dlim = D) {
  constexpr int TOT = R * CH;
#pragma unroll
  for (int it = 0; it < (TOT + NTH - 1) / NTH; ++it) {
    const int c = it * NTH + threadIdx.x;
    if (TOT % NTH == 0 || c < TOT) {
      const int r = c / CH, ch = c % CH;
      const bool ok = r < rlim && ch * 8 < dlim;
      cp_async_sw(s + sw_off<R>(r, ch), ok ? (const void*)(g + r * rs + ch * 8) : (const void*)g, ok ? 16 : 0);
    }
  }
}
`)
	if v.stagedStores() {
		b.WriteString(rowOutSource)
	}
	if v.Flat || v.bwdDeepTails() {
		b.WriteString(zeroColsSource) // flat rows' neighbours, the deep kernels' atom tails
	}
}

// flatName returns name for Flat variants and "" otherwise.
func (g *bwdGen) flatName(name string) string {
	if g.v.Flat {
		return name
	}
	return ""
}

// flatLimit returns the end of a tile's valid columns: d, or for Flat
// variants the shift sh plus d.
func (g *bwdGen) flatLimit(sh, d string) string {
	if g.v.Flat {
		return "(" + sh + " + " + d + ")"
	}
	return d
}

// tmaAt returns the coordinate arguments (row, head, batch, first column)
// of a streamed tile's boxes from row row of the sequence, for head h of a
// tensor with head dim d (a constant of the kernel, its padded width d +
// "P"): head h from column 0, or with Flat head 0 from flat_shift columns
// before h·d. In a packed batch (Varlen) the map spans every sequence's
// rows (batch extent 1), and the sequence's rows start at first (qr0 or
// kr0).
func (g *bwdGen) tmaAt(row, first, h, d string) string {
	if g.v.Flat {
		return fmt.Sprintf("%[3]s, 0, b, %[1]s * %[2]s - flat_shift(%[1]s, %[2]s, %[2]sP)", h, d, row)
	}
	if g.v.Varlen {
		return fmt.Sprintf("(int)%s + %s, %s, 0", first, row, h)
	}
	return row + ", " + h + ", b"
}

// qStageTMA returns the statements (each line after indent) with which one
// thread of the dK/dV kernel issues stage s's q and dO boxes for the step
// at query row iq of head hq (QA and DA 64-column atoms), their bytes
// announced on the stage's barrier.
func (g *bwdGen) qStageTMA(indent string) string {
	return fmt.Sprintf(`%[1]smbar_expect_tx(bar + 8 * s, (QA + DA) * BM * 128%[4]s);
%[1]stma_rows<BM, QA>(sQ + s * Q_STAGE, &tp.a, bar + 8 * s, %[2]s);
%[1]stma_rows<BM, DA>(sdO + s * DO_STAGE, &tp.b, bar + 8 * s, %[3]s);
`, indent, g.tmaAt("iq", "qr0", "hq", "DK"), g.tmaAt("iq", "qr0", "hq", "DV"), g.bwdBiasStageBytes()) + g.bwdBiasStageTMA(indent)
}

// kvStageTMA returns the statements (each line after indent) with which one
// thread of the dQ kernel issues stage s's k and v boxes for the step at
// key row jk, their bytes announced on the stage's barrier.
func (g *bwdGen) kvStageTMA(indent string) string {
	ka, va := swizzleAtoms(g.v.DKPad()), swizzleAtoms(g.v.DVPad())
	return fmt.Sprintf(`%[1]smbar_expect_tx(bar + 8 * s, (%[2]d + %[3]d) * BN * 128);
%[1]stma_rows<BN, %[2]d>(sK + s * K_STAGE, &tp.a, bar + 8 * s, %[4]s);
%[1]stma_rows<BN, %[3]d>(sV + s * V_STAGE, &tp.b, bar + 8 * s, %[5]s);
`, indent, ka, va, g.tmaAt("jk", "kr0", "kvh", "DK"), g.tmaAt("jk", "kr0", "kvh", "DV"))
}

// flatZero returns, for Flat variants, the code run once the tiles loaded
// once per block have landed: their columns outside the shifted head (tile
// a: rows ra, padded width pa, shift sa, head dim da; likewise b) zeroed.
func (g *bwdGen) flatZero(a, ra, pa, sa, da, b, rb, pb, sb, db string) string {
	if !g.v.Flat {
		return ""
	}
	return fmt.Sprintf(`
    // flat rows: the neighbouring heads' columns of the %[1]s and %[6]s tiles zeroed once they landed
    cp_async_wait0();
    %[11]s
    zero_cols<%[2]s>(smem + (%[1]s - s0), %[4]s, %[5]s, %[3]s, tid, NTH);
    zero_cols<%[7]s>(smem + (%[6]s - s0), %[9]s, %[10]s, %[8]s, tid, NTH);`, a, ra, pa, sa, da, b, rb, pb, sb, db, g.computeSync())
}

// hopperArg returns the parameter list of a Hopper dK/dV or dQ kernel:
// BwdParams, or with TMA the tensor maps ahead of them.
func (g *bwdGen) hopperArg() string {
	if g.v.TMA {
		return "const __grid_constant__ BwdTmaParams tp"
	}
	return "const BwdParams p"
}

// hopperArgAlias returns the line naming the BwdParams of a TMA kernel p.
func (g *bwdGen) hopperArgAlias() string {
	if g.v.TMA {
		return "  const BwdParams& p = tp.p;\n"
	}
	return ""
}

// tmaBarriers writes, for TMA variants, the two stage barriers of the
// streamed tiles (what: which) at the layout's "bar" and their
// initialization, for a kernel with stages stages of them (with one, the
// second barrier is unused).
func (g *bwdGen) tmaBarriers(b *strings.Builder, l bwdSmemLayout, what string, stages int) {
	if !g.v.TMA {
		return
	}
	parity := "(it >> 1) & 1"
	if stages == 1 {
		parity = "it & 1"
	}
	fmt.Fprintf(b, `  // ---- mbarriers: stage s of %s landed (one arrival with the byte count, then the copies); the
  // k-th fill of stage s completes phase k, so step it waits for parity %s
  const u32 bar = s0 + %d;
  if (tid == 0) {
    mbar_init(bar, 1);
    mbar_init(bar + 8, 1);
    mbar_fence_init();
  }
  __syncthreads();
`, what, parity, l.off["bar"])
}

// lockstepStepStart writes the start of step it (stage st) of a lockstep
// Hopper kernel over iters steps whose streamed tiles load (a lambda of
// (it, stage)) brings. With two stages: the wait for step it's tiles
// (loaded during step it-1, the first before the loop), then the loads of
// step it+1 into the other stage, which step it-1 has finished reading
// (its products were waited for). With one: once every warpgroup is done
// with step it-1's tiles, step it's loads and the wait until they landed.
func (g *bwdGen) lockstepStepStart(b *strings.Builder, stages int, load, iters string) {
	if stages == 1 {
		fmt.Fprintf(b, `    __syncthreads();  // every warpgroup is done with step it-1's tiles (its products were waited for)
    %s(it, 0);
    cp_async_commit();
    cp_async_wait0();
`, load)
		if g.v.TMA {
			b.WriteString("    mbar_wait(bar, it & 1);  // the streamed tiles of step it (one stage: the k-th fill completes phase k)\n")
		}
		b.WriteString(`    fence_proxy_async();
    __syncthreads();  // step it's tiles landed for every thread
`)
		return
	}
	b.WriteString("    cp_async_wait0();\n")
	g.tmaStageWait(b)
	fmt.Fprintf(b, `    fence_proxy_async();
    __syncthreads();  // step it's tiles landed for every thread; every warpgroup is done with step it-1
    if (it + 1 < %[2]s) { %[1]s(it + 1, st ^ 1); cp_async_commit(); }
`, load, iters)
}

// stageOf returns the stage of step it in a kernel of stages stages of
// streamed tiles.
func stageOf(stages int) string {
	if stages == 1 {
		return "0"
	}
	return "it & 1"
}

// tmaStageWait writes, for TMA variants, the wait for the streamed tiles
// of step it (stage st).
func (g *bwdGen) tmaStageWait(b *strings.Builder) {
	if g.v.TMA {
		b.WriteString("    mbar_wait(bar + 8 * st, (it >> 1) & 1);  // the streamed tiles of step it\n")
	}
}

// stepLoop returns the opening of a Hopper backward kernel's loop over its
// query steps, indented by indent: it = first .. first + iters − 1 (first:
// 0, or gs for a persistent kernel, whose steps count on over its tiles so
// that stages and barrier phases carry on from tile to tile); step it
// covers query block ib0 + (it − first) mod nib of query head
// kvh·G + (it − first) / nib, whose head and first query row it declares
// as h and i0. The quotient and remainder are carried from step to step
// (step_h, step_i) rather than divided out each step, a division by a
// value the compiler does not know.
func stepLoop(indent, h, i0, first string) string {
	carried, loop := "it / nib and it % nib", "for (int it = 0; it < iters; ++it) {\n"
	if first != "0" {
		carried = "(it - " + first + ") / nib and (it - " + first + ") % nib"
		loop = fmt.Sprintf("for (int it = %[1]s; it < %[1]s + iters; ++it) {  // the CTA's step it: its stage and barrier phases\n", first)
	}
	return indentLines(fmt.Sprintf(`int step_h = 0, step_i = 0;  // %s, carried from step to step
%s  const int %s = kvh * G + step_h, %s = (ib0 + step_i) * BM;
  if (++step_i == nib) step_i = 0, ++step_h;
`, carried, loop, h, i0), indent)
}

// hopperPreamble writes the opening of a Hopper backward kernel: its tile
// constants (with the byte sizes of one stage of its two streamed tiles,
// named s1 and s2, which hold what), the thread's coordinates (warpgroup
// wg), and the shared base on the swizzle's 1024-byte period (s0): aligned
// where the map l reserves the slack, else checked (alignSlack).
func (g *bwdGen) hopperPreamble(b *strings.Builder, t BwdTile, l bwdSmemLayout, s1 string, b1 int, s2 string, b2 int, what string) {
	v := g.v
	fmt.Fprintf(b, `  constexpr int BM = %d, BN = %d, NTH = 256;
  constexpr int DK = %d, DV = %d, DKP = %d, DVP = %d;
  constexpr int KCH = DKP / 8, VCH = DVP / 8;  // 16-byte chunks of a q/k row and of a dO/v row
  constexpr int %s = %d, %s = %d;  // bytes of one stage of the %s tiles
  (void)DK; (void)DV;
  const int tid = threadIdx.x, warp = `+warpIndex+`, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int wg = warp >> 2;  // warpgroup
  (void)tid; (void)g; (void)t4;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
`, t.BlockM, t.BlockN, v.DK, v.DV, v.DKPad(), v.DVPad(), s1, b1, s2, b2, what)
	if l.slack == 0 {
		b.WriteString(`  // the swizzle repeats every 1024 bytes: tiles start on 1024-byte boundaries; the tiles fill
  // shared memory without the slack to align the base, which must lie on a boundary already
  unsigned char* smem = smem_raw;
  if (smem_u32(smem) & 1023u) __trap();
  const u32 s0 = smem_u32(smem);
`)
		return
	}
	b.WriteString(`  // the swizzle repeats every 1024 bytes: tiles start on 1024-byte boundaries
  unsigned char* smem = smem_raw + (((smem_u32(smem_raw) + 1023u) & ~1023u) - smem_u32(smem_raw));
  const u32 s0 = smem_u32(smem);
`)
}

// addSwizzled adds a tile in the 128-byte swizzled layout: it starts on the
// swizzle's 1024-byte period (from a base the kernel aligns).
func (l *bwdSmemLayout) addSwizzled(name string, bytes int) {
	l.add(name, roundUp(bytes, swizzlePeriod))
}
