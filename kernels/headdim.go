package kernels

import "github.com/flashattn/flashattn/attn"

// Every rule that rounds a head dim, in one place: the padding of the
// matrix products (forward, backward, Hopper), the capacity classes of the
// generated modules, the rows of staging copies, tensor-map boxes and the
// atomic dQ accumulator, and the room Flat variants need. The reasons
// behind each rule are measured; docs/kernels/ (forward.md, backward.md, odd-dims.md) holds
// the measurements.

func roundUp(x, m int) int { return (x + m - 1) / m * m }

// padMMA returns head dim d padded to the 16-element k-step of the matrix
// instructions (mma.sync and wgmma): the forward's DK, the Hopper
// backward's DK and DV.
func padMMA(d int) int { return roundUp(d, 16) }

// fwdPadDV returns the forward's padded DV for warpsN warps (warpgroups)
// splitting the value columns: a multiple of 16 per warp column.
func fwdPadDV(d, warpsN int) int { return roundUp(d, 16*warpsN) }

// fwdHopperSplitDV returns the Hopper forward's padded DV when two
// warpgroups split the value columns (WarpsN = 2): a whole number of
// 64-column swizzle atoms each, so a multiple of 128.
func fwdHopperSplitDV(d int) int { return roundUp(d, 128) }

// hopperTileDim returns the head dim that selects a Hopper forward tile
// (HopperTable): the larger of the padded DK and DV.
func hopperTileDim(dk, dv int) int { return max(padMMA(dk), padMMA(dv)) }

// swizzleAtoms returns the 64-column atoms of the 128-byte swizzle that a
// tile row of padded width dp spans.
func swizzleAtoms(dp int) int { return (dp + 63) / 64 }

// bwdPadDim returns the mma.sync backward's padded head dim: the
// 16-element granule of the matrix instructions up to 64, a multiple of 32
// above, so that eight warps can split the wider products evenly.
func bwdPadDim(d int) int {
	if d <= 64 {
		return roundUp(d, 16)
	}
	return roundUp(d, 32)
}

// CapacityDim returns the head-dim capacity of the forward module that
// serves head dim d (Variant.DK and DV): d rounded up to 16, so that one
// module serves every head dim of its 16-column class.
func CapacityDim(d int) int { return padMMA(d) }

// TMACols returns the columns of a tensor map over rows of head dim d of a
// 16-bit tensor: d rounded up to 8 elements, the 16 bytes the accelerator
// moves at least.
func TMACols(d int) int { return roundUp(d, 8) }

// StagedRowBytes is the granule of a staging copy's row, forward and
// backward: one 32-byte L2 sector, so that every row starts on a sector
// (rows of a multiple of 16 bytes only would start mid-sector every other
// row, and the kernel reading them would move a sector more per such row).
const StagedRowBytes = 32

// StagedDim returns the row length in elements of a staging copy of a
// 16-bit tensor with head dim d: d rounded up to StagedRowBytes.
func StagedDim(d int) int { return roundUp(d, StagedRowBytes/2) }

// BwdStagedDim returns the row length in elements of a staging buffer for
// head dim d in dtype dt: d rounded up to StagedRowBytes.
func BwdStagedDim(dt attn.DType, d int) int { return roundUp(d, StagedRowBytes/dt.Size()) }

// BwdNeedsStaging reports whether head dims dk, dv in dtype dt are not
// multiples of 16 bytes, so that rows cannot move in 16-byte copies
// without the staging copy of a Staged variant.
func BwdNeedsStaging(dt attn.DType, dk, dv int) bool {
	g := 16 / dt.Size()
	return dk%g != 0 || dv%g != 0
}

// BwdDQAccDim returns the row length in floats of the atomic dQ
// accumulator for head dim dk: past 32, dk rounded up to a multiple of 32,
// so that every row starts on a 128-byte line; up to 32, 16 or 32, so that
// no row straddles two lines (and every even column starts an 8-byte
// aligned pair for the vector atomic adds). Rows that straddle lines make
// the atomic adds of a row touch three lines, not two (docs/kernels/backward.md).
//
// A row is never shorter than FlatWidth(dk): a Flat variant's dK/dV
// kernel adds dQ at K's shifted columns, up to flat_shift + dk, which
// reaches the 16-padded width (DK = 8: head 1 shifted by 8 adds columns
// 8..15; rows of 8 floats put them into the next row's head 0).
func BwdDQAccDim(dk int) int {
	if dk > 16 {
		return roundUp(dk, 32)
	}
	return 16
}

// FlatWidth returns the padded width a Flat variant's tile gives head dim
// d: d rounded up to 16 columns. A head whose shift s leaves s + d within it
// is read in place.
func FlatWidth(d int) int { return padMMA(d) }

// FlatFits reports whether head dims dk and dv leave the room a Flat
// variant needs past them in their 16-padded widths (seven columns: the
// largest shift).
func FlatFits(dk, dv int) bool {
	return FlatWidth(dk)-dk >= 7 && FlatWidth(dv)-dv >= 7
}
