package bench

import (
	"fmt"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/gpu"
)

// openCUDA opens the first GPU through package gpu and returns a device
// runner on a stream of its own. It fails (wrapping cuda.ErrNoDriver or
// cuda.ErrNoDevice) where no GPU works.
func openCUDA() (Runner, error) {
	b, err := gpu.Open()
	if err != nil {
		return nil, err
	}
	// Compiling other element types' variants on spare cores would compete
	// with the timed launches.
	b.Speculate = false
	s, err := b.Device().NewStream()
	if err != nil {
		b.Close()
		return nil, fmt.Errorf("bench: %w", err)
	}
	return NewDeviceRunner(&cudaDevice{b: b, dev: b.Device(), s: s}), nil
}

// cudaDevice adapts package gpu's device-level API to Device: the forward
// through Backend.ForwardDevice, the backward through gpu.BackwardDevice
// (dQ algorithm chosen by the backend's table, or the deterministic one),
// both on one stream, timed by CUDA events on it.
type cudaDevice struct {
	b   *gpu.Backend
	dev *cuda.Device
	s   *cuda.Stream
	ws  *cuda.Buffer // the backward's workspace, grown as needed
	fws *cuda.Buffer // the forward's staging workspace (odd head dims), grown as needed

	lastFwd *fwdArgs // the last forward's arguments, for Describe
	lastBwd *bwdArgs // the last backward's arguments, for Describe
	lastDQ  string
}

type fwdArgs struct {
	q, k, v, o, lse gpu.DeviceTensor
	opt             gpu.DeviceOptions
}

type bwdArgs struct {
	q, k, v, o, lse, dO, dq, dk, dv gpu.DeviceTensor
	opt                             gpu.BackwardOptions
}

func (d *cudaDevice) Backend() string { return "cuda" }
func (d *cudaDevice) Name() string    { return d.dev.Name() }

// CPBackend gives the backend, which also takes host tensors, to the
// context-parallel cases.
func (d *cudaDevice) CPBackend() (attn.Backend, error) { return d.b, nil }

// CacheBytes returns the larger of the device's L2 size and DeviceCacheBytes.
func (d *cudaDevice) CacheBytes() int64 {
	return max(int64(d.dev.L2CacheSize()), DeviceCacheBytes)
}

func (d *cudaDevice) Upload(t attn.Tensor) (DeviceTensor, error) {
	x, err := gpu.NewDeviceTensor(d.dev, t.DType, t.Shape...)
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	src := cuda.AsBytes(t.Bits)
	if t.DType == attn.Float32 {
		src = cuda.AsBytes(t.F32)
	}
	if x.Buf != nil {
		if err := d.dev.CopyToDevice(x.Buf, 0, src); err != nil {
			x.Free()
			return nil, fmt.Errorf("bench: upload: %w", err)
		}
	}
	return x, nil
}

func (d *cudaDevice) Alloc(dt attn.DType, shape ...int) (DeviceTensor, error) {
	x, err := gpu.NewDeviceTensor(d.dev, dt, shape...)
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	return x, nil
}

func dt(t DeviceTensor) gpu.DeviceTensor { return t.(gpu.DeviceTensor) }

// deviceOptions returns the device options of a call with the given bias
// (nil without one).
func deviceOptions(opt attn.Options, bias DeviceTensor) gpu.DeviceOptions {
	o := gpu.DeviceOptions{Options: opt}
	if bias != nil {
		b := dt(bias)
		o.Bias = &b
	}
	return o
}

func (d *cudaDevice) Forward(q, k, v, o, lse, bias DeviceTensor, opt attn.Options) error {
	a := fwdArgs{dt(q), dt(k), dt(v), dt(o), dt(lse), deviceOptions(opt, bias)}
	need, err := d.b.PrepareForward(a.q, a.k, a.v, a.o, a.lse, a.opt)
	if err != nil {
		return err
	}
	if need > 0 {
		if err := grow(d.dev, &d.fws, need); err != nil {
			return fmt.Errorf("bench: forward staging: %w", err)
		}
		a.opt.Staging = d.fws
	}
	d.lastFwd = &a
	return d.b.ForwardDevice(d.s, a.q, a.k, a.v, a.o, a.lse, a.opt)
}

// grow makes *buf a device buffer of at least n bytes, replacing a smaller one.
func grow(dev *cuda.Device, buf **cuda.Buffer, n int64) error {
	if *buf != nil && (*buf).Size() >= n {
		return nil
	}
	if *buf != nil {
		(*buf).Free()
		*buf = nil
	}
	b, err := dev.Alloc(max(n, 1))
	if err != nil {
		return err
	}
	*buf = b
	return nil
}

func (d *cudaDevice) Backward(q, k, v, o, lse, dO, dq, dk, dv, bias, dbias DeviceTensor, opt attn.Options) error {
	a := bwdArgs{dt(q), dt(k), dt(v), dt(o), dt(lse), dt(dO), dt(dq), dt(dk), dt(dv), gpu.BackwardOptions{DeviceOptions: deviceOptions(opt, bias)}}
	if dbias != nil {
		g := dt(dbias)
		a.opt.DBias = &g
	}
	algo, need, err := d.b.PrepareBackward(a.q, a.k, a.v, a.o, a.lse, a.dO, a.dq, a.dk, a.dv, a.opt)
	if err != nil {
		return err
	}
	if err := grow(d.dev, &d.ws, need); err != nil {
		return fmt.Errorf("bench: backward workspace: %w", err)
	}
	a.opt.Workspace = d.ws
	a.opt.DQ = algo
	d.lastBwd = &a
	algo, err = d.b.BackwardDevice(d.s, a.q, a.k, a.v, a.o, a.lse, a.dO, a.dq, a.dk, a.dv, a.opt)
	d.lastDQ = algo.String()
	return err
}

type cudaEvent struct{ e *cuda.Event }

func (e cudaEvent) Close() error { return e.e.Close() }

func (d *cudaDevice) NewEvent() (Event, error) {
	e, err := d.dev.NewEvent()
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	return cudaEvent{e}, nil
}

func (d *cudaDevice) Record(e Event) error {
	if err := e.(cudaEvent).e.Record(d.s); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	return nil
}

func (d *cudaDevice) ElapsedMs(start, end Event) (float64, error) {
	ms, err := cuda.ElapsedMs(start.(cudaEvent).e, end.(cudaEvent).e)
	if err != nil {
		return 0, fmt.Errorf("bench: %w", err)
	}
	return float64(ms), nil
}

func (d *cudaDevice) Sync() error { return d.s.Synchronize() }

// Describe returns the name of the last forward's kernel variant, and the
// last backward's after " + " when a backward ran, and the last
// backward's dQ algorithm.
func (d *cudaDevice) Describe() (kernel, dq string) {
	if a := d.lastFwd; a != nil {
		if v, err := d.b.Variant(a.q, a.k, a.v, a.o, a.lse, a.opt); err == nil {
			kernel = v.Name()
		}
	}
	if a := d.lastBwd; a != nil {
		if v, err := d.b.BackwardVariant(a.q, a.k, a.v, a.o, a.lse, a.dO, a.dq, a.dk, a.dv, a.opt); err == nil {
			kernel += " + " + v.Name()
		}
	}
	return kernel, d.lastDQ
}

// Reset forgets the last launches (a new case begins).
func (d *cudaDevice) Reset() { d.lastFwd, d.lastBwd, d.lastDQ = nil, nil, "" }

func (d *cudaDevice) Close() error {
	var first error
	for _, b := range []*cuda.Buffer{d.ws, d.fws} {
		if b != nil {
			if err := b.Free(); err != nil && first == nil {
				first = err
			}
		}
	}
	if err := d.s.Close(); err != nil && first == nil {
		first = err
	}
	if err := d.b.Close(); err != nil && first == nil {
		first = err
	}
	return first
}
