package attn

import (
	"slices"
	"sort"
)

// The attention inputs are [B, S, H, D] (batch, sequence position, head,
// feature; "BSHD", flash_attn's order) or packed [T, H, D] ("THD"). The
// functions below turn tensors held in other orders into views of that
// order without copying, and back.

// Permute returns the view of t whose dimension d is t's dimension perm[d]:
// the same storage and offset, with the shape and strides rearranged. It
// copies no elements. perm must be a permutation of 0 … Rank()−1; otherwise
// the error wraps ErrShape.
func Permute(t Tensor, perm ...int) (Tensor, error) {
	r := len(t.Shape)
	if len(perm) != r {
		return Tensor{}, Errorf(ErrShape, "permutation %v of a rank-%d tensor", perm, r)
	}
	st := t.strides()
	if len(st) != r {
		return Tensor{}, Errorf(ErrLayout, "%d strides for %d dims", len(st), r)
	}
	seen := make([]bool, r)
	v := t
	v.Shape, v.Strides = make([]int, r), make([]int, r)
	for d, p := range perm {
		if p < 0 || p >= r || seen[p] {
			return Tensor{}, Errorf(ErrShape, "%v is not a permutation of the %d dims", perm, r)
		}
		seen[p] = true
		v.Shape[d], v.Strides[d] = t.Shape[p], st[p]
	}
	return v, nil
}

// BSHD returns t, which must already be in the native [B, S, H, D] order
// (flash_attn's q, k and v), after checking its rank: a rank other than 4
// wraps ErrShape. It exists so that code naming its layouts reads the same
// whichever layout it holds.
func BSHD(t Tensor) (Tensor, error) {
	if len(t.Shape) != 4 {
		return Tensor{}, Errorf(ErrShape, "BSHD: shape %v is not [B, S, H, D]", t.Shape)
	}
	return t, nil
}

// BHSD returns the [B, S, H, D] view of a tensor held as [B, H, S, D]
// (PyTorch's scaled_dot_product_attention order), without copying: element
// (b, s, h, d) of the view is element (b, h, s, d) of t. A rank other than 4
// wraps ErrShape.
//
// Passing a [B, H, S, D] tensor without this view would read it silently as
// [B, S, H, D]: heads and positions swapped.
func BHSD(t Tensor) (Tensor, error) {
	if len(t.Shape) != 4 {
		return Tensor{}, Errorf(ErrShape, "BHSD: shape %v is not [B, H, S, D]", t.Shape)
	}
	return Permute(t, 0, 2, 1, 3)
}

// ToBHSD returns the [B, H, S, D] view of a [B, S, H, D] tensor, such as O
// or a gradient, without copying: the inverse of BHSD, for reading results
// in PyTorch's order. A rank other than 4 wraps ErrShape.
func ToBHSD(t Tensor) (Tensor, error) {
	if len(t.Shape) != 4 {
		return Tensor{}, Errorf(ErrShape, "ToBHSD: shape %v is not [B, S, H, D]", t.Shape)
	}
	return Permute(t, 0, 2, 1, 3)
}

// THD returns t, which must be a packed variable-length tensor [T, H, D]
// (total positions, head, feature; flash_attn's varlen order, with the
// segments given by Options.CuSeqlensQ / CuSeqlensK), after checking its
// rank: a rank other than 3 wraps ErrShape.
func THD(t Tensor) (Tensor, error) {
	if len(t.Shape) != 3 {
		return Tensor{}, Errorf(ErrShape, "THD: shape %v is not [T, H, D]", t.Shape)
	}
	return t, nil
}

// NewLike returns a zero-filled tensor of type dt with like's shape whose
// elements are laid out densely in like's memory order: the dimension with
// the largest stride in like is outermost, the one with the smallest
// innermost (ties keep the dimension order). A contiguous like gives a
// contiguous tensor; the [B, S, H, D] view of a [B, H, S, D] buffer (see
// BHSD) gives a [B, S, H, D] tensor whose storage is [B, H, S, D] row-major,
// so that ToBHSD of it is contiguous. Backends allocate gradients with it,
// so that they come back in their input's layout.
func NewLike(dt DType, like Tensor) Tensor {
	t := New(dt, like.Shape...)
	if t.storageLen() == 0 && t.NumElements() != 0 {
		return t // an invalid shape (see New): no storage to lay out
	}
	t.Strides = StridesLike(like)
	return t
}

// StridesLike returns the strides NewLike gives a tensor of like's shape:
// dense, in like's memory order (contiguous ones when like's strides are
// contiguous or malformed).
func StridesLike(like Tensor) []int {
	contig := ContiguousStrides(like.Shape)
	st := like.strides()
	if len(st) != len(like.Shape) || slices.Equal(st, contig) {
		return contig
	}
	order := make([]int, len(like.Shape)) // dims from innermost to outermost
	for d := range order {
		order[d] = len(order) - 1 - d
	}
	sort.SliceStable(order, func(a, b int) bool { return st[order[a]] < st[order[b]] })
	out := make([]int, len(like.Shape))
	n := 1
	for _, d := range order {
		out[d] = n
		n *= like.Shape[d]
	}
	return out
}
