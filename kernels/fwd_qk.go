package kernels

import "github.com/flashattn/flashattn/attn"

// qkProduct writes qk(): S = Q·Kᵀ for one warp's 16·MT rows and 8·NT_S keys.
//
// Fragments: Q (A operand, row-major) is read with ldmatrix.x4 (or kept in
// registers), K (B operand, "col" = K row-major) with ldmatrix.x4 giving two
// 8-key n-tiles per load. In 16-bit types one k-step covers 16 elements
// (m16n8k16); in fp32 it covers 8 (m16n8k8 tf32), both 32 bytes = 2 chunks,
// so the ldmatrix addressing is shared.
func (x *gen) qkProduct() {
	v := x.v
	qdecl := ""
	if v.QInRegs {
		qdecl = ", const u32 (&qf)[MT][KSTEPS][4]"
	}
	x.p("// ---- S = Q·Kᵀ: S[16·MT x 8·NT_S] (qbase: the warp's first Q row; kbase: its first K row),")
	x.p("// accumulated over KSTEPS k-steps of the padded head dim DKP.")
	x.p("DEV void qk(float (&s)[MT][NT_S][4], u32 qbase, u32 kbase, u32 qo, u32 ko%s) {", qdecl)
	x.raw(`#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    u32 a[MT][4];  // Q fragments of this k-step
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
`)
	if v.QInRegs {
		x.raw(`#pragma unroll
      for (int e = 0; e < 4; ++e) a[mt][e] = qf[mt][kk][e];
`)
	} else {
		x.raw("      ldsm4(a[mt], qbase + qo + toff<KCH>(mt * 16, 2 * kk));\n")
	}
	x.raw("    }\n")
	if v.DType == attn.Float32 {
		x.raw(`    u32 ah[MT][4], al[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) split4(a[mt], ah[mt], al[mt]);
`)
	}
	x.raw(`#pragma unroll
    for (int np = 0; np < NT_S / 2; ++np) {  // 16 keys: two n-tiles per ldmatrix
      u32 bk[4];
      ldsm4(bk, kbase + ko + toff<KCH>(np * 16, 2 * kk));
`)
	if v.DType == attn.Float32 {
		// Each k step's split products go into fresh accumulators that are
		// then added with rounded fp32 adds: the sums, in the order, of the
		// backward's S product (bwdEmitTF32), so that both kernels get the same
		// S bit for bit. The backward recomputes P from this kernel's LSE with
		// its own S; an S summed otherwise (chained through the tensor cores'
		// accumulators, which also truncate) moves P by the difference times
		// the scale, which at D = 160–256 and a logit scale of 0.3 put the fp32
		// gradients at 3–10x the error of a naive fp32 computation.
		x.raw(`      u32 bh[4], bl[4];
      split4(bk, bh, bl);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float t0[4] = {0.f, 0.f, 0.f, 0.f}, t1[4] = {0.f, 0.f, 0.f, 0.f};
        mma3(t0, ah[mt], al[mt], bh[0], bh[1], bl[0], bl[1]);
        mma3(t1, ah[mt], al[mt], bh[2], bh[3], bl[2], bl[3]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[mt][2 * np][e] += t0[e];
          s[mt][2 * np + 1][e] += t1[e];
        }
      }
`)
	} else {
		x.raw(`#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma(s[mt][2 * np], a[mt], bk[0], bk[1]);
        mma(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
      }
`)
	}
	x.raw("    }\n  }\n}\n\n")
}
