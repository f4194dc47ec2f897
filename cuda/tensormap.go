package cuda

import (
	"fmt"
	"runtime"
	"unsafe"
)

// TensorMapBytes is the size of an encoded tensor map (CUtensorMap).
const TensorMapBytes = 128

// TensorMap is an encoded tensor map: the description of a tiled global
// tensor that the tensor memory accelerator (sm_90 and later) copies boxes
// of into shared memory. Kernels take it by value in their parameters.
type TensorMap [TensorMapBytes]byte

// TensorMapSpec describes a tensor of 16-bit elements for EncodeTensorMap:
// dimension 0 is the contiguous one.
type TensorMapSpec struct {
	// Addr is the device address of element (0, 0, ...): 16-byte aligned.
	Addr uint64
	// Dims are the extents, innermost first (1 to 5 of them, each 1..2^32).
	Dims []uint64
	// Strides are the byte strides of dims 1.. (len(Dims)-1 of them), each
	// a positive multiple of 16 below 2^40.
	Strides []uint64
	// Box is the extent of one copy in each dim (1..256 each); with Swizzle128
	// the innermost extent is at most 128 bytes.
	Box []uint32
	// Swizzle128 stores each copied box's 128-byte rows with 16-byte chunk c
	// of row r at chunk c ^ (r mod 8), the layout of the warpgroup products'
	// 128-byte swizzle.
	Swizzle128 bool
	// Elem is how the accelerator takes the elements: as 16 bits copied as
	// they are (the zero value), or as fp16 or bf16 numbers, which a
	// reduce-add through the map (cp.reduce.async.bulk.tensor .add) needs.
	Elem TensorMapElem
}

// TensorMapElem is the element type a tensor map gives the accelerator.
type TensorMapElem uint8

const (
	// TensorMapBits16: 16-bit elements copied as they are.
	TensorMapBits16 TensorMapElem = iota
	// TensorMapFloat16: IEEE binary16 numbers.
	TensorMapFloat16
	// TensorMapBFloat16: bfloat16 numbers.
	TensorMapBFloat16
)

// driverType returns e's CUtensorMapDataType.
func (e TensorMapElem) driverType() uintptr {
	switch e {
	case TensorMapFloat16:
		return tensorMapFloat16
	case TensorMapBFloat16:
		return tensorMapBFloat16
	}
	return tensorMapUint16
}

// Tensor map encoding constants of the driver API.
const (
	tensorMapUint16     = 1 // CU_TENSOR_MAP_DATA_TYPE_UINT16: bits copied as they are
	tensorMapFloat16    = 6 // CU_TENSOR_MAP_DATA_TYPE_FLOAT16
	tensorMapBFloat16   = 9 // CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
	tensorMapSwizzle128 = 3 // CU_TENSOR_MAP_SWIZZLE_128B
	tensorMapL2Promo128 = 2 // CU_TENSOR_MAP_L2_PROMOTION_L2_128B
)

// Check reports the first requirement of cuTensorMapEncodeTiled that s
// violates (an error wrapping ErrArgument), or nil: EncodeTensorMap runs it
// first, and a caller can ask before choosing tensor-map loads at all.
func (s TensorMapSpec) Check() error {
	r := len(s.Dims)
	switch {
	case r < 1 || r > 5:
		return argErrorf("tensor map of rank %d (1 to 5)", r)
	case len(s.Strides) != r-1 || len(s.Box) != r:
		return argErrorf("tensor map of rank %d with %d strides and %d box extents", r, len(s.Strides), len(s.Box))
	case s.Addr%16 != 0:
		return argErrorf("tensor map address %#x not 16-byte aligned", s.Addr)
	case s.Elem > TensorMapBFloat16:
		return argErrorf("tensor map element type %d (TensorMapBits16, TensorMapFloat16 or TensorMapBFloat16)", s.Elem)
	case s.Swizzle128 && s.Box[0]*2 > 128:
		return argErrorf("tensor map box of %d elements per row with the 128-byte swizzle (at most 64)", s.Box[0])
	}
	for i, d := range s.Dims {
		if d == 0 || d > 1<<32 {
			return argErrorf("tensor map dim %d of extent %d", i, d)
		}
		if s.Box[i] == 0 || s.Box[i] > 256 {
			return argErrorf("tensor map box extent %d in dim %d (1 to 256)", s.Box[i], i)
		}
	}
	for i, st := range s.Strides {
		if !TensorMapStrideOK(st) {
			return argErrorf("tensor map stride %d bytes in dim %d (a positive multiple of 16 below 2^40)", st, i+1)
		}
	}
	return nil
}

// TensorMapStrideOK reports whether the encoder takes a byte stride: a
// positive multiple of 16 below 2^40.
func TensorMapStrideOK(st uint64) bool { return st != 0 && st%16 == 0 && st < 1<<40 }

// EncodeTensorMap encodes s with cuTensorMapEncodeTiled: 16-bit elements of type s.Elem,
// no interleave, zero fill out of bounds, 128-byte L2 promotion. Drivers
// before CUDA 12 lack the call and get an error wrapping ErrArgument.
func (d *Device) EncodeTensorMap(s TensorMapSpec) (TensorMap, error) {
	var m TensorMap
	if err := s.Check(); err != nil {
		return m, err
	}
	fn := d.api.lib.optionalSymbol("cuTensorMapEncodeTiled")
	if fn == 0 {
		return m, argErrorf("the driver in %s has no cuTensorMapEncodeTiled (CUDA 12 or later)", d.api.path)
	}
	// the driver wants the map 64-byte aligned: encode into an aligned
	// window of a larger buffer
	buf := heapBytes(TensorMapBytes + 64)
	off := (64 - int(uintptr(unsafe.Pointer(&buf[0]))%64)) % 64
	dst := buf[off : off+TensorMapBytes]
	elemStrides := make([]uint32, len(s.Dims))
	for i := range elemStrides {
		elemStrides[i] = 1
	}
	strides := append([]uint64(nil), s.Strides...)
	if len(strides) == 0 {
		strides = []uint64{0} // never read at rank 1; keeps the pointer valid
	}
	swz := uintptr(0)
	if s.Swizzle128 {
		swz = tensorMapSwizzle128
	}
	// the driver wants a current context: encode on the device's executor
	var r uintptr
	err := d.do(func() error {
		r = ccall(fn, uintptr(unsafe.Pointer(&dst[0])), s.Elem.driverType(), uintptr(len(s.Dims)), uintptr(s.Addr),
			uintptr(unsafe.Pointer(&s.Dims[0])), uintptr(unsafe.Pointer(&strides[0])),
			uintptr(unsafe.Pointer(&s.Box[0])), uintptr(unsafe.Pointer(&elemStrides[0])),
			0, swz, tensorMapL2Promo128, 0)
		return nil
	})
	if res := Result(int32(r)); err == nil && res != Success {
		err = d.api.err(fmt.Sprintf("cuTensorMapEncodeTiled(dims %v, strides %v, box %v)", s.Dims, s.Strides, s.Box), res)
	}
	runtime.KeepAlive(buf)
	runtime.KeepAlive(s)
	runtime.KeepAlive(strides)
	runtime.KeepAlive(elemStrides)
	if err != nil {
		return m, err
	}
	copy(m[:], dst)
	return m, nil
}
