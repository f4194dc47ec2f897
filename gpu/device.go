package gpu

import (
	"math"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// DeviceTensor is a strided view of device memory: element (i0, i1, …)
// lives at element Offset + Σ i_d·Strides[d] of Buf. Nil Strides mean
// contiguous row-major. Buf may be nil only for a tensor with no elements.
type DeviceTensor struct {
	Buf     *cuda.Buffer
	Offset  int64
	DType   attn.DType
	Shape   []int
	Strides []int

	base uint64 // address of element 0 when Buf is nil (host emulation in tests)
}

// NewDeviceTensor allocates a contiguous tensor on dev. Its contents are
// undefined. A tensor with no elements gets no buffer.
func NewDeviceTensor(dev *cuda.Device, dt attn.DType, shape ...int) (DeviceTensor, error) {
	t := DeviceTensor{DType: dt, Shape: append([]int(nil), shape...), Strides: attn.ContiguousStrides(shape)}
	n := int64(attn.NumElements(shape))
	if n == 0 {
		return t, nil
	}
	buf, err := dev.Alloc(n * int64(dt.Size()))
	if err != nil {
		return DeviceTensor{}, err
	}
	t.Buf = buf
	return t, nil
}

// TensorAt returns a device tensor viewing memory the caller owns, for
// frameworks that keep their tensors in their own allocations: element
// (i0, i1, …) of type dt lives at address ptr + (Σ i_d·strides[d])·size
// (nil strides: contiguous row-major). ptr must be a device address in
// dev's context (see cuda.OpenContext for a context of the caller's); the
// memory is borrowed (cuda.Device.BorrowBuffer), so Free leaves it to the
// caller, who keeps it alive while work enqueued on it runs. It fails with
// errors wrapping attn.ErrLayout, attn.ErrShape or attn.ErrDType for a
// layout that is not well formed (negative sizes or strides, extents that
// overflow).
func TensorAt(dev *cuda.Device, ptr uint64, dt attn.DType, shape, strides []int) (DeviceTensor, error) {
	if !dt.Valid() {
		return DeviceTensor{}, attn.Errorf(attn.ErrDType, "TensorAt: dtype %d", int(dt))
	}
	if strides == nil {
		strides = attn.ContiguousStrides(shape)
	}
	t := DeviceTensor{DType: dt, Shape: append([]int(nil), shape...), Strides: append([]int(nil), strides...)}
	end, err := attn.LayoutSpan("TensorAt", shape, strides, 0)
	if err != nil {
		return DeviceTensor{}, err
	}
	span := int64(end)
	if span == 0 {
		return t, nil
	}
	if ptr == 0 {
		return DeviceTensor{}, attn.Errorf(attn.ErrLayout, "TensorAt: nil device pointer for %v", shape)
	}
	if span > math.MaxInt64/int64(dt.Size()) {
		return DeviceTensor{}, attn.Errorf(attn.ErrLayout, "TensorAt: %d elements of %d bytes overflow", span, dt.Size())
	}
	buf, err := dev.BorrowBuffer(ptr, span*int64(dt.Size()))
	if err != nil {
		return DeviceTensor{}, attn.Errorf(attn.ErrLayout, "TensorAt: %v", err)
	}
	t.Buf = buf
	return t, nil
}

// Narrow returns the view of t whose index along axis runs over [start,
// start+n): the same buffer and strides, the offset moved to element
// start. It fails with an error wrapping attn.ErrShape for an axis or a
// range outside t.
func (t DeviceTensor) Narrow(axis, start, n int) (DeviceTensor, error) {
	if axis < 0 || axis >= len(t.Shape) || start < 0 || n < 0 || start > t.Shape[axis]-n {
		return DeviceTensor{}, attn.Errorf(attn.ErrShape, "narrow: [%d, %d+%d) along axis %d of %v", start, start, n, axis, t.Shape)
	}
	st := t.strides()
	v := t
	v.Shape = append([]int(nil), t.Shape...)
	v.Shape[axis] = n
	v.Strides = append([]int(nil), st...)
	if t.Buf == nil && t.base != 0 {
		v.base = t.base + uint64(start*st[axis]*t.DType.Size()) // (host emulation: element 0's address moves)
	} else {
		v.Offset = t.Offset + int64(start)*int64(st[axis])
	}
	return v, nil
}

// Free frees the tensor's buffer (if any).
func (t DeviceTensor) Free() error {
	if t.Buf == nil {
		return nil
	}
	return t.Buf.Free()
}

// strides returns the effective strides.
func (t DeviceTensor) strides() []int {
	if t.Strides == nil {
		return attn.ContiguousStrides(t.Shape)
	}
	return t.Strides
}

// NumElements returns the number of logical elements.
func (t DeviceTensor) NumElements() int { return attn.NumElements(t.Shape) }

// ptr returns the device address of element 0 (0 for an empty tensor).
func (t DeviceTensor) ptr() uint64 {
	if t.Buf == nil {
		return t.base
	}
	return t.Buf.Ptr() + uint64(t.Offset)*uint64(t.DType.Size())
}

// check reports whether t is a well-formed tensor of rank rank and dtype dt
// that lies inside its buffer, and whether its feature (last) dim has
// stride 1 when feat is set.
func (t DeviceTensor) check(name string, dt attn.DType, rank int, feat bool) error {
	if t.DType != dt {
		return attn.Errorf(attn.ErrDType, "%s: dtype %v, want %v", name, t.DType, dt)
	}
	if len(t.Shape) != rank {
		return attn.Errorf(attn.ErrShape, "%s: shape %v, want rank %d", name, t.Shape, rank)
	}
	st := t.strides()
	if len(st) != rank {
		return attn.Errorf(attn.ErrLayout, "%s: %d strides for %d dims", name, len(st), rank)
	}
	if t.Offset > math.MaxInt {
		return attn.Errorf(attn.ErrLayout, "%s: offset %d past the largest int index", name, t.Offset)
	}
	end, err := attn.LayoutSpan(name, t.Shape, st, int(t.Offset))
	if err != nil {
		return err
	}
	if end == 0 {
		return nil
	}
	last := int64(end - 1)
	if t.Buf == nil {
		return attn.Errorf(attn.ErrLayout, "%s: no buffer for %v", name, t.Shape)
	}
	if have := t.Buf.Size() / int64(dt.Size()); last >= have {
		return attn.Errorf(attn.ErrLayout, "%s: shape %v strides %v offset %d reach element %d of a buffer of %d",
			name, t.Shape, st, t.Offset, last, have)
	}
	if feat && t.Shape[rank-1] > 1 && st[rank-1] != 1 {
		return attn.Errorf(attn.ErrUnsupported, "%s: feature-dim stride %d (the CUDA kernels need 1)", name, st[rank-1])
	}
	return nil
}

// DeviceOptions are the options of ForwardDevice (and, embedded in
// BackwardOptions, of BackwardDevice): the host options plus the device
// copies the kernels read. Each setting has one source:
//
//   - the bias is DeviceOptions.Bias alone; Options.Bias must be nil (a call
//     with it set fails with attn.ErrOption rather than ignore a host
//     tensor), and the host forms move their Options.Bias to the device
//     into DeviceOptions.Bias;
//   - a packed batch's offsets are Options.CuSeqlensQ/K, read on the host
//     for the batch's sizes and validated there; DeviceOptions.CuSeqlensQ/K
//     must hold the same offsets on the device for the kernels.
type DeviceOptions struct {
	attn.Options
	// Bias is the additive bias on the device, [B|1, H|1, N, M] in any dtype.
	Bias *DeviceTensor
	// CuSeqlensQ and CuSeqlensK hold the int32 offsets of Options.CuSeqlensQ
	// and CuSeqlensK on the device (packed batches only).
	CuSeqlensQ, CuSeqlensK *cuda.Buffer
	// Staging is optional forward scratch of at least the bytes
	// Backend.PrepareForward returns: when 16-bit q, k and v have rows that
	// are not 16-byte aligned (head dims not multiples of 8, odd ones in
	// particular), the forward copies them into it with padded rows and
	// reads the copies with 16-byte loads. Without it such rows load with
	// narrower copies, odd ones element by element (correct, slower). The
	// Hopper forward reads such rows in place instead, with no staging,
	// where their layout allows it (kernels.Variant.Flat: fixed-length,
	// one query head per key head, heads contiguous, H·D a multiple of 8
	// and room for every head's shift up to the next multiple of 16; the
	// backward likewise, kernels.BwdVariant.Flat); PrepareForward then
	// returns 0. Where fewer than half the heads lack that room (D = 59:
	// two in eight), only those are copied and the rest read in place
	// (kernels.Variant.FlatStaged), and PrepareForward returns the smaller
	// size. The backward does not read it.
	Staging *cuda.Buffer
}

// deviceProblemOf returns the problem of a device call made from the host
// problem p (validated by attn.NewProblem) with device options opt: the
// problem deviceProblem would return for the device copies of p's
// tensors, without validating them again.
func deviceProblemOf(p *attn.Problem, opt DeviceOptions) *attn.Problem {
	dp := *p
	dp.Opt = opt.Options
	return &dp
}

// deviceProblem validates device tensors and options as attn.NewProblem
// does for host tensors, and returns the problem.
func deviceProblem(q, k, v DeviceTensor, opt DeviceOptions) (*attn.Problem, error) {
	if opt.Options.Bias != nil {
		return nil, attn.Errorf(attn.ErrOption, "device options: the bias goes in DeviceOptions.Bias, not Options.Bias")
	}
	if !q.DType.Valid() {
		return nil, attn.Errorf(attn.ErrDType, "q: dtype %d", int(q.DType))
	}
	p := &attn.Problem{Opt: opt.Options}
	p.Varlen = opt.CuSeqlensQ != nil || opt.CuSeqlensK != nil || opt.Options.CuSeqlensQ != nil || opt.Options.CuSeqlensK != nil
	rank := 4
	if p.Varlen {
		rank = 3
	}
	for _, x := range []struct {
		name string
		t    DeviceTensor
	}{{"q", q}, {"k", k}, {"v", v}} {
		if err := x.t.check(x.name, q.DType, rank, true); err != nil {
			return nil, err
		}
	}
	if p.Varlen {
		p.TotalQ, p.H, p.DK = q.Shape[0], q.Shape[1], q.Shape[2]
		p.TotalK, p.Hkv = k.Shape[0], k.Shape[1]
		if v.Shape[0] != p.TotalK || v.Shape[1] != p.Hkv || k.Shape[2] != p.DK {
			return nil, attn.Errorf(attn.ErrShape, "q %v, k %v, v %v do not fit [totalQ, H, DK], [totalK, Hkv, DK], [totalK, Hkv, DV]", q.Shape, k.Shape, v.Shape)
		}
		p.DV = v.Shape[2]
		if err := checkCuSeqlens(p, opt); err != nil {
			return nil, err
		}
	} else {
		p.B, p.N, p.H, p.DK = q.Shape[0], q.Shape[1], q.Shape[2], q.Shape[3]
		p.M, p.Hkv = k.Shape[1], k.Shape[2]
		if k.Shape[0] != p.B || v.Shape[0] != p.B || k.Shape[3] != p.DK || v.Shape[1] != p.M || v.Shape[2] != p.Hkv {
			return nil, attn.Errorf(attn.ErrShape, "q %v, k %v, v %v do not fit [B, N, H, DK], [B, M, Hkv, DK], [B, M, Hkv, DV]", q.Shape, k.Shape, v.Shape)
		}
		p.DV = v.Shape[3]
	}
	if err := p.Resolve(); err != nil {
		return nil, err
	}
	if opt.Bias != nil {
		if p.Varlen {
			return nil, attn.Errorf(attn.ErrUnsupported, "bias with a packed variable-length batch")
		}
		if err := opt.Bias.check("bias", opt.Bias.DType, 4, false); err != nil {
			return nil, err
		}
		s := opt.Bias.Shape
		if (s[0] != 1 && s[0] != p.B) || (s[1] != 1 && s[1] != p.H) || s[2] != p.N || s[3] != p.M {
			return nil, attn.Errorf(attn.ErrShape, "bias shape %v does not broadcast to [B=%d, H=%d, N=%d, M=%d]", s, p.B, p.H, p.N, p.M)
		}
	}
	return p, nil
}

// checkCuSeqlens validates the host offsets of a packed batch and that the
// device copies exist and hold them.
func checkCuSeqlens(p *attn.Problem, opt DeviceOptions) error {
	cq, ck := opt.Options.CuSeqlensQ, opt.Options.CuSeqlensK
	if cq == nil || ck == nil || opt.CuSeqlensQ == nil || opt.CuSeqlensK == nil {
		return attn.Errorf(attn.ErrOption, "packed batch: host and device cu_seqlens for both q and k are needed")
	}
	if len(cq) != len(ck) || len(cq) < 2 {
		return attn.Errorf(attn.ErrOption, "cu_seqlens have %d and %d entries: want the same number, at least 2", len(cq), len(ck))
	}
	for _, x := range []struct {
		name  string
		cu    []int32
		dev   *cuda.Buffer
		total int
		max   *int
	}{{"cu_seqlens_q", cq, opt.CuSeqlensQ, p.TotalQ, &p.N}, {"cu_seqlens_k", ck, opt.CuSeqlensK, p.TotalK, &p.M}} {
		if x.cu[0] != 0 {
			return attn.Errorf(attn.ErrOption, "%s[0] = %d, want 0", x.name, x.cu[0])
		}
		for i := 1; i < len(x.cu); i++ {
			if x.cu[i] < x.cu[i-1] {
				return attn.Errorf(attn.ErrOption, "%s not non-decreasing at %d", x.name, i)
			}
			*x.max = max(*x.max, int(x.cu[i]-x.cu[i-1]))
		}
		if int(x.cu[len(x.cu)-1]) != x.total {
			return attn.Errorf(attn.ErrOption, "%s ends at %d but the packed tensor has %d tokens", x.name, x.cu[len(x.cu)-1], x.total)
		}
		if x.dev.Size() < int64(4*len(x.cu)) {
			return attn.Errorf(attn.ErrLayout, "%s: device buffer of %d bytes holds fewer than %d offsets", x.name, x.dev.Size(), len(x.cu))
		}
	}
	p.B = len(cq) - 1
	return nil
}

// checkOutputs validates o and lse against the problem.
func checkOutputs(p *attn.Problem, dt attn.DType, o, lse DeviceTensor) error {
	if err := o.check("o", dt, len(p.OutputShape()), true); err != nil {
		return err
	}
	if err := lse.check("lse", attn.Float32, len(p.LSEShape()), false); err != nil {
		return err
	}
	for _, x := range []struct {
		name      string
		got, want []int
	}{{"o", o.Shape, p.OutputShape()}, {"lse", lse.Shape, p.LSEShape()}} {
		for i := range x.want {
			if x.got[i] != x.want[i] {
				return attn.Errorf(attn.ErrShape, "%s shape %v, want %v", x.name, x.got, x.want)
			}
		}
	}
	return nil
}

// checkDropoutAt refuses a dropout origin (attn.Options.DropoutAt, already
// validated as every backend validates it) that the kernels cannot draw:
// a key origin that is not a multiple of 16 (they draw the mask in 16-key
// blocks aligned to their tiles), or positions and heads past the 32-bit
// counter words. Both planners call it, so host-tensor and device calls
// are refused alike.
func checkDropoutAt(p *attn.Problem) error {
	d := p.Opt.DropoutAt
	if d == nil || p.Opt.Dropout == 0 {
		return nil
	}
	if d.Key%16 != 0 {
		return attn.Errorf(attn.ErrUnsupported, "cuda backend: dropout key origin %d is not a multiple of 16 (Options.DropoutAt)", d.Key)
	}
	head, heads, qo, ko := p.DropoutPlace(0)
	if int64(qo)+int64(p.N) > math.MaxInt32 || int64(ko)+int64(p.M) > math.MaxInt32 || int64(p.B)*int64(heads)+int64(head)+int64(p.H) > math.MaxUint32 {
		return attn.Errorf(attn.ErrUnsupported, "cuda backend: dropout origin %+v places the call past the mask's 32-bit positions", *d)
	}
	return nil
}
