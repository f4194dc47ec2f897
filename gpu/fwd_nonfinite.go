package gpu

import (
	"fmt"
	"sync"

	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// The forward's non-finite flags. Every forward launch is followed by the
// fix-up kernel (kernels.NonFiniteKernel), which reads a flag that the main
// kernel raises when a CTA stored a NaN or an infinity in O, and whose last
// block clears it. The forward has no workspace of its own, so the flags
// live in a small device arena of the backend: one slot per stream the
// backend has seen, four 32-bit words: the flag and the fix-up's done
// counter, then the tile counter of a dynamically scheduled persistent
// forward and its count of CTAs done (kernels.Variant.Persistent; its last
// CTA clears both).
// Calls on one stream run in order, so a slot the last fix-up cleared is
// ready for the next call; a CUDA graph captured on a stream keeps that
// stream's slot address, and its replays clear the slot the same way.

// nfSlotBytes is the size of one stream's slot.
const nfSlotBytes = 16

// nfChunkSlots is the number of slots each chunk of the arena holds.
const nfChunkSlots = 512

// nfArena hands out the streams' slots. The chunks are never freed or
// moved while the backend lives (captured graphs hold their addresses).
type nfArena struct {
	mu     sync.Mutex
	chunks []*cuda.Buffer
	slots  map[uintptr]uint64 // stream handle (0: the legacy default stream) -> slot address, handed out in order
}

// grow adds a zeroed chunk of nfChunkSlots slots. It allocates and clears
// device memory synchronously, so it fails during a stream capture.
func (a *nfArena) grow(dev *cuda.Device) error {
	buf, err := dev.Alloc(nfChunkSlots * nfSlotBytes)
	if err != nil {
		return err
	}
	if err := dev.Memset32(buf, 0); err != nil {
		buf.Free()
		return err
	}
	a.chunks = append(a.chunks, buf)
	return nil
}

// init allocates the first chunk (outside any capture: at New).
func (a *nfArena) init(dev *cuda.Device) error {
	a.slots = map[uintptr]uint64{}
	return a.grow(dev)
}

// free releases the arena's chunks (Backend.Close).
func (a *nfArena) free() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, c := range a.chunks {
		c.Free()
	}
	a.chunks, a.slots = nil, map[uintptr]uint64{}
}

// slot returns the device address of stream s's slot (nil: the legacy
// default stream), taking a fresh one on the first call on s. When every
// slot is taken it grows the arena; where it cannot (during a stream
// capture, or out of memory) it fails rather than share a slot between
// streams, whose calls could then run at the same time.
func (a *nfArena) slot(dev *cuda.Device, s *cuda.Stream) (uint64, error) {
	var h uintptr
	if s != nil {
		h = s.Handle()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if p, ok := a.slots[h]; ok {
		return p, nil
	}
	n := len(a.slots) // the next slot's index
	if n/nfChunkSlots >= len(a.chunks) {
		if err := a.grow(dev); err != nil {
			return 0, fmt.Errorf("gpu: forward: a non-finite flag for stream %#x (%d streams have one; the flags grow outside stream capture only): %w",
				h, len(a.slots), err)
		}
	}
	p := a.chunks[n/nfChunkSlots].Ptr() + uint64(n%nfChunkSlots*nfSlotBytes)
	a.slots[h] = p
	return p, nil
}

// launchNonFinite enqueues the forward's fix-up kernel after the main
// kernel of pl (argument args, already holding the flag's slot) on s.
func (b *Backend) launchNonFinite(kn *module, pl *fwdPlan, s *cuda.Stream, args []byte) error {
	g := [3]uint32{kernels.NonFiniteBlocks(pl.grid, b.dev.SMCount()), 1, 1}
	if err := b.dev.Launch(kn.function(kernels.NonFiniteKernel), g, [3]uint32{uint32(pl.v.Threads()), 1, 1}, 0, s, args); err != nil {
		return fmt.Errorf("gpu: launch %s %s: %w", pl.v.Name(), kernels.NonFiniteKernel, err)
	}
	return nil
}
