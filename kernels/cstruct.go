package kernels

import (
	"encoding/binary"
	"fmt"
	"math"
	"strings"
)

// CStruct is the one description of a kernel argument: a C struct passed by
// value. Its field list gives both the C declaration the generated source
// holds (Decl) and the bytes a launch passes (Pack), laid out as the CUDA
// C++ compiler lays the struct out on a 64-bit host: each field at the next
// multiple of its alignment, the whole padded to the largest alignment.
// Because both come from the same list, they cannot disagree.
//
// T is the Go type whose values fill the struct; every field reads its
// value from a *T.
type CStruct[T any] struct {
	// Name is the C struct's name.
	Name string
	// Align is the alignment declared with __align__ (0: none); the struct's
	// alignment is the larger of it and its fields'.
	Align int
	// TypeWidth and DocColumn format the declaration: each field's type is
	// padded to TypeWidth characters, and a field's comment starts after its
	// declaration padded to DocColumn characters (then " // ").
	TypeWidth, DocColumn int

	fields []CField[T]
	offs   []int
	size   int
}

// CField is one member of a CStruct: its C type and name, an optional
// comment, and how its value is read from a *T. Make fields with CPtr,
// CI64, CU64, CI32, CU32, CF32 and CBlob.
type CField[T any] struct {
	ctype, name, doc string
	size, align      int
	// join declares the field on the line of the previous one (both of
	// its type: "long long sb, sr, sh;").
	join bool
	bits func(*T) uint64  // scalars: the value's bits
	put  func(*T, []byte) // CBlob fields: writes the value's bytes
}

// CPtr is a device pointer of C type ctype ("const T*", "u64", ...).
func CPtr[T any](ctype, name, doc string, get func(*T) uint64) CField[T] {
	return CField[T]{ctype: ctype, name: name, doc: doc, size: 8, align: 8, bits: get}
}

// CU64 is an unsigned 64-bit integer of C type ctype.
func CU64[T any](ctype, name, doc string, get func(*T) uint64) CField[T] {
	return CPtr(ctype, name, doc, get)
}

// CI64 is a signed 64-bit integer of C type ctype ("long long", "i64").
func CI64[T any](ctype, name, doc string, get func(*T) int64) CField[T] {
	return CField[T]{ctype: ctype, name: name, doc: doc, size: 8, align: 8, bits: func(p *T) uint64 { return uint64(get(p)) }}
}

// CI32 is a signed 32-bit integer of C type ctype ("int").
func CI32[T any](ctype, name, doc string, get func(*T) int32) CField[T] {
	return CField[T]{ctype: ctype, name: name, doc: doc, size: 4, align: 4, bits: func(p *T) uint64 { return uint64(uint32(get(p))) }}
}

// CU32 is an unsigned 32-bit integer of C type ctype ("unsigned", "u32").
func CU32[T any](ctype, name, doc string, get func(*T) uint32) CField[T] {
	return CField[T]{ctype: ctype, name: name, doc: doc, size: 4, align: 4, bits: func(p *T) uint64 { return uint64(get(p)) }}
}

// CF32 is a float.
func CF32[T any](name, doc string, get func(*T) float32) CField[T] {
	return CField[T]{ctype: "float", name: name, doc: doc, size: 4, align: 4, bits: func(p *T) uint64 { return uint64(math.Float32bits(get(p))) }}
}

// CBlob is a member of C type ctype held as size bytes with the given
// alignment (a nested struct, a tensor map); put writes them into a slice
// of size zeroed bytes.
func CBlob[T any](ctype, name, doc string, size, align int, put func(*T, []byte)) CField[T] {
	return CField[T]{ctype: ctype, name: name, doc: doc, size: size, align: align, put: put}
}

// Joined returns f declared on the line of the field before it, which must
// have the same C type.
func (f CField[T]) Joined() CField[T] {
	f.join = true
	return f
}

// NewCStruct returns the struct of the fields, in declaration order, with
// its layout computed.
func NewCStruct[T any](name string, align int, fields ...CField[T]) *CStruct[T] {
	s := &CStruct[T]{Name: name, Align: align, fields: fields, offs: make([]int, len(fields))}
	off, al := 0, max(align, 1)
	for i, f := range fields {
		off = roundUp(off, f.align)
		s.offs[i] = off
		off += f.size
		al = max(al, f.align)
	}
	s.size = roundUp(off, al)
	return s
}

// Size returns the size in bytes of the struct (sizeof).
func (s *CStruct[T]) Size() int { return s.size }

// Offset returns the byte offset of the field name, and false if the
// struct has no such field.
func (s *CStruct[T]) Offset(name string) (int, bool) {
	for i, f := range s.fields {
		if f.name == name {
			return s.offs[i], true
		}
	}
	return 0, false
}

// Pack returns the struct's bytes for p (little-endian).
func (s *CStruct[T]) Pack(p *T) []byte {
	b := make([]byte, s.size)
	s.PackInto(b, p)
	return b
}

// PackInto writes the struct's bytes for p into b, which must hold Size
// bytes; padding bytes are zeroed. It allocates nothing beyond what CBlob
// fields' put functions do.
func (s *CStruct[T]) PackInto(b []byte, p *T) {
	b = b[:s.size]
	clear(b)
	for i, f := range s.fields {
		at := b[s.offs[i] : s.offs[i]+f.size]
		switch {
		case f.put != nil:
			f.put(p, at)
		case f.size == 8:
			binary.LittleEndian.PutUint64(at, f.bits(p))
		default:
			binary.LittleEndian.PutUint32(at, uint32(f.bits(p)))
		}
	}
}

// Decl returns the C declaration of the struct: one line per field (or per
// run of joined fields), with its comment where it has one.
func (s *CStruct[T]) Decl() string {
	var b strings.Builder
	if s.Align > 0 {
		fmt.Fprintf(&b, "struct __align__(%d) %s {\n", s.Align, s.Name)
	} else {
		fmt.Fprintf(&b, "struct %s {\n", s.Name)
	}
	for i := 0; i < len(s.fields); {
		f := s.fields[i]
		names := []string{f.name}
		doc := f.doc
		for i++; i < len(s.fields) && s.fields[i].join; i++ {
			names = append(names, s.fields[i].name)
			if s.fields[i].doc != "" {
				doc = s.fields[i].doc
			}
		}
		decl := fmt.Sprintf("%-*s %s;", s.TypeWidth, f.ctype, strings.Join(names, ", "))
		if doc == "" {
			fmt.Fprintf(&b, "  %s\n", decl)
		} else {
			fmt.Fprintf(&b, "  %-*s // %s\n", s.DocColumn, decl, doc)
		}
	}
	b.WriteString("};\n")
	return b.String()
}

// OneLineDecl returns the C declaration of the struct on one line, without
// comments.
func (s *CStruct[T]) OneLineDecl() string {
	var b strings.Builder
	fmt.Fprintf(&b, "struct %s {", s.Name)
	for _, f := range s.fields {
		fmt.Fprintf(&b, " %s %s;", f.ctype, f.name)
	}
	b.WriteString(" };")
	return b.String()
}

// SizeAssert returns the static_assert that pins sizeof(Name) to Size.
func (s *CStruct[T]) SizeAssert() string {
	return fmt.Sprintf("static_assert(sizeof(%[1]s) == %[2]d, \"%[1]s size differs from the Go packing\");\n", s.Name, s.size)
}

// OffsetAsserts returns the static_asserts that pin every field's offset,
// for nvcc only: NVRTC's front end lacks __builtin_offsetof.
func (s *CStruct[T]) OffsetAsserts() string {
	var b strings.Builder
	b.WriteString("#ifndef __CUDACC_RTC__\n")
	for i, f := range s.fields {
		fmt.Fprintf(&b, "static_assert(__builtin_offsetof(%[1]s, %[2]s) == %[3]d, \"%[1]s.%[2]s offset\");\n", s.Name, f.name, s.offs[i])
	}
	b.WriteString("#endif\n")
	return b.String()
}
