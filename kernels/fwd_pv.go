package kernels

import "github.com/flashattn/flashattn/attn"

// pvProduct writes pv(): O += P·V for one warp's 16·MT rows and 8·NT_O value
// columns starting at column dv0.
//
// With WarpsN = 1, P comes from the S registers: the C fragment of two
// adjacent 8-key n-tiles is exactly the A fragment of one 16-key k-step
// (m16n8k16), so P is only converted, never moved. In fp32 (m16n8k8 tf32)
// the C fragment holds keys 2c, 2c+1 where the A fragment wants c, c+4: the
// product runs over the keys in the order π(c) = 2c, π(c+4) = 2c+1 and reads
// the V rows in the same order. With WarpsN = 2, P comes from shared memory
// (all BN keys, written by both key halves) with ldmatrix.
//
// V (B operand) is read with ldmatrix.x4.trans in 16-bit types (two 8-column
// n-tiles per load) and with 32-bit shared loads in fp32.
func (x *gen) pvProduct() {
	v := x.v
	fromSmem := v.WarpsN > 1
	x.p("// ---- O += P·V: O[16·MT x 8·NT_O] (value columns dv0..), over the BN keys of the tile in PSTEPS k-steps.")
	if fromSmem {
		x.p("DEV void pv(float (&o)[MT][NT_O][4], u32 pbase, u32 sV, u32 po, u32 vo, int dv0, int lane) {")
	} else {
		x.p("DEV void pv(float (&o)[MT][NT_O][4], const float (&s)[MT][NT_S][4], u32 sV, u32 vo, int dv0, int lane) {")
	}
	x.raw(`#pragma unroll
  for (int kk = 0; kk < PSTEPS; ++kk) {
    u32 a[MT][4];  // P fragments of this k-step
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
`)
	switch {
	case fromSmem:
		x.raw("      ldsm4(a[mt], pbase + po + toff<PCH>(mt * 16, 2 * kk));\n")
	case v.DType == attn.Float32:
		x.raw(`      a[mt][0] = __float_as_uint(s[mt][kk][0]);  // (row g,   key π(c))
      a[mt][1] = __float_as_uint(s[mt][kk][2]);  // (row g+8, key π(c))
      a[mt][2] = __float_as_uint(s[mt][kk][1]);  // (row g,   key π(c+4))
      a[mt][3] = __float_as_uint(s[mt][kk][3]);  // (row g+8, key π(c+4))
`)
	default:
		x.raw(`      a[mt][0] = pack2(s[mt][2 * kk][0], s[mt][2 * kk][1]);          // (row g,   keys 2c..)
      a[mt][1] = pack2(s[mt][2 * kk][2], s[mt][2 * kk][3]);          // (row g+8, keys 2c..)
      a[mt][2] = pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);  // (row g,   keys 8+2c..)
      a[mt][3] = pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);  // (row g+8, keys 8+2c..)
`)
	}
	x.raw("    }\n")
	if v.DType == attn.Float32 {
		// Key row of V this lane reads for its first B register (relative to the
		// k-step), and the distance to the row of its second.
		r0, dr := "2 * (lane & 3)", "1"
		if fromSmem {
			r0, dr = "(lane & 3)", "4"
		}
		// Each k step's split products go into a fresh accumulator, added to O
		// with a rounded fp32 add, as in qkProduct: chained through the tensor
		// cores' truncating accumulators, O drifted toward zero over the keys,
		// and with it the backward's Delta = rowsum(dO∘O).
		x.p(`    u32 ah[MT][4], al[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) split4(a[mt], ah[mt], al[mt]);
    // this lane reads V[kk·8 + row][dv0 + nt·8 + g]: a lane offset plus immediates
    const u32 vl = sV + toff<VCH>(%s, 0) + dv0 * 4 + ((lane >> 2) >> 2) * 16 + ((lane >> 2) & 3) * 4;
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) {
      const u32 b0 = lds32(vl + toff<VCH>(kk * 8, 0) + nt * 32);
      const u32 b1 = lds32(vl + toff<VCH>(kk * 8 + %s, 0) + nt * 32);
      u32 bh0, bl0, bh1, bl1;
      split(b0, bh0, bl0);
      split(b1, bh1, bl1);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float t[4] = {0.f, 0.f, 0.f, 0.f};  // this k step's sum, added rounded
        mma3(t, ah[mt], al[mt], bh0, bh1, bl0, bl1);
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][nt][e] += t[e];
      }
    }
  }
}
`, r0, dr)
		return
	}
	x.raw(`#pragma unroll
    for (int np = 0; np < NT_O / 2; ++np) {  // 16 value columns: two n-tiles per ldmatrix
      u32 bv[4];
      ldsm4t(bv, sV + vo + toff<VCH>(kk * 16, 2 * np));  // vo includes the column base dv0
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma(o[mt][2 * np], a[mt], bv[0], bv[1]);
        mma(o[mt][2 * np + 1], a[mt], bv[2], bv[3]);
      }
    }
  }
}

`)
}
