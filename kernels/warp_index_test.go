package kernels

import (
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestWarpIndexSource checks where the Hopper kernels take the warp index
// broadcast from lane 0 (warpIndex): every backward and every forward but
// those with dropout or a softcap at head dims 65–128, which compute it per
// lane; and that the backward's loops over query steps carry the step's
// head and block from step to step (stepLoop) rather than dividing by the
// number of query blocks.
func TestWarpIndexSource(t *testing.T) {
	ws := Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}
	fwd := func(d int, f func(*Variant)) Variant {
		v := hopperVariant(t, attn.BFloat16, d, d, f)
		v.TMA, v.Pipeline = true, ws
		return v
	}
	uniform, perLane := "warp = "+warpIndex+";", "warp = tid >> 5;"
	for _, c := range []struct {
		name    string
		v       Variant
		uniform bool
	}{
		{"d128", fwd(128, func(*Variant) {}), true},
		{"d64 dropout", fwd(64, func(v *Variant) { v.Dropout = true }), true},
		{"d128 bias", fwd(128, func(v *Variant) { v.Bias = BiasBF16 }), true},
		{"d256 dropout", fwd(256, func(v *Variant) { v.Dropout = true }), true},
		{"d128 dropout", fwd(128, func(v *Variant) { v.Dropout = true }), false},
		{"d96 softcap", fwd(96, func(v *Variant) { v.Softcap = true }), false},
	} {
		src, err := c.v.Source()
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got := strings.Contains(src, uniform); got != c.uniform || strings.Contains(src, perLane) == c.uniform {
			t.Errorf("forward %s (%s): uniform warp index %v, want %v", c.name, c.v.Name(), got, c.uniform)
		}
	}
	vs := append(bwdHopperKeyRowsVariants(), bwdHopperWSVariants()...)
	if len(vs) < 10 {
		t.Fatalf("only %d backward variants", len(vs))
	}
	for _, v := range vs {
		src, err := v.Source()
		if err != nil {
			t.Fatalf("%s: %v", v.Name(), err)
		}
		if !strings.Contains(src, "warp = "+warpIndex+",") {
			t.Errorf("%s: no uniform warp index", v.Name())
		}
		if strings.Contains(src, "G + it / nib") || !strings.Contains(src, "if (++step_i == nib) step_i = 0, ++step_h;") {
			t.Errorf("%s: a step loop divides by nib, or none carries its coordinates", v.Name())
		}
	}
}
