package kernels

import (
	"fmt"
	"strings"

	"github.com/flashattn/flashattn/attn"
)

// Scores by key rows (BwdVariant.KeyRows): the warp-specialized Hopper
// dK/dV kernel's step for head dims up to 128, as FlashAttention-3
// arranges it. Warpgroup w owns keys 64w .. 64w+63 of the block, as in
// the other step, but computes S and dP transposed:
//
//	Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ    64 keys × the BM queries (64, or 80 or
//	                          128: QueryStep), both operands
//	                          K-major (the same instruction as S = Q·Kᵀ with
//	                          the operands swapped)
//	Pᵀ, dSᵀ                    element-wise with the query's LSE2 and Delta
//	                          per column; kept as 16-bit pairs of
//	                          consecutive queries, which is the A operand
//	                          layout of a k16 step
//	dV += Pᵀ·dO, dK += dSᵀ·Q   A from those registers, B (dO, q) read
//	                          N-major from shared memory
//
// so that with the separate dQ neither P nor dS goes through shared memory
// and the warpgroups never meet inside the loop. dK and dV keep the other step's layout (rows:
// keys), and with it its stores. Under dropout each warp draws the keep
// bits of its 16 keys and the step's queries (drop_bits_kr, one Philox call
// per 16 of a lane's elements, as the other steps draw them, handed out by
// votes), dP is kept or zeroed and rescaled before dSᵀ, and Pᵀ is dropped
// and rescaled once dSᵀ has read it, before dV += Pᵀ·dO.
//
// With the atomic dQ (AtomicDQ, BulkDQ or not; padded dK 128, where the
// warpgroups split dQ's columns, or steps of 128 queries at padded dK up to
// 64, where they split its rows) dS goes to shared memory
// after all, as FlashAttention-3 has it: each warpgroup stores its dSᵀ
// elements at their (query, key) place of the other step's dS tile, both
// warpgroups meet on named barrier 1 once the dV and dK products are
// issued, and dQ += dS·K (and its reduction) is the other step's. P has no
// tile in this step, and dS one only with the atomic dQ.

// KeyRowsOK reports whether v (with KeyRows set or not) can take the
// key-rows step: the warp-specialized Hopper kernels, padded head dims up
// to 128; with the atomic dQ only where both warpgroups share
// its columns (padded dK 128) or its rows (steps of 128 queries): where
// warpgroup 0 alone computes it, its product sits in a branch, and ptxas
// (NVRTC 13.0) then serializes every warpgroup product of the kernel.
func KeyRowsOK(v BwdVariant) bool {
	return v.WGMMA && v.WarpSpecialized && !v.bwdHopperWide() && (!v.AtomicDQ || v.bwdHopperSplitDQ() || v.bwdDQRowHalves())
}

// keyRowsProducts returns the product wrappers the key-rows step adds: dV
// += Pᵀ·dO with A from registers (wg_rv; dK += dSᵀ·Q takes the dQ kernel's
// wg_rq, both of N = DKP, where DV pads to the same width), and Sᵀ and dPᵀ
// over a step of other than 64 queries (keyRowsScores).
func (v BwdVariant) keyRowsProducts() []WGMMAProduct {
	if !v.KeyRows {
		return nil
	}
	var ps []WGMMAProduct
	if v.DVPad() != v.DKPad() {
		ps = append(ps, WGMMAProduct{Name: "wg_rv", N: v.DVPad(), TB: true, RegA: true})
	}
	if name := v.keyRowsScores(); name != "wg_s" {
		ps = append(ps, WGMMAProduct{Name: name, N: v.bwdHopperTile().BlockM})
	}
	return ps
}

// keyRowsScores returns the product wrapper of the key-rows step's Sᵀ and
// dPᵀ (64 keys × the step's queries): the other step's wg_s where the step
// has as many queries as a warpgroup has keys (64), else wg_sq, which the
// dQ kernel's S (64 queries × 64 keys) does not share.
func (v BwdVariant) keyRowsScores() string {
	t := v.bwdHopperTile()
	if t.BlockM == t.BlockN/2 {
		return "wg_s"
	}
	return "wg_sq"
}

// dkdvSM90StepKeyRows writes the key-rows loop over query blocks (the
// counterpart of dkdvSM90Step).
func (g *bwdGen) dkdvSM90StepKeyRows(b *strings.Builder) {
	v := g.v
	rv := "wg_rq"
	if v.DVPad() != v.DKPad() {
		rv = "wg_rv"
	}
	b.WriteString(stepLoop("  ", "h", "i0", g.firstStep()) + `    const int st = it & 1;
    mbar_wait(bar + 8 * st, (it >> 1) & 1);  // q, dO, LSE2 and Delta of step it (the producer's)
`)
	g.bwdBiasStageStep(b)
	if v.AtomicDQ {
		b.WriteString(`    const u32 pso = st * PS_BUF;  // this step's dS buffer
    T* const sdSb = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(sdS) + pso);
`)
	}
	g.fullMask(b)
	b.WriteString(g.keyRowsBiasPrefetch())
	early, biasDecl := "", g.keyRowsBiasDecl()+g.keyRowsBiasStagedDecl()
	if g.keyRowsBiasEarly() {
		b.WriteString(biasDecl + "    u32 bpre[BM / 8][2];  // this step's bias: the bits of (qi, kj) | (qi + 1, kj) << 16\n")
		early, biasDecl = g.keyRowsBiasEarlyLoads(), ""
	}
	wgScores(b, v.keyRowsScores(), "keys as rows: this warpgroup's BN/2 keys x the BM queries",
		"      const u64 dq = sw128_desc(sQ + st * Q_STAGE, 16, 1024), ddo = sw128_desc(sdO + st * DO_STAGE, 16, 1024);\n",
		"dKs", "dq", "dVs", "ddo", "BN", "BM", v.bwdHopperTile().BlockM/8, early)
	g.wsBwdRelease(b)
	fmt.Fprintf(b, `    // ---- Pᵀ and dSᵀ: element (key 64wg + kr, query qc) with kr = 16(warp & 3) + g + 8hh, qc = 8nt + 2t4 + c
%[5]s%[1]s%[11]s    u32 pk[BM / 8][2], dsk[BM / 8][2];  // Pᵀ and dSᵀ, 16-bit pairs of consecutive queries
%[2]s%[10]s%[15]s    wgmma_wait<0>();  // dPᵀ
    fence_acc(accP[0]);
%[14]s#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        %[12]s
        (void)kj; (void)qi;
        float pr[2], ds[2];
        unpack2(pk[nt][hh], pr[0], pr[1]);
%[13]s%[7]s#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float d = pr[c] * (%[8]s - %[6]s);
%[3]s          ds[c] = d;
        }
        dsk[nt][hh] = pack2(ds[0], ds[1]);%[9]s
      }
%[4]s`, g.keyRowsSoftcapDecl(), g.keyRowsPLoops(), g.keyRowsChain(), g.keyRowsStoreDS(), g.keyRowsStatsDecl(), g.keyRowsStat("d"),
		g.keyRowsKeptDecl(), g.keyRowsDP(), g.keyRowsDropP(), g.keyRowsDropBits(), biasDecl,
		keyRowsElem, g.keyRowsStatPair("d"), g.keyRowsDBiasDecl(), g.keyRowsDBiasTileFree())
	if v.AtomicDQ {
		g.keyRowsProductsAtomic(b, rv)
		return
	}
	keyRowsDV(b, rv, true)
}

// keyRowsDV writes dV += Pᵀ·dO over the BM queries (rv: the product's
// wrapper) and, with dK, dK += dSᵀ·Q beside it in one commit group; dqn,
// q's descriptor for dK, is declared before the group.
func keyRowsDV(b *strings.Builder, rv string, dK bool) {
	what, dkProduct := "dV += Pᵀ·dO", ""
	if dK {
		what = "dV += Pᵀ·dO and dK += dSᵀ·Q"
		dkProduct = `        const u32 as[4] = {dsk[2 * kk][0], dsk[2 * kk][1], dsk[2 * kk + 1][0], dsk[2 * kk + 1][1]};
        wg_rq(accdK[0], as, dqn + (u64)((kk * 2048) >> 4));
`
	}
	fmt.Fprintf(b, `    // ---- %[1]s over the BM queries: A from registers (k16 step kk: query columns 16kk .. 16kk+15),
    // dO and q read N-major
    const u64 dqn = sw128_desc(sQ + st * Q_STAGE, BM * 128, 1024);
    {
      const u64 ddn = sw128_desc(sdO + st * DO_STAGE, BM * 128, 1024);
      fence_acc(accdV[0]);
      fence_acc(accdK[0]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        const u32 ap[4] = {pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]};
        %[2]s(accdV[0], ap, ddn + (u64)((kk * 2048) >> 4));
%[3]s      }
      wgmma_commit();
    }
`, what, rv, dkProduct)
}

// keyRowsProductsAtomic writes the key-rows step's products with the
// atomic dQ in FlashAttention-3's order: dV += Pᵀ·dO; the barrier after
// which dS of all BN keys is in shared memory; dQ += dS·K; dK += dSᵀ·Q;
// then, once dV and dQ are complete and while dK still runs, dQ's
// reduction (dqReduce). The wait that closes the step retires dK. Both
// warpgroups run every product: KeyRowsOK takes the atomic dQ only where
// they split its columns.
func (g *bwdGen) keyRowsProductsAtomic(b *strings.Builder, rv string) {
	_, _, nq := g.v.bwdHopperCols()
	keyRowsDV(b, rv, false)
	what := fmt.Sprintf("dQ += dS·K over the block's BN keys (columns dq0 .. dq0 + %d)", nq)
	if g.v.bwdDQRowHalves() {
		what = fmt.Sprintf("dQ += dS·K over the block's BN keys (this warpgroup's queries i0 + dqi .., columns 0 .. %d)", nq)
	}
	acc := fmt.Sprintf("float accQ[%d][4];", nq/8)
	if g.v.bwdDQTransposed() {
		what = fmt.Sprintf("dQᵀ += Kᵀ·dSᵀ over the block's BN keys (this warpgroup's columns dq0 .. dq0 + %d as rows,\n    // the BM queries as columns)", nq)
		acc = "float accQ[BM / 8][4];  // element (column dq0 + 16(warp & 3) + g + 8hh, query 8nt + 2t4 + c) at [nt][2hh + c]"
	}
	fmt.Fprintf(b, `    fence_proxy_async();
%[5]s    %[1]s
    // ---- %[2]s, then dK += dSᵀ·Q (A from registers,
    // q read N-major); dQ is added to the fp32 accumulator while dK runs
%[4]s    %[3]s
    {
`, g.wsStepSync("dS of all BN keys in shared memory for the dQ product"), what, acc, g.keyRowsDBiasTileAdd(), g.keyRowsDBiasStoreWait(2))
	g.dqProduct(b)
	fmt.Fprintf(b, `      wgmma_commit();
    }
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      const u32 as[4] = {dsk[2 * kk][0], dsk[2 * kk][1], dsk[2 * kk + 1][0], dsk[2 * kk + 1][1]};
      wg_rq(accdK[0], as, dqn + (u64)((kk * 2048) >> 4));
    }
    wgmma_commit();
    {
`)
	g.dqReduce(b, "      wgmma_wait<1>();  // dV and dQ complete; dK runs on\n")
}

// keyRowsDropBits returns, under dropout, the drawing of the keep bits of
// the warp's 16 keys and the step's queries (drop_bits_kr): after Pᵀ, whose
// Sᵀ registers are then free, and before the wait for dPᵀ, while that
// product runs.
func (g *bwdGen) keyRowsDropBits() string {
	if !g.v.Dropout {
		return ""
	}
	if g.v.ProducerDropout {
		return bwdKeepRead()
	}
	return `    // ---- dropout keep bits of this warp's 16 keys and the BM queries (drop_bits_kr), drawn while dPᵀ runs:
    // element (key kj, query qi + c) kept when bit 8(nt & 3) + 2t4 + c of dkeep[nt >> 2][hh] is set
    u32 dkeep[(BM / 8 + 3) / 4][2];
    drop_bits_kr<BM / 8>(dkeep, (u32)(i0 + p.drop_q0), (u32)(j0 + 64 * wg + 16 * (warp & 3) + p.drop_k0) >> 4,
                         (u32)(b * p.drop_heads + p.drop_h0 + h), p.drop_offset, p.seed_lo, p.seed_hi, p.drop_threshold, lane);
`
}

// keyRowsKeptDecl returns, under dropout, the declaration of kw: the keep
// bits of the pair of elements (key kj, queries qi, qi + 1), bit c for
// query qi + c (the step's dkeep words).
func (g *bwdGen) keyRowsKeptDecl() string {
	if !g.v.Dropout {
		return ""
	}
	return "        const u32 kw = dkeep[nt >> 2][hh] >> (8 * (nt & 3) + 2 * t4);  // the pair's keep bits\n"
}

// keyRowsDP returns dP of element (key kj, query qi + c): the dPᵀ
// accumulator's, under dropout kept and rescaled or zeroed.
func (g *bwdGen) keyRowsDP() string {
	if !g.v.Dropout {
		return "accP[0][nt][hh * 2 + c]"
	}
	return "((kw >> c) & 1u ? accP[0][nt][hh * 2 + c] * p.drop_scale : 0.f)"
}

// keyRowsDropP returns, under dropout, the statement that turns the pair
// of Pᵀ just read for dSᵀ into the dropped and rescaled pair that dV +=
// Pᵀ·dO takes.
func (g *bwdGen) keyRowsDropP() string {
	if !g.v.Dropout {
		return ""
	}
	return `
        pk[nt][hh] = pack2((kw & 1u) ? pr[0] * p.drop_scale : 0.f, (kw & 2u) ? pr[1] * p.drop_scale : 0.f);`
}

// keyRowsStoreDS returns, with the atomic dQ, the stores of the warp's
// dSᵀ pairs (dsk, rounded as dK's product reads them) into this step's dS
// tile (query rows, key columns), the dQ product's A operand: each (nt, hh)
// pair of fragments is the 8x8 block of keys 16(warp & 3) + 8hh + 0..7 by
// queries 8nt + 0..7, which stmatrix .trans stores as 8 rows of 8 keys
// (16 bytes, one swizzled chunk), four blocks a store, where storing each
// element took 16-bit stores one by one.
func (g *bwdGen) keyRowsStoreDS() string {
	if !g.v.AtomicDQ {
		return ""
	}
	return `    {  // ---- dSᵀ into the dS tile, transposed: block (nt, hh) = matrix 2(nt & 1) + hh of a store
      const int mb = lane >> 3, mr = lane & 7;  // the block this lane addresses, and its row (query)
#pragma unroll
      for (int nt = 0; nt < BM / 8; nt += 2)
        stsm_x4_t(smem_u32(sdSb + sw_elem<BM>(8 * (nt + (mb >> 1)) + mr, 64 * wg + 16 * (warp & 3) + 8 * (mb & 1))),
                  dsk[nt][0], dsk[nt][1], dsk[nt + 1][0], dsk[nt + 1][1]);
    }
`
}

// keyRowsKey0 and keyRowsQuery0 are the thread's first key (at hh = 0: a
// row of Sᵀ) and first query (at nt = 0) of the step.
const (
	keyRowsKey0   = "j0 + 64 * wg + 16 * (warp & 3) + g"
	keyRowsQuery0 = "i0 + 2 * t4"
)

// keyRowsElem declares the step's element (nt, hh) of the thread: its key
// kj (a row of Sᵀ) and first query qi (its columns qi and qi + 1).
const keyRowsElem = "const int kj = " + keyRowsKey0 + " + 8 * hh, qi = i0 + nt * 8 + 2 * t4;"

// keyRowsPLoops returns the loop that computes Pᵀ of the step's elements
// into pk: without a mask or an element-wise feature (bias, softcap,
// dropout), twice — the copy for steps whose keys all lie in the sequence
// (full: every step but a last partial key block's) with no test, which
// would test and select every element for nothing, and the other with it;
// otherwise once with the test of steps that are not full, as the second
// copy's registers spilled there (docs/kernels/backward.md, "dS into its
// tile by stmatrix").
func (g *bwdGen) keyRowsPLoops() string {
	if v := g.v; v.Masked() || v.Biased() || v.Softcap || v.Dropout {
		return g.keyRowsPLoop(true)
	}
	return "    if (full) {  // every key of the step in the sequence: the loop without the test\n" +
		g.keyRowsPLoop(false) + "    } else {\n" + g.keyRowsPLoop(true) + "    }\n"
}

// keyRowsPLoop returns the loop that computes Pᵀ of the step's elements
// into pk, with the test of each element's visibility in steps that are
// not full where tested.
func (g *bwdGen) keyRowsPLoop(tested bool) string {
	mask := ""
	if tested {
		mask = "          if (!full && !visible(qi + c, kj, m, off, p.left, p.right)) x[c] = -FA_INF;\n"
	}
	body, read, end := "\n", "", "" // the nt loop's body: the hh loop, or a block with the staged bias's read first
	if g.v.BiasStaged {
		body, read, end = " {\n", g.keyRowsBiasStagedRead(), "    }\n"
	}
	return `#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt)` + body + read + `#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        ` + keyRowsElem + `
        (void)kj; (void)qi;
        float x[2];
` + g.keyRowsStatPair("l") + `#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float s = accS[0][nt][hh * 2 + c];
` + g.keyRowsLogit() + mask + `        }
        pk[nt][hh] = pack2(ex2f(x[0]), ex2f(x[1]));
      }
` + end
}

// keyRowsLogit returns the logit of element (key kj, query qi + c): the
// shared logit, its bias read from the step's staged tile where the
// variant stages it (BiasStaged), else from global memory at the step's
// addresses (keyRowsBiasDecl) plus the element's query offset.
func (g *bwdGen) keyRowsLogit() string {
	bias := ""
	switch {
	case g.v.BiasStaged:
		bias = g.keyRowsPairBias("bst[2 * (nt & 1) + hh]")
	case g.keyRowsBiasEarly():
		bias = g.keyRowsPairBias("bpre[nt][hh]")
	case g.keyRowsBiasHoisted():
		bias = "bt_to_f(bkr[hh][(nt * 8 + c) * bsi])"
	}
	// the staged tile's reads hold zeros past the queries and keys; the early loads too, but the
	// multiply-add that needs no range test spilled there (backward.md, "A staged bias in the key-rows step")
	return g.logit("          ", g.keyRowsStat("l"), "fc[nt][hh * 2 + c]", "(qi + c)", "kj", bias, g.v.BiasStaged)
}

// keyRowsBiasPairs reports whether the key-rows step holds its 16-bit bias
// in registers as pairs of adjacent queries' bits (the staged tile's
// reads, the early loads), which keyRowsPairBias converts.
func (g *bwdGen) keyRowsBiasPairs() bool {
	return g.keyRowsBiasEarly() || g.v.KeyRows && g.v.BiasStaged
}

// keyRowsPairBias returns the bias of element (kj, qi + c) from reg, the
// register of its pair (keyRowsBiasPairs): query qi's bits in the low half.
func (g *bwdGen) keyRowsPairBias(reg string) string {
	return bitsToF32Func(g.v.Bias) + "((u16)(" + reg + " >> (16 * c)))"
}

// keyRowsBiasStagedDecl returns, where the variant stages the bias
// (BiasStaged), the declaration of bst, the registers that
// keyRowsBiasStagedRead fills.
func (g *bwdGen) keyRowsBiasStagedDecl() string {
	if !g.v.BiasStaged {
		return ""
	}
	return "    u32 bst[4];  // the staged bias of query blocks nt, nt + 1 (nt even): pairs of queries 2t4, 2t4 + 1 of keys kj(0), kj(1)\n"
}

// keyRowsBiasStagedRead returns the read of the staged bias at the start
// of each even query block nt of the Pᵀ loop: the tile holds [query][key]
// rows, so one transposed ldmatrix.x4 of four 8×8 blocks — queries
// 8nt .. 8nt + 15 by the warp's keys 16(warp & 3) .. + 15 of its
// warpgroup's 64 — hands each lane the pairs of queries 2t4 and 2t4 + 1
// of its keys g and g + 8 for blocks nt and nt + 1 (bst[2(nt & 1) + hh]),
// where a 16-bit load an element took its own swizzled address. Read block
// by block, the four registers live only across two blocks: all of a
// step's at once (16 registers) spilled beside a mask (4 → 436 bytes at
// D = 128, NVRTC 12.4).
func (g *bwdGen) keyRowsBiasStagedRead() string {
	return `      if ((nt & 1) == 0)  // blocks (queries 8nt | 8nt + 8) x (keys +0 | +8); lane l addresses row l & 7 of block l >> 3
        ldsm_x4_t(bst, smem_u32(sBst + sw_elem<BM>(8 * nt + 8 * (lane >> 4) + (lane & 7), 64 * wg + 16 * (warp & 3) + 8 * ((lane >> 3) & 1))));
`
}

// keyRowsBiasHoisted reports whether the key-rows step addresses a bias
// from global memory once a step (keyRowsBiasDecl) rather than by each
// element's 64-bit index: without a softcap and without dropout, whose
// registers beside the addresses' spill more than the index saves, and
// above DK = 64 only with dBias or where the step loads the bias early
// (keyRowsBiasEarly), as the D = 128 step with a bias alone loaded after
// S's wait ran slower with them (backward.md, "The bias's addresses in
// the key-rows step").
func (g *bwdGen) keyRowsBiasHoisted() bool {
	v := g.v
	return v.Biased() && !v.BiasStaged && !v.Softcap && !v.Dropout && (v.DK <= 64 || v.BiasGrad || g.keyRowsBiasEarly())
}

// keyRowsBiasDecl declares, where keyRowsBiasHoisted, the addresses of the
// thread's two keys' bias in the step's first query row of the thread
// (i0 + 2t4, head h), once a step: an element's is then one add of its
// query offset times the row stride, where the 64-bit index of every
// element (batch, head, query and key products) cost about twenty
// instructions an element (docs/kernels/backward.md, "The bias's
// addresses in the key-rows step").
func (g *bwdGen) keyRowsBiasDecl() string {
	if !g.keyRowsBiasHoisted() {
		return ""
	}
	return `    // bias of the thread's keys kj(hh) in query row i0 + 2t4 of head h; query i0 + 2t4 + r at + r·bsi
    const i64 bsi = p.bias_si;
    const BT* bkr[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      bkr[hh] = p.bias + (b * p.bias_sb + h * p.bias_sh + (i64)(i0 + 2 * t4) * bsi +
                          (i64)(j0 + 64 * wg + 16 * (warp & 3) + g + 8 * hh) * p.bias_sj);
`
}

// keyRowsBiasPrefetched reports whether the key-rows step prefetches
// its bias rows into L1 at the step's start (keyRowsBiasPrefetch): a bias
// read from global memory after S's wait on the 128-query step, whose 64
// loads a thread wait on one another (48 of them load into a register an
// earlier one wrote, in SASS), so that they find their lines in L1. On
// steps of 64 queries it raised the spills (D = 128 with dBias 48 → 132
// bytes, NVRTC 12.4).
func (g *bwdGen) keyRowsBiasPrefetched() bool {
	v := g.v
	return v.KeyRows && v.Biased() && !v.BiasStaged && v.bwdHopperTile().BlockM > 64
}

// keyRowsBiasPrefetch returns, where keyRowsBiasPrefetched, the prefetch
// of the step's bias rows: each thread of a warpgroup one query row of the
// warpgroup's 64 keys (128 bytes of a 16-bit bias, 256 of an fp32 one),
// rows and keys inside the sequences only.
func (g *bwdGen) keyRowsBiasPrefetch() string {
	if !g.keyRowsBiasPrefetched() {
		return ""
	}
	half := ""
	if g.v.Bias.DType() == attn.Float32 {
		half = "\n        if (kw + 32 < m) prefetch_l1(row + 32 * p.bias_sj);  // the second 128 bytes"
	}
	return `    {  // ---- this step's bias rows into L1 while the products run: row r of the warpgroup's 64 keys
      const int r = 32 * (warp & 3) + lane, kw = j0 + 64 * wg;
      if (r < BM && i0 + r < n && kw < m) {
        const BT* const row = p.bias + b * p.bias_sb + h * p.bias_sh + (i64)(i0 + r) * p.bias_si + (i64)kw * p.bias_sj;
        prefetch_l1(row);` + half + `
      }
    }
`
}

// keyRowsBiasEarly reports whether the key-rows step loads its 16-bit
// bias from global memory, at the hoisted addresses (keyRowsBiasHoisted),
// while its S and dP products run (keyRowsBiasEarlyLoads), where the loads
// were issued after S's wait and each one waited for before its
// exponential: steps of at most 64 queries (16 registers of pairs; on
// steps of 128 ptxas sank the loads after the wait again), without a mask,
// dBias, a softcap or dropout (beside a mask or dBias the registers
// spilled: D = 128 with a mask 64 → 156 bytes, NVRTC 12.4).
func (g *bwdGen) keyRowsBiasEarly() bool {
	v := g.v
	return v.KeyRows && v.Biased() && v.Bias.DType() != attn.Float32 && !v.BiasStaged && !v.Masked() && !v.Softcap && !v.Dropout &&
		!v.BiasGrad && v.bwdHopperTile().BlockM <= 64
}

// keyRowsBiasEarlyLoads returns the loads of bpre (declared, with the
// step's bias addresses, before the products' block): the step's bias of
// the thread's elements as 16-bit pairs, queries qi and qi + 1 of key kj,
// 0 outside the sequences.
func (g *bwdGen) keyRowsBiasEarlyLoads() string {
	return `      {  // ---- this step's bias into bpre while S and dP run
#pragma unroll
        for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            ` + keyRowsElem + `
            const unsigned short* const bk = reinterpret_cast<const unsigned short*>(bkr[hh]);
            u32 w = 0u;
#pragma unroll
            for (int c = 0; c < 2; ++c)
              if (qi + c < n && kj < m) w |= (u32)bk[(nt * 8 + c) * bsi] << (16 * c);
            bpre[nt][hh] = w;
          }
      }
`
}

// keyRowsStatsInRegs reports whether the key-rows step keeps the LSE2 and
// Delta of its thread's query columns in registers (steps of up to 80
// queries) or reads them from the stage where it uses them (128: beside
// Sᵀ, dPᵀ and their 16-bit pairs of 128 queries they would not fit).
func (g *bwdGen) keyRowsStatsInRegs() bool { return g.v.bwdHopperTile().BlockM <= 80 }

// keyRowsStatsDecl declares the LSE2 and Delta of the thread's query
// columns: loaded into registers, or pointers to them in the stage.
func (g *bwdGen) keyRowsStatsDecl() string {
	if !g.keyRowsStatsInRegs() {
		return `    // LSE2 and Delta of this thread's query columns 8nt + 2t4 + c, read from the stage where they are used
    const float* lcs = sL + st * BM + 2 * t4;
    const float* dcs = sD + st * BM + 2 * t4;
`
	}
	return `    float lc[BM / 8][2], dc[BM / 8][2];  // LSE2 and Delta of this thread's query columns
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt) {  // columns 8nt + 2t4 and + 1: one 8-byte load each (adjacent, the pair 8-byte aligned)
      const float2 l2 = *reinterpret_cast<const float2*>(sL + st * BM + nt * 8 + 2 * t4);
      const float2 d2 = *reinterpret_cast<const float2*>(sD + st * BM + nt * 8 + 2 * t4);
      lc[nt][0] = l2.x; lc[nt][1] = l2.y;
      dc[nt][0] = d2.x; dc[nt][1] = d2.y;
    }
`
}

// keyRowsStat returns statistic x's value (l: LSE2, d: Delta) for query
// column 8nt + 2t4 + c (keyRowsStatsDecl; from the stage, the pair
// keyRowsStatPair loaded).
func (g *bwdGen) keyRowsStat(x string) string {
	if !g.keyRowsStatsInRegs() {
		return "(c ? " + x + "c2.y : " + x + "c2.x)"
	}
	return x + "c[nt][c]"
}

// keyRowsStatPair returns, where the statistics are read from the stage,
// the load of statistic x's two values of query columns 8nt + 2t4 and +1
// as one 8-byte load (they are adjacent and the pair 8-byte aligned),
// where each took its own.
func (g *bwdGen) keyRowsStatPair(x string) string {
	if g.keyRowsStatsInRegs() {
		return ""
	}
	return fmt.Sprintf("        const float2 %[1]sc2 = *reinterpret_cast<const float2*>(%[1]scs + nt * 8);  // columns 8nt + 2t4, +1\n", x)
}

// keyRowsSoftcapDecl declares, with softcap, the chain-rule factors of
// this thread's elements.
func (g *bwdGen) keyRowsSoftcapDecl() string {
	if !g.v.Softcap {
		return ""
	}
	return "    float fc[BM / 8][4];  // 1 - tanh² of each element's softcap\n"
}

// keyRowsDBiasFromFirst reports whether the step addresses its dBias
// elements from the thread's first (keyRowsDBiasDecl) rather than each
// from its indices: where the bias is staged and dBias goes through the
// scratch or directly, where it measured faster (not beside the atomic
// adds: docs/kernels/backward.md, "dBias addressed from the thread's first
// element"; DBiasTiles, DBiasStore and DBiasReduce hand dBias whole tiles).
// Beside the global loads of an unstaged bias the first element's address
// and the tile test are two more live registers, and NVRTC 12.4 spilled
// more in some of those variants (D = 128 with softcap 28 → 196–236
// bytes) and less in others; staged, the spills fell or held (D = 128
// softcap 208 → 64, 80 → 40) but for the scratch at D = 64 (20 → 36).
func (g *bwdGen) keyRowsDBiasFromFirst() bool {
	return g.v.BiasGrad && g.v.BiasStaged && (g.v.DBiasPath == DBiasScratch || g.v.DBiasPath == DBiasDirect)
}

// keyRowsDBiasDecl declares, under DBiasTiles, the thread's places in its
// warpgroup's dBias tile of shared memory (dbias_tile_at), and where
// keyRowsDBiasFromFirst the thread's place among the step's dBias
// elements (dbiasPlace): that of its first element, query i0 + 2t4 and
// key kj at hh = 0, from which element (nt, hh, c) lies 8nt + c rows and
// 8hh keys on (keyRowsChain); the step's tile wholly inside the sequences
// (dbin) skips the elements' tests.
func (g *bwdGen) keyRowsDBiasDecl() string {
	if g.v.DBiasPath == DBiasTiles {
		return `    // dBias: this warpgroup's tile of the step (the dQ tile's place), element (query 8nt + 2t4 + c, key
    // 16(warp & 3) + g + 8hh) at dbias_tile_at: row 8nt + 2t4 + c, chunk (2(warp & 3) + hh) ^ t4, word g
    float* const sdb = sdQ + wg * ` + fmt.Sprint(BwdDQTileFloats) + ` + 2 * t4 * 64 + g;
    const int dbc[2] = {((2 * (warp & 3)) ^ t4) << 3, ((2 * (warp & 3) + 1) ^ t4) << 3};
`
	}
	if !g.keyRowsDBiasFromFirst() {
		return ""
	}
	return `    // dBias: this thread's first element (query i0 + 2t4, key kj of hh = 0); element (nt, hh, c) lies 8nt + c
    // rows (of p.M keys) and 8hh keys on
    const bool dbin = i0 + BM <= n && j0 + BN <= m;
    ` + g.dbiasPointer() + ` const dbp = ` + g.dbiasPlace(keyRowsQuery0, keyRowsKey0) + `;
    const long long dbm = p.M;
`
}

// keyRowsChain returns the statements that finish d, the gradient of
// element (key kj, query qi + c)'s logit: its dBias element (from the
// thread's first where keyRowsDBiasFromFirst) and the softcap's chain
// rule.
func (g *bwdGen) keyRowsChain() string {
	v := g.v
	var b strings.Builder
	switch {
	case v.DBiasByMap(): // the dS tile goes out whole (keyRowsDBiasTileAdd)
	case v.DBiasPath == DBiasTiles:
		b.WriteString("          sdb[(8 * nt + c) * 64 + dbc[hh]] = d;  // every element: the tile's padding takes those past the sequences\n")
	case g.keyRowsDBiasFromFirst():
		b.WriteString("          if (dbin || (qi + c < n && kj < m)) " + g.dbiasStoreAt("dbp + (8 * nt + c) * dbm + 8 * hh", "d") + "\n")
	case v.BiasGrad:
		b.WriteString("          if (qi + c < n && kj < m) " + g.dbiasStore("qi + c", "kj", "d") + "\n")
	}
	if v.Softcap {
		b.WriteString("          d *= fc[nt][hh * 2 + c];\n")
	}
	return b.String()
}

// keyRowsDBiasTileFree returns, under DBiasTiles, the wait after which
// the warpgroup may store its dBias elements into its dQ tile: its issuing
// thread's reduce-adds of the last step (dQ's) no longer read the tile.
// It comes after Pᵀ, while dPᵀ runs.
func (g *bwdGen) keyRowsDBiasTileFree() string {
	if g.v.DBiasPath != DBiasTiles {
		return ""
	}
	return wgTileFree("    ", wgIssuer)
}

// keyRowsDBiasTileAdd returns, under DBiasTiles, the bulk reduce-add of
// the warpgroup's dBias tile into the accumulator, under DBiasStore the
// tensor-map store of its share of the dS tile into dBias, and under
// DBiasReduce its store into dBias's plane (the launch over batch element
// 0) or its tensor-map reduce-add there (the other batch elements), by the
// thread that adds its dQ tile, after the barrier that publishes the
// step's dS (the tiles' stores came before its proxy fence). A warpgroup
// whose keys all lie past the sequence has no tile; dQ's stores wait for
// the reads of both (wgTileReduce), which also frees the dS tile before
// any warp writes it again, a step later (two buffers) or in the next
// step (one).
func (g *bwdGen) keyRowsDBiasTileAdd() string {
	var what, copy string
	switch g.v.DBiasPath {
	case DBiasStore:
		what = "dS tile (the step's queries x its 64 keys) into dBias"
		copy = "tma_store_4d(&tp.d, smem_u32(sdSb + wg * BM * 64), j0 + 64 * wg, i0, h, b);  // (rows and keys past N and M are dropped)"
	case DBiasReduce:
		what = "dS tile (the step's queries x its 64 keys) stored into dBias's plane, or added there"
		copy = `// (rows and keys past N and M are dropped)
      const u32 src = smem_u32(sdSb + wg * BM * 64);
      const int dh = p.bias_nh == 1 ? 0 : h;  // dBias's plane: the head's, or the one the heads share
      if (dbias_first) tma_store_4d(&tp.d, src, j0 + 64 * wg, i0, dh, 0);
      else tma_reduce_add_4d<BT>(&tp.d, src, j0 + 64 * wg, i0, dh, 0);`
	case DBiasTiles:
		what = "dBias tile (64 queries x its 64 keys) into the accumulator"
		copy = fmt.Sprintf("bulk_reduce_add_f32(p.dbias_scratch + dbias_acc_at(p, b, h, i0, j0 + 64 * wg), smem_u32(sdQ + wg * %d), %d);",
			BwdDQTileFloats, BwdDQTileFloats*4)
	default:
		return ""
	}
	return "    if (" + wgIssuer + " && j0 + 64 * wg < m) {  // this warpgroup's " + what + "\n      " + copy + "\n      bulk_commit();\n    }\n"
}

// keyRowsDBiasStoreWait returns, under DBiasStore and DBiasReduce without
// the tiled dQ accumulator (whose wait at the end of each step covers it),
// the issuing thread's wait for the reads of its last store or add (the
// step before's) ahead
// of the first barrier after which warps write that store's dS buffer
// again (buffers: where it goes, 2 before the dQ barrier, 1 before the
// barrier that releases the buffer), and "" elsewhere.
func (g *bwdGen) keyRowsDBiasStoreWait(buffers int) string {
	if !g.v.DBiasByMap() || g.v.DQAccTiled() || g.v.bwdWSBuffers() != buffers {
		return ""
	}
	return "    if (" + wgIssuer + ") bulk_wait_read<0>();  // the last step's dBias store or add no longer reads its dS buffer\n"
}
