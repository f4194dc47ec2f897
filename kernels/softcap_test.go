package kernels

import (
	"regexp"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// softcapCall matches a softcap's tanh call on a score (forward: t or s,
// backward: s) and captures the function's name.
var softcapCall = regexp.MustCompile(`(\w+)\([st] \* p\.softcap_in\)`)

// TestSoftcapTanh checks that every kernel applying a softcap (the forward's
// main loop and non-finite fix-up, the backward's P recomputation and its
// non-finite pairs; mma.sync, Hopper, Hopper with tensor maps and warp
// specialization) calls the same tanh for one element type: the hardware
// approximation, defined once inside the primitives block, for bf16, and
// tanhf for fp16 and fp32, so that the backward's recomputed P is taken
// with the tanh of the forward that produced the LSE.
func TestSoftcapTanh(t *testing.T) {
	softcap := func(v *Variant) { v.Softcap, v.Mask = true, MaskWindow }
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float16, attn.Float32} {
		want, other := "tanhf", tanhApprox
		if dt == attn.BFloat16 {
			want, other = tanhApprox, "tanhf"
		}
		if got := softcapTanh(dt); got != want {
			t.Errorf("softcapTanh(%v) = %s, want %s", dt, got, want)
		}
		type module struct {
			name string
			src  func() (string, error)
		}
		fwd := fwdVariant(t, dt, 64, 64, 16, softcap)
		bwd := BwdVariant{DType: dt, DK: 64, DV: 64, Features: Features{Mask: MaskWindow, Softcap: true, Dropout: true}, Vector: true}
		ms := []module{{"forward " + fwd.Name(), fwd.Source}, {"backward " + bwd.Name(), bwd.Source}}
		if dt != attn.Float32 {
			h := hopperVariant(t, dt, 128, 128, softcap)
			ws := h
			ws.TMA, ws.WarpSpecialized, ws.PingPong = true, true, true
			hb := BwdVariant{DType: dt, DK: 128, DV: 128, Features: Features{Softcap: true, Bias: BiasF32}, Vector: true, AtomicDQ: true, BiasGrad: true, WGMMA: true, TMA: true}
			ms = append(ms, module{"forward " + h.Name(), h.Source}, module{"forward " + ws.Name(), ws.Source}, module{"backward " + hb.Name(), hb.Source})
		}
		for _, m := range ms {
			src, err := m.src()
			if err != nil {
				t.Fatalf("%s: %v", m.name, err)
			}
			calls := softcapCall.FindAllStringSubmatch(src, -1)
			if len(calls) < 2 {
				t.Errorf("%s: %d softcap calls, want the main loop's and the non-finite path's", m.name, len(calls))
			}
			for _, c := range calls {
				if c[1] != want {
					t.Errorf("%s: softcap by %s, want %s", m.name, c[0], want)
				}
			}
			if strings.Contains(src, other+"(") {
				t.Errorf("%s: source calls %s, want only %s", m.name, other, want)
			}
			n := strings.Count(src, "tanh.approx.f32")
			i, j := strings.Index(src, PrimitivesBegin), strings.Index(src, PrimitivesEnd)
			inBlock := i >= 0 && j > i && strings.Contains(src[i:j], "tanh.approx.f32")
			if wantApprox := want == tanhApprox; (n == 1 && inBlock) != wantApprox || (!wantApprox && n != 0) {
				t.Errorf("%s: tanh.approx.f32 %d times (in the first primitives block: %v), want it once there: %v", m.name, n, inBlock, wantApprox)
			}
		}
	}
}

// TestCompileSoftcap compiles bf16 softcap kernels, which take the
// hardware tanh, for sm_90a with NVRTC (12.0 or later; skipped otherwise):
// the mma.sync forward, the Hopper forward lockstep and with ping-pong, and
// the Hopper backward with tensor maps, and fails on spills and serialized
// products as TestCompileHopper and TestBwdCompileHopper do. (The mma.sync
// backward's dK/dV kernel spills with softcap whichever the tanh:
// docs/kernels/backward.md, "Softcap's tanh".)
func TestCompileSoftcap(t *testing.T) {
	c := compilerOrSkip(t)
	if major, _ := c.Version(); major < 12 {
		t.Skipf("NVRTC %s cannot target sm_90a", c.VersionString())
	}
	softcap := func(v *Variant) { v.Softcap, v.Mask = true, MaskWindow }
	pp := hopperVariant(t, attn.BFloat16, 128, 128, softcap)
	pp.TMA, pp.WarpSpecialized, pp.PingPong, pp.EarlyRescale = true, true, true, true
	fwd := []Variant{fwdVariant(t, attn.BFloat16, 128, 128, 16, softcap), hopperVariant(t, attn.BFloat16, 128, 128, softcap), pp}
	checkHopperCompiles(t, c, fwd)
	checkBwdHopperCompiles(t, c, []BwdVariant{
		{DType: attn.BFloat16, DK: 128, DV: 128, Features: Features{Mask: MaskWindow, Softcap: true}, Vector: true, AtomicDQ: true, WGMMA: true, TMA: true},
		{DType: attn.BFloat16, DK: 64, DV: 64, Features: Features{Softcap: true}, Vector: true, WGMMA: true, TMA: true},
	})
}
