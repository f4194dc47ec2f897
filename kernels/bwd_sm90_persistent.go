package kernels

import (
	"fmt"
	"strings"
)

// The persistent dK/dV kernel (BwdVariant.Persistent): the launch's tiles
// (key blocks of BN keys of one batch element and key head; ntiles =
// nkb·B·Hkv, nkb = ⌈M / BN⌉) are numbered as the grid of the other dK/dV
// kernels orders its CTAs — the key blocks of a (batch element, key head)
// pair fastest, the pairs one after another, or under LightTail in
// tile_order's order — and the PersistentGrid CTAs take them in that
// order from a counter in global memory as they free up, as the
// hardware's dispatch takes the CTAs of one tile each. A static share
// (CTA c taking tiles c, c + gridDim.x, …) measured slower: under a mask,
// whose tiles weigh unequally (a key block sees the queries from its keys
// on), some CTAs were left with more steps than others; without one, the
// CTAs drift apart and the tiles in flight, which share q and dO in L2,
// with them.
//
// The producer warp and the compute warpgroups walk the same tiles in two
// loops of their own (their register budgets differ). Steps are numbered
// over the CTA's tiles (gs: the steps of its earlier tiles), so the stages
// and the phases of their full and empty barriers carry on from one tile
// to the next. The producer's first lane also loads each tile's K and V
// (the dQ kernel's tensor maps, boxes of its BN rows, two or more a tile)
// against a full and an empty barrier of their own (kt: the CTA's tiles so
// far; tile kt completes phase kt mod 2 of each). A compute thread
// releases the tile's K and V and its last stage once the tile's products
// are complete (rather than the stage at the next step's S, which would
// hold back the producer's second stage until the next tile runs), so the
// next tile's K and V and its first two q and dO stages land while dK and
// dV are stored.

// The counter is word 2 of Params.NFFlag's slot, which the preprocess
// zeroes. The producer's first lane takes each next tile from it, once the
// compute threads released the last tile's K and V, and hands its number
// to the compute warpgroups through the shared word sched, written before
// the tile's K and V are asked for and read once they landed; the number
// ntiles ends both loops (the producer then arrives on kvbar with no
// bytes).

// PersistentOK reports whether v's dK/dV kernel can run persistent: the
// key-rows step (so warp-specialized, padded head dims up to 128) with
// 16-byte loads (no staged rows, whose gradients would go out through the
// tiles the producer fills), no bias, rows not read in place, a
// fixed-length batch and not the 80-query step (which leaves no registers
// for the tile loop's).
func PersistentOK(v BwdVariant) bool {
	return v.KeyRows && KeyRowsOK(v) && v.Vector && !v.Staged && !v.Flat && !v.Biased() && v.DBiasPath == DBiasScratch && !v.Varlen && v.QueryStep != 80
}

// firstStep returns the number of a tile's first step in the dK/dV
// kernel's step counter: 0, or gs in a persistent kernel.
func (g *bwdGen) firstStep() string {
	if g.v.Persistent {
		return "gs"
	}
	return "0"
}

// persistentTiles writes the persistent dK/dV kernel's tile count, its K
// and V barriers' addresses and the shared word of the tile's number,
// before the producer's branch.
func (g *bwdGen) persistentTiles(b *strings.Builder, l bwdSmemLayout) {
	fmt.Fprintf(b, `  // persistent: the launch's tiles (nkb key blocks of each batch element and key head), taken from the
  // counter p.nf_flag[2] in the grid's order, each number handed over in sched; K and V of the CTA's
  // tile kt landed (kvbar, phase kt mod 2) and released by every compute thread (kvempty)
  const int nkb = (p.M + BN - 1) / BN, ntiles = nkb * p.B * p.Hkv;
  const u32 kvbar = s0 + %d, kvempty = kvbar + 8;
  volatile int* sched = reinterpret_cast<volatile int*>(smem + %d);  // the number of the CTA's tile kt
`, l.off["kvbar"], l.off["kvbar"]+16)
}

// persistentCoords writes a persistent tile's batch element b, key head
// kvh and first key j0 from its number tile: the grid's order (key blocks
// fastest, then the batch, then the key heads), or under LightTail
// tile_order's.
func (g *bwdGen) persistentCoords(b *strings.Builder) {
	if !g.v.LightTail {
		b.WriteString("  const int b = (tile / nkb) % p.B, kvh = tile / nkb / p.B, j0 = (tile % nkb) * BN;\n")
		return
	}
	b.WriteString(`  int pair_, blk_;
  tile_order(tile, nkb, p.B * p.Hkv, pair_, blk_);  // the first key blocks see the most queries
  const int b = pair_ % p.B, kvh = pair_ / p.B, j0 = blk_ * BN;
`)
}

// persistentTileLoop returns the opening of a persistent loop over the
// CTA's tiles, indented by indent: head (the statements that set tile and
// leave the loop at ntiles), then the tile's coordinates and query range.
func (g *bwdGen) persistentTileLoop(indent, head string) string {
	var t strings.Builder
	g.persistentCoords(&t)
	g.dkdvRange(&t, "") // (PersistentOK: fixed length, every tile's keys start before M)
	return indentLines("int gs = 0, kt = 0;  // steps of this CTA's earlier tiles, and their number\nfor (;; ++kt) {\n"+head, indent) +
		indentLines(t.String(), indent)
}

// persistentProducer wraps the producer warp's loop over a tile's steps
// (steps, indented for the kernel without tiles) in its loop over the
// CTA's tiles, each tile's K and V loads ahead of its steps.
func (g *bwdGen) persistentProducer(steps string) string {
	v := g.v
	box := v.bwdHopperDQTile().BlockN
	// lane 0 takes the next tile once the compute threads are done with the last one's K and V (and
	// have read its number), hands it over, and asks for its K and V below
	return g.persistentTileLoop("      ", `  int tile = 0;
  if (lane == 0) {
    if (kt > 0) mbar_wait(kvempty, (kt - 1) & 1);  // the last tile's K, V and number released
    tile = (int)atomicAdd(reinterpret_cast<unsigned*>(p.nf_flag) + 2, 1u);  // the next place in the order
    *sched = tile;
    if (tile >= ntiles) mbar_arrive(kvbar);  // none left: the compute warpgroups leave too
  }
  tile = __shfl_sync(0xffffffffu, tile, 0);
  if (tile >= ntiles) break;
`) + g.persistentKVLoads(box) + indentLines(steps, "  ") + "        gs += iters;\n      }\n"
}

// persistentKVLoads returns the producer's first lane's K and V loads of
// its tile kt (box: the rows of the dQ kernel's maps' boxes), once every
// compute thread is done with the last tile's (waited for above).
func (g *bwdGen) persistentKVLoads(box int) string {
	v := g.v
	return fmt.Sprintf(`        if (lane == 0) {  // tile kt's K and V
          constexpr int KA = %[1]d, VA = %[2]d, KV_BOX = %[3]d;  // their 64-column atoms; rows a box (the dQ kernel's maps)
          mbar_expect_tx(kvbar, (KA + VA) * BN * 128);
#pragma unroll
          for (int r = 0; r < BN; r += KV_BOX) {
#pragma unroll
            for (int a = 0; a < KA; ++a) tma_load_4d(sK + (a * BN + r) * 128, &tp.c, kvbar, a * 64, %[4]s);
#pragma unroll
            for (int a = 0; a < VA; ++a) tma_load_4d(sV + (a * BN + r) * 128, &tp.d, kvbar, a * 64, %[5]s);
          }
        }
`, swizzleAtoms(v.DKPad()), swizzleAtoms(v.DVPad()), box, g.tmaAt("j0 + r", "kr0", "kvh", "DK"), g.tmaAt("j0 + r", "kr0", "kvh", "DV"))
}

// persistentComputeOpen writes the opening of the compute warpgroups'
// loop over the CTA's tiles.
func (g *bwdGen) persistentComputeOpen(b *strings.Builder) {
	b.WriteString(g.persistentTileLoop("  ", `  mbar_wait(kvbar, kt & 1);  // the tile's number, and its K and V unless it is ntiles
  const int tile = *sched;
  if (tile >= ntiles) break;
`))
}

// persistentTileEnd writes the end of a persistent tile's steps: its K and
// V and its last stage released, the step counter moved on.
func (g *bwdGen) persistentTileEnd(b *strings.Builder) {
	if !g.v.Persistent {
		return
	}
	b.WriteString(`  mbar_arrive(kvempty);  // the tile's products are complete: this thread is done with its K and V
  if (iters > 0) mbar_arrive(empty + 8 * ((gs + iters - 1) & 1));  // and with its last stage
  gs += iters;
`)
}
