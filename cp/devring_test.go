package cp

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/gpu"
)

// asyncDev is streamOps on the host that behaves as a device does, for
// tests: each stream is a goroutine that runs its queue in order, sleeping
// a random time (up to maxDelay) before each operation; a record completes
// when its stream reaches it, and a wait blocks its stream's goroutine
// until the record it names has completed. The operations' arithmetic is
// hostDev's. A missing wait therefore lets a stream read a buffer before
// another has written it, or overwrite it while another reads it, and
// gives wrong results. The streams share nothing with each other but the
// tensors' elements and the records' channels (each operation gets the
// host's snapshot of the store), so under go test -race the race
// detector reports a missing wait as well.
//
// Optionally the delays are adversarial instead: operations named in
// slow sleep maxDelay each and the others not at all.
//
// asyncDev also checks the schedule itself, as it is enqueued, whatever
// the delays: vector clocks follow what happens before what (each
// stream's order, the waits, and the host, which sees a stream's work once
// it waited for it), and every pair of operations that touch overlapping
// elements of one buffer, one of them writing, must be ordered, or the
// pair is reported as a hazard. With exec unset nothing runs: only the
// schedule is checked.
type asyncDev struct {
	h        *hostDev
	exec     bool            // run the operations
	maxDelay time.Duration   // the longest sleep before an operation
	seed     uint64          // the streams' delays
	slow     map[string]bool // when set, the operations that sleep (maxDelay each)
	drop     int             // the index of a wait call to leave out (−1: none)
	streams  []*fakeStream   // [0]: the origin
	events   []*fakeRecord   // each event's last record (nil: none yet)
	waits    []waitCall      // every wait call, in order
	host     clock
	accesses map[*cuda.Buffer][]access
	hazards  []string

	mu  sync.Mutex
	err error // the first error of an operation a stream ran
}

// clock is a vector clock: component 0 counts the host's accesses,
// component i+1 the operations of stream i.
type clock []int

// at returns component i (0 beyond the clock's length).
func (c clock) at(i int) int {
	if i < len(c) {
		return c[i]
	}
	return 0
}

// join returns the componentwise maximum of c and o.
func (c clock) join(o clock) clock {
	out := make(clock, max(len(c), len(o)))
	for i := range out {
		out[i] = max(c.at(i), o.at(i))
	}
	return out
}

// covers reports whether o happened before c (o ≤ c componentwise).
func (c clock) covers(o clock) bool {
	for i := range o {
		if o[i] > c.at(i) {
			return false
		}
	}
	return true
}

// tick returns c with component i incremented.
func (c clock) tick(i int) clock {
	out := c.join(make(clock, i+1))
	out[i]++
	return out
}

// waitCall is one call of asyncDev.wait: stream s waits for event e;
// orders tells whether that ordered anything not ordered already.
type waitCall struct {
	s      streamID
	e      eventID
	orders bool
}

// fakeStream is one stream of asyncDev.
type fakeStream struct {
	clk   clock       // the clock of its last enqueued operation
	queue chan queued // its operations, run by its goroutine
	done  chan struct{}
	calls []hostDevCall // the attention calls it ran, in order
}

// queued is an operation in a stream's queue.
type queued struct {
	what string
	op   func()
}

// fakeRecord is one record of an event.
type fakeRecord struct {
	clk  clock
	done chan struct{} // closed when the stream reaches the record
}

// access is one operation's read or write of elements [lo, hi] of a
// buffer: operation n of clock component comp.
type access struct {
	lo, hi   int64
	write    bool
	comp, n  int
	what     string
	streamID int // −1: the host
}

// newAsyncDev returns an asyncDev that runs the operations (exec) with
// delays up to maxDelay seeded by seed, leaving out wait call drop (−1:
// none); its goroutines end with t.
func newAsyncDev(t *testing.T, exec bool, maxDelay time.Duration, seed uint64, drop int) *asyncDev {
	d := &asyncDev{h: newHostDev(), exec: exec, maxDelay: maxDelay, seed: seed, drop: drop, accesses: map[*cuda.Buffer][]access{}}
	d.newStream()
	t.Cleanup(func() {
		for _, s := range d.streams {
			close(s.queue)
			<-s.done
		}
	})
	return d
}

func (d *asyncDev) newStream() (streamID, error) {
	s := &fakeStream{queue: make(chan queued, 1<<16), done: make(chan struct{})}
	id := len(d.streams)
	d.streams = append(d.streams, s)
	go func() {
		defer close(s.done)
		r := rand.New(rand.NewPCG(d.seed, uint64(id)))
		for q := range s.queue {
			switch {
			case d.slow != nil && d.slow[q.what]:
				time.Sleep(d.maxDelay)
			case d.slow == nil && d.maxDelay > 0:
				time.Sleep(time.Duration(r.Int64N(int64(d.maxDelay))))
			}
			q.op()
		}
	}()
	return streamID(id), nil
}

func (d *asyncDev) newEvent() (eventID, error) {
	d.events = append(d.events, nil)
	return eventID(len(d.events) - 1), nil
}

// enqueue appends an operation to stream s's queue, reading reads and
// writing writes, after checking its accesses against the earlier ones.
// op runs on a hostDev holding the snapshot of the store of now.
func (d *asyncDev) enqueue(s streamID, what string, reads, writes []gpu.DeviceTensor, op func(h *hostDev) error) {
	st := d.streams[s]
	st.clk = st.clk.join(d.host).tick(int(s) + 1)
	d.check(st.clk, int(s)+1, int(s), what, reads, writes)
	h := &hostDev{b: d.h.b, store: d.h.store}
	d.run(st, what, func() {
		if err := op(h); err != nil {
			d.mu.Lock()
			if d.err == nil {
				d.err = fmt.Errorf("%s on stream %d: %w", what, s, err)
			}
			d.mu.Unlock()
		}
	})
}

// run queues op, named what, on st when the operations run.
func (d *asyncDev) run(st *fakeStream, what string, op func()) {
	if d.exec {
		st.queue <- queued{what, op}
	}
}

// check records the accesses of an operation with clock c (component
// comp, on stream id, −1 for the host) and reports a hazard for every
// earlier access it conflicts with that does not happen before it.
func (d *asyncDev) check(c clock, comp, id int, what string, reads, writes []gpu.DeviceTensor) {
	for i, ts := range [][]gpu.DeviceTensor{reads, writes} {
		for _, t := range ts {
			lo, hi, ok := elementSpan(t)
			if !ok {
				continue
			}
			a := access{lo: lo, hi: hi, write: i == 1, comp: comp, n: c.at(comp), what: what, streamID: id}
			for _, b := range d.accesses[t.Buf] {
				if b.hi < lo || hi < b.lo || !(a.write || b.write) || c.at(b.comp) >= b.n {
					continue
				}
				d.hazards = append(d.hazards, fmt.Sprintf("%s (stream %d, write %v) and %s (stream %d, write %v) touch elements [%d, %d] of one buffer unordered",
					b.what, b.streamID, b.write, what, id, a.write, max(lo, b.lo), min(hi, b.hi)))
			}
			d.accesses[t.Buf] = append(d.accesses[t.Buf], a)
		}
	}
}

// elementSpan returns the first and last element of t's buffer that t
// spans; ok is false for an empty tensor.
func elementSpan(t gpu.DeviceTensor) (lo, hi int64, ok bool) {
	st := t.Strides
	if st == nil {
		st = attn.ContiguousStrides(t.Shape)
	}
	lo, hi = t.Offset, t.Offset
	for i, n := range t.Shape {
		if n == 0 {
			return 0, 0, false
		}
		hi += int64(n-1) * int64(st[i])
	}
	return lo, hi, true
}

// hostAccess checks an access of the host (synchronous, in program order).
func (d *asyncDev) hostAccess(what string, reads, writes []gpu.DeviceTensor) {
	d.host = d.host.tick(0)
	d.check(d.host, 0, -1, what, reads, writes)
}

func (d *asyncDev) record(e eventID, s streamID) error {
	st := d.streams[s]
	st.clk = st.clk.join(d.host)
	r := &fakeRecord{clk: st.clk, done: make(chan struct{})}
	d.events[e] = r
	d.run(st, "record", func() { close(r.done) })
	return nil
}

func (d *asyncDev) wait(s streamID, e eventID) error {
	st := d.streams[s]
	st.clk = st.clk.join(d.host)
	r := d.events[e]
	i := len(d.waits)
	d.waits = append(d.waits, waitCall{s, e, r != nil && !st.clk.covers(r.clk)})
	if i == d.drop || r == nil {
		return nil
	}
	st.clk = st.clk.join(r.clk)
	d.run(st, "wait", func() { <-r.done })
	return nil
}

// sync waits until stream s has run everything enqueued on it; the host
// has then seen its work.
func (d *asyncDev) sync(s streamID) {
	st := d.streams[s]
	done := make(chan struct{})
	d.run(st, "sync", func() { close(done) })
	if d.exec {
		<-done
	}
	d.host = d.host.join(st.clk)
}

// on returns the operations of stream s.
func (d *asyncDev) on(s streamID) devOps { return fakeOps{d, s} }

// The devOps of asyncDev itself are those of the origin stream.

func (d *asyncDev) alloc(dt attn.DType, shape ...int) (gpu.DeviceTensor, error) {
	return fakeOps{d, 0}.alloc(dt, shape...)
}
func (d *asyncDev) copy(dst, src gpu.DeviceTensor) error { return fakeOps{d, 0}.copy(dst, src) }
func (d *asyncDev) forward(q, k, v, o, lse gpu.DeviceTensor, opt attn.Options) error {
	return fakeOps{d, 0}.forward(q, k, v, o, lse, opt)
}
func (d *asyncDev) backward(q, k, v, o, lse, dO, dq, dk, dv gpu.DeviceTensor, opt attn.Options) error {
	return fakeOps{d, 0}.backward(q, k, v, o, lse, dO, dq, dk, dv, opt)
}
func (d *asyncDev) reset(a gpu.Accumulator) error { return fakeOps{d, 0}.reset(a) }
func (d *asyncDev) combine(parts, partsLSE, o, lse gpu.DeviceTensor) error {
	return fakeOps{d, 0}.combine(parts, partsLSE, o, lse)
}
func (d *asyncDev) clearLSE(lse gpu.DeviceTensor) error { return fakeOps{d, 0}.clearLSE(lse) }
func (d *asyncDev) add(a gpu.Accumulator, r0 int, g gpu.DeviceTensor) error {
	return fakeOps{d, 0}.add(a, r0, g)
}
func (d *asyncDev) finish(a gpu.Accumulator, out gpu.DeviceTensor, lse *gpu.DeviceTensor) error {
	return fakeOps{d, 0}.finish(a, out, lse)
}

// upload returns a new tensor holding x, written by the host.
func (d *asyncDev) upload(x attn.Tensor) gpu.DeviceTensor {
	t := d.h.upload(x)
	d.hostAccess("upload", nil, []gpu.DeviceTensor{t})
	return t
}

// download waits for the origin stream and returns a copy of t.
func (d *asyncDev) download(t gpu.DeviceTensor) attn.Tensor {
	d.sync(0)
	d.hostAccess("download", []gpu.DeviceTensor{t}, nil)
	return d.h.download(t)
}

// settle waits for every stream and reports the hazards and the errors.
func (d *asyncDev) settle(t *testing.T) {
	t.Helper()
	for s := range d.streams {
		d.sync(streamID(s))
	}
	if len(d.hazards) > 0 {
		t.Errorf("%d hazards, the first: %s", len(d.hazards), d.hazards[0])
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.err != nil {
		t.Error(d.err)
	}
}

// fakeOps are the operations of one stream of asyncDev: each is checked
// and queued; its arguments are validated at once, as the GPU's are.
type fakeOps struct {
	d *asyncDev
	s streamID
}

// accumulator returns a's tensors.
func accumulator(a gpu.Accumulator) []gpu.DeviceTensor {
	if a.LSE == nil {
		return []gpu.DeviceTensor{a.O}
	}
	return []gpu.DeviceTensor{a.O, *a.LSE}
}

func (f fakeOps) alloc(dt attn.DType, shape ...int) (gpu.DeviceTensor, error) {
	t, err := f.d.h.alloc(dt, shape...)
	f.d.hostAccess("alloc", nil, []gpu.DeviceTensor{t})
	return t, err
}

func (f fakeOps) copy(dst, src gpu.DeviceTensor) error {
	if !dense(dst) || !dense(src) || !sameInts(dst.Shape, src.Shape) || dst.DType != src.DType {
		return attn.Errorf(attn.ErrLayout, "copy of %v %v into %v %v", src.DType, src.Shape, dst.DType, dst.Shape)
	}
	f.d.enqueue(f.s, "copy", []gpu.DeviceTensor{src}, []gpu.DeviceTensor{dst}, func(h *hostDev) error { return h.copy(dst, src) })
	return nil
}

func (f fakeOps) forward(q, k, v, o, lse gpu.DeviceTensor, opt attn.Options) error {
	st := f.d.streams[f.s]
	f.d.enqueue(f.s, "forward", []gpu.DeviceTensor{q, k, v}, []gpu.DeviceTensor{o, lse}, func(h *hostDev) error {
		st.calls = append(st.calls, callOf(q, k, opt))
		return h.runForward(q, k, v, o, lse, opt)
	})
	return nil
}

func (f fakeOps) backward(q, k, v, o, lse, dO, dq, dk, dv gpu.DeviceTensor, opt attn.Options) error {
	st := f.d.streams[f.s]
	f.d.enqueue(f.s, "backward", []gpu.DeviceTensor{q, k, v, o, lse, dO}, []gpu.DeviceTensor{dq, dk, dv}, func(h *hostDev) error {
		st.calls = append(st.calls, callOf(q, k, opt))
		return h.runBackward(q, k, v, o, lse, dO, dq, dk, dv, opt)
	})
	return nil
}

func (f fakeOps) reset(a gpu.Accumulator) error {
	f.d.enqueue(f.s, "reset", nil, accumulator(a), func(h *hostDev) error { return h.reset(a) })
	return nil
}

func (f fakeOps) combine(parts, partsLSE, o, lse gpu.DeviceTensor) error {
	f.d.enqueue(f.s, "combine", []gpu.DeviceTensor{parts, partsLSE}, []gpu.DeviceTensor{o, lse}, func(h *hostDev) error {
		return h.combine(parts, partsLSE, o, lse)
	})
	return nil
}

func (f fakeOps) clearLSE(lse gpu.DeviceTensor) error {
	f.d.enqueue(f.s, "clear", nil, []gpu.DeviceTensor{lse}, func(h *hostDev) error { return h.clearLSE(lse) })
	return nil
}

func (f fakeOps) add(a gpu.Accumulator, r0 int, g gpu.DeviceTensor) error {
	f.d.enqueue(f.s, "add", []gpu.DeviceTensor{g}, accumulator(a), func(h *hostDev) error { return h.add(a, r0, g) })
	return nil
}

func (f fakeOps) finish(a gpu.Accumulator, out gpu.DeviceTensor, lse *gpu.DeviceTensor) error {
	writes := []gpu.DeviceTensor{out}
	if lse != nil {
		writes = append(writes, *lse)
	}
	f.d.enqueue(f.s, "finish", accumulator(a), writes, func(h *hostDev) error { return h.finish(a, out, lse) })
	return nil
}

// ringStreams lays out the device ring on h, which must be streamOps.
func ringStreams(h devHarness, st Strategy, p int, q, k, v gpu.DeviceTensor, opt attn.Options) (splitPasses, error) {
	so, ok := h.(streamOps)
	if !ok {
		return splitPasses{}, fmt.Errorf("harness %T has no streams", h)
	}
	g, err := newDevRing(so, st, p, q, k, v, opt)
	if err != nil {
		return splitPasses{}, err
	}
	return splitPasses{g.devSplit, g.forward, g.setBackward, g.backward}, nil
}

// asyncDelay is the longest sleep of asyncDev's streams in the accuracy
// tests: long next to a small call, so that the streams' interleavings
// vary widely.
const asyncDelay = 200 * time.Microsecond

// TestDeviceRingOnAsyncHost runs the device ring (forward, then backward
// from its own outputs) on asyncDev with random delays, P = 1 … 4, ring
// and zigzag, on the device split's cases (causal under both alignments
// and not, GQA and MQA, DK ≠ DV, windows, softcap) in float32 and
// bfloat16, checks outputs and gradients against the float64 oracle with
// the accuracy criterion, and checks that the schedule has no hazard.
func TestDeviceRingOnAsyncHost(t *testing.T) {
	seed := uint64(0)
	checkDevSplits(t, func(t *testing.T) devHarness {
		seed++
		return newAsyncDev(t, true, asyncDelay, seed, -1)
	}, ringStreams, []attn.DType{attn.Float32, attn.BFloat16}, []int{1, 2, 3, 4})
}

// ringSchedule lays out the device ring of tc's shapes on d and enqueues
// its forward, its backward and the unsharding of its results, each read
// back by the host.
func ringSchedule(t *testing.T, d *asyncDev, tc accCase, st Strategy, p int) *devRing {
	t.Helper()
	r := rand.New(rand.NewPCG(31, 32))
	q := d.upload(normal(r, attn.Float32, tc.b, tc.n, tc.h, tc.dk))
	k := d.upload(normal(r, attn.Float32, tc.b, tc.m, tc.hkv, tc.dk))
	v := d.upload(normal(r, attn.Float32, tc.b, tc.m, tc.hkv, tc.dv))
	dO := d.upload(normal(r, attn.Float32, tc.b, tc.n, tc.h, tc.dv))
	g, err := newDevRing(d, st, p, q, k, v, tc.opt)
	if err != nil {
		t.Fatal(err)
	}
	o, _ := d.alloc(attn.Float32, tc.b, tc.n, tc.h, tc.dv)
	lse, _ := d.alloc(attn.Float32, tc.b, tc.h, tc.n)
	steps := []func() error{g.forward, func() error { return g.unshard(o, g.o, 1) }, func() error { return g.unshard(lse, g.lse, 2) },
		func() error { return g.setBackward(o, lse, dO) }, g.backward}
	for i, out := range []gpu.DeviceTensor{q, k, v} {
		steps = append(steps, func() error { return g.unshard(out, [][]gpu.DeviceTensor{g.dq, g.dk, g.dv}[i], 1) })
	}
	for _, step := range steps {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	for _, out := range []gpu.DeviceTensor{o, lse, q, k, v} {
		d.download(out)
	}
	return g
}

// TestDeviceRingWaitsNeeded checks the device ring's events against the
// schedule checker of asyncDev, without running anything: the full
// schedule (forward, backward, results read back) has no hazard, and
// leaving out any one wait that orders something not ordered already
// makes one, for ring and zigzag, causal and not, P = 2 … 4. So every
// such wait is needed, and none is missing as far as the checker sees.
func TestDeviceRingWaitsNeeded(t *testing.T) {
	cases := []accCase{devCases()[0], devCases()[2]} // full; causal, N < M, DK ≠ DV
	for _, tc := range cases {
		for _, st := range []Strategy{RingStrategy, ZigzagStrategy} {
			for _, p := range []int{2, 3, 4} {
				t.Run(fmt.Sprintf("%s/%v/P=%d", tc.name, st, p), func(t *testing.T) {
					d := newAsyncDev(t, false, 0, 0, -1)
					ringSchedule(t, d, tc, st, p)
					if len(d.hazards) > 0 {
						t.Fatalf("%d hazards, the first: %s", len(d.hazards), d.hazards[0])
					}
					needed := 0
					for i, w := range d.waits {
						if !w.orders {
							continue
						}
						needed++
						dropped := newAsyncDev(t, false, 0, 0, i)
						ringSchedule(t, dropped, tc, st, p)
						if len(dropped.hazards) == 0 {
							t.Errorf("wait %d of %d (stream %d, event %d) left out: no hazard", i, len(d.waits), w.s, w.e)
						}
					}
					t.Logf("%d waits, %d of them ordering something new, each needed", len(d.waits), needed)
				})
			}
		}
	}
}

// TestDeviceRingMissingWaitFails shows that asyncDev turns a missing wait
// into wrong results. Two waits of the zigzag ring over 4 ranks are left
// out in turn, each under the delays that expose it: the wait of rank 0's
// compute stream for the K/V block of step 1, with slow copies (its calls
// then read the buffer before the copy lands), and the wait of rank 0's
// communication stream for its step 1 calls before it copies the block
// of step 3 over the buffer they read, with slow attention calls. With
// the wait the results meet the accuracy criterion in every run; without
// it they fail it within a few runs.
func TestDeviceRingMissingWaitFails(t *testing.T) {
	if raceEnabled {
		t.Skip("a wait left out races on purpose, which the race detector reports")
	}
	tc := devCases()[1] // causal, top-left, GQA
	const p, runs = 4, 3
	// the wait calls of the schedule, and the ring's streams and events
	d := newAsyncDev(t, false, 0, 0, -1)
	g := ringSchedule(t, d, tc, ZigzagStrategy, p)
	r := rand.New(rand.NewPCG(33, 34))
	dt := attn.Float32
	q := normal(r, dt, tc.b, tc.n, tc.h, tc.dk)
	k := normal(r, dt, tc.b, tc.m, tc.hkv, tc.dk)
	v := normal(r, dt, tc.b, tc.m, tc.hkv, tc.dv)
	dO := normal(r, dt, tc.b, tc.n, tc.h, tc.dv)
	or := newOracle(t, dt, q, k, v, dO, tc.opt)
	for _, c := range []struct {
		name string
		s    streamID
		ev   evKey
		slow []string
	}{
		{"compute waits for K/V", g.cs[0], evKey{evKVLanded, 0, 1}, []string{"copy"}},
		{"copy waits for the calls", g.ms[0], evKey{evComputed, 0, 1}, []string{"forward", "backward"}},
	} {
		drop := -1
		for i, w := range d.waits {
			if w.s == c.s && w.e == g.events[c.ev] {
				drop = i
				break
			}
		}
		if drop < 0 {
			t.Fatalf("%s: no such wait", c.name)
		}
		slow := map[string]bool{}
		for _, s := range c.slow {
			slow[s] = true
		}
		for _, missing := range []bool{false, true} {
			var errs []error
			for run := range runs {
				h := newAsyncDev(t, true, 2*time.Millisecond, uint64(run+1), -1)
				h.slow = slow
				if missing {
					h.drop = drop
				}
				split, _, splitG, _ := runDevSplit(t, h, ringStreams, ZigzagStrategy, p, q, k, v, dO, tc.opt)
				if !missing {
					h.settle(t)
				} else if len(h.hazards) == 0 {
					t.Errorf("%s left out (wait %d): the schedule checker found no hazard", c.name, drop)
				}
				if err := or.errs("ring", dt, split, splitG); err != nil {
					errs = append(errs, err)
					if missing {
						break
					}
				}
			}
			switch {
			case !missing && len(errs) > 0:
				t.Errorf("%s, every wait: %d of %d runs wrong: %v", c.name, len(errs), runs, errs[0])
			case missing && len(errs) == 0:
				t.Errorf("%s left out (wait %d): %d runs all right", c.name, drop, runs)
			case missing:
				t.Logf("%s left out (wait %d): %v", c.name, drop, errs[0])
			}
		}
	}
}

// TestDeviceRingCallsMatchRing checks that the device ring makes, rank by
// rank on the rank's compute stream, the very calls the host ring makes,
// forward then backward: the same query rows of the rank's shard, the
// same rows of the block it holds and the same windows, in the same
// order, for ring and zigzag, P = 1 … 4, on the device split's cases.
func TestDeviceRingCallsMatchRing(t *testing.T) {
	r := rand.New(rand.NewPCG(35, 36))
	for _, tc := range devCases() {
		for _, st := range []Strategy{RingStrategy, ZigzagStrategy} {
			for _, p := range []int{1, 2, 3, 4} {
				t.Run(fmt.Sprintf("%s/%v/P=%d", tc.name, st, p), func(t *testing.T) {
					q := normal(r, attn.Float32, tc.b, tc.n, tc.h, tc.dk)
					k := normal(r, attn.Float32, tc.b, tc.m, tc.hkv, tc.dk)
					v := normal(r, attn.Float32, tc.b, tc.m, tc.hkv, tc.dv)
					dO := normal(r, attn.Float32, tc.b, tc.n, tc.h, tc.dv)
					host := hostRingCalls(t, st, p, q, k, v, dO, tc.opt, true)
					d := newAsyncDev(t, true, 0, 0, -1)
					g, err := newDevRing(d, st, p, d.upload(q), d.upload(k), d.upload(v), tc.opt)
					if err != nil {
						t.Fatal(err)
					}
					o, _ := d.alloc(attn.Float32, tc.b, tc.n, tc.h, tc.dv)
					lse, _ := d.alloc(attn.Float32, tc.b, tc.h, tc.n)
					for _, step := range []func() error{g.forward, func() error { return g.unshard(o, g.o, 1) },
						func() error { return g.unshard(lse, g.lse, 2) }, func() error { return g.setBackward(o, lse, d.upload(dO)) }, g.backward} {
						if err := step(); err != nil {
							t.Fatal(err)
						}
					}
					d.settle(t)
					dev := make([][]hostDevCall, p)
					for rank, s := range g.cs {
						dev[rank] = d.streams[s].calls
					}
					sameCalls(t, dev, host)
				})
			}
		}
	}
}

// TestDeviceRingMisuse checks the device ring's own guards: a backward
// before setBackward fails with attn.ErrOption, and a wait for an event
// not recorded in the pass (which a CUDA graph capture could not follow)
// fails instead of being enqueued.
func TestDeviceRingMisuse(t *testing.T) {
	r := rand.New(rand.NewPCG(41, 42))
	d := newAsyncDev(t, false, 0, 0, -1)
	q := d.upload(normal(r, attn.Float32, 1, 48, 2, 8))
	g, err := newDevRing(d, ZigzagStrategy, 2, q, q, q, attn.Options{Causal: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := g.backward(); !errors.Is(err, attn.ErrOption) {
		t.Errorf("backward before setBackward: %v, want ErrOption", err)
	}
	if err := g.forward(); err != nil {
		t.Fatal(err)
	}
	g.recorded = map[eventID]bool{} // a new pass
	waits := len(d.waits)
	if err := g.await(g.cs[0], evKey{evKVLanded, 0, 1}); err == nil || len(d.waits) != waits {
		t.Errorf("a wait for an event of the last pass: %v, %d waits enqueued", err, len(d.waits)-waits)
	}
}
