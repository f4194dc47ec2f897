package npy

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/half"
)

// file assembles a .npy file by hand: version major.0, the given dictionary
// text (padded with spaces and a newline to a multiple of 64 bytes when pad is
// set) and the data bytes.
func file(major byte, dict string, pad bool, data []byte) []byte {
	var b bytes.Buffer
	b.WriteString(magic)
	b.WriteByte(major)
	b.WriteByte(0)
	pre := 10
	if major >= 2 {
		pre = 12
	}
	text := dict
	if pad {
		total := (pre + len(dict) + 1 + 63) / 64 * 64
		text = dict + strings.Repeat(" ", total-pre-len(dict)-1) + "\n"
	}
	if major == 1 {
		binary.Write(&b, binary.LittleEndian, uint16(len(text)))
	} else {
		binary.Write(&b, binary.LittleEndian, uint32(len(text)))
	}
	b.WriteString(text)
	b.Write(data)
	return b.Bytes()
}

func sameShape(a, b []int) bool {
	return len(a) == len(b) && (len(a) == 0 || reflect.DeepEqual(a, b))
}

func f4bytes(xs ...float32) []byte {
	b := make([]byte, 0, 4*len(xs))
	for _, x := range xs {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(x))
	}
	return b
}

func f8bytes(xs ...float64) []byte {
	b := make([]byte, 0, 8*len(xs))
	for _, x := range xs {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(x))
	}
	return b
}

func f2bytes(xs ...float32) []byte {
	b := make([]byte, 0, 2*len(xs))
	for _, x := range xs {
		b = binary.LittleEndian.AppendUint16(b, uint16(half.Float16FromFloat32(x)))
	}
	return b
}

// TestNumPyBytes checks the exact bytes NumPy writes for
// np.save(f, np.arange(6, dtype='<f4').reshape(2, 3)).
func TestNumPyBytes(t *testing.T) {
	var b bytes.Buffer
	if err := WriteFloat32(&b, []int{2, 3}, []float32{0, 1, 2, 3, 4, 5}); err != nil {
		t.Fatal(err)
	}
	dict := "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"
	want := "\x93NUMPY\x01\x00v\x00" + dict + strings.Repeat(" ", 128-10-len(dict)-1) + "\n"
	got := b.Bytes()
	if string(got[:128]) != want {
		t.Fatalf("header\n got %q\nwant %q", got[:128], want)
	}
	if !bytes.Equal(got[128:], f4bytes(0, 1, 2, 3, 4, 5)) {
		t.Fatalf("data % x", got[128:])
	}
}

func TestReadHandMade(t *testing.T) {
	tests := []struct {
		name  string
		in    []byte
		dtype attn.DType
		shape []int
		want  []float32
	}{
		{"v1 f4", file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }", true, f4bytes(1, -2, 3.5, 1e-30)),
			attn.Float32, []int{2, 2}, []float32{1, -2, 3.5, 1e-30}},
		{"v2 f4", file(2, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", true, f4bytes(1, 2, 3)),
			attn.Float32, []int{3}, []float32{1, 2, 3}},
		{"v3 f4 utf8 padding", file(3, "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1), }  ", false, f4bytes(7)),
			attn.Float32, []int{1, 1}, []float32{7}},
		{"f2", file(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (4,), }", true, f2bytes(1, 0.5, -65504, 6e-8)),
			attn.Float16, []int{4}, []float32{1, 0.5, -65504, half.RoundFloat16(6e-8)}},
		{"f8 rounded", file(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", true, f8bytes(0.1, -1e300)),
			attn.Float32, []int{2}, []float32{float32(0.1), float32(math.Inf(-1))}},
		{"keys reordered, double quotes, no trailing comma", file(1, `{"shape": (1, 2), "fortran_order": False, "descr": "<f4"}`, true, f4bytes(5, 6)),
			attn.Float32, []int{1, 2}, []float32{5, 6}},
		{"scalar", file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (), }", true, f4bytes(42)),
			attn.Float32, []int{}, []float32{42}},
		{"empty", file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 5), }", true, nil),
			attn.Float32, []int{0, 5}, []float32{}},
		{"unpadded header", file(1, "{'descr':'<f4','fortran_order':False,'shape':(1,)}", false, f4bytes(3)),
			attn.Float32, []int{1}, []float32{3}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Read(bytes.NewReader(tc.in))
			if err != nil {
				t.Fatal(err)
			}
			if got.DType != tc.dtype {
				t.Errorf("dtype %v, want %v", got.DType, tc.dtype)
			}
			if !sameShape(got.Shape, tc.shape) {
				t.Errorf("shape %v, want %v", got.Shape, tc.shape)
			}
			if vals := got.Float32s(); !reflect.DeepEqual(vals, tc.want) {
				t.Errorf("values %v, want %v", vals, tc.want)
			}
			if err := got.CheckLayout("got"); err != nil {
				t.Error(err)
			}
		})
	}
}

func TestReadErrors(t *testing.T) {
	good := "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"
	v4 := file(1, good, true, f4bytes(1, 2)) // format version 4.0
	v4[6] = 4
	v11 := file(1, good, true, f4bytes(1, 2)) // format version 1.1
	v11[7] = 1
	tests := []struct {
		name string
		in   []byte
		want error
		msg  string
	}{
		{"empty input", nil, ErrFormat, "magic"},
		{"bad magic", []byte("PK\x03\x04 not numpy at all"), ErrFormat, "magic"},
		{"short preamble", []byte("\x93NUM"), ErrTruncated, "preamble"},
		{"magic only", file(1, good, true, nil)[:6:6], ErrTruncated, "preamble"},
		{"truncated header", file(1, good, true, nil)[:30], ErrTruncated, "header"},
		{"truncated data", file(1, good, true, f4bytes(1)), ErrTruncated, "needs 8 bytes, file has 4"},
		{"truncated f8 data", file(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 2), }", true, f8bytes(1, 2, 3)), ErrTruncated, "needs 32 bytes"},
		{"fortran order", file(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", true, f4bytes(1, 2, 3, 4)), ErrUnsupported, "fortran_order"},
		{"big-endian f4", file(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }", true, f4bytes(1)), ErrUnsupported, "big-endian"},
		{"big-endian f8", file(1, "{'descr': '>f8', 'fortran_order': False, 'shape': (1,), }", true, f8bytes(1)), ErrUnsupported, "big-endian"},
		{"int32", file(1, "{'descr': '<i4', 'fortran_order': False, 'shape': (1,), }", true, f4bytes(1)), ErrUnsupported, `"<i4"`},
		{"complex", file(1, "{'descr': '<c8', 'fortran_order': False, 'shape': (1,), }", true, f8bytes(1)), ErrUnsupported, `"<c8"`},
		{"native order", file(1, "{'descr': '=f4', 'fortran_order': False, 'shape': (1,), }", true, f4bytes(1)), ErrUnsupported, "byte order"},
		{"structured", file(1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }", true, f4bytes(1)), ErrFormat, "quoted string"},
		{"missing shape", file(1, "{'descr': '<f4', 'fortran_order': False, }", true, nil), ErrFormat, `"shape"`},
		{"duplicate key", file(1, "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", true, f4bytes(1)), ErrFormat, "duplicate"},
		{"unknown key", file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}", true, f4bytes(1)), ErrFormat, "unexpected key"},
		{"shape not a tuple", file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3), }", true, f4bytes(1, 2, 3)), ErrFormat, "trailing comma"},
		{"negative shape", file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", true, nil), ErrFormat, "non-negative"},
		{"huge shape", file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", true, nil), ErrFormat, "out of range"},
		{"overflowing shape", file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000000, 100000000000000), }", true, nil), ErrFormat, "too many"},
		{"bad bool", file(1, "{'descr': '<f4', 'fortran_order': false, 'shape': (1,), }", true, f4bytes(1)), ErrFormat, "True or False"},
		{"text after dict", file(1, good+" junk", false, f4bytes(1, 2)), ErrFormat, "after the dictionary"},
		{"non-ascii v1 header", file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), } é", false, f4bytes(1, 2)), ErrFormat, "ASCII"},
		{"version 4.0", v4, ErrUnsupported, "version 4.0"},
		{"version 1.1", v11, ErrUnsupported, "version 1.1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Read(bytes.NewReader(tc.in))
			if !errors.Is(err, tc.want) {
				t.Fatalf("error %v, want one wrapping %v", err, tc.want)
			}
			if !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("error %q does not mention %q", err, tc.msg)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Errorf("error %q spans several lines", err)
			}
		})
	}
}

func TestRoundTrip(t *testing.T) {
	vals := []float32{0, 1, -1, 0.1, 3.14159, -2.5e-8, 65504, 1e30, float32(math.Inf(1)), 7, 8, 9}
	strided := attn.FromFloat32(attn.Float32, vals, 3, 4)
	// The transpose view [4, 3] of the [3, 4] buffer, written in its logical order.
	transposed := attn.Tensor{DType: attn.Float32, Shape: []int{4, 3}, Strides: []int{1, 4}, F32: strided.F32}
	tests := []struct {
		name      string
		t         attn.Tensor
		wantDType attn.DType
	}{
		{"fp32 2d", attn.FromFloat32(attn.Float32, vals, 3, 4), attn.Float32},
		{"fp32 4d", attn.FromFloat32(attn.Float32, vals, 1, 2, 3, 2), attn.Float32},
		{"fp32 1d", attn.FromFloat32(attn.Float32, vals, 12), attn.Float32},
		{"fp32 scalar", attn.FromFloat32(attn.Float32, vals[4:5]), attn.Float32},
		{"fp32 empty", attn.New(attn.Float32, 2, 0, 3), attn.Float32},
		{"fp16", attn.FromFloat32(attn.Float16, vals, 2, 6), attn.Float16},
		{"bf16 widened", attn.FromFloat32(attn.BFloat16, vals, 4, 3), attn.Float32},
		{"strided view", transposed, attn.Float32},
		{"fp16 strided view", attn.Tensor{DType: attn.Float16, Shape: []int{2, 2}, Strides: []int{6, 2}, Offset: 1,
			Bits: attn.FromFloat32(attn.Float16, vals, 12).Bits}, attn.Float16},
	}
	dir := t.TempDir()
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var b bytes.Buffer
			if err := Write(&b, tc.t); err != nil {
				t.Fatal(err)
			}
			if hl := binary.LittleEndian.Uint16(b.Bytes()[8:]); (10+int(hl))%64 != 0 {
				t.Errorf("data starts at byte %d, not a multiple of 64", 10+int(hl))
			}
			got, err := Read(&b)
			if err != nil {
				t.Fatal(err)
			}
			if b.Len() != 0 {
				t.Errorf("%d bytes left unread", b.Len())
			}
			check := func(got attn.Tensor) {
				t.Helper()
				if got.DType != tc.wantDType || !sameShape(got.Shape, tc.t.Shape) {
					t.Errorf("got %v %v, want %v %v", got.DType, got.Shape, tc.wantDType, tc.t.Shape)
				}
				if g, w := got.Float32s(), tc.t.Float32s(); !reflect.DeepEqual(g, w) {
					t.Errorf("values %v, want %v", g, w)
				}
			}
			check(got)
			path := filepath.Join(dir, string(rune('a'+i))+".npy")
			if err := WriteFile(path, tc.t); err != nil {
				t.Fatal(err)
			}
			fromFile, err := ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			check(fromFile)
		})
	}
}

func TestConcatenated(t *testing.T) {
	var b bytes.Buffer
	for i := 1; i <= 3; i++ {
		if err := WriteFloat32(&b, []int{i}, make([]float32, i)); err != nil {
			t.Fatal(err)
		}
	}
	for i := 1; i <= 3; i++ {
		got, err := Read(&b)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got.Shape, []int{i}) {
			t.Fatalf("array %d has shape %v", i, got.Shape)
		}
	}
}

func TestLargeHeaderVersion2(t *testing.T) {
	// A 30000-dimensional shape of ones does not fit a 2-byte header length.
	shape := make([]int, 30000)
	for i := range shape {
		shape[i] = 1
	}
	var b bytes.Buffer
	if err := WriteFloat32(&b, shape, []float32{2.5}); err != nil {
		t.Fatal(err)
	}
	if v := b.Bytes()[6]; v != 2 {
		t.Fatalf("version %d, want 2", v)
	}
	if hl := binary.LittleEndian.Uint32(b.Bytes()[8:]); (12+int(hl))%64 != 0 {
		t.Errorf("data starts at byte %d, not a multiple of 64", 12+int(hl))
	}
	got, err := Read(&b)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Shape) != len(shape) || got.Float32s()[0] != 2.5 {
		t.Fatalf("got rank %d value %v", len(got.Shape), got.Float32s())
	}
}

func TestWriteErrors(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want error
	}{
		{"count mismatch", WriteFloat32(&bytes.Buffer{}, []int{2, 2}, []float32{1}), attn.ErrShape},
		{"negative dim", WriteFloat32(&bytes.Buffer{}, []int{-1}, nil), attn.ErrShape},
		{"tensor past its data", Write(&bytes.Buffer{}, attn.Tensor{DType: attn.Float32, Shape: []int{3}, F32: []float32{1}}), attn.ErrLayout},
		{"missing dir", WriteFile(filepath.Join(t.TempDir(), "no", "such.npy"), attn.New(attn.Float32, 1)), nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.err == nil {
				t.Fatal("no error")
			}
			if tc.want != nil && !errors.Is(tc.err, tc.want) {
				t.Fatalf("error %v, want one wrapping %v", tc.err, tc.want)
			}
		})
	}
}

func TestReadFileErrorNamesFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "q.npy")
	if err := WriteFloat32File(path, []int{2}, []float32{1, 2}); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadFile(path); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(t.TempDir(), "short.npy")
	if err := os.WriteFile(bad, data[:len(data)-1], 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadFile(bad); !errors.Is(err, ErrTruncated) || !strings.Contains(err.Error(), "short.npy") {
		t.Errorf("error %v: want ErrTruncated naming short.npy", err)
	}
	_, err = ReadFile(filepath.Join(t.TempDir(), "absent.npy"))
	if err == nil || !strings.Contains(err.Error(), "absent.npy") {
		t.Errorf("error %v does not name the file", err)
	}
}
