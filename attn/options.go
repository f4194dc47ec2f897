package attn

// Align says where the diagonal of a causal mask or window sits when the
// number of queries N differs from the number of keys M.
type Align int

const (
	// AlignBottomRight puts query i's diagonal at key i + M − N: the last query
	// sees the last key. It is the default.
	AlignBottomRight Align = iota
	// AlignTopLeft puts query i's diagonal at key i.
	AlignTopLeft
)

// String returns "bottom-right" or "top-left".
func (a Align) String() string {
	if a == AlignTopLeft {
		return "top-left"
	}
	return "bottom-right"
}

// Window keeps, for each query, the keys from its diagonal − Left to its
// diagonal + Right, inclusive. A negative side is unbounded.
type Window struct {
	Left, Right int
}

// Bias is an additive bias on the scores, shaped [B or 1, H or 1, N, M]
// (packed variable-length batches do not take a bias).
type Bias struct {
	Tensor Tensor
	// RequiresGrad asks the backward for dBias.
	RequiresGrad bool
}

// DropoutOrigin places a call inside a larger problem of Heads query heads
// for the dropout mask: element (b, h, i, j) of the call (query head h,
// query i, key j) draws the keep decision of element (b, Head+h, Query+i,
// Key+j) of that problem. Heads 0 means the call's own number of heads.
type DropoutOrigin struct {
	Query, Key, Head, Heads int
}

// Options are the knobs of one attention call. The zero value is plain,
// unmasked attention with scale 1/sqrt(DK).
type Options struct {
	// Scale multiplies q·k; 0 means 1/sqrt(DK). Must be finite.
	Scale float64
	// Softcap, when > 0, replaces s by Softcap·tanh(s/Softcap). Must be finite and ≥ 0.
	Softcap float64
	// Bias, when non-nil, is added to the scores after the softcap.
	Bias *Bias
	// Causal masks every key after the diagonal.
	Causal bool
	// Align places the diagonal; the zero value is AlignBottomRight.
	Align Align
	// Window, when non-nil, keeps only keys within the window around the diagonal.
	Window *Window
	// Dropout is the probability of dropping an attention probability, in
	// [0, 1). The mask resolves it in steps of 1/256 (package philox): p
	// runs as 1 − T/256 with T = round(256·(1 − p)), kept probabilities
	// scaled by 256/T; 0 < p ≤ 1/512 and p > 1 − 1/512 are refused.
	Dropout float64
	// Seed and Offset select the dropout mask (see package philox).
	Seed   uint64
	Offset uint32
	// DropoutAt, when non-nil, places this call inside a larger problem
	// for the dropout mask (see DropoutOrigin), so that a call over a block
	// of that problem draws the block's part of its mask. Context
	// parallelism sets it. Both backends implement it; the CUDA backend
	// takes key origins that are multiples of 16 and refuses others with
	// ErrUnsupported when Dropout > 0.
	DropoutAt *DropoutOrigin
	// CuSeqlensQ and CuSeqlensK, when set, are the B+1 cumulative segment
	// offsets of a packed variable-length batch (both or neither).
	CuSeqlensQ, CuSeqlensK []int32
	// Deterministic demands bit-identical results on repeat.
	Deterministic bool
}

// MaskBounds returns the effective window: left and right extents around the
// diagonal (negative means unbounded) and whether any mask applies at all.
func (o Options) MaskBounds() (left, right int, masked bool) {
	left, right = -1, -1
	if o.Window != nil {
		left, right = o.Window.Left, o.Window.Right
		if left < 0 {
			left = -1
		}
		if right < 0 {
			right = -1
		}
	}
	if o.Causal && (right < 0 || right > 0) {
		right = 0
	}
	return left, right, left >= 0 || right >= 0
}
