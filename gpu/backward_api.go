package gpu

import (
	"slices"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// BackwardOptions are the options of BackwardDevice: the forward's device
// options plus what only the backward needs.
type BackwardOptions struct {
	DeviceOptions
	// DBias, when set, receives dBias: a contiguous [bB, bH, N, M] tensor in
	// the bias's dtype and shape (DeviceOptions.Bias must be set).
	DBias *DeviceTensor
	// DQ selects the dQ algorithm; DQAuto uses SelectDQAlgorithmFor, and
	// Options.Deterministic forces DQSeparate.
	DQ DQAlgorithm
	// Workspace is device scratch of at least BackwardWorkspaceBytes bytes
	// (PrepareBackward returns the size).
	Workspace *cuda.Buffer
}

// bwdDeviceArgs validates the device tensors of a backward call and
// returns the problem and the raw views the kernels take.
func bwdDeviceArgs(q, k, v, o, lse, dO, dq, dk, dv DeviceTensor, opt BackwardOptions) (*attn.Problem, bwdArgs, error) {
	var a bwdArgs
	p, err := deviceProblem(q, k, v, opt.DeviceOptions)
	if err != nil {
		return nil, a, err
	}
	if err := checkOutputs(p, q.DType, o, lse); err != nil {
		return nil, a, err
	}
	rank := len(p.OutputShape())
	for _, x := range []struct {
		name string
		t    DeviceTensor
		like []int
	}{{"dO", dO, o.Shape}, {"dq", dq, q.Shape}, {"dk", dk, k.Shape}, {"dv", dv, v.Shape}} {
		if err := x.t.check(x.name, q.DType, rank, true); err != nil {
			return nil, a, err
		}
		for i := range x.like {
			if x.t.Shape[i] != x.like[i] {
				return nil, a, attn.Errorf(attn.ErrShape, "%s shape %v, want %v", x.name, x.t.Shape, x.like)
			}
		}
	}
	view := func(t DeviceTensor) bwdView {
		sb, sn, sh := seqStrides(t, p.Varlen)
		return bwdView{Ptr: t.ptr(), DType: t.DType, Batch: sb, Row: sn, Head: sh}
	}
	a.Q, a.K, a.V, a.O, a.DO = view(q), view(k), view(v), view(o), view(dO)
	a.DQ, a.DK, a.DV = view(dq), view(dk), view(dv)
	lb, lh, ln := lseStrides(lse, p.Varlen)
	if ln != 1 && lse.Shape[len(lse.Shape)-1] > 1 {
		return nil, a, attn.Errorf(attn.ErrUnsupported, "lse: position stride %d (the backward kernels need 1)", ln)
	}
	a.LSE = bwdView{Ptr: lse.ptr(), DType: attn.Float32, Batch: lb, Head: lh}
	if bt := opt.Bias; bt != nil {
		st := bt.strides()
		a.Bias = &bwdBiasView{Ptr: bt.ptr(), DType: bt.DType, Batches: bt.Shape[0], Heads: bt.Shape[1],
			Batch: int64(st[0]), Head: int64(st[1]), Query: int64(st[2]), Key: int64(st[3])}
	}
	if db := opt.DBias; db != nil {
		if opt.Bias == nil {
			return nil, a, attn.Errorf(attn.ErrOption, "dBias without a bias")
		}
		if err := db.check("dbias", opt.Bias.DType, 4, false); err != nil {
			return nil, a, err
		}
		want := attn.ContiguousStrides(opt.Bias.Shape)
		for i, s := range db.strides() {
			if db.Shape[i] != opt.Bias.Shape[i] || (db.Shape[i] > 1 && s != want[i]) {
				return nil, a, attn.Errorf(attn.ErrLayout, "dbias: shape %v strides %v, want contiguous %v", db.Shape, db.strides(), opt.Bias.Shape)
			}
		}
		a.DBias = &bwdBiasView{Ptr: db.ptr(), DType: db.DType, Batches: db.Shape[0], Heads: db.Shape[1]}
	}
	if p.Varlen {
		a.CuSeqlensQ, a.CuSeqlensK = opt.CuSeqlensQ.Ptr(), opt.CuSeqlensK.Ptr()
	}
	return p, a, nil
}

// PrepareBackward validates a BackwardDevice call, compiles its kernels
// (so that the call itself only enqueues, as a CUDA graph capture needs)
// and returns the dQ algorithm it will use and the workspace bytes it
// needs. opt.Workspace is not read.
func (b *Backend) PrepareBackward(q, k, v, o, lse, dO, dq, dk, dv DeviceTensor, opt BackwardOptions) (DQAlgorithm, int64, error) {
	p, a, err := bwdDeviceArgs(q, k, v, o, lse, dO, dq, dk, dv, opt)
	if err != nil {
		return opt.DQ, 0, err
	}
	algo := resolveDQ(p, opt.DQ, bwdHopperRuns(p, q.DType, &a, hopperCapable(b.dev)))
	if err := prepareBackward(b.dev, p, q.DType, a, algo); err != nil {
		return algo, 0, err
	}
	return algo, BackwardWorkspaceBytes(p, q.DType, algo, a.DBias != nil), nil
}

// BackwardDevice enqueues the backward pass on stream s: dq, dk, dv (and
// opt.DBias) from q, k, v, the forward's o and lse, and dO, all device
// tensors with the layouts of ForwardDevice (feature dims with stride 1,
// lse rows contiguous). It neither synchronizes nor allocates, so a
// forward and backward enqueued on one stream can be captured in a CUDA
// graph once PrepareBackward has compiled the kernels. It returns the dQ
// algorithm used. Errors from the kernels' execution appear at the
// stream's next synchronization.
func (b *Backend) BackwardDevice(s *cuda.Stream, q, k, v, o, lse, dO, dq, dk, dv DeviceTensor, opt BackwardOptions) (DQAlgorithm, error) {
	p, a, err := bwdDeviceArgs(q, k, v, o, lse, dO, dq, dk, dv, opt)
	if err != nil {
		return opt.DQ, err
	}
	algo := resolveDQ(p, opt.DQ, bwdHopperRuns(p, q.DType, &a, hopperCapable(b.dev)))
	need := BackwardWorkspaceBytes(p, q.DType, algo, a.DBias != nil)
	if opt.Workspace == nil || opt.Workspace.Size() < need {
		return algo, attn.Errorf(attn.ErrOption, "backward: workspace of %d bytes needed", need)
	}
	a.Workspace = opt.Workspace.Ptr()
	return enqueueBackward(b.dev, s, p, q.DType, a, algo)
}

// backward computes the gradients of host tensors on the GPU (see
// BackwardInto) and returns them in the input shapes and memory orders
// (attn.NewLike: the gradients of a [B, H, N, D] buffer viewed as
// [B, N, H, D] come back in that memory order).
func (b *Backend) backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return attn.Gradients{}, err
	}
	if err := p.CheckBackward(q, o, lse, dO); err != nil {
		return attn.Gradients{}, err
	}
	// headers in the inputs' memory orders; the storage is allocated while
	// the inputs go to the device
	like := func(t attn.Tensor) attn.Tensor {
		return attn.Tensor{DType: q.DType, Shape: slices.Clone(t.Shape), Strides: attn.StridesLike(t)}
	}
	g := attn.Gradients{DQ: like(q), DK: like(k), DV: like(v)}
	hs := []attn.Tensor{g.DQ, g.DK, g.DV}
	if opt.Bias != nil && opt.Bias.RequiresGrad {
		db := header(opt.Bias.Tensor.DType, opt.Bias.Tensor.Shape)
		g.DBias = &db
		hs = append(hs, db)
	}
	late := allocLate(hs...)
	if err := b.backwardHost(p, q, k, v, o, lse, dO, g, late, opt); err != nil {
		return attn.Gradients{}, err
	}
	ts := late.wait()
	g = attn.Gradients{DQ: ts[0], DK: ts[1], DV: ts[2]}
	if len(ts) > 3 {
		g.DBias = &ts[3]
	}
	return g, nil
}
