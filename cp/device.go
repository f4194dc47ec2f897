package cp

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/gpu"
)

// DeviceSplit is the measured cost of splitting one call over P virtual
// ranks on one GPU, everything resident on the device (MeasureDeviceSplit):
// the single call over the whole problem against the same problem as a
// ring split runs it, every rank's step calls and merge kernels back to
// back on one stream, and as the device ring runs it (DeviceRing). Times
// are medians over the repeats, in milliseconds,
// each from CUDA events around one replay of a CUDA graph of the work, so
// that no host launch overhead enters them.
type DeviceSplit struct {
	// Strategy, P and Backward say what was measured.
	Strategy Strategy
	P        int
	Backward bool
	// Calls is the number of attention calls over all steps and ranks;
	// Merges the number of merge kernels (the forward's combines; the
	// backward's resets, gradient adds and finishes).
	Calls, Merges int
	// SingleMs is the single call (ForwardDevice or BackwardDevice) over
	// the whole problem.
	SingleMs float64
	// AttentionMs is every rank's step calls alone, MergeMs the merge
	// kernels alone, TotalMs both in their order: the sum of the per-step
	// kernels, the compute a real P-GPU run spreads over its GPUs.
	AttentionMs, MergeMs, TotalMs float64
	// RingMs is the same split run as DeviceRing runs it: every rank's
	// calls and merge kernels on its compute stream, the K/V blocks (and
	// in the backward the dK/dV accumulators) copied on its communication
	// stream meanwhile, ordered by events, all ranks at once on the one
	// GPU.
	RingMs float64
	// Repeats is the number of timed replays of each.
	Repeats int
}

// Ratio returns TotalMs / SingleMs: the cost of splitting (1: none).
func (d DeviceSplit) Ratio() float64 {
	if d.SingleMs <= 0 {
		return 0
	}
	return d.TotalMs / d.SingleMs
}

// PartsRatio returns (AttentionMs + MergeMs) / SingleMs: the cost of
// splitting with the calls and the merge kernels timed apart (1: none).
func (d DeviceSplit) PartsRatio() float64 {
	if d.SingleMs <= 0 {
		return 0
	}
	return (d.AttentionMs + d.MergeMs) / d.SingleMs
}

// RingStepMs returns RingMs / P²: the ring's time shared out over its P
// steps and P ranks, one rank's step were the ranks' work, with its
// copies overlapped as on the one GPU, spread over P GPUs.
func (d DeviceSplit) RingStepMs() float64 {
	if d.P <= 0 {
		return 0
	}
	return d.RingMs / float64(d.P*d.P)
}

// MeasureDeviceSplit measures the cost of splitting one call by strategy s
// (ring, or zigzag for a causal mask) over p virtual ranks on backend b's
// GPU. q [B, N, H, DK], k [B, M, Hkv, DK] and v [B, M, Hkv, DV] are the
// global inputs, contiguous on b's device; with backward set the backward
// is measured, from dO [B, N, H, DV] and the forward's outputs (computed
// here by the single call). The inputs are sharded once; then the single
// call, the split with all its kernels on one stream, with its attention
// calls alone and with its merge kernels alone, and the split as the
// device ring runs it on the ranks' streams, are each captured in a CUDA
// graph (after one eager run, which compiles every kernel) and replayed
// repeats times (at least 1). The inputs are not rotated through the L2 cache: a
// short problem's blocks may stay in it from one call to the next. Problems the device split does not take are refused
// with errors wrapping attn's sentinels: a2a and hybrid, packed batches, a
// bias and dropout with attn.ErrUnsupported, uneven shards with
// attn.ErrShape.
func MeasureDeviceSplit(b *gpu.Backend, s Strategy, p int, backward bool, q, k, v, dO gpu.DeviceTensor, opt attn.Options, repeats int) (DeviceSplit, error) {
	if b == nil {
		return DeviceSplit{}, attn.Errorf(attn.ErrOption, "cp: MeasureDeviceSplit needs a backend")
	}
	r, err := newDeviceRun(b, s, p, q, k, v, opt)
	if err != nil {
		return DeviceSplit{}, err
	}
	defer r.close()
	d, err := r.measure(backward, dO, max(repeats, 1))
	if err != nil {
		return DeviceSplit{}, err
	}
	d.Strategy, d.P = s, p
	return d, nil
}

// deviceRun is a split and the single call of one problem on a GPU, their
// work enqueued on one stream of its own (the ring's forked onto the
// ranks' streams).
type deviceRun struct {
	ops     *gpuOps
	so      *gpuStreams
	ring    *devRing
	x       *devSplit
	q, k, v gpu.DeviceTensor // the global inputs
	opt     attn.Options
	o, lse  gpu.DeviceTensor // the single forward's outputs
}

// newDeviceRun lays the problem out for the split on b (see newDevSplit)
// and allocates the single forward's outputs.
func newDeviceRun(b *gpu.Backend, st Strategy, p int, q, k, v gpu.DeviceTensor, opt attn.Options) (*deviceRun, error) {
	s, err := b.Device().NewStreamNonBlocking()
	if err != nil {
		return nil, fmt.Errorf("cp: %w", err)
	}
	r := &deviceRun{ops: &gpuOps{b: b, s: s}, q: q, k: k, v: v, opt: opt}
	r.so = newGPUStreams(r.ops)
	if r.ring, err = newDevRing(r.so, st, p, q, k, v, opt); err == nil {
		r.x = r.ring.devSplit
		gp := r.x.gp
		if r.o, err = r.ops.alloc(q.DType, gp.B, gp.N, gp.H, gp.DV); err == nil {
			r.lse, err = r.ops.alloc(attn.Float32, gp.B, gp.H, gp.N)
		}
	}
	if err == nil {
		err = s.Synchronize()
	}
	if err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

// close waits for the streams and frees everything the run allocated.
func (r *deviceRun) close() error {
	err := r.so.close()
	return errors.Join(err, r.ops.s.Synchronize(), r.ops.free(), r.ops.s.Close())
}

// single enqueues the single forward over the global inputs into r.o and
// r.lse.
func (r *deviceRun) single() error { return r.ops.forward(r.q, r.k, r.v, r.o, r.lse, r.opt) }

// setBackward runs the single forward and gives its outputs and the global
// dO to the split's backward; it allocates the single backward's
// gradients and returns the single backward's enqueuer.
func (r *deviceRun) setBackward(dO gpu.DeviceTensor) (func() error, error) {
	if err := r.single(); err != nil {
		return nil, err
	}
	if err := r.ring.setBackward(r.o, r.lse, dO); err != nil {
		return nil, err
	}
	gs := make([]gpu.DeviceTensor, 3)
	for i, t := range []gpu.DeviceTensor{r.q, r.k, r.v} {
		var err error
		if gs[i], err = r.ops.alloc(t.DType, t.Shape...); err != nil {
			return nil, err
		}
	}
	return func() error { return r.ops.backward(r.q, r.k, r.v, r.o, r.lse, dO, gs[0], gs[1], gs[2], r.opt) }, nil
}

// measure times the single call and the split (see MeasureDeviceSplit).
func (r *deviceRun) measure(backward bool, dO gpu.DeviceTensor, repeats int) (DeviceSplit, error) {
	single, pass, ring := r.single, r.x.forward, r.ring.forward
	if backward {
		var err error
		if single, err = r.setBackward(dO); err != nil {
			return DeviceSplit{}, err
		}
		pass, ring = r.x.backward, r.ring.backward
	}
	// single, the split whole, its attention calls alone, its merge
	// kernels alone, the ring; an eager run of each (the split whole last,
	// for its counts) compiles every kernel and sizes the scratch of every
	// stream before any capture
	works := []func() error{single, func() error { return pass(opAll) }, func() error { return pass(opAttention) }, func() error { return pass(opMerge) }, ring}
	for _, i := range []int{0, 2, 3, 4, 1} {
		if err := works[i](); err != nil {
			return DeviceSplit{}, err
		}
	}
	d := DeviceSplit{Backward: backward, Repeats: repeats, Calls: r.x.calls, Merges: r.x.launches}
	if err := r.ops.s.Synchronize(); err != nil {
		return d, fmt.Errorf("cp: the eager runs: %w", err)
	}
	// the backend may still be compiling other dtypes' variants in the
	// background (Backend.Speculate): a module load during a capture would
	// break it, so wait for them
	r.ops.b.KernelStats()
	graphs := make([]*cuda.Graph, len(works))
	defer func() {
		for _, g := range graphs {
			g.Close()
		}
	}()
	for i, w := range works {
		var err error
		if graphs[i], err = capture(r.ops.s, w); err != nil {
			return d, err
		}
	}
	times, err := replay(r.ops.b.Device(), r.ops.s, graphs, repeats)
	if err != nil {
		return d, err
	}
	d.SingleMs, d.TotalMs, d.AttentionMs, d.MergeMs, d.RingMs = times[0], times[1], times[2], times[3], times[4]
	return d, nil
}

// capture captures what work enqueues on s in a CUDA graph.
func capture(s *cuda.Stream, work func() error) (*cuda.Graph, error) {
	if err := s.BeginCapture(cuda.CaptureThreadLocal); err != nil {
		return nil, fmt.Errorf("cp: capture: %w", err)
	}
	werr := work()
	g, err := s.EndCapture()
	if err = errors.Join(werr, err); err != nil {
		g.Close()
		return nil, fmt.Errorf("cp: capture: %w", err)
	}
	return g, nil
}

// replay launches each graph repeats times on s (a stream of dev), in
// turn, each between two events, and returns each graph's median time in
// milliseconds.
func replay(dev *cuda.Device, s *cuda.Stream, graphs []*cuda.Graph, repeats int) ([]float64, error) {
	events := make([]*cuda.Event, 2*len(graphs)*repeats)
	defer func() {
		for _, e := range events {
			e.Close()
		}
	}()
	for i := range events {
		var err error
		if events[i], err = dev.NewEvent(); err != nil {
			return nil, fmt.Errorf("cp: %w", err)
		}
	}
	for rep := range repeats {
		for i, g := range graphs {
			e := events[2*(rep*len(graphs)+i):]
			if err := e[0].Record(s); err != nil {
				return nil, fmt.Errorf("cp: %w", err)
			}
			if err := g.Launch(s); err != nil {
				return nil, fmt.Errorf("cp: graph launch: %w", err)
			}
			if err := e[1].Record(s); err != nil {
				return nil, fmt.Errorf("cp: %w", err)
			}
		}
	}
	if err := s.Synchronize(); err != nil {
		return nil, fmt.Errorf("cp: the timed replays: %w", err)
	}
	out := make([]float64, len(graphs))
	for i := range graphs {
		ms := make([]float64, repeats)
		for rep := range repeats {
			e := events[2*(rep*len(graphs)+i):]
			t, err := cuda.ElapsedMs(e[0], e[1])
			if err != nil {
				return nil, fmt.Errorf("cp: %w", err)
			}
			ms[rep] = float64(t)
		}
		slices.Sort(ms)
		out[i] = ms[repeats/2]
		if repeats%2 == 0 {
			out[i] = (ms[repeats/2-1] + ms[repeats/2]) / 2
		}
	}
	return out, nil
}

// gpuOps are the device operations on package gpu's backend, enqueued on
// one stream. The forward's staging and the backward's workspace grow to
// what the calls need (waiting for the stream before a buffer in use is
// freed), which an eager run does before a graph capture.
type gpuOps struct {
	b                  *gpu.Backend
	s                  *cuda.Stream
	owned              []gpu.DeviceTensor
	staging, workspace *cuda.Buffer
}

func (g *gpuOps) alloc(dt attn.DType, shape ...int) (gpu.DeviceTensor, error) {
	t, err := gpu.NewDeviceTensor(g.b.Device(), dt, shape...)
	if err != nil {
		return t, fmt.Errorf("cp: %w", err)
	}
	g.owned = append(g.owned, t)
	return t, nil
}

// free frees every tensor and scratch buffer the operations allocated.
func (g *gpuOps) free() error {
	var errs []error
	for _, t := range g.owned {
		errs = append(errs, t.Free())
	}
	for _, b := range []*cuda.Buffer{g.staging, g.workspace} {
		if b != nil {
			errs = append(errs, b.Free())
		}
	}
	g.owned, g.staging, g.workspace = nil, nil, nil
	return errors.Join(errs...)
}

func (g *gpuOps) copy(dst, src gpu.DeviceTensor) error {
	if !dense(dst) || !dense(src) || !sameInts(dst.Shape, src.Shape) || dst.DType != src.DType {
		return attn.Errorf(attn.ErrLayout, "cp: copy of %v %v into %v %v: want dense tensors of one shape and dtype", src.DType, src.Shape, dst.DType, dst.Shape)
	}
	size := int64(src.DType.Size())
	n := int64(src.NumElements()) * size
	return g.b.Device().CopyDeviceToDeviceAsync(dst.Buf, dst.Offset*size, src.Buf, src.Offset*size, n, g.s)
}

// grow returns *buf holding at least n bytes, replacing a smaller one
// once the stream is done with it.
func (g *gpuOps) grow(buf **cuda.Buffer, n int64) (*cuda.Buffer, error) {
	if n == 0 || *buf != nil && (*buf).Size() >= n {
		return *buf, nil
	}
	if *buf != nil {
		if err := g.s.Synchronize(); err != nil {
			return nil, err
		}
		if err := (*buf).Free(); err != nil {
			return nil, err
		}
		*buf = nil
	}
	b, err := g.b.Device().Alloc(n)
	if err != nil {
		return nil, err
	}
	*buf = b
	return b, nil
}

func (g *gpuOps) forward(q, k, v, o, lse gpu.DeviceTensor, opt attn.Options) error {
	dopt := gpu.DeviceOptions{Options: opt}
	n, err := g.b.PrepareForward(q, k, v, o, lse, dopt)
	if err == nil {
		dopt.Staging, err = g.grow(&g.staging, n)
	}
	if err == nil {
		err = g.b.ForwardDevice(g.s, q, k, v, o, lse, dopt)
	}
	return err
}

func (g *gpuOps) backward(q, k, v, o, lse, dO, dq, dk, dv gpu.DeviceTensor, opt attn.Options) error {
	bopt := gpu.BackwardOptions{DeviceOptions: gpu.DeviceOptions{Options: opt}}
	_, n, err := g.b.PrepareBackward(q, k, v, o, lse, dO, dq, dk, dv, bopt)
	if err == nil {
		bopt.Workspace, err = g.grow(&g.workspace, n)
	}
	if err == nil {
		_, err = g.b.BackwardDevice(g.s, q, k, v, o, lse, dO, dq, dk, dv, bopt)
	}
	return err
}

func (g *gpuOps) reset(a gpu.Accumulator) error { return g.b.ResetAccumulator(g.s, a) }

func (g *gpuOps) combine(parts, partsLSE, o, lse gpu.DeviceTensor) error {
	return g.b.CombineForward(g.s, parts, partsLSE, o, lse)
}

func (g *gpuOps) clearLSE(lse gpu.DeviceTensor) error {
	if lse.DType != attn.Float32 || lse.Buf == nil || lse.Offset != 0 || !dense(lse) || lse.Buf.Size() != int64(lse.NumElements())*4 {
		return attn.Errorf(attn.ErrLayout, "cp: clear of a %v %v LSE: want a float32 tensor filling its buffer", lse.DType, lse.Shape)
	}
	return g.b.Device().Memset32Async(lse.Buf, math.Float32bits(float32(math.Inf(-1))), g.s)
}

func (g *gpuOps) add(a gpu.Accumulator, r0 int, d gpu.DeviceTensor) error {
	return g.b.AddGradient(g.s, a, r0, d)
}

func (g *gpuOps) finish(a gpu.Accumulator, out gpu.DeviceTensor, lse *gpu.DeviceTensor) error {
	return g.b.FinishAccumulator(g.s, a, out, lse)
}
