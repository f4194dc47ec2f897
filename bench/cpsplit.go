package bench

import (
	"fmt"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cp"
	"github.com/flashattn/flashattn/gpu"
)

// CPSplitResult is the cost of splitting one pass of a case over P
// virtual ranks on one GPU, everything on the device (cp.DeviceSplit):
// medians over the repeats, in milliseconds.
type CPSplitResult struct {
	// Scheme is ring or zigzag; Ranks is P; Pass is fwd or bwd.
	Scheme string `json:"scheme"`
	Ranks  int    `json:"ranks"`
	Pass   Pass   `json:"pass"`
	// SingleMs is the single call over the whole case.
	SingleMs float64 `json:"single_ms"`
	// AttentionMs is every rank's step calls, MergeMs the merge kernels,
	// TotalMs both in their order: the sum of the per-step kernels.
	AttentionMs float64 `json:"attention_ms"`
	MergeMs     float64 `json:"merge_ms"`
	TotalMs     float64 `json:"total_ms"`
	// Ratio is TotalMs / SingleMs, the cost of splitting (1: none);
	// PartsRatio is (AttentionMs + MergeMs) / SingleMs, the same with the
	// calls and the merge kernels timed apart.
	Ratio      float64 `json:"ratio"`
	PartsRatio float64 `json:"parts_ratio"`
	// RingMs is the split as cp.DeviceRing runs it: every rank's calls on
	// its compute stream while its communication stream copies the next
	// K/V block (and dK/dV), all ranks at once on the one GPU;
	// RingStepMs is RingMs / P², one rank's step were that work spread
	// over P GPUs (cp.DeviceSplit.RingStepMs).
	RingMs     float64 `json:"ring_ms"`
	RingStepMs float64 `json:"ring_step_ms"`
	// Calls and Merges count the attention calls and merge kernels.
	Calls  int `json:"calls"`
	Merges int `json:"merges"`
	// Repeats is the number of timed replays.
	Repeats int `json:"repeats"`
}

// CPSplitRepeats is the number of timed replays MeasureCPSplit makes of
// each graph when the caller gives none.
const CPSplitRepeats = 5

// MeasureCPSplit measures the cost of splitting case c over each number of
// virtual ranks of ps by strategy s (ring or zigzag) on the first GPU,
// device-resident (cp.MeasureDeviceSplit, the device ring's time
// included): the inputs are filled on the
// device (gpu.Backend.FillRandom) and every pass of the case (fwd, bwd or
// both) is measured for each P, repeats replays each (0:
// CPSplitRepeats). It fails where no GPU works (wrapping cuda.ErrNoDriver
// or cuda.ErrNoDevice) and for cases the device split does not take.
func MeasureCPSplit(c Case, s cp.Strategy, ps []int, repeats int) ([]CPSplitResult, error) {
	c.Normalize()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	for _, p := range ps {
		if err := s.Check(c.SeqlenQ, c.SeqlenK, c.KVHeads, p); err != nil {
			return nil, err
		}
	}
	if repeats <= 0 {
		repeats = CPSplitRepeats
	}
	b, err := gpu.Open()
	if err != nil {
		return nil, err
	}
	defer b.Close()
	b.Speculate = false // compiling other dtypes on spare cores would compete with the timed replays
	dt, _ := c.DTypeValue()
	seed := caseSeed(c)
	var ins []gpu.DeviceTensor
	defer func() {
		for _, t := range ins {
			t.Free()
		}
	}()
	for i, shape := range [][]int{{c.Batch, c.SeqlenQ, c.Heads, c.HeadDim}, {c.Batch, c.SeqlenK, c.KVHeads, c.HeadDim},
		{c.Batch, c.SeqlenK, c.KVHeads, c.HeadDimV}, {c.Batch, c.SeqlenQ, c.Heads, c.HeadDimV}} {
		t, err := gpu.NewDeviceTensor(b.Device(), dt, shape...)
		if err != nil {
			return nil, fmt.Errorf("bench: %w", err)
		}
		ins = append(ins, t)
		if err := b.FillRandom(nil, t, seed+uint64(i)); err != nil {
			return nil, fmt.Errorf("bench: %w", err)
		}
	}
	if err := b.Device().Synchronize(); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	var passes []Pass
	if c.Pass != Backward {
		passes = append(passes, Forward)
	}
	if c.Pass != Forward {
		passes = append(passes, Backward)
	}
	var out []CPSplitResult
	for _, p := range ps {
		for _, pass := range passes {
			d, err := cp.MeasureDeviceSplit(b, s, p, pass == Backward, ins[0], ins[1], ins[2], ins[3], c.Options(), repeats)
			if err != nil {
				return out, fmt.Errorf("bench: %v over %d ranks, %s: %w", s, p, pass, err)
			}
			out = append(out, CPSplitResult{Scheme: s.String(), Ranks: p, Pass: pass, SingleMs: roundMs(d.SingleMs),
				AttentionMs: roundMs(d.AttentionMs), MergeMs: roundMs(d.MergeMs), TotalMs: roundMs(d.TotalMs),
				Ratio: d.Ratio(), PartsRatio: d.PartsRatio(), RingMs: roundMs(d.RingMs), RingStepMs: roundMs(d.RingStepMs()), Calls: d.Calls, Merges: d.Merges, Repeats: d.Repeats})
		}
	}
	return out, nil
}

// SplitStrategy returns the strategy of a device split named by scheme:
// "" picks zigzag for a causal case and ring otherwise; ring and zigzag
// are themselves; anything else fails with an error wrapping
// attn.ErrUnsupported (or attn.ErrOption for a name that is no scheme).
func SplitStrategy(scheme string, causal bool) (cp.Strategy, error) {
	if scheme == "" {
		return cp.Default(causal), nil
	}
	s, err := cp.ParseStrategy(scheme)
	if err != nil {
		return s, err
	}
	if s != cp.RingStrategy && s != cp.ZigzagStrategy {
		return s, attn.Errorf(attn.ErrUnsupported, "%s: the device split runs ring and zigzag", scheme)
	}
	return s, nil
}
