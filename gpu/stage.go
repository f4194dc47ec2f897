package gpu

import (
	"fmt"

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
// 16-byte-copy kernel on the copies. Where the Hopper forward reads most
// heads in place over flat rows (kernels.Variant.FlatStaged: D = 59, two
// heads in eight past the padded width), only the other heads are copied
// (kernels.PackParams.HeadMask), and the forward starts alongside the copy
// (cuda.Device.LaunchEarly), its staged heads' blocks waiting for it.

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

// stagingAt lays out the staging copies of q, k and v of problem p in ws
// (nil: at device address base — stagingPlanBase for sizes and the kernel
// choice only): every head, or with heads only those each mask selects
// (kernels.FlatStagedHeads; a zero mask: no copy of that tensor), for a
// kernels.Variant.FlatStaged launch that reads the rest in place.
func stagingAt(p *attn.Problem, q, k, v DeviceTensor, ws *cuda.Buffer, base uint64, heads *[3]uint8) fwdStaging {
	var st fwdStaging
	for i, t := range []DeviceTensor{q, k, v} {
		d := t.Shape[len(t.Shape)-1]
		ds := kernels.StagedDim(d)
		batch, rows, nh := 1, t.Shape[0], t.Shape[1]
		if !p.Varlen {
			batch, rows, nh = t.Shape[0], t.Shape[1], t.Shape[2]
		}
		var mask uint8
		kept := nh // heads the copy holds
		if heads != nil {
			mask = heads[i]
			kept = kernels.FlatStagedCount(nh, mask)
		}
		shape := append([]int(nil), t.Shape...)
		shape[len(shape)-2] = kept
		strides := []int{rows * kept * ds, kept * ds, ds, 1}
		if p.Varlen {
			strides = strides[1:]
		}
		off := st.bytes
		st.bytes += align256(int64(batch) * int64(rows) * int64(kept) * int64(ds) * int64(t.DType.Size()))
		st.views[i] = DeviceTensor{Buf: ws, Offset: off / int64(t.DType.Size()), DType: t.DType, Shape: shape, Strides: strides}
		if ws == nil {
			st.views[i].base = base + uint64(off)
		}
		if kept == 0 {
			continue // nothing of this tensor to copy: Rows 0
		}
		sb, sr, sh := seqStrides(t, p.Varlen)
		st.params[i] = kernels.PackParams{Src: t.ptr(), Lim: t.ptr(), BatchStride: sb, RowStride: sr, HeadStride: sh,
			Rows: int32(rows), Heads: int32(nh), D: int32(d), DS: int32(ds), HeadMask: mask}
		if batch > 0 && rows > 0 && nh > 0 && d > 0 {
			last := int64(batch-1)*sb + int64(rows-1)*sr + int64(nh-1)*sh + int64(d-1)
			st.params[i].Lim = t.ptr() + uint64(last+1)*uint64(t.DType.Size())
		}
		st.params[i].Dst = st.views[i].ptr()
		st.grids[i] = kernels.PackGrid(rows, kept, batch)
	}
	return st
}

// enqueueStaging enqueues the pack launch of st on s (one for q, k and v)
// and reports whether there was one (there is none when no tensor has rows
// to copy).
func (b *Backend) enqueueStaging(s *cuda.Stream, st *fwdStaging) (bool, error) {
	m, err := b.module(packModuleSpec)
	if err != nil {
		return false, err
	}
	g, args := kernels.PackLaunch(st.params[:], st.grids[:])
	if g[0] == 0 || g[1] == 0 {
		return false, nil
	}
	if err := b.dev.Launch(m.function(kernels.PackKernel), g, [3]uint32{kernels.PackThreads, 1, 1}, kernels.PackSharedBytes, s, args); err != nil {
		return false, fmt.Errorf("gpu: launch %s: %w", kernels.PackKernel, err)
	}
	return true, nil
}
