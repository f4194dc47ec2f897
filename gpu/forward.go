package gpu

import (
	"fmt"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// The forward pass. Every entry validates its call once (attn.NewProblem
// for host tensors, forwardCall for device tensors), plans it once
// (planForward) and enqueues the plan (enqueueForward); the host forms
// upload their inputs between the validation and the plan.

// Forward computes O and LSE of host tensors on the GPU and returns them
// contiguous: O [B, N, H, DV] in q's dtype (packed: [totalQ, H, DV]) and
// float32 LSE [B, H, N] (packed: [H, totalQ]). Inputs keep their strides
// on the device where their feature dim has stride 1 and are gathered
// otherwise. ForwardInto writes into tensors the caller provides.
func (b *Backend) Forward(q, k, v attn.Tensor, opt attn.Options) (attn.Result, error) {
	rec := b.traceCall("forward")
	countValidation()
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return attn.Result{}, err
	}
	res := attn.Result{O: header(q.DType, p.OutputShape()), LSE: header(attn.Float32, p.LSEShape())}
	late := allocLate(res.O, res.LSE)
	if err := b.forwardHost(p, q, k, v, res, late, opt, rec); err != nil {
		return attn.Result{}, err
	}
	ts := late.wait()
	return attn.Result{O: ts[0], LSE: ts[1]}, nil
}

// ForwardInto computes O and LSE of host tensors on the GPU into res.O
// ([B, N, H, DV] in q's dtype; packed: [totalQ, H, DV]) and res.LSE
// (float32 [B, H, N]; packed: [H, totalQ]), tensors the caller allocated
// with any layout, so that repeated calls allocate nothing on the host and,
// after the first call of a shape, nothing on the device.
func (b *Backend) ForwardInto(q, k, v attn.Tensor, res attn.Result, opt attn.Options) error {
	rec := b.traceCall("forward into")
	countValidation()
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return err
	}
	if err := p.CheckResult(q.DType, res); err != nil {
		return err
	}
	return b.forwardHost(p, q, k, v, res, nil, opt, rec)
}

// forwardHost runs a validated forward on host tensors: it uploads them,
// plans the call on the device copies (with staging copies where they
// help) and enqueues it as ForwardDevice does.
//
// With late set, res holds headers alone (shape and contiguous strides) and
// late.wait returns the tensors with storage, allocated meanwhile. rec (nil:
// untraced) records the call's breakdown when it succeeds.
func (b *Backend) forwardHost(p *attn.Problem, q, k, v attn.Tensor, res attn.Result, late *lateTensors, opt attn.Options, rec *callRecorder) (err error) {
	if res.O.NumElements() == 0 && res.LSE.NumElements() == 0 {
		rec.finish()
		return nil
	}
	c := b.beginHost(rec)
	defer b.hostMu.Unlock()
	defer c.end(&err)
	s := b.stream
	ins, dopt, err := c.inputs(s, p, opt, q, k, v)
	if err != nil {
		return err
	}
	o, err := c.output(res.O, false)
	if err != nil {
		return err
	}
	lse, err := c.output(res.LSE, false)
	if err != nil {
		return err
	}
	call := &fwdCall{p: deviceProblemOf(p, dopt), dt: q.DType, q: ins[0], k: ins[1], v: ins[2], o: o.dev, lse: lse.dev, opt: dopt}
	pl, err := b.planForward(call, nil, true)
	if err != nil {
		return err
	}
	rec.lap(HostPlan)
	if pl.st != nil {
		ws, err := c.alloc(pl.st.bytes)
		if err != nil {
			return err
		}
		pl.relocate(ws)
	}
	if !pl.empty() {
		m := rec.begin(s)
		if err := b.enqueueForward(s, &pl); err != nil {
			return err
		}
		rec.end(s, StreamKernels, m, 0)
		rec.lap(HostEnqueue)
	}
	if err := c.b.copier.releaseInputs(rec); err != nil {
		return err
	}
	if late != nil {
		ts := late.wait()
		o.host, lse.host = ts[0], ts[1]
		rec.lap(HostOutputs)
	}
	for _, x := range []hostOutput{o, lse} {
		if err := c.download(s, x); err != nil {
			return fmt.Errorf("gpu: forward: %w", err)
		}
	}
	return nil
}

// forwardCall validates the device arguments of a forward call.
func forwardCall(q, k, v, o, lse DeviceTensor, opt DeviceOptions) (*fwdCall, error) {
	countValidation()
	p, err := deviceProblem(q, k, v, opt)
	if err != nil {
		return nil, err
	}
	if err := checkOutputs(p, q.DType, o, lse); err != nil {
		return nil, err
	}
	return &fwdCall{p: p, dt: q.DType, q: q, k: k, v: v, o: o, lse: lse, opt: opt}, nil
}

// ForwardDevice enqueues the forward pass on stream s (nil: the legacy
// default stream): q [B, N, H, DK], k [B, M, Hkv, DK], v [B, M, Hkv, DV]
// (packed: drop B, give cu_seqlens), o [B, N, H, DV] in q's dtype and lse
// [B, H, N] (packed: [H, totalQ]) float32, all on the device with any
// strides (feature dims of q, k, v, o with stride 1). It neither
// synchronizes nor allocates device memory, so it can be captured in a CUDA
// graph once its kernel is compiled (the first call with a new variant
// compiles it; PrepareForward compiles ahead). With opt.Staging, q, k and v
// whose rows allow only 2-byte loads are first copied into it with padded
// rows (see PrepareForward). Errors from the kernel's execution appear at
// the stream's next synchronization.
func (b *Backend) ForwardDevice(s *cuda.Stream, q, k, v, o, lse DeviceTensor, opt DeviceOptions) error {
	c, err := forwardCall(q, k, v, o, lse, opt)
	if err != nil {
		return err
	}
	pl, err := b.planForward(c, opt.Staging, opt.Staging != nil)
	if err != nil || pl.empty() {
		return err
	}
	return b.enqueueForward(s, &pl)
}

// PrepareForward validates a ForwardDevice call and returns the bytes of
// DeviceOptions.Staging it can use: 0 when q, k and v load with 16-byte
// copies as they are (or are fp32), otherwise the size of their staging
// copies (planStaging), in which case it also compiles the pack kernel
// and the forward kernel that reads the copies (so that a call with
// Staging set only enqueues, as a CUDA graph capture needs). opt.Staging
// is not read.
func (b *Backend) PrepareForward(q, k, v, o, lse DeviceTensor, opt DeviceOptions) (int64, error) {
	c, err := forwardCall(q, k, v, o, lse, opt)
	if err != nil {
		return 0, err
	}
	pl, err := b.planForward(c, nil, true)
	if err != nil || pl.st == nil {
		return 0, err
	}
	if _, err := b.module(packModuleSpec); err != nil {
		return 0, err
	}
	if _, err := b.lookup(pl.v); err != nil {
		return 0, err
	}
	return pl.st.bytes, nil
}

// Variant returns the kernel variant ForwardDevice would launch for these
// arguments (for Prefetch, benchmarks and reports).
func (b *Backend) Variant(q, k, v, o, lse DeviceTensor, opt DeviceOptions) (kernels.Variant, error) {
	c, err := forwardCall(q, k, v, o, lse, opt)
	if err != nil {
		return kernels.Variant{}, err
	}
	pl, err := b.planForward(c, opt.Staging, opt.Staging != nil)
	return pl.v, err
}

// enqueueForward enqueues the plan of a forward call on s: the staging
// copy (if any), then the forward kernel, compiling either on first use.
func (b *Backend) enqueueForward(s *cuda.Stream, pl *fwdPlan) error {
	kn, err := b.lookup(pl.v)
	if err != nil {
		return err
	}
	if pl.params.NFFlag, err = b.nf.slot(b.dev, s); err != nil {
		return err
	}
	packed := false
	if pl.st != nil {
		if packed, err = b.enqueueStaging(s, pl.st); err != nil {
			return err
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	args := b.pbuf[:kernels.ParamsSize]
	if pl.v.TMA {
		maps, err := b.tmaps.get(pl.tma[:], fwdTMANames(pl.v), func(t kernels.TMATensor) (cuda.TensorMap, error) {
			return b.dev.EncodeTensorMap(tensorMapSpec(t))
		})
		if err != nil {
			return fmt.Errorf("gpu: %s: %w", pl.v.Name(), err)
		}
		args = b.pbuf[:pl.v.TMAParamsSize()]
		pl.v.PackTMA(args, &pl.params, maps...)
	} else {
		pl.params.PackInto(args)
	}
	launch := b.dev.Launch
	if packed && pl.v.FlatStaged {
		// the heads read in place need nothing of the pack kernel just enqueued: the forward starts
		// alongside it, and only the blocks of staged heads wait for it (griddep_wait)
		launch = b.dev.LaunchEarly
	}
	if err := launch(kn.function(kernels.KernelName), pl.grid, [3]uint32{uint32(pl.v.Threads()), 1, 1}, uint32(pl.v.SharedBytes()), s, args); err != nil {
		return fmt.Errorf("gpu: launch %s: %w", pl.v.Name(), err)
	}
	return b.launchNonFinite(kn, pl, s, args)
}
