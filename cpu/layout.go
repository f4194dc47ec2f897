package cpu

import (
	"math"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/half"
	"github.com/flashattn/flashattn/internal/vec"
)

// view is a float32 image of a [B, S, H, D] (or packed [T, H, D], or bias
// [B, H, N, M]) tensor whose last dimension is contiguous: element
// (b, i, h, d) is at data[off + b·sb + i·si + h·sh + d]. Consecutive
// positions i of one (b, h) are therefore rows of a matrix with leading
// dimension si, which is what the tile kernels take.
type view struct {
	data            []float32
	off, sb, si, sh int
}

// row returns the index of element (b, i, h, 0).
func (v view) row(b, i, h int) int { return v.off + v.sb*b + v.si*i + v.sh*h }

// newView returns t itself when it is float32 with a contiguous last
// dimension, and otherwise a contiguous float32 copy. The dims of t are read
// as (b, i, h, d) for rank 4 and (i, h, d) for rank 3 (b = 0). When headsDim1
// is set, a rank-4 tensor is read as (b, h, i, d) instead (the bias layout).
func newView(t attn.Tensor, headsDim1 bool) view {
	st := t.Strides
	if st == nil {
		st = attn.ContiguousStrides(t.Shape)
	}
	r := len(t.Shape)
	last := t.Shape[r-1]
	// Dims (b, i, h) of t's storage, with the strides to match.
	var nb, ni, nh, sb, si, sh int
	switch {
	case r == 3:
		nb, ni, nh, sb, si, sh = 1, t.Shape[0], t.Shape[1], 0, st[0], st[1]
	case headsDim1:
		nb, nh, ni, sb, sh, si = t.Shape[0], t.Shape[1], t.Shape[2], st[0], st[1], st[2]
	default:
		nb, ni, nh, sb, si, sh = t.Shape[0], t.Shape[1], t.Shape[2], st[0], st[1], st[2]
	}
	if t.DType == attn.Float32 && (st[r-1] == 1 || last <= 1) {
		return view{data: t.F32, off: t.Offset, sb: sb, si: si, sh: sh}
	}
	// Contiguous copy in (b, i, h, d) order.
	v := view{data: make([]float32, nb*ni*nh*last), sh: last, si: nh * last, sb: ni * nh * last}
	if r == 3 {
		v.sb = 0
	}
	sd := st[r-1]
	for b := 0; b < nb; b++ {
		for i := 0; i < ni; i++ {
			for h := 0; h < nh; h++ {
				src := t.Offset + b*sb + i*si + h*sh
				dst := v.data[v.row(b, i, h) : v.row(b, i, h)+last]
				switch {
				case sd == 1 && t.DType == attn.BFloat16:
					vec.BF16ToFloat32(dst, t.Bits[src:src+last])
				case sd == 1 && t.DType == attn.Float16:
					vec.Float16ToFloat32(dst, t.Bits[src:src+last])
				default:
					for d := range dst {
						dst[d] = t.Load(src + d*sd)
					}
				}
			}
		}
	}
	return v
}

// storeRow writes s·src[d] into the contiguous storage of t at off+d, rounded
// to t's dtype.
func storeRow(t attn.Tensor, off int, src []float32, s float32) {
	switch t.DType {
	case attn.Float32:
		dst := t.F32[off : off+len(src)]
		for d, x := range src {
			dst[d] = x * s
		}
	case attn.Float16:
		dst := t.Bits[off : off+len(src)]
		for d, x := range src {
			dst[d] = uint16(half.Float16FromFloat32(x * s))
		}
	default:
		dst := t.Bits[off : off+len(src)]
		for d, x := range src {
			dst[d] = uint16(half.BFloat16FromFloat32(x * s))
		}
	}
}

// seg describes one sequence of the batch: its index b, its n queries and m
// keys, and where they sit in the views: batch index vb and first positions
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

// keyRow is outRow for tensors shaped like k or v.
func keyRow(p *attn.Problem, sg seg, j, kh, d int) int {
	return ((sg.vb*p.M+sg.k0+j)*p.Hkv + kh) * d
}

// lseIndex returns the index of row (i, h) of sg in a contiguous LSE.
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

var negInf = float32(math.Inf(-1))
