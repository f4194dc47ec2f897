package kernels

import (
	"fmt"

	"github.com/flashattn/flashattn/attn"
)

// The dropout keep bits drawn by the producer warpgroup
// (Variant.ProducerDropout, warp-specialized Hopper forward).
//
// The producer warpgroup's first warp issues the loads with one lane; its
// other three warps (the keep warps, KEEP_THREADS threads) have nothing to
// do. Under dropout they draw each key block's keep mask (package philox's
// mapping, bit for bit) into shared memory, so that the compute warps no
// longer run Philox or exchange its bytes between lanes:
//
//   - Layout: stage g & 1 of key block g (numbered as K and V are, from the
//     tile's last block down) holds one 16-bit word per query row and
//     16-key unit, [BM rows][BN/16 units], bit 4·(k & 3) + (k >> 2)
//     keeping key 16·unit + k of the block: one Philox call's sixteen
//     numbers compared with the threshold, in the order of its bytes
//     (drop_keep32).
//   - Full barrier keepFull + 8·(g & 1), count KEEP_THREADS: every keep
//     thread arrives once its words of block g are stored (an mbarrier
//     arrival releases the thread's shared stores to the waiters).
//   - Empty barrier keepEmpty + 8·(g & 1), count NCOMPUTE: every compute
//     thread arrives once it has read its words of block g; the keep warps
//     wait for phase g/2 − 1 before drawing block g ≥ 2 into the stage.
//
// A compute warp reads its words while S = Q·Kᵀ of the block runs (where
// the early dropout bits were drawn) and keeps them with one shift and
// mask a word (keepFromShared); apply_keep_words zeroes the dropped
// probabilities.

// keepThreads is the number of producer threads that draw the keep bits:
// the producer warpgroup's warps 1 to 3.
const keepThreads = 96

// keepStageBytes is the shared memory of one stage of keep words: a 16-bit
// word per query row and 16-key unit.
func keepStageBytes(v Variant) int { return v.BlockM * v.BlockN / 16 * 2 }

// validateProducerDropout reports what the keep warps cannot serve.
func (v Variant) validateProducerDropout() error {
	if !v.ProducerDropout {
		return nil
	}
	switch {
	case !v.WarpSpecialized || !v.Dropout || !v.WGMMA || !v.TMA || v.WarpsN != 1:
		return attn.Errorf(attn.ErrUnsupported, "kernels: the producer's dropout keep bits need the warp-specialized forward with tensor-map loads, one warpgroup per row group, and dropout (WarpSpecialized %v, TMA %v, WarpsN %d, Dropout %v)", v.WarpSpecialized, v.TMA, v.WarpsN, v.Dropout)
	case v.EarlyDropout:
		return attn.Errorf(attn.ErrUnsupported, "kernels: the producer's dropout keep bits replace the early ones: not both")
	case v.BlockN%32 != 0:
		return attn.Errorf(attn.ErrUnsupported, "kernels: the producer's dropout keep bits want key blocks of a multiple of 32 keys (a compute lane reads 32-bit words), not %d", v.BlockN)
	}
	return nil
}

// keepConstants writes the keep stages' constants (after EMPTY_OFF).
func (x *gen) keepConstants(keepOff int) {
	if !x.v.ProducerDropout {
		return
	}
	x.p("constexpr int KEEP_OFF = %d;  // [2][BM][BN/16] 16-bit dropout keep words, drawn by the keep warps", keepOff)
	x.p("constexpr int KEEP_STAGE = %d;  // bytes of one stage", keepStageBytes(x.v))
	x.p("constexpr int KEEP_WORDS = BN / 32;  // 32-bit words of keep bits per query row")
	x.p("constexpr int KEEP_THREADS = %d;  // the producer's warps 1..3 draw the keep bits", keepThreads)
	x.p("constexpr int KEEPBAR_OFF = EMPTY_OFF + %d;  // full barriers of keep stages 0 and 1, then their empty barriers", tmaBarrierBytes)
}

// keepBarriers returns the keep stages' barrier addresses (after the
// pipeline's) and their initialization (inside the loop over stages i).
func (x *gen) keepBarriers() (decl, init string) {
	if !x.v.ProducerDropout {
		return "", ""
	}
	return "  const u32 keepFull = s_base + KEEPBAR_OFF, keepEmpty = keepFull + 16;  // keep stage b: + 8b\n",
		`      mbar_init(keepFull + 8 * i, KEEP_THREADS);
      mbar_init(keepEmpty + 8 * i, NCOMPUTE);
`
}

// keepProducer writes the keep warps' loop over the tile's key blocks
// (inside the producer warpgroup's branch, after the loading thread's):
// key block s (from the last, nb_hi − 1, down) into stage s & 1, its BM·BN/16
// Philox calls shared out among the KEEP_THREADS threads.
func (x *gen) keepProducer() {
	if !x.v.ProducerDropout {
		return
	}
	x.raw("    } else if (tid >= NCOMPUTE + 32) {  // ---- the keep warps: each key block's dropout keep words\n")
	x.raw(indentLines(keepBlocks("0"), "      "))
}

// keepBlocks returns the keep warps' loop over a tile's key blocks, the
// block s (from the last, nb_hi − 1, down) being number first + s of the
// CTA's sequence, which gives its stage and barrier phases.
func keepBlocks(first string) string {
	g := "s"
	if first != "0" {
		g = "(" + first + " + s)"
	}
	return fmt.Sprintf(`const int T = nb_hi - nb_lo;
for (int s = 0; s < T; ++s) {  // key block s: first key (nb_hi - 1 - s)·BN, number %[1]s
  const int kg = %[1]s;
  if (kg >= 2) mbar_wait(keepEmpty + 8 * (kg & 1), ((kg >> 1) - 1) & 1);  // block kg - 2's words read
  // (the coordinates derived again each block: at PRODUCER_REGS, values kept across blocks spill)
  const u32 bh = (u32)(b * p.drop_heads + p.drop_h0 + h), i0 = (u32)(m0 + p.drop_q0);
  const u32 dst = s_base + KEEP_OFF + (kg & 1) * KEEP_STAGE;
  const u32 kb0 = (u32)((nb_hi - 1 - s) * BN + p.drop_k0) >> 4;  // the block's first 16-key unit (drop_k0: a multiple of 16)
  // pair e: units 2e and 2e + 1 of the stage's [BM][BN/16] words, row e / (BN/32), units 2·(e %% (BN/32)) + 0, 1
  for (u32 e = threadIdx.x - (NCOMPUTE + 32); e < BM * (BN / 32); e += KEEP_THREADS) {
    const u32 r = i0 + e / (BN / 32), u = kb0 + 2 * (e %% (BN / 32));
    const uint4 wa = philox4(u, r, bh, p.drop_offset, p.seed_lo, p.seed_hi), wb = philox4(u + 1, r, bh, p.drop_offset, p.seed_lo, p.seed_hi);
    sts32(dst + 4 * e, drop_keep32(wa, wb, p.drop_threshold));
  }
  mbar_arrive(keepFull + 8 * (kg & 1));  // releases this thread's words of block kg
}
`, g)
}

// keepPersistent writes the keep warps' loop over a persistent CTA's tiles
// (inside the producer warpgroup's branch, after the loading thread's):
// each tile's index read from sched once Q's full barrier completes, as the
// compute warps read it, and Q's empty barrier arrived on at once (it
// counts the keep threads too), so that the loading thread writes no next
// index before every keep thread read this one — without it a tile with no
// key could let Q's barrier run two phases ahead of a keep thread.
func (x *gen) keepPersistent() {
	if !x.v.ProducerDropout {
		return
	}
	x.raw(`    } else if (tid >= NCOMPUTE + 32) {  // ---- the keep warps: each tile's key blocks' dropout keep words
      int kv0 = 0;  // key blocks of the CTA's tiles so far (as the loading thread counts them)
      for (int q_it = 0;; ++q_it) {
        mbar_wait(barQ, q_it & 1);  // the tile's index
        const int tile = *sched;
        mbar_arrive(emptyQ);  // read: the loading thread may write the next one
        if (tile >= ntiles) break;
`)
	x.raw(x.persistentTileRange("        "))
	x.raw(indentLines("if (nb_hi <= nb_lo) continue;  // no key: no block\n"+keepBlocks("kv0")+"kv0 += T;\n", "        "))
	x.raw("      }\n")
}

// keepFromShared writes a compute thread's keep bits of key block seq (a
// C++ expression: the block's number from the tile's last down) from the
// keep stage into dkeep, in apply_keep_words's layout, and its release of
// the stage (indent: the block's). A unit's word holds key 4w + b at bit
// 4b + w (drop_keep32), so lane c's keys 2c + e (e = 0, 1) sit at bits
// base + 4e and its keys 8 + 2c + e at base + 2 + 4e, base = 8·(c & 1) +
// (c >> 1): one shift by base a word brings them to bits 0, 4, 2, 6 (and
// 16 more for the word's second unit), row g + 8's one bit higher.
func (x *gen) keepFromShared(indent, seq string) {
	x.raw(indentLines(fmt.Sprintf(`u32 dkeep[MT][NT_S / 4];  // ---- dropout keep bits of the block, from the keep warps' words (apply_keep_words)
{
  const int kg = %s;  // the block's number
  mbar_wait(keepFull + 8 * (kg & 1), (kg >> 1) & 1);
  const u32* kw = (const u32*)(smem + (s_base - smem_addr(smem)) + KEEP_OFF + (kg & 1) * KEEP_STAGE);
  const int g = lane >> 2, c = lane & 3, base = 8 * (c & 1) + (c >> 1);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const u32* ra = kw + (wrow0 + 16 * mt + g) * KEEP_WORDS;  // rows g and g + 8 of the row tile
#pragma unroll
    for (int u = 0; u < KEEP_WORDS; ++u)  // keys 32u .. 32u + 31: key tiles 4u .. 4u + 3
      dkeep[mt][u] = ((ra[u] >> base) & 0x00550055u) | (((ra[u + 8 * KEEP_WORDS] >> base) & 0x00550055u) << 1);
  }
  mbar_arrive(keepEmpty + 8 * (kg & 1));  // this thread has read its words
}
`, seq), indent))
}

// dropKeep32Func holds the keep warps' device functions: drop_keep32, the
// keep bits of two Philox calls' sixteen numbers each in the transposed
// order keepFromShared reads, and apply_keep_words.
const dropKeep32Func = `// drop_flags4: byte b of the result is 1 when byte b of v is dropped (u >= t), else 0; add = (256 - t) in
// both 16-bit lanes. Bytes 0, 2 and bytes 1, 3 of v in 16-bit lanes: u + 256 - t reaches bit 8 of its
// lane exactly when u >= t (t in 1..256).
DEV u32 drop_flags4(u32 v, u32 add) {
  const u32 even = __byte_perm(v, 0u, 0x4240u) + add, odd = __byte_perm(v, 0u, 0x4341u) + add;
  return __byte_perm(even, odd, 0x7351u);  // the lanes' bit 8, for bytes 0, 1, 2, 3
}
// drop_nibbles: one call's dropped flags, key 4w + b (byte b of word w) at bit 4b + w of bytes 0 and 2
// (keys with b = 0, 1 in byte 0, b = 2, 3 in byte 2)
DEV u32 drop_nibbles(uint4 w, u32 add) {
  const u32 y = drop_flags4(w.x, add) | drop_flags4(w.y, add) << 1 | drop_flags4(w.z, add) << 2 | drop_flags4(w.w, add) << 3;
  return y | (y >> 4);
}
// drop_keep32: the keep bits of two calls a and b (two consecutive 16-key units of one row): key k of unit a
// at bit 4·(k & 3) + (k >> 2), of unit b at 16 more.
DEV u32 drop_keep32(uint4 a, uint4 b, u32 t) {
  const u32 add = (256u - t) * 0x00010001u;
  return ~__byte_perm(drop_nibbles(a, add), drop_nibbles(b, add), 0x6420u);
}
// Zero the dropped probabilities of this warp's S tile by the keep warps' bits (keepFromShared's layout):
// element e of key tile nt kept when bit 16·((nt >> 1) & 1) + 4·(e & 1) + 2·(nt & 1) + (e >> 1) of word
// nt >> 2 is set.
DEV void apply_keep_words(float (&s)[MT][NT_S][4], const u32 (&keep)[MT][NT_S / 4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (!((keep[mt][nt >> 2] >> (16 * ((nt >> 1) & 1) + 4 * (e & 1) + 2 * (nt & 1) + (e >> 1))) & 1u)) s[mt][nt][e] = 0.f;
}
`
