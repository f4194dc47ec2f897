package kernels

// dropoutFuncs writes Philox4x32-10 and the keep mask's device functions
// (DropoutSource: the mapping of package philox, bit for bit); apply_dropout,
// which zeroes the dropped probabilities of a warp's S tile from the keep
// bits drop_bits draws for it: one Philox call per lane per 16 of its
// elements, the sixteen numbers of one row and 16-key block a call shared
// by the quad that holds them (see dropMaskFuncs), and apply_keep, which
// applies bits drawn before (EarlyDropout) — or, with ProducerDropout, the
// keep warps' drop_keep32 and apply_keep_words.
func (x *gen) dropoutFuncs() {
	if !x.v.Dropout {
		return
	}
	x.raw("// ---- dropout\n" + DropoutSource)
	if x.v.ProducerDropout {
		x.raw(dropKeep32Func)
		return
	}
	x.applyDropoutFunc()
	if x.v.EarlyDropout {
		x.raw(`// Zero the dropped probabilities of this warp's S tile by keep bits drawn before (drop_bits, while
// the S product ran: Variant.EarlyDropout).
DEV void apply_keep(float (&s)[MT][NT_S][4], const u32 (&keep)[MT][(NT_S + 7) / 8]) {
` + zeroDropped + `}

`)
	}
}

// applyDropoutFunc writes apply_dropout, which draws a warp's keep bits
// after the softmax and applies them.
func (x *gen) applyDropoutFunc() {
	call := dropBitsCall("keep", "MT", "NT_S", x.dropAligned(), "i0", "j0", "bh", "p")
	x.raw(`// Zero the dropped probabilities of this warp's S tile. i0: sequence position of the warp's
// first row; j0: sequence position of the warp's first key; bh = b·H + h.
DEV void apply_dropout(float (&s)[MT][NT_S][4], const Params& p, int i0, int j0, u32 bh, int lane) {
  u32 keep[MT][(NT_S + 7) / 8];  // bit 4·(nt % 8) + e keeps s[mt][nt][e]
  ` + call + `
` + zeroDropped + `}

`)
}

// zeroDropped is the loop of apply_dropout and apply_keep that zeroes the
// elements of s whose bit in keep is clear.
const zeroDropped = `#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (!((keep[mt][nt >> 3] >> (4 * (nt & 7) + e)) & 1u)) s[mt][nt][e] = 0.f;
`

// earlyDropBits writes, with EarlyDropout, the drawing of the keep bits of
// the key block whose first key is n0 (a C++ expression) into dkeep,
// before the wait for its S (indent: the block's); with ProducerDropout
// their reading from the keep stage of the block numbered seq.
func (x *gen) earlyDropBits(indent, n0, seq string) {
	if x.v.ProducerDropout {
		x.keepFromShared(indent, seq)
		return
	}
	if !x.v.EarlyDropout {
		return
	}
	call := dropBitsCall("dkeep", "MT", "NT_S", x.dropAligned(), "m0 + wrow0 + p.drop_q0", "("+n0+") + key0 + p.drop_k0", "(u32)(b * p.drop_heads + p.drop_h0 + h)", "p")
	x.raw(indent + "u32 dkeep[MT][(NT_S + 7) / 8];  // ---- dropout keep bits of the block, drawn while its S product runs\n" + indent + call + "\n")
}

// dropAligned reports whether every warp's first key in S is a multiple of
// 16 (drop_bits with A = 0): tiles start at multiples of BlockN, a
// multiple of 16, and a warp's keys at a multiple of its share, BlockN/WN
// (mma.sync kernels: a multiple of 16 by Validate; Hopper kernels with two
// warpgroups splitting the keys: BlockN/2, a multiple of 8).
func (x *gen) dropAligned() bool {
	return (x.v.BlockN/max(x.v.WarpsN, 1))%16 == 0
}
