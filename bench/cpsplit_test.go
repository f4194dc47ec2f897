package bench

import (
	"errors"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cp"
)

// TestSplitStrategy checks the strategies the device split takes: the
// default for the mask, ring and zigzag; the others refused.
func TestSplitStrategy(t *testing.T) {
	for _, tc := range []struct {
		scheme string
		causal bool
		want   cp.Strategy
		err    error
	}{
		{"", true, cp.ZigzagStrategy, nil},
		{"", false, cp.RingStrategy, nil},
		{"ring", true, cp.RingStrategy, nil},
		{"zigzag", false, cp.ZigzagStrategy, nil},
		{"a2a", false, cp.Strategy{}, attn.ErrUnsupported},
		{"hybrid-2", true, cp.Strategy{}, attn.ErrUnsupported},
		{"ulysses", false, cp.Strategy{}, attn.ErrOption},
	} {
		s, err := SplitStrategy(tc.scheme, tc.causal)
		if tc.err != nil {
			if !errors.Is(err, tc.err) {
				t.Errorf("%q: %v, want an error wrapping %v", tc.scheme, err, tc.err)
			}
			continue
		}
		if err != nil || s != tc.want {
			t.Errorf("%q causal %v: %v, %v; want %v", tc.scheme, tc.causal, s, err, tc.want)
		}
	}
}

// TestMeasureCPSplitRefuses checks that a case the split cannot cut is
// refused before any device is opened.
func TestMeasureCPSplitRefuses(t *testing.T) {
	c := Case{DType: "bf16", Batch: 1, SeqlenQ: 100, Heads: 2, HeadDim: 64, Causal: true, Pass: Forward}
	if _, err := MeasureCPSplit(c, cp.ZigzagStrategy, []int{2, 8}, 1); !errors.Is(err, attn.ErrShape) {
		t.Errorf("N = 100 over 8 zigzag ranks: %v, want ErrShape", err)
	}
	c.HeadDim = 0
	if _, err := MeasureCPSplit(c, cp.RingStrategy, []int{2}, 1); err == nil {
		t.Error("an invalid case was measured")
	}
}
