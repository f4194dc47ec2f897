package conformance

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
)

// oracle is a backend that returns the float64 reference rounded to the
// storage dtype: the best any backend can do. The suite must accept it.
type oracle struct{}

func (oracle) Name() string { return "oracle" }

func (oracle) Forward(q, k, v attn.Tensor, opt attn.Options) (attn.Result, error) {
	ref, err := cpu.Reference(q, k, v, opt)
	if err != nil {
		return attn.Result{}, err
	}
	return attn.Result{O: fromFloat64(q.DType, ref.O, ref.Problem.OutputShape()),
		LSE: fromFloat64(attn.Float32, ref.LSE, ref.Problem.LSEShape())}, nil
}

func (oracle) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return attn.Gradients{}, err
	}
	if err := p.CheckBackward(q, o, lse, dO); err != nil {
		return attn.Gradients{}, err
	}
	g, err := cpu.ReferenceBackward(q, k, v, dO, opt)
	if err != nil {
		return attn.Gradients{}, err
	}
	out := attn.Gradients{DQ: fromFloat64(q.DType, g.DQ, q.Shape), DK: fromFloat64(k.DType, g.DK, k.Shape),
		DV: fromFloat64(v.DType, g.DV, v.Shape)}
	if g.DBias != nil {
		db := fromFloat64(opt.Bias.Tensor.DType, g.DBias, opt.Bias.Tensor.Shape)
		out.DBias = &db
	}
	return out, nil
}

func fromFloat64(dt attn.DType, x []float64, shape []int) attn.Tensor {
	f := make([]float32, len(x))
	for i, v := range x {
		f[i] = float32(v)
	}
	return attn.FromFloat32(dt, f, shape...)
}

// TestSuiteAcceptsOracle runs the quick subset against the rounded oracle:
// the criterion must accept a result that is exact but for its final
// rounding.
func TestSuiteAcceptsOracle(t *testing.T) {
	Run(t, oracle{}, Config{Short: true})
}

// TestLayouts checks that every test layout is a valid view whose elements
// are distinct storage cells and whose gaps hold NaN.
func TestLayouts(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 1))
	for _, l := range []layout{contiguous, headsMajor, gapped} {
		for _, shape := range [][]int{{2, 3, 4, 5}, {7, 3, 2}, {1, 1, 1, 1}} {
			for _, dt := range []attn.DType{attn.Float32, attn.BFloat16} {
				x := emptyTensor(dt, l, shape...)
				if err := x.CheckLayout("x"); err != nil {
					t.Fatalf("layout %d shape %v: %v", l, shape, err)
				}
				seen := map[int]bool{}
				for idx := make([]int, len(shape)); ; {
					o := x.Index(idx...)
					if seen[o] {
						t.Fatalf("layout %d shape %v: two elements at storage %d", l, shape, o)
					}
					seen[o] = true
					d := len(idx) - 1
					for ; d >= 0; d-- {
						if idx[d]++; idx[d] < shape[d] {
							break
						}
						idx[d] = 0
					}
					if d < 0 {
						break
					}
				}
				for o := 0; o < len(x.F32)+len(x.Bits); o++ {
					if !seen[o] && l == gapped && !math.IsNaN(float64(x.Load(o))) {
						t.Fatalf("gap at storage %d holds %v, want NaN", o, x.Load(o))
					}
				}
				y := randTensor(r, dt, l, 1, shape...)
				if !y.IsFinite() {
					t.Errorf("layout %d: random tensor has non-finite elements", l)
				}
			}
		}
	}
}

// TestRandomCases checks the drawn cases: the same draw every time, unique
// names, the short subset first, 16-bit dtypes (and fp32 up to D = 128),
// and every case valid with a row that sees two keys.
func TestRandomCases(t *testing.T) {
	a, b := randomCases(20, 7, 5), randomCases(20, 7, 5)
	names := map[string]bool{}
	for i, tc := range a {
		if tc.name != b[i].name {
			t.Fatalf("case %d drawn as %q and %q", i, tc.name, b[i].name)
		}
		if names[tc.name] {
			t.Errorf("name %q twice", tc.name)
		}
		names[tc.name] = true
		want := []attn.DType{attn.Float16, attn.BFloat16}
		if max(tc.dk, tc.dv) <= 128 {
			want = append(want, attn.Float32)
		}
		if tc.short != (i < 5) || !slices.Equal(tc.dtypes, want) {
			t.Errorf("%s: short %t, dtypes %v, want %v", tc.name, tc.short, tc.dtypes, want)
		}
		if !tc.someRowSeesTwoKeys() {
			t.Errorf("%s: no row sees two keys", tc.name)
		}
	}
}
