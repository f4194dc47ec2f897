package attn

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
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

// ContiguousStrides returns the row-major strides of shape. The shape must
// be valid (CheckShape); the strides of one whose element count overflows
// int are meaningless.
func ContiguousStrides(shape []int) []int {
	st := make([]int, len(shape))
	n := 1
	for d := len(shape) - 1; d >= 0; d-- {
		st[d] = n
		n *= shape[d]
	}
	return st
}

// NumElements returns the product of shape. The shape must be valid
// (CheckShape); for one that is not, the product is meaningless.
func NumElements(shape []int) int {
	n := 1
	for _, s := range shape {
		n *= s
	}
	return n
}

// mulInt returns a·b for a, b ≥ 0, and false when the product overflows int.
func mulInt(a, b int) (int, bool) {
	if a != 0 && b > math.MaxInt/a {
		return 0, false
	}
	return a * b, true
}

// addInt returns a+b for a, b ≥ 0, and false when the sum overflows int.
func addInt(a, b int) (int, bool) {
	if a > math.MaxInt-b {
		return 0, false
	}
	return a + b, true
}

// CheckShape returns the number of elements of shape. It fails with an
// error wrapping ErrShape when a size is negative or the product of the
// sizes overflows int. name names the tensor in the message.
func CheckShape(name string, shape []int) (int, error) {
	for _, s := range shape {
		if s < 0 {
			return 0, Errorf(ErrShape, "%s: shape %v has a negative size", name, shape)
		}
	}
	if slices.Contains(shape, 0) {
		return 0, nil
	}
	n := 1
	for _, s := range shape {
		var ok bool
		if n, ok = mulInt(n, s); !ok {
			return 0, Errorf(ErrShape, "%s: shape %v has more elements than an int counts", name, shape)
		}
	}
	return n, nil
}

// LayoutSpan returns end, the number of storage elements a strided view
// needs: one past its largest storage index, offset + Σ (shape[d]−1)·strides[d],
// or 0 when the view has no element. It fails with an error wrapping
// ErrShape for a negative size or an element count that overflows int, and
// ErrLayout for a strides slice whose length differs from the rank, a
// negative stride or offset, or an end that overflows int. Every step is
// overflow-checked. It does not check that elements are distinct (see
// Tensor.CheckLayout). name names the tensor in the message.
func LayoutSpan(name string, shape, strides []int, offset int) (end int, err error) {
	if len(strides) != len(shape) {
		return 0, Errorf(ErrLayout, "%s: %d strides for %d dims", name, len(strides), len(shape))
	}
	n, err := CheckShape(name, shape)
	if err != nil {
		return 0, err
	}
	for d, st := range strides {
		if st < 0 {
			return 0, Errorf(ErrLayout, "%s: negative stride %d in dim %d", name, st, d)
		}
	}
	if offset < 0 {
		return 0, Errorf(ErrLayout, "%s: negative offset %d", name, offset)
	}
	if n == 0 {
		return 0, nil
	}
	end = offset
	ok := true
	for d, s := range shape {
		var step int
		if step, ok = mulInt(s-1, strides[d]); !ok {
			break
		}
		if end, ok = addInt(end, step); !ok {
			break
		}
	}
	if ok {
		end, ok = addInt(end, 1)
	}
	if !ok {
		return 0, Errorf(ErrLayout, "%s: shape %v strides %v offset %d reach past the largest int index", name, shape, strides, offset)
	}
	return end, nil
}

// New returns a contiguous zero-filled tensor of dt and shape. It never
// panics: when shape is invalid (a negative size, or more elements or bytes
// than an int counts) or dt is, the tensor keeps dt and shape and has no
// storage, so that CheckLayout, which every backend runs on its inputs,
// fails with an error wrapping ErrShape (ErrDType). NewChecked returns that
// error at once; use it for shapes that come from outside the program.
func New(dt DType, shape ...int) Tensor {
	t, err := NewChecked(dt, shape...)
	if err != nil {
		return Tensor{DType: dt, Shape: append([]int(nil), shape...)}
	}
	return t
}

// NewChecked returns a contiguous zero-filled tensor of dt and shape, or an
// error wrapping ErrDType for an invalid dtype and ErrShape for a negative
// size or an element or byte count that overflows int.
func NewChecked(dt DType, shape ...int) (Tensor, error) {
	if !dt.Valid() {
		return Tensor{}, Errorf(ErrDType, "new tensor: dtype %d", int(dt))
	}
	n, err := CheckShape("new tensor", shape)
	if err != nil {
		return Tensor{}, err
	}
	if _, ok := mulInt(n, dt.Size()); !ok {
		return Tensor{}, Errorf(ErrShape, "new tensor: shape %v has more bytes than an int counts", shape)
	}
	t := Tensor{DType: dt, Shape: append([]int(nil), shape...), Strides: ContiguousStrides(shape)}
	if dt == Float32 {
		t.F32 = make([]float32, n)
	} else {
		t.Bits = make([]uint16, n)
	}
	return t, nil
}

// FromFloat32 returns a contiguous tensor of type dt holding data (row-major
// in shape), each value rounded to dt to nearest, ties to even. It panics if
// dt or shape is invalid or len(data) differs from the number of elements,
// which are programming errors.
func FromFloat32(dt DType, data []float32, shape ...int) Tensor {
	t, err := NewChecked(dt, shape...)
	if err != nil {
		panic(fmt.Sprintf("attn.FromFloat32: %v", err))
	}
	if len(data) != t.storageLen() {
		panic(fmt.Sprintf("attn.FromFloat32: %d values for shape %v", len(data), shape))
	}
	for i, x := range data {
		t.setLinear(i, x)
	}
	return t
}

// Rank returns the number of dimensions.
func (t Tensor) Rank() int { return len(t.Shape) }

// NumElements returns the number of logical elements. The shape must be
// valid (CheckShape).
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
	out := make([]float32, t.mustSpan())
	t.each(func(lin, off int) { out[lin] = t.Load(off) })
	return out
}

// Float64s returns the elements in row-major logical order as float64.
func (t Tensor) Float64s() []float64 {
	out := make([]float64, t.mustSpan())
	t.each(func(lin, off int) { out[lin] = float64(t.Load(off)) })
	return out
}

// each calls f with the row-major linear index and the storage offset of
// every element. It panics with the error of checkSpan when t's elements
// are not all inside its storage.
func (t Tensor) each(f func(lin, off int)) {
	n := t.mustSpan()
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
	out := make([]byte, t.mustSpan()*t.DType.Size())
	if t.DType == Float32 {
		t.each(func(lin, off int) { binary.LittleEndian.PutUint32(out[4*lin:], math.Float32bits(t.F32[off])) })
	} else {
		t.each(func(lin, off int) { binary.LittleEndian.PutUint16(out[2*lin:], t.Bits[off]) })
	}
	return out
}

// Fill sets every element to x (rounded to the dtype).
func (t Tensor) Fill(x float32) { t.each(func(_, off int) { t.Store(off, x) }) }

// mustSpan returns the number of elements of t, and panics with the error
// of checkSpan when its elements are not all inside its storage.
func (t Tensor) mustSpan() int {
	n, err := t.checkSpan("tensor")
	if err != nil {
		panic(err)
	}
	return n
}

// checkSpan returns the number of elements of t, and an error (wrapping
// ErrDType, ErrShape or ErrLayout) unless t has a valid dtype, storage of
// that dtype and every element inside the storage. It does not check that
// the elements are distinct.
func (t Tensor) checkSpan(name string) (int, error) {
	if !t.DType.Valid() {
		return 0, Errorf(ErrDType, "%s: dtype %d", name, int(t.DType))
	}
	if t.DType == Float32 && t.Bits != nil && t.F32 == nil {
		return 0, Errorf(ErrDType, "%s: dtype fp32 but storage holds 16-bit values", name)
	}
	if t.DType != Float32 && t.F32 != nil && t.Bits == nil {
		return 0, Errorf(ErrDType, "%s: dtype %v but storage holds float32 values", name, t.DType)
	}
	n, err := CheckShape(name, t.Shape)
	if err != nil {
		return 0, err
	}
	if _, ok := mulInt(n, t.DType.Size()); !ok {
		return 0, Errorf(ErrShape, "%s: shape %v has more bytes than an int counts", name, t.Shape)
	}
	st := t.Strides
	if st == nil {
		st = ContiguousStrides(t.Shape) // the count fits an int: so do these
	}
	end, err := LayoutSpan(name, t.Shape, st, t.Offset)
	if err != nil {
		return 0, err
	}
	if end > t.storageLen() {
		return 0, Errorf(ErrLayout, "%s: shape %v strides %v offset %d reach element %d of a storage of %d",
			name, t.Shape, st, t.Offset, end-1, t.storageLen())
	}
	return n, nil
}

// CheckLayout reports whether the tensor is well formed: a valid dtype,
// storage of that dtype, non-negative sizes whose product (in elements and
// in bytes) fits an int,
// non-negative strides and offset, no two elements sharing storage, and
// every element inside the storage. Every step of the arithmetic is
// overflow-checked. The error wraps ErrDType, ErrShape or ErrLayout; name
// names the tensor in its message.
//
// The methods that read or write elements (At, Set, Index, Load, Store)
// assume a tensor that passes CheckLayout; the bulk ones (Float32s,
// Float64s, Bytes, Fill, IsFinite) panic with this error on one whose
// elements are not all inside its storage.
func (t Tensor) CheckLayout(name string) error {
	n, err := t.checkSpan(name)
	if err != nil || n == 0 {
		return err
	}
	// Overlap: sorted by stride, each dim's stride must clear the span of
	// the smaller ones. Each span is at most the storage length (checkSpan
	// bounded the sum of all (size−1)·stride), so none of this overflows.
	st := t.strides()
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
