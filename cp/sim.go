package cp

import (
	"context"
	"fmt"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/gpu"
)

// Sim is an attn.Backend that runs each call through P in-process ranks
// (Run): it shards the global inputs with Layout, runs Attention with
// Scheme on every rank, and reassembles the global outputs. It computes
// what Backend computes alone, within rounding, and exists to test and
// measure context parallelism on one machine. Backend must be safe for
// concurrent use.
type Sim struct {
	// Backend computes the local blocks of every rank.
	Backend attn.Backend
	// P is the number of ranks.
	P int
	// Layout and Scheme are those of every rank's Attention.
	Layout Layout
	Scheme Scheme
	// Groups is the Hybrid scheme's all-to-all degree (0: automatic).
	Groups int
	// Timeout, when positive, bounds each call.
	Timeout time.Duration
	// OnDevice runs each call as a DeviceRing on the GPU of Backend, which
	// must then be the CUDA backend (*gpu.Backend) and Scheme Ring: the
	// global inputs are uploaded, the ranks' K/V blocks travel between
	// their buffers by device-to-device copies on the ranks' streams, and
	// the outputs come back; it takes what DeviceRing takes (padded
	// batches, no bias or dropout). Otherwise the ranks are goroutines
	// exchanging host memory, whatever the backend.
	OnDevice bool

	// wrap, when set, replaces each rank's backend and transport (used to
	// meter them, see MeasureSplit).
	wrap func(rank int, b attn.Backend, t Transport) (attn.Backend, Transport)
}

var _ attn.Backend = (*Sim)(nil)

// Name returns a name such as "cp-ring-zigzag-4/cpu".
func (s *Sim) Name() string {
	name := "?"
	if s.Backend != nil {
		name = s.Backend.Name()
	}
	return fmt.Sprintf("cp-%v-%v-%d/%s", s.Scheme, s.Layout, s.P, name)
}

// run validates the global inputs, shards each (tensor, sequence axis)
// pair of ins and calls fn on every rank with its shards.
func (s *Sim) run(q, k, v attn.Tensor, opt attn.Options, ins []sharded, fn func(ctx context.Context, a *Attention, shards []attn.Tensor) error) error {
	if s.Backend == nil {
		return attn.Errorf(attn.ErrOption, "cp: Sim needs a Backend")
	}
	if err := unsupported(opt); err != nil {
		return err
	}
	if _, err := attn.NewProblem(q, k, v, opt); err != nil {
		return err
	}
	if err := s.Layout.check(s.P, 0); err != nil {
		return err
	}
	shards := make([][]attn.Tensor, s.P)
	for r := range s.P {
		for _, in := range ins {
			sh, err := shardInput(in.t, in.axis, in.cu, s.Layout, s.P, r)
			if err != nil {
				return fmt.Errorf("cp: %s: %w", in.name, err)
			}
			shards[r] = append(shards[r], sh)
		}
	}
	ctx := context.Background()
	if s.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.Timeout)
		defer cancel()
	}
	return Run(ctx, s.P, func(ctx context.Context, t Transport) error {
		a := &Attention{Backend: s.Backend, Transport: t, Layout: s.Layout, Scheme: s.Scheme, Groups: s.Groups}
		if s.wrap != nil {
			a.Backend, a.Transport = s.wrap(t.Rank(), s.Backend, t)
		}
		return fn(ctx, a, shards[t.Rank()])
	})
}

// sharded is a global input, the axis its sequence runs along in a padded
// batch and, in a packed one, its cu_seqlens.
type sharded struct {
	name string
	t    attn.Tensor
	axis int
	cu   []int32
}

// Forward computes O and the LSE of the global problem with P ranks.
func (s *Sim) Forward(q, k, v attn.Tensor, opt attn.Options) (attn.Result, error) {
	if s.OnDevice {
		out, err := s.onDevice(q, k, v, opt, nil, func(p *attn.Problem) []outSpec {
			return []outSpec{{q.DType, []int{p.B, p.N, p.H, p.DV}}, {attn.Float32, []int{p.B, p.H, p.N}}}
		}, func(d *DeviceRing, in, out []gpu.DeviceTensor) error {
			return d.Forward(in[0], in[1], in[2], out[0], out[1])
		})
		if err != nil {
			return attn.Result{}, err
		}
		return attn.Result{O: out[0], LSE: out[1]}, nil
	}
	os, lses := make([]attn.Tensor, s.P), make([]attn.Tensor, s.P)
	cq, ck := opt.CuSeqlensQ, opt.CuSeqlensK
	err := s.run(q, k, v, opt, []sharded{{"q", q, 1, cq}, {"k", k, 1, ck}, {"v", v, 1, ck}},
		func(ctx context.Context, a *Attention, in []attn.Tensor) error {
			res, err := a.Forward(ctx, in[0], in[1], in[2], opt)
			os[a.Transport.Rank()], lses[a.Transport.Rank()] = res.O, res.LSE
			return err
		})
	if err != nil {
		return attn.Result{}, err
	}
	out, err := s.unshard([][]attn.Tensor{os, lses}, []int{1, 2}, [][]int32{cq, cq})
	if err != nil {
		return attn.Result{}, err
	}
	return attn.Result{O: out[0], LSE: out[1]}, nil
}

// unshard reassembles each list of shards along its axis (that of a padded
// batch, see shardInput), packed with its cu_seqlens when not nil.
func (s *Sim) unshard(parts [][]attn.Tensor, axes []int, cus [][]int32) ([]attn.Tensor, error) {
	out := make([]attn.Tensor, len(parts))
	for i, shards := range parts {
		var err error
		if out[i], err = unshardOutput(shards, axes[i], cus[i], s.Layout); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// Backward computes the gradients of the global problem with P ranks.
func (s *Sim) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	if s.OnDevice {
		out, err := s.onDevice(q, k, v, opt, []attn.Tensor{o, lse, dO}, func(*attn.Problem) []outSpec {
			return []outSpec{{q.DType, q.Shape}, {q.DType, k.Shape}, {q.DType, v.Shape}}
		}, func(d *DeviceRing, in, out []gpu.DeviceTensor) error {
			return d.Backward(in[0], in[1], in[2], in[3], in[4], in[5], out[0], out[1], out[2])
		})
		if err != nil {
			return attn.Gradients{}, err
		}
		return attn.Gradients{DQ: out[0], DK: out[1], DV: out[2]}, nil
	}
	dqs, dks, dvs := make([]attn.Tensor, s.P), make([]attn.Tensor, s.P), make([]attn.Tensor, s.P)
	cq, ck := opt.CuSeqlensQ, opt.CuSeqlensK
	err := s.run(q, k, v, opt, []sharded{{"q", q, 1, cq}, {"k", k, 1, ck}, {"v", v, 1, ck}, {"o", o, 1, cq}, {"lse", lse, 2, cq}, {"dO", dO, 1, cq}},
		func(ctx context.Context, a *Attention, in []attn.Tensor) error {
			g, err := a.Backward(ctx, in[0], in[1], in[2], in[3], in[4], in[5], opt)
			r := a.Transport.Rank()
			dqs[r], dks[r], dvs[r] = g.DQ, g.DK, g.DV
			return err
		})
	if err != nil {
		return attn.Gradients{}, err
	}
	out, err := s.unshard([][]attn.Tensor{dqs, dks, dvs}, []int{1, 1, 1}, [][]int32{cq, ck, ck})
	if err != nil {
		return attn.Gradients{}, err
	}
	return attn.Gradients{DQ: out[0], DK: out[1], DV: out[2]}, nil
}

// outSpec is the dtype and shape of an output of a call on the device.
type outSpec struct {
	dt    attn.DType
	shape []int
}

// onDevice runs a call as a DeviceRing (OnDevice): q, k, v and then more
// are uploaded contiguous, outputs of the specs outs gives for the global
// problem allocated, call enqueues the work on the ring, and the outputs
// are downloaded.
func (s *Sim) onDevice(q, k, v attn.Tensor, opt attn.Options, more []attn.Tensor, outs func(*attn.Problem) []outSpec,
	call func(d *DeviceRing, in, out []gpu.DeviceTensor) error) ([]attn.Tensor, error) {
	b, ok := s.Backend.(*gpu.Backend)
	if !ok {
		name := "none"
		if s.Backend != nil {
			name = s.Backend.Name()
		}
		return nil, attn.Errorf(attn.ErrUnsupported, "cp: Sim.OnDevice runs on the CUDA backend, not %s", name)
	}
	if s.Scheme != Ring {
		return nil, attn.Errorf(attn.ErrUnsupported, "cp: Sim.OnDevice runs the ring scheme, not %v", s.Scheme)
	}
	if packed(opt) {
		return nil, attn.Errorf(attn.ErrUnsupported, "cp: Sim.OnDevice: a packed batch")
	}
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return nil, err
	}
	var held []gpu.DeviceTensor
	defer func() {
		for _, t := range held {
			t.Free()
		}
	}()
	in := make([]gpu.DeviceTensor, 0, 3+len(more))
	for _, t := range append([]attn.Tensor{q, k, v}, more...) {
		c, err := contiguous(t)
		if err != nil {
			return nil, err
		}
		d, err := b.Upload(c)
		if err != nil {
			return nil, fmt.Errorf("cp: %w", err)
		}
		held, in = append(held, d), append(in, d)
	}
	var out []gpu.DeviceTensor
	for _, o := range outs(p) {
		d, err := gpu.NewDeviceTensor(b.Device(), o.dt, o.shape...)
		if err != nil {
			return nil, fmt.Errorf("cp: %w", err)
		}
		held, out = append(held, d), append(out, d)
	}
	d, err := NewDeviceRing(b, Strategy{Layout: s.Layout, Scheme: s.Scheme}, s.P, in[0], in[1], in[2], opt)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	if err := call(d, in, out); err != nil {
		return nil, err
	}
	res := make([]attn.Tensor, len(out))
	for i, t := range out {
		if res[i], err = b.Download(d.Stream(), t); err != nil {
			return nil, fmt.Errorf("cp: %w", err)
		}
	}
	return res, nil
}
