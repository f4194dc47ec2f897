package bench

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cp"
)

// CPResult is the measured cost of splitting one case over P virtual ranks
// on one device (cp.MeasureSplit): the medians over the repeats, in
// milliseconds. The ranks run one after another, so these are the
// kernels a P-device run would spread over its devices, not its time.
type CPResult struct {
	// Scheme is ring, zigzag, a2a, hybrid or hybrid-A; Ranks is P.
	Scheme string `json:"scheme"`
	Ranks  int    `json:"ranks"`
	// SingleMs is the backend time of the whole case in one call.
	SingleMs float64 `json:"single_ms"`
	// Steps is the number of steps of the case's pass (forward and backward
	// add up); StepMs the critical path divided by them.
	Steps  int     `json:"steps"`
	StepMs float64 `json:"step_ms"`
	// CriticalMs sums, step by step, the slowest rank's backend time: the
	// compute of a P-device run whose communication is hidden; its least
	// and greatest over the repeats are CriticalMinMs and CriticalMaxMs.
	CriticalMs    float64 `json:"critical_ms"`
	CriticalMinMs float64 `json:"critical_min_ms,omitempty"`
	CriticalMaxMs float64 `json:"critical_max_ms,omitempty"`
	// Speedup is SingleMs / CriticalMs.
	Speedup float64 `json:"speedup"`
	// Calls and WorkMs are the backend calls of all steps of all ranks and
	// their total time; SplitCost is WorkMs / SingleMs, the cost of
	// splitting itself (1: none).
	Calls     int     `json:"calls"`
	WorkMs    float64 `json:"work_ms"`
	SplitCost float64 `json:"split_cost"`
	// WallMs is the wall-clock time of the whole simulated case: kernels,
	// merges, copies and in-process exchanges.
	WallMs float64 `json:"wall_ms"`
	// SentBytes is the most bytes any rank sent, in Messages messages.
	SentBytes int64 `json:"sent_bytes"`
	Messages  int   `json:"messages"`
	// Repeats is the number of measured repeats.
	Repeats int `json:"repeats"`
}

// MeasureCP measures case c split by strategy s over p virtual ranks on
// backend b (host tensors) against the same case in one call on b: one
// untimed run, then repeats until t.Budget has passed (within
// t.MinRepeats and t.MaxRepeats), reporting medians. A case the strategy
// cannot split fails with the reason (uneven shards wrap attn.ErrShape,
// the all-to-all head cap attn.ErrUnsupported).
func MeasureCP(b attn.Backend, c Case, s cp.Strategy, p int, t Timing) (CPResult, error) {
	c.Normalize()
	if err := c.Validate(); err != nil {
		return CPResult{}, err
	}
	if err := s.Check(c.SeqlenQ, c.SeqlenK, c.KVHeads, p); err != nil {
		return CPResult{}, err
	}
	dt, _ := c.DTypeValue()
	opt := c.Options()
	rng := rand.New(rand.NewPCG(caseSeed(c), 2))
	q := RandomTensor(rng, dt, c.Batch, c.SeqlenQ, c.Heads, c.HeadDim)
	k := RandomTensor(rng, dt, c.Batch, c.SeqlenK, c.KVHeads, c.HeadDim)
	v := RandomTensor(rng, dt, c.Batch, c.SeqlenK, c.KVHeads, c.HeadDimV)
	dO := RandomTensor(rng, dt, c.Batch, c.SeqlenQ, c.Heads, c.HeadDimV)
	res, err := b.Forward(q, k, v, opt)
	if err != nil {
		return CPResult{}, fmt.Errorf("bench: forward: %w", err)
	}
	// pass measures the case's pass split over n ranks by st.
	pass := func(st cp.Strategy, n int) (cp.Split, error) {
		var sp cp.Split
		if c.Pass != Backward {
			f, _, _, err := cp.MeasureSplit(b, st, n, false, q, k, v, attn.Tensor{}, attn.Tensor{}, attn.Tensor{}, opt)
			if err != nil {
				return sp, err
			}
			sp = f
		}
		if c.Pass != Forward {
			g, _, _, err := cp.MeasureSplit(b, st, n, true, q, k, v, res.O, res.LSE, dO, opt)
			if err != nil {
				return sp, err
			}
			if c.Pass == Backward {
				return g, nil
			}
			sp = sp.Add(g)
		}
		return sp, nil
	}
	if _, err := pass(s, p); err != nil {
		return CPResult{}, err
	}
	var single, step, critical, work, wall []float64
	var last cp.Split
	start := time.Now()
	for n := 0; n < max(t.MinRepeats, 1) || n < t.MaxRepeats && time.Since(start) < t.Budget; n++ {
		one, err := pass(cp.RingStrategy, 1)
		if err != nil {
			return CPResult{}, err
		}
		if last, err = pass(s, p); err != nil {
			return CPResult{}, err
		}
		single = append(single, ms(one.Work))
		step = append(step, ms(last.StepTime()))
		critical = append(critical, ms(last.Critical))
		work = append(work, ms(last.Work))
		wall = append(wall, ms(last.Wall))
	}
	r := CPResult{Scheme: s.String(), Ranks: p, SingleMs: median(single), Steps: len(last.Steps), StepMs: median(step),
		CriticalMs: median(critical), Calls: last.Calls, WorkMs: median(work), WallMs: median(wall),
		SentBytes: last.MaxSent(), Repeats: len(single)}
	if i := slices.Index(last.Sent, r.SentBytes); i >= 0 {
		r.Messages = last.Messages[i]
	}
	_, lo, hi := Summarize(critical)
	r.CriticalMinMs, r.CriticalMaxMs = roundMs(lo), roundMs(hi)
	if r.CriticalMs > 0 {
		r.Speedup = r.SingleMs / r.CriticalMs
	}
	if r.SingleMs > 0 {
		r.SplitCost = r.WorkMs / r.SingleMs
	}
	return r, nil
}

// median returns the median of xs, rounded to the nanosecond.
func median(xs []float64) float64 {
	m, _, _ := Summarize(xs)
	return roundMs(m)
}

// CPBackender is a Runner that gives its backend to MeasureCP for the
// context-parallel cases of a sweep: the host runner and the CUDA device
// runner do. CPBackend fails (wrapping attn.ErrUnsupported) when the
// runner has no backend to give.
type CPBackender interface {
	CPBackend() (attn.Backend, error)
}

// CPBackend returns the runner's backend.
func (r *HostRunner) CPBackend() (attn.Backend, error) { return r.b, nil }

// CPBackend returns the device's backend, when it has one to give.
func (r *DeviceRunner) CPBackend() (attn.Backend, error) {
	if d, ok := r.d.(CPBackender); ok {
		return d.CPBackend()
	}
	return nil, attn.Errorf(attn.ErrUnsupported, "the %s device runner has no backend for context parallelism", r.d.Backend())
}

// CPBackend returns the reason the backend is unavailable.
func (u *unavailable) CPBackend() (attn.Backend, error) { return nil, u.err }

// cpMaxRepeats bounds the repeats of a context-parallel case in a sweep:
// each repeat runs the case whole twice (one call, then split).
const cpMaxRepeats = 5

// runCP fills rec, a validated context-parallel case with its FLOPs, by
// MeasureCP on r's backend under t (at most cpMaxRepeats repeats, at least
// one). The record's times are the critical path; CP holds the rest.
func runCP(r Runner, rec Record, t Timing) Record {
	c := rec.Case
	fail := func(err error) Record {
		rec.Status, rec.Message = statusOf(err), err.Error()
		return rec
	}
	br, ok := r.(CPBackender)
	if !ok {
		return fail(attn.Errorf(attn.ErrUnsupported, "runner %s cannot split cases over virtual ranks", r.Backend()))
	}
	b, err := br.CPBackend()
	if err != nil {
		return fail(err)
	}
	s, err := cp.ParseStrategy(c.CPScheme)
	if err != nil {
		return fail(err)
	}
	t.MaxRepeats = min(max(t.MaxRepeats, 1), cpMaxRepeats)
	t.MinRepeats = min(t.MinRepeats, t.MaxRepeats)
	res, err := MeasureCP(b, c, s, c.CPRanks, t)
	if err != nil {
		return fail(err)
	}
	rec.Status, rec.CP = StatusOK, &res
	rec.MedianMs, rec.MinMs, rec.MaxMs, rec.Repeats = res.CriticalMs, res.CriticalMinMs, res.CriticalMaxMs, res.Repeats
	if res.CriticalMs > 0 {
		rec.TFLOPs = rec.FLOPs / (res.CriticalMs * 1e-3) / 1e12
	}
	return rec
}

// Summary describes a context-parallel measurement in a few words: the
// split's cost over one call and the speedup with communication hidden.
func (r *CPResult) Summary() string {
	return fmt.Sprintf("%s×%d: split %.3f×, speedup %.2f×", r.Scheme, r.Ranks, r.SplitCost, r.Speedup)
}
