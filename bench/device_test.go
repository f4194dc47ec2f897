package bench

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// fakeDevice is a Device whose stream is a counter: each enqueued forward
// or backward advances it by one "millisecond", and events read it.
type fakeDevice struct {
	cache      int64
	clock      float64
	live       map[*fakeTensor]bool
	events     int
	recorded   int
	resets     int
	forwards   int
	backwards  int
	failFwd    error
	uploadSeen map[float32]bool
	biasCalls  []biasCall
}

// biasCall is a forward or backward that had a bias: the shapes of the
// bias and of its gradient (nil: not asked for).
type biasCall struct {
	pass       Pass
	bias, grad []int
}

type fakeTensor struct {
	d     *fakeDevice
	t     attn.Tensor
	shape []int
}

func (t *fakeTensor) Free() error { delete(t.d.live, t); return nil }

type fakeEvent struct {
	d  *fakeDevice
	at float64
}

func (e *fakeEvent) Close() error { e.d.events--; return nil }

func newFakeDevice(cache int64) *fakeDevice {
	return &fakeDevice{cache: cache, live: map[*fakeTensor]bool{}, uploadSeen: map[float32]bool{}}
}

func (d *fakeDevice) Backend() string   { return "cuda" }
func (d *fakeDevice) Name() string      { return "Fake H200" }
func (d *fakeDevice) CacheBytes() int64 { return d.cache }
func (d *fakeDevice) Upload(t attn.Tensor) (DeviceTensor, error) {
	ft := &fakeTensor{d: d, t: t, shape: t.Shape}
	d.live[ft] = true
	d.uploadSeen[t.Load(0)] = true
	return ft, nil
}
func (d *fakeDevice) Alloc(dt attn.DType, shape ...int) (DeviceTensor, error) {
	ft := &fakeTensor{d: d, shape: shape}
	d.live[ft] = true
	return ft, nil
}

// noteBias records the shapes of a call's bias and gradient.
func (d *fakeDevice) noteBias(pass Pass, bias, dbias DeviceTensor) {
	if bias == nil {
		return
	}
	c := biasCall{pass: pass, bias: bias.(*fakeTensor).shape}
	if dbias != nil {
		c.grad = dbias.(*fakeTensor).shape
	}
	d.biasCalls = append(d.biasCalls, c)
}

func (d *fakeDevice) Forward(q, k, v, o, lse, bias DeviceTensor, opt attn.Options) error {
	if d.failFwd != nil {
		return d.failFwd
	}
	d.noteBias(Forward, bias, nil)
	d.forwards++
	d.clock++
	return nil
}
func (d *fakeDevice) Backward(q, k, v, o, lse, dO, dq, dk, dv, bias, dbias DeviceTensor, opt attn.Options) error {
	d.noteBias(Backward, bias, dbias)
	d.backwards++
	d.clock++
	return nil
}
func (d *fakeDevice) NewEvent() (Event, error) { d.events++; return &fakeEvent{d: d}, nil }
func (d *fakeDevice) Record(e Event) error     { e.(*fakeEvent).at = d.clock; d.recorded++; return nil }
func (d *fakeDevice) Reset()                   { d.resets++ }
func (d *fakeDevice) ElapsedMs(a, b Event) (float64, error) {
	return b.(*fakeEvent).at - a.(*fakeEvent).at, nil
}
func (d *fakeDevice) Sync() error                { return nil }
func (d *fakeDevice) Describe() (string, string) { return "fwd_m128", "separate" }
func (d *fakeDevice) Close() error               { return nil }

func TestDeviceRunner(t *testing.T) {
	for _, tc := range []struct {
		pass    Pass
		perRun  float64
		wantFwd bool
	}{
		{Forward, 1, true},
		{Backward, 1, false},
		{ForwardBackward, 2, true},
	} {
		t.Run(string(tc.pass), func(t *testing.T) {
			d := newFakeDevice(1 << 20)
			r := NewDeviceRunner(d)
			c := Case{Batch: 1, SeqlenQ: 64, Heads: 2, HeadDim: 32, Pass: tc.pass}
			c.Normalize()
			rec := Run(r, c, Timing{MinRepeats: 5, MaxRepeats: 5})
			if !rec.OK() || rec.MedianMs != tc.perRun || rec.MinMs != tc.perRun || rec.MaxMs != tc.perRun || rec.Repeats != 5 {
				t.Fatalf("record %+v, want %v ms per run", rec, tc.perRun)
			}
			if rec.Backend != "cuda" || rec.Device != "Fake H200" || rec.KernelVariant != "fwd_m128" || rec.DQAlgorithm != "separate" {
				t.Errorf("record names %+v", rec)
			}
			sets := RotationSets(c.Bytes(), d.cache)
			if sets < 2 {
				t.Fatalf("only %d sets: the test needs rotation", sets)
			}
			if len(d.uploadSeen) < sets {
				t.Errorf("%d distinct uploads for %d sets: the inputs do not differ", len(d.uploadSeen), sets)
			}
			if d.recorded != 2*5 || d.resets != 1 {
				t.Errorf("%d events recorded, %d resets; want 10 and 1", d.recorded, d.resets)
			}
			if len(d.live) != 0 || d.events != 0 {
				t.Errorf("%d tensors and %d events left after the case", len(d.live), d.events)
			}
			if (d.forwards > 0) != (tc.wantFwd || tc.pass == Backward) {
				t.Errorf("%d forwards", d.forwards)
			}
			if tc.pass == Backward && d.forwards != sets {
				t.Errorf("%d forwards for %d sets: want one per set before timing", d.forwards, sets)
			}
		})
	}
}

func TestDeviceRunnerBias(t *testing.T) {
	// The case's bias reaches every forward and backward, and its gradient
	// every backward that asks for it.
	for _, tc := range []struct {
		bias       string
		grad       bool
		pass       Pass
		shape      []int
		gradOfBwds bool
	}{
		{"1hnm", false, Forward, []int{1, 2, 64, 48}, false},
		{"b1nm", false, Backward, []int{3, 1, 64, 48}, false},
		{"bhnm", true, Backward, []int{3, 2, 64, 48}, true},
		{"11nm", true, ForwardBackward, []int{1, 1, 64, 48}, true},
	} {
		d := newFakeDevice(1 << 30)
		c := Case{Batch: 3, SeqlenQ: 64, SeqlenK: 48, Heads: 2, HeadDim: 32, Bias: tc.bias, BiasGrad: tc.grad, Pass: tc.pass}
		c.Normalize()
		if rec := Run(NewDeviceRunner(d), c, Timing{MinRepeats: 2, MaxRepeats: 2}); !rec.OK() {
			t.Fatalf("%v: %+v", c, rec)
		}
		count := map[Pass]int{}
		for _, call := range d.biasCalls {
			count[call.pass]++
			want := []int(nil)
			if call.pass == Backward && tc.gradOfBwds {
				want = tc.shape
			}
			if !slices.Equal(call.bias, tc.shape) || !slices.Equal(call.grad, want) {
				t.Errorf("%v: a %s call had bias %v and gradient %v, want %v and %v", c, call.pass, call.bias, call.grad, tc.shape, want)
			}
		}
		// every call had the bias (a backward's inputs come from forwards)
		if count[Forward] != d.forwards || count[Backward] != d.backwards || d.forwards == 0 || (d.backwards > 0) != (tc.pass != Forward) {
			t.Errorf("%v: %d of %d forwards and %d of %d backwards had the bias", c, count[Forward], d.forwards, count[Backward], d.backwards)
		}
		if len(d.live) != 0 {
			t.Errorf("%v: %d tensors left", c, len(d.live))
		}
	}
}

func TestDeviceRunnerUnsupported(t *testing.T) {
	d := newFakeDevice(1 << 20)
	d.failFwd = attn.Errorf(attn.ErrUnsupported, "head dim 300")
	c := Case{Batch: 1, SeqlenQ: 64, Heads: 2, HeadDim: 300, Pass: Backward}
	rec := Run(NewDeviceRunner(d), c, Timing{MinRepeats: 1, MaxRepeats: 1})
	if rec.Status != StatusUnsupported {
		t.Errorf("status %q (%s), want unsupported", rec.Status, rec.Message)
	}
	if len(d.live) != 0 {
		t.Errorf("%d tensors left after a failed prepare", len(d.live))
	}
}

func TestRandomPool(t *testing.T) {
	p := newRandomPool(1000, 1)
	rng := rand.New(rand.NewPCG(1, 2))
	for _, dt := range []attn.DType{attn.Float32, attn.Float16, attn.BFloat16} {
		x := p.tensor(rng, dt, 3, 1100) // longer than the pool: wraps around
		if err := x.CheckLayout("x"); err != nil {
			t.Fatal(err)
		}
		var sum, sq float64
		zeros := 0
		for _, v := range x.Float64s() {
			sum += v
			sq += v * v
			if v == 0 {
				zeros++
			}
		}
		n := float64(x.NumElements())
		mean, std := sum/n, math.Sqrt(sq/n-(sum/n)*(sum/n))
		if math.Abs(mean) > 0.2 || math.Abs(std-1) > 0.2 || zeros > 0 {
			t.Errorf("%v: mean %.3f std %.3f zeros %d, want standard normal values", dt, mean, std, zeros)
		}
	}
}
