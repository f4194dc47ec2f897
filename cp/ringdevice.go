package cp

import (
	"errors"
	"fmt"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/gpu"
)

// DeviceRing runs attention split by the ring or zigzag strategy over P
// virtual ranks on one GPU, everything resident on the device, as P GPUs
// would run it: every rank has a compute stream and a communication
// stream; at each step its compute stream runs the calls the host ring
// plans for the step (ForwardDevice or BackwardDevice on views of its
// shards and of the K/V block it holds, each followed by the merge
// kernel into its float32 accumulators) while its communication stream
// copies the next block, device to device, into its other K/V buffer; in
// the backward the float32 dK/dV accumulators travel the ring back to
// their owners the same way. Events order the streams (see package
// documentation). The results equal the single call's within rounding.
//
// Its calls enqueue on Stream: each forks onto the ranks' streams and
// joins back, so work enqueued on Stream afterwards sees its results. A
// DeviceRing is not safe for concurrent use.
type DeviceRing struct {
	ops  *gpuStreams
	ring *devRing
}

// NewDeviceRing prepares the ring of strategy s (ring, or zigzag for a
// causal mask) over p virtual ranks on backend b's GPU for the problem of
// q [B, N, H, DK], k [B, M, Hkv, DK] and v [B, M, Hkv, DV] under opt
// (contiguous device tensors on b's device; their shapes, dtype and opt
// are fixed from here on): it creates a stream of its own and every
// rank's two streams, allocates every rank's shards, buffers and
// accumulators, and copies q, k and v's shards in. It refuses what
// MeasureDeviceSplit refuses, with the same errors.
func NewDeviceRing(b *gpu.Backend, s Strategy, p int, q, k, v gpu.DeviceTensor, opt attn.Options) (*DeviceRing, error) {
	if b == nil {
		return nil, attn.Errorf(attn.ErrOption, "cp: NewDeviceRing needs a backend")
	}
	st, err := b.Device().NewStreamNonBlocking()
	if err != nil {
		return nil, fmt.Errorf("cp: %w", err)
	}
	d := &DeviceRing{ops: newGPUStreams(&gpuOps{b: b, s: st})}
	if d.ring, err = newDevRing(d.ops, s, p, q, k, v, opt); err == nil {
		err = st.Synchronize()
	}
	if err != nil {
		return nil, errors.Join(err, d.Close())
	}
	return d, nil
}

// Stream returns the stream the ring's calls enqueue on.
func (d *DeviceRing) Stream() *cuda.Stream { return d.ops.s }

// shard copies the global inputs q, k and v, shaped as NewDeviceRing's,
// into the ranks' shards.
func (d *DeviceRing) shard(q, k, v gpu.DeviceTensor) error {
	x := d.ring.devSplit
	if err := checkGlobals(x.global("q", q), x.global("k", k), x.global("v", v)); err != nil {
		return err
	}
	for _, in := range []struct {
		t      gpu.DeviceTensor
		shards []gpu.DeviceTensor
	}{{q, x.q}, {k, x.k}, {v, x.v}} {
		if err := x.copyChunks(in.t, in.shards, 1, false); err != nil {
			return err
		}
	}
	return nil
}

// Forward enqueues the forward of q, k and v (shaped as NewDeviceRing's)
// into o [B, N, H, DV] in q's dtype and lse [B, H, N] in float32,
// contiguous: the inputs are sharded, the ring runs, and every rank's O
// and LSE are copied back into o and lse. It fails, wrapping attn's
// sentinels, for tensors of other shapes, dtypes or layouts.
func (d *DeviceRing) Forward(q, k, v, o, lse gpu.DeviceTensor) error {
	x := d.ring.devSplit
	if err := checkGlobals(x.global("o", o), x.global("lse", lse)); err != nil {
		return err
	}
	if err := d.shard(q, k, v); err != nil {
		return err
	}
	if err := d.ring.forward(); err != nil {
		return err
	}
	if err := x.unshard(o, x.o, 1); err != nil {
		return err
	}
	return x.unshard(lse, x.lse, 2)
}

// Backward enqueues the backward of q, k and v (shaped as NewDeviceRing's)
// from the forward's o and lse and from dO [B, N, H, DV] into dq, dk and
// dv, shaped as q, k and v, all contiguous. It fails as Forward does.
func (d *DeviceRing) Backward(q, k, v, o, lse, dO, dq, dk, dv gpu.DeviceTensor) error {
	x := d.ring.devSplit
	if err := checkGlobals(x.global("dq", dq), x.global("dk", dk), x.global("dv", dv)); err != nil {
		return err
	}
	if err := d.shard(q, k, v); err != nil {
		return err
	}
	if err := d.ring.setBackward(o, lse, dO); err != nil {
		return err
	}
	if err := d.ring.backward(); err != nil {
		return err
	}
	for _, g := range []struct {
		t      gpu.DeviceTensor
		shards []gpu.DeviceTensor
	}{{dq, x.dq}, {dk, x.dk}, {dv, x.dv}} {
		if err := x.unshard(g.t, g.shards, 1); err != nil {
			return err
		}
	}
	return nil
}

// Close waits for the ring's streams and frees its streams, events and
// device memory.
func (d *DeviceRing) Close() error {
	err := d.ops.close()
	return errors.Join(err, d.ops.s.Synchronize(), d.ops.free(), d.ops.s.Close())
}

// gpuStreams are streamOps on package gpu's backend: stream 0 is the
// origin's, the others are non-blocking streams of the device, each with
// operations of its own (its own forward staging and backward workspace,
// since calls on different streams may run at the same time) that
// allocate through the origin's; events are created without timing.
type gpuStreams struct {
	*gpuOps                 // the origin stream's operations
	streams []*gpuStreamOps // streams[i-1] is stream i
	events  []*cuda.Event
}

// gpuStreamOps are the operations on one stream of gpuStreams.
type gpuStreamOps struct {
	*gpuOps
	root *gpuOps
}

func (g *gpuStreamOps) alloc(dt attn.DType, shape ...int) (gpu.DeviceTensor, error) {
	return g.root.alloc(dt, shape...)
}

func newGPUStreams(root *gpuOps) *gpuStreams { return &gpuStreams{gpuOps: root} }

func (g *gpuStreams) newStream() (streamID, error) {
	s, err := g.b.Device().NewStreamNonBlocking()
	if err != nil {
		return 0, fmt.Errorf("cp: %w", err)
	}
	g.streams = append(g.streams, &gpuStreamOps{gpuOps: &gpuOps{b: g.b, s: s}, root: g.gpuOps})
	return streamID(len(g.streams)), nil
}

func (g *gpuStreams) newEvent() (eventID, error) {
	e, err := g.b.Device().NewEventNoTiming()
	if err != nil {
		return 0, fmt.Errorf("cp: %w", err)
	}
	g.events = append(g.events, e)
	return eventID(len(g.events) - 1), nil
}

// stream returns the CUDA stream of s.
func (g *gpuStreams) stream(s streamID) *cuda.Stream {
	if s == 0 {
		return g.s
	}
	return g.streams[s-1].s
}

func (g *gpuStreams) on(s streamID) devOps {
	if s == 0 {
		return g.gpuOps
	}
	return g.streams[s-1]
}

func (g *gpuStreams) record(e eventID, s streamID) error {
	if err := g.events[e].Record(g.stream(s)); err != nil {
		return fmt.Errorf("cp: %w", err)
	}
	return nil
}

func (g *gpuStreams) wait(s streamID, e eventID) error {
	if err := g.stream(s).WaitEvent(g.events[e]); err != nil {
		return fmt.Errorf("cp: %w", err)
	}
	return nil
}

// close waits for the streams other than the origin, frees their scratch
// and closes them and the events. The origin's operations stay.
func (g *gpuStreams) close() error {
	var errs []error
	for _, o := range g.streams {
		errs = append(errs, o.s.Synchronize(), o.free(), o.s.Close())
	}
	for _, e := range g.events {
		errs = append(errs, e.Close())
	}
	g.streams, g.events = nil, nil
	return errors.Join(errs...)
}
