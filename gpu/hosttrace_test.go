package gpu

import (
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// fakeMarks is a streamMarker whose marks lie at given stream times, and
// which can fail its n-th mark or its wait.
type fakeMarks struct {
	at       []time.Duration // stream time of mark i
	n        int
	failMark int // the mark that fails (-1: none)
	failWait error
}

func (m *fakeMarks) mark(*cuda.Stream) (int, error) {
	if m.n == m.failMark {
		return 0, errors.New("event record failed")
	}
	m.n++
	return m.n - 1, nil
}

func (m *fakeMarks) wait() error { return m.failWait }

func (m *fakeMarks) elapsed(i, j int) (time.Duration, error) { return m.at[j] - m.at[i], nil }

// fakeClock returns a clock that reads start, then advances by each step in
// turn on every later reading.
func fakeClock(steps ...time.Duration) func() time.Time {
	t := time.Unix(1000, 0)
	i := -1
	return func() time.Time {
		if i >= 0 && i < len(steps) {
			t = t.Add(steps[i])
		}
		i++
		return t
	}
}

func TestCallRecorder(t *testing.T) {
	ms := time.Millisecond
	errWait := errors.New("event wait failed")
	// One call: plan 3 ms, alloc 1 ms, a 100-byte upload (enqueue 2 ms),
	// the kernels (enqueue 1 ms), a 50-byte download (enqueue 1 ms), wait
	// 4 ms, pinned→host 2 ms, then 0.5 ms to the end. Stream marks: the
	// upload from 0 to 2 ms, the kernels 2.5–3.5 ms, the download 4–5 ms.
	run := func(r *callRecorder) {
		r.lap(HostPlan)
		r.lap(HostAlloc)
		m := r.begin(nil)
		r.end(nil, StreamToDevice, m, 100)
		r.lap(HostEnqueue)
		m = r.begin(nil)
		r.end(nil, StreamKernels, m, 0)
		r.lap(HostEnqueue)
		m = r.begin(nil)
		r.end(nil, StreamFromDevice, m, 50)
		r.lap(HostEnqueue)
		r.lap(HostWait)
		r.lap(PinnedToHost)
		r.finish()
	}
	steps := []time.Duration{3 * ms, 1 * ms, 2 * ms, 1 * ms, 1 * ms, 4 * ms, 2 * ms, ms / 2}
	at := []time.Duration{0, 2 * ms, ms * 5 / 2, ms * 7 / 2, 4 * ms, 5 * ms}
	var wantHost [NumHostPhases]time.Duration
	wantHost[HostPlan], wantHost[HostAlloc], wantHost[HostEnqueue] = 3*ms, ms, 4*ms
	wantHost[HostWait], wantHost[PinnedToHost], wantHost[HostOther] = 4*ms, 2*ms, ms/2
	cases := []struct {
		name       string
		marks      *fakeMarks
		wantStream [NumStreamPhases]time.Duration
		wantSpan   time.Duration
		wantErr    error // what StreamErr wraps; nil: no error
	}{
		{"stream times", &fakeMarks{at: at, failMark: -1},
			[NumStreamPhases]time.Duration{2 * ms, ms, ms}, 5 * ms, nil},
		{"a mark fails", &fakeMarks{at: at, failMark: 3}, [NumStreamPhases]time.Duration{}, 0, nil},
		{"the wait fails", &fakeMarks{at: at, failMark: -1, failWait: errWait}, [NumStreamPhases]time.Duration{}, 0, errWait},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tr := &HostTrace{}
			run(newCallRecorder(tr, "forward", fakeClock(steps...), c.marks))
			calls := tr.Calls()
			if len(calls) != 1 {
				t.Fatalf("%d calls recorded, want 1", len(calls))
			}
			got := calls[0]
			if got.Op != "forward" || got.Host != wantHost || got.Wall != 29*ms/2 {
				t.Errorf("op %q, wall %v, host %v; want forward, 14.5ms, %v", got.Op, got.Wall, got.Host, wantHost)
			}
			var sum time.Duration
			for _, d := range got.Host {
				sum += d
			}
			if sum != got.Wall {
				t.Errorf("the host phases add up to %v, not the wall time %v", sum, got.Wall)
			}
			if got.ToDevice != 100 || got.FromDevice != 50 {
				t.Errorf("bytes %d to the device, %d from it; want 100 and 50", got.ToDevice, got.FromDevice)
			}
			if got.Stream != c.wantStream || got.Span != c.wantSpan {
				t.Errorf("stream %v over a span of %v, want %v over %v", got.Stream, got.Span, c.wantStream, c.wantSpan)
			}
			switch {
			case c.marks.failMark < 0 && c.wantErr == nil:
				if got.StreamErr != nil || got.Idle() != ms {
					t.Errorf("stream error %v, idle %v; want none and 1ms", got.StreamErr, got.Idle())
				}
			case c.wantErr != nil:
				if !errors.Is(got.StreamErr, c.wantErr) {
					t.Errorf("stream error %v, want one wrapping %v", got.StreamErr, c.wantErr)
				}
			default:
				if got.StreamErr == nil || c.marks.n != c.marks.failMark {
					t.Errorf("stream error %v after %d marks; want an error and no mark after the failed one", got.StreamErr, c.marks.n)
				}
			}
		})
	}
}

func TestCallRecorderOff(t *testing.T) {
	// An untraced call has a nil recorder: every method does nothing.
	var r *callRecorder
	r.lap(HostPlan)
	if m := r.begin(nil); m != -1 {
		t.Errorf("begin on nil: %d", m)
	}
	r.end(nil, StreamToDevice, 0, 10)
	r.finish()
	b := &Backend{}
	if b.traceCall("forward") != nil {
		t.Fatal("a backend without a trace returned a recorder")
	}
	tr := &HostTrace{}
	b.SetHostTrace(tr)
	if b.traceCall("forward") == nil {
		t.Fatal("a backend with a trace returned no recorder")
	}
	b.SetHostTrace(nil)
	if b.traceCall("forward") != nil {
		t.Fatal("SetHostTrace(nil) left the trace on")
	}
}

func TestMedianCall(t *testing.T) {
	ms := time.Millisecond
	calls := []HostCall{
		{Op: "forward", Wall: 9 * ms}, {Op: "backward", Wall: 30 * ms}, {Op: "forward", Wall: 11 * ms},
		{Op: "forward", Wall: 10 * ms}, {Op: "backward", Wall: 20 * ms},
	}
	cases := []struct {
		op   string
		want time.Duration
		ok   bool
	}{
		{"forward", 10 * ms, true},
		{"backward", 30 * ms, true}, // the upper of two
		{"forward into", 0, false},
	}
	for _, c := range cases {
		got, ok := MedianCall(calls, c.op)
		if ok != c.ok || got.Wall != c.want || (ok && got.Op != c.op) {
			t.Errorf("MedianCall(%q) = %v %v, %v; want %v, %v", c.op, got.Op, got.Wall, ok, c.want, c.ok)
		}
	}
	tr := &HostTrace{}
	for _, c := range calls {
		tr.add(c)
	}
	if n := len(tr.Calls()); n != len(calls) {
		t.Errorf("%d calls, want %d", n, len(calls))
	}
	tr.Reset()
	if n := len(tr.Calls()); n != 0 {
		t.Errorf("%d calls after Reset", n)
	}
}

func TestPhaseNames(t *testing.T) {
	cases := []struct {
		got, want string
	}{
		{HostToPinned.String(), "host→pinned"},
		{HostOther.String(), "other"},
		{NumHostPhases.String(), "HostPhase(9)"},
		{StreamKernels.String(), "kernels"},
		{StreamPhase(-1).String(), "StreamPhase(-1)"},
	}
	for _, c := range cases {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
}

// TestHostTraceGPU traces host-path calls on the GPU: each records its
// breakdown, the host phases add up to the wall time, the bytes are the
// tensors', the stream times fit in the span, and the outputs equal the
// untraced calls'.
func TestHostTraceGPU(t *testing.T) {
	b := fwdBackend(t)
	rng := rand.New(rand.NewPCG(3, 4))
	const dt = attn.BFloat16
	// 48 MiB per input: three staging chunks each.
	q, k, v, dO := randTensor(rng, dt, 1, 2, 3072, 16, 256), randTensor(rng, dt, 1, 2, 3072, 16, 256),
		randTensor(rng, dt, 1, 2, 3072, 16, 256), randTensor(rng, dt, 1, 2, 3072, 16, 256)
	opt := attn.Options{Causal: true, Deterministic: true}
	want, wantG := hostStep(t, b, q, k, v, dO, opt)
	tr := &HostTrace{}
	b.SetHostTrace(tr)
	defer b.SetHostTrace(nil) // the backend is shared with other tests
	res, g := hostStep(t, b, q, k, v, dO, opt)
	b.SetHostTrace(nil)
	if _, err := b.Forward(q, k, v, opt); err != nil {
		t.Fatal(err)
	}
	sameStep(t, "the untraced step's", res, g, want, wantG)
	size := func(ts ...attn.Tensor) int64 {
		n := 0
		for _, x := range ts {
			n += len(x.Bytes())
		}
		return int64(n)
	}
	calls := tr.Calls()
	if len(calls) != 2 {
		t.Fatalf("%d calls recorded, want 2 (the untraced ones are not)", len(calls))
	}
	for i, c := range []struct {
		op      string
		in, out int64
	}{{"forward", size(q, k, v), size(res.O, res.LSE)}, {"backward", size(q, k, v, res.O, res.LSE, dO), size(g.DQ, g.DK, g.DV)}} {
		got := calls[i]
		t.Logf("%s: wall %v, host %v, stream %v, span %v, idle %v", got.Op, got.Wall, got.Host, got.Stream, got.Span, got.Idle())
		var sum time.Duration
		for _, d := range got.Host {
			sum += d
		}
		if got.Op != c.op || sum != got.Wall || got.ToDevice != c.in || got.FromDevice != c.out || got.StreamErr != nil {
			t.Errorf("%s: op %q, phases %v of wall %v, bytes %d in %d out (want %d, %d), stream error %v",
				c.op, got.Op, sum, got.Wall, got.ToDevice, got.FromDevice, c.in, c.out, got.StreamErr)
		}
		for p, d := range got.Stream {
			if d <= 0 {
				t.Errorf("%s: no stream time for %v", c.op, StreamPhase(p))
			}
		}
		if got.Idle() < 0 || got.Span > got.Wall {
			t.Errorf("%s: span %v, idle %v, wall %v", c.op, got.Span, got.Idle(), got.Wall)
		}
	}
}
