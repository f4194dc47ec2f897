package attn

// Result is the output of a forward pass: O [B, N, H, DV] in q's dtype (packed:
// [totalQ, H, DV]) and the float32 natural-log LSE [B, H, N] (packed: [H, totalQ]).
// Read them with O.Float32s() (every element, row-major in the shape),
// O.At(b, i, h, d) and O.Shape; ToBHSD(O) views O in PyTorch's order.
type Result struct {
	O, LSE Tensor
}

// Gradients is the output of a backward pass, each in its input's dtype and
// shape: DQ like q, DK like k, DV like v. A backend that allocates them with
// NewLike also gives each its input's memory order, so that gradients of a
// BHSD view come back as the same kind of view. DBias is set only when the
// bias asked for its gradient.
type Gradients struct {
	DQ, DK, DV Tensor
	DBias      *Tensor
}

// Backend computes attention. Implementations validate their inputs with
// NewProblem and return ErrUnsupported for valid problems they cannot run;
// none silently hands work to another backend.
type Backend interface {
	// Name returns a short name such as "cpu" or "cuda".
	Name() string
	// Forward computes O and LSE.
	Forward(q, k, v Tensor, opt Options) (Result, error)
	// Backward computes the gradients given the forward's inputs and outputs
	// and dO. opt must be the forward's options, unchanged (mask, scale,
	// bias, cu_seqlens, dropout seed and offset): other options are not
	// detected and give wrong gradients.
	Backward(q, k, v, o, lse, dO Tensor, opt Options) (Gradients, error)
}
