package gpu

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/flashattn/flashattn/cuda"
)

// stagingChunk is the size of each pinned staging slot: large enough that
// the per-copy overhead is small next to the transfer, small enough that the
// first slot's DMA starts soon.
const stagingChunk = 16 << 20

// hostCopier moves bytes between Go memory and device buffers through two
// pinned staging slots that it keeps between calls: while the DMA engine
// copies one slot, the host fills (or drains) the other, with several
// goroutines when there is much to copy. Pageable Go memory would instead
// make the driver stage every copy through its own small pinned buffers,
// one at a time.
type hostCopier struct {
	dev   *cuda.Device
	slots [2]*cuda.HostBuffer
	done  [2]*cuda.Event // recorded after the last copy that used each slot
	busy  [2]bool        // done[i] has been recorded and not yet waited for
	next  int            // the slot the next chunk uses
	// direct asks the copies of the current call (Backend.HostRegister) to
	// register the Go memory they read or write (page-locked by
	// cuda.Device.RegisterHost) and DMA it in place, a chunk at a time,
	// instead of staging it through the slots; a chunk whose pages another
	// registration holds goes through the slots. The inputs are
	// unregistered while the kernels run (markInputs, releaseInputs), the
	// outputs at the call's end (unregisterAll).
	direct bool
	// refused is set once the driver answered that it does not page-lock
	// host memory here (not permitted, not supported): every copy then
	// stages (directFor).
	refused bool
	// chunk is the size of a direct copy's parts (0: stagingChunk)
	chunk int
	// registered are the registrations the current call made;
	// unregisterAll releases them once the stream is done with them.
	registered []*cuda.HostRegistration
	// inputsDone is recorded after the inputs' copies (markInputs), so that
	// releaseInputs can unregister them while the kernels run; inputsMarked
	// says it was recorded in this call.
	inputsDone   *cuda.Event
	inputsMarked bool
	// pins are the backend's live pins (Backend.Pin): a copy whose host
	// bytes all lie in their registrations goes over the link in place,
	// with neither the slots nor a registration of the call's own.
	pins []*HostPin
}

// pinRanges returns the address ranges ([start, end) each, not
// overlapping) of the pins' registrations.
func (c *hostCopier) pinRanges() [][2]uintptr {
	var out [][2]uintptr
	for _, p := range c.pins {
		out = append(out, registrationRanges(p.regs)...)
	}
	return out
}

// registrationRanges returns the address ranges ([start, end) each) of
// registrations regs.
func registrationRanges(regs []*cuda.HostRegistration) [][2]uintptr {
	out := make([][2]uintptr, len(regs))
	for i, r := range regs {
		a, n := r.Range()
		out[i] = [2]uintptr{a, a + uintptr(n)}
	}
	return out
}

// ready allocates the slots and events on first use.
func (c *hostCopier) ready() error {
	if c.slots[1] != nil {
		return nil
	}
	for i := range c.slots {
		h, err := c.dev.AllocHost(stagingChunk)
		if err != nil {
			return fmt.Errorf("gpu: pinned staging: %w", err)
		}
		e, err := c.dev.NewEvent()
		if err != nil {
			h.Free()
			return fmt.Errorf("gpu: pinned staging: %w", err)
		}
		c.slots[i], c.done[i] = h, e
	}
	return nil
}

// close frees the slots and events.
func (c *hostCopier) close() {
	for i := range c.slots {
		if c.slots[i] != nil {
			_ = c.slots[i].Free()
			_ = c.done[i].Close()
		}
		c.slots[i], c.done[i], c.busy[i] = nil, nil, false
	}
	if c.inputsDone != nil {
		_ = c.inputsDone.Close()
		c.inputsDone, c.inputsMarked = nil, false
	}
}

// claim waits until slot i is free for the host to write or read.
func (c *hostCopier) claim(i int) error {
	if !c.busy[i] {
		return nil
	}
	c.busy[i] = false
	if err := c.done[i].Synchronize(); err != nil {
		return fmt.Errorf("gpu: host copy: %w", err)
	}
	return nil
}

// mark records that the work just enqueued on s uses slot i.
func (c *hostCopier) mark(i int, s *cuda.Stream) error {
	if err := c.done[i].Record(s); err != nil {
		return fmt.Errorf("gpu: host copy: %w", err)
	}
	c.busy[i] = true
	return nil
}

// toDevice enqueues the copy of src to dst at byte offset off on s. Staged,
// it returns once src has been read (into the slots); direct, once the DMA
// of every chunk is enqueued: src must then stay unchanged until the
// stream has run it (the host path's calls wait for their stream before
// they return). The DMA of the last chunks may still run, ordered on s
// before later work. rec (nil: untraced) records the phases.
func (c *hostCopier) toDevice(s *cuda.Stream, dst *cuda.Buffer, off int64, src []byte, rec *callRecorder) error {
	if pieces, ok := c.pinnedPieces(src); ok {
		return dmaPieces(s, src, off, StreamToDevice, rec, pieces,
			func(part []byte, o int64) error { return c.dev.CopyToDeviceAsync(dst, o, part, s) })
	}
	if !c.directFor(src) {
		return c.toDeviceStaged(s, dst, off, src, rec)
	}
	return c.directParts(s, src, off, StreamToDevice, rec,
		func(part []byte, o int64) error { return c.toDeviceStaged(s, dst, o, part, rec) },
		func(part []byte, o int64) error { return c.dev.CopyToDeviceAsync(dst, o, part, s) })
}

// directFor reports whether the copy of host bytes b goes direct (as the
// call asked, the driver registers memory here, and b is large enough).
func (c *hostCopier) directFor(b []byte) bool {
	return c.direct && !c.refused && len(b) >= directMin
}

// directParts copies host bytes b, at byte offset off of the device side,
// a page-aligned part at a time: each part registered and copied in place
// by dma (its DMA traced as phase), or through the slots by staged where
// its pages cannot be registered.
func (c *hostCopier) directParts(s *cuda.Stream, b []byte, off int64, phase StreamPhase, rec *callRecorder, staged, dma func(part []byte, off int64) error) error {
	for _, ch := range pageChunks(b, c.chunkBytes()) {
		part, o := b[ch[0]:ch[1]], off+int64(ch[0])
		pieces, ok := c.register(part, rec)
		if !ok {
			if err := staged(part, o); err != nil {
				return err
			}
			continue
		}
		if err := dmaPieces(s, part, o, phase, rec, pieces, dma); err != nil {
			return err
		}
	}
	return nil
}

// dmaPieces copies host bytes b, registered memory, at byte offset off of
// the device side by dma, one DMA per piece ([start, end) offsets of b,
// each inside one registration: the driver refuses a copy whose range runs
// from one registration into the next), traced as phase.
func dmaPieces(s *cuda.Stream, b []byte, off int64, phase StreamPhase, rec *callRecorder, pieces [][2]int, dma func(part []byte, off int64) error) error {
	m := rec.begin(s)
	for _, pc := range pieces {
		if err := dma(b[pc[0]:pc[1]], off+int64(pc[0])); err != nil {
			return fmt.Errorf("gpu: host copy: %w", err)
		}
	}
	rec.end(s, phase, m, int64(len(b)))
	rec.lap(HostEnqueue)
	return nil
}

// pinnedPieces reports whether every byte of b lies in the backend's pins,
// and if so b's pieces, one per registration it spans (dmaPieces).
func (c *hostCopier) pinnedPieces(b []byte) ([][2]int, bool) {
	return pinnedPieces(b, c.pinRanges())
}

// pinnedPieces reports whether every byte of b lies in the ranges pinned
// ([start, end) each, not overlapping), and if so b's pieces, one per range
// it spans.
func pinnedPieces(b []byte, pinned [][2]uintptr) ([][2]int, bool) {
	if len(b) == 0 || len(pinned) == 0 {
		return nil, false
	}
	base := uintptr(unsafe.Pointer(&b[0]))
	if len(uncoveredPages(base, base+uintptr(len(b)), pinned)) > 0 {
		return nil, false
	}
	return registrationPieces(base, len(b), pinned), true
}

// chunkBytes returns the size of a direct copy's parts.
func (c *hostCopier) chunkBytes() int {
	if c.chunk > 0 {
		return c.chunk
	}
	return stagingChunk
}

// directMin is the size below which a direct copier still stages: locking
// a page costs a system call and a driver mapping, more than copying a few
// pages through a slot.
const directMin = 256 << 10

// toDeviceStaged is toDevice through the pinned slots.
func (c *hostCopier) toDeviceStaged(s *cuda.Stream, dst *cuda.Buffer, off int64, src []byte, rec *callRecorder) error {
	if len(src) == 0 {
		return nil
	}
	if err := c.ready(); err != nil {
		return err
	}
	rec.lap(HostAlloc)
	for pos := 0; pos < len(src); {
		i := c.next
		c.next ^= 1
		if err := c.claim(i); err != nil {
			return err
		}
		rec.lap(HostWait)
		n := min(stagingChunk, len(src)-pos)
		slot := c.slots[i].Bytes()[:n]
		parallelCopy(slot, src[pos:pos+n])
		rec.lap(HostToPinned)
		m := rec.begin(s)
		if err := c.dev.CopyToDeviceAsync(dst, off+int64(pos), slot, s); err != nil {
			return fmt.Errorf("gpu: host copy: %w", err)
		}
		rec.end(s, StreamToDevice, m, int64(n))
		rec.staged(int64(n))
		if err := c.mark(i, s); err != nil {
			return err
		}
		rec.lap(HostEnqueue)
		pos += n
	}
	return nil
}

// fromDevice copies len(dst) bytes of src at byte offset off into dst after
// the work enqueued on s so far, and returns when dst holds them. Staged,
// the DMA of chunk i+1 runs while the host drains chunk i; direct, the
// host page-locks chunk i+1 while the DMA writes chunk i in place. rec
// (nil: untraced) records the phases.
func (c *hostCopier) fromDevice(s *cuda.Stream, dst []byte, src *cuda.Buffer, off int64, rec *callRecorder) error {
	dma := func(part []byte, o int64) error { return c.dev.CopyFromDeviceAsync(part, src, o, s) }
	var err error
	if pieces, ok := c.pinnedPieces(dst); ok {
		err = dmaPieces(s, dst, off, StreamFromDevice, rec, pieces, dma)
	} else if !c.directFor(dst) {
		return c.fromDeviceStaged(s, dst, src, off, rec)
	} else {
		err = c.directParts(s, dst, off, StreamFromDevice, rec,
			func(part []byte, o int64) error { return c.fromDeviceStaged(s, part, src, o, rec) }, dma)
	}
	if err != nil {
		return err
	}
	if err := s.Synchronize(); err != nil {
		return fmt.Errorf("gpu: host copy: %w", err)
	}
	rec.lap(HostWait)
	return nil
}

// fromDeviceStaged is fromDevice through the pinned slots.
func (c *hostCopier) fromDeviceStaged(s *cuda.Stream, dst []byte, src *cuda.Buffer, off int64, rec *callRecorder) error {
	if len(dst) == 0 {
		return nil
	}
	if err := c.ready(); err != nil {
		return err
	}
	rec.lap(HostAlloc)
	chunks := (len(dst) + stagingChunk - 1) / stagingChunk
	enqueue := func(k int) error {
		i := k % 2
		// (stream order puts this DMA after any earlier one that read the slot)
		lo := k * stagingChunk
		n := min(stagingChunk, len(dst)-lo)
		m := rec.begin(s)
		if err := c.dev.CopyFromDeviceAsync(c.slots[i].Bytes()[:n], src, off+int64(lo), s); err != nil {
			return fmt.Errorf("gpu: host copy: %w", err)
		}
		rec.end(s, StreamFromDevice, m, int64(n))
		rec.staged(int64(n))
		err := c.mark(i, s)
		rec.lap(HostEnqueue)
		return err
	}
	for k := 0; k < min(2, chunks); k++ {
		if err := enqueue(k); err != nil {
			return err
		}
	}
	for k := 0; k < chunks; k++ {
		i := k % 2
		if err := c.claim(i); err != nil {
			return err
		}
		rec.lap(HostWait)
		lo := k * stagingChunk
		n := min(stagingChunk, len(dst)-lo)
		parallelCopy(dst[lo:lo+n], c.slots[i].Bytes()[:n])
		rec.lap(PinnedToHost)
		if k+2 < chunks {
			if err := enqueue(k + 2); err != nil {
				return err
			}
		}
	}
	c.next = 0
	return nil
}

// pageChunks splits b into consecutive parts of about chunk bytes that end
// on host page boundaries (the last at b's end), as [start, end) offsets,
// so that page-locking one part locks no page of the next.
func pageChunks(b []byte, chunk int) [][2]int {
	if len(b) == 0 {
		return nil
	}
	base := uintptr(unsafe.Pointer(&b[0]))
	var out [][2]int
	for lo := 0; lo < len(b); {
		end := (base + uintptr(lo+chunk) + cuda.HostPageSize - 1) &^ (cuda.HostPageSize - 1)
		hi := min(len(b), int(end-base))
		out = append(out, [2]int{lo, hi})
		lo = hi
	}
	return out
}

// register page-locks the pages of b that this call has not registered
// yet and reports whether all of b's pages are now registered by this
// call, so that a copy can DMA b in place, and if so b's pieces, as
// [start, end) offsets in order, that each lie within one registration.
// Pages held by a registration not this call's (the caller's own, or
// another backend's) make it report false: b then goes through the slots,
// as a registration this call does not own may end while the copy runs.
// So do pages the driver will not lock (read-only mappings, say); a
// driver that locks none turns the direct mode off.
func (c *hostCopier) register(b []byte, rec *callRecorder) (pieces [][2]int, ok bool) {
	defer rec.lap(HostRegister)
	regs, err := lockUncovered(c.dev, b, c.heldRanges())
	c.registered = append(c.registered, regs...)
	if err != nil {
		var ce *cuda.Error
		if errors.As(err, &ce) && (ce.Code == cuda.ErrorNotPermitted || ce.Code == cuda.ErrorNotSupported) {
			c.refused = true // no registration on this system: stage from now on
		}
		return nil, false // these pages (held elsewhere, read-only, not memory) go through the slots
	}
	return registrationPieces(uintptr(unsafe.Pointer(&b[0])), len(b), c.heldRanges()), true
}

// lockUncovered page-locks the pages of b (not empty) that none of the
// held ranges covers, one registration per uncovered run of pages, and
// returns the registrations it made, also those made before an error.
func lockUncovered(dev *cuda.Device, b []byte, held [][2]uintptr) ([]*cuda.HostRegistration, error) {
	var regs []*cuda.HostRegistration
	base := uintptr(unsafe.Pointer(&b[0]))
	lo, hi := cuda.HostPages(b)
	for _, piece := range uncoveredPages(lo, hi, held) {
		// the bytes of b inside the piece, whose pages are the piece's
		plo, phi := max(piece[0], base)-base, min(piece[1], base+uintptr(len(b)))-base
		r, err := dev.RegisterHost(b[plo:phi])
		if err != nil {
			return regs, err
		}
		regs = append(regs, r)
	}
	return regs, nil
}

// heldRanges returns the address ranges ([start, end) each) this call has
// registered.
func (c *hostCopier) heldRanges() [][2]uintptr { return registrationRanges(c.registered) }

// registrationPieces splits the n bytes at base into the pieces, as
// [start, end) offsets from base in order, that the held ranges cover one
// each (the ranges do not overlap and together cover the bytes).
func registrationPieces(base uintptr, n int, held [][2]uintptr) [][2]int {
	var out [][2]int
	end := base + uintptr(n)
	for _, h := range held {
		if lo, hi := max(h[0], base), min(h[1], end); lo < hi {
			out = append(out, [2]int{int(lo - base), int(hi - base)})
		}
	}
	slices.SortFunc(out, func(a, b [2]int) int { return a[0] - b[0] })
	return out
}

// uncoveredPages returns the parts of the range [lo, hi) that none of the
// ranges held ([start, end) each) covers, in order.
func uncoveredPages(lo, hi uintptr, held [][2]uintptr) [][2]uintptr {
	out := [][2]uintptr{{lo, hi}}
	for _, h := range held {
		a, b := h[0], h[1]
		var next [][2]uintptr
		for _, p := range out {
			if b <= p[0] || a >= p[1] {
				next = append(next, p)
				continue
			}
			if p[0] < a {
				next = append(next, [2]uintptr{p[0], a})
			}
			if b < p[1] {
				next = append(next, [2]uintptr{b, p[1]})
			}
		}
		out = next
	}
	return out
}

// markInputs records, when this call registered memory (its inputs, all
// uploaded by now), an event after their copies on s, for releaseInputs.
func (c *hostCopier) markInputs(s *cuda.Stream) error {
	c.inputsMarked = false
	if len(c.registered) == 0 {
		return nil
	}
	if c.inputsDone == nil {
		e, err := c.dev.NewEventNoTiming()
		if err != nil {
			return fmt.Errorf("gpu: host copy: %w", err)
		}
		c.inputsDone = e
	}
	if err := c.inputsDone.Record(s); err != nil {
		return fmt.Errorf("gpu: host copy: %w", err)
	}
	c.inputsMarked = true
	return nil
}

// releaseInputs waits for the inputs' copies (markInputs; the kernels
// enqueued after them run on) and unregisters the memory registered so
// far, the inputs', which the kernels read from device buffers: the host
// unlocks them while the kernels run instead of after the copies back.
// Outputs registered later lock their own pages again.
func (c *hostCopier) releaseInputs(rec *callRecorder) error {
	if !c.inputsMarked {
		return nil
	}
	c.inputsMarked = false
	err := c.inputsDone.Synchronize()
	rec.lap(HostWait)
	if err != nil {
		return fmt.Errorf("gpu: host copy: %w", err)
	}
	return c.unregister(rec)
}

// unregister unlocks the memory of the call's registrations, which no copy
// uses any more, and forgets them.
func (c *hostCopier) unregister(rec *callRecorder) error {
	err := unregisterEach(c.registered)
	c.registered = c.registered[:0]
	rec.lap(HostRegister)
	if err != nil {
		return fmt.Errorf("gpu: host copy: %w", err)
	}
	return nil
}

// unregisterEach unlocks every registration of regs and returns the first
// error.
func unregisterEach(regs []*cuda.HostRegistration) error {
	var err error
	for _, r := range regs {
		if uerr := r.Unregister(); uerr != nil && err == nil {
			err = uerr
		}
	}
	return err
}

// unregisterAll waits for s, the stream that copied the registered memory,
// and unregisters it (the end of every host-path call that may have
// registered some).
func (c *hostCopier) unregisterAll(s *cuda.Stream, rec *callRecorder) error {
	c.inputsMarked = false
	if len(c.registered) == 0 {
		return nil
	}
	err := s.Synchronize()
	rec.lap(HostWait)
	if err != nil {
		// the copies may still run: leave the pages locked rather than
		// unlock them under the DMA (the device's Close unlocks them)
		c.registered = nil
		return fmt.Errorf("gpu: host copy: %w", err)
	}
	return c.unregister(rec)
}

// parallelCopy copies src into dst (of equal length), split over several
// goroutines when it is large: one core copies less than a host-to-device
// link carries.
func parallelCopy(dst, src []byte) {
	const piece = 1 << 20
	copyWith(dst, src, min(runtime.GOMAXPROCS(0), 16, len(src)/piece))
}

// copyWith copies src into dst (of equal length) with the given number of
// goroutines, each taking one contiguous part.
func copyWith(dst, src []byte, workers int) {
	if workers < 2 {
		copy(dst, src)
		return
	}
	per := (len(src) + workers - 1) / workers
	var wg sync.WaitGroup
	for lo := 0; lo < len(src); lo += per {
		hi := min(lo+per, len(src))
		wg.Add(1)
		go func() {
			defer wg.Done()
			copy(dst[lo:hi], src[lo:hi])
		}()
	}
	wg.Wait()
}

// HostRates are the host's own rates on the host path's two ways of
// moving bytes, in bytes per second.
type HostRates struct {
	// ToPinned and FromPinned copy between Go memory and pinned memory as
	// the staging does (up to 16 goroutines, a slot at a time).
	ToPinned, FromPinned float64
	// Register and Unregister page-lock Go memory and unlock it again, as
	// the direct host path does (Backend.HostRegister), per byte.
	Register, Unregister float64
}

// HostRates measures the host side of the host path: copies of 128 MiB
// between Go memory and a pinned staging slot each way, and page-locking a
// 64 MiB Go buffer and unlocking it, each timed (the median of a few
// repetitions each).
// The host↔device link is LinkBandwidth's.
func (b *Backend) HostRates() (HostRates, error) {
	const goBytes, regBytes, reps = 128 << 20, 64 << 20, 3
	slot, err := b.dev.AllocHost(stagingChunk)
	if err != nil {
		return HostRates{}, fmt.Errorf("gpu: host rates: %w", err)
	}
	defer slot.Free()
	heap := make([]byte, goBytes)
	for i := 0; i < len(heap); i += 4096 {
		heap[i] = byte(i >> 12) // map every page before timing
	}
	pinned := slot.Bytes()
	// each way and step timed reps times, the median kept
	var toPinned, fromPinned, lock, unlock []float64
	for range reps {
		t0 := time.Now()
		for lo := 0; lo < len(heap); lo += len(pinned) {
			parallelCopy(pinned, heap[lo:lo+len(pinned)])
		}
		t1 := time.Now()
		for lo := 0; lo < len(heap); lo += len(pinned) {
			parallelCopy(heap[lo:lo+len(pinned)], pinned)
		}
		toPinned, fromPinned = append(toPinned, t1.Sub(t0).Seconds()), append(fromPinned, time.Since(t1).Seconds())
	}
	median := func(ts []float64) float64 {
		slices.Sort(ts)
		return ts[len(ts)/2]
	}
	r := HostRates{ToPinned: goBytes / median(toPinned), FromPinned: goBytes / median(fromPinned)}
	for range reps {
		t0 := time.Now()
		reg, err := b.dev.RegisterHost(heap[:regBytes])
		if err != nil {
			return r, fmt.Errorf("gpu: host rates: %w", err)
		}
		t1 := time.Now()
		if err := reg.Unregister(); err != nil {
			return r, fmt.Errorf("gpu: host rates: %w", err)
		}
		lock, unlock = append(lock, t1.Sub(t0).Seconds()), append(unlock, time.Since(t1).Seconds())
	}
	r.Register, r.Unregister = regBytes/median(lock), regBytes/median(unlock)
	return r, nil
}

// LinkBandwidth measures the host↔device link in bytes per second, to the
// device and from it, with CUDA events around repeated 64 MiB copies
// between pinned host memory and device memory (the host path's staging
// moves its data the same way).
func (b *Backend) LinkBandwidth() (toDevice, fromDevice float64, err error) {
	const size, reps = 64 << 20, 8
	h, err := b.dev.AllocHost(size)
	if err != nil {
		return 0, 0, fmt.Errorf("gpu: link bandwidth: %w", err)
	}
	defer h.Free()
	d, err := b.dev.Alloc(size)
	if err != nil {
		return 0, 0, fmt.Errorf("gpu: link bandwidth: %w", err)
	}
	defer d.Free()
	var ev [2]*cuda.Event
	for i := range ev {
		if ev[i], err = b.dev.NewEvent(); err != nil {
			return 0, 0, fmt.Errorf("gpu: link bandwidth: %w", err)
		}
		defer ev[i].Close()
	}
	s := b.stream
	rate := func(copy func() error) (float64, error) {
		if err := copy(); err != nil { // warm-up
			return 0, err
		}
		if err := ev[0].Record(s); err != nil {
			return 0, err
		}
		for range reps {
			if err := copy(); err != nil {
				return 0, err
			}
		}
		if err := ev[1].Record(s); err != nil {
			return 0, err
		}
		if err := ev[1].Synchronize(); err != nil {
			return 0, err
		}
		ms, err := cuda.ElapsedMs(ev[0], ev[1])
		if err != nil {
			return 0, err
		}
		return float64(size) * reps / (float64(ms) / 1e3), nil
	}
	if toDevice, err = rate(func() error { return b.dev.CopyToDeviceAsync(d, 0, h.Bytes(), s) }); err != nil {
		return 0, 0, fmt.Errorf("gpu: link bandwidth: %w", err)
	}
	if fromDevice, err = rate(func() error { return b.dev.CopyFromDeviceAsync(h.Bytes(), d, 0, s) }); err != nil {
		return 0, 0, fmt.Errorf("gpu: link bandwidth: %w", err)
	}
	return toDevice, fromDevice, nil
}
