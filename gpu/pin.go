package gpu

import (
	"errors"
	"fmt"
	"slices"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// HostPin is host memory that a backend keeps page-locked for its
// host-tensor calls (Backend.Pin) until Unpin.
type HostPin struct {
	b    *Backend
	regs []*cuda.HostRegistration
	// storage keeps the pinned tensors' storage reachable while pinned
	storage [][]byte
}

// Pin page-locks the storage of host tensors ts for b's host-tensor calls
// (Forward, Backward and their Into forms) until Unpin: a copy whose host
// memory lies in a pin goes over the link in place, with neither the
// pinned staging nor a lock of the call's own. A training loop pins, once,
// the tensors it refills every step (q, k, v, dO, and the outputs it
// passes to the Into forms); a tensor not pinned is staged as before.
//
// The whole storage of each tensor is locked (its F32 or Bits slice),
// whole pages of it; tensors may share storage or pages with each other
// and with the backend's other pins. Pages another registration holds
// (the caller's own through cuda.Device.RegisterHost, another backend's
// pin) cannot be locked twice: Pin then unlocks what it locked and returns
// the driver's error. The pin keeps the storage reachable until Unpin;
// pinned memory is not available to the rest of the system, so pin what a
// step reuses, not everything.
func (b *Backend) Pin(ts ...attn.Tensor) (*HostPin, error) {
	b.hostMu.Lock()
	defer b.hostMu.Unlock()
	p := &HostPin{b: b}
	b.copier.pins = append(b.copier.pins, p)
	for i, t := range ts {
		st := tensorStorage(t)
		if len(st) == 0 {
			continue
		}
		regs, err := lockUncovered(b.dev, st, b.copier.pinRanges())
		p.regs = append(p.regs, regs...)
		if err != nil {
			uerr := p.unpinLocked()
			return nil, fmt.Errorf("gpu: pin tensor %d of %d (%d bytes): %w", i, len(ts), len(st), errors.Join(err, uerr))
		}
		p.storage = append(p.storage, st)
	}
	return p, nil
}

// Unpin unlocks the pin's memory; the backend's calls stage copies of it
// again. Unpin waits for a host-tensor call of the backend that is
// running. Unpinning twice, or after the backend's Close (which unpins
// what is still pinned), returns nil.
func (p *HostPin) Unpin() error {
	if p == nil || p.b == nil {
		return nil
	}
	p.b.hostMu.Lock()
	defer p.b.hostMu.Unlock()
	return p.unpinLocked()
}

// unpinLocked unregisters the pin's registrations and drops the pin from
// the backend's pins. The caller holds hostMu.
func (p *HostPin) unpinLocked() error {
	p.b.copier.pins = slices.DeleteFunc(p.b.copier.pins, func(x *HostPin) bool { return x == p })
	err := unregisterEach(p.regs)
	p.regs, p.storage = nil, nil
	if err != nil {
		return fmt.Errorf("gpu: unpin: %w", err)
	}
	return nil
}

// tensorStorage returns the bytes of t's whole storage (nil if it has
// none).
func tensorStorage(t attn.Tensor) []byte {
	if t.DType == attn.Float32 {
		return cuda.AsBytes(t.F32)
	}
	return cuda.AsBytes(t.Bits)
}
