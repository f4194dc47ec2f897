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
	if x.v.Mask == MaskWindow {
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

// Masked keys with non-finite values. A masked score is replaced by −inf
// (maskApply selects, never adds), so a NaN or ±Inf in a key row nobody
// sees gives P = 0 exactly; but O += P·V still multiplies that 0 by the
// key's value row, and 0·NaN = 0·Inf = NaN would spread such a value to
// rows that do not see it. Only boundary blocks have keys that some rows
// see and others do not (the keys past the sequence end are zero-filled
// by every loader), so the kernels check the V tiles of those blocks as
// they land: each thread runs its share of the tile through nf_acc (x·0 +
// acc per element: 0 while the elements are finite, NaN from the first one
// that is not) and, only when it found one (rare), zeroes the non-finite
// elements of its share. With cp.async or register-staged loads a thread's
// share is what its own copies wrote, checked before the barrier that
// already makes the tile whole for the product; with tensor maps it is a
// slice of the landed tile, checked between the issues of S' = Q·Kᵀ of the
// next block and of O += P·V, with a vote (and, when some thread zeroed
// values, a proxy fence and a barrier) there. After the main loop, a CTA in
// which some thread zeroed values adds them back with nf_add_keys, read
// again from global memory, to the O elements of the rows that see those
// keys (NaN + x and Inf + x keep them, as the float64 reference's sums do;
// the later rescales are by positive factors).
//
// Not covered: over flat rows (Variant.Flat) a key tile also holds the
// neighbouring heads' columns, which Q's zeroed columns multiply; a NaN or
// Inf there reaches the scores of the keys of that row (see NOTES.md).

// maskedValues reports whether the variant checks V tiles for non-finite
// values: it has a mask kind (without one, no key below the sequence end
// is masked).
func (v Variant) maskedValues() bool { return v.Mask != MaskNone }

// nfFuncs writes the device functions of the non-finite checks that do
// not depend on the load path: the element test, the word scan and zeroing
// and nf_add_keys. nf_acc is a primitive (ptx).
func (x *gen) nfFuncs() {
	v := x.v
	if !v.maskedValues() {
		return
	}
	// magnitude bits of a word of elements and of one element, the least non-finite magnitude, the
	// element's value from its bits, its load
	word, one, exp, elem, load := "0x7fff7fffu", "0x7fffu", "0x7f80u", "bf16_to_f32((u16)h)", "*(const u16*)p"
	switch v.DType {
	case attn.Float16:
		exp, elem = "0x7c00u", "f16_to_f32((u16)h)"
	case attn.Float32:
		word, one, exp, elem, load = "0x7fffffffu", "0x7fffffffu", "0x7f800000u", "__uint_as_float(h)", "*(const u32*)p"
	}
	x.p(`// ---- non-finite values (NaN, ±Inf) in the V tiles of boundary blocks (see mask.go): the tile's
// elements go through nf_acc, and only a tile that holds such values takes the rare path
DEV bool nf_any(u32 acc) { return (acc & %s) != 0; }  // nf_acc saw a non-finite element
DEV bool nf_bits(u32 h) { return (h & %s) >= %s; }  // one element's bits: exponent all ones
DEV u32 nf_load(const char* p) { return %s; }  // one element's bits from global memory`, word, one, exp, load)
	if v.DType == attn.Float32 {
		x.raw("DEV u32 nf_zero_word(u32 w) { return nf_bits(w) ? 0u : w; }\n")
	} else {
		x.raw(`DEV u32 nf_zero_word(u32 w) {  // zero the non-finite halves of a word
  const u32 lo = nf_bits(w & 0xffffu) ? 0u : w & 0xffffu, hi = nf_bits(w >> 16) ? 0u : w >> 16;
  return lo | (hi << 16);
}
`)
	}
	x.p(`// NB bytes (4, 8 or 16) of a shared tile at p: scan into acc (the non-finite checks OR the scans of
// their pieces, each from 0: finite elements leave ±0), and zero their non-finite elements
template <int NB> DEV u32 nf_scan(const unsigned char* p, u32 acc) {
  if constexpr (NB == 16) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    return nf_acc(nf_acc(nf_acc(nf_acc(acc, w.x), w.y), w.z), w.w);
  } else {
#pragma unroll
    for (int k = 0; k < NB / 4; ++k) acc = nf_acc(acc, reinterpret_cast<const u32*>(p)[k]);
    return acc;
  }
}
template <int NB> DEV void nf_zero(unsigned char* p) {
#pragma unroll
  for (int k = 0; k < NB / 4; ++k) reinterpret_cast<u32*>(p)[k] = nf_zero_word(reinterpret_cast<u32*>(p)[k]);
}
// ---- rare: V's keys n0 .. n0 + BN - 1 held non-finite values, zeroed in the shared tile before
// O += P·V; afterwards each row adds the non-finite values of the keys it sees (key j - row i in
// [dlo, dhi)), read from global memory: v is key 0's row (byte stride v_rs), row0 the sequence
// position of the lane's first row, and O's column col0 + d of a lane holds V's column d
DEV void nf_add_keys(float (&o)[MT][NT_O][4], const char* v, i64 v_rs, int n0, int m, int row0, int dlo, int dhi,
                     int col0, int d_v, int lane) {
  const int g = lane >> 2, c = lane & 3;
  for (int w = 0; w < (BN + 31) / 32; ++w) {
    const int j = n0 + 32 * w + lane;  // one key per lane: does its row hold a non-finite value?
    bool bad = false;
    if (32 * w + lane < BN && j < m)
      for (int d = 0; d < d_v; ++d) bad |= nf_bits(nf_load(v + (i64)j * v_rs + (i64)d * ESZ));
    for (u32 keys = __ballot_sync(FULL_MASK, bad); keys != 0; keys &= keys - 1) {
      const int jb = n0 + 32 * w + __ffs(keys) - 1;
      const char* row = v + (i64)jb * v_rs;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int dj = jb - (row0 + mt * 16 + g + 8 * hf);
          if (dj < dlo || dj >= dhi) continue;  // this row does not see the key
#pragma unroll
          for (int nt = 0; nt < NT_O; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int d = col0 + nt * 8 + 2 * c + e;
              if (d < 0 || d >= d_v) continue;
              const u32 h = nf_load(row + (i64)d * ESZ);
              if (nf_bits(h)) o[mt][nt][2 * hf + e] += %s;
            }
        }
    }
  }
}
`, elem)
}

// nfTileFuncs writes nf_fix, which scans the share of a landed V tile that
// this thread may read before the barrier (what its own copies wrote; with
// tensor maps, after the wait on the tile's barrier, any part) and zeroes
// its non-finite elements when there are some, reporting whether there
// were. It follows the tile's loader, so it comes after it.
func (x *gen) nfTileFuncs() {
	v := x.v
	if !v.maskedValues() {
		return
	}
	x.raw("// ---- nf_fix: this thread's share of a landed V tile [BN rows]: scan; zero its non-finite elements (rare)\n")
	switch {
	case v.WGMMA && v.TMA:
		x.raw(`// (tensor maps: the tile has landed for every thread; thread tid takes its 16-byte chunks tid, tid + NTHREADS, ...,
// one at a time: this runs while S' = Q·Kᵀ of the next block is in flight, its accumulators live)
DEV bool nf_fix(unsigned char* t, int tid) {
  constexpr int CHUNKS = V_STAGE / 16, PASSES = (CHUNKS + NTHREADS - 1) / NTHREADS;
  u32 acc = 0;
#pragma unroll 1
  for (int k = 0; k < PASSES; ++k)
    if (CHUNKS % NTHREADS == 0 || tid + k * NTHREADS < CHUNKS) acc |= nf_scan<16>(t + 16 * (tid + k * NTHREADS), 0u);
  if (!nf_any(acc)) return false;
  for (int i = tid; i < CHUNKS; i += NTHREADS) nf_zero<16>(t + 16 * i);
  return true;
}
`)
	case v.WGMMA:
		x.raw(`// (cp.async: the chunks load_sw<BN, VCH> gave this thread, whose copies cp_wait completed)
template <class F> DEV void sw_copies(int tid, F f) {
  constexpr int CPR = VCH <= 4 ? 4 : VCH <= 8 ? 8 : VCH <= 16 ? 16 : VCH <= 32 ? 32 : 64;
  constexpr int RSTEP = NTHREADS / CPR;
  constexpr int PASSES = (BN + RSTEP - 1) / RSTEP;
  const int r0 = tid / CPR, c = tid % CPR;
  if (VCH < CPR && c >= VCH) return;
#pragma unroll
  for (int it = 0; it < PASSES; ++it) {
    const int r = r0 + it * RSTEP;
    if (BN % RSTEP == 0 || r < BN) f(sw_off<BN, VCH>(r, c));
  }
}
DEV bool nf_fix(unsigned char* t, int tid) {
  u32 acc = 0;
  sw_copies(tid, [&](u32 off) { acc |= nf_scan<16>(t + off, 0u); });
  if (!nf_any(acc)) return false;
  sw_copies(tid, [&](u32 off) { nf_zero<16>(t + off); });
  return true;
}
`)
	case v.LoadBytes == 2:
		x.raw(`// (register-staged: the element pairs ldg_tile<BN, VCH> put in this thread's staging registers, before
// sts_tile stores them)
DEV bool nf_fix(u32 (&r)[STAGE_REGS]) {
  constexpr int N = (BN * VCH * 4 + NTHREADS - 1) / NTHREADS;  // the V tile's pairs per thread
  u32 acc = 0;
#pragma unroll
  for (int it = 0; it < N; ++it) acc |= nf_acc(0u, r[2 * it] | (r[2 * it + 1] << 16));
  if (!nf_any(acc)) return false;
#pragma unroll
  for (int k = 0; k < 2 * N; ++k) r[k] = nf_bits(r[k]) ? 0u : r[k];
  return true;
}
`)
	default:
		x.raw(`// (cp.async: the LB-byte pieces load_tile<BN, VCH> gave this thread, whose copies cp_wait completed;
// one at a time: the check runs where the scores and O fill the registers, most kernels at the limit)
template <class F> DEV void tile_copies(int tid, F f) {
  constexpr int PER_ROW = VCH * 16 / LB;
  if constexpr (NTHREADS % PER_ROW == 0) {
    constexpr int RSTEP = NTHREADS / PER_ROW;
    constexpr int PASSES = (BN + RSTEP - 1) / RSTEP;
    const int r0 = tid / PER_ROW, cb = (tid % PER_ROW) * LB;
#pragma unroll 1
    for (int it = 0; it < PASSES; ++it)
      if (BN % RSTEP == 0 || r0 + it * RSTEP < BN) f(toff<VCH>(r0 + it * RSTEP, cb >> 4) + (cb & 15));
  } else {
    constexpr int TOTAL = BN * PER_ROW;
#pragma unroll 1
    for (int it = 0; it < (TOTAL + NTHREADS - 1) / NTHREADS; ++it) {
      const int idx = tid + it * NTHREADS;
      const int r = idx / PER_ROW, cb = (idx % PER_ROW) * LB;
      if (TOTAL % NTHREADS == 0 || idx < TOTAL) f(toff<VCH>(r, cb >> 4) + (cb & 15));
    }
  }
}
DEV bool nf_fix(unsigned char* t, int tid) {
  u32 acc = 0;
  tile_copies(tid, [&](u32 off) { acc |= nf_scan<LB>(t + off, 0u); });
  if (!nf_any(acc)) return false;
  tile_copies(tid, [&](u32 off) { nf_zero<LB>(t + off); });
  return true;
}
`)
	}
	x.raw("\n")
}

// nfEpilogue writes the rare path after the main loop: when some thread
// zeroed values in a V tile (vany; the CTA votes here unless the loop's
// votes made vany uniform already, with tensor maps), nf_add_keys for every
// boundary block, before O is normalized. Adding them there rather than
// after each block's product keeps the accumulators of the warpgroup
// products out of the loop's rare path (writes to them in a branch made
// ptxas serialize the products) and out of its registers; a non-finite
// value stays one through the later rescales and the normalization.
func (x *gen) nfEpilogue() {
	v := x.v
	if !v.maskedValues() {
		return
	}
	cond := "__syncthreads_or(vany)"
	if v.TMA {
		cond = "vany"
	}
	col := "dv0"
	if v.Flat {
		col = "dv0 - sv_" // the tile holds the head from column sv_
	}
	x.p(`
  if (%s) {  // ---- rare: V's boundary blocks held non-finite values, zeroed in their tiles
    for (int nb = nb_lo; nb < nb_hi; ++nb)
      if (!(lo_last <= nb * BN && hi_first >= nb * BN + BN)) nf_add_keys(o, gV, v_rs, nb * BN, m, m0 + wrow0, dlo, dhi, %s, p.d_v, lane);
  }`, cond, col)
}
