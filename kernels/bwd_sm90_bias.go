package kernels

import (
	"fmt"
	"strings"
)

// The staged bias of the key-rows backward step (BwdVariant.BiasStaged).
// The producer warp, beside each step's LSE2 and Delta, copies the step's
// bias tile — the BM queries × the block's BN keys, 16-bit — into the
// stage's shared buffer with cp.async: lane l copies the 16-byte chunks
// l + 32k, BN/8 chunks a row, in the layout of the kernel's other swizzled
// tiles (sw_off), zeros past the queries and keys. Each lane waits for its
// copies before it arrives on the stage's full barrier, so the compute
// warps find the tile complete when the phase completes (handing the
// copies to the barrier instead, cp.async.mbarrier.arrive, measured no
// faster). The stage's empty barrier orders the compute
// warps' reads before its next copies. A compute thread
// reads its 16 queries × 2 keys at sw_elem, the places where the atomic
// dQ's step stores the same elements of dS (no bank conflicts).

// bwdBiasStageOK reports whether v can stage its bias: the key-rows step
// (the only reader written for it), a 16-bit bias, fixed length, and a
// key tile of whole swizzle atoms (BN a multiple of 64).
func bwdBiasStageOK(v BwdVariant) bool {
	return v.KeyRows && (v.Bias == BiasBF16 || v.Bias == BiasF16) && !v.Varlen && v.bwdHopperTile().BlockN%64 == 0
}

// bwdBiasStageCopies returns, for a variant with a staged bias, the
// producer lanes' copies of step it's bias tile into stage s (indent before
// each line; hq and iq are the step's query head and first query as the
// producer names them); bwdBiasStageWait, the wait for them or their
// hand-over to the stage's full barrier.
func (g *bwdGen) bwdBiasStageCopies(indent string) string {
	if !g.v.BiasStaged {
		return ""
	}
	s := `// the step's bias tile [BM][BN] into stage s (zeros past the queries and keys)
for (int q = lane; q < BM * (BN / 8); q += 32) {
  const int r = q / (BN / 8), ch = q % (BN / 8), qi = iq + r, kj = j0 + 8 * ch;
  const bool ok = qi < n && kj < m;
  const BT* src = ok ? p.bias + b * p.bias_sb + hq * p.bias_sh + qi * p.bias_si + kj : p.bias;
  cp_async_sw(sB + s * B_STAGE + sw_off<BM>(r, ch), src, ok ? (u32)min(16, (m - kj) * 2) : 0u);
}
`
	return indentLines(s+"cp_async_commit();\n", indent)
}

// bwdBiasStageWait returns, for a variant with a staged bias, the producer
// lane's wait for its copies of the step's bias tile before it arrives on
// the stage's full barrier.
func (g *bwdGen) bwdBiasStageWait(indent string) string {
	if !g.v.BiasStaged {
		return ""
	}
	return indent + "cp_async_wait0();  // this lane's copies of the bias tile landed\n"
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
