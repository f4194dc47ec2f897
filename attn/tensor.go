package attn

import (
	"encoding/binary"
	"fmt"
	"math"
	"sort"

	"github.com/flashattn/flashattn/half"
)

// Tensor is a strided view of host memory. The storage is F32 when DType is
// Float32 and Bits (the raw 16-bit patterns) when DType is Float16 or
// BFloat16. Element (i0, i1, …) lives at Offset + Σ i_d·Strides[d] in that
// storage. Nil Strides mean contiguous row-major.
type Tensor struct {
	DType   DType
	Shape   []int
	Strides []int
	Offset  int
	F32     []float32
	Bits    []uint16
}

// ContiguousStrides returns the row-major strides of shape.
func ContiguousStrides(shape []int) []int {
	st := make([]int, len(shape))
	n := 1
	for d := len(shape) - 1; d >= 0; d-- {
		st[d] = n
		n *= shape[d]
	}
	return st
}

// NumElements returns the product of shape.
func NumElements(shape []int) int {
	n := 1
	for _, s := range shape {
		n *= s
	}
	return n
}

// New returns a contiguous zero-filled tensor.
func New(dt DType, shape ...int) Tensor {
	t := Tensor{DType: dt, Shape: append([]int(nil), shape...), Strides: ContiguousStrides(shape)}
	n := NumElements(shape)
	if dt == Float32 {
		t.F32 = make([]float32, n)
	} else {
		t.Bits = make([]uint16, n)
	}
	return t
}

// FromFloat32 returns a contiguous tensor of type dt holding data (row-major
// in shape), each value rounded to dt to nearest, ties to even. It panics if
// len(data) differs from the number of elements, which is a programming error.
func FromFloat32(dt DType, data []float32, shape ...int) Tensor {
	if len(data) != NumElements(shape) {
		panic(fmt.Sprintf("attn.FromFloat32: %d values for shape %v", len(data), shape))
	}
	t := New(dt, shape...)
	for i, x := range data {
		t.setLinear(i, x)
	}
	return t
}

// Rank returns the number of dimensions.
func (t Tensor) Rank() int { return len(t.Shape) }

// NumElements returns the number of logical elements.
func (t Tensor) NumElements() int { return NumElements(t.Shape) }

// strides returns the effective strides.
func (t Tensor) strides() []int {
	if t.Strides == nil {
		return ContiguousStrides(t.Shape)
	}
	return t.Strides
}

// storageLen returns the length of the storage slice for t's dtype.
func (t Tensor) storageLen() int {
	if t.DType == Float32 {
		return len(t.F32)
	}
	return len(t.Bits)
}

// Index returns the storage index of the element at idx (no bounds check).
func (t Tensor) Index(idx ...int) int {
	st := t.strides()
	o := t.Offset
	for d, i := range idx {
		o += i * st[d]
	}
	return o
}

// Load returns the storage element at position o as float32.
func (t Tensor) Load(o int) float32 {
	switch t.DType {
	case Float16:
		return half.Float16(t.Bits[o]).Float32()
	case BFloat16:
		return half.BFloat16(t.Bits[o]).Float32()
	}
	return t.F32[o]
}

// Store rounds x to t's dtype and writes it at storage position o.
func (t Tensor) Store(o int, x float32) {
	switch t.DType {
	case Float16:
		t.Bits[o] = uint16(half.Float16FromFloat32(x))
	case BFloat16:
		t.Bits[o] = uint16(half.BFloat16FromFloat32(x))
	default:
		t.F32[o] = x
	}
}

func (t Tensor) setLinear(i int, x float32) { t.Store(i, x) }

// At returns the element at idx as float32.
func (t Tensor) At(idx ...int) float32 { return t.Load(t.Index(idx...)) }

// Set rounds x to t's dtype and stores it at idx.
func (t Tensor) Set(x float32, idx ...int) { t.Store(t.Index(idx...), x) }

// Float32s returns the elements in row-major logical order as float32.
func (t Tensor) Float32s() []float32 {
	out := make([]float32, t.NumElements())
	t.each(func(lin, off int) { out[lin] = t.Load(off) })
	return out
}

// Float64s returns the elements in row-major logical order as float64.
func (t Tensor) Float64s() []float64 {
	out := make([]float64, t.NumElements())
	t.each(func(lin, off int) { out[lin] = float64(t.Load(off)) })
	return out
}

// each calls f with the row-major linear index and the storage offset of
// every element.
func (t Tensor) each(f func(lin, off int)) {
	n := t.NumElements()
	if n == 0 {
		return
	}
	st := t.strides()
	idx := make([]int, len(t.Shape))
	off := t.Offset
	for lin := 0; lin < n; lin++ {
		f(lin, off)
		for d := len(idx) - 1; d >= 0; d-- {
			idx[d]++
			off += st[d]
			if idx[d] < t.Shape[d] {
				break
			}
			off -= idx[d] * st[d]
			idx[d] = 0
		}
	}
}

// Bytes returns the elements in row-major logical order as the
// little-endian bytes of the storage type (4 per fp32 element, 2 per fp16 or
// bf16 element): the contiguous image of the tensor, for copies to devices
// and files.
func (t Tensor) Bytes() []byte {
	out := make([]byte, t.NumElements()*t.DType.Size())
	if t.DType == Float32 {
		t.each(func(lin, off int) { binary.LittleEndian.PutUint32(out[4*lin:], math.Float32bits(t.F32[off])) })
	} else {
		t.each(func(lin, off int) { binary.LittleEndian.PutUint16(out[2*lin:], t.Bits[off]) })
	}
	return out
}

// Fill sets every element to x (rounded to the dtype).
func (t Tensor) Fill(x float32) { t.each(func(_, off int) { t.Store(off, x) }) }

// CheckLayout reports whether the tensor is well formed: a valid dtype,
// storage of that dtype, non-negative sizes and strides, no two elements
// sharing storage, and every element inside the storage. name is used in the
// error message.
func (t Tensor) CheckLayout(name string) error {
	if !t.DType.Valid() {
		return Errorf(ErrDType, "%s: dtype %d", name, int(t.DType))
	}
	if t.DType == Float32 && t.Bits != nil && t.F32 == nil {
		return Errorf(ErrDType, "%s: dtype fp32 but storage holds 16-bit values", name)
	}
	if t.DType != Float32 && t.F32 != nil && t.Bits == nil {
		return Errorf(ErrDType, "%s: dtype %v but storage holds float32 values", name, t.DType)
	}
	st := t.strides()
	if len(st) != len(t.Shape) {
		return Errorf(ErrLayout, "%s: %d strides for %d dims", name, len(st), len(t.Shape))
	}
	for d, s := range t.Shape {
		if s < 0 {
			return Errorf(ErrShape, "%s: shape %v has a negative size", name, t.Shape)
		}
		if st[d] < 0 {
			return Errorf(ErrLayout, "%s: negative stride %d in dim %d", name, st[d], d)
		}
	}
	if t.Offset < 0 {
		return Errorf(ErrLayout, "%s: negative offset %d", name, t.Offset)
	}
	if t.NumElements() == 0 {
		return nil
	}
	// Past the data: the largest storage index must exist.
	last := t.Offset
	for d, s := range t.Shape {
		last += (s - 1) * st[d]
	}
	if last >= t.storageLen() {
		return Errorf(ErrLayout, "%s: shape %v strides %v offset %d reach element %d of a storage of %d",
			name, t.Shape, st, t.Offset, last, t.storageLen())
	}
	// Overlap: sorted by stride, each dim's stride must clear the span of the smaller ones.
	dims := make([]int, 0, len(t.Shape))
	for d, s := range t.Shape {
		if s > 1 {
			dims = append(dims, d)
		}
	}
	sort.Slice(dims, func(a, b int) bool { return st[dims[a]] < st[dims[b]] })
	span := 1
	for _, d := range dims {
		if st[d] < span {
			return Errorf(ErrLayout, "%s: strides %v make elements of shape %v overlap", name, st, t.Shape)
		}
		span = st[d]*(t.Shape[d]-1) + span
	}
	return nil
}

// IsFinite reports whether every element is finite; used by tests and tools.
func (t Tensor) IsFinite() bool {
	ok := true
	t.each(func(_, off int) {
		x := t.Load(off)
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			ok = false
		}
	})
	return ok
}
