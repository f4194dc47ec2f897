package flashattn

import (
	"sync"

	"github.com/flashattn/flashattn/attn"
)

// Version is the version of the library and the command line.
const Version = "0.1.0"

// Tensor is a strided view of host memory holding float32, float16 or
// bfloat16 elements; see attn.Tensor.
type Tensor = attn.Tensor

// DType is the element type of a tensor.
type DType = attn.DType

// The element types.
const (
	Float32  = attn.Float32  // IEEE 754 binary32
	Float16  = attn.Float16  // IEEE 754 binary16 ("fp16")
	BFloat16 = attn.BFloat16 // bfloat16 ("bf16")
)

// MaxHeadDim is the largest head dimension (DK or DV) accepted.
const MaxHeadDim = attn.MaxHeadDim

// Options are the knobs of one attention call; the zero value is plain,
// unmasked attention with scale 1/sqrt(DK). See attn.Options.
type Options = attn.Options

// Window keeps, for each query, the keys from its diagonal − Left to its
// diagonal + Right; a negative side is unbounded.
type Window = attn.Window

// Bias is an additive score bias [B or 1, H or 1, N, M]; RequiresGrad asks
// the backward for its gradient.
type Bias = attn.Bias

// Align places the diagonal of causal masks and windows when N ≠ M.
type Align = attn.Align

// The alignments of the diagonal.
const (
	AlignBottomRight = attn.AlignBottomRight // query i's diagonal at key i + M − N (the default)
	AlignTopLeft     = attn.AlignTopLeft     // query i's diagonal at key i
)

// Result is the output of a forward pass: O [B, N, H, DV] in q's dtype and
// the float32 natural-log log-sum-exp LSE [B, H, N] (packed batches:
// [totalQ, H, DV] and [H, totalQ]). Read them with res.O.Float32s() (all
// elements in row-major order), res.O.At(b, i, h, d) and res.O.Shape; see
// Tensor's methods in package attn.
type Result = attn.Result

// Gradients is the output of a backward pass: DQ, DK, DV in the shapes of
// q, k, v and, when the bias asked for it, DBias. Read them like Result.
type Gradients = attn.Gradients

// Generator hands out the dropout (Seed, Offset) pair of successive calls,
// as PyTorch's generator does, so that every call draws a mask of its own:
// opt = gen.Draw(opt) before each forward (Next, State and SetState are its
// other methods; see attn.Generator). The backward must reuse the forward's
// pair, which Forwarded does.
type Generator = attn.Generator

// NewGenerator returns a dropout generator whose first pair is (seed, 0).
func NewGenerator(seed uint64) *Generator { return attn.NewGenerator(seed) }

// Backend computes attention forward and backward. Backends that hold
// resources (the CUDA backend) also implement io.Closer.
type Backend = attn.Backend

// Problem is a validated attention problem with its resolved sizes.
type Problem = attn.Problem

// Sentinel errors: every error for bad input wraps one of them.
var (
	ErrShape       = attn.ErrShape       // shapes that do not fit together or are out of range
	ErrDType       = attn.ErrDType       // an element type not allowed where it was given
	ErrLayout      = attn.ErrLayout      // strides that overlap or run past the data
	ErrOption      = attn.ErrOption      // an option outside its domain
	ErrUnsupported = attn.ErrUnsupported // a valid problem the backend cannot run
)

// New returns a contiguous zero-filled tensor of type dt. It never panics:
// for an invalid shape (a negative size, more elements than an int counts)
// it returns a tensor without storage, which every backend rejects with an
// error wrapping ErrShape. NewChecked reports that error at once.
func New(dt DType, shape ...int) Tensor { return attn.New(dt, shape...) }

// NewChecked returns a contiguous zero-filled tensor of type dt, or an error
// wrapping ErrShape or ErrDType for an invalid shape or dtype: use it for
// shapes that come from outside the program.
func NewChecked(dt DType, shape ...int) (Tensor, error) { return attn.NewChecked(dt, shape...) }

// FromFloat32 returns a contiguous tensor of type dt holding data, row-major
// in shape, each value rounded to dt (nearest, ties to even). It panics if
// len(data) is not the number of elements of shape.
func FromFloat32(dt DType, data []float32, shape ...int) Tensor {
	return attn.FromFloat32(dt, data, shape...)
}

// NewLike returns a zero-filled tensor of type dt with like's shape, laid
// out densely in like's memory order (see attn.NewLike).
func NewLike(dt DType, like Tensor) Tensor { return attn.NewLike(dt, like) }

// BSHD returns t, a tensor in the native [B, S, H, D] order (flash_attn's),
// after checking that its rank is 4 (otherwise the error wraps ErrShape).
func BSHD(t Tensor) (Tensor, error) { return attn.BSHD(t) }

// BHSD returns the [B, S, H, D] view of a tensor held as [B, H, S, D]
// (PyTorch's scaled_dot_product_attention order), without copying. Without
// it such a tensor is read as [B, S, H, D], heads and positions swapped. A
// rank other than 4 wraps ErrShape.
func BHSD(t Tensor) (Tensor, error) { return attn.BHSD(t) }

// ToBHSD returns the [B, H, S, D] view of a [B, S, H, D] tensor such as O or
// a gradient, without copying: results in PyTorch's order.
func ToBHSD(t Tensor) (Tensor, error) { return attn.ToBHSD(t) }

// THD returns t, a packed variable-length tensor [T, H, D], after checking
// that its rank is 3 (otherwise the error wraps ErrShape).
func THD(t Tensor) (Tensor, error) { return attn.THD(t) }

// Permute returns the view of t whose dimension d is t's dimension perm[d],
// without copying (see attn.Permute).
func Permute(t Tensor, perm ...int) (Tensor, error) { return attn.Permute(t, perm...) }

// ParseDType parses fp32, fp16 or bf16 (also float32, float16, bfloat16).
func ParseDType(s string) (DType, error) { return attn.ParseDType(s) }

// NewProblem validates q, k, v and opt and returns the problem they
// describe, without computing anything.
func NewProblem(q, k, v Tensor, opt Options) (*Problem, error) {
	return attn.NewProblem(q, k, v, opt)
}

// Open returns the backend called name:
//
//   - "cpu": the pure-Go backend, always available;
//   - "cuda": the GPU backend; it fails when no GPU works, with an error
//     that says why (no driver, no device, a failed initialisation);
//   - "auto": the GPU backend when one works, otherwise the CPU backend.
//
// Any other name fails with an error wrapping ErrOption. Close a backend
// that implements io.Closer when done with it.
func Open(name string) (Backend, error) {
	switch name {
	case "cpu":
		return openCPU(), nil
	case "cuda":
		return openCUDA()
	case "auto":
		if b, err := openCUDA(); err == nil {
			return b, nil
		}
		return openCPU(), nil
	}
	return nil, attn.Errorf(attn.ErrOption, "backend %q is not cpu, cuda or auto", name)
}

// auto is the backend Forward and Backward use, opened on first use.
var auto = sync.OnceValue(func() Backend {
	b, _ := Open("auto") // "auto" always yields a backend
	return b
})

// Forward computes attention on the automatically chosen backend (see Open):
// O [B, N, H, DV] in q's dtype and LSE [B, H, N] in float32 (packed batches:
// [totalQ, H, DV] and [H, totalQ]). A problem the chosen backend cannot run
// fails with an error wrapping ErrUnsupported; nothing is handed to another
// backend behind the caller's back.
func Forward(q, k, v Tensor, opt Options) (Result, error) {
	return auto().Forward(q, k, v, opt)
}

// Backward computes dQ, dK, dV (and dBias when opt.Bias.RequiresGrad) from
// the forward's inputs q, k, v, its outputs o and lse, and the output
// gradient dO, on the automatically chosen backend (see Forward).
//
// opt must be the forward's options, unchanged: the same mask, alignment,
// scale, softcap, bias, cu_seqlens and dropout probability, seed and
// offset. Other options are not detected; they give wrong gradients. This
// form is for callers that keep O and LSE themselves; ForwardOn returns a
// Forwarded whose Backward takes only dO and cannot be given other options.
func Backward(q, k, v, o, lse, dO Tensor, opt Options) (Gradients, error) {
	return auto().Backward(q, k, v, o, lse, dO, opt)
}
