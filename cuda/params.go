package cuda

import (
	"encoding/binary"
	"math"
)

// ParamBuffer builds the bytes of a kernel's struct parameter the way the
// CUDA C++ compiler lays the struct out on a 64-bit host: each field at the
// next multiple of its alignment, the whole padded to its largest
// alignment. Append fields in declaration order, then pass Bytes to Launch.
//
// For
//
//	struct Params { const float* a; float* c; int n; float scale; };
//
// write
//
//	var p cuda.ParamBuffer
//	p.Ptr(a.Ptr()); p.Ptr(c.Ptr()); p.I32(int32(n)); p.F32(scale)
//	err := dev.Launch(f, grid, block, 0, nil, p.Bytes())
//
// The zero value is an empty buffer ready to use.
type ParamBuffer struct {
	b        []byte
	maxAlign int
}

// Align pads the buffer to a multiple of n bytes (a power of two) and makes
// the struct at least n-aligned, for fields such as __align__(16) arrays.
func (p *ParamBuffer) Align(n int) {
	for len(p.b)%n != 0 {
		p.b = append(p.b, 0)
	}
	if n > p.maxAlign {
		p.maxAlign = n
	}
}

// put appends v's low size bytes at the next multiple of size.
func (p *ParamBuffer) put(v uint64, size int) {
	p.Align(size)
	switch size {
	case 4:
		p.b = binary.LittleEndian.AppendUint32(p.b, uint32(v))
	case 8:
		p.b = binary.LittleEndian.AppendUint64(p.b, v)
	case 2:
		p.b = binary.LittleEndian.AppendUint16(p.b, uint16(v))
	default:
		p.b = append(p.b, byte(v))
	}
}

// Ptr appends a device pointer (8 bytes), such as Buffer.Ptr().
func (p *ParamBuffer) Ptr(v uint64) { p.put(v, 8) }

// U64 appends an unsigned 64-bit integer.
func (p *ParamBuffer) U64(v uint64) { p.put(v, 8) }

// I64 appends a signed 64-bit integer.
func (p *ParamBuffer) I64(v int64) { p.put(uint64(v), 8) }

// U32 appends an unsigned 32-bit integer.
func (p *ParamBuffer) U32(v uint32) { p.put(uint64(v), 4) }

// I32 appends a signed 32-bit integer.
func (p *ParamBuffer) I32(v int32) { p.put(uint64(uint32(v)), 4) }

// U16 appends an unsigned 16-bit integer (also the bits of a half or
// bfloat16 value).
func (p *ParamBuffer) U16(v uint16) { p.put(uint64(v), 2) }

// U8 appends one byte (a C++ bool or char).
func (p *ParamBuffer) U8(v uint8) { p.put(uint64(v), 1) }

// F32 appends a float.
func (p *ParamBuffer) F32(v float32) { p.put(uint64(math.Float32bits(v)), 4) }

// F64 appends a double.
func (p *ParamBuffer) F64(v float64) { p.put(math.Float64bits(v), 8) }

// Len returns the number of bytes appended so far, without tail padding:
// the offset the next byte-aligned field would take.
func (p *ParamBuffer) Len() int { return len(p.b) }

// Bytes returns the struct's bytes padded to its alignment. The result is
// a copy; the buffer can go on being appended to.
func (p *ParamBuffer) Bytes() []byte {
	out := append([]byte(nil), p.b...)
	for p.maxAlign > 0 && len(out)%p.maxAlign != 0 {
		out = append(out, 0)
	}
	return out
}

// Reset empties the buffer for reuse.
func (p *ParamBuffer) Reset() {
	p.b = p.b[:0]
	p.maxAlign = 0
}
