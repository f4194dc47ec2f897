package cpu

import (
	"math"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/internal/vec"
)

// src reads the rows of an input tensor in place, whatever its dtype and
// strides: element (b, i, h, d) of a [B, S, H, D] tensor (a packed [T, H, D]
// tensor has b = 0) is at off + b·sb + i·si + h·sh + d·sd of its storage.
type src struct {
	t                   attn.Tensor
	off, sb, si, sh, sd int
	n                   int // row length D
}

func newSrc(t attn.Tensor) src {
	st := t.Strides
	if st == nil {
		st = attn.ContiguousStrides(t.Shape)
	}
	r := len(t.Shape)
	s := src{t: t, off: t.Offset, sd: st[r-1], n: t.Shape[r-1]}
	if r == 3 {
		s.si, s.sh = st[0], st[1]
	} else {
		s.sb, s.si, s.sh = st[0], st[1], st[2]
	}
	return s
}

// load writes row (b, i, h) to dst[:n] as float32 (exactly).
func (s src) load(dst []float32, b, i, h int) {
	o := s.off + b*s.sb + i*s.si + h*s.sh
	dst = dst[:s.n]
	if s.sd == 1 {
		switch s.t.DType {
		case attn.Float32:
			copy(dst, s.t.F32[o:o+s.n])
			return
		case attn.BFloat16:
			vec.BF16ToFloat32(dst, s.t.Bits[o:o+s.n])
			return
		case attn.Float16:
			vec.Float16ToFloat32(dst, s.t.Bits[o:o+s.n])
			return
		}
	}
	for d := range dst {
		dst[d] = s.t.Load(o + d*s.sd)
	}
}

// loadBits writes the raw 16-bit patterns of row (b, i, h) of a float16 or
// bfloat16 tensor to dst[:n].
func (s src) loadBits(dst []uint16, b, i, h int) {
	o := s.off + b*s.sb + i*s.si + h*s.sh
	dst = dst[:s.n]
	if s.sd == 1 {
		copy(dst, s.t.Bits[o:o+s.n])
		return
	}
	for d := range dst {
		dst[d] = s.t.Bits[o+d*s.sd]
	}
}

// store writes scale·row[d] to element (b, i, h, d) of s's tensor, rounded
// to its dtype.
func (s src) store(b, i, h int, row []float32, scale float32) {
	o := s.off + b*s.sb + i*s.si + h*s.sh
	if s.sd == 1 {
		storeRow(s.t, o, row[:s.n], scale)
		return
	}
	for d, x := range row[:s.n] {
		s.t.Store(o+d*s.sd, x*scale)
	}
}

// biasRows reads the rows of an additive bias [bB, bH, N, M] where they
// are stored, in any dtype and layout, a tile's row at a time (a float32
// copy of the whole bias would cost a pass over it on one core per call).
type biasRows struct {
	t          attn.Tensor
	st         []int
	oneB, oneH bool // broadcast over the batch, over the heads
}

func newBiasRows(t attn.Tensor) biasRows {
	st := t.Strides
	if st == nil {
		st = attn.ContiguousStrides(t.Shape)
	}
	return biasRows{t: t, st: st, oneB: t.Shape[0] == 1, oneH: t.Shape[1] == 1}
}

// at returns the storage index of the bias of batch element b, head h,
// query i and key j, broadcast dims taken at 0.
func (r biasRows) at(b, h, i, j int) int {
	if r.oneB {
		b = 0
	}
	if r.oneH {
		h = 0
	}
	return r.t.Offset + b*r.st[0] + h*r.st[1] + i*r.st[2] + j*r.st[3]
}

// touch reads the first and last element of the bias of queries
// i0 … i0+rows-1 at keys j0 … j0+cols-1 (batch element b, head h) and
// returns a value made of them (for the caller to keep, so that the loads
// stay): loads that do not depend on each other, so that the rows' pieces,
// each in other pages, come from memory together rather than one after
// another as add reads them.
func (r biasRows) touch(b, h, i0, rows, j0, cols int) uint32 {
	o := r.at(b, h, i0, j0)
	last := (cols - 1) * r.st[3]
	var s uint32
	for i := 0; i < rows; i++ {
		if r.t.DType == attn.Float32 {
			s += math.Float32bits(r.t.F32[o]) ^ math.Float32bits(r.t.F32[o+last])
		} else {
			s += uint32(r.t.Bits[o]) ^ uint32(r.t.Bits[o+last])
		}
		o += r.st[2]
	}
	return s
}

// add adds the bias of batch element b, head h and query i at keys
// j0 … j0+len(x)-1 to x; tmp (at least len(x) long) holds the converted
// row of a 16-bit bias.
func (r biasRows) add(x []float32, b, h, i, j0 int, tmp []float32) {
	n := len(x)
	o := r.at(b, h, i, j0)
	if r.st[3] != 1 && n > 1 {
		for j := range x {
			x[j] += r.t.Load(o + j*r.st[3])
		}
		return
	}
	src := tmp[:n]
	switch r.t.DType {
	case attn.Float32:
		src = r.t.F32[o : o+n]
	case attn.Float16:
		vec.Float16ToFloat32(src, r.t.Bits[o:o+n])
	default:
		vec.BF16ToFloat32(src, r.t.Bits[o:o+n])
	}
	for j, v := range src {
		x[j] += v
	}
}

// storeRow writes s·src[d] into the contiguous storage of t at off+d, rounded
// to t's dtype.
func storeRow(t attn.Tensor, off int, src []float32, s float32) {
	switch t.DType {
	case attn.Float32:
		vec.ScaleTo(t.F32[off:off+len(src)], src, s)
	case attn.Float16:
		vec.ScaleToFloat16(t.Bits[off:off+len(src)], src, s)
	default:
		vec.ScaleToBF16(t.Bits[off:off+len(src)], src, s)
	}
}

// seg describes one sequence of the batch: its index b, its n queries and m
// keys, and where they sit in the inputs: batch index vb and first positions
// q0, k0 (vb = b, q0 = k0 = 0 for a padded batch; vb = 0 and the cu_seqlens
// offsets for a packed one).
type seg struct {
	b, n, m, vb, q0, k0 int
}

func segments(p *attn.Problem) []seg {
	s := make([]seg, p.B)
	for b := range s {
		q0, n, k0, m := p.Segment(b)
		if p.Varlen {
			s[b] = seg{b: b, n: n, m: m, q0: q0, k0: k0}
		} else {
			s[b] = seg{b: b, n: n, m: m, vb: b}
		}
	}
	return s
}

// outRow returns the index of row (i, h) of sg in a contiguous output shaped
// like q or O ([B, N, H, d] or [T, H, d]) with head dimension d.
func outRow(p *attn.Problem, sg seg, i, h, d int) int {
	return ((sg.vb*p.N+sg.q0+i)*p.H + h) * d
}

// lseIndex returns the index of row (i, h) of sg in a contiguous LSE. The
// rows of one (sequence, head) are consecutive in this order, which is also
// the row order of the packed query-side buffers of the backward.
func lseIndex(p *attn.Problem, sg seg, i, h int) int {
	if p.Varlen {
		return h*p.TotalQ + sg.q0 + i
	}
	return (sg.b*p.H+h)*p.N + i
}

// queryRange returns the queries [i0, i1) of a sequence of n queries over m
// keys that see at least one key of [j0, j1). Visible key ranges move
// monotonically with the query, so the set is an interval.
func queryRange(p *attn.Problem, n, m, j0, j1 int) (i0, i1 int) {
	i0, i1 = n, n
	for i := 0; i < n; i++ {
		lo, hi := p.KeyRange(i, n, m)
		if max(lo, j0) < min(hi, j1) {
			if i0 == n {
				i0 = i
			}
			i1 = i + 1
		}
	}
	if i0 == n {
		return 0, 0
	}
	return i0, i1
}

// keySpan returns the union [lo, hi) of the visible keys of queries i0 … i1-1,
// clamped to [0, m); lo ≥ hi when none of them sees a key.
func keySpan(p *attn.Problem, n, m, i0, i1 int) (lo, hi int) {
	lo, _ = p.KeyRange(i0, n, m)
	_, hi = p.KeyRange(i1-1, n, m)
	return max(lo, 0), min(hi, m)
}

var (
	negInf = float32(math.Inf(-1))
	nan    = float32(math.NaN())
)
