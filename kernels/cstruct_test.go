package kernels

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"
)

// TestCStructLayout checks offsets, sizes and declarations against what the
// C++ compiler gives for a few hand-laid-out structs.
func TestCStructLayout(t *testing.T) {
	type mixed struct {
		A int32
		B uint64
		C float32
		M [3]byte
	}
	tests := []struct {
		name  string
		s     *CStruct[mixed]
		offs  map[string]int
		size  int
		decl  string
		bytes []byte
	}{
		{
			name: "padding before a wide field and at the tail",
			s: NewCStruct("S", 0,
				CI32("int", "a", "", func(p *mixed) int32 { return p.A }),
				CU64("u64", "b", "the pointer", func(p *mixed) uint64 { return p.B }),
				CF32("c", "", func(p *mixed) float32 { return p.C })),
			offs: map[string]int{"a": 0, "b": 8, "c": 16},
			size: 24,
			decl: "struct S {\n  int a;\n  u64 b;  // the pointer\n  float c;\n};\n",
			bytes: []byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0, 0,
				0, 0, 0x80, 0x3f, 0, 0, 0, 0},
		},
		{
			name: "declared alignment and a blob",
			s: NewCStruct("T", 64,
				CBlob("TensorMap", "m", "", 3, 4, func(p *mixed, b []byte) { copy(b, p.M[:]) }),
				CI32("int", "x", "", func(p *mixed) int32 { return p.A }).Joined()),
			offs:  map[string]int{"m": 0, "x": 4},
			size:  64,
			decl:  "struct __align__(64) T {\n  TensorMap m, x;\n};\n",
			bytes: append([]byte{7, 8, 9, 0, 0xff, 0xff, 0xff, 0xff}, make([]byte, 56)...),
		},
	}
	v := mixed{A: -1, B: 0x0201, C: 1, M: [3]byte{7, 8, 9}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.s.DocColumn = 7
			for name, want := range tc.offs {
				if got, ok := tc.s.Offset(name); !ok || got != want {
					t.Errorf("offset of %s = %d (%v), want %d", name, got, ok, want)
				}
			}
			if tc.s.Size() != tc.size {
				t.Errorf("size %d, want %d", tc.s.Size(), tc.size)
			}
			if got := tc.s.Decl(); got != tc.decl {
				t.Errorf("declaration\n%s\nwant\n%s", got, tc.decl)
			}
			b := bytes.Repeat([]byte{0xee}, tc.size)
			tc.s.PackInto(b, &v)
			if !bytes.Equal(b, tc.bytes) || !bytes.Equal(tc.s.Pack(&v), tc.bytes) {
				t.Errorf("bytes % x, want % x", b, tc.bytes)
			}
		})
	}
}

// layoutCheck is one field's expected offset, size and value in a packed
// struct.
type layoutCheck struct {
	name      string
	off, size int
	want      uint64
}

// checkLayout checks each field of checks in the bytes b that s packed: its
// offset, its value, and its member in the declaration.
func checkLayout[T any](t *testing.T, s *CStruct[T], b []byte, checks []layoutCheck) {
	t.Helper()
	decl := s.Decl()
	for _, c := range checks {
		off, ok := s.Offset(c.name)
		if !ok || off != c.off {
			t.Errorf("field %s at %d (%v), want %d", c.name, off, ok, c.off)
			continue
		}
		got := uint64(binary.LittleEndian.Uint32(b[off:]))
		if c.size == 8 {
			got = binary.LittleEndian.Uint64(b[off:])
		}
		if got != c.want {
			t.Errorf("field %s = %#x, want %#x", c.name, got, c.want)
		}
		if !strings.Contains(decl, " "+c.name+";") && !strings.Contains(decl, " "+c.name+",") {
			t.Errorf("C struct lacks %s", c.name)
		}
	}
}

func TestCStructAsserts(t *testing.T) {
	s := NewCStruct("A", 8, CI32[int32]("int", "n", "", func(p *int32) int32 { return *p }))
	if got, want := s.SizeAssert(), "static_assert(sizeof(A) == 8, \"A size differs from the Go packing\");\n"; got != want {
		t.Errorf("SizeAssert = %q, want %q", got, want)
	}
	if got, want := s.OffsetAsserts(), "#ifndef __CUDACC_RTC__\nstatic_assert(__builtin_offsetof(A, n) == 0, \"A.n offset\");\n#endif\n"; got != want {
		t.Errorf("OffsetAsserts = %q, want %q", got, want)
	}
	if got, want := s.OneLineDecl(), "struct A { int n; };"; got != want {
		t.Errorf("OneLineDecl = %q, want %q", got, want)
	}
}
