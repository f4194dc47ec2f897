package gpu

import (
	"fmt"
	"slices"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// The backward pass. As for the forward, every entry validates its call
// once (attn.NewProblem and Problem.CheckBackward for host tensors,
// bwdDeviceArgs for device tensors), plans it once (planBackward) and
// enqueues the plan (enqueueBackward); the host forms upload their inputs
// between the validation and the plan, and bind the plan to the workspace
// they then allocate.

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

// Backward computes dQ, dK, dV (and dBias) of host tensors on the GPU (see
// BackwardInto) and returns them in the input shapes and memory orders
// (attn.NewLike: the gradients of a [B, H, N, D] buffer viewed as
// [B, N, H, D] come back in that memory order).
func (b *Backend) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	rec := b.traceCall("backward")
	countValidation()
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
	if err := b.backwardHost(p, q, k, v, o, lse, dO, g, late, opt, rec); err != nil {
		return attn.Gradients{}, err
	}
	ts := late.wait()
	g = attn.Gradients{DQ: ts[0], DK: ts[1], DV: ts[2]}
	if len(ts) > 3 {
		g.DBias = &ts[3]
	}
	return g, nil
}

// BackwardInto computes dQ, dK, dV (and dBias when opt.Bias.RequiresGrad)
// of host tensors on the GPU into g's tensors, which the caller allocated
// in the shapes of q, k, v (and the bias) with any layout; opt must be the
// forward's options, unchanged. Like ForwardInto it allocates nothing per
// call once a shape has run.
func (b *Backend) BackwardInto(q, k, v, o, lse, dO attn.Tensor, g attn.Gradients, opt attn.Options) error {
	rec := b.traceCall("backward into")
	countValidation()
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return err
	}
	if err := p.CheckBackward(q, o, lse, dO); err != nil {
		return err
	}
	if err := p.CheckGradients(q, k, v, g); err != nil {
		return err
	}
	return b.backwardHost(p, q, k, v, o, lse, dO, g, nil, opt, rec)
}

// backwardHost runs a validated backward on host tensors: it uploads them,
// plans the call on the device copies, allocates the workspace the plan
// needs, binds the plan to it and enqueues it as BackwardDevice does.
//
// With late set, g holds headers alone and late.wait returns dQ, dK, dV
// (and dBias) with storage, allocated meanwhile. rec (nil: untraced) records
// the call's breakdown when it succeeds.
func (b *Backend) backwardHost(p *attn.Problem, q, k, v, o, lse, dO attn.Tensor, g attn.Gradients, late *lateTensors, opt attn.Options, rec *callRecorder) (err error) {
	c := b.beginHost(rec)
	defer b.hostMu.Unlock()
	defer c.end(&err)
	s := b.stream
	ins, dopt, err := c.inputs(s, p, opt, q, k, v, o, lse, dO)
	if err != nil {
		return err
	}
	bopt := BackwardOptions{DeviceOptions: dopt}
	var outs []hostOutput
	var grads [3]DeviceTensor
	for i, t := range []attn.Tensor{g.DQ, g.DK, g.DV} {
		x, err := c.output(t, false)
		if err != nil {
			return err
		}
		outs, grads[i] = append(outs, x), x.dev
	}
	if opt.Bias != nil && opt.Bias.RequiresGrad {
		x, err := c.output(*g.DBias, true)
		if err != nil {
			return err
		}
		outs, bopt.DBias = append(outs, x), &x.dev
	}
	dp := deviceProblemOf(p, dopt)
	a, err := bwdViews(dp, ins[0], ins[1], ins[2], ins[3], ins[4], ins[5], grads[0], grads[1], grads[2], bopt)
	if err != nil {
		return err
	}
	pl, err := planBackward(b.bwdRequest(dp, q.DType, a, bopt.DQ))
	if err != nil {
		return err
	}
	if _, err := b.module(bwdModuleSpec(pl.v)); err != nil {
		return err
	}
	if b.Speculate {
		b.bwdSpeculate(pl.v)
	}
	rec.lap(HostPlan)
	ws, err := c.alloc(pl.w.total)
	if err != nil {
		return err
	}
	pl.bind(ws.Ptr())
	m := rec.begin(s)
	if err := b.enqueueBackward(s, pl); err != nil {
		return err
	}
	rec.end(s, StreamKernels, m, 0)
	rec.lap(HostEnqueue)
	if err := c.b.copier.releaseInputs(rec); err != nil {
		return err
	}
	if late != nil {
		for i, t := range late.wait() {
			outs[i].host = t
		}
		rec.lap(HostOutputs)
	}
	for _, x := range outs {
		if err := c.download(s, x); err != nil {
			return fmt.Errorf("gpu: backward: %w", err)
		}
	}
	return nil
}

// bwdDeviceArgs validates the device tensors of a backward call and
// returns the problem and the views the kernels take.
func bwdDeviceArgs(q, k, v, o, lse, dO, dq, dk, dv DeviceTensor, opt BackwardOptions) (*attn.Problem, bwdArgs, error) {
	countValidation()
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
	if a, err = bwdViews(p, q, k, v, o, lse, dO, dq, dk, dv, opt); err != nil {
		return nil, a, err
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
	}
	return p, a, nil
}

// bwdViews returns the views the backward kernels take of the device
// tensors of a backward of p; it fails only for an LSE whose rows are not
// contiguous.
func bwdViews(p *attn.Problem, q, k, v, o, lse, dO, dq, dk, dv DeviceTensor, opt BackwardOptions) (bwdArgs, error) {
	var a bwdArgs
	view := func(t DeviceTensor) bwdView {
		sb, sn, sh := seqStrides(t, p.Varlen)
		return bwdView{Ptr: t.ptr(), DType: t.DType, Batch: sb, Row: sn, Head: sh}
	}
	a.Q, a.K, a.V, a.O, a.DO = view(q), view(k), view(v), view(o), view(dO)
	a.DQ, a.DK, a.DV = view(dq), view(dk), view(dv)
	lb, lh, ln := lseStrides(lse, p.Varlen)
	if ln != 1 && lse.Shape[len(lse.Shape)-1] > 1 {
		return a, attn.Errorf(attn.ErrUnsupported, "lse: position stride %d (the backward kernels need 1)", ln)
	}
	a.LSE = bwdView{Ptr: lse.ptr(), DType: attn.Float32, Batch: lb, Head: lh}
	if bt := opt.Bias; bt != nil {
		st := bt.strides()
		a.Bias = &bwdBiasView{Ptr: bt.ptr(), DType: bt.DType, Batches: bt.Shape[0], Heads: bt.Shape[1],
			Batch: int64(st[0]), Head: int64(st[1]), Query: int64(st[2]), Key: int64(st[3])}
	}
	if db := opt.DBias; db != nil {
		a.DBias = &bwdBiasView{Ptr: db.ptr(), DType: db.DType, Batches: db.Shape[0], Heads: db.Shape[1]}
	}
	if p.Varlen {
		a.CuSeqlensQ, a.CuSeqlensK = opt.CuSeqlensQ.Ptr(), opt.CuSeqlensK.Ptr()
	}
	if opt.Workspace != nil {
		a.Workspace = opt.Workspace.Ptr()
	}
	return a, nil
}

// BackwardVariant returns the kernel variant a BackwardDevice call with
// these arguments runs (its dQ algorithm resolved), without compiling or
// enqueueing anything. opt.Workspace is not read.
func (b *Backend) BackwardVariant(q, k, v, o, lse, dO, dq, dk, dv DeviceTensor, opt BackwardOptions) (kernels.BwdVariant, error) {
	_, _, pl, err := b.planDeviceBackward(q, k, v, o, lse, dO, dq, dk, dv, opt)
	if err != nil {
		return kernels.BwdVariant{}, err
	}
	return pl.v, nil
}

// planDeviceBackward validates the arguments of a device backward call
// (opt.Workspace not read) and plans it; p is nil when the arguments are
// invalid.
func (b *Backend) planDeviceBackward(q, k, v, o, lse, dO, dq, dk, dv DeviceTensor, opt BackwardOptions) (p *attn.Problem, a bwdArgs, pl *bwdPlan, err error) {
	opt.Workspace = nil
	p, a, err = bwdDeviceArgs(q, k, v, o, lse, dO, dq, dk, dv, opt)
	if err != nil {
		return nil, a, nil, err
	}
	pl, err = planBackward(b.bwdRequest(p, q.DType, a, opt.DQ))
	return p, a, pl, err
}

// PrepareBackward validates a BackwardDevice call, compiles its kernels
// (so that the call itself only enqueues, as a CUDA graph capture needs)
// and returns the dQ algorithm it will use and the workspace bytes it
// needs. opt.Workspace is not read.
func (b *Backend) PrepareBackward(q, k, v, o, lse, dO, dq, dk, dv DeviceTensor, opt BackwardOptions) (DQAlgorithm, int64, error) {
	p, a, pl, err := b.planDeviceBackward(q, k, v, o, lse, dO, dq, dk, dv, opt)
	if p == nil {
		return opt.DQ, 0, err
	}
	if err != nil {
		return resolveDQ(p, opt.DQ, DQKernels{Hopper: bwdHopperRuns(p, q.DType, &a, b.WGMMA, b.BwdDeep)}), 0, err
	}
	if _, err := b.module(bwdModuleSpec(pl.v)); err != nil {
		return pl.algo, 0, err
	}
	return pl.algo, pl.w.total, nil
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
	pl, perr := planBackward(b.bwdRequest(p, q.DType, a, opt.DQ))
	var algo DQAlgorithm
	if perr == nil {
		algo = pl.algo
	} else {
		algo = resolveDQ(p, opt.DQ, DQKernels{Hopper: bwdHopperRuns(p, q.DType, &a, b.WGMMA, b.BwdDeep)})
	}
	need := BackwardWorkspaceBytes(p, q.DType, algo, a.DBias != nil)
	if opt.Workspace == nil || opt.Workspace.Size() < need {
		return algo, attn.Errorf(attn.ErrOption, "backward: workspace of %d bytes needed", need)
	}
	if perr != nil {
		return algo, perr
	}
	return algo, b.enqueueBackward(s, pl)
}

// enqueueBackward enqueues the launches of plan pl on stream s, compiling
// its kernels on first use of the variant (PrepareBackward compiles
// ahead). It only enqueues: no host synchronisation, no host arithmetic on
// the data, so a caller may capture it in a CUDA graph.
func (b *Backend) enqueueBackward(s *cuda.Stream, pl *bwdPlan) error {
	m, err := b.module(bwdModuleSpec(pl.v))
	if err != nil {
		return err
	}
	args, err := b.bwdLaunchArgs(pl)
	if err != nil {
		return err
	}
	for _, l := range pl.launches {
		g := [3]uint32{uint32(l.grid[0]), uint32(l.grid[1]), uint32(l.grid[2])}
		if err := b.dev.Launch(m.function(l.kernel), g, [3]uint32{uint32(l.threads), 1, 1}, uint32(l.smem), s, args(l.kernel)); err != nil {
			return fmt.Errorf("flashattn: backward %s %v: %w", l.kernel, l.grid, err)
		}
	}
	return nil
}

// bwdLaunchArgs returns the argument of each of the plan's kernel launches
// (bwdPlan.kernelArgs), the TMA kernels' tensor maps encoded unless the
// backend's last backward used the same tensors.
func (b *Backend) bwdLaunchArgs(pl *bwdPlan) (func(kernel string) []byte, error) {
	if !pl.v.TMA {
		return pl.kernelArgs(nil), nil
	}
	b.mu.Lock()
	maps, err := b.bwdMaps.get(pl.tma, bwdTMANames, func(t kernels.TMATensor) (cuda.TensorMap, error) {
		return b.dev.EncodeTensorMap(tensorMapSpec(t))
	})
	b.mu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("flashattn: backward %s: %w", pl.v.Name(), err)
	}
	return pl.kernelArgs(maps), nil
}
