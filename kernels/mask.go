package kernels

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
