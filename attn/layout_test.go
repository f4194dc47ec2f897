package attn

import (
	"errors"
	"slices"
	"testing"
)

// iota32 returns a contiguous float32 tensor whose elements count 0, 1, 2, …
// in row-major order, so that every element is told apart by its value.
func iota32(shape ...int) Tensor {
	t := New(Float32, shape...)
	for i := range t.F32 {
		t.F32[i] = float32(i)
	}
	return t
}

func TestPermute(t *testing.T) {
	base := iota32(2, 3, 4, 5)
	tests := []struct {
		name    string
		t       Tensor
		perm    []int
		wantErr error
	}{
		{"identity", base, []int{0, 1, 2, 3}, nil},
		{"swap 1 2", base, []int{0, 2, 1, 3}, nil},
		{"reverse", base, []int{3, 2, 1, 0}, nil},
		{"nil strides", Tensor{DType: Float32, Shape: []int{2, 3}, F32: make([]float32, 6)}, []int{1, 0}, nil},
		{"too short", base, []int{0, 1, 2}, ErrShape},
		{"repeated", base, []int{0, 1, 1, 3}, ErrShape},
		{"out of range", base, []int{0, 1, 2, 4}, ErrShape},
		{"negative", base, []int{0, 1, 2, -1}, ErrShape},
		{"strides of another rank", Tensor{DType: Float32, Shape: []int{2, 3}, Strides: []int{1}, F32: make([]float32, 6)}, []int{1, 0}, ErrLayout},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v, err := Permute(tc.t, tc.perm...)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("error %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if &v.F32[0] != &tc.t.F32[0] || v.Offset != tc.t.Offset {
				t.Fatal("the view does not share the tensor's storage")
			}
			if err := v.CheckLayout("view"); err != nil {
				t.Fatal(err)
			}
			// Every element of the view is the permuted element of t.
			idx, src := make([]int, len(v.Shape)), make([]int, len(v.Shape))
			for lin := range v.NumElements() {
				r := lin
				for d := len(idx) - 1; d >= 0; d-- {
					idx[d] = r % v.Shape[d]
					r /= v.Shape[d]
				}
				for d, p := range tc.perm {
					src[p] = idx[d]
				}
				if got, want := v.At(idx...), tc.t.At(src...); got != want {
					t.Fatalf("view%v = %v, want t%v = %v", idx, got, src, want)
				}
			}
		})
	}
}

// TestLayoutViews checks that BHSD reads a [B, H, S, D] tensor as
// [B, S, H, D] without copying, that ToBHSD undoes it, and that the
// identity checks take only their rank.
func TestLayoutViews(t *testing.T) {
	const B, H, S, D = 2, 3, 5, 4
	bhsd := iota32(B, H, S, D)
	v, err := BHSD(bhsd)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(v.Shape, []int{B, S, H, D}) || !slices.Equal(v.Strides, []int{H * S * D, D, S * D, 1}) {
		t.Fatalf("BHSD view shape %v strides %v", v.Shape, v.Strides)
	}
	for b := range B {
		for s := range S {
			for h := range H {
				for d := range D {
					if v.At(b, s, h, d) != bhsd.At(b, h, s, d) {
						t.Fatalf("view(%d,%d,%d,%d) = %v, want %v", b, s, h, d, v.At(b, s, h, d), bhsd.At(b, h, s, d))
					}
				}
			}
		}
	}
	back, err := ToBHSD(v)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(back.Shape, bhsd.Shape) || !slices.Equal(back.Strides, bhsd.Strides) {
		t.Fatalf("ToBHSD(BHSD(t)) shape %v strides %v, want %v %v", back.Shape, back.Strides, bhsd.Shape, bhsd.Strides)
	}
	if !slices.Equal(back.Float32s(), bhsd.Float32s()) {
		t.Fatal("ToBHSD(BHSD(t)) reads other values than t")
	}
	if !slices.Equal(bhsd.Strides, ContiguousStrides(bhsd.Shape)) {
		t.Fatal("BHSD changed its argument")
	}

	tests := []struct {
		name string
		f    func(Tensor) (Tensor, error)
		rank int
	}{
		{"BSHD", BSHD, 4}, {"BHSD", BHSD, 4}, {"ToBHSD", ToBHSD, 4}, {"THD", THD, 3},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, shape := range [][]int{{6}, {2, 3}, {2, 3, 4}, {2, 3, 4, 5}, {1, 2, 3, 4, 5}} {
				_, err := tc.f(iota32(shape...))
				if len(shape) == tc.rank && err != nil {
					t.Errorf("%s of shape %v: %v", tc.name, shape, err)
				}
				if len(shape) != tc.rank && !errors.Is(err, ErrShape) {
					t.Errorf("%s of shape %v: error %v, want ErrShape", tc.name, shape, err)
				}
			}
		})
	}
}

func TestNewLike(t *testing.T) {
	bhsd, _ := BHSD(iota32(2, 3, 5, 4))                  // [2, 5, 3, 4] with strides [60, 4, 20, 1]
	thd, _ := Permute(iota32(3, 7, 8), 1, 0, 2)          // [7, 3, 8] held as [3, 7, 8]
	oneHead, _ := BHSD(iota32(2, 1, 5, 4))               // strides [20, 4, 20, 1]: a size-1 dim ties
	featureOuter, _ := Permute(iota32(4, 2, 3), 1, 2, 0) // [2, 3, 4] with the last dim outermost
	tests := []struct {
		name        string
		dt          DType
		like        Tensor
		wantStrides []int
	}{
		{"contiguous", Float32, iota32(2, 5, 3, 4), []int{60, 12, 4, 1}},
		{"nil strides", BFloat16, Tensor{DType: Float32, Shape: []int{2, 3}, F32: make([]float32, 6)}, []int{3, 1}},
		{"BHSD view", Float16, bhsd, []int{60, 4, 20, 1}},
		{"THD view", BFloat16, thd, []int{8, 56, 1}},
		{"size-1 head", Float32, oneHead, []int{20, 4, 20, 1}},
		{"feature outermost", Float32, featureOuter, []int{3, 1, 6}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			g := NewLike(tc.dt, tc.like)
			if g.DType != tc.dt || !slices.Equal(g.Shape, tc.like.Shape) {
				t.Fatalf("NewLike: dtype %v shape %v, want %v %v", g.DType, g.Shape, tc.dt, tc.like.Shape)
			}
			if !slices.Equal(g.Strides, tc.wantStrides) {
				t.Fatalf("strides %v, want %v", g.Strides, tc.wantStrides)
			}
			if err := g.CheckLayout("g"); err != nil {
				t.Fatal(err)
			}
			if n := g.NumElements(); len(g.F32)+len(g.Bits) != n {
				t.Fatalf("storage of %d elements for %d", len(g.F32)+len(g.Bits), n)
			}
			for _, x := range g.Float32s() {
				if x != 0 {
					t.Fatal("not zero-filled")
				}
			}
			if &tc.like.Shape[0] == &g.Shape[0] {
				t.Fatal("the new tensor shares like's shape slice")
			}
		})
	}
	// The gradient of a BHSD view, viewed back in PyTorch's order, is a
	// contiguous [B, H, S, D] tensor.
	back, _ := ToBHSD(NewLike(Float32, bhsd))
	if !slices.Equal(back.Strides, ContiguousStrides(back.Shape)) {
		t.Errorf("ToBHSD(NewLike(BHSD view)) strides %v, want contiguous %v", back.Strides, ContiguousStrides(back.Shape))
	}
}
