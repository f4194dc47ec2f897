package gpu

import (
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/flashattn/flashattn/kernels"
)

// packEmuDriver is the emulator's driver of the pack kernel.
func packEmuDriver() string {
	var ptrs []string
	for i := 0; i < 3; i++ {
		ptrs = append(ptrs, fmt.Sprintf("t[%d].src", i), fmt.Sprintf("t[%d].dst", i), fmt.Sprintf("t[%d].lim", i))
	}
	return emuDriver("PackArgs", ptrs, []string{kernels.PackKernel})
}

// TestPackEmulated runs the forward's pack kernel on the host emulator for
// head dims of every alignment, contiguous and strided sources whose rows
// start at every even offset within a 16-byte block, and checks every
// staged element, the zero padding and the guard bands around the copy.
func TestPackEmulated(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "pack")
	src := kernels.PrimitivesBegin + "\n" + kernels.PrimitivesEnd + "\n" + kernels.PackSource
	bin := emuBinary(t, src, "pack.h", packEmuDriver())
	type layout struct {
		name            string
		offset          int // elements before element 0 in the source allocation
		rowPad, headPad int // extra elements per row and per head beyond the contiguous strides
	}
	layouts := []layout{{"contiguous", 0, 0, 0}, {"offset3", 3, 0, 0}, {"strided", 5, 3, 1}}
	for i, d := range []int{1, 2, 3, 7, 8, 9, 15, 59, 64, 111, 127, 199, 257, 509} {
		for j, l := range layouts {
			slot := (i + j) % 3 // the launch's tensor slot (q, k or v) that holds it; the other two are empty
			t.Run(fmt.Sprintf("d%d-%s-slot%d", d, l.name, slot), func(t *testing.T) {
				t.Parallel()
				packEmuCase(t, bin, slot, d, 2, 97, 3, l.offset, l.rowPad, l.headPad, 0) // 291 pairs: three blocks, the last one partial
			})
		}
	}
	// copies of only the heads a head mask selects (kernels.Variant.FlatStaged's)
	for i, d := range []int{59, 127, 62} {
		for j, l := range layouts[:2] {
			heads := 12 + 4*j
			t.Run(fmt.Sprintf("d%d-%s-heads%d-masked", d, l.name, heads), func(t *testing.T) {
				t.Parallel()
				packEmuCase(t, bin, (i+j)%3, d, 2, 37, heads, l.offset, l.rowPad, l.headPad, kernels.FlatStagedHeads(d))
			})
		}
	}
}

// packEmuCase packs a [batch, rows, heads, d] tensor whose element
// (b, r, h, e) is a distinct nonzero 16-bit pattern, in slot slot of a
// launch whose other slots are empty, and checks the copy (with a head
// mask, of only the heads it selects, back to back). The source allocation
// ends with the tensor's last element, so that a 16-byte load past it
// would read outside the arena's tensor.
func packEmuCase(t *testing.T, bin string, slot, d, batch, rows, heads, offset, rowPad, headPad int, mask uint8) {
	t.Helper()
	sh := int64(d + headPad)
	sr := sh*int64(heads) + int64(rowPad)
	sb := sr * int64(rows)
	pattern := func(b, r, h, e int) uint16 { return uint16(1 + (b*7919+r*104729+h*31+e*131)%65000) }
	n := int64(offset) + sb*int64(batch)
	host := make([]byte, 2*n)
	for i := range host {
		host[i] = 0xEE // filler between rows: must never reach the copy
	}
	for b := 0; b < batch; b++ {
		for r := 0; r < rows; r++ {
			for h := 0; h < heads; h++ {
				for e := 0; e < d; e++ {
					at := int64(offset) + int64(b)*sb + int64(r)*sr + int64(h)*sh + int64(e)
					binary.LittleEndian.PutUint16(host[2*at:], pattern(b, r, h, e))
				}
			}
		}
	}
	ar := &emuArena{}
	srcAddr := ar.put(host) + uint64(2*offset)
	ds := kernels.StagedDim(d)
	kept := []int{} // the heads the copy holds, in order
	for h := 0; h < heads; h++ {
		if mask == 0 || mask>>(h%8)&1 == 1 {
			kept = append(kept, h)
		}
	}
	if mask != 0 && len(kept) != kernels.FlatStagedCount(heads, mask) {
		t.Fatalf("%d heads kept, FlatStagedCount says %d", len(kept), kernels.FlatStagedCount(heads, mask))
	}
	dstBytes := batch * rows * len(kept) * ds * 2
	out := emuOut{shape: []int{batch, rows, len(kept), ds}, addr: ar.poisoned(dstBytes + 2*bwdGuard), n: dstBytes}
	last := int64(batch-1)*sb + int64(rows-1)*sr + int64(heads-1)*sh + int64(d-1)
	ps := make([]kernels.PackParams, 3)
	grids := make([][3]uint32, 3)
	ps[slot] = kernels.PackParams{Src: srcAddr, Dst: out.ptr(), Lim: srcAddr + 2*uint64(last+1), BatchStride: sb, RowStride: sr, HeadStride: sh,
		Rows: int32(rows), Heads: int32(heads), D: int32(d), DS: int32(ds), HeadMask: mask}
	grids[slot] = kernels.PackGrid(rows, len(kept), batch)
	g, args := kernels.PackLaunch(ps, grids)
	grid := [3]int{int(g[0]), int(g[1]), int(g[2])}
	emuExec(t, bin, kernels.PackKernel, args, ar, []emuLaunch{{kernels.PackKernel, grid, kernels.PackThreads}}, nil)
	got := ar.at(out.addr, dstBytes+2*bwdGuard)
	for i := 0; i < bwdGuard; i++ {
		if got[i] != bwdPoison || got[bwdGuard+dstBytes+i] != bwdPoison {
			t.Fatalf("guard band overwritten")
		}
	}
	got = got[bwdGuard : bwdGuard+dstBytes]
	for b := 0; b < batch; b++ {
		for r := 0; r < rows; r++ {
			for j, h := range kept {
				for e := 0; e < ds; e++ {
					want := uint16(0)
					if e < d {
						want = pattern(b, r, h, e)
					}
					at := (((b*rows+r)*len(kept)+j)*ds + e) * 2
					if g := binary.LittleEndian.Uint16(got[at:]); g != want {
						t.Fatalf("(b %d, row %d, head %d, element %d): %#04x, want %#04x", b, r, h, e, g, want)
					}
				}
			}
		}
	}
}
