package gpu

import (
	"encoding/binary"
	"math"
	"testing"

	"github.com/flashattn/flashattn/kernels"
)

// tanhEmuSource evaluates tanh_approx, the bf16 kernels' softcap tanh
// (tanh.approx.f32), over an array on the emulator: its block of
// primitives is replaced by testdata/emu/fwd.h as a bf16 forward module's.
var tanhEmuSource = `typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;
#define DEV static __device__ __forceinline__
constexpr int DT = 2;   // bf16 elements
constexpr int LB = 16;  // load width (unused here)
` + kernels.PrimitivesBegin + "\n" + kernels.PrimitivesEnd + `
struct TanhParams {
  const float* x;  // [n] arguments
  float* y;        // [n] tanh_approx(x)
  int n;
  int pad;
};
__global__ void tanh_model(const TanhParams p) {
  for (int i = threadIdx.x; i < p.n; i += blockDim.x) p.y[i] = tanh_approx(p.x[i]);
}
`

// TestTanhApproxModelEmulated checks the emulator's model of
// tanh.approx.f32 under each FLASHATTN_EMU_TANH setting: over a sweep of
// arguments the relative error stays within the PTX ISA's bound 2^-11 and
// comes within 10% of it (round, toward0, away: the model is as bad as
// the bound allows), with the sign the setting gives it (toward0: never
// larger in magnitude, away: never smaller), exact stays within fp32
// rounding, and the ISA's corner cases hold in every setting (NaN, ±Inf
// to ±1, ±0, subnormals passed through).
func TestTanhApproxModelEmulated(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "forward")
	bin := emuBinary(t, tanhEmuSource, "fwd.h", emuDriver("TanhParams", []string{"x", "y"}, []string{"tanh_model"}))
	var xs []float32
	for i := -100000; i <= 100000; i++ {
		xs = append(xs, float32(i)*2e-4) // [-20, 20]
	}
	for e := -30; e <= 6; e++ {
		for f := 0; f < 64; f++ {
			xs = append(xs, float32(math.Ldexp(1+float64(f)/64, e))) // small arguments: tanh(x) ≈ x
		}
	}
	sweep := len(xs)
	sub := math.Float32frombits(0x00000400) // subnormal
	corners := []struct{ x, want float32 }{
		{float32(math.NaN()), float32(math.NaN())}, {float32(math.Inf(1)), 1}, {float32(math.Inf(-1)), -1},
		{0, 0}, {float32(math.Copysign(0, -1)), float32(math.Copysign(0, -1))}, {sub, sub}, {-sub, -sub},
	}
	for _, c := range corners {
		xs = append(xs, c.x)
	}
	bound := math.Ldexp(1, -11)
	for _, tc := range []struct {
		model       string
		maxRel      float64 // the relative error's bound
		minMax      float64 // the least maximum relative error over the sweep
		sign        int     // +1: |y| >= |tanh x| everywhere, -1: |y| <= |tanh x|, 0: either
		magnitudeLE float64 // |y| at most this
	}{
		{"round", bound, 0.9 * bound, 0, 1},
		{"toward0", bound, 0.9 * bound, -1, 1},
		{"away", bound, 0.9 * bound, 1, 1 + bound},
		{"exact", math.Ldexp(1, -24), 0, 0, 1},
	} {
		t.Run(tc.model, func(t *testing.T) {
			t.Setenv("FLASHATTN_EMU_TANH", tc.model)
			var ar emuArena
			xb := make([]byte, 4*len(xs))
			for i, x := range xs {
				binary.LittleEndian.PutUint32(xb[4*i:], math.Float32bits(x))
			}
			xa := ar.put(xb)
			ya := ar.poisoned(4 * len(xs))
			params := make([]byte, 24)
			binary.LittleEndian.PutUint64(params[0:], xa)
			binary.LittleEndian.PutUint64(params[8:], ya)
			binary.LittleEndian.PutUint32(params[16:], uint32(len(xs)))
			emuExec(t, bin, "tanh_model", params, &ar, []emuLaunch{{"tanh_model", [3]int{1, 1, 1}, 128}}, nil)
			yb := ar.at(ya, 4*len(xs))
			y := func(i int) float32 { return math.Float32frombits(binary.LittleEndian.Uint32(yb[4*i:])) }
			worst, at := 0.0, 0
			for i := 0; i < sweep; i++ {
				want, got := math.Tanh(float64(xs[i])), float64(y(i))
				if want == 0 {
					if got != 0 {
						t.Fatalf("tanh_approx(%v) = %v, want 0", xs[i], got)
					}
					continue
				}
				rel := math.Abs(got-want) / math.Abs(want)
				if rel > worst {
					worst, at = rel, i
				}
				if tc.sign < 0 && math.Abs(got) > math.Abs(want) || tc.sign > 0 && math.Abs(got) < math.Abs(want) {
					t.Fatalf("tanh_approx(%v) = %v: the wrong side of tanh = %v", xs[i], got, want)
				}
				if math.Abs(got) > tc.magnitudeLE {
					t.Fatalf("tanh_approx(%v) = %v: magnitude above %v", xs[i], got, tc.magnitudeLE)
				}
			}
			t.Logf("%s: max relative error 2^%.3f at x = %v", tc.model, math.Log2(worst), xs[at])
			if worst > tc.maxRel*(1+1e-12) || worst < tc.minMax { // (1e-12: float64 tanh and division here)
				t.Errorf("max relative error %.4g at x = %v, want in [%.4g, %.4g]", worst, xs[at], tc.minMax, tc.maxRel)
			}
			for i, c := range corners {
				got := y(sweep + i)
				same := math.Float32bits(got) == math.Float32bits(c.want) || got != got && c.want != c.want
				if !same {
					t.Errorf("tanh_approx(%v) = %v, want %v", c.x, got, c.want)
				}
			}
		})
	}
}
