package kernels

import "github.com/flashattn/flashattn/attn"

// Masking. Query i (position in its sequence of n queries over m keys) sees
// the keys [key_lo(i), key_hi(i)): with the diagonal at key i + diag (diag =
// m − n bottom-right, 0 top-left), key_lo = max(0, i + diag − left) and
// key_hi = min(m, i + diag + right + 1), a negative side being unbounded.
// Both bounds grow with i, so a CTA's rows [m0, m0 + rows) see keys only in
// [key_lo(m0), key_hi(m0 + rows − 1)): the key blocks outside are skipped.
// A block [n0, n0 + BN) is seen whole by every row when key_lo(last row) ≤ n0
// and key_hi(first row) ≥ n0 + BN; only the other (boundary) blocks pay for
// the elementwise mask. Without a mask kind the only boundary is the
// sequence end.

// maskRange writes the key-block range [nb_lo, nb_hi) of the CTA, and the
// bounds of j − i used by the elementwise mask (one register per lane: the
// row position, instead of a bound pair per row).
func (x *gen) maskRange() {
	if x.v.Mask == MaskNone {
		x.raw(`  // ---- key blocks: all of them (no mask kind)
  const int nb_lo = 0, nb_hi = (m + BN - 1) / BN;
`)
		return
	}
	x.raw(`  // ---- visible keys of query i: [key_lo(i), key_hi(i)); the diagonal of query i is key i + diag
  const int diag = p.align_br ? m - n : 0;
  auto key_lo = [&](int i) { return p.win_left < 0 ? 0 : max(0, i + diag - p.win_left); };
  auto key_hi = [&](int i) { return p.win_right < 0 ? m : min(m, i + diag + p.win_right + 1); };
  const int lo_first = key_lo(m0), lo_last = key_lo(m0 + rows - 1);
  const int hi_first = key_hi(m0), hi_last = key_hi(m0 + rows - 1);
  // key blocks any row of this CTA can see
  const int nb_lo = lo_first / BN;
  const int nb_hi = hi_last <= 0 ? 0 : (hi_last + BN - 1) / BN;
  // elementwise test: key j is visible to row i iff dlo <= j - i < dhi and j < m
  const int dlo = p.win_left < 0 ? (int)0x80000000 : diag - p.win_left;
  const int dhi = p.win_right < 0 ? 0x7fffffff : diag + p.win_right + 1;
`)
}

// maskBoundary writes the test whether the key block at n0 needs the
// elementwise mask.
func (x *gen) maskBoundary() {
	if x.v.Mask == MaskNone {
		x.raw("    const bool boundary = n0 + BN > m;  // the sequence end cuts this block\n")
		return
	}
	x.raw("    const bool boundary = !(lo_last <= n0 && hi_first >= n0 + BN);  // some row does not see the whole block\n")
}

// maskApply writes the elementwise mask of a boundary block: masked scores
// become -inf.
func (x *gen) maskApply() {
	cond := "j >= m"
	if x.v.Mask == MaskWindow {
		cond = "j - (irow + mt * 16 + 8 * (e >> 1)) < dlo || j - (irow + mt * 16 + 8 * (e >> 1)) >= dhi || j >= m"
	}
	x.raw("    if (boundary) {  // ---- elementwise mask\n")
	if x.v.Mask == MaskWindow && x.v.Persistent {
		x.raw(`      // sequence position of this lane's row (mt, hf) is irow + 16·mt + 8·hf
      const int irow = m0 + wrow0 + g;
`)
	} else if x.v.LightTail {
		x.raw("      const u32 tx = tid_x();\n" + ctaOrderCall("      ", ""))
		x.raw(`      (void)pair_;
      // sequence position of this lane's row (mt, hf) is irow + 16·mt + 8·hf (query blocks run last first)
      const int irow = (int)(gridDim.x - 1 - blk_) * BM + (int)((tx >> 5) % WM) * MT * 16 + (int)((tx & 31) >> 2);
`)
	} else if x.v.Mask == MaskWindow {
		// The lane's row is re-derived here (fresh special-register reads)
		// instead of being kept in a register through the whole loop.
		x.raw(`      const u32 tx = tid_x(), cx = ctaid_x();
      // sequence position of this lane's row (mt, hf) is irow + 16·mt + 8·hf (query blocks run last first)
      const int irow = (int)(gridDim.x - 1 - cx) * BM + (int)((tx >> 5) % WM) * MT * 16 + (int)((tx & 31) >> 2);
`)
	}
	x.p(`#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = n0 + key0 + nt * 8 + 2 * c + (e & 1);
            if (%s) s[mt][nt][e] = NEG_INF;
          }
    }`, cond)
}

// Non-finite values (NaN, ±Inf). A masked score is replaced by −inf
// (maskApply selects, never adds), so a NaN or ±Inf in a key row nobody
// sees gives P = 0 exactly; but O += P·V still multiplies that 0 by the
// key's value row, and 0·NaN = 0·Inf = NaN spreads such a value to rows that
// do not see it (in the diagonal and window-edge blocks). A row whose scores
// are all −inf (l = 0: it gets O = 0) takes the same NaN from any value it
// visits, and over flat rows (Variant.Flat) a key tile also holds the
// neighbouring heads' columns, which Q's zeroed columns multiply, so that a
// NaN there gives this head's row a NaN score.
//
// The main loop does none of this work: every such case leaves a
// non-finite value in the row's O. The epilogue folds the O values each
// thread writes into one flag (x·0 summed: NaN when one is not finite), and
// after the stores (every product has completed) the CTA votes once
// (__syncthreads_or); on a positive vote (rare: a NaN or an infinity
// reached some row of the block through P·V, visibly or not) one thread
// raises the call's non-finite flag (Params.NFFlag). The slow path runs in
// a kernel of its own, the fix-up (NonFiniteKernel, fwd_nonfinite.go), in
// the same module and launched after the main kernel with its argument:
// with the flag clear it returns at once (inlined into the main kernel,
// the slow path cost it registers and time); with the flag set
// its blocks stride over the main kernel's CTAs and nf_rows, a warp a row,
// reads each row's O back from global memory and, where it holds a NaN or
// an infinity, recomputes it exactly from q, k and v in global memory, with
// scalar arithmetic (no accumulator registers, no tensor-core product):
// O_i = Σ_j P_ij·v_j over the keys j row i sees, P_ij = exp2(t_ij − L_i)
// with t the score in base-2 units (scale, softcap, bias) and L_i the
// row's base-2 LSE, read back from the stored LSE (computed again with
// nf_lse2 for a variant that stores none), times dropout's keep mask and
// scale 256/T (drop_u8, package philox). The last fix-up block to finish clears the flag and its done
// counter. As in cpu.Reference, a visible key's NaN
// or Inf reaches the row even when dropout drops the key (0·NaN), a row
// with L = −inf gets O = 0 and one with L = NaN (a NaN score) keeps O = NaN
// and LSE = NaN (under dropout its O is recomputed too: P = NaN at the kept
// keys and 0 at the dropped ones, so that a row whose keys are all dropped
// gets 0·v, as in the reference). Over flat rows a row with L = NaN has L recomputed as well (the NaN may
// be a neighbouring head's), and LSE rewritten when it comes out otherwise.

// nfFixupFuncs writes nf_rows, the slow path of the non-finite fix-up
// (and its helpers), and the fix-up kernel that runs it (nfFixupKernel).
// It uses bias_load, drop_u8 and store_elem, so it comes after them.
func (x *gen) nfFixupFuncs() {
	x.nfLoad()
	x.nfScore()
	if x.v.Flat || !x.v.LSE {
		x.nfLSE2()
	}
	x.nfRows()
	x.nfFixupKernel()
}

// nfLoad writes nf_ld (one element of q, k, v or O read as float) and
// nf_bad (a value is NaN or ±Inf).
func (x *gen) nfLoad() {
	v := x.v
	ld := "bf16_to_f32(*(const u16*)p)"
	switch v.DType {
	case attn.Float16:
		ld = "f16_to_f32(*(const u16*)p)"
	case attn.Float32:
		ld = "*(const float*)p"
	}
	x.p(`// ---- non-finite O (rare; see fwd_mask.go): rows whose O holds a NaN or an infinity, recomputed exactly
DEV float nf_ld(const char* p) { return %s; }  // one element of q, k, v or O (global memory)
DEV bool nf_bad(float x) { return !(fabsf(x) < __int_as_float(0x7f800000)); }  // NaN or ±Inf`, ld)
}

// nfScore writes nf_score: the score of key j in base-2 units, as the main
// loop transforms it (scale, softcap, bias).
func (x *gen) nfScore() {
	v := x.v
	x.raw(`// score of query row q with key row k (d elements), in base-2 units: the main loop's transform
DEV float nf_score(const Params& p, const char* q, const char* k, const char* brow, int j) {
  float s = 0.f;
  for (int d = 0; d < p.d_k; ++d) s = fmaf(nf_ld(q + (i64)d * ESZ), nf_ld(k + (i64)d * ESZ), s);
`)
	if v.Softcap {
		x.p("  float t = %s(s * p.softcap_in) * p.softcap_out;", softcapTanh(v.DType))
	} else {
		x.raw("  float t = s * p.scale_log2;\n")
	}
	if v.Bias != BiasNone {
		x.p("  t += bias_load(brow + (i64)j * p.bias_sm * %d) * LOG2E;", v.biasSize())
	} else {
		x.raw("  (void)brow; (void)j;\n")
	}
	x.raw("  return t;\n}\n")
}

// nfLSE2 writes nf_lse2: a row's base-2 LSE computed again over its keys,
// for variants that store no LSE and for flat rows whose LSE is NaN.
func (x *gen) nfLSE2() {
	x.raw(`// base-2 LSE of a row over its keys [lo, hi) (lanes take keys): NaN when a score is NaN or +Inf, −inf when
// none is finite; the same value in every lane
DEV float nf_lse2(const Params& p, const char* q, const char* k0, i64 k_rs, const char* brow, int lo, int hi, int lane) {
  float mx = NEG_INF, sum = 0.f;
  bool bad = false;
  for (int j = lo + lane; j < hi; j += 32) {
    const float t = nf_score(p, q, k0 + (i64)j * k_rs, brow, j);
    if (t != t || t == -NEG_INF) {
      bad = true;
    } else if (t > mx) {
      sum = sum * exp2f(mx - t) + 1.f;
      mx = t;
    } else if (t != NEG_INF) {
      sum += exp2f(t - mx);
    }
  }
  for (int k = 1; k < 32; k <<= 1) {  // butterfly: every lane ends with the same sums
    const float om = __shfl_xor_sync(FULL_MASK, mx, k), os = __shfl_xor_sync(FULL_MASK, sum, k);
    const float nm = fmaxf(mx, om);
    if (nm != NEG_INF) sum = sum * exp2f(mx - nm) + os * exp2f(om - nm);
    mx = nm;
  }
  if (__ballot_sync(FULL_MASK, bad) != 0u) return __int_as_float(0x7fffffff);
  return mx == NEG_INF ? NEG_INF : mx + log2f(sum);
}
`)
}

// nfRows writes nf_rows: each of a CTA's rows whose O holds a NaN or an
// infinity recomputed exactly from q, k and v in global memory.
func (x *gen) nfRows() {
	v := x.v
	x.raw(`// The CTA's rows [0, rows) from sequence position m0 (batch element or segment b, head h; query row offset
// qs of a packed batch), visible keys j of row i: dlo <= j - i < dhi; a row's LSE read back from global
// memory in base 2. Warps take rows, lanes value columns; the scores of 32 keys at a time, one key a lane.
// Everything from global memory and the parameters (it runs in the fix-up kernel, after the main kernel).
DEV void nf_rows(const Params& p, int b, int h, int m0, int rows, i64 qs, int dlo, int dhi, int tid) {
  constexpr int NV = (DVP + 31) / 32;  // value columns per lane
  const int lane = tid & 31, kvh = h / p.group;
  int m = p.m;  // keys of the sequence
  i64 ks = 0;   // first packed key row of the sequence
`)
	if v.Varlen {
		x.raw("  ks = ((const int*)p.cu_k)[b];\n  m = ((const int*)p.cu_k)[b + 1] - (int)ks;\n")
	}
	x.raw(`  const i64 q_rs = p.q_sn * ESZ, k_rs = p.k_sn * ESZ, v_rs = p.v_sn * ESZ, o_rs = p.o_sn * ESZ;
  const char* gQ = (const char*)p.q + ((i64)b * p.q_sb + (qs + m0) * p.q_sn + (i64)h * p.q_sh) * ESZ;
  const char* gK = (const char*)p.k + ((i64)b * p.k_sb + ks * p.k_sn + (i64)kvh * p.k_sh) * ESZ;
  const char* gV = (const char*)p.v + ((i64)b * p.v_sb + ks * p.v_sn + (i64)kvh * p.v_sh) * ESZ;
  char* gO = (char*)p.o + ((i64)b * p.o_sb + (qs + m0) * p.o_sn + (i64)h * p.o_sh) * ESZ;
  for (int r = tid >> 5; r < rows; r += NTHREADS / 32) {  // (uniform over the warp)
    char* orow = gO + r * o_rs;
    bool bad = false;
    for (int d = lane; d < p.d_v; d += 32) bad |= nf_bad(nf_ld(orow + (i64)d * ESZ));
    if (__ballot_sync(FULL_MASK, bad) == 0u) continue;  // this row's O is finite
    const int i = m0 + r;                               // sequence position of the row
    const i64 lo_ = (i64)i + dlo, hi_ = (i64)i + dhi;  // clamped to the sequence: the keys [lo, hi)
    const int lo = lo_ < 0 ? 0 : lo_ > m ? m : (int)lo_, hi = hi_ > m ? m : hi_ < lo ? lo : (int)hi_;
    const char* qrow = gQ + r * q_rs;
`)
	if v.Bias != BiasNone {
		x.p("    const char* brow = (const char*)p.bias + ((i64)b * p.bias_sb + (i64)h * p.bias_sh + (i64)i * p.bias_sn) * %d;", v.biasSize())
	} else {
		x.raw("    const char* brow = nullptr;\n")
	}
	if v.LSE {
		x.raw(`    float l2 = ((const float*)p.lse)[(i64)b * p.lse_sb + (i64)h * p.lse_sh + (qs + i) * p.lse_sn];  // as stored
    l2 = l2 == NEG_INF ? NEG_INF : l2 * LOG2E;  // in base 2 (NaN stays NaN)
`)
	} else {
		x.raw("    float l2 = nf_lse2(p, qrow, gK, k_rs, brow, lo, hi, lane);  // (no LSE output: computed again)\n")
	}
	if v.Flat {
		x.raw(`    if (l2 != l2) {  // a NaN score, or a neighbouring head's NaN in a key tile's columns (flat rows): again
      l2 = nf_lse2(p, qrow, gK, k_rs, brow, lo, hi, lane);
`)
		if v.LSE {
			x.raw(`      if (lane == 0 && l2 == l2)
        ((float*)p.lse)[(i64)b * p.lse_sb + (i64)h * p.lse_sh + (qs + i) * p.lse_sn] = l2 == NEG_INF ? NEG_INF : l2 * LN2;
`)
		}
		x.raw("    }\n")
	}
	if v.Dropout {
		// a NaN score makes every P NaN, and the sum runs over the kept keys' NaN and the dropped
		// keys' 0·v, as the reference's does (O = 0 where dropout drops every key the row sees)
		x.raw("    // (a NaN score, L = NaN: P = NaN at the kept keys, 0 at the dropped ones)\n")
	} else {
		x.raw("    if (l2 != l2) continue;  // a NaN score: O = LSE = NaN, as written\n")
	}
	x.raw(`    float acc[NV];
#pragma unroll
    for (int t = 0; t < NV; ++t) acc[t] = 0.f;
    if (l2 != NEG_INF) {  // else no key has a finite score: O = 0
      for (int j0 = lo; j0 < hi; j0 += 32) {
        const int j = j0 + lane;  // this lane's key
        float pr = 0.f;           // its probability (after dropout)
        if (j < hi) {
          pr = exp2f(nf_score(p, qrow, gK + (i64)j * k_rs, brow, j) - l2);
`)
	if v.Dropout {
		x.raw(`          const u32 u = drop_u8((u32)i + p.drop_q0, (u32)j + p.drop_k0, (u32)(b * p.drop_heads + p.drop_h0 + h), p.drop_offset, p.seed_lo, p.seed_hi);
          pr = u < p.drop_threshold ? pr * p.drop_scale : 0.f;  // a dropped key still multiplies its value
`)
	}
	x.raw(`        }
        const int cnt = min(32, hi - j0);
        for (int u = 0; u < cnt; ++u) {
          const float pu = __shfl_sync(FULL_MASK, pr, u);
          const char* vrow = gV + (i64)(j0 + u) * v_rs;
#pragma unroll
          for (int t = 0; t < NV; ++t)
            if (lane + 32 * t < p.d_v) acc[t] = fmaf(pu, nf_ld(vrow + (i64)(lane + 32 * t) * ESZ), acc[t]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < NV; ++t)
      if (lane + 32 * t < p.d_v) store_elem(orow + (i64)(lane + 32 * t) * ESZ, acc[t]);
  }
}

`)
}

// nfFixup writes, after the epilogue's stores, the CTA's vote on the
// threads' flags of non-finite O values (nf_o) and, on a positive vote,
// the non-finite flag raised for the fix-up kernel (fwd_nonfinite.go).
func (x *gen) nfFixup() {
	x.p(`
  // ---- non-finite O (rare; see fwd_mask.go): after every product and store, one vote; the fix-up kernel recomputes
  if (__syncthreads_or(nf_o != nf_o) && tid == 0) atomicOr((u32*)p.nf_flag, 1u);`)
}
