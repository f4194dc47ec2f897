package cpu

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// gridTensor returns an fp32 tensor whose values are multiples of 2^-6 in
// [-2, 2], so that adding or subtracting the finite-difference step 2^-14 is exact.
func gridTensor(r *rand.Rand, shape ...int) attn.Tensor {
	t := attn.New(attn.Float32, shape...)
	for i := range t.F32 {
		t.F32[i] = float32(r.IntN(257)-128) / 64
	}
	return t
}

// gridInputs returns q [b, n, h, dk], k [b, m, hkv, dk], v [b, m, hkv, dv]
// and dO [b, n, h, dv] of grid values, drawn from r in that order.
func gridInputs(r *rand.Rand, b, n, m, h, hkv, dk, dv int) (q, k, v, dO attn.Tensor) {
	q = gridTensor(r, b, n, h, dk)
	k = gridTensor(r, b, m, hkv, dk)
	v = gridTensor(r, b, m, hkv, dv)
	dO = gridTensor(r, b, n, h, dv)
	return q, k, v, dO
}

func dot(a, b []float64) float64 {
	var s float64
	for i := range a {
		s += a[i] * b[i]
	}
	return s
}

// TestReferenceGradientsFiniteDifference checks ReferenceBackward against
// central differences of L = Σ O∘dO, computed with Reference.
func TestReferenceGradientsFiniteDifference(t *testing.T) {
	const step = 1.0 / (1 << 14)
	tests := []struct {
		name          string
		b, n, m, h, g int // g: query heads per key head
		dk, dv        int
		opt           func(r *rand.Rand) attn.Options
	}{
		{"plain", 1, 3, 4, 2, 1, 3, 2, func(*rand.Rand) attn.Options { return attn.Options{} }},
		{"softcap+bias", 2, 3, 5, 2, 2, 4, 3, func(r *rand.Rand) attn.Options {
			return attn.Options{Softcap: 1.5, Scale: 0.7, Bias: &attn.Bias{Tensor: gridTensor(r, 2, 1, 3, 5), RequiresGrad: true}}
		}},
		{"causal+bias-broadcast-batch", 2, 4, 3, 3, 3, 2, 2, func(r *rand.Rand) attn.Options {
			return attn.Options{Causal: true, Align: attn.AlignTopLeft, Bias: &attn.Bias{Tensor: gridTensor(r, 1, 3, 4, 3), RequiresGrad: true}}
		}},
		{"masked-rows+softcap+dropout", 1, 5, 3, 2, 1, 3, 4, func(*rand.Rand) attn.Options {
			return attn.Options{Causal: true, Softcap: 2, Dropout: 0.3, Seed: 11, Offset: 2}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(1, 2))
			hkv := tc.h / tc.g
			q, k, v, dO := gridInputs(r, tc.b, tc.n, tc.m, tc.h, hkv, tc.dk, tc.dv)
			opt := tc.opt(r)
			g, err := ReferenceBackward(q, k, v, dO, opt)
			if err != nil {
				t.Fatal(err)
			}
			dOf := dO.Float64s()
			loss := func() float64 {
				out, err := Reference(q, k, v, opt)
				if err != nil {
					t.Fatal(err)
				}
				return dot(out.O, dOf)
			}
			check := func(name string, x []float32, grad []float64) {
				if len(grad) != len(x) {
					t.Fatalf("%s: %d gradients for %d elements", name, len(grad), len(x))
				}
				for i := range x {
					orig := x[i]
					x[i] = orig + step
					lp := loss()
					x[i] = orig - step
					lm := loss()
					x[i] = orig
					fd := (lp - lm) / (2 * step)
					if math.Abs(fd-grad[i]) > 1e-6*(1+math.Abs(fd)) {
						t.Errorf("%s[%d]: analytic %.10g, finite difference %.10g", name, i, grad[i], fd)
					}
				}
			}
			check("dQ", q.F32, g.DQ)
			check("dK", k.F32, g.DK)
			check("dV", v.F32, g.DV)
			if opt.Bias != nil {
				check("dBias", opt.Bias.Tensor.F32, g.DBias)
			} else if g.DBias != nil {
				t.Errorf("dBias = %v without a bias", g.DBias)
			}
		})
	}
}

// TestReferenceFullyMaskedRows checks that rows without a visible key give
// O = 0, LSE = -Inf and zero gradients.
func TestReferenceFullyMaskedRows(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	q, k, v, dO := gridInputs(r, 1, 5, 2, 1, 1, 2, 2)
	opt := attn.Options{Causal: true} // bottom-right: rows 0..2 see no key
	out, err := Reference(q, k, v, opt)
	if err != nil {
		t.Fatal(err)
	}
	g, err := ReferenceBackward(q, k, v, dO, opt)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 5; i++ {
		masked := i < 3
		if got := math.IsInf(out.LSE[i], -1); got != masked {
			t.Errorf("row %d: LSE %v, masked %v", i, out.LSE[i], masked)
		}
		for d := 0; d < 2; d++ {
			if masked && (out.O[i*2+d] != 0 || g.DQ[i*2+d] != 0) {
				t.Errorf("row %d: O %v, dQ %v, want 0", i, out.O[i*2+d], g.DQ[i*2+d])
			}
		}
	}
	for _, x := range append(append(append([]float64{}, out.O...), g.DQ...), g.DK...) {
		if math.IsNaN(x) {
			t.Fatal("NaN in output")
		}
	}
}

// TestReferenceUniform checks a case with a closed form: with q = 0 every
// visible key has the same probability, so O is the mean of the visible
// values and LSE = log(count).
func TestReferenceUniform(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	const n, m = 3, 4
	q := attn.New(attn.Float32, 1, n, 1, 2)
	k := gridTensor(r, 1, m, 1, 2)
	v := gridTensor(r, 1, m, 1, 1)
	out, err := Reference(q, k, v, attn.Options{Causal: true, Align: attn.AlignTopLeft})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		var mean float64
		for j := 0; j <= i; j++ {
			mean += float64(v.F32[j])
		}
		mean /= float64(i + 1)
		if math.Abs(out.O[i]-mean) > 1e-15 || math.Abs(out.LSE[i]-math.Log(float64(i+1))) > 1e-15 {
			t.Errorf("row %d: O %v LSE %v, want %v and %v", i, out.O[i], out.LSE[i], mean, math.Log(float64(i+1)))
		}
	}
}

// TestNaiveRounds checks that the naive baseline differs from the oracle by
// roughly the precision of its dtype.
func TestNaiveRounds(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	q, k, v, dO := gridInputs(r, 1, 16, 16, 2, 2, 8, 8)
	ref, err := Reference(q, k, v, attn.Options{})
	if err != nil {
		t.Fatal(err)
	}
	refG, err := ReferenceBackward(q, k, v, dO, attn.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		dt       attn.DType
		min, max float64 // bounds on the max abs error of O
	}{{attn.Float32, 1e-12, 1e-6}, {attn.Float16, 1e-6, 1e-2}, {attn.BFloat16, 1e-4, 1e-1}} {
		out, err := NaiveForward(tc.dt, q, k, v, attn.Options{})
		if err != nil {
			t.Fatal(err)
		}
		g, err := NaiveBackward(tc.dt, q, k, v, dO, attn.Options{})
		if err != nil {
			t.Fatal(err)
		}
		var e, eg float64
		for i := range out.O {
			e = max(e, math.Abs(out.O[i]-ref.O[i]))
		}
		for i := range g.DQ {
			eg = max(eg, math.Abs(g.DQ[i]-refG.DQ[i]))
		}
		if e < tc.min || e > tc.max || eg < tc.min || eg > 100*tc.max {
			t.Errorf("%v: naive error O %g dQ %g outside [%g, %g]", tc.dt, e, eg, tc.min, tc.max)
		}
	}
}

func TestReferenceErrors(t *testing.T) {
	q := attn.New(attn.Float32, 1, 2, 3, 4)
	k := attn.New(attn.Float32, 1, 2, 2, 4)
	if _, err := Reference(q, k, k, attn.Options{}); !errors.Is(err, attn.ErrShape) {
		t.Errorf("H=3, Hkv=2: err %v, want ErrShape", err)
	}
	k = attn.New(attn.Float32, 1, 2, 1, 4)
	dO := attn.New(attn.Float32, 1, 2, 3, 5)
	if _, err := ReferenceBackward(q, k, k, dO, attn.Options{}); !errors.Is(err, attn.ErrShape) {
		t.Errorf("bad dO: err %v, want ErrShape", err)
	}
	if _, err := NaiveForward(attn.DType(9), q, k, k, attn.Options{}); !errors.Is(err, attn.ErrDType) {
		t.Errorf("bad dtype: err %v, want ErrDType", err)
	}
}
