package flashattn

import (
	"errors"
	"math"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
)

func randomTensor(rng *rand.Rand, dt DType, shape ...int) Tensor {
	data := make([]float32, attn.NumElements(shape))
	for i := range data {
		data[i] = float32(rng.NormFloat64())
	}
	return FromFloat32(dt, data, shape...)
}

func TestOpen(t *testing.T) {
	tests := []struct {
		name    string
		want    []string // acceptable backend names
		wantErr error
	}{
		{"cpu", []string{"cpu"}, nil},
		{"auto", []string{"cpu", "cuda"}, nil},
		{"", nil, ErrOption},
		{"CPU", nil, ErrOption},
		{"gpu", nil, ErrOption},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := Open(tc.name)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("Open(%q) error %v, want %v", tc.name, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			ok := false
			for _, n := range tc.want {
				ok = ok || b.Name() == n
			}
			if !ok {
				t.Errorf("Open(%q).Name() = %q, want one of %v", tc.name, b.Name(), tc.want)
			}
		})
	}
}

// TestOpenCUDA checks that "cuda" either opens a GPU backend or says why not.
func TestOpenCUDA(t *testing.T) {
	b, err := Open("cuda")
	if err != nil {
		if b != nil {
			t.Errorf("Open(cuda) returned a backend with error %v", err)
		}
		if err.Error() == "" {
			t.Error("empty error")
		}
		t.Logf("no GPU backend here: %v", err)
		return
	}
	if b.Name() != "cuda" {
		t.Errorf("Name() = %q, want cuda", b.Name())
	}
}

// TestForwardBackwardMatchReference runs the package-level functions and
// compares them with the float64 reference.
func TestForwardBackwardMatchReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	tests := []struct {
		name          string
		b, n, m, h, g int // g: query heads per key/value head
		dk, dv        int
		opt           Options
	}{
		{"plain", 2, 5, 7, 2, 1, 8, 8, Options{}},
		{"causal gqa", 1, 9, 6, 4, 2, 16, 12, Options{Causal: true}},
		{"window top-left softcap", 1, 8, 8, 1, 1, 4, 4, Options{Window: &Window{Left: 2, Right: 1}, Align: AlignTopLeft, Softcap: 3}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			q := randomTensor(rng, Float32, tc.b, tc.n, tc.h, tc.dk)
			k := randomTensor(rng, Float32, tc.b, tc.m, tc.h/tc.g, tc.dk)
			v := randomTensor(rng, Float32, tc.b, tc.m, tc.h/tc.g, tc.dv)
			dO := randomTensor(rng, Float32, tc.b, tc.n, tc.h, tc.dv)
			res, err := Forward(q, k, v, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			ref, err := cpu.Reference(q, k, v, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			closeTo(t, "O", res.O.Float64s(), ref.O)
			closeTo(t, "LSE", res.LSE.Float64s(), ref.LSE)
			g, err := Backward(q, k, v, res.O, res.LSE, dO, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			refG, err := cpu.ReferenceBackward(q, k, v, dO, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			closeTo(t, "dQ", g.DQ.Float64s(), refG.DQ)
			closeTo(t, "dK", g.DK.Float64s(), refG.DK)
			closeTo(t, "dV", g.DV.Float64s(), refG.DV)
		})
	}
}

// closeTo fails unless got and want agree to float32 accuracy relative to
// the largest magnitude of want.
func closeTo(t *testing.T, name string, got, want []float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", name, len(got), len(want))
	}
	scale := 0.0
	for _, w := range want {
		if !math.IsInf(w, 0) {
			scale = math.Max(scale, math.Abs(w))
		}
	}
	for i := range got {
		if got[i] == want[i] {
			continue
		}
		if d := math.Abs(got[i] - want[i]); !(d <= 1e-5*math.Max(scale, 1)) {
			t.Fatalf("%s[%d] = %v, want %v", name, i, got[i], want[i])
		}
	}
}

// TestConcurrentFirstUse calls Forward from many goroutines at once, so the
// lazily opened backend is opened once and shared safely.
func TestConcurrentFirstUse(t *testing.T) {
	q := FromFloat32(Float32, []float32{1, 2, 3, 4}, 1, 2, 1, 2)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	outs := make([][]float32, 8)
	for i := range errs {
		wg.Go(func() {
			res, err := Forward(q, q, q, Options{})
			errs[i] = err
			if err == nil {
				outs[i] = res.O.Float32s()
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
		for j := range outs[i] {
			if outs[i][j] != outs[0][j] {
				t.Fatalf("goroutine %d got %v, goroutine 0 %v", i, outs[i], outs[0])
			}
		}
	}
}

func TestBadInputErrors(t *testing.T) {
	q := New(Float32, 1, 4, 2, 8)
	tests := []struct {
		name string
		k, v Tensor
		opt  Options
		want error
	}{
		{"dropout out of range", q, q, Options{Dropout: 1}, ErrOption},
		{"scale NaN", q, q, Options{Scale: math.NaN()}, ErrOption},
		{"dtype mismatch", New(Float16, 1, 4, 2, 8), q, Options{}, ErrDType},
		{"head dim mismatch", New(Float32, 1, 4, 2, 7), q, Options{}, ErrShape},
		{"layout past data", Tensor{DType: Float32, Shape: []int{1, 4, 2, 8}, F32: make([]float32, 3)}, q, Options{}, ErrLayout},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Forward(q, tc.k, tc.v, tc.opt); !errors.Is(err, tc.want) {
				t.Fatalf("error %v, want %v", err, tc.want)
			}
		})
	}
}
