package attn

import "fmt"

// DType is the element type of a tensor.
type DType int

// The element types flashattn stores. Arithmetic is always done in float32 or
// wider; these are storage formats.
const (
	Float32  DType = iota // IEEE 754 binary32
	Float16               // IEEE 754 binary16 ("fp16")
	BFloat16              // bfloat16 ("bf16")
)

// String returns the short name used on the command line: fp32, fp16 or bf16.
func (d DType) String() string {
	switch d {
	case Float32:
		return "fp32"
	case Float16:
		return "fp16"
	case BFloat16:
		return "bf16"
	}
	return fmt.Sprintf("DType(%d)", int(d))
}

// Size returns the size of one element in bytes.
func (d DType) Size() int {
	if d == Float32 {
		return 4
	}
	return 2
}

// Valid reports whether d is one of the defined element types.
func (d DType) Valid() bool { return d >= Float32 && d <= BFloat16 }

// ParseDType parses fp32, fp16 or bf16 (also float32, float16, bfloat16).
func ParseDType(s string) (DType, error) {
	switch s {
	case "fp32", "float32", "f32":
		return Float32, nil
	case "fp16", "float16", "f16", "half":
		return Float16, nil
	case "bf16", "bfloat16":
		return BFloat16, nil
	}
	return 0, Errorf(ErrDType, "dtype %q is not fp32, fp16 or bf16", s)
}
