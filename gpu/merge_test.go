package gpu

import (
	"errors"
	"fmt"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/kernels"
)

// TestMergeErrors checks that the merge entry points refuse malformed
// arguments with the right sentinel before touching the device (the
// backend here has none).
func TestMergeErrors(t *testing.T) {
	var b Backend
	f32 := func(shape ...int) DeviceTensor { return DeviceTensor{DType: attn.Float32, Shape: shape} }
	bf := func(shape ...int) DeviceTensor { return DeviceTensor{DType: attn.BFloat16, Shape: shape} }
	lse := f32(2, 3, 10)
	acc := Accumulator{O: f32(2, 10, 3, 64), LSE: &lse}
	grad := Accumulator{O: f32(2, 10, 3, 64)}
	outLSE := f32(2, 3, 10)
	badLSE := f32(2, 3, 9)
	tests := []struct {
		name string
		err  error
		want error
	}{
		{"accumulator dtype", b.ResetAccumulator(nil, Accumulator{O: bf(2, 10, 3, 64)}), attn.ErrDType},
		{"accumulator rank", b.ResetAccumulator(nil, Accumulator{O: f32(10, 3, 64)}), attn.ErrShape},
		{"accumulator LSE shape", b.ResetAccumulator(nil, Accumulator{O: f32(2, 10, 3, 64), LSE: &badLSE}), attn.ErrShape},
		{"feature dim", b.ResetAccumulator(nil, Accumulator{O: f32(1, 1, 1, kernels.MergeMaxD+1)}), attn.ErrShape},
		{"merge into a gradient", b.MergeForward(nil, grad, 0, bf(2, 4, 3, 64), f32(2, 3, 4)), attn.ErrOption},
		{"partial past the rows", b.MergeForward(nil, acc, 7, bf(2, 4, 3, 64), f32(2, 3, 4)), attn.ErrShape},
		{"negative offset", b.MergeForward(nil, acc, -1, bf(2, 4, 3, 64), f32(2, 3, 4)), attn.ErrShape},
		{"partial heads", b.MergeForward(nil, acc, 0, bf(2, 4, 2, 64), f32(2, 2, 4)), attn.ErrShape},
		{"partial LSE rows", b.MergeForward(nil, acc, 0, bf(2, 4, 3, 64), f32(2, 3, 5)), attn.ErrShape},
		{"partial LSE dtype", b.MergeForward(nil, acc, 0, bf(2, 4, 3, 64), bf(2, 3, 4)), attn.ErrDType},
		{"partial dtype", b.MergeForward(nil, acc, 0, DeviceTensor{DType: attn.DType(9), Shape: []int{2, 4, 3, 64}}, f32(2, 3, 4)), attn.ErrDType},
		{"gradient dims", b.AddGradient(nil, grad, 0, bf(2, 4, 3, 32)), attn.ErrShape},
		{"finish rows", b.FinishAccumulator(nil, acc, bf(2, 9, 3, 64), &outLSE), attn.ErrShape},
		{"finish without LSE", b.FinishAccumulator(nil, acc, bf(2, 10, 3, 64), nil), attn.ErrOption},
		{"finish gradient with LSE", b.FinishAccumulator(nil, grad, bf(2, 10, 3, 64), &outLSE), attn.ErrOption},
		{"no buffer", b.MergeForward(nil, acc, 0, bf(2, 4, 3, 64), f32(2, 3, 4)), attn.ErrLayout},
		{"combine rank", b.CombineForward(nil, bf(2, 10, 3, 64), f32(4, 2, 3, 10), bf(2, 10, 3, 64), outLSE), attn.ErrShape},
		{"combine LSE slots", b.CombineForward(nil, bf(4, 2, 10, 3, 64), f32(3, 2, 3, 10), bf(2, 10, 3, 64), outLSE), attn.ErrShape},
		{"combine LSE dtype", b.CombineForward(nil, bf(4, 2, 10, 3, 64), bf(4, 2, 3, 10), bf(2, 10, 3, 64), outLSE), attn.ErrDType},
		{"combine output rows", b.CombineForward(nil, bf(4, 2, 10, 3, 64), f32(4, 2, 3, 10), bf(2, 9, 3, 64), outLSE), attn.ErrShape},
		{"combine output dtype", b.CombineForward(nil, bf(4, 2, 10, 3, 64), f32(4, 2, 3, 10), f32(2, 10, 3, 64), outLSE), attn.ErrDType},
		{"combine feature dim", b.CombineForward(nil, bf(1, 1, 1, 1, kernels.MergeMaxD+1), f32(1, 1, 1, 1), bf(1, 1, 1, kernels.MergeMaxD+1), f32(1, 1, 1)), attn.ErrShape},
		{"combine no buffer", b.CombineForward(nil, bf(4, 2, 10, 3, 64), f32(4, 2, 3, 10), bf(2, 10, 3, 64), outLSE), attn.ErrLayout},
	}
	for _, tt := range tests {
		if !errors.Is(tt.err, tt.want) {
			t.Errorf("%s: %v, want %v", tt.name, tt.err, tt.want)
		}
	}
}

// TestMergeParams checks the arguments a call packs: strides, the
// accumulator's row offset, the geometry and the 16-byte path, taken only
// when every row of every tensor starts 16-byte aligned and D is whole
// chunks.
func TestMergeParams(t *testing.T) {
	const base = 1 << 32
	lse := DeviceTensor{DType: attn.Float32, Shape: []int{1, 2, 20}, base: base + 4096}
	acc := Accumulator{O: DeviceTensor{DType: attn.Float32, Shape: []int{1, 20, 2, 64}, base: base}, LSE: &lse}
	tests := []struct {
		name    string
		src     DeviceTensor
		vec     bool
		strides [3]int64
	}{
		{"contiguous", DeviceTensor{DType: attn.BFloat16, Shape: []int{1, 5, 2, 64}, base: base + 8192}, true, [3]int64{640, 128, 64}},
		{"padded heads", DeviceTensor{DType: attn.BFloat16, Shape: []int{1, 5, 2, 64}, Strides: []int{800, 160, 72, 1}, base: base + 8192}, true, [3]int64{800, 160, 72}},
		{"odd head stride", DeviceTensor{DType: attn.BFloat16, Shape: []int{1, 5, 2, 64}, Strides: []int{800, 160, 67, 1}, base: base + 8192}, false, [3]int64{800, 160, 67}},
		{"unaligned start", DeviceTensor{DType: attn.BFloat16, Shape: []int{1, 5, 2, 64}, base: base + 8194}, false, [3]int64{640, 128, 64}},
		{"fp32 8-byte start", DeviceTensor{DType: attn.Float32, Shape: []int{1, 5, 2, 64}, base: base + 8200}, false, [3]int64{640, 128, 64}},
	}
	for _, tt := range tests {
		c, err := mergeAccumulator(acc)
		if err == nil {
			err = c.partial(tt.src, &DeviceTensor{DType: attn.Float32, Shape: []int{1, 2, 5}, base: base + 16384}, 7)
		}
		if err != nil {
			t.Fatalf("%s: %v", tt.name, err)
		}
		p, blocks := c.params()
		if p.Vec != tt.vec || p.SrcStrides != tt.strides || p.R0 != 7 || p.Rows != 5 || p.Shift != 3 || blocks != 1 {
			t.Errorf("%s: vec %v strides %v r0 %d rows %d shift %d blocks %d; want vec %v strides %v, r0 7, rows 5, shift 3, 1 block",
				tt.name, p.Vec, p.SrcStrides, p.R0, p.Rows, p.Shift, blocks, tt.vec, tt.strides)
		}
		if p.AccStrides != [3]int64{2560, 128, 64} || p.AccLSEStrides != [3]int64{40, 20, 1} || p.SrcLSEStrides != [3]int64{10, 5, 1} {
			t.Errorf("%s: accumulator strides %v, its LSE's %v, the partial LSE's %v", tt.name, p.AccStrides, p.AccLSEStrides, p.SrcLSEStrides)
		}
	}
}

// TestDeviceTensorNarrow checks the views Narrow returns (offsets moved
// by the axis's stride, strides kept) and the ranges it refuses.
func TestDeviceTensorNarrow(t *testing.T) {
	x := DeviceTensor{DType: attn.BFloat16, Shape: []int{2, 10, 3, 8}, Offset: 5}
	v, err := x.Narrow(1, 4, 3)
	if err != nil {
		t.Fatal(err)
	}
	if v.Offset != 5+4*24 || fmt.Sprint(v.Shape) != "[2 3 3 8]" || fmt.Sprint(v.Strides) != "[240 24 8 1]" {
		t.Errorf("rows 4..6: offset %d shape %v strides %v", v.Offset, v.Shape, v.Strides)
	}
	w, err := v.Narrow(2, 1, 2)
	if err != nil || w.Offset != v.Offset+8 || fmt.Sprint(w.Shape) != "[2 3 2 8]" {
		t.Errorf("heads 1..2 of it: %v, offset %d shape %v", err, w.Offset, w.Shape)
	}
	if fmt.Sprint(x.Shape) != "[2 10 3 8]" {
		t.Errorf("the narrowed tensor changed: %v", x.Shape)
	}
	for _, bad := range [][3]int{{4, 0, 1}, {-1, 0, 1}, {1, 8, 3}, {1, -1, 2}, {1, 0, -1}} {
		if _, err := x.Narrow(bad[0], bad[1], bad[2]); !errors.Is(err, attn.ErrShape) {
			t.Errorf("Narrow%v: %v, want ErrShape", bad, err)
		}
	}
}
