package cp

import (
	"math"
	"unsafe"

	"github.com/flashattn/flashattn/attn"
)

// bytesOf returns the storage of a tensor as bytes (no copy), for the
// transport. The tensor must own its whole storage contiguously, as the
// buffers this package allocates do.
func bytesOf(t attn.Tensor) []byte {
	if t.DType == attn.Float32 {
		return f32Bytes(t.F32)
	}
	if len(t.Bits) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&t.Bits[0])), 2*len(t.Bits))
}

// f32Bytes returns x as bytes (no copy).
func f32Bytes(x []float32) []byte {
	if len(x) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 4*len(x))
}

// contiguous returns a contiguous copy of t.
func contiguous(t attn.Tensor) (attn.Tensor, error) {
	c, err := attn.NewChecked(t.DType, t.Shape...)
	if err != nil {
		return attn.Tensor{}, err
	}
	return c, attn.CopyInto(c, t)
}

// addRows adds the [B, rows, H, D] tensor g into rows [r0, r0+rows) of the
// float32 accumulator acc, row-major [B, n, H, D].
func addRows(acc []float32, n, r0 int, g attn.Tensor) {
	b, rows, h, d := g.Shape[0], g.Shape[1], g.Shape[2], g.Shape[3]
	vals := g.Float32s()
	row := h * d
	for bi := range b {
		src := vals[bi*rows*row : (bi+1)*rows*row]
		dst := acc[(bi*n+r0)*row : (bi*n+r0+rows)*row]
		for i, x := range src {
			dst[i] += x
		}
	}
}

// accum is the running result of a forward over several key blocks: O
// [B, n, H, DV] in float32 and the natural-log LSE [B, H, n] in float64,
// merged block by block through their LSE.
type accum struct {
	b, n, h, dv int
	o           []float32
	lse         []float64
}

// newAccum returns an accumulator holding no key yet: O = 0, LSE = −inf.
func newAccum(b, n, h, dv int) *accum {
	a := &accum{b: b, n: n, h: h, dv: dv, o: make([]float32, b*n*h*dv), lse: make([]float64, b*h*n)}
	for i := range a.lse {
		a.lse[i] = math.Inf(-1)
	}
	return a
}

// merge folds in a partial result over other keys for the local query
// rows [r0, r0+rows): O = w1·O1 + w2·O2 with w = exp(LSE_x − LSE), LSE =
// m + log(exp(LSE1 − m) + exp(LSE2 − m)), m = max(LSE1, LSE2), computed in
// float64 so that nothing overflows; a row whose partial LSE is −inf saw
// no key there and contributes nothing, and a NaN stays NaN.
func (a *accum) merge(res attn.Result, r0 int) {
	rows := res.LSE.Shape[2]
	o, lse := res.O.Float32s(), res.LSE.Float32s()
	for b := range a.b {
		for h := range a.h {
			for i := range rows {
				l2 := float64(lse[(b*a.h+h)*rows+i])
				if math.IsInf(l2, -1) {
					continue
				}
				li := (b*a.h+h)*a.n + r0 + i
				src := o[((b*rows+i)*a.h+h)*a.dv:][:a.dv]
				dst := a.o[((b*a.n+r0+i)*a.h+h)*a.dv:][:a.dv]
				l1 := a.lse[li]
				if math.IsInf(l1, -1) {
					copy(dst, src)
					a.lse[li] = l2
					continue
				}
				m := max(l1, l2)
				l := m + math.Log(math.Exp(l1-m)+math.Exp(l2-m))
				w1, w2 := math.Exp(l1-l), math.Exp(l2-l)
				for d, x := range src {
					dst[d] = float32(w1*float64(dst[d]) + w2*float64(x))
				}
				a.lse[li] = l
			}
		}
	}
}

// result returns O in dt and the LSE as tensors.
func (a *accum) result(dt attn.DType) (attn.Result, error) {
	o := attn.FromFloat32(dt, a.o, a.b, a.n, a.h, a.dv)
	lse, err := attn.NewChecked(attn.Float32, a.b, a.h, a.n)
	if err != nil {
		return attn.Result{}, err
	}
	for i, l := range a.lse {
		lse.F32[i] = float32(l)
	}
	return attn.Result{O: o, LSE: lse}, nil
}
