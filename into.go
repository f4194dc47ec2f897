package flashattn

import "github.com/flashattn/flashattn/attn"

// IntoBackend is a Backend that writes into caller-allocated outputs; see
// ForwardInto and BackwardInto.
type IntoBackend = attn.IntoBackend

// ForwardInto computes attention on backend b into res.O ([B, N, H, DV] in
// q's dtype; packed: [totalQ, H, DV]) and res.LSE (float32 [B, H, N];
// packed: [H, totalQ]), tensors the caller allocated once in any layout
// (a BHSD view of a [B, H, N, D] buffer, say). On a backend that
// implements IntoBackend (the CUDA backend) nothing is allocated on the
// host per call; on others the result is computed and copied in.
func ForwardInto(b Backend, q, k, v Tensor, res Result, opt Options) error {
	if b == nil {
		return attn.Errorf(attn.ErrOption, "ForwardInto: nil backend")
	}
	if ib, ok := b.(IntoBackend); ok {
		return ib.ForwardInto(q, k, v, res, opt)
	}
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return err
	}
	if err := p.CheckResult(q.DType, res); err != nil {
		return err
	}
	got, err := b.Forward(q, k, v, opt)
	if err != nil {
		return err
	}
	if err := attn.CopyInto(res.O, got.O); err != nil {
		return err
	}
	return attn.CopyInto(res.LSE, got.LSE)
}

// BackwardInto computes dQ, dK, dV (and dBias when opt.Bias.RequiresGrad)
// on backend b into g's tensors, which the caller allocated once in the
// shapes of q, k, v (and the bias), in any layout. opt must be the
// forward's options, unchanged (Forwarded.Backward cannot get them wrong).
// Like ForwardInto, it allocates nothing on the host per call on an
// IntoBackend and copies in on others.
func BackwardInto(b Backend, q, k, v, o, lse, dO Tensor, g Gradients, opt Options) error {
	if b == nil {
		return attn.Errorf(attn.ErrOption, "BackwardInto: nil backend")
	}
	if ib, ok := b.(IntoBackend); ok {
		return ib.BackwardInto(q, k, v, o, lse, dO, g, opt)
	}
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return err
	}
	if err := p.CheckGradients(q, k, v, g); err != nil {
		return err
	}
	got, err := b.Backward(q, k, v, o, lse, dO, opt)
	if err != nil {
		return err
	}
	for _, x := range [][2]Tensor{{g.DQ, got.DQ}, {g.DK, got.DK}, {g.DV, got.DV}} {
		if err := attn.CopyInto(x[0], x[1]); err != nil {
			return err
		}
	}
	if opt.Bias != nil && opt.Bias.RequiresGrad {
		return attn.CopyInto(*g.DBias, *got.DBias)
	}
	return nil
}
