package gpu

import (
	"fmt"
	"sync"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// The forward's staging copies. A 16-bit tensor whose rows start only
// 2-byte aligned (an odd head dim, say) would make the forward kernel load
// it element by element, at less than half the speed of 16-byte copies;
// rows 4- or 8-byte aligned (head dims ≡ 2, 4, 6 mod 8) take narrower
// asynchronous copies. Given DeviceOptions.Staging, ForwardDevice first
// copies such q, k and v (one pack launch for the three) into workspace rows
// padded to a multiple of 16 elements (kernels.StagedDim) and runs the
// 16-byte-copy kernel on the copies.

// fwdStaging is the staging plan of one forward call: for q, k and v, the
// view of its copy in the workspace and its slot of the pack launch
// (parameters and the grid it alone would need).
type fwdStaging struct {
	views  [3]DeviceTensor
	params [3]kernels.PackParams
	grids  [3][3]uint32
	bytes  int64 // workspace the copies take
}

// stagingPlanBase stands in for the workspace address when a staging plan
// is made only to size it or choose its kernel (ws nil): any 256-byte
// aligned address plans the same kernel.
const stagingPlanBase = 1 << 40

// stagingFor lays out the staging copies of q, k and v of problem p in ws
// (nil: at stagingPlanBase, for sizes and the kernel choice only).
func stagingFor(p *attn.Problem, q, k, v DeviceTensor, ws *cuda.Buffer) fwdStaging {
	var st fwdStaging
	for i, t := range []DeviceTensor{q, k, v} {
		d := t.Shape[len(t.Shape)-1]
		ds := kernels.StagedDim(d)
		batch, rows, heads := 1, t.Shape[0], t.Shape[1]
		if !p.Varlen {
			batch, rows, heads = t.Shape[0], t.Shape[1], t.Shape[2]
		}
		strides := []int{rows * heads * ds, heads * ds, ds, 1}
		if p.Varlen {
			strides = strides[1:]
		}
		off := st.bytes
		st.bytes += align256(int64(batch) * int64(rows) * int64(heads) * int64(ds) * int64(t.DType.Size()))
		st.views[i] = DeviceTensor{Buf: ws, Offset: off / int64(t.DType.Size()), DType: t.DType,
			Shape: append([]int(nil), t.Shape...), Strides: strides}
		if ws == nil {
			st.views[i].base = stagingPlanBase + uint64(off)
		}
		sb, sr, sh := seqStrides(t, p.Varlen)
		st.params[i] = kernels.PackParams{Src: t.ptr(), Lim: t.ptr(), BatchStride: sb, RowStride: sr, HeadStride: sh,
			Rows: int32(rows), Heads: int32(heads), D: int32(d), DS: int32(ds)}
		if batch > 0 && rows > 0 && heads > 0 && d > 0 {
			last := int64(batch-1)*sb + int64(rows-1)*sr + int64(heads-1)*sh + int64(d-1)
			st.params[i].Lim = t.ptr() + uint64(last+1)*uint64(t.DType.Size())
		}
		if ws != nil {
			st.params[i].Dst = st.views[i].ptr()
		}
		st.grids[i] = kernels.PackGrid(rows, heads, batch)
	}
	return st
}

// packer is the compiled pack kernel of a backend.
type packer struct {
	once sync.Once
	fn   *cuda.Function
	err  error
}

// packFunction returns the pack kernel, compiling it on first use.
func (b *Backend) packFunction() (*cuda.Function, error) {
	b.pack.once.Do(func() {
		mod, err := b.dev.Compile(cuda.CompileRequest{Name: kernels.PackKernel + ".cu", Source: kernels.PackSource})
		if err != nil {
			b.pack.err = fmt.Errorf("gpu: compile pack kernel: %w", err)
			return
		}
		b.pack.fn, b.pack.err = mod.Function(kernels.PackKernel)
	})
	return b.pack.fn, b.pack.err
}

// planForward plans a ForwardDevice call: the launch on the caller's
// tensors or, when they are 16-bit with rows that allow no 16-byte copies
// and opt.Staging is set, the launch on the staging copies together with
// the staging plan.
func (b *Backend) planForward(q, k, v, o, lse DeviceTensor, opt DeviceOptions) (launch, *attn.Problem, *fwdStaging, error) {
	l, p, err := b.planDevice(q, k, v, o, lse, opt)
	if err != nil || opt.Staging == nil || l.v.LoadBytes >= 16 || q.DType.Size() != 2 || p.N == 0 || p.B == 0 {
		return l, p, nil, err
	}
	st := stagingFor(p, q, k, v, opt.Staging)
	if st.bytes > opt.Staging.Size() {
		return l, p, nil, attn.Errorf(attn.ErrOption, "forward: staging workspace of %d bytes, %d needed", opt.Staging.Size(), st.bytes)
	}
	ls, err := b.planStaged(p, q.DType, &st, o, lse, opt)
	return ls, p, &st, err
}

// planStaged plans the forward launch on the staging copies of st.
func (b *Backend) planStaged(p *attn.Problem, dt attn.DType, st *fwdStaging, o, lse DeviceTensor, opt DeviceOptions) (launch, error) {
	var cuq, cuk uint64
	if p.Varlen {
		cuq, cuk = opt.CuSeqlensQ.Ptr(), opt.CuSeqlensK.Ptr()
	}
	l, err := plan(p, dt, st.views[0], st.views[1], st.views[2], o, lse, opt.Bias, cuq, cuk, b.Tiles, true, b.WGMMA, b.TMA)
	if err != nil {
		return l, fmt.Errorf("gpu: forward on staging copies: %w", err)
	}
	return l, nil
}

// PrepareForward validates a ForwardDevice call and returns the bytes of
// DeviceOptions.Staging it can use: 0 when q, k and v load with 16-byte
// copies as they are (or are fp32), otherwise the size of their staging copies, in which case it
// also compiles the pack kernel and the forward kernel that reads the
// copies (so that a call with Staging set only enqueues, as a CUDA graph
// capture needs). opt.Staging is not read.
func (b *Backend) PrepareForward(q, k, v, o, lse DeviceTensor, opt DeviceOptions) (int64, error) {
	opt.Staging = nil
	l, p, err := b.planDevice(q, k, v, o, lse, opt)
	if err != nil || l.v.LoadBytes >= 16 || q.DType.Size() != 2 || p.N == 0 || p.B == 0 {
		return 0, err
	}
	st := stagingFor(p, q, k, v, nil)
	ls, err := b.planStaged(p, q.DType, &st, o, lse, opt)
	if err != nil {
		return 0, err
	}
	if _, err := b.packFunction(); err != nil {
		return 0, err
	}
	if _, err := b.lookup(ls.v); err != nil {
		return 0, err
	}
	return st.bytes, nil
}

// enqueueStaging enqueues the pack launch of st on s (one for q, k and v).
func (b *Backend) enqueueStaging(s *cuda.Stream, st *fwdStaging) error {
	fn, err := b.packFunction()
	if err != nil {
		return err
	}
	g, args := kernels.PackLaunch(st.params[:], st.grids[:])
	if g[0] == 0 || g[1] == 0 {
		return nil
	}
	if err := b.dev.Launch(fn, g, [3]uint32{kernels.PackThreads, 1, 1}, kernels.PackSharedBytes, s, args); err != nil {
		return fmt.Errorf("gpu: launch %s: %w", kernels.PackKernel, err)
	}
	return nil
}
