package kernels

import (
	"fmt"
	"strings"
)

// Non-finite values in the backward kernels. A pair (i, j) that the mask
// hides contributes nothing to any gradient by the definition, but the
// tiles do not know that: a hidden pair's P is 0 exactly (its score is
// selected to −inf), yet dS = P∘(dP − Delta) is 0·NaN where dP (a hidden
// key's V, the row's dO) or Delta is NaN, and the products multiply the
// hidden pairs' zeros by Q, dO and K, so that 0·NaN = 0·Inf = NaN spreads a
// row's non-finite value to the gradients of keys (dK += dSᵀ·Q,
// dV += Pᵀ·dO) or queries (dQ += dS·K) that cannot see it: on the diagonal
// and window-edge tiles, through rows and keys past the sequence end, and
// over flat rows (BwdVariant.Flat) through the neighbouring heads' columns
// of the streamed tiles. Every such leak leaves a NaN in the gradient it
// reaches (a sum with a NaN term is NaN), and only rows holding a NaN or an
// infinity can have taken one.
//
// So the main loops do none of this work (checks and zeroing in the loop,
// as a first version did, cost far more: docs/kernels/nonfinite.md,
// "Backward: first design"), and
// neither do the main kernels' epilogues beyond one flag. Each kernel's
// epilogue folds the accumulators it stores (dK and dV, or dQ) into one
// flag, the block votes once, after its stores (the convert kernel: a warp
// on each dQ row it writes), and on a positive vote one thread raises the call's
// non-finite flag (two words in the workspace: the flag and a done
// counter, zeroed by the preprocess, which runs first). The slow path
// lives in a kernel of its own, the fix-up (BwdNonFiniteKernel,
// bwd_nonfinite.go), launched after the dQ or convert kernel and before
// the dBias reduction: with the flag clear it returns at once (one small
// launch; inlined into the main kernels, the slow path cost them
// registers, spills and time); with the flag set its blocks
// stride over key tiles and query row tiles, and a warp a row, each
// gradient row that holds a NaN or an infinity, read back from global
// memory, is recomputed exactly in scalar fp32 from q, k, v, dO, LSE2 and
// Delta in global memory, over the visible pairs only, and overwritten
// (nf_keys: dK and dV of a key over the query rows of the group that see
// it, and the dBias scratch of those pairs, before the reduction reads it;
// nf_query: dQ of a query row over the keys it sees). The last fix-up
// block to finish clears the flag and the counter. As in
// cpu.ReferenceBackward, a row with LSE = −inf (it sees no key with a
// finite score) contributes nothing, a visible NaN reaches what it touches
// (0·NaN at a dropped key included), and the scores take the main loop's
// transforms (scale, softcap, bias, dropout's keep mask and scale 256/T).

// nfFuncs writes the slow path's device functions: nf_bad and nf_fold,
// nf_pair (a visible pair's P and dS), nf_keys and nf_query. It uses
// visible, drop_u8 (under dropout), the conversions and ex2f, so it comes
// after them.
func (g *bwdGen) nfFuncs(b *strings.Builder) {
	nfBad(b)
	g.nfPair(b)
	g.dbiasAccFuncs(b)
	g.nfKeys(b)
	g.nfQuery(b)
}

// nfBad writes nf_bad (a value is NaN or ±Inf) and nf_fold (any element of
// an accumulator is).
func nfBad(b *strings.Builder) {
	b.WriteString(`// ---- non-finite gradients (rare; see bwd_nan.go): rows holding a NaN or an infinity recomputed exactly
DEV bool nf_bad(float x) { return !(fabsf(x) < FA_INF); }  // NaN or ±Inf
template <int A, int B_>
DEV void nf_fold(const float (&acc)[A][B_][4], bool& bad) {  // any non-finite accumulator element
#pragma unroll
  for (int a = 0; a < A; ++a)
#pragma unroll
    for (int c = 0; c < B_; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) bad |= nf_bad(acc[a][c][e]);
}
// nf_fold_cols: the same over the columns under LIMIT of a warpgroup product's accumulator whose first
// column is c0 (element e of block c: column c0 + 8c + 2·(lane mod 4) + e mod 2); the columns from LIMIT
// on, computed from tiles never loaded there and never stored, are left out
template <int LIMIT, int B_>
DEV void nf_fold_cols(const float (&acc)[1][B_][4], int c0, bool& bad) {
  const int t4 = threadIdx.x & 3;
#pragma unroll
  for (int c = 0; c < B_; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (c0 + 8 * c + 2 * t4 + (e & 1) < LIMIT) bad |= nf_bad(acc[0][c][e]);
}
`)
}

// nfPair writes nf_pair: a visible pair's P and dS recomputed in scalar
// fp32 from global memory, with the main loop's score transforms.
func (g *bwdGen) nfPair(b *strings.Builder) {
	v := g.v
	q, k, vv, do := g.in("q"), g.in("k"), g.in("v"), g.in("do")
	fmt.Fprintf(b, `// nf_pair: the visible pair of query row i (head h) and key row j (head kvh) of batch element b (segment rows
// from qr0 and kr0), as the main loop computes it, in scalar fp32 from global memory: pd, P as dV takes it
// (dropout: 0 where dropped, kept scaled), ds, dS with the softcap chain rule, dsb, dS as dBias takes it.
// False when row i counts for nothing (LSE -inf: no key with a finite score).
DEV bool nf_pair(const BwdParams& p, int b, int h, int kvh, long long qr0, long long kr0, int i, int j, float& pd, float& ds,
                 float& dsb) {
  const long long si = b * p.stat_sb + h * p.stat_sh + qr0 + i;
  const float l2 = p.lse2[si];
  if (l2 == FA_INF) return false;
  const T* qr = %[1]s;
  const T* kr = %[2]s;
  const T* vr = %[3]s;
  const T* dor = %[4]s;
  float s = 0.f, dp = 0.f;  // (loops kept rolled: unrolled, their loads would raise the kernel's register count)
#pragma unroll 4
  for (int d = 0; d < %[5]d; ++d) s = fmaf(t_to_f(qr[d]), t_to_f(kr[d]), s);
#pragma unroll 4
  for (int d = 0; d < %[6]d; ++d) dp = fmaf(t_to_f(dor[d]), t_to_f(vr[d]), dp);
`, q.at("i", "h"), k.at("j", "kvh"), vv.at("j", "kvh"), do.at("i", "h"), v.DK, v.DV)
	switch {
	case !v.Softcap && !v.Biased():
		b.WriteString("  const float pr = ex2f(fmaf(s, p.scale_log2, -l2));\n")
	default:
		if v.Softcap {
			fmt.Fprintf(b, "  const float th = %s(s * p.softcap_in);\n  float sv = p.softcap * th;\n", softcapTanh(v.DType))
		} else {
			b.WriteString("  float sv = s * p.scale;\n")
		}
		if v.Biased() {
			b.WriteString("  sv += bt_to_f(p.bias[b * p.bias_sb + h * p.bias_sh + i * p.bias_si + j * p.bias_sj]);\n")
		}
		b.WriteString("  const float pr = ex2f(fmaf(sv, FA_LOG2E, -l2));\n")
	}
	b.WriteString("  pd = pr;\n")
	if v.Dropout {
		b.WriteString(`  const bool kept = drop_u8((unsigned)i + p.drop_q0, (unsigned)j + p.drop_k0, (unsigned)(b * p.drop_heads + p.drop_h0 + h), p.drop_offset, p.seed_lo, p.seed_hi) < p.drop_threshold;
  dp = kept ? dp * p.drop_scale : 0.f;  // (a dropped key's dO·V is not taken)
  pd = kept ? pr * p.drop_scale : 0.f;
`)
	}
	b.WriteString("  ds = pr * (dp - p.delta[si]);\n  dsb = ds;\n")
	if v.Softcap {
		b.WriteString("  ds *= 1.f - th * th;\n")
	}
	b.WriteString("  return true;\n}\n")
}

// nfKeys writes nf_keys: the dK and dV rows of a dK/dV block's keys that
// hold a NaN or an infinity, recomputed over the query rows that see each
// key (and, with BiasGrad, those pairs' dBias scratch rewritten).
func (g *bwdGen) nfKeys(b *strings.Builder) {
	v := g.v
	q, do := g.in("q"), g.in("do")
	rowsOf := "" // the query rows that see key j
	if v.Masked() {
		rowsOf = `  if (p.right >= 0) ilo = max(ilo, j - p.right - off);
    if (p.left >= 0) ihi = min(ihi, j + p.left - off + 1);
`
	}
	scratch, hidden := g.nfDBiasRewrite()
	fmt.Fprintf(b, `// nf_keys: the dK/dV kernel's keys j0 .. j0 + rows - 1 (key head kvh of batch element b): each key whose dK or dV
// row holds a NaN or an infinity (read back from global memory) has both recomputed exactly over the query rows
// of the group that see it, and (dBias) those pairs' dS scratch rewritten. Warps take keys; lanes take query rows
// for P and dS, then columns.
DEV void nf_keys(const BwdParams& p, int b, int kvh, long long qr0, long long kr0, int n, int m, int j0, int rows, int warp,
                 int nwarps, int lane) {
  constexpr int CK = %[1]d, CV = %[2]d;  // columns per lane
  const int off = p.bottom_right ? m - n : 0, G = p.H / p.Hkv;
  (void)off;
  for (int jl = warp; jl < rows; jl += nwarps) {  // (uniform over the warp)
    const int j = j0 + jl;
    T* dk = p.dk + b * p.dk_sb + (kr0 + j) * p.dk_sr + kvh * p.dk_sh;
    T* dv = p.dv + b * p.dv_sb + (kr0 + j) * p.dv_sr + kvh * p.dv_sh;
    bool bad = false;
    for (int d = lane; d < %[3]d; d += 32) bad |= nf_bad(t_to_f(dk[d]));
    for (int d = lane; d < %[4]d; d += 32) bad |= nf_bad(t_to_f(dv[d]));
    if (__ballot_sync(0xffffffffu, bad) == 0u) continue;  // this key's gradients are finite
    float ak[CK], av[CV];
#pragma unroll
    for (int c = 0; c < CK; ++c) ak[c] = 0.f;
#pragma unroll
    for (int c = 0; c < CV; ++c) av[c] = 0.f;
    int ilo = 0, ihi = n;  // the query rows that see key j
  %[5]s    for (int h = kvh * G; h < kvh * G + G; ++h)
      for (int i0 = ilo; i0 < ihi; i0 += 32) {
        const int i = i0 + lane;
        float pd = 0.f, ds = 0.f, dsb = 0.f;
        const bool use = i < ihi && nf_pair(p, b, h, kvh, qr0, kr0, i, j, pd, ds, dsb);
%[6]s        for (unsigned u = __ballot_sync(0xffffffffu, use); u != 0u; u &= u - 1) {  // the rows, one at a time
          const int r = __ffs(u) - 1;
          const float pdr = __shfl_xor_sync(0xffffffffu, pd, lane ^ r), dsr = __shfl_xor_sync(0xffffffffu, ds, lane ^ r);
          const T* qr = %[7]s;
          const T* dor = %[8]s;
#pragma unroll
          for (int c = 0; c < CK; ++c)
            if (lane + 32 * c < %[3]d) ak[c] = fmaf(dsr, t_to_f(qr[lane + 32 * c]), ak[c]);
#pragma unroll
          for (int c = 0; c < CV; ++c)
            if (lane + 32 * c < %[4]d) av[c] = fmaf(pdr, t_to_f(dor[lane + 32 * c]), av[c]);
        }
      }
%[9]s#pragma unroll
    for (int c = 0; c < CK; ++c)
      if (lane + 32 * c < %[3]d) dk[lane + 32 * c] = t_from_f(ak[c] * p.scale);
#pragma unroll
    for (int c = 0; c < CV; ++c)
      if (lane + 32 * c < %[4]d) dv[lane + 32 * c] = t_from_f(av[c]);
  }
}
`, (v.DK+31)/32, (v.DV+31)/32, v.DK, v.DV, rowsOf, scratch, q.at("i0 + r", "h"), do.at("i0 + r", "h"), hidden)
}

// nfQuery writes nf_query: one query row's dQ recomputed over the keys it
// sees and stored.
func (g *bwdGen) nfQuery(b *strings.Builder) {
	v := g.v
	k := g.in("k")
	keysOf := g.rowKeys("  ", "i") // the keys query row i sees
	fmt.Fprintf(b, `// nf_query: dQ of query row i (head h of batch element b) recomputed exactly over the keys it sees and stored
// (one warp; lanes take keys for dS, then columns)
DEV void nf_query(const BwdParams& p, int b, int h, long long qr0, long long kr0, int n, int m, int i, int lane) {
  constexpr int CK = %[1]d;  // columns per lane
  const int kvh = h / (p.H / p.Hkv), off = p.bottom_right ? m - n : 0;
  (void)off;
  float aq[CK];
#pragma unroll
  for (int c = 0; c < CK; ++c) aq[c] = 0.f;
  int jlo = 0, jhi = m;  // the keys row i sees
%[2]s  for (int j0 = jlo; j0 < jhi; j0 += 32) {
    const int j = j0 + lane;
    float pd = 0.f, ds = 0.f, dsb = 0.f;
    const bool use = j < jhi && nf_pair(p, b, h, kvh, qr0, kr0, i, j, pd, ds, dsb);
    for (unsigned u = __ballot_sync(0xffffffffu, use); u != 0u; u &= u - 1) {  // the keys, one at a time
      const int r = __ffs(u) - 1;
      const float dsr = __shfl_xor_sync(0xffffffffu, ds, lane ^ r);
      const T* kr = %[3]s;
#pragma unroll
      for (int c = 0; c < CK; ++c)
        if (lane + 32 * c < %[4]d) aq[c] = fmaf(dsr, t_to_f(kr[lane + 32 * c]), aq[c]);
    }
  }
  T* dq = p.dq + b * p.dq_sb + (qr0 + i) * p.dq_sr + h * p.dq_sh;
#pragma unroll
  for (int c = 0; c < CK; ++c)
    if (lane + 32 * c < %[4]d) dq[lane + 32 * c] = t_from_f(aq[c] * p.scale);
}
`, (v.DK+31)/32, keysOf, k.at("j0 + r", "kvh"), v.DK)
}

// nfKeysCheck writes the dK/dV kernels' check after their stores: the
// accumulators accs folded into a flag and the vote (nfVote).
func nfKeysCheck(b *strings.Builder, perWarp bool, accs ...nfAcc) {
	b.WriteString("  {  // ---- non-finite dK or dV (rare: a NaN or an infinity in the inputs; see bwd_nan.go)\n    bool nfo = false;\n")
	for _, a := range accs {
		if a.limit == "" {
			fmt.Fprintf(b, "    nf_fold(%s, nfo);\n", a.name)
			continue
		}
		fmt.Fprintf(b, "    nf_fold_cols<%s>(%s, %s, nfo);\n", a.limit, a.name, a.col0)
	}
	nfVote(b, perWarp)
	b.WriteString("  }\n")
}

// nfAcc is an accumulator the non-finite check folds: all of it, or with
// limit the columns under limit of a warpgroup product's accumulator whose
// first column is col0 (nf_fold_cols).
type nfAcc struct{ name, col0, limit string }

// nfAll returns the accumulators names, each folded whole.
func nfAll(names ...string) []nfAcc {
	accs := make([]nfAcc, len(names))
	for i, n := range names {
		accs[i] = nfAcc{name: n}
	}
	return accs
}

// nfVote writes the vote on nfo: the block's (perWarp: each warp's, where
// not every thread of the block is left), and on a positive vote the
// non-finite flag raised for the fix-up kernel.
func nfVote(b *strings.Builder, perWarp bool) {
	if perWarp {
		// a warp-specialized kernel's producer warpgroup has left: one vote per compute warp
		fmt.Fprintf(b, "    if (__any_sync(0xffffffffu, nfo) && (threadIdx.x & 31) == 0) atomicOr(p.nf_flag, 1u);  // the fix-up kernel recomputes (%s)\n", BwdNonFiniteKernel)
		return
	}
	b.WriteString(nfRaise("__syncthreads_or(nfo)"))
}

// nfQueryCheck writes the separate dQ kernels' check after their stores:
// accQ folded into a flag, the block's vote, and on a positive vote the
// non-finite flag raised for the fix-up kernel.
func nfQueryCheck(b *strings.Builder, perWarp bool) {
	b.WriteString("  {  // ---- non-finite dQ (rare: a NaN or an infinity in the inputs; see bwd_nan.go)\n    bool nfo = false;\n    nf_fold(accQ, nfo);\n")
	nfVote(b, perWarp)
	b.WriteString("  }\n")
}
