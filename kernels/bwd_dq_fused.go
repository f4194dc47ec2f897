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
// heads' dQ over the compute warps, R rows a warp at once through L2
// (dq_tile_rows, as the conversion kernel), and their vote on a
// non-finite element.
func (g *bwdGen) dqFusedConvert(b *strings.Builder) {
	const rows = 4 // rows a warp loads before converting them
	fmt.Fprintf(b, `  {  // ---- dQ converted here: the CTA holding its (batch, key head)'s last ticket converts the group's rows
    volatile unsigned* last = reinterpret_cast<volatile unsigned*>(sdQ);  // the dQ tile's room, free now
#ifdef __CUDA_ARCH__
    if (%[4]s) asm volatile("fence.proxy.async.global;" ::: "memory");  // its completed adds, before the generic accesses below
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
      constexpr int R = %[3]d;  // rows a warp converts at once (dq_tile_rows)
      const int fw = tid >> 5, fl = tid & 31, nw = NCOMPUTE / 32, rows = G * n;
      bool bad = false;
      for (int r0 = fw; r0 < rows; r0 += nw * R) {
        int hq[R], i[R];
        bool live[R];
#pragma unroll
        for (int k = 0; k < R; ++k) {
          const int rr = r0 + nw * k;
          live[k] = rr < rows, hq[k] = kvh * G + rr / n, i[k] = rr %% n;
        }
        bad |= dq_tile_rows<R, true>(p, b, qr0, hq, i, live, fl);
      }
      // a NaN or an infinity (rare: one in the inputs; see bwd_nan.go): the warp's vote raises the flag, the fix-up
      // kernel recomputes the rows
      if (__ballot_sync(0xffffffffu, bad) != 0u && fl == 0) atomicOr(p.nf_flag, 1u);
    }
  }
`, g.computeSync(), BwdDQTicketWord, rows, wgIssuer)
}
