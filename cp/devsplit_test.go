package cp

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/gpu"
)

// hostDev is devOps on the host, standing in for a GPU in tests: every
// allocation is a host tensor found by a *cuda.Buffer of its own (never
// used as a device buffer), the device tensors' views read and write it
// through their offsets and strides, the attention calls run on the CPU
// backend and the merge kernels compute what cp's host merge computes,
// the LSE kept in float32 between merges as on the device. alloc
// replaces store by a copy holding the new tensor, so that asyncDev's
// streams read the snapshot of the store they were handed and share
// nothing with the host but the tensors' elements.
type hostDev struct {
	b     attn.Backend
	store map[*cuda.Buffer]attn.Tensor
	calls []hostDevCall // every attention call, in order
}

// hostDevCall records one attention call: the element offsets and shapes
// of its q and k views and its window.
type hostDevCall struct {
	qOff, kOff int64
	nq, nk     int
	window     *attn.Window
}

func newHostDev() *hostDev {
	return &hostDev{b: cpu.New(), store: map[*cuda.Buffer]attn.Tensor{}}
}

func (h *hostDev) alloc(dt attn.DType, shape ...int) (gpu.DeviceTensor, error) {
	buf := new(cuda.Buffer)
	t := attn.New(dt, attn.NumElements(shape))
	t.Fill(float32(math.NaN())) // contents undefined: NaN until written
	store := maps.Clone(h.store)
	store[buf] = t
	h.store = store
	return gpu.DeviceTensor{Buf: buf, DType: dt, Shape: shape, Strides: attn.ContiguousStrides(shape)}, nil
}

// host returns the host view of device tensor t.
func (h *hostDev) host(t gpu.DeviceTensor) attn.Tensor {
	s := h.store[t.Buf]
	st := t.Strides
	if st == nil {
		st = attn.ContiguousStrides(t.Shape)
	}
	return attn.Tensor{DType: t.DType, Shape: t.Shape, Strides: st, Offset: int(t.Offset), F32: s.F32, Bits: s.Bits}
}

// upload returns a device tensor holding x.
func (h *hostDev) upload(x attn.Tensor) gpu.DeviceTensor {
	t, _ := h.alloc(x.DType, x.Shape...)
	if err := attn.CopyInto(h.host(t), x); err != nil {
		panic(err)
	}
	return t
}

// download returns a contiguous copy of t.
func (h *hostDev) download(t gpu.DeviceTensor) attn.Tensor {
	out := attn.New(t.DType, t.Shape...)
	if err := attn.CopyInto(out, h.host(t)); err != nil {
		panic(err)
	}
	return out
}

func (h *hostDev) copy(dst, src gpu.DeviceTensor) error {
	if !dense(dst) || !dense(src) {
		return attn.Errorf(attn.ErrLayout, "copy: %v into %v: not dense", src.Strides, dst.Strides)
	}
	return attn.CopyInto(h.host(dst), h.host(src))
}

func (h *hostDev) forward(q, k, v, o, lse gpu.DeviceTensor, opt attn.Options) error {
	h.calls = append(h.calls, callOf(q, k, opt))
	return h.runForward(q, k, v, o, lse, opt)
}

// callOf returns the record of a call on q and k under opt.
func callOf(q, k gpu.DeviceTensor, opt attn.Options) hostDevCall {
	return hostDevCall{q.Offset, k.Offset, q.Shape[1], k.Shape[1], opt.Window}
}

// runForward computes a forward call without recording it.
func (h *hostDev) runForward(q, k, v, o, lse gpu.DeviceTensor, opt attn.Options) error {
	res, err := h.b.Forward(h.host(q), h.host(k), h.host(v), opt)
	if err == nil {
		err = errors.Join(attn.CopyInto(h.host(o), res.O), attn.CopyInto(h.host(lse), res.LSE))
	}
	return err
}

func (h *hostDev) backward(q, k, v, o, lse, dO, dq, dk, dv gpu.DeviceTensor, opt attn.Options) error {
	h.calls = append(h.calls, callOf(q, k, opt))
	return h.runBackward(q, k, v, o, lse, dO, dq, dk, dv, opt)
}

// runBackward computes a backward call without recording it.
func (h *hostDev) runBackward(q, k, v, o, lse, dO, dq, dk, dv gpu.DeviceTensor, opt attn.Options) error {
	g, err := h.b.Backward(h.host(q), h.host(k), h.host(v), h.host(o), h.host(lse), h.host(dO), opt)
	if err == nil {
		err = errors.Join(attn.CopyInto(h.host(dq), g.DQ), attn.CopyInto(h.host(dk), g.DK), attn.CopyInto(h.host(dv), g.DV))
	}
	return err
}

func (h *hostDev) reset(a gpu.Accumulator) error {
	h.host(a.O).Fill(0)
	if a.LSE != nil {
		h.host(*a.LSE).Fill(float32(math.Inf(-1)))
	}
	return nil
}

// combine merges the slots in order with accum.merge (the device
// combine's semantics) and writes the result, rounded to o's dtype.
func (h *hostDev) combine(parts, partsLSE, o, lse gpu.DeviceTensor) error {
	sh := parts.Shape
	acc := newAccum(sh[1], sh[2], sh[3], sh[4])
	for k := range sh[0] {
		acc.merge(attn.Result{O: h.download(slotOf(parts, k)), LSE: h.download(slotOf(partsLSE, k))}, 0)
	}
	res, err := acc.result(o.DType)
	if err == nil {
		err = errors.Join(attn.CopyInto(h.host(o), res.O), attn.CopyInto(h.host(lse), res.LSE))
	}
	return err
}

func (h *hostDev) clearLSE(lse gpu.DeviceTensor) error {
	if !dense(lse) || lse.Offset != 0 || h.store[lse.Buf].NumElements() != lse.NumElements() {
		return attn.Errorf(attn.ErrLayout, "clear of an LSE %v not filling its buffer", lse.Shape)
	}
	h.host(lse).Fill(float32(math.Inf(-1)))
	return nil
}

// add adds g into the accumulator's rows from r0 with addRows.
func (h *hostDev) add(a gpu.Accumulator, r0 int, g gpu.DeviceTensor) error {
	vals := h.host(a.O).Float32s()
	addRows(vals, a.O.Shape[1], r0, h.download(g))
	return attn.CopyInto(h.host(a.O), attn.FromFloat32(attn.Float32, vals, a.O.Shape...))
}

func (h *hostDev) finish(a gpu.Accumulator, out gpu.DeviceTensor, lse *gpu.DeviceTensor) error {
	err := attn.CopyInto(h.host(out), attn.FromFloat32(out.DType, h.host(a.O).Float32s(), out.Shape...))
	if lse != nil {
		err = errors.Join(err, attn.CopyInto(h.host(*lse), h.host(*a.LSE)))
	}
	return err
}

// devHarness is what the device split's checks need beyond devOps: moving
// global tensors in and out (download waits for the work enqueued
// before), and settle, which reports through t what went wrong in the
// work enqueued so far.
type devHarness interface {
	devOps
	upload(x attn.Tensor) gpu.DeviceTensor
	download(t gpu.DeviceTensor) attn.Tensor
	settle(t *testing.T)
}

// settle has nothing to report: hostDev runs every operation at once.
func (h *hostDev) settle(*testing.T) {}

// splitPasses are the passes of a split laid out on a harness.
type splitPasses struct {
	x           *devSplit
	forward     func() error
	setBackward func(o, lse, dO gpu.DeviceTensor) error
	backward    func() error
}

// splitMaker lays the split of global inputs out on a harness.
type splitMaker func(h devHarness, st Strategy, p int, q, k, v gpu.DeviceTensor, opt attn.Options) (splitPasses, error)

// oneStream lays out the split on one stream (devSplit).
func oneStream(h devHarness, st Strategy, p int, q, k, v gpu.DeviceTensor, opt attn.Options) (splitPasses, error) {
	x, err := newDevSplit(h, st, p, q, k, v, opt)
	if err != nil {
		return splitPasses{}, err
	}
	return splitPasses{x, func() error { return x.forward(opAll) }, x.setBackward, func() error { return x.backward(opAll) }}, nil
}

// runDevSplit runs the forward and then the backward of q, k, v (global,
// contiguous) split by st over p ranks on h as mk lays it out, the
// backward from the split's own forward outputs and dO, and returns the
// outputs and gradients unsharded; then the single calls over the whole
// problem on h, the backward from their forward's outputs.
func runDevSplit(t *testing.T, h devHarness, mk splitMaker, st Strategy, p int, q, k, v, dO attn.Tensor, opt attn.Options) (split, single attn.Result, splitG, singleG attn.Gradients) {
	t.Helper()
	dq, dk, dv, ddO := h.upload(q), h.upload(k), h.upload(v), h.upload(dO)
	sp, err := mk(h, st, p, dq, dk, dv, opt)
	if err != nil {
		t.Fatal(err)
	}
	x := sp.x
	gp := x.gp
	outs := func() (o, lse, gq, gk, gv gpu.DeviceTensor) {
		o, _ = h.alloc(q.DType, gp.B, gp.N, gp.H, gp.DV)
		lse, _ = h.alloc(attn.Float32, gp.B, gp.H, gp.N)
		gq, _ = h.alloc(q.DType, q.Shape...)
		gk, _ = h.alloc(q.DType, k.Shape...)
		gv, _ = h.alloc(q.DType, v.Shape...)
		return
	}
	download := func(o, lse, gq, gk, gv gpu.DeviceTensor) (attn.Result, attn.Gradients) {
		return attn.Result{O: h.download(o), LSE: h.download(lse)}, attn.Gradients{DQ: h.download(gq), DK: h.download(gk), DV: h.download(gv)}
	}
	o, lse, gq, gk, gv := outs()
	if err := sp.forward(); err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(x.unshard(o, x.o, 1), x.unshard(lse, x.lse, 2)); err != nil {
		t.Fatal(err)
	}
	if err := sp.setBackward(o, lse, ddO); err != nil {
		t.Fatal(err)
	}
	if err := sp.backward(); err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(x.unshard(gq, x.dq, 1), x.unshard(gk, x.dk, 1), x.unshard(gv, x.dv, 1)); err != nil {
		t.Fatal(err)
	}
	split, splitG = download(o, lse, gq, gk, gv)
	o, lse, gq, gk, gv = outs()
	if err := h.forward(dq, dk, dv, o, lse, opt); err != nil {
		t.Fatal(err)
	}
	if err := h.backward(dq, dk, dv, o, lse, ddO, gq, gk, gv, opt); err != nil {
		t.Fatal(err)
	}
	single, singleG = download(o, lse, gq, gk, gv)
	return split, single, splitG, singleG
}

// devCases are the accuracy table's cases without dropout.
func devCases() []accCase { return accCasesWith(false) }

// devDropoutCases are the accuracy table's dropout cases (the split places
// each call's mask with Options.DropoutAt; key origins that are not
// multiples of 16, as theirs are not, the CUDA kernels refuse, so these run
// on the host stand-ins).
func devDropoutCases() []accCase { return accCasesWith(true) }

// accCasesWith returns the accuracy table's cases with dropout, or those
// without.
func accCasesWith(dropout bool) []accCase {
	var out []accCase
	for _, tc := range accCases {
		if (tc.opt.Dropout > 0) == dropout {
			out = append(out, tc)
		}
	}
	return out
}

// checkDevSplits runs every case of devCases in dt through the device split
// mk lays out on the harness newH makes, ring and zigzag on each number of
// ranks, and checks outputs and gradients, and those of the single calls
// on the same harness, against the float64 oracle with the accuracy
// criterion.
func checkDevSplits(t *testing.T, newH func(t *testing.T) devHarness, mk splitMaker, dts []attn.DType, ps []int) {
	checkDevSplitCases(t, devCases(), newH, mk, dts, ps)
}

// checkDevSplitCases is checkDevSplits on cases.
func checkDevSplitCases(t *testing.T, cases []accCase, newH func(t *testing.T) devHarness, mk splitMaker, dts []attn.DType, ps []int) {
	r := rand.New(rand.NewPCG(21, 22))
	for _, tc := range cases {
		for _, dt := range dts {
			q := normal(r, dt, tc.b, tc.n, tc.h, tc.dk)
			k := normal(r, dt, tc.b, tc.m, tc.hkv, tc.dk)
			v := normal(r, dt, tc.b, tc.m, tc.hkv, tc.dv)
			dO := normal(r, dt, tc.b, tc.n, tc.h, tc.dv)
			or := newOracle(t, dt, q, k, v, dO, tc.opt)
			for _, st := range []Strategy{RingStrategy, ZigzagStrategy} {
				for _, p := range ps {
					t.Run(fmt.Sprintf("%s/%v/%v/P=%d", tc.name, dt, st, p), func(t *testing.T) {
						h := newH(t)
						split, single, splitG, singleG := runDevSplit(t, h, mk, st, p, q, k, v, dO, tc.opt)
						h.settle(t)
						or.check(t, "split", dt, split, splitG)
						or.check(t, "single", dt, single, singleG)
					})
				}
			}
		}
	}
}

// TestDeviceSplitOnHost runs the device split's whole algorithm (shards
// copied at their chunks' offsets, every planned call on views of them,
// partial results merged into float32 accumulators and gradients added
// into their owners', results unsharded) over the host stand-in for the
// GPU, and checks it against the oracle: ring and zigzag, P = 1 … 4 and 6,
// causal under both alignments and not, GQA and MQA, DK ≠ DV, windows,
// softcap.
func TestDeviceSplitOnHost(t *testing.T) {
	checkDevSplits(t, func(*testing.T) devHarness { return newHostDev() }, oneStream, []attn.DType{attn.Float32, attn.BFloat16}, []int{1, 2, 3, 4, 6})
}

// TestDeviceSplitDropoutOnHost is TestDeviceSplitOnHost on the dropout
// cases (each call's mask placed in the global problem's), and the device
// ring's schedule on them over asyncDev.
func TestDeviceSplitDropoutOnHost(t *testing.T) {
	checkDevSplitCases(t, devDropoutCases(), func(*testing.T) devHarness { return newHostDev() }, oneStream, []attn.DType{attn.Float32}, []int{1, 2, 3, 4})
	seed := uint64(100)
	checkDevSplitCases(t, devDropoutCases(), func(t *testing.T) devHarness {
		seed++
		return newAsyncDev(t, true, asyncDelay, seed, -1)
	}, ringStreams, []attn.DType{attn.Float32}, []int{2, 4})
}

// recorder is a backend that records the q and k views of every call it
// passes on to the CPU backend.
type recorder struct {
	attn.Backend
	calls []hostDevCall
}

// hostCallOf returns the record of a call on host tensors q and k.
func hostCallOf(q, k attn.Tensor, opt attn.Options) hostDevCall {
	return hostDevCall{int64(q.Offset), int64(k.Offset), q.Shape[1], k.Shape[1], opt.Window}
}

func (r *recorder) Forward(q, k, v attn.Tensor, opt attn.Options) (attn.Result, error) {
	r.calls = append(r.calls, hostCallOf(q, k, opt))
	return r.Backend.Forward(q, k, v, opt)
}

func (r *recorder) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	r.calls = append(r.calls, hostCallOf(q, k, opt))
	return r.Backend.Backward(q, k, v, o, lse, dO, opt)
}

// hostRingCalls runs the host ring of st over p in-process ranks on q, k,
// v (and when backward is set the backward, from its forward's outputs
// and dO) and returns the calls each rank made, in order.
func hostRingCalls(t *testing.T, st Strategy, p int, q, k, v, dO attn.Tensor, opt attn.Options, backward bool) [][]hostDevCall {
	t.Helper()
	recs := make([]*recorder, p)
	sim := st.Sim(cpu.New(), p)
	sim.Timeout = testTimeout
	sim.wrap = func(rank int, b attn.Backend, tr Transport) (attn.Backend, Transport) {
		if recs[rank] == nil { // the forward's; the backward's calls follow
			recs[rank] = &recorder{Backend: b}
		}
		return recs[rank], tr
	}
	res, err := sim.Forward(q, k, v, opt)
	if err == nil && backward {
		_, err = sim.Backward(q, k, v, res.O, res.LSE, dO, opt)
	}
	if err != nil {
		t.Fatal(err)
	}
	out := make([][]hostDevCall, p)
	for r, rec := range recs {
		out[r] = rec.calls
	}
	return out
}

// sameCalls checks that each rank's device calls are the host ring's.
func sameCalls(t *testing.T, dev, host [][]hostDevCall) {
	t.Helper()
	for rank, want := range host {
		got := dev[rank]
		if len(got) != len(want) {
			t.Fatalf("rank %d: %d device calls, the host ring made %d", rank, len(got), len(want))
		}
		for j, c := range want {
			d := got[j]
			if c.qOff != d.qOff || c.kOff != d.kOff || c.nq != d.nq || c.nk != d.nk || fmt.Sprint(c.window) != fmt.Sprint(d.window) {
				t.Fatalf("rank %d call %d: device %+v, host ring %+v", rank, j, d, c)
			}
		}
	}
}

// TestDevicePlanMatchesRing checks that the device split makes, rank by
// rank, the very calls the host ring makes: the same query rows of the
// rank's shard, the same rows of the visiting block and the same windows,
// in the same order, for ring and zigzag on causal (both alignments),
// windowed and full problems.
func TestDevicePlanMatchesRing(t *testing.T) {
	r := rand.New(rand.NewPCG(23, 24))
	for _, tc := range devCases() {
		for _, st := range []Strategy{RingStrategy, ZigzagStrategy} {
			for _, p := range []int{2, 3, 4} {
				t.Run(fmt.Sprintf("%s/%v/P=%d", tc.name, st, p), func(t *testing.T) {
					q := normal(r, attn.Float32, tc.b, tc.n, tc.h, tc.dk)
					k := normal(r, attn.Float32, tc.b, tc.m, tc.hkv, tc.dk)
					v := normal(r, attn.Float32, tc.b, tc.m, tc.hkv, tc.dv)
					host := hostRingCalls(t, st, p, q, k, v, attn.Tensor{}, tc.opt, false)
					h := newHostDev()
					x, err := newDevSplit(h, st, p, h.upload(q), h.upload(k), h.upload(v), tc.opt)
					if err != nil {
						t.Fatal(err)
					}
					if err := x.forward(opAttention); err != nil {
						t.Fatal(err)
					}
					// the device calls, rank by rank: step-major in the plan, so each rank's in step order
					byRank := make([][]hostDevCall, p)
					i := 0
					for _, steps := range x.plan {
						for _, s := range steps {
							byRank[s.rank] = append(byRank[s.rank], h.calls[i:i+len(s.tasks)]...)
							i += len(s.tasks)
						}
					}
					if i != len(h.calls) || x.calls != i {
						t.Fatalf("%d calls recorded, %d counted, the plan has %d", len(h.calls), x.calls, i)
					}
					sameCalls(t, byRank, host)
				})
			}
		}
	}
}

// TestDeviceSplitKinds checks that a pass enqueues the attention calls
// alone, the merge kernels alone or both, as asked, and counts them: the
// forward a combine per rank; the backward three resets and three
// finishes per rank and three adds per call.
func TestDeviceSplitKinds(t *testing.T) {
	r := rand.New(rand.NewPCG(25, 26))
	const p = 4
	q := normal(r, attn.Float32, 1, 48, 2, 8)
	h := newHostDev()
	x, err := newDevSplit(h, ZigzagStrategy, p, h.upload(q), h.upload(q), h.upload(q), attn.Options{Causal: true})
	if err != nil {
		t.Fatal(err)
	}
	o, _ := h.alloc(attn.Float32, 1, 48, 2, 8)
	lse, _ := h.alloc(attn.Float32, 1, 2, 48)
	tasks := 0
	for _, steps := range x.plan {
		for _, s := range steps {
			tasks += len(s.tasks)
		}
	}
	fwd := p // the forward: a combine per rank (the slot clears go with the calls)
	for _, tc := range []struct {
		kinds           opKind
		backward        bool
		calls, launches int
	}{
		{opAll, false, tasks, fwd},
		{opAttention, false, tasks, 0},
		{opMerge, false, 0, fwd},
		{opAll, true, tasks, 6*p + 3*tasks},
		{opAttention, true, tasks, 0},
		{opMerge, true, 0, 6*p + 3*tasks},
	} {
		h.calls = nil
		pass := x.forward
		if tc.backward {
			if err := x.setBackward(o, lse, h.upload(q)); err != nil {
				t.Fatal(err)
			}
			pass = x.backward
		}
		if err := pass(tc.kinds); err != nil {
			t.Fatal(err)
		}
		if x.calls != tc.calls || x.launches != tc.launches || len(h.calls) != tc.calls {
			t.Errorf("kinds %d backward %v: %d calls (%d made), %d merge kernels; want %d, %d", tc.kinds, tc.backward, x.calls, len(h.calls), x.launches, tc.calls, tc.launches)
		}
		if !tc.backward && tc.kinds == opAll {
			if err := errors.Join(x.unshard(o, x.o, 1), x.unshard(lse, x.lse, 2)); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestDeviceSplitRefused checks what the device split refuses, with the
// sentinel each refusal wraps.
func TestDeviceSplitRefused(t *testing.T) {
	r := rand.New(rand.NewPCG(27, 28))
	h := newHostDev()
	q := h.upload(normal(r, attn.Float32, 1, 48, 2, 8))
	odd := h.upload(normal(r, attn.Float32, 1, 50, 2, 8))
	strided := q
	strided.Shape, strided.Strides = []int{1, 24, 2, 8}, []int{768, 32, 8, 1}
	cu := []int32{0, 48}
	for _, tc := range []struct {
		name    string
		st      Strategy
		p       int
		q, k, v gpu.DeviceTensor
		opt     attn.Options
		want    error
	}{
		{"a2a", AllToAllStrategy, 2, q, q, q, attn.Options{}, attn.ErrUnsupported},
		{"hybrid", HybridStrategy, 2, q, q, q, attn.Options{}, attn.ErrUnsupported},
		{"uneven", ZigzagStrategy, 4, odd, odd, odd, attn.Options{}, attn.ErrShape},
		{"packed", RingStrategy, 2, q, q, q, attn.Options{CuSeqlensQ: cu, CuSeqlensK: cu}, attn.ErrUnsupported},
		{"strided", RingStrategy, 2, strided, strided, strided, attn.Options{}, attn.ErrLayout},
		{"shapes", RingStrategy, 2, q, odd, q, attn.Options{}, attn.ErrShape},
		{"no ranks", RingStrategy, 0, q, q, q, attn.Options{}, attn.ErrOption},
	} {
		if _, err := newDevSplit(h, tc.st, tc.p, tc.q, tc.k, tc.v, tc.opt); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want an error wrapping %v", tc.name, err, tc.want)
		}
	}
	if _, err := MeasureDeviceSplit(nil, RingStrategy, 2, false, q, q, q, q, attn.Options{}, 1); !errors.Is(err, attn.ErrOption) {
		t.Errorf("no backend: %v, want ErrOption", err)
	}
	if _, err := NewDeviceRing(nil, RingStrategy, 2, q, q, q, attn.Options{}); !errors.Is(err, attn.ErrOption) {
		t.Errorf("device ring, no backend: %v, want ErrOption", err)
	}
	d := newAsyncDev(t, false, 0, 0, -1)
	for _, tc := range []struct {
		name string
		st   Strategy
		p    int
		opt  attn.Options
		want error
	}{
		{"a2a", AllToAllStrategy, 2, attn.Options{}, attn.ErrUnsupported},
		{"uneven", ZigzagStrategy, 5, attn.Options{}, attn.ErrShape},
	} {
		dq := d.upload(normal(r, attn.Float32, 1, 48, 2, 8))
		if _, err := newDevRing(d, tc.st, tc.p, dq, dq, dq, tc.opt); !errors.Is(err, tc.want) {
			t.Errorf("device ring, %s: %v, want an error wrapping %v", tc.name, err, tc.want)
		}
	}
}

// TestDeviceSplitRatios checks the ratios a measured split reports: the
// whole split and its parts timed apart over the single call, and 0 where
// the single call has no time.
func TestDeviceSplitRatios(t *testing.T) {
	for _, tc := range []struct {
		d            DeviceSplit
		ratio, parts float64
	}{
		{DeviceSplit{SingleMs: 10, AttentionMs: 10.5, MergeMs: 0.3, TotalMs: 11}, 1.1, 1.08},
		{DeviceSplit{SingleMs: 2, AttentionMs: 2, TotalMs: 2}, 1, 1},
		{DeviceSplit{AttentionMs: 1, MergeMs: 1, TotalMs: 2}, 0, 0},
	} {
		if r, p := tc.d.Ratio(), tc.d.PartsRatio(); math.Abs(r-tc.ratio) > 1e-12 || math.Abs(p-tc.parts) > 1e-12 {
			t.Errorf("%+v: ratio %v, parts %v; want %v, %v", tc.d, r, p, tc.ratio, tc.parts)
		}
	}
}
