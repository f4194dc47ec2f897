package cpu

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/internal/vec"
)

// TestSoftcapRow checks softcapRow against math.Tanh, on every vector
// implementation: scores across the ranges of both formulas and their
// boundary, zero, tiny and huge scores, ±Inf and NaN.
func TestSoftcapRow(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	const softcap = 30
	x := []float32{0, 1e-30, -1e-30, 1e-6, softcap / 4, softcap/4 - 1e-5, -softcap / 4, softcap * 0.999, 300, -3000, 1e30,
		float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN())}
	for range 4000 {
		x = append(x, float32(r.NormFloat64()*math.Pow(10, r.Float64()*4-2)))
	}
	impl := vec.Implementation()
	defer vec.Use(impl)
	for _, name := range vec.Implementations() {
		if err := vec.Use(name); err != nil {
			t.Fatal(err)
		}
		worst := 0.0
		got, th := append([]float32(nil), x...), make([]float32, len(x))
		softcapRow(got, th, softcap)
		for i, v := range x {
			want := math.Tanh(float64(v) / softcap)
			if math.IsNaN(float64(v)) {
				if !math.IsNaN(float64(th[i])) || !math.IsNaN(float64(got[i])) {
					t.Errorf("%s: NaN gives tanh %v, score %v", name, th[i], got[i])
				}
				continue
			}
			// a few float32 roundings of tanh, and of a tanh below 2⁻¹²⁶ (subnormal) in absolute terms
			if d := math.Abs(float64(th[i]) - want); d > 3e-7*math.Abs(want)+1e-37 {
				t.Errorf("%s: tanh(%v/%v) = %v, want %v (error %.3g relative)", name, v, softcap, th[i], want, d/math.Abs(want))
			}
			if e := math.Abs(float64(th[i])-want) / math.Max(math.Abs(want), 1e-300); e > worst {
				worst = e
			}
			if got[i] != softcap*th[i] {
				t.Errorf("%s: score %v, want softcap·tanh = %v", name, got[i], softcap*th[i])
			}
		}
		t.Logf("%s: worst relative error %.3g", name, worst)
		// rows whose scores all take the series (no exponentials), and the same with a NaN
		for _, row := range [][]float32{{0.5, -7, 7.4, 1e-20}, {0.5, float32(math.NaN()), -7}} {
			got, th := append([]float32(nil), row...), make([]float32, len(row))
			softcapRow(got, th, softcap)
			for i, v := range row {
				want := math.Tanh(float64(v) / softcap)
				if math.IsNaN(want) != math.IsNaN(float64(th[i])) || math.Abs(float64(th[i])-want) > 3e-7*math.Abs(want) {
					t.Errorf("%s: row %v: tanh(%v/%v) = %v, want %v", name, row, v, softcap, th[i], want)
				}
			}
		}
	}
}
