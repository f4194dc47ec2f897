package kernels

import (
	"fmt"
	"strings"
)

// BwdDQTicketWord is the word of the backward's non-finite flag area
// (BwdParams.NFFlag) at which the tickets of FusedDQConvert begin: one
// uint32 per (batch, key head), [B][Hkv], which the preprocess zeroes.
// The workspace holds BwdDQTicketBytes past the area's first
// BwdNonFiniteFlagBytes.
const BwdDQTicketWord = BwdNonFiniteFlagBytes / 4

// BwdDQTicketBytes returns the bytes of FusedDQConvert's tickets for b
// batch elements and hkv key heads.
func BwdDQTicketBytes(b, hkv int) int64 { return 4 * int64(b) * int64(hkv) }

// FusedDQConvertOK reports whether v's dK/dV kernel can convert dQ itself
// (BwdVariant.FusedDQConvert): the warp-specialized kernel with the tiled
// dQ accumulator (DQAccTiled) and DK a multiple of 4, one tile a CTA (not
// Persistent, whose CTAs would hold several key heads' tickets), and no
// bias gradient (whose reduce launches split the batch).
func FusedDQConvertOK(v BwdVariant) bool {
	return v.WarpSpecialized && v.DQAccTiled() && v.DK%4 == 0 && !v.Persistent && !v.BiasGrad
}

// dqFusedConvert writes, for a FusedDQConvert variant, the end of the dK/dV
// kernel's compute warpgroups after their reduce-adds of dQ are complete:
// a proxy fence by each issuing thread (the copy engine's writes before
// the generic accesses), the CTA's ticket of its (batch, key head) — one
// thread, between two fences, after the compute warpgroups meet — and, in the CTA holding the
// last of the ceil(M / BN) tickets, the conversion of the group's query
// heads' dQ, row by row over the compute warps, each warp loading R rows'
// 16-byte units through L2 before converting them (as the conversion
// kernel does, convertTiledBody), and its vote on a non-finite element.
func (g *bwdGen) dqFusedConvert(b *strings.Builder) {
	v := g.v
	const rows = 4 // rows a warp loads before converting them
	fmt.Fprintf(b, `  {  // ---- dQ converted here: the CTA holding its (batch, key head)'s last ticket converts the group's rows
    volatile unsigned* last = reinterpret_cast<volatile unsigned*>(sdQ);  // the dQ tile's room, free now
#ifdef __CUDA_ARCH__
    if (%[7]s) asm volatile("fence.proxy.async.global;" ::: "memory");  // its completed adds, before the generic accesses below
#endif
    %[1]s  // every warpgroup's reduce-adds are complete
    if (tid == 0) {
      __threadfence();  // this CTA's adds, before its ticket
      const unsigned t = atomicAdd(p.nf_flag + %[2]d + b * p.Hkv + kvh, 1u);
      __threadfence();  // the other CTAs' adds, before this CTA reads them
      *last = t == (unsigned)((m + BN - 1) / BN) - 1u;
    }
    %[1]s
    if (*last) {
      constexpr int R = %[3]d, C = %[4]d;  // rows a warp loads at once; 16-byte units (four columns) a lane and row
      const int fw = tid >> 5, fl = tid & 31, nw = NCOMPUTE / 32, rows = G * n;
      bool bad = false;
      for (int r0 = fw; r0 < rows; r0 += nw * R) {
        float4 a[R][C];
#pragma unroll
        for (int k = 0; k < R; ++k) {  // every load first
          const int rr = r0 + nw * k, hq = kvh * G + rr / n, i = rr %% n;
          const float* gs = p.dqacc + b * p.dqa_sb + hq * p.dqa_sh;  // the tiled accumulator
#pragma unroll
          for (int e = 0; e < C; ++e) {
            const int c = fl + 32 * e;
            if (rr < rows && 4 * c < %[5]d) a[k][e] = __ldcg(reinterpret_cast<const float4*>(gs + %[6]s));
          }
        }
#pragma unroll
        for (int k = 0; k < R; ++k) {
          const int rr = r0 + nw * k, hq = kvh * G + rr / n, i = rr %% n;
          if (rr >= rows) break;
          T* gq = p.dq + b * p.dq_sb + (qr0 + i) * p.dq_sr + hq * p.dq_sh;
          const bool whole = (reinterpret_cast<unsigned long long>(gq) & 7ull) == 0;  // four elements a store
#pragma unroll
          for (int e = 0; e < C; ++e) {
            const int c = fl + 32 * e;
            if (4 * c >= %[5]d) break;
            const float x[4] = {a[k][e].x * p.scale, a[k][e].y * p.scale, a[k][e].z * p.scale, a[k][e].w * p.scale};
            bad |= nf_bad(x[0]) | nf_bad(x[1]) | nf_bad(x[2]) | nf_bad(x[3]);
            if (whole) {
              *reinterpret_cast<uint2*>(gq + 4 * c) = make_uint2(pack2(x[0], x[1]), pack2(x[2], x[3]));
            } else {
#pragma unroll
              for (int q = 0; q < 4; ++q) gq[4 * c + q] = t_from_f(x[q]);
            }
          }
        }
      }
      // a NaN or an infinity (rare: one in the inputs; see bwd_nan.go): the warp's vote raises the flag, the fix-up
      // kernel recomputes the rows
      if (__ballot_sync(0xffffffffu, bad) != 0u && fl == 0) atomicOr(p.nf_flag, 1u);
    }
  }
`, g.computeSync(), BwdDQTicketWord, rows, (v.DK/4+31)/32, v.DK, v.dqAccTiledAt("i", "4 * c"), wgIssuer)
}
