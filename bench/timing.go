package bench

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/flashattn/flashattn/attn"
)

// Runner runs one implementation of attention on one device.
type Runner interface {
	// Implementation returns the name recorded for the runner's results ("flashattn").
	Implementation() string
	// Backend returns the backend's name ("cpu", "cuda").
	Backend() string
	// Device names the processor.
	Device() string
	// Prepare allocates and fills the inputs of c and returns a workload
	// ready to run. A valid case the runner cannot run fails with an error
	// wrapping attn.ErrUnsupported.
	Prepare(c Case) (Workload, error)
	// Close releases the runner's resources.
	Close() error
}

// Workload is one prepared case. Run may be asynchronous (a GPU runner
// enqueues work on a stream); Start and Stop mark the ends of one timed
// region, Sync waits for all work enqueued so far, and Elapsed then returns
// the length of every region marked since the previous Elapsed.
type Workload interface {
	// Sets returns the number of input sets Run rotates among.
	Sets() int
	// Run runs the case's pass once on input set (set mod Sets()).
	Run(set int) error
	// Start marks the beginning of a timed region.
	Start() error
	// Stop marks its end.
	Stop() error
	// Sync waits until all work issued so far is done.
	Sync() error
	// Elapsed returns the length in milliseconds of each region marked since
	// the last call, in order. Call Sync first.
	Elapsed() ([]float64, error)
	// Variant returns the kernel variant and dQ algorithm the backend used,
	// or empty strings when it does not say.
	Variant() (kernel, dq string)
	// Close releases the inputs.
	Close() error
}

// reserver is implemented by workloads that prepare the timing of n
// regions ahead (a GPU workload creates its events).
type reserver interface {
	Reserve(n int) error
}

// Timing is the measuring policy of Measure.
type Timing struct {
	// Warmup is the least time spent running before the timed repeats,
	// after the first run.
	Warmup time.Duration
	// Budget is the time the timed repeats should fill.
	Budget time.Duration
	// MinRepeats and MaxRepeats bound the number of timed repeats.
	MinRepeats, MaxRepeats int
}

// HostTiming returns the policy for host (CPU) backends: 50 ms of warm-up,
// 300 ms of repeats, between 3 and 50 of them.
func HostTiming() Timing {
	return Timing{Warmup: 50 * time.Millisecond, Budget: 300 * time.Millisecond, MinRepeats: 3, MaxRepeats: 50}
}

// DeviceTiming returns the policy for GPU backends, that of
// triton.testing.do_bench's defaults: 25 ms of warm-up, 100 ms of repeats,
// between 10 and 1000 of them.
func DeviceTiming() Timing {
	return Timing{Warmup: 25 * time.Millisecond, Budget: 100 * time.Millisecond, MinRepeats: 10, MaxRepeats: 1000}
}

// Measurement summarises the timed repeats of one measurement.
type Measurement struct {
	// Median, Min and Max are in milliseconds, over Repeats runs.
	Median, Min, Max float64
	Repeats          int
	// First is the wall-clock time of the first run in milliseconds: on a
	// GPU it includes run-time compilation and module loading.
	First float64
}

// Summarize returns the median, minimum and maximum of ms (the median of an
// even count is the mean of the middle two). ms must not be empty.
func Summarize(ms []float64) (median, min, max float64) {
	s := append([]float64(nil), ms...)
	sort.Float64s(s)
	n := len(s)
	median = s[n/2]
	if n%2 == 0 {
		median = (s[n/2-1] + s[n/2]) / 2
	}
	return median, s[0], s[n-1]
}

// Measure times w under policy t: one first run (wall clock, after a Sync),
// warm-up runs for at least t.Warmup, then a number of timed repeats chosen
// from the warm-up's mean to fill t.Budget, rotating the input sets.
func Measure(w Workload, t Timing) (Measurement, error) {
	if t.MinRepeats < 1 {
		t.MinRepeats = 1
	}
	if t.MaxRepeats < t.MinRepeats {
		t.MaxRepeats = t.MinRepeats
	}
	sets := max(w.Sets(), 1)
	var st Measurement
	t0 := time.Now()
	if err := w.Run(0); err != nil {
		return st, err
	}
	if err := w.Sync(); err != nil {
		return st, err
	}
	st.First = ms(time.Since(t0))

	// Warm-up: whole passes over the sets until Warmup has passed.
	n := 0
	t0 = time.Now()
	for n == 0 || time.Since(t0) < t.Warmup {
		for i := 0; i < sets; i++ {
			if err := w.Run(i); err != nil {
				return st, err
			}
		}
		n += sets
		if err := w.Sync(); err != nil {
			return st, err
		}
	}
	per := time.Since(t0) / time.Duration(n)
	reps := t.MaxRepeats
	if per > 0 {
		reps = int(t.Budget / per)
	}
	reps = min(max(reps, t.MinRepeats), t.MaxRepeats)
	if r, ok := w.(reserver); ok {
		if err := r.Reserve(reps); err != nil {
			return st, err
		}
	}

	for i := 0; i < reps; i++ {
		if err := w.Start(); err != nil {
			return st, err
		}
		if err := w.Run(i + 1); err != nil {
			return st, err
		}
		if err := w.Stop(); err != nil {
			return st, err
		}
	}
	if err := w.Sync(); err != nil {
		return st, err
	}
	times, err := w.Elapsed()
	if err != nil {
		return st, err
	}
	if len(times) != reps {
		return st, fmt.Errorf("bench: %d timed regions for %d repeats", len(times), reps)
	}
	st.Median, st.Min, st.Max = Summarize(times)
	st.Median, st.Min, st.Max, st.First = roundMs(st.Median), roundMs(st.Min), roundMs(st.Max), roundMs(st.First)
	st.Repeats = reps
	return st, nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// roundMs rounds milliseconds to the nanosecond, the resolution of the
// clocks behind them.
func roundMs(x float64) float64 { return math.Round(x*1e6) / 1e6 }

// DeviceCacheBytes is the last-level cache size the rotation defeats on a
// GPU: 60 MB, that of an H100/H200's L2 rounded up.
const DeviceCacheBytes = 60 << 20

// MaxSets bounds the number of input sets a workload rotates among.
const MaxSets = 64

// RotationSets returns how many input sets of setBytes each to rotate among
// so that together they exceed twice cacheBytes: at least 1, at most
// MaxSets. A cacheBytes of 0 gives 1.
func RotationSets(setBytes, cacheBytes int64) int {
	if cacheBytes <= 0 || setBytes <= 0 {
		return 1
	}
	n := (2*cacheBytes + setBytes - 1) / setBytes
	if n > MaxSets {
		n = MaxSets
	}
	if n < 1 {
		n = 1
	}
	return int(n)
}

// Run measures c with r under policy t and returns the record, whatever
// happens (a context-parallel case, CPRanks > 0, through MeasureCP with the
// runner's backend, see CPBackender): a case the runner rejects as unsupported gets status
// "unsupported", any other failure (a panic included) status "error", with
// the message.
func Run(r Runner, c Case, t Timing) (rec Record) {
	c.Normalize()
	rec = Record{Case: c, Implementation: r.Implementation(), Backend: r.Backend(), Device: r.Device()}
	defer func() {
		if p := recover(); p != nil {
			rec.Status, rec.Message = StatusError, fmt.Sprintf("panic: %v", p)
		}
	}()
	if err := c.Validate(); err != nil {
		rec.Status, rec.Message = StatusError, err.Error()
		return rec
	}
	rec.FLOPs = c.FLOPs()
	if c.CPRanks > 0 {
		return runCP(r, rec, t)
	}
	w, err := r.Prepare(c)
	if err != nil {
		rec.Status, rec.Message = statusOf(err), err.Error()
		return rec
	}
	defer w.Close()
	st, err := Measure(w, t)
	rec.KernelVariant, rec.DQAlgorithm = w.Variant()
	if err != nil {
		rec.Status, rec.Message = statusOf(err), err.Error()
		return rec
	}
	rec.Status = StatusOK
	rec.MedianMs, rec.MinMs, rec.MaxMs, rec.Repeats, rec.FirstMs = st.Median, st.Min, st.Max, st.Repeats, st.First
	if st.Median > 0 {
		rec.TFLOPs = rec.FLOPs / (st.Median * 1e-3) / 1e12
	}
	return rec
}

func statusOf(err error) string {
	if errors.Is(err, attn.ErrUnsupported) {
		return StatusUnsupported
	}
	return StatusError
}
