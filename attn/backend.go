package attn

// Result is the output of a forward pass: O [B, N, H, DV] in q's dtype (packed:
// [totalQ, H, DV]) and the float32 natural-log LSE [B, H, N] (packed: [H, totalQ]).
type Result struct {
	O, LSE Tensor
}

// Gradients is the output of a backward pass, each in its input's dtype and
// shape. DBias is set only when the bias asked for its gradient.
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
	// Backward computes the gradients given the forward's inputs and outputs and dO.
	Backward(q, k, v, o, lse, dO Tensor, opt Options) (Gradients, error)
}
