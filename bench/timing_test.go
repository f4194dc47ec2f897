package bench

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/flashattn/flashattn/attn"
)

// fakeWork is a workload whose every run "takes" the given times in turn,
// recorded without a clock.
type fakeWork struct {
	sets     int
	runs     []int // the set of every run
	times    []float64
	next     float64
	elapsed  []float64
	failAt   int // fail the run with this index (1-based); 0 never
	failWith error
	sleep    time.Duration
}

func (w *fakeWork) Sets() int { return w.sets }
func (w *fakeWork) Run(set int) error {
	w.runs = append(w.runs, set%max(w.sets, 1))
	if w.failAt > 0 && len(w.runs) == w.failAt {
		return w.failWith
	}
	time.Sleep(w.sleep)
	w.next = w.times[(len(w.runs)-1)%len(w.times)]
	return nil
}
func (w *fakeWork) Start() error                { return nil }
func (w *fakeWork) Stop() error                 { w.elapsed = append(w.elapsed, w.next); return nil }
func (w *fakeWork) Sync() error                 { return nil }
func (w *fakeWork) Elapsed() ([]float64, error) { e := w.elapsed; w.elapsed = nil; return e, nil }
func (w *fakeWork) Variant() (string, string)   { return "v1", "separate" }
func (w *fakeWork) Close() error                { return nil }

func TestSummarize(t *testing.T) {
	for _, tc := range []struct {
		in            []float64
		med, min, max float64
	}{
		{[]float64{3}, 3, 3, 3},
		{[]float64{5, 1, 3}, 3, 1, 5},
		{[]float64{4, 1, 3, 2}, 2.5, 1, 4},
	} {
		med, lo, hi := Summarize(tc.in)
		if med != tc.med || lo != tc.min || hi != tc.max {
			t.Errorf("Summarize(%v) = %v, %v, %v; want %v, %v, %v", tc.in, med, lo, hi, tc.med, tc.min, tc.max)
		}
	}
}

func TestMeasure(t *testing.T) {
	for _, tc := range []struct {
		name     string
		timing   Timing
		sets     int
		wantReps int
	}{
		{"min repeats", Timing{Budget: 0, MinRepeats: 5, MaxRepeats: 9}, 1, 5},
		{"max repeats", Timing{Budget: time.Hour, MinRepeats: 1, MaxRepeats: 7}, 3, 7},
		{"fixed", Timing{Budget: time.Hour, MinRepeats: 4, MaxRepeats: 4}, 2, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := &fakeWork{sets: tc.sets, times: []float64{2, 1, 3}}
			st, err := Measure(w, tc.timing)
			if err != nil {
				t.Fatal(err)
			}
			if st.Repeats != tc.wantReps {
				t.Errorf("repeats %d, want %d", st.Repeats, tc.wantReps)
			}
			if st.Min < 1 || st.Max > 3 || st.Median < st.Min || st.Median > st.Max {
				t.Errorf("stats %+v outside the run times 1..3", st)
			}
			seen := map[int]bool{}
			for _, s := range w.runs {
				seen[s] = true
			}
			if len(seen) != tc.sets {
				t.Errorf("runs used sets %v, want all %d", seen, tc.sets)
			}
		})
	}
}

func TestMeasureWarmup(t *testing.T) {
	w := &fakeWork{sets: 1, times: []float64{1}, sleep: time.Millisecond}
	if _, err := Measure(w, Timing{Warmup: 20 * time.Millisecond, MinRepeats: 1, MaxRepeats: 1}); err != nil {
		t.Fatal(err)
	}
	// first run + at least 20 ms of 1 ms runs + 1 timed run.
	if len(w.runs) < 1+10+1 {
		t.Errorf("%d runs: the warm-up did not last", len(w.runs))
	}
}

func TestMeasureError(t *testing.T) {
	sentinel := errors.New("launch failed")
	for _, at := range []int{1, 2, 5} {
		w := &fakeWork{sets: 1, times: []float64{1}, failAt: at, failWith: sentinel}
		if _, err := Measure(w, Timing{MinRepeats: 3, MaxRepeats: 3}); !errors.Is(err, sentinel) {
			t.Errorf("failure at run %d: %v", at, err)
		}
	}
}

func TestRotationSets(t *testing.T) {
	for _, tc := range []struct {
		set, cache int64
		want       int
	}{
		{100, 0, 1},
		{200 << 20, DeviceCacheBytes, 1},
		{60 << 20, DeviceCacheBytes, 2},
		{7 << 20, DeviceCacheBytes, 18},
		{1, DeviceCacheBytes, MaxSets},
	} {
		if got := RotationSets(tc.set, tc.cache); got != tc.want {
			t.Errorf("RotationSets(%d, %d) = %d, want %d", tc.set, tc.cache, got, tc.want)
		}
	}
}

// fakeRunner prepares fakeWork, or fails as told.
type fakeRunner struct {
	prepErr error
	work    *fakeWork
	panics  bool
}

func (r *fakeRunner) Implementation() string { return Ours }
func (r *fakeRunner) Backend() string        { return "fake" }
func (r *fakeRunner) Device() string         { return "fake device" }
func (r *fakeRunner) Close() error           { return nil }
func (r *fakeRunner) Prepare(Case) (Workload, error) {
	if r.panics {
		panic("index out of range")
	}
	if r.prepErr != nil {
		return nil, r.prepErr
	}
	return r.work, nil
}

func TestRunStatus(t *testing.T) {
	c := Case{Batch: 1, SeqlenQ: 1024, Heads: 1, HeadDim: 128}
	quick := Timing{MinRepeats: 3, MaxRepeats: 3}
	for _, tc := range []struct {
		name       string
		r          Runner
		c          Case
		status     string
		msgPresent bool
	}{
		{"ok", &fakeRunner{work: &fakeWork{sets: 1, times: []float64{2}}}, c, StatusOK, false},
		{"unsupported", &fakeRunner{prepErr: attn.Errorf(attn.ErrUnsupported, "head dim 999")}, c, StatusUnsupported, true},
		{"unavailable backend", Unavailable("cuda", fmt.Errorf("no driver")), c, StatusUnsupported, true},
		{"error", &fakeRunner{prepErr: errors.New("out of memory")}, c, StatusError, true},
		{"run error", &fakeRunner{work: &fakeWork{sets: 1, times: []float64{1}, failAt: 2, failWith: attn.Errorf(attn.ErrUnsupported, "x")}}, c, StatusUnsupported, true},
		{"panic", &fakeRunner{panics: true}, c, StatusError, true},
		{"invalid case", &fakeRunner{}, Case{Batch: 1, SeqlenQ: 4, Heads: 3, KVHeads: 2, HeadDim: 8}, StatusError, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := Run(tc.r, tc.c, quick)
			if rec.Status != tc.status || (rec.Message != "") != tc.msgPresent {
				t.Fatalf("status %q message %q, want %q (message %t)", rec.Status, rec.Message, tc.status, tc.msgPresent)
			}
			if rec.Implementation != Ours || rec.Backend != tc.r.Backend() {
				t.Errorf("record names %q/%q", rec.Implementation, rec.Backend)
			}
			if rec.Status == StatusOK {
				// 4·1·1·1024·1024·128 flops in 2 ms.
				want := 4.0 * 1024 * 1024 * 128 / 2e-3 / 1e12
				if rec.MedianMs != 2 || rec.TFLOPs != want || rec.Repeats != 3 || rec.KernelVariant != "v1" || rec.DQAlgorithm != "separate" {
					t.Errorf("record %+v, want median 2 ms, %v TFLOP/s", rec, want)
				}
			}
		})
	}
}
