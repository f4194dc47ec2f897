package attn

import "slices"

// IntoBackend is a Backend that also writes its outputs into tensors the
// caller allocated, once, in any layout, so that a training loop's steps
// allocate nothing per call.
type IntoBackend interface {
	Backend
	// ForwardInto computes O and LSE into res.O and res.LSE, which must have
	// the shapes and dtypes Forward would return.
	ForwardInto(q, k, v Tensor, res Result, opt Options) error
	// BackwardInto computes the gradients into g's tensors, which must have
	// the shapes and dtypes Backward would return (g.DBias when the bias
	// asks for its gradient); opt is the forward's options, unchanged.
	BackwardInto(q, k, v, o, lse, dO Tensor, g Gradients, opt Options) error
}

// CheckOutput validates an output tensor a caller provides: well formed
// (CheckLayout), of dtype dt and shape want. The error wraps ErrLayout,
// ErrDType or ErrShape; name names the tensor in its message.
func CheckOutput(name string, t Tensor, dt DType, want []int) error {
	if err := t.CheckLayout(name); err != nil {
		return err
	}
	if t.DType != dt {
		return Errorf(ErrDType, "%s: dtype %v, want %v", name, t.DType, dt)
	}
	if !slices.Equal(t.Shape, want) {
		return Errorf(ErrShape, "%s: shape %v, want %v", name, t.Shape, want)
	}
	return nil
}

// CopyInto copies the elements of src into dst, which must have src's
// dtype and shape; both may have any strides. It fails with an error
// wrapping ErrDType, ErrShape or ErrLayout otherwise.
func CopyInto(dst, src Tensor) error {
	if err := src.CheckLayout("source"); err != nil {
		return err
	}
	if err := CheckOutput("destination", dst, src.DType, src.Shape); err != nil {
		return err
	}
	n := src.NumElements()
	if n == 0 {
		return nil
	}
	ds, ss := dst.strides(), src.strides()
	idx := make([]int, len(src.Shape))
	do, so := dst.Offset, src.Offset
	for lin := 0; lin < n; lin++ {
		if src.DType == Float32 {
			dst.F32[do] = src.F32[so]
		} else {
			dst.Bits[do] = src.Bits[so]
		}
		for d := len(idx) - 1; d >= 0; d-- {
			idx[d]++
			do += ds[d]
			so += ss[d]
			if idx[d] < src.Shape[d] {
				break
			}
			do -= idx[d] * ds[d]
			so -= idx[d] * ss[d]
			idx[d] = 0
		}
	}
	return nil
}

// CheckResult validates outputs a caller provides for p's forward: O of
// dtype dt in p.OutputShape() and a float32 LSE in p.LSEShape().
func (p *Problem) CheckResult(dt DType, res Result) error {
	if err := CheckOutput("o", res.O, dt, p.OutputShape()); err != nil {
		return err
	}
	return CheckOutput("lse", res.LSE, Float32, p.LSEShape())
}

// CheckGradients validates outputs a caller provides for p's backward: dQ,
// dK, dV of q's dtype in the shapes of q, k, v, and dBias in the bias's
// dtype and shape when the bias asks for its gradient (an error wrapping
// ErrOption when g.DBias is nil then).
func (p *Problem) CheckGradients(q, k, v Tensor, g Gradients) error {
	for _, x := range []struct {
		name      string
		dst, like Tensor
	}{{"dq", g.DQ, q}, {"dk", g.DK, k}, {"dv", g.DV, v}} {
		if err := CheckOutput(x.name, x.dst, q.DType, x.like.Shape); err != nil {
			return err
		}
	}
	if b := p.Opt.Bias; b != nil && b.RequiresGrad {
		if g.DBias == nil {
			return Errorf(ErrOption, "dbias: the bias asks for its gradient but Gradients.DBias is nil")
		}
		return CheckOutput("dbias", *g.DBias, b.Tensor.DType, b.Tensor.Shape)
	}
	return nil
}
