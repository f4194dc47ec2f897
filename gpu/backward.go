package gpu

import (
	"encoding/binary"
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
		if v.Biased() && v.Bias.DType() == dt {
			v.Bias = kernels.BiasFor(other)
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
