package kernels

import "github.com/flashattn/flashattn/attn"

// What the forward and the backward kernels share: the features a variant
// applies to the scores (Features, which Variant and BwdVariant embed) and
// the shared-memory limit.

// MaxSharedBytes is the most dynamic shared memory one CTA may use on the
// devices the kernels target (sm_80 and sm_90: 227 KiB), forward and
// backward.
const MaxSharedBytes = 227 << 10

// MaskKind says whether a kernel applies a causal mask or window.
type MaskKind uint8

const (
	// MaskNone: every key of the sequence is visible (only the sequence
	// end is masked).
	MaskNone MaskKind = iota
	// MaskWindow: causal masks and sliding windows, given at run time as
	// the window's left and right extents and the diagonal's alignment.
	MaskWindow
)

// String returns "none" or "window".
func (k MaskKind) String() string {
	if k == MaskWindow {
		return "window"
	}
	return "none"
}

// BiasKind says whether a kernel adds a bias to the scores and in which
// element type the bias is stored.
type BiasKind uint8

const (
	// BiasNone: no bias.
	BiasNone BiasKind = iota
	// BiasF32: a float32 bias.
	BiasF32
	// BiasF16: a float16 bias.
	BiasF16
	// BiasBF16: a bfloat16 bias.
	BiasBF16
)

// BiasFor returns the BiasKind of a bias stored in dt.
func BiasFor(dt attn.DType) BiasKind {
	switch dt {
	case attn.Float16:
		return BiasF16
	case attn.BFloat16:
		return BiasBF16
	}
	return BiasF32
}

// String returns "none", "fp32", "fp16" or "bf16".
func (k BiasKind) String() string {
	switch k {
	case BiasF32:
		return "fp32"
	case BiasF16:
		return "fp16"
	case BiasBF16:
		return "bf16"
	}
	return "none"
}

// MaskFor returns MaskWindow when masked is set (a causal mask or a
// window, given at run time), MaskNone otherwise.
func MaskFor(masked bool) MaskKind {
	if masked {
		return MaskWindow
	}
	return MaskNone
}

// DType returns the element type of a bias of kind k (attn.Float32 for
// BiasNone).
func (k BiasKind) DType() attn.DType {
	switch k {
	case BiasF16:
		return attn.Float16
	case BiasBF16:
		return attn.BFloat16
	}
	return attn.Float32
}

// Features are the score transformations a forward or backward variant
// applies, and how its batch is laid out. Variant and BwdVariant embed it.
type Features struct {
	// Mask selects causal/window masking; the window's extents and the
	// diagonal's alignment are launch parameters.
	Mask MaskKind
	// Softcap applies s = c·tanh(s/c).
	Softcap bool
	// Bias adds a bias of the given element type to the scores.
	Bias BiasKind
	// Dropout drops probabilities with the philox keep mask.
	Dropout bool
	// Varlen reads segment offsets from cu_seqlens (packed batches).
	Varlen bool
}

// Masked reports whether a causal mask or window applies.
func (f Features) Masked() bool { return f.Mask != MaskNone }

// Biased reports whether a bias is added.
func (f Features) Biased() bool { return f.Bias != BiasNone }
