// Package npy reads and writes NumPy .npy files holding the tensors flashattn
// computes with.
//
// Read accepts format versions 1.0, 2.0 and 3.0, C (row-major) order, and the
// little-endian dtypes '<f4' (returned as an attn.Float32 tensor), '<f2'
// (returned as attn.Float16, bit for bit) and '<f8' (rounded to float32 to
// nearest). Anything else fails with an error that wraps one of the
// sentinels:
//
//   - ErrFormat: not a .npy file, or a header that cannot be parsed;
//   - ErrTruncated: the file ends before the data the header announces;
//   - ErrUnsupported: a well-formed file this package does not read:
//     fortran_order True, big-endian data, or a dtype other than the three above.
//
// Write produces version 1.0 files (2.0 when the header does not fit), with
// the header padded so the data starts at a multiple of 64 bytes, as NumPy
// itself writes them. float32 tensors are written as '<f4' and float16
// tensors as '<f2'; NumPy has no bfloat16, so bfloat16 tensors are written as
// '<f4', which holds every bfloat16 value exactly.
package npy

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"
	"strings"

	"github.com/flashattn/flashattn/attn"
)

// Sentinel errors; test for them with errors.Is.
var (
	// ErrFormat reports input that is not a well-formed .npy file.
	ErrFormat = errors.New("npy: bad format")
	// ErrTruncated reports a file shorter than its header announces.
	ErrTruncated = errors.New("npy: truncated")
	// ErrUnsupported reports a well-formed file with a layout or dtype this package does not read.
	ErrUnsupported = errors.New("npy: unsupported")
)

// magic is the six bytes every .npy file starts with.
const magic = "\x93NUMPY"

// maxHeaderLen bounds the header a reader accepts (NumPy itself refuses
// headers above 10000 bytes unless told otherwise; this leaves room).
const maxHeaderLen = 1 << 20

// maxDim bounds one dimension of a shape, so that size computations cannot overflow.
const maxDim = 1 << 48

func errorf(sentinel error, format string, args ...any) error {
	return fmt.Errorf("%s: %w", fmt.Sprintf(format, args...), sentinel)
}

// Header is the parsed dictionary of a .npy header.
type Header struct {
	// Descr is the NumPy dtype string, such as "<f4".
	Descr string
	// FortranOrder reports column-major data.
	FortranOrder bool
	// Shape is the array shape; empty for a 0-dimensional array.
	Shape []int
	// Major and Minor are the format version (1.0, 2.0 or 3.0).
	Major, Minor byte
}

// ReadHeader reads the magic string, the version and the header dictionary
// from r, leaving r at the first byte of the data.
func ReadHeader(r io.Reader) (Header, error) {
	var pre [8]byte
	n, err := io.ReadFull(r, pre[:])
	if m := min(n, len(magic)); string(pre[:m]) != magic[:m] || n == 0 {
		return Header{}, errorf(ErrFormat, "missing the \\x93NUMPY magic string (starts with %q)", pre[:m])
	}
	if err != nil {
		return Header{}, errorf(ErrTruncated, "file ends inside the preamble (%d of 8 bytes)", n)
	}
	h := Header{Major: pre[6], Minor: pre[7]}
	var hlen int
	switch h.Major {
	case 1:
		var b [2]byte
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return h, errorf(ErrTruncated, "file ends inside the header length")
		}
		hlen = int(binary.LittleEndian.Uint16(b[:]))
	case 2, 3:
		var b [4]byte
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return h, errorf(ErrTruncated, "file ends inside the header length")
		}
		hlen = int(binary.LittleEndian.Uint32(b[:]))
	default:
		return h, errorf(ErrUnsupported, "format version %d.%d (want 1.0, 2.0 or 3.0)", h.Major, h.Minor)
	}
	if h.Minor != 0 {
		return h, errorf(ErrUnsupported, "format version %d.%d (want 1.0, 2.0 or 3.0)", h.Major, h.Minor)
	}
	if hlen > maxHeaderLen {
		return h, errorf(ErrFormat, "header length %d exceeds %d bytes", hlen, maxHeaderLen)
	}
	text := make([]byte, hlen)
	if n, err := io.ReadFull(r, text); err != nil {
		return h, errorf(ErrTruncated, "file ends inside the header (%d of %d bytes)", n, hlen)
	}
	if h.Major < 3 {
		for _, c := range text {
			if c >= 0x80 {
				return h, errorf(ErrFormat, "version %d.0 header is not ASCII", h.Major)
			}
		}
	}
	if err := h.parse(string(text)); err != nil {
		return h, err
	}
	return h, nil
}

// parse fills h from the header's Python dictionary literal.
func (h *Header) parse(text string) error {
	p := &parser{s: text}
	seen := map[string]bool{}
	p.space()
	if !p.eat('{') {
		return p.fail("want '{'")
	}
	for {
		p.space()
		if p.eat('}') {
			break
		}
		key, err := p.str()
		if err != nil {
			return err
		}
		p.space()
		if !p.eat(':') {
			return p.fail("want ':' after key " + strconv.Quote(key))
		}
		p.space()
		switch key {
		case "descr":
			if h.Descr, err = p.str(); err != nil {
				return err
			}
		case "fortran_order":
			if h.FortranOrder, err = p.boolean(); err != nil {
				return err
			}
		case "shape":
			if h.Shape, err = p.tuple(); err != nil {
				return err
			}
		default:
			return p.fail("unexpected key " + strconv.Quote(key))
		}
		if seen[key] {
			return p.fail("duplicate key " + strconv.Quote(key))
		}
		seen[key] = true
		p.space()
		if p.eat(',') {
			continue
		}
		p.space()
		if !p.eat('}') {
			return p.fail("want ',' or '}'")
		}
		break
	}
	if rest := strings.TrimSpace(p.s[p.i:]); rest != "" {
		return p.fail("text after the dictionary")
	}
	for _, k := range []string{"descr", "fortran_order", "shape"} {
		if !seen[k] {
			return errorf(ErrFormat, "header has no %q key", k)
		}
	}
	return nil
}

// parser scans the restricted Python literal syntax of .npy headers.
type parser struct {
	s string
	i int
}

func (p *parser) fail(msg string) error {
	return errorf(ErrFormat, "header %q: %s at byte %d", p.s, msg, p.i)
}

func (p *parser) space() {
	for p.i < len(p.s) && strings.IndexByte(" \t\r\n", p.s[p.i]) >= 0 {
		p.i++
	}
}

func (p *parser) eat(c byte) bool {
	if p.i < len(p.s) && p.s[p.i] == c {
		p.i++
		return true
	}
	return false
}

// str reads a single- or double-quoted string without escapes.
func (p *parser) str() (string, error) {
	if p.i >= len(p.s) || (p.s[p.i] != '\'' && p.s[p.i] != '"') {
		return "", p.fail("want a quoted string")
	}
	q := p.s[p.i]
	end := strings.IndexByte(p.s[p.i+1:], q)
	if end < 0 {
		return "", p.fail("unterminated string")
	}
	v := p.s[p.i+1 : p.i+1+end]
	if strings.IndexByte(v, '\\') >= 0 {
		return "", p.fail("escape in string")
	}
	p.i += end + 2
	return v, nil
}

func (p *parser) boolean() (bool, error) {
	switch {
	case strings.HasPrefix(p.s[p.i:], "True"):
		p.i += 4
		return true, nil
	case strings.HasPrefix(p.s[p.i:], "False"):
		p.i += 5
		return false, nil
	}
	return false, p.fail("want True or False")
}

// tuple reads a tuple of non-negative integers: (), (n,), (n, m), ….
func (p *parser) tuple() ([]int, error) {
	if !p.eat('(') {
		return nil, p.fail("want '(' for the shape")
	}
	shape := []int{}
	for {
		p.space()
		if p.eat(')') {
			return shape, nil
		}
		j := p.i
		for j < len(p.s) && p.s[j] >= '0' && p.s[j] <= '9' {
			j++
		}
		if j == p.i {
			return nil, p.fail("want a non-negative integer in the shape")
		}
		n, err := strconv.Atoi(p.s[p.i:j])
		if err != nil || n > maxDim {
			return nil, p.fail("shape dimension out of range")
		}
		p.i = j
		shape = append(shape, n)
		p.space()
		if p.eat(',') {
			continue
		}
		p.space()
		if !p.eat(')') {
			return nil, p.fail("want ',' or ')' in the shape")
		}
		if len(shape) == 1 {
			return nil, p.fail("a one-element shape needs a trailing comma")
		}
		return shape, nil
	}
}

// elemType resolves a descr to the tensor dtype it is read as and the size of
// one stored element.
func elemType(descr string) (dt attn.DType, size int, err error) {
	if len(descr) < 2 {
		return 0, 0, errorf(ErrUnsupported, "dtype %q", descr)
	}
	order, kind := descr[0], descr[1:]
	switch order {
	case '<', '|', '=':
	case '>':
		if kind == "f2" || kind == "f4" || kind == "f8" {
			return 0, 0, errorf(ErrUnsupported, "big-endian dtype %q (convert with arr.astype('<%s'))", descr, kind)
		}
		return 0, 0, errorf(ErrUnsupported, "dtype %q (want '<f4', '<f2' or '<f8')", descr)
	default:
		return 0, 0, errorf(ErrUnsupported, "dtype %q (want '<f4', '<f2' or '<f8')", descr)
	}
	if order != '<' {
		return 0, 0, errorf(ErrUnsupported, "dtype %q without explicit little-endian byte order (want '<f4', '<f2' or '<f8')", descr)
	}
	switch kind {
	case "f4":
		return attn.Float32, 4, nil
	case "f2":
		return attn.Float16, 2, nil
	case "f8":
		return attn.Float32, 8, nil
	}
	return 0, 0, errorf(ErrUnsupported, "dtype %q (want '<f4', '<f2' or '<f8')", descr)
}

// Read reads one array from r. It consumes exactly the bytes of one .npy
// file, so several arrays written back to back can be read in turn.
func Read(r io.Reader) (attn.Tensor, error) {
	h, err := ReadHeader(r)
	if err != nil {
		return attn.Tensor{}, err
	}
	return readData(r, h)
}

func readData(r io.Reader, h Header) (attn.Tensor, error) {
	dt, size, err := elemType(h.Descr)
	if err != nil {
		return attn.Tensor{}, err
	}
	if h.FortranOrder {
		// NumPy marks an array fortran_order only when it is not also
		// C-contiguous, so the data really is column-major.
		return attn.Tensor{}, errorf(ErrUnsupported, "fortran_order True (save with np.ascontiguousarray first)")
	}
	n := 1
	for _, d := range h.Shape {
		if d != 0 && n > math.MaxInt/(8*d) {
			return attn.Tensor{}, errorf(ErrFormat, "shape %v has too many elements", h.Shape)
		}
		n *= d
	}
	want := int64(n) * int64(size)
	var buf bytes.Buffer
	got, err := io.CopyN(&buf, r, want)
	if err != nil && err != io.EOF {
		return attn.Tensor{}, fmt.Errorf("npy: reading data: %w", err)
	}
	if got < want {
		return attn.Tensor{}, errorf(ErrTruncated, "data of shape %v %s needs %d bytes, file has %d", h.Shape, h.Descr, want, got)
	}
	b := buf.Bytes()
	t := attn.New(dt, h.Shape...)
	switch {
	case dt == attn.Float16:
		for i := range t.Bits {
			t.Bits[i] = binary.LittleEndian.Uint16(b[2*i:])
		}
	case size == 4:
		for i := range t.F32 {
			t.F32[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
		}
	default: // '<f8'
		for i := range t.F32 {
			t.F32[i] = float32(math.Float64frombits(binary.LittleEndian.Uint64(b[8*i:])))
		}
	}
	return t, nil
}

// ReadFile reads the .npy file at path. Errors name the file.
func ReadFile(path string) (attn.Tensor, error) {
	f, err := os.Open(path)
	if err != nil {
		return attn.Tensor{}, err
	}
	defer f.Close()
	t, err := Read(bufio.NewReader(f))
	if err != nil {
		return attn.Tensor{}, fmt.Errorf("%s: %w", path, err)
	}
	return t, nil
}

// header returns the padded header bytes (magic through the newline) for a
// C-order array of the given descr and shape.
func header(descr string, shape []int) []byte {
	var d strings.Builder
	fmt.Fprintf(&d, "{'descr': '%s', 'fortran_order': False, 'shape': (", descr)
	for i, s := range shape {
		if i > 0 {
			d.WriteString(", ")
		}
		d.WriteString(strconv.Itoa(s))
	}
	if len(shape) == 1 {
		d.WriteString(",")
	}
	d.WriteString("), }")
	dict := d.String()
	// Version 1.0 has a 2-byte length; fall back to 2.0 for huge headers.
	major, pre := byte(1), 10
	if total := pre + len(dict) + 1; (total+63)/64*64-pre > math.MaxUint16 {
		major, pre = 2, 12
	}
	total := (pre + len(dict) + 1 + 63) / 64 * 64
	hlen := total - pre
	out := make([]byte, 0, total)
	out = append(out, magic...)
	out = append(out, major, 0)
	if major == 1 {
		out = binary.LittleEndian.AppendUint16(out, uint16(hlen))
	} else {
		out = binary.LittleEndian.AppendUint32(out, uint32(hlen))
	}
	out = append(out, dict...)
	for len(out) < total-1 {
		out = append(out, ' ')
	}
	return append(out, '\n')
}

// Write writes t to w as a C-order .npy file: '<f4' for float32 and bfloat16
// tensors (bfloat16 widened exactly), '<f2' for float16 tensors. Strided
// tensors are written in logical row-major order. It fails with an error
// wrapping attn.ErrLayout or attn.ErrDType when t is malformed.
func Write(w io.Writer, t attn.Tensor) error {
	if err := t.CheckLayout("npy.Write"); err != nil {
		return err
	}
	if t.DType == attn.Float16 {
		bw := bufio.NewWriter(w)
		if _, err := bw.Write(header("<f2", t.Shape)); err != nil {
			return err
		}
		var b [2]byte
		st := t.Strides
		if st == nil {
			st = attn.ContiguousStrides(t.Shape)
		}
		var werr error
		forEach(t.Shape, st, t.Offset, func(off int) {
			if werr == nil {
				binary.LittleEndian.PutUint16(b[:], t.Bits[off])
				_, werr = bw.Write(b[:])
			}
		})
		if werr != nil {
			return werr
		}
		return bw.Flush()
	}
	return WriteFloat32(w, t.Shape, t.Float32s())
}

// forEach calls f with the storage offset of every element in row-major order.
func forEach(shape, strides []int, offset int, f func(off int)) {
	n := attn.NumElements(shape)
	idx := make([]int, len(shape))
	off := offset
	for lin := 0; lin < n; lin++ {
		f(off)
		for d := len(idx) - 1; d >= 0; d-- {
			idx[d]++
			off += strides[d]
			if idx[d] < shape[d] {
				break
			}
			off -= idx[d] * strides[d]
			idx[d] = 0
		}
	}
}

// WriteFloat32 writes data, row-major in shape, to w as a '<f4' .npy file.
// It fails with an error wrapping attn.ErrShape when len(data) does not match
// shape.
func WriteFloat32(w io.Writer, shape []int, data []float32) error {
	for _, s := range shape {
		if s < 0 {
			return attn.Errorf(attn.ErrShape, "npy: negative dimension in shape %v", shape)
		}
	}
	if n := attn.NumElements(shape); n != len(data) {
		return attn.Errorf(attn.ErrShape, "npy: %d values for shape %v (%d elements)", len(data), shape, n)
	}
	bw := bufio.NewWriter(w)
	if _, err := bw.Write(header("<f4", shape)); err != nil {
		return err
	}
	var b [4]byte
	for _, x := range data {
		binary.LittleEndian.PutUint32(b[:], math.Float32bits(x))
		if _, err := bw.Write(b[:]); err != nil {
			return err
		}
	}
	return bw.Flush()
}

// WriteFile writes t to the file at path (see Write), replacing it.
func WriteFile(path string, t attn.Tensor) error {
	return writeFile(path, func(w io.Writer) error { return Write(w, t) })
}

// WriteFloat32File writes data, row-major in shape, to the file at path as a
// '<f4' .npy file, replacing it.
func WriteFloat32File(path string, shape []int, data []float32) error {
	return writeFile(path, func(w io.Writer) error { return WriteFloat32(w, shape, data) })
}

func writeFile(path string, write func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return fmt.Errorf("%s: %w", path, err)
	}
	return f.Close()
}
