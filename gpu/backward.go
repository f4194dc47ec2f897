package gpu

import (
	"encoding/binary"
	"fmt"
	"math"
	"runtime"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// tensorFromBytes returns a contiguous tensor of dt and shape holding b.
func tensorFromBytes(dt attn.DType, b []byte, shape []int) attn.Tensor {
	t := attn.New(dt, shape...)
	if dt == attn.Float32 {
		for i := range t.F32 {
			t.F32[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
		}
	} else {
		for i := range t.Bits {
			t.Bits[i] = binary.LittleEndian.Uint16(b[2*i:])
		}
	}
	return t
}

// bwdBuffers tracks the device buffers of one host-level backward call.
type bwdBuffers struct {
	dev  *cuda.Device
	bufs []*cuda.Buffer
}

func (bb *bwdBuffers) alloc(bytes int64) (*cuda.Buffer, error) {
	b, err := bb.dev.Alloc(max(align256(bytes), 256))
	if err != nil {
		return nil, err
	}
	bb.bufs = append(bb.bufs, b)
	return b, nil
}

func (bb *bwdBuffers) upload(data []byte) (*cuda.Buffer, error) {
	b, err := bb.alloc(int64(len(data)))
	if err != nil {
		return nil, err
	}
	if len(data) > 0 {
		if err := bb.dev.CopyToDevice(b, 0, data); err != nil {
			return nil, err
		}
	}
	return b, nil
}

func (bb *bwdBuffers) free() {
	for _, b := range bb.bufs {
		_ = b.Free()
	}
	bb.bufs = nil
}

// seqView returns the view of a contiguous [B, seq, heads, dim] (packed:
// [total, heads, dim]) tensor at ptr.
func seqView(ptr uint64, dt attn.DType, shape []int) bwdView {
	if len(shape) == 3 {
		return bwdView{Ptr: ptr, DType: dt, Row: int64(shape[1] * shape[2]), Head: int64(shape[2])}
	}
	return bwdView{Ptr: ptr, DType: dt, Batch: int64(shape[1] * shape[2] * shape[3]), Row: int64(shape[2] * shape[3]), Head: int64(shape[3])}
}

// lseView returns the view of a contiguous LSE ([B, H, N] or [H, totalQ]).
func lseView(ptr uint64, shape []int) bwdView {
	if len(shape) == 2 {
		return bwdView{Ptr: ptr, DType: attn.Float32, Head: int64(shape[1])}
	}
	return bwdView{Ptr: ptr, DType: attn.Float32, Batch: int64(shape[1] * shape[2]), Head: int64(shape[2])}
}

// biasView returns the view of a contiguous [bB, bH, N, M] bias at ptr.
func biasView(ptr uint64, dt attn.DType, shape []int) *bwdBiasView {
	return &bwdBiasView{Ptr: ptr, DType: dt, Batches: shape[0], Heads: shape[1],
		Batch: int64(shape[1] * shape[2] * shape[3]), Head: int64(shape[2] * shape[3]), Query: int64(shape[3]), Key: 1}
}

// backwardHost runs a whole backward call on dev and stream s: validation,
// upload, the kernels, download. It returns the gradients and the dQ
// algorithm used.
func backwardHost(dev *cuda.Device, s *cuda.Stream, q, k, v, o, lse, dO attn.Tensor, opt attn.Options, algo DQAlgorithm) (attn.Gradients, DQAlgorithm, error) {
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return attn.Gradients{}, algo, err
	}
	if err := p.CheckBackward(q, o, lse, dO); err != nil {
		return attn.Gradients{}, algo, err
	}
	dt := q.DType
	bb := &bwdBuffers{dev: dev}
	defer bb.free()
	var a bwdArgs
	views := []struct {
		t   attn.Tensor
		dst *bwdView
	}{{q, &a.Q}, {k, &a.K}, {v, &a.V}, {o, &a.O}, {dO, &a.DO}}
	for _, x := range views {
		buf, err := bb.upload(x.t.Bytes())
		if err != nil {
			return attn.Gradients{}, algo, fmt.Errorf("flashattn: backward upload: %w", err)
		}
		*x.dst = seqView(buf.Ptr(), dt, x.t.Shape)
	}
	lb, err := bb.upload(lse.Bytes())
	if err != nil {
		return attn.Gradients{}, algo, fmt.Errorf("flashattn: backward upload: %w", err)
	}
	a.LSE = lseView(lb.Ptr(), lse.Shape)
	outs := []struct {
		shape []int
		dst   *bwdView
	}{{q.Shape, &a.DQ}, {k.Shape, &a.DK}, {v.Shape, &a.DV}}
	outBufs := make([]*cuda.Buffer, 3)
	for i := range outs {
		buf, err := bb.alloc(int64(attn.NumElements(outs[i].shape) * dt.Size()))
		if err != nil {
			return attn.Gradients{}, algo, fmt.Errorf("flashattn: backward outputs: %w", err)
		}
		outBufs[i] = buf
		*outs[i].dst = seqView(buf.Ptr(), dt, outs[i].shape)
	}
	var dbBuf *cuda.Buffer
	if opt.Bias != nil {
		bt := opt.Bias.Tensor
		buf, err := bb.upload(bt.Bytes())
		if err != nil {
			return attn.Gradients{}, algo, fmt.Errorf("flashattn: backward upload bias: %w", err)
		}
		a.Bias = biasView(buf.Ptr(), bt.DType, bt.Shape)
		if opt.Bias.RequiresGrad {
			if dbBuf, err = bb.alloc(int64(bt.NumElements() * bt.DType.Size())); err != nil {
				return attn.Gradients{}, algo, fmt.Errorf("flashattn: backward dBias: %w", err)
			}
			a.DBias = biasView(dbBuf.Ptr(), bt.DType, bt.Shape)
		}
	}
	if p.Varlen {
		for _, x := range []struct {
			cu  []int32
			dst *uint64
		}{{opt.CuSeqlensQ, &a.CuSeqlensQ}, {opt.CuSeqlensK, &a.CuSeqlensK}} {
			b := make([]byte, 4*len(x.cu))
			for i, c := range x.cu {
				binary.LittleEndian.PutUint32(b[4*i:], uint32(c))
			}
			buf, err := bb.upload(b)
			if err != nil {
				return attn.Gradients{}, algo, fmt.Errorf("flashattn: backward upload cu_seqlens: %w", err)
			}
			*x.dst = buf.Ptr()
		}
	}
	algo = resolveDQ(p, algo, bwdHopperRuns(p, dt, &a, hopperCapable(dev)))
	bwdSpeculate(dev, p, dt, &a, algo)
	ws, err := bb.alloc(BackwardWorkspaceBytes(p, dt, algo, a.DBias != nil))
	if err != nil {
		return attn.Gradients{}, algo, fmt.Errorf("flashattn: backward workspace: %w", err)
	}
	a.Workspace = ws.Ptr()
	if algo, err = enqueueBackward(dev, s, p, dt, a, algo); err != nil {
		return attn.Gradients{}, algo, err
	}
	if err := s.Synchronize(); err != nil {
		return attn.Gradients{}, algo, fmt.Errorf("flashattn: backward: %w", err)
	}
	var g attn.Gradients
	for i, x := range []struct {
		shape []int
		dst   *attn.Tensor
	}{{q.Shape, &g.DQ}, {k.Shape, &g.DK}, {v.Shape, &g.DV}} {
		host := make([]byte, attn.NumElements(x.shape)*dt.Size())
		if len(host) > 0 {
			if err := dev.CopyFromDevice(host, outBufs[i], 0); err != nil {
				return attn.Gradients{}, algo, fmt.Errorf("flashattn: backward download: %w", err)
			}
		}
		*x.dst = tensorFromBytes(dt, host, x.shape)
	}
	if dbBuf != nil {
		bt := opt.Bias.Tensor
		host := make([]byte, bt.NumElements()*bt.DType.Size())
		if len(host) > 0 {
			if err := dev.CopyFromDevice(host, dbBuf, 0); err != nil {
				return attn.Gradients{}, algo, fmt.Errorf("flashattn: backward download dBias: %w", err)
			}
		}
		db := tensorFromBytes(bt.DType, host, bt.Shape)
		g.DBias = &db
	}
	return g, algo, nil
}

// bwdSpecSlots bounds the background compilations bwdSpeculate starts.
var bwdSpecSlots = make(chan struct{}, max(1, runtime.NumCPU()-1))

// bwdSpeculate starts, on idle cores, the compilation of the variants a
// caller is likely to ask for next: the same problem in the other dtypes.
// Each compiles once (bwdModuleFor); a later call waits for it.
func bwdSpeculate(dev *cuda.Device, p *attn.Problem, dt attn.DType, a *bwdArgs, algo DQAlgorithm) {
	pl, err := planBackward(p, dt, a, algo, dev.SMCount(), hopperCapable(dev))
	if err != nil {
		return
	}
	for _, other := range []attn.DType{attn.Float32, attn.Float16, attn.BFloat16} {
		if other == dt {
			continue
		}
		v := pl.v
		v.DType = other
		if v.Bias && v.BiasDType == dt {
			v.BiasDType = other
		}
		g := 16 / other.Size()
		v.Vector = v.Vector && v.DK%g == 0 && v.DV%g == 0
		v.Flat = v.Flat && other.Size() == 2 // (rows read in place: 16-bit only)
		v.Staged = !v.Vector && !v.Flat && kernels.BwdNeedsStaging(other, v.DK, v.DV)
		v.WGMMA = v.WGMMA && kernels.BwdHopperOK(v)
		v.TMA = v.TMA && v.WGMMA // (the same strides in bytes: still whole 16-byte units)
		if v.Validate() != nil {
			continue
		}
		select {
		case bwdSpecSlots <- struct{}{}:
			go func() {
				defer func() { <-bwdSpecSlots }()
				_, _ = bwdModuleFor(dev, v)
			}()
		default:
		}
	}
}
