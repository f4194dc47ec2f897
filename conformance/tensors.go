package conformance

import (
	"math"
	"math/rand/v2"

	"github.com/flashattn/flashattn/attn"
)

// layout says how a test tensor is laid out in memory.
type layout int

const (
	// contiguous row-major.
	contiguous layout = iota
	// headsMajor stores [B, S, H, D] as [B, H, S, D] (and [T, H, D] as [H, T, D]).
	headsMajor
	// gapped has an offset, an element stride of 2 and a gap after every
	// row of every dimension; everything outside the view is NaN.
	gapped
)

// randTensor returns a tensor of dt and shape in layout l holding normal
// values with standard deviation sd, rounded to dt.
func randTensor(r *rand.Rand, dt attn.DType, l layout, sd float64, shape ...int) attn.Tensor {
	t := emptyTensor(dt, l, shape...)
	fillLogical(t, func() float32 { return float32(r.NormFloat64() * sd) })
	return t
}

// emptyTensor returns a zero tensor of dt and shape in layout l (NaN outside
// the view for gapped).
func emptyTensor(dt attn.DType, l layout, shape ...int) attn.Tensor {
	switch l {
	case headsMajor:
		r := len(shape)
		perm := make([]int, r) // storage order of the dims
		for d := range perm {
			perm[d] = d
		}
		perm[r-3], perm[r-2] = perm[r-2], perm[r-3]
		st := make([]int, r)
		n := 1
		for d := r - 1; d >= 0; d-- {
			st[perm[d]] = n
			n *= shape[perm[d]]
		}
		t := attn.New(dt, attn.NumElements(shape))
		t.Shape, t.Strides = append([]int(nil), shape...), st
		return t
	case gapped:
		r := len(shape)
		st := make([]int, r)
		st[r-1] = 2
		for d := r - 2; d >= 0; d-- {
			st[d] = st[d+1]*shape[d+1] + 3
		}
		const off = 5
		size := off + 4
		for d := range shape {
			size += (shape[d] - 1) * st[d]
		}
		t := attn.New(dt, size)
		t.Fill(float32(math.NaN()))
		t.Shape, t.Strides, t.Offset = append([]int(nil), shape...), st, off
		fillLogical(t, func() float32 { return 0 })
		return t
	}
	return attn.New(dt, shape...)
}

// fillLogical sets every element of t, in row-major logical order, to f().
func fillLogical(t attn.Tensor, f func() float32) {
	n := t.NumElements()
	idx := make([]int, len(t.Shape))
	for lin := 0; lin < n; lin++ {
		t.Set(f(), idx...)
		for d := len(idx) - 1; d >= 0; d-- {
			idx[d]++
			if idx[d] < t.Shape[d] {
				break
			}
			idx[d] = 0
		}
	}
}

// cumulative returns the B+1 offsets of the segment lengths.
func cumulative(lens []int) []int32 {
	cu := make([]int32, len(lens)+1)
	for i, l := range lens {
		cu[i+1] = cu[i] + int32(l)
	}
	return cu
}
