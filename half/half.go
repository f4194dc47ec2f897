// Package half converts between float32 and the two 16-bit floating-point
// formats attention kernels store: IEEE 754 binary16 ("fp16") and bfloat16
// ("bf16"). Every conversion to 16 bits rounds to nearest, ties to even, and
// handles subnormals, infinities and NaN exactly.
package half

import "math"

// Float16 holds the bits of an IEEE 754 binary16 number.
type Float16 uint16

// BFloat16 holds the bits of a bfloat16 number (the top half of a float32).
type BFloat16 uint16

// Float16FromFloat32 rounds f to the nearest binary16 value, ties to even.
// Values beyond the binary16 range become ±Inf; NaN stays NaN.
func Float16FromFloat32(f float32) Float16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	man := b & 0x7fffff
	if exp == 0xff { // Inf or NaN
		if man != 0 {
			return Float16(sign | 0x7e00 | uint16(man>>13))
		}
		return Float16(sign | 0x7c00)
	}
	// Unbiased exponent, rebiased for binary16 (bias 15).
	e := exp - 127 + 15
	if e >= 0x1f {
		return Float16(sign | 0x7c00)
	}
	if e <= 0 {
		// Subnormal in binary16 (or zero). Shift in the implicit bit.
		if e < -10 {
			return Float16(sign) // rounds to zero (below half the smallest subnormal)
		}
		m := man | 0x800000
		shift := uint32(14 - e) // 13 + (1 - e)
		h := m >> shift
		rem := m & ((1 << shift) - 1)
		halfway := uint32(1) << (shift - 1)
		if rem > halfway || (rem == halfway && h&1 == 1) {
			h++
		}
		return Float16(sign | uint16(h))
	}
	h := uint32(e)<<10 | man>>13
	rem := man & 0x1fff
	if rem > 0x1000 || (rem == 0x1000 && h&1 == 1) {
		h++ // may carry into the exponent, and into Inf: both are correct
	}
	return Float16(sign | uint16(h))
}

// Float32 returns the exact float32 value of h.
func (h Float16) Float32() float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	man := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	case exp == 0:
		if man == 0 {
			return math.Float32frombits(sign)
		}
		// Subnormal: value = man · 2^-24.
		v := float32(man) * (1.0 / (1 << 24))
		if sign != 0 {
			v = -v
		}
		return v
	}
	return math.Float32frombits(sign | (exp+127-15)<<23 | man<<13)
}

// BFloat16FromFloat32 rounds f to the nearest bfloat16 value, ties to even.
// NaN stays NaN (quiet).
func BFloat16FromFloat32(f float32) BFloat16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return BFloat16(b>>16 | 0x40)
	}
	lsb := (b >> 16) & 1
	b += 0x7fff + lsb
	return BFloat16(b >> 16)
}

// Float32 returns the exact float32 value of h.
func (h BFloat16) Float32() float32 {
	return math.Float32frombits(uint32(h) << 16)
}

// RoundFloat16 returns f rounded to binary16 precision, as a float32.
func RoundFloat16(f float32) float32 { return Float16FromFloat32(f).Float32() }

// RoundBFloat16 returns f rounded to bfloat16 precision, as a float32.
func RoundBFloat16(f float32) float32 { return BFloat16FromFloat32(f).Float32() }
