package kernels

import (
	"fmt"
	"strings"
)

// The CTA order under BwdVariant.LightTail and Variant.LightTail.
//
// A dK/dV launch's grid is (key blocks, batch, key heads), a dQ launch's
// (query blocks, batch, heads) and a forward launch's (query blocks,
// heads, batch); the GPU starts CTAs in that order, x fastest, as SMs free
// up. Under a causal mask the blocks of one (batch, head) pair weigh
// unequally — a dK/dV block sees the queries from its keys on, a dQ or
// forward block the keys up to its queries — and the blocks of a pair
// running together share that pair's tiles in L2. Taking the pairs one
// after another, heaviest block first, keeps that sharing, but ends the
// launch on the last pairs' heaviest blocks, started when the other SMs
// are about to run dry. cta_order keeps that order except for the last
// pairs, about three waves of CTAs, whose blocks it takes block by block
// across them: the launch then ends on its lightest blocks. A greedy model
// of the dispatch (every block's steps equal, a few more a block for its
// prologue and epilogue, 132 SMs) puts the tail of a causal dK/dV launch at
// 5–7 % of its time from 1024 to 8192 keys over 32–256 pairs, more over
// fewer (16 pairs of 4096: 26 %; 24 of 4608: 15 %), and at 1–3 % in this
// order; a causal forward of 32 pairs of 8192 at 5.4 % and 0.7 %.

// smCountPrimitive reads the SM count the tail section is sized by.
const smCountPrimitive = `// sm_count: the SMs of the device (%nsmid, at least their number), which size cta_order's tail.
DEV int sm_count() { u32 r; asm volatile("mov.u32 %0, %%nsmid;" : "=r"(r)); return (int)r; }
`

// ctaOrderFunc is the device functions tile_order and cta_order.
const ctaOrderFunc = `// tile_order: the (batch, head) pair and block of place l in a launch's order of work over npair
// pairs of nblk blocks. The pairs go one after another, each pair's blocks in block order (heaviest
// first, as the kernel reads it), except the last tail pairs — about three waves of CTAs — whose
// blocks go block by block across them, so that the launch ends on its lightest blocks
// (kernels/cta_order.go).
DEV void tile_order(int l, int nblk, int npair, int& pair, int& blk) {
  const int tail = min(npair, (3 * sm_count() + nblk - 1) / nblk);  // pairs in the tail section
  const int head = (npair - tail) * nblk;                           // places before it
  if (l < head) {
    pair = l / nblk;
    blk = l - pair * nblk;
  } else {
    const int t = l - head;
    blk = t / tail;
    pair = npair - tail + (t - blk * tail);
  }
}
// cta_order: this CTA's (batch, head) pair (y + gridDim.y * z) and block: the tile_order of its place
// in the dispatch, x fastest.
DEV void cta_order(int& pair, int& blk) {
  tile_order(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), gridDim.x, gridDim.y * gridDim.z, pair, blk);
}
`

// ctaCoords writes a kernel's batch element b, head (head: kvh for the
// dK/dV kernel, h for the dQ kernel) and first row (first = its block ·
// tile): from the grid, or under LightTail from cta_order, the blocks
// reversed where the last weigh the most (heaviest: the comment that says
// which).
func (g *bwdGen) ctaCoords(b *strings.Builder, head, first, tile string, reversed bool, heaviest string) {
	if !g.v.LightTail {
		fmt.Fprintf(b, "  const int b = blockIdx.y, %s = blockIdx.z, %s = blockIdx.x * %s;\n", head, first, tile)
		return
	}
	blk := "blk_"
	if reversed {
		blk = "(gridDim.x - 1 - blk_)"
	}
	b.WriteString(ctaOrderCall("  ", heaviest))
	fmt.Fprintf(b, "  const int b = pair_ %% gridDim.y, %s = pair_ / gridDim.y, %s = %s * %s;\n", head, first, blk, tile)
}

// ctaOrderCall returns the declaration of pair_ and blk_ and the call of
// cta_order that sets them, indent before each line and comment (if any)
// after the call.
func ctaOrderCall(indent, comment string) string {
	s := indent + "int pair_, blk_;\n" + indent + "cta_order(pair_, blk_);"
	if comment != "" {
		s += "  // " + comment
	}
	return s + "\n"
}

// dkdvCoords writes the dK/dV kernel's b, kvh and first key j0 (ctaCoords).
func (g *bwdGen) dkdvCoords(b *strings.Builder) {
	g.ctaCoords(b, "kvh", "j0", "BN", false, "the first key blocks see the most queries")
}

// dqCoords writes the dQ kernel's b, h and first query i0 (ctaCoords).
func (g *bwdGen) dqCoords(b *strings.Builder) {
	g.ctaCoords(b, "h", "i0", "BM", true, "the last query blocks see the most keys")
}
