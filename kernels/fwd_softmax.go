package kernels

import (
	"fmt"

	"github.com/flashattn/flashattn/attn"
)

// Softmax. The kernel keeps, per query row, the running maximum row_max and
// the running sum row_sum of exp2(s·SC − row_max·SC) over the keys seen so
// far, where SC = scale·log2(e) (exp(x) = exp2(x·log2 e), and ex2.approx is
// one instruction). Prescaled variants (softcap, bias, negative scale) turn
// the scores into base-2 units first and use SC = 1, except a bias without
// softcap, whose scores scale·s + bias stay in natural units with
// SC = log2(e) (naturalScores). A new key block raises
// the maximum to m', rescales row_sum and the O accumulators by
// exp2((m − m')·SC), and adds its own probabilities. A row with no visible
// key so far has maximum −inf; its subtrahend is taken as 0 so that every
// exp2 gives 0 rather than NaN.

// biasFuncs writes the bias element loader.
func (x *gen) biasFuncs() string {
	switch x.v.Bias {
	case BiasF32:
		return "DEV float bias_load(const char* p) { return *(const float*)p; }\n"
	case BiasBF16, BiasF16:
		return "DEV float bias_load(const char* p) { return " + bitsToF32Func(x.v.Bias) + "(*(const u16*)p); }\n"
	}
	return ""
}

func (v Variant) biasSize() int {
	if v.Bias == BiasF32 {
		return 4
	}
	return 2
}

// biasSetup writes the per-lane bias row pointers (none for a staged bias,
// which is read from shared memory).
func (x *gen) biasSetup() {
	if x.v.Bias == BiasNone || x.v.BiasStaged {
		return
	}
	x.p(`  // ---- bias rows of this lane (sequence positions m0 + wrow0 + 16·mt + g + 8·hf); 0 strides broadcast
  const i64 bias_km = p.bias_sm * %d;  // key stride in bytes
  const char* brow[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = wrow0 + mt * 16 + g + 8 * hf;
      brow[mt][hf] = r < rows ? (const char*)p.bias + ((i64)b * p.bias_sb + (i64)h * p.bias_sh + (i64)(m0 + r) * p.bias_sn) * %d : nullptr;
    }`, x.v.biasSize(), x.v.biasSize())
}

// biasElement returns the declarations of score element (mt, nt, e)'s key
// j, in the block whose first key is n0 (an expression), and of br, its
// query's bias row (nullptr past the rows): what the bias loads of the
// transform and of the Hopper prefetch (biasPrefetch) index.
func biasElement(n0 string) string {
	return "const int j = " + n0 + " + key0 + nt * 8 + 2 * c + (e & 1);\nconst char* br = brow[mt][e >> 1];\n"
}

// transform writes the score transform of prescaled variants: softcap or
// scale, then bias, into base-2 units, or scale·s + bias in natural units
// (naturalScores).
func (x *gen) transform() {
	v := x.v
	if !v.prescaled() {
		return
	}
	x.raw(`    // ---- scores: `)
	switch {
	case v.naturalScores():
		x.raw("scale·s + bias (natural units: SC = log2 e)")
	case v.Softcap:
		x.raw("softcap·tanh(scale·s/softcap)·log2e into base-2 units")
	default:
		x.raw("scale·s·log2e into base-2 units")
	}
	if v.Bias != BiasNone && !v.naturalScores() {
		x.raw(" + bias·log2e")
	}
	x.raw(`
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float t = s[mt][nt][e];
`)
	switch {
	case v.naturalScores() && v.WGMMA:
		x.raw("          t = fmaf(t, p.scale, bpre[mt][nt][e]);  // (bias loaded while S ran: biasPrefetch, biasStageRead)\n")
	case v.naturalScores():
		x.raw(indentLines(biasElement("n0"), "          "))
		x.raw("          t = fmaf(t, p.scale, br != nullptr && j < m ? bias_load(br + j * bias_km) : 0.f);\n")
	case v.Softcap:
		x.p("          t = %s(t * p.softcap_in) * p.softcap_out;", softcapTanh(v.DType))
	default:
		x.raw("          t *= p.scale_log2;\n")
	}
	if v.Bias != BiasNone && !v.naturalScores() { // beside a softcap: the bias in base-2 units
		if v.WGMMA {
			x.raw("          t += bpre[mt][nt][e] * LOG2E;  // (loaded while S ran: biasPrefetch)\n")
		} else {
			x.raw(indentLines(biasElement("n0"), "          "))
			x.raw("          if (br != nullptr && j < m) t += bias_load(br + j * bias_km) * LOG2E;\n")
		}
	}
	x.raw("          s[mt][nt][e] = t;\n        }\n")
}

// softmaxPartialMax writes, for WarpsN > 1, the first phase: each warp's row
// maxima over its keys go to shared memory.
func (x *gen) softmaxPartialMax() {
	x.raw(`    // ---- softmax, phase 1: row maxima over this warp's keys -> shared
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mx = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
        if (c == 0) red[wn * BM + wrow0 + mt * 16 + g + 8 * hf] = mx;
      }
`)
}

// softmax writes the online-softmax update of a key block; S becomes P.
func (x *gen) softmax() { x.softmaxUpdate(false) }

// lazyRescaleBits is how far, in base 2, a key block's maximum may pass a
// row's reference before the reference moves (Pipeline.LazyRescale):
// probabilities stay at most 2^8, well inside the 16-bit types' range and
// the fp32 row sums'.
const lazyRescaleBits = 8.0

// softmaxUpdate writes the online-softmax update of a key block; S becomes
// P. With deferred, the O accumulators are not touched (an asynchronous
// product may still be adding into them): each row's rescale factor is left
// in alpha_r[mt][hf] for the caller to apply once the product is done.
func (x *gen) softmaxUpdate(deferred bool) {
	split := x.v.splitKeys()
	x.raw(`    // ---- online softmax (base 2): S -> P, rescale O and the row sums
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mx = row_max[mt][hf];
`)
	if split {
		x.raw(`#pragma unroll
        for (int w = 0; w < WN; ++w) mx = fmaxf(mx, red[w * BM + wrow0 + mt * 16 + g + 8 * hf]);
`)
	} else {
		x.raw(`#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
`)
	}
	if x.v.LazyRescale && deferred {
		x.p(`        // lazy rescale: the row's reference moves only where the block passes it by more than
        // %.0[1]f in base 2 (from −inf: at its first visible key; −inf against −inf gives NaN: stays), so
        // that P stays at most 2^%.0[1]f
        const bool moves = (mx - row_max[mt][hf]) * SC > %.1[1]ff;
        const float ref = moves ? mx : row_max[mt][hf];
        const float ms = ref == NEG_INF ? 0.f : ref * SC;                        // subtrahend, base-2 units
        const float alpha = moves ? ex2(row_max[mt][hf] * SC - ms) : 1.f;  // rescale of the old sums (0 on the first)
        row_max[mt][hf] = ref;`, lazyRescaleBits)
	} else {
		x.raw("        const float ms = mx == NEG_INF ? 0.f : mx * SC;      // subtrahend, base-2 units\n")
		if x.v.DType == attn.Float32 {
			// fp32 only: the fused form's drift of the LSE is far below the
			// 16-bit dtypes' rounding, and the separate multiply costs their
			// forward time (docs/kernels/forward.md, "The rescale factor")
			x.raw(`        // rescale of the old sums (0 on the first block): 2^(old subtrahend − new), the old one
        // rounded as ms was (__fmul_rn: not fused into the subtraction, which would give the
        // product's rounding error instead of 0 when the maximum holds, and alpha ≠ 1 every block)
        const float alpha = ex2(__fmul_rn(row_max[mt][hf], SC) - ms);
`)
		} else {
			x.raw("        const float alpha = ex2(row_max[mt][hf] * SC - ms);  // rescale of the old sums (0 on the first block)\n")
		}
		x.raw("        row_max[mt][hf] = mx;\n")
	}
	fmt.Fprintf(&x.b, `        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
          for (int e = 2 * hf; e < 2 * hf + 2; ++e) {
%s            s[mt][nt][e] = pr;
            sum += pr;
          }
        row_sum[mt][hf] = row_sum[mt][hf] * alpha + sum;
`, x.probability())
	if deferred {
		note := ""
		if x.v.LazyRescale {
			note = " (1: not at all)"
		}
		x.raw("        alpha_r[mt][hf] = alpha;  // O is rescaled once the P·V product in flight is done" + note + "\n      }\n")
		return
	}
	x.raw(`#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) {
          o[mt][nt][2 * hf] *= alpha;
          o[mt][nt][2 * hf + 1] *= alpha;
        }
      }
`)
}

// storeP writes, for WarpsN > 1, this warp's P block into the shared P tile.
func (x *gen) storeP() {
	x.raw(`    // ---- P -> shared [BM][BN] (this warp's rows and keys), read back whole by the PV product
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = wrow0 + mt * 16 + g + 8 * hf, col = key0 + nt * 8 + 2 * c;
          const u32 addr = sP + toff<PCH>(r, (col * ESZ) >> 4) + ((col * ESZ) & 15);
`)
	if x.v.DType == attn.Float32 {
		x.raw("          sts64(addr, s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]);\n")
	} else {
		x.raw("          sts32(addr, pack2(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));\n")
	}
	x.raw("        }\n")
}

// probability returns the statement of the softmax's exponent loop that
// turns score s[mt][nt][e] into its probability pr: 2^(s·SC − ms) by the
// MUFU's ex2, or, with Pipeline.PolyExp, by ex2Poly in the first PolyExp
// of every four key groups (nt is a constant once the loop is unrolled).
func (x *gen) probability() string {
	if x.v.PolyExp == 0 {
		return "            const float pr = ex2(fmaf(s[mt][nt][e], SC, -ms));\n"
	}
	return fmt.Sprintf(`            const float xe = fmaf(s[mt][nt][e], SC, -ms);
            // key groups 0..%[1]d of every four on the FMA pipes, the others on the MUFU
            const float pr = (nt & 3) < %[2]d ? ex2_poly(xe) : ex2(xe);
`, x.v.PolyExp-1, x.v.PolyExp)
}

// ex2Poly is the source of ex2_poly(x) = 2^x without the MUFU
// (Pipeline.PolyExp): x rounded to the nearest integer j by adding
// 1.5·2^23, which leaves j in the sum's low mantissa bits; 2^(x − j) on
// [−0.5, 0.5] by a cubic fitted for the least maximum relative error
// (7.5e-5, below the 16-bit types' rounding of P); j added into the
// exponent field. Below −125 (a masked key's −inf among them) it gives 0
// as ex2 does, and a NaN stays NaN. Plain C++: the host emulator compiles
// it as it stands.
const ex2Poly = `// 2^x on the FMA and integer pipes: x = j + f with j = round(x) (the 1.5·2^23 shift), 2^f by a cubic
// (relative error below 7.5e-5), j added into the exponent field; 0 below −125, NaN kept
DEV float ex2_poly(float x) {
  const bool low = x < -125.f;
  const float xc = low ? -125.f : x;
  const float t = xc + 12582912.f;          // 1.5·2^23: the low mantissa bits hold round(xc)
  const float f = xc - (t - 12582912.f);    // in [−0.5, 0.5]
  const float p = fmaf(fmaf(fmaf(0.0551713761f, f, 0.24261121f), f, 0.693261031f), f, 0.99992807f);
  const float r = __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));
  return low ? 0.f : r;
}
`
