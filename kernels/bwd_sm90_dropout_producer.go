package kernels

import (
	"fmt"
	"strings"
)

// The dropout keep bits of the key-rows dK/dV kernel drawn by the producer
// warpgroup (BwdVariant.ProducerDropout), as the forward's
// (fwd_sm90_dropout_producer.go): the producer's first warp loads each
// step's q, dO, LSE2 and Delta; its other three (the keep warps) draw the
// step's keep bits into the same stage, and every keep lane arrives on the
// stage's full barrier (count 32 + KEEP_THREADS), so the compute warps'
// wait for the stage covers the bits and their release of it (the empty
// barrier) lets the keep warps refill it.
//
// Layout of a stage: [BN/16 units][16 keys][KR rounds] 32-bit words, word
// (u, k, r) holding bit i for query 32r + i of the step and key 16u + k of
// the tile — what drop_bits_kr gives compute warp u (the warp whose 16 keys
// unit u is) in dkeep[r][k >> 3] of its lanes g = k & 7. A keep warp draws
// one (unit, round) at a time: lane L the Philox call of query 32r + L and
// the unit, one vote a key hands every lane that key's bits of the 32
// queries, and lanes 0..15 store the words of their key. The compute warp
// reads its four (KR·2) words in place of drawing them.

// bwdKeepRounds returns KR, the 32-query rounds of a step's keep words.
func bwdKeepRounds(bm int) int { return (bm/8 + 3) / 4 }

// bwdKeepStageBytes returns the shared bytes of one stage of keep words.
func (v BwdVariant) bwdKeepStageBytes() int {
	t := v.bwdHopperTile()
	return t.BlockN / 16 * 16 * bwdKeepRounds(t.BlockM) * 4
}

// bwdProducerDropoutOK reports whether the producer's keep bits serve v:
// the warp-specialized key-rows dK/dV kernel under dropout, one tile a
// CTA.
func bwdProducerDropoutOK(v BwdVariant) bool {
	return v.WarpSpecialized && v.KeyRows && v.Dropout && !v.Persistent
}

// bwdKeepDecls writes the keep stages' constants and pointer.
func (g *bwdGen) bwdKeepDecls(b *strings.Builder, l bwdSmemLayout) {
	if !g.v.ProducerDropout {
		return
	}
	fmt.Fprintf(b, `  constexpr int KEEP_THREADS = %d, KR = (BM / 8 + 3) / 4;  // the producer's warps 1..3 draw the keep bits; 32-query rounds a step
  constexpr int KEEP_STAGE = BN / 16 * 16 * KR;  // words of one stage: [BN/16 units][16 keys][KR rounds]
  u32* const sKeep = reinterpret_cast<u32*>(smem + %d);  // [2][KEEP_STAGE]: each step's dropout keep words
`, keepThreads, l.off["sKeep"])
}

// bwdKeepFullCount returns the arrivals on a stage's full barrier: the
// loading warp's 32 lanes, and the keep warps'.
func (g *bwdGen) bwdKeepFullCount() int {
	if g.v.ProducerDropout {
		return 32 + keepThreads
	}
	return 32
}

// bwdKeepProducer returns the keep warps' branch (after the loading
// warp's), over the same steps.
func (g *bwdGen) bwdKeepProducer() string {
	if !g.v.ProducerDropout {
		return ""
	}
	return `    } else {  // ---- the keep warps (the producer's warps 1..3): each step's dropout keep words
` + stepLoop("      ", "hq", "iq", g.firstStep()) + `        const int s = it & 1;
        if (it >= 2) mbar_wait(empty + 8 * s, ((it >> 1) - 1) & 1);  // step it - 2 released the stage
        const u32 bh = (u32)(b * p.drop_heads + p.drop_h0 + hq);
        for (int w = warp - NCOMPUTE / 32 - 1; w < BN / 16 * KR; w += KEEP_THREADS / 32) {  // (unit w / KR, round w % KR)
          const int u = w / KR, r = w % KR;
          const uint4 x = philox4((u32)(j0 + 16 * u + p.drop_k0) >> 4, (u32)(iq + 32 * r + lane + p.drop_q0), bh, p.drop_offset, p.seed_lo, p.seed_hi);
          u32 mine = 0u;  // lane k < 16: key 16u + k's bits of the round's 32 queries
#pragma unroll
          for (int k = 0; k < 16; ++k) {
            const u32 wd = (k & 8) ? ((k & 4) ? x.w : x.z) : ((k & 4) ? x.y : x.x);
            const u32 vote = __ballot_sync(0xffffffffu, ((wd >> (8 * (k & 3))) & 0xffu) < p.drop_threshold);
            mine = lane == k ? vote : mine;
          }
          if (lane < 16) sKeep[s * KEEP_STAGE + (u * 16 + lane) * KR + r] = mine;
        }
        mbar_arrive(bar + 8 * s);  // this lane's keep words of step it are stored
      }
`
}

// bwdKeepRead returns a compute thread's reading of its keep words of the
// step (in place of drop_bits_kr): dkeep[r][hh] of key g + 8hh of the
// warp's unit.
func bwdKeepRead() string {
	return `    // ---- dropout keep bits of this warp's 16 keys and the BM queries, drawn by the keep warps into the stage:
    // element (key kj, query qi + c) kept when bit 8(nt & 3) + 2t4 + c of dkeep[nt >> 2][hh] is set
    u32 dkeep[KR][2];
    {
      const u32* kw = sKeep + st * KEEP_STAGE + (warp * 16 + g) * KR;  // unit warp (its 16 keys), key g
#pragma unroll
      for (int r = 0; r < KR; ++r) {
        dkeep[r][0] = kw[r];
        dkeep[r][1] = kw[8 * KR + r];
      }
    }
`
}
