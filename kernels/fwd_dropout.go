package kernels

// dropoutFuncs writes Philox4x32-10 (philoxFunc) and the keep-mask
// application, which reproduce package philox bit for bit:
//
//	key     = (lo32(seed), hi32(seed))
//	counter = (j >> 2, i, b·H + h, offset)
//	keep    = Philox(counter, key)[j & 3] < threshold
//
// In the mma C layout lane (g, c) holds keys 2c, 2c+1 of an 8-key n-tile for
// rows g and g+8: lanes c and c^1 share the key group j >> 2 for both rows.
// Each lane therefore draws one Philox block, for row g (c even) or g+8
// (c odd), and the pair swaps the two words the other needs: one Philox call
// per lane per n-tile instead of two.
func (x *gen) dropoutFuncs() {
	if !x.v.Dropout {
		return
	}
	x.raw("// ---- dropout\n" + philoxFunc)
	x.raw(`// Zero the dropped probabilities of this warp's S tile. i0: sequence position of the warp's
// first row; j0: sequence position of the warp's first key; bh = b·H + h.
DEV void apply_dropout(float (&s)[MT][NT_S][4], const Params& p, int i0, int j0, u32 bh, int lane) {
  const int g = lane >> 2, c = lane & 3;
  const bool odd = c & 1;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const u32 row = (u32)(i0 + mt * 16 + g + (odd ? 8 : 0));  // the row this lane draws for
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) {
      const u32 j = (u32)(j0 + nt * 8 + 2 * c);  // even key: words j&3, j&3+1 of group j>>2
      const uint4 w = philox4(j >> 2, row, bh, p.drop_offset, p.seed_lo, p.seed_hi);
      // even lanes drew row g and need row g+8's words 0,1; odd lanes drew row g+8 and need row g's words 2,3
      const u32 ra = __shfl_xor_sync(FULL_MASK, odd ? w.x : w.z, 1);
      const u32 rb = __shfl_xor_sync(FULL_MASK, odd ? w.y : w.w, 1);
      const u32 t = p.drop_threshold;
      const u32 r0 = odd ? ra : w.x, r1 = odd ? rb : w.y;  // row g,   keys j, j+1
      const u32 r2 = odd ? w.z : ra, r3 = odd ? w.w : rb;  // row g+8, keys j, j+1
      s[mt][nt][0] = r0 < t ? s[mt][nt][0] : 0.f;
      s[mt][nt][1] = r1 < t ? s[mt][nt][1] : 0.f;
      s[mt][nt][2] = r2 < t ? s[mt][nt][2] : 0.f;
      s[mt][nt][3] = r3 < t ? s[mt][nt][3] : 0.f;
    }
  }
}

`)
}
