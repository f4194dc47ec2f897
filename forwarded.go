package flashattn

import (
	"slices"

	"github.com/flashattn/flashattn/attn"
)

// Forwarded is a forward pass that runs its own backward. It holds the
// forward's Result (O and LSE, embedded: read them as f.O and f.LSE) and
// everything the backward needs: the backend, q, k and v, O and LSE, and the
// options, the dropout seed and offset included. Its Backward therefore
// cannot be given options other than the forward's — a different dropout
// pair, a causal forward differentiated as non-causal — which the explicit
// Backward accepts and answers with wrong gradients.
//
// The options are copied (window, bias header, cu_seqlens), so changing the
// caller's Options afterwards changes nothing; the tensors' storage is
// shared, not copied, and must not be written until the backward has run.
// Reassigning f.O or f.LSE does not change what Backward uses. Backward
// may run more than once, and concurrently where the backend allows it.
type Forwarded struct {
	Result
	b       Backend
	q, k, v Tensor
	o, lse  Tensor
	opt     Options
}

// ForwardOn runs the forward on backend b and returns it with what its
// backward needs. To draw a fresh dropout mask per call, pass the options
// through a Generator: ForwardOn(b, q, k, v, gen.Draw(opt)). A nil b fails
// with an error wrapping ErrOption; bad input fails as b.Forward does.
func ForwardOn(b Backend, q, k, v Tensor, opt Options) (*Forwarded, error) {
	if b == nil {
		return nil, attn.Errorf(attn.ErrOption, "ForwardOn: nil backend")
	}
	res, err := b.Forward(q, k, v, opt)
	if err != nil {
		return nil, err
	}
	return &Forwarded{
		Result: res,
		b:      b,
		q:      cloneHeader(q), k: cloneHeader(k), v: cloneHeader(v),
		o: cloneHeader(res.O), lse: cloneHeader(res.LSE),
		opt: cloneOptions(opt),
	}, nil
}

// Backward computes dQ, dK, dV (and dBias when the bias asked for it) for
// the output gradient dO [B, N, H, DV] (packed: [totalQ, H, DV]), with the
// forward's backend, inputs, outputs and options, its dropout pair
// included. The gradients have their inputs' shapes and, on the CPU
// backend, their inputs' memory order (see NewLike).
func (f *Forwarded) Backward(dO Tensor) (Gradients, error) {
	return f.b.Backward(f.q, f.k, f.v, f.o, f.lse, dO, f.opt)
}

// Options returns a copy of the options the forward ran with, with the
// dropout seed and offset it used.
func (f *Forwarded) Options() Options { return cloneOptions(f.opt) }

// Backend returns the backend the forward ran on, which Backward uses too.
func (f *Forwarded) Backend() Backend { return f.b }

// cloneHeader returns t with its own copies of Shape and Strides; the
// storage is shared.
func cloneHeader(t Tensor) Tensor {
	t.Shape, t.Strides = slices.Clone(t.Shape), slices.Clone(t.Strides)
	return t
}

// cloneOptions returns opt with its own copies of everything it points to,
// except tensor storage.
func cloneOptions(opt Options) Options {
	if opt.Window != nil {
		w := *opt.Window
		opt.Window = &w
	}
	if opt.Bias != nil {
		b := *opt.Bias
		b.Tensor = cloneHeader(b.Tensor)
		opt.Bias = &b
	}
	opt.CuSeqlensQ, opt.CuSeqlensK = slices.Clone(opt.CuSeqlensQ), slices.Clone(opt.CuSeqlensK)
	return opt
}
