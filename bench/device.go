package bench

import (
	"errors"
	"fmt"
	"math/rand/v2"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/half"
)

// Device is what the device runner needs from a GPU backend: device
// tensors, the forward and backward enqueued on one stream, and events on
// that stream. Package gpu's backend is adapted to it in cuda.go.
type Device interface {
	// Backend names the backend ("cuda"); Name the device ("NVIDIA H200").
	Backend() string
	Name() string
	// CacheBytes is the last-level cache size the input rotation must exceed.
	CacheBytes() int64
	// Upload returns a device copy of the contiguous host tensor t.
	Upload(t attn.Tensor) (DeviceTensor, error)
	// Alloc returns an uninitialised device tensor.
	Alloc(dt attn.DType, shape ...int) (DeviceTensor, error)
	// Forward enqueues the forward: o and lse from q, k, v (and the bias,
	// nil without one).
	Forward(q, k, v, o, lse, bias DeviceTensor, opt attn.Options) error
	// Backward enqueues the backward: dq, dk, dv from q, k, v, o, lse, dO
	// (and the bias, nil without one), and dbias when it is not nil.
	Backward(q, k, v, o, lse, dO, dq, dk, dv, bias, dbias DeviceTensor, opt attn.Options) error
	// NewEvent creates an event; Record enqueues it on the stream.
	NewEvent() (Event, error)
	Record(e Event) error
	// ElapsedMs returns the time between two completed events.
	ElapsedMs(start, end Event) (float64, error)
	// Sync waits for the stream.
	Sync() error
	// Reset starts a new case; Describe then returns the kernel variant
	// of the case's last forward and the dQ algorithm of its last backward
	// ("" when the backend does not say or the pass has none).
	Reset()
	Describe() (kernel, dq string)
	// Close releases the device.
	Close() error
}

// DeviceTensor is a tensor in device memory.
type DeviceTensor interface {
	// Free releases its memory.
	Free() error
}

// Event is a point on the device's stream.
type Event interface {
	// Close releases the event.
	Close() error
}

// DeviceRunner times a Device: inputs resident on the device, rotated among
// RotationSets sets, each repeat between two events.
type DeviceRunner struct {
	d    Device
	pool *randomPool
}

// NewDeviceRunner returns a runner for d.
func NewDeviceRunner(d Device) *DeviceRunner { return &DeviceRunner{d: d} }

// Implementation returns "flashattn".
func (r *DeviceRunner) Implementation() string { return Ours }

// Backend returns the device's backend name.
func (r *DeviceRunner) Backend() string { return r.d.Backend() }

// Device returns the device's name.
func (r *DeviceRunner) Device() string { return r.d.Name() }

// Close closes the device.
func (r *DeviceRunner) Close() error { return r.d.Close() }

// devSet is one input set on the device.
type devSet struct {
	q, k, v, o, lse, dO DeviceTensor
}

// deviceWork is a prepared case on a device.
type deviceWork struct {
	d          Device
	c          Case
	opt        attn.Options
	sets       []devSet
	o, lse     DeviceTensor // outputs of a timed forward
	dq, dk, dv DeviceTensor // outputs of a timed backward
	bias       DeviceTensor // the case's bias (nil without one), shared by every set
	dbias      DeviceTensor // its gradient, when the case asks for it
	events     []Event      // created events, reused by every timed region
	marks      int          // events recorded since the last Elapsed
	owned      []DeviceTensor
}

// Prepare uploads RotationSets input sets of random normal values (drawn
// from a pool generated once per runner, at a random offset per tensor),
// allocates the outputs, and for a backward runs the forward of each set.
func (r *DeviceRunner) Prepare(c Case) (w Workload, err error) {
	c.Normalize()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	dt, _ := c.DTypeValue()
	if r.pool == nil {
		r.pool = newRandomPool(1<<22, 0x5eed)
	}
	rng := rand.New(rand.NewPCG(caseSeed(c), 2))
	r.d.Reset()
	dw := &deviceWork{d: r.d, c: c, opt: c.Options()}
	defer func() {
		if err != nil {
			dw.Close()
		}
	}()
	upload := func(shape ...int) (DeviceTensor, error) {
		t, err := r.d.Upload(r.pool.tensor(rng, dt, shape...))
		if err == nil {
			dw.owned = append(dw.owned, t)
		}
		return t, err
	}
	alloc := func(dt attn.DType, shape ...int) (DeviceTensor, error) {
		t, err := r.d.Alloc(dt, shape...)
		if err == nil {
			dw.owned = append(dw.owned, t)
		}
		return t, err
	}
	B, N, M, H, Hkv, DK, DV := c.Batch, c.SeqlenQ, c.SeqlenK, c.Heads, c.KVHeads, c.HeadDim, c.HeadDimV
	if c.Pass != Backward {
		if dw.o, err = alloc(dt, B, N, H, DV); err != nil {
			return nil, err
		}
		if dw.lse, err = alloc(attn.Float32, B, H, N); err != nil {
			return nil, err
		}
	}
	if c.Pass != Forward {
		if dw.dq, err = alloc(dt, B, N, H, DK); err != nil {
			return nil, err
		}
		if dw.dk, err = alloc(dt, B, M, Hkv, DK); err != nil {
			return nil, err
		}
		if dw.dv, err = alloc(dt, B, M, Hkv, DV); err != nil {
			return nil, err
		}
	}
	if shape := c.BiasShape(); shape != nil {
		// one bias serves every input set: it is larger than the cache
		// whenever q, k and v are
		if dw.bias, err = upload(shape...); err != nil {
			return nil, err
		}
		if c.BiasGrad && c.Pass != Forward {
			if dw.dbias, err = alloc(dt, shape...); err != nil {
				return nil, err
			}
		}
	}
	n := RotationSets(c.Bytes(), r.d.CacheBytes())
	for i := 0; i < n; i++ {
		var s devSet
		if s.q, err = upload(B, N, H, DK); err != nil {
			return nil, err
		}
		if s.k, err = upload(B, M, Hkv, DK); err != nil {
			return nil, err
		}
		if s.v, err = upload(B, M, Hkv, DV); err != nil {
			return nil, err
		}
		s.o, s.lse = dw.o, dw.lse
		if c.Pass != Forward {
			if s.dO, err = upload(B, N, H, DV); err != nil {
				return nil, err
			}
		}
		if c.Pass == Backward {
			if s.o, err = alloc(dt, B, N, H, DV); err != nil {
				return nil, err
			}
			if s.lse, err = alloc(attn.Float32, B, H, N); err != nil {
				return nil, err
			}
			if err = r.d.Forward(s.q, s.k, s.v, s.o, s.lse, dw.bias, dw.opt); err != nil {
				return nil, fmt.Errorf("bench: forward for the backward's inputs: %w", err)
			}
		}
		dw.sets = append(dw.sets, s)
	}
	if err = r.d.Sync(); err != nil {
		return nil, err
	}
	return dw, nil
}

func (w *deviceWork) Sets() int { return len(w.sets) }

func (w *deviceWork) Run(set int) error {
	s := w.sets[set%len(w.sets)]
	o, lse := s.o, s.lse
	if w.c.Pass != Backward {
		o, lse = w.o, w.lse
		if err := w.d.Forward(s.q, s.k, s.v, o, lse, w.bias, w.opt); err != nil {
			return err
		}
	}
	if w.c.Pass != Forward {
		return w.d.Backward(s.q, s.k, s.v, o, lse, s.dO, w.dq, w.dk, w.dv, w.bias, w.dbias, w.opt)
	}
	return nil
}

// Reserve creates the events of n timed regions ahead, so that no event is
// created inside the timed loop.
func (w *deviceWork) Reserve(n int) error {
	for len(w.events) < 2*n {
		e, err := w.d.NewEvent()
		if err != nil {
			return err
		}
		w.events = append(w.events, e)
	}
	return nil
}

func (w *deviceWork) mark() error {
	if w.marks == len(w.events) {
		if err := w.Reserve(w.marks/2 + 1); err != nil {
			return err
		}
	}
	if err := w.d.Record(w.events[w.marks]); err != nil {
		return err
	}
	w.marks++
	return nil
}

func (w *deviceWork) Start() error { return w.mark() }
func (w *deviceWork) Stop() error  { return w.mark() }
func (w *deviceWork) Sync() error  { return w.d.Sync() }

func (w *deviceWork) Elapsed() ([]float64, error) {
	n := w.marks
	w.marks = 0
	if n%2 != 0 {
		return nil, errors.New("bench: a timed region was started and not stopped")
	}
	out := make([]float64, 0, n/2)
	for i := 0; i < n; i += 2 {
		ms, err := w.d.ElapsedMs(w.events[i], w.events[i+1])
		if err != nil {
			return nil, err
		}
		out = append(out, ms)
	}
	return out, nil
}

func (w *deviceWork) Variant() (string, string) { return w.d.Describe() }

// Close frees every device tensor and event of the case.
func (w *deviceWork) Close() error {
	var first error
	for _, e := range w.events {
		if err := e.Close(); err != nil && first == nil {
			first = err
		}
	}
	for _, t := range w.owned {
		if err := t.Free(); err != nil && first == nil {
			first = err
		}
	}
	w.events, w.owned, w.sets = nil, nil, nil
	return first
}

// randomPool holds standard normal values in every storage format, from
// which tensors are cut at random offsets: filling large device inputs then
// costs a copy, not a normal draw per element.
type randomPool struct {
	f32  []float32
	bf16 []uint16
	fp16 []uint16
}

func newRandomPool(n int, seed uint64) *randomPool {
	rng := rand.New(rand.NewPCG(seed, 3))
	p := &randomPool{f32: make([]float32, n), bf16: make([]uint16, n), fp16: make([]uint16, n)}
	for i := range p.f32 {
		x := float32(rng.NormFloat64())
		p.f32[i] = x
		p.bf16[i] = uint16(half.BFloat16FromFloat32(x))
		p.fp16[i] = uint16(half.Float16FromFloat32(x))
	}
	return p
}

// tensor returns a contiguous tensor of the shape whose elements are the
// pool's values from a random offset on, wrapping around.
func (p *randomPool) tensor(rng *rand.Rand, dt attn.DType, shape ...int) attn.Tensor {
	t := attn.Tensor{DType: dt, Shape: append([]int(nil), shape...), Strides: attn.ContiguousStrides(shape)}
	n := attn.NumElements(shape)
	start := rng.IntN(len(p.f32))
	switch dt {
	case attn.Float32:
		t.F32 = make([]float32, n)
		fillFrom(t.F32, p.f32, start)
	case attn.BFloat16:
		t.Bits = make([]uint16, n)
		fillFrom(t.Bits, p.bf16, start)
	default:
		t.Bits = make([]uint16, n)
		fillFrom(t.Bits, p.fp16, start)
	}
	return t
}

func fillFrom[T any](dst, src []T, start int) {
	for i := 0; i < len(dst); {
		i += copy(dst[i:], src[start:])
		start = 0
	}
}
