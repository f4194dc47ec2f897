package cuda

import (
	"errors"
	"testing"
)

// TestTensorMapElemDriverType checks the element types' driver values
// (CUtensorMapDataType).
func TestTensorMapElemDriverType(t *testing.T) {
	for e, want := range map[TensorMapElem]uintptr{TensorMapBits16: 1, TensorMapFloat16: 6, TensorMapBFloat16: 9} {
		if got := e.driverType(); got != want {
			t.Errorf("%d: CUtensorMapDataType %d, want %d", e, got, want)
		}
	}
}

// TestTensorMapSpecCheck checks the requirements EncodeTensorMap enforces
// before it reaches the driver.
func TestTensorMapSpecCheck(t *testing.T) {
	good := func() TensorMapSpec {
		return TensorMapSpec{Addr: 0x1000, Dims: []uint64{208, 4096, 8, 4}, Strides: []uint64{416 * 8, 416, 416 * 8 * 4096},
			Box: []uint32{64, 80, 1, 1}, Swizzle128: true}
	}
	cases := []struct {
		name string
		edit func(*TensorMapSpec)
		ok   bool
	}{
		{"valid", func(*TensorMapSpec) {}, true},
		{"rank 1", func(s *TensorMapSpec) { s.Dims, s.Strides, s.Box = []uint64{64}, nil, []uint32{64} }, true},
		{"rank 6", func(s *TensorMapSpec) {
			s.Dims, s.Strides, s.Box = make([]uint64, 6), make([]uint64, 5), make([]uint32, 6)
		}, false},
		{"stride count", func(s *TensorMapSpec) { s.Strides = s.Strides[:2] }, false},
		{"box count", func(s *TensorMapSpec) { s.Box = s.Box[:3] }, false},
		{"unaligned address", func(s *TensorMapSpec) { s.Addr = 0x1002 }, false},
		{"stride not a multiple of 16", func(s *TensorMapSpec) { s.Strides[0] = 398 }, false},
		{"stride too large", func(s *TensorMapSpec) { s.Strides[2] = 1 << 40 }, false},
		{"zero stride", func(s *TensorMapSpec) { s.Strides[1] = 0 }, false},
		{"empty dim", func(s *TensorMapSpec) { s.Dims[1] = 0 }, false},
		{"box too tall", func(s *TensorMapSpec) { s.Box[1] = 257 }, false},
		{"empty box", func(s *TensorMapSpec) { s.Box[2] = 0 }, false},
		{"swizzled rows past 128 bytes", func(s *TensorMapSpec) { s.Box[0] = 128 }, false},
		{"unswizzled wide rows", func(s *TensorMapSpec) { s.Box[0], s.Swizzle128 = 128, false }, true},
		{"bf16 elements", func(s *TensorMapSpec) { s.Elem = TensorMapBFloat16 }, true},
		{"fp16 elements", func(s *TensorMapSpec) { s.Elem = TensorMapFloat16 }, true},
		{"unknown element type", func(s *TensorMapSpec) { s.Elem = TensorMapBFloat16 + 1 }, false},
	}
	for _, c := range cases {
		s := good()
		c.edit(&s)
		err := s.Check()
		if c.ok && err != nil {
			t.Errorf("%s: %v", c.name, err)
		}
		if !c.ok && !errors.Is(err, ErrArgument) {
			t.Errorf("%s: err %v, want ErrArgument", c.name, err)
		}
	}
}
