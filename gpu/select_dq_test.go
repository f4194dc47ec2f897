package gpu

import (
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestSelectDQAlgorithm checks the measured table's choices and that
// Deterministic always gets the separate (bit-for-bit) algorithm.
func TestSelectDQAlgorithm(t *testing.T) {
	cases := []struct {
		name string
		p    attn.Problem
		ask  DQAlgorithm
		want DQAlgorithm
	}{
		{"d64 short", attn.Problem{N: 512, M: 512, DK: 64, DV: 64}, DQAuto, DQAtomic},
		{"d128 causal", attn.Problem{N: 4096, M: 4096, DK: 128, DV: 128, Masked: true}, DQAuto, DQAtomic},
		{"d512", attn.Problem{N: 4096, M: 4096, DK: 512, DV: 384}, DQAuto, DQAtomic},
		{"deterministic", attn.Problem{N: 4096, M: 4096, DK: 128, DV: 128, Opt: attn.Options{Deterministic: true}}, DQAuto, DQSeparate},
		{"deterministic beats an explicit atomic", attn.Problem{N: 64, M: 64, DK: 64, DV: 64, Opt: attn.Options{Deterministic: true}}, DQAtomic, DQSeparate},
		{"explicit separate", attn.Problem{N: 4096, M: 4096, DK: 64, DV: 64}, DQSeparate, DQSeparate},
	}
	for _, c := range cases {
		if got := resolveDQ(&c.p, c.ask); got != c.want {
			t.Errorf("%s: resolveDQ(%v) = %v, want %v", c.name, c.ask, got, c.want)
		}
	}
}
