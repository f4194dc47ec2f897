package kernels

import (
	"fmt"
	"strings"
)

// The staged bias of the key-rows backward step (BwdVariant.BiasStaged).
// The producer lane that loads each step's q and dO tiles also loads the
// step's bias tile — the BM queries × the block's BN keys, 16-bit — into
// the stage's shared buffer with the tensor memory accelerator: one box of
// [BM rows][64 keys] a key atom, in the layout of the kernel's other
// swizzled tiles (sw_off), zeros past the queries and keys (out-of-bounds
// fill), its bytes announced with the tiles' on the stage's full barrier
// (the bias's map, BwdVariant.BiasTMATensor, is the argument's third). The
// stage's empty barrier orders the compute warps' reads before its next
// load. A compute thread reads its 16 queries × 2 keys at sw_elem, the
// places where the atomic dQ's step stores the same elements of dS (no
// bank conflicts).

// bwdBiasStageOK reports whether v can stage its bias: the key-rows step
// (the only reader written for it), a 16-bit bias, fixed length, and a
// key tile of whole swizzle atoms (BN a multiple of 64).
func bwdBiasStageOK(v BwdVariant) bool {
	return v.KeyRows && (v.Bias == BiasBF16 || v.Bias == BiasF16) && !v.Varlen && v.bwdHopperTile().BlockN%64 == 0
}

// bwdBiasStageTMA returns, for a variant with a staged bias, the
// producer lane's load of step it's bias tile into stage s (indent before
// each line; hq and iq are the step's query head and first query as the
// producer names them), after the stage's tiles whose bytes it announced
// (bwdBiasStageBytes).
func (g *bwdGen) bwdBiasStageTMA(indent string) string {
	if !g.v.BiasStaged {
		return ""
	}
	return indentLines("tma_rows<BM, BN / 64>(sB + s * B_STAGE, &tp.c, bar + 8 * s, iq, "+biasMapCoords("hq", "b")+", j0);  // the step's bias tile\n", indent)
}

// bwdBiasStageBytes returns, for a variant with a staged bias, the bytes
// of its tile the stage's full barrier also expects (" + B_STAGE"), else "".
func (g *bwdGen) bwdBiasStageBytes() string {
	if !g.v.BiasStaged {
		return ""
	}
	return " + B_STAGE"
}

// bwdBiasStageDecls writes, for a variant with a staged bias, the
// addresses of the stages' tiles and the size of one (bwdBiasStageStep
// takes a step's).
func (g *bwdGen) bwdBiasStageDecls(b *strings.Builder, l bwdSmemLayout) {
	if !g.v.BiasStaged {
		return
	}
	fmt.Fprintf(b, `  const u32 sB = s0 + %[1]d;  // [2][BN/64][BM][64] 16-bit, swizzled: each stage's bias tile
  const BT* sBp = reinterpret_cast<const BT*>(smem + %[1]d);
  constexpr int B_STAGE = BM * BN * 2;  // bytes of one stage of the bias tile
`, l.off["sB"])
}

// bwdBiasStageStep writes, for a variant with a staged bias, the base of
// step it's bias tile (stage st).
func (g *bwdGen) bwdBiasStageStep(b *strings.Builder) {
	if !g.v.BiasStaged {
		return
	}
	b.WriteString("    const BT* sBst = sBp + st * (B_STAGE / 2);  // this step's bias tile (the producer's)\n")
}
