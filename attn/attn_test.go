package attn

import (
	"errors"
	"math"
	"testing"
)

func TestKeyRange(t *testing.T) {
	tests := []struct {
		name    string
		opt     Options
		i, n, m int
		lo, hi  int
	}{
		{"unmasked", Options{}, 3, 5, 7, 0, 7},
		{"causal-bottom-right-square", Options{Causal: true}, 2, 4, 4, 0, 3},
		{"causal-bottom-right-more-keys", Options{Causal: true}, 0, 2, 5, 0, 4},
		{"causal-bottom-right-fewer-keys", Options{Causal: true}, 0, 5, 2, 0, 0},
		{"causal-top-left", Options{Causal: true, Align: AlignTopLeft}, 1, 2, 5, 0, 2},
		{"window-both-sides", Options{Window: &Window{Left: 1, Right: 1}, Align: AlignTopLeft}, 3, 8, 8, 2, 5},
		{"window-left-unbounded", Options{Window: &Window{Left: -1, Right: 2}, Align: AlignTopLeft}, 3, 8, 8, 0, 6},
		{"window-and-causal", Options{Causal: true, Window: &Window{Left: 2, Right: 5}, Align: AlignTopLeft}, 4, 8, 8, 2, 5},
		{"window-clipped-right", Options{Window: &Window{Left: 0, Right: 10}, Align: AlignTopLeft}, 6, 8, 8, 6, 8},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := &Problem{Opt: tc.opt}
			p.Left, p.Right, p.Masked = tc.opt.MaskBounds()
			lo, hi := p.KeyRange(tc.i, tc.n, tc.m)
			if hi <= lo && tc.hi <= tc.lo {
				return // both empty
			}
			if lo != tc.lo || hi != tc.hi {
				t.Errorf("KeyRange(%d, %d, %d) = [%d, %d), want [%d, %d)", tc.i, tc.n, tc.m, lo, hi, tc.lo, tc.hi)
			}
		})
	}
}

func TestCheckLayout(t *testing.T) {
	tests := []struct {
		name string
		t    Tensor
		want error
	}{
		{"contiguous", New(Float32, 2, 3, 4), nil},
		{"bhnd-as-bnhd", Tensor{DType: Float32, Shape: []int{2, 5, 3, 4}, Strides: []int{60, 4, 20, 1}, F32: make([]float32, 120)}, nil},
		{"past-end", Tensor{DType: Float32, Shape: []int{2, 3}, Strides: []int{3, 1}, Offset: 1, F32: make([]float32, 6)}, ErrLayout},
		{"overlap", Tensor{DType: Float32, Shape: []int{2, 3}, Strides: []int{2, 1}, F32: make([]float32, 6)}, ErrLayout},
		{"zero-stride", Tensor{DType: Float32, Shape: []int{2, 3}, Strides: []int{0, 1}, F32: make([]float32, 6)}, ErrLayout},
		{"negative-stride", Tensor{DType: Float32, Shape: []int{2, 3}, Strides: []int{-3, 1}, F32: make([]float32, 6)}, ErrLayout},
		{"wrong-storage", Tensor{DType: BFloat16, Shape: []int{2}, F32: make([]float32, 2)}, ErrDType},
		{"bad-dtype", Tensor{DType: DType(7), Shape: []int{2}, F32: make([]float32, 2)}, ErrDType},
		{"size-one-dim-any-stride", Tensor{DType: Float32, Shape: []int{1, 3}, Strides: []int{0, 1}, F32: make([]float32, 3)}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.t.CheckLayout("x")
			if tc.want == nil && err != nil {
				t.Fatalf("unexpected error %v", err)
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("error %v, want %v", err, tc.want)
			}
		})
	}
}

func TestNewProblem(t *testing.T) {
	q := New(Float16, 2, 7, 6, 40)
	k := New(Float16, 2, 9, 2, 40)
	v := New(Float16, 2, 9, 2, 24)
	p, err := NewProblem(q, k, v, Options{Causal: true})
	if err != nil {
		t.Fatal(err)
	}
	if p.B != 2 || p.N != 7 || p.M != 9 || p.H != 6 || p.Hkv != 2 || p.DK != 40 || p.DV != 24 || p.Group() != 3 {
		t.Fatalf("sizes %+v", p)
	}
	if math.Abs(p.Scale-1/math.Sqrt(40)) > 1e-15 {
		t.Fatalf("scale %v", p.Scale)
	}
	if got := p.OutputShape(); len(got) != 4 || got[3] != 24 {
		t.Fatalf("output shape %v", got)
	}
	// Bottom-right causal with M > N: query i sees keys [0, i+M-N].
	var pairs float64
	for i := 0; i < 7; i++ {
		pairs += float64(i + 2 + 1)
	}
	if want := 2 * 2 * 6 * pairs * 64; p.FLOPs() != want {
		t.Fatalf("FLOPs %v, want %v", p.FLOPs(), want)
	}
}

func TestNewProblemErrors(t *testing.T) {
	q := New(Float32, 1, 4, 4, 8)
	k := New(Float32, 1, 5, 2, 8)
	v := New(Float32, 1, 5, 2, 8)
	nan := math.NaN()
	tests := []struct {
		name    string
		q, k, v Tensor
		opt     Options
		want    error
	}{
		{"heads", q, New(Float32, 1, 5, 3, 8), New(Float32, 1, 5, 3, 8), Options{}, ErrShape},
		{"dk-mismatch", q, New(Float32, 1, 5, 2, 9), v, Options{}, ErrShape},
		{"dim-zero", New(Float32, 1, 4, 4, 0), New(Float32, 1, 5, 2, 0), v, Options{}, ErrShape},
		{"dim-too-big", New(Float32, 1, 1, 1, 513), New(Float32, 1, 1, 1, 513), New(Float32, 1, 1, 1, 4), Options{}, ErrShape},
		{"dtype-mix", q, New(BFloat16, 1, 5, 2, 8), v, Options{}, ErrDType},
		{"dropout-one", q, k, v, Options{Dropout: 1}, ErrOption},
		{"dropout-negative", q, k, v, Options{Dropout: -0.1}, ErrOption},
		// below and above the mask's resolution of 1/256 (package philox)
		{"dropout-unresolved-small", q, k, v, Options{Dropout: 1e-3}, ErrOption},
		{"dropout-half-step", q, k, v, Options{Dropout: 1.0 / 512}, ErrOption},
		{"dropout-unresolved-large", q, k, v, Options{Dropout: 0.999}, ErrOption},
		{"scale-nan", q, k, v, Options{Scale: nan}, ErrOption},
		{"softcap-inf", q, k, v, Options{Softcap: math.Inf(1)}, ErrOption},
		{"bias-shape", q, k, v, Options{Bias: &Bias{Tensor: New(Float32, 1, 4, 4, 4)}}, ErrShape},
		{"rank", New(Float32, 4, 4, 8), k, v, Options{}, ErrShape},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewProblem(tc.q, tc.k, tc.v, tc.opt)
			if !errors.Is(err, tc.want) {
				t.Fatalf("error %v, want %v", err, tc.want)
			}
		})
	}
}

// TestProblemDropout checks the resolved dropout threshold and scale:
// T = round(256·(1 − p)) and 256/T, zero without dropout.
func TestProblemDropout(t *testing.T) {
	q, k, v := New(Float32, 1, 4, 2, 8), New(Float32, 1, 5, 2, 8), New(Float32, 1, 5, 2, 8)
	tests := []struct {
		p     float64
		t     uint32
		scale float64
	}{{0, 0, 0}, {0.1, 230, 256.0 / 230}, {0.5, 128, 2}, {1 - 1.0/512, 1, 256}, {0.0025, 255, 256.0 / 255}}
	for _, tc := range tests {
		p, err := NewProblem(q, k, v, Options{Dropout: tc.p})
		if err != nil {
			t.Fatalf("p=%v: %v", tc.p, err)
		}
		if p.DropThreshold != tc.t || p.DropScale != tc.scale {
			t.Errorf("p=%v: DropThreshold %d, DropScale %v; want %d, %v", tc.p, p.DropThreshold, p.DropScale, tc.t, tc.scale)
		}
	}
}

func TestVarlenProblem(t *testing.T) {
	q := New(Float32, 40, 2, 8)
	k := New(Float32, 9, 1, 8)
	v := New(Float32, 9, 1, 8)
	p, err := NewProblem(q, k, v, Options{CuSeqlensQ: []int32{0, 5, 5, 40}, CuSeqlensK: []int32{0, 7, 9, 9}})
	if err != nil {
		t.Fatal(err)
	}
	if p.B != 3 || p.N != 35 || p.M != 7 {
		t.Fatalf("B=%d N=%d M=%d", p.B, p.N, p.M)
	}
	q0, n, k0, m := p.Segment(2)
	if q0 != 5 || n != 35 || k0 != 9 || m != 0 {
		t.Fatalf("segment 2 = %d %d %d %d", q0, n, k0, m)
	}
	for _, cu := range [][2][]int32{
		{{0, 5, 4, 40}, {0, 7, 9, 9}},
		{{1, 5, 5, 40}, {0, 7, 9, 9}},
		{{0, 5, 5, 39}, {0, 7, 9, 9}},
		{{0, 40}, {0, 7, 9, 9}},
	} {
		_, err := NewProblem(q, k, v, Options{CuSeqlensQ: cu[0], CuSeqlensK: cu[1]})
		if !errors.Is(err, ErrOption) {
			t.Errorf("cu_seqlens %v: error %v, want ErrOption", cu, err)
		}
	}
}

func TestParseDType(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want DType
	}{{"fp32", Float32}, {"bf16", BFloat16}, {"float16", Float16}} {
		got, err := ParseDType(tc.in)
		if err != nil || got != tc.want || got.String() == "" {
			t.Errorf("ParseDType(%q) = %v, %v", tc.in, got, err)
		}
	}
	if _, err := ParseDType("int8"); !errors.Is(err, ErrDType) {
		t.Errorf("int8: %v", err)
	}
}

func TestBytes(t *testing.T) {
	// A [2, 3] view with strides [1, 2] (column-major storage) reads back in row-major order.
	x := Tensor{DType: Float32, Shape: []int{2, 3}, Strides: []int{1, 2}, F32: []float32{1, 4, 2, 5, 3, 6}}
	b := x.Bytes()
	for i, want := range []float32{1, 2, 3, 4, 5, 6} {
		if got := math.Float32frombits(uint32(b[4*i]) | uint32(b[4*i+1])<<8 | uint32(b[4*i+2])<<16 | uint32(b[4*i+3])<<24); got != want {
			t.Fatalf("element %d = %v, want %v", i, got, want)
		}
	}
	h := Tensor{DType: BFloat16, Shape: []int{3}, Strides: []int{2}, Offset: 1, Bits: []uint16{0, 0x3f80, 0, 0x4000, 0, 0x4040}}
	if got := h.Bytes(); len(got) != 6 || got[0] != 0x80 || got[1] != 0x3f || got[3] != 0x40 || got[5] != 0x40 || got[4] != 0x40 {
		t.Fatalf("bf16 bytes % x", got)
	}
}
