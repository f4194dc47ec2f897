package gpu

import (
	"encoding/binary"
	"fmt"
	"math"
	"runtime"
	"slices"
	"sync"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// The host path: Forward, Backward and their Into forms take host tensors,
// copy them to device buffers from the backend's caching allocator through
// reused pinned staging, run the device path (ForwardDevice,
// BackwardDevice) on the backend's stream and copy the outputs back.

// Backend writes into caller-allocated host outputs.
var _ attn.IntoBackend = (*Backend)(nil)

// hostCall holds the device buffers of one host-path call; release puts
// them back in the pool once the stream has finished with them.
type hostCall struct {
	b    *Backend
	bufs []*cuda.Buffer
	// keep makes alloc take buffers from the driver, not the pool, for a
	// caller to own (Upload)
	keep bool
	// rec records the call's breakdown (nil: untraced)
	rec *callRecorder
}

// hostOutput is a host output tensor and the device tensor that receives it.
type hostOutput struct {
	host attn.Tensor
	dev  DeviceTensor
	// scatter is set when dev is h's contiguous image rather than h's own
	// layout (a host view whose elements are spread out with gaps).
	scatter bool
}

// alloc returns a pool buffer of at least bytes bytes.
func (c *hostCall) alloc(bytes int64) (*cuda.Buffer, error) {
	get := c.b.pool.get
	if c.keep {
		get = c.b.dev.Alloc
	}
	buf, err := get(max(bytes, 1))
	if err != nil {
		return nil, fmt.Errorf("gpu: %w", err)
	}
	c.bufs = append(c.bufs, buf)
	c.rec.lap(HostAlloc)
	return buf, nil
}

// release returns the call's buffers to the pool. The stream must have
// finished every use of them.
func (c *hostCall) release() {
	for _, buf := range c.bufs {
		if c.keep {
			_ = buf.Free()
		} else {
			c.b.pool.put(buf)
		}
	}
	c.bufs = nil
}

// end releases the call's buffers and, when the call succeeded (*err is
// nil), closes its breakdown.
func (c *hostCall) end(err *error) {
	if uerr := c.b.copier.unregisterAll(c.b.stream, c.rec); uerr != nil && *err == nil {
		*err = uerr
	}
	c.release()
	if *err == nil {
		c.rec.finish()
	}
}

// beginHost starts a host-path call: it takes the host path's lock, which
// the caller releases (b.hostMu.Unlock) after the call's c.end, and records
// the planning and the wait for the lock in rec (nil: untraced).
func (b *Backend) beginHost(rec *callRecorder) *hostCall {
	rec.lap(HostPlan)
	b.hostMu.Lock()
	rec.lap(HostWait)
	b.copier.direct = b.HostRegister
	return &hostCall{b: b, rec: rec}
}

// hostSpan returns the storage of t from its first to its last element (see
// denseLayout). t must have passed CheckLayout and have elements.
func hostSpan(t attn.Tensor) []byte {
	n, _ := denseLayout(t)
	size := t.DType.Size()
	return tensorStorage(t)[t.Offset*size : (t.Offset+n)*size]
}

// denseLayout returns the number of storage elements from t's first
// element to its last, and whether that is exactly t's element count: its
// strides then permute a contiguous block (as a [B, H, N, D] buffer viewed
// as [B, N, H, D] does). It reads no storage: t may be a header alone.
func denseLayout(t attn.Tensor) (span int, dense bool) {
	st := hostStrides(t)
	span = 1
	for d, s := range t.Shape {
		span += (s - 1) * st[d]
	}
	return span, span == t.NumElements()
}

// hostStrides returns t's strides (contiguous ones for nil).
func hostStrides(t attn.Tensor) []int {
	if t.Strides == nil {
		return attn.ContiguousStrides(t.Shape)
	}
	return slices.Clone(t.Strides)
}

// upload copies host tensor t to the device. A tensor whose feature (last)
// dim has stride 1 and whose storage span is at most twice its elements
// goes over as that span, keeping its strides (no gathering on the host);
// any other goes over as its contiguous image.
func (c *hostCall) upload(s *cuda.Stream, t attn.Tensor) (DeviceTensor, error) {
	d := DeviceTensor{DType: t.DType, Shape: slices.Clone(t.Shape), Strides: hostStrides(t)}
	n := t.NumElements()
	if n == 0 {
		return d, nil
	}
	span := hostSpan(t)
	last := len(t.Shape) - 1
	if t.Shape[last] > 1 && d.Strides[last] != 1 || len(span) > 2*n*t.DType.Size() {
		span = t.Bytes()
		d.Strides = attn.ContiguousStrides(t.Shape)
		c.rec.lap(HostToPinned)
	}
	buf, err := c.alloc(int64(len(span)))
	if err != nil {
		return d, err
	}
	d.Buf = buf
	if err := c.b.copier.toDevice(s, buf, 0, span, c.rec); err != nil {
		return d, err
	}
	return d, nil
}

// uploadInt32 copies a small int32 array (cu_seqlens) to the device.
func (c *hostCall) uploadInt32(s *cuda.Stream, x []int32) (*cuda.Buffer, error) {
	buf, err := c.alloc(int64(4 * len(x)))
	if err != nil {
		return nil, err
	}
	return buf, c.b.copier.toDevice(s, buf, 0, cuda.AsBytes(x), c.rec)
}

// output returns the device tensor that receives host output h: with h's
// own strides when h's span is dense with a unit feature stride (the span
// then comes back as it is), contiguous otherwise (the values are then
// scattered into h element by element). contiguous forces the contiguous
// device layout (dBias, which the kernels write contiguous).
func (c *hostCall) output(h attn.Tensor, contiguous bool) (hostOutput, error) {
	o := hostOutput{host: h, dev: DeviceTensor{DType: h.DType, Shape: slices.Clone(h.Shape), Strides: hostStrides(h)}}
	n := h.NumElements()
	if n == 0 {
		return o, nil
	}
	_, dense := denseLayout(h)
	last := len(h.Shape) - 1
	if contiguous || !dense || h.Shape[last] > 1 && o.dev.Strides[last] != 1 {
		contig := attn.ContiguousStrides(h.Shape)
		o.scatter = !dense || !slices.Equal(contig, o.dev.Strides)
		o.dev.Strides = contig
	}
	buf, err := c.alloc(int64(n * h.DType.Size()))
	if err != nil {
		return o, err
	}
	o.dev.Buf = buf
	return o, nil
}

// download copies the output into its host tensor after the work enqueued
// on s.
func (c *hostCall) download(s *cuda.Stream, o hostOutput) error {
	if o.host.NumElements() == 0 {
		return nil
	}
	if o.scatter {
		img := make([]byte, o.host.NumElements()*o.host.DType.Size())
		if err := c.b.copier.fromDevice(s, img, o.dev.Buf, 0, c.rec); err != nil {
			return err
		}
		err := attn.CopyInto(o.host, tensorFromBytes(o.host.DType, img, o.host.Shape))
		c.rec.lap(PinnedToHost)
		return err
	}
	span := hostSpan(o.host)
	return c.b.copier.fromDevice(s, span, o.dev.Buf, 0, c.rec)
}

// inputs uploads ts, then the bias and cu_seqlens of opt, and returns the
// device tensors and the device options.
func (c *hostCall) inputs(s *cuda.Stream, p *attn.Problem, opt attn.Options, ts ...attn.Tensor) ([]DeviceTensor, DeviceOptions, error) {
	ins := make([]DeviceTensor, len(ts))
	for i, t := range ts {
		d, err := c.upload(s, t)
		if err != nil {
			return nil, DeviceOptions{}, err
		}
		ins[i] = d
	}
	dopt, err := c.deviceOptions(s, p, opt)
	if err == nil {
		err = c.b.copier.markInputs(s)
	}
	return ins, dopt, err
}

// deviceOptions uploads the bias and cu_seqlens of opt and returns the
// device options: opt with its bias moved into DeviceOptions.Bias (see
// DeviceOptions).
func (c *hostCall) deviceOptions(s *cuda.Stream, p *attn.Problem, opt attn.Options) (DeviceOptions, error) {
	dopt := DeviceOptions{Options: opt}
	dopt.Options.Bias = nil
	if opt.Bias != nil {
		db, err := c.upload(s, opt.Bias.Tensor)
		if err != nil {
			return dopt, err
		}
		dopt.Bias = &db
	}
	if p.Varlen {
		var err error
		if dopt.CuSeqlensQ, err = c.uploadInt32(s, opt.CuSeqlensQ); err != nil {
			return dopt, err
		}
		if dopt.CuSeqlensK, err = c.uploadInt32(s, opt.CuSeqlensK); err != nil {
			return dopt, err
		}
	}
	return dopt, nil
}

// Upload copies host tensor t into newly allocated device memory and
// returns the device tensor, which keeps t's strides where its feature dim
// has stride 1 (the storage span from its first to its last element is
// copied) and is contiguous otherwise. The caller frees it.
func (b *Backend) Upload(t attn.Tensor) (DeviceTensor, error) {
	if err := t.CheckLayout("upload"); err != nil {
		return DeviceTensor{}, err
	}
	b.hostMu.Lock()
	defer b.hostMu.Unlock()
	c := &hostCall{b: b, keep: true}
	b.copier.direct = b.HostRegister
	d, err := c.upload(b.stream, t)
	if err == nil {
		err = b.stream.Synchronize()
	}
	if uerr := b.copier.unregisterAll(b.stream, nil); uerr != nil && err == nil {
		err = uerr
	}
	if err != nil {
		c.release()
		return DeviceTensor{}, err
	}
	return d, nil
}

// Download waits for the work enqueued on s (nil: the whole device) and
// returns a contiguous host copy of device tensor t, whatever its strides:
// its storage span (from its first element to its last) comes over, and
// the elements are gathered on the host. It fails, wrapping attn's
// sentinels, for a tensor that does not lie inside its buffer.
func (b *Backend) Download(s *cuda.Stream, t DeviceTensor) (attn.Tensor, error) {
	if err := t.check("download", t.DType, len(t.Shape), false); err != nil {
		return attn.Tensor{}, err
	}
	sync := b.dev.Synchronize
	if s != nil {
		sync = s.Synchronize
	}
	if err := sync(); err != nil {
		return attn.Tensor{}, fmt.Errorf("gpu: download: %w", err)
	}
	out := attn.New(t.DType, t.Shape...)
	if out.NumElements() == 0 {
		return out, nil
	}
	view := attn.Tensor{DType: t.DType, Shape: slices.Clone(t.Shape), Strides: t.strides()}
	span, _ := denseLayout(view)
	img := make([]byte, span*t.DType.Size())
	if err := b.dev.CopyFromDevice(img, t.Buf, t.Offset*int64(t.DType.Size())); err != nil {
		return attn.Tensor{}, fmt.Errorf("gpu: download: %w", err)
	}
	src := tensorFromBytes(t.DType, img, []int{span})
	view.F32, view.Bits = src.F32, src.Bits
	if err := attn.CopyInto(out, view); err != nil {
		return attn.Tensor{}, fmt.Errorf("gpu: download: %w", err)
	}
	return out, nil
}

// lateTensors allocates host output tensors on goroutines of their own, one
// each, while the host path uploads and the kernels run, and touches every
// page of them there: Go either zeroes the heap memory it reuses for a new
// slice or hands out fresh pages that the kernel maps on their first write,
// each about as long per byte as the copy to the device takes, and this
// hides both behind the copies rather than leaving the page faults to the
// copies out of the pinned staging.
type lateTensors struct {
	ts []attn.Tensor
	wg sync.WaitGroup
}

// allocLate starts allocating one tensor per header like (of its dtype,
// shape and memory order: attn.NewLike).
func allocLate(like ...attn.Tensor) *lateTensors {
	l := &lateTensors{ts: make([]attn.Tensor, len(like))}
	for i, h := range like {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			l.ts[i] = attn.NewLike(h.DType, h)
			prefault(l.ts[i])
		}()
	}
	return l
}

// wait returns the tensors once they are allocated.
func (l *lateTensors) wait() []attn.Tensor {
	l.wg.Wait()
	return l.ts
}

// prefaultChunk is the bytes one goroutine of prefault touches.
const prefaultChunk = 8 << 20

// prefaultWorkers bounds the goroutines prefault runs for one tensor.
const prefaultWorkers = 4

// touchPages writes a zero into every 4 KiB page of bytes [lo, hi) of x,
// whose elements are size bytes.
func touchPages[E uint16 | float32](x []E, size, lo, hi int) {
	for i := lo / size; i < hi/size; i += 4096 / size {
		x[i] = 0
	}
	x[hi/size-1] = 0 // the last page, which the stride may step over
}

// prefault writes a zero into every 4 KiB page of t's storage (which is
// zero, being new), on up to prefaultWorkers goroutines, so that the
// kernel maps the pages that Go took fresh from the system now rather than
// during the copies that fill them.
func prefault(t attn.Tensor) {
	var touch func(lo, hi int) // touches storage bytes [lo, hi)
	var n int
	switch {
	case len(t.F32) > 0:
		n, touch = 4*len(t.F32), func(lo, hi int) { touchPages(t.F32, 4, lo, hi) }
	case len(t.Bits) > 0:
		n, touch = 2*len(t.Bits), func(lo, hi int) { touchPages(t.Bits, 2, lo, hi) }
	default:
		return
	}
	chunks := (n + prefaultChunk - 1) / prefaultChunk
	workers := min(chunks, prefaultWorkers, runtime.GOMAXPROCS(0))
	if workers <= 1 {
		touch(0, n)
		return
	}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for c := w; c < chunks; c += workers {
				touch(c*prefaultChunk, min(n, (c+1)*prefaultChunk))
			}
		}()
	}
	wg.Wait()
}

// header returns a tensor of dt and shape with contiguous strides and no
// storage, which stands for an output until its storage is allocated.
func header(dt attn.DType, shape []int) attn.Tensor {
	return attn.Tensor{DType: dt, Shape: slices.Clone(shape), Strides: attn.ContiguousStrides(shape)}
}

// tensorFromBytes returns a contiguous tensor of dt and shape holding b.
func tensorFromBytes(dt attn.DType, b []byte, shape []int) attn.Tensor {
	t := attn.New(dt, shape...)
	if dt == attn.Float32 {
		for i := range t.F32 {
			t.F32[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
		}
	} else {
		for i := range t.Bits {
			t.Bits[i] = binary.LittleEndian.Uint16(b[2*i:])
		}
	}
	return t
}
