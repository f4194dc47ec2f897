package gpu

import (
	"fmt"
	"math"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// launch is one planned forward kernel launch.
type launch struct {
	v      kernels.Variant
	params kernels.Params
	grid   [3]uint32
	tma    []kernels.TMATensor // q, k, v for the tensor maps (v.TMA), then with v.FlatStaged their copies'
}

// seqStrides returns the (batch, position, head) strides of a q/k/v/o
// tensor; a packed tensor has no batch dim (stride 0). Size-1 dims get
// stride 0: they are never stepped over.
func seqStrides(t DeviceTensor, varlen bool) (sb, sn, sh int64) {
	st := t.strides()
	z := func(d int) int64 {
		if t.Shape[d] <= 1 {
			return 0
		}
		return int64(st[d])
	}
	if varlen {
		return 0, z(0), z(1)
	}
	return z(0), z(1), z(2)
}

// lseStrides returns the (batch, head, position) strides of the LSE.
func lseStrides(t DeviceTensor, varlen bool) (sb, sh, sn int64) {
	st := t.strides()
	if varlen {
		return 0, int64(st[0]), int64(st[1])
	}
	return int64(st[0]), int64(st[1]), int64(st[2])
}

// loadWidth returns the widest global load (bytes) that every row start of
// q, k and v allows: 16, 8 or 4 (cp.async), or 2 (16-bit types whose rows
// are only 2-byte aligned).
func loadWidth(dt attn.DType, varlen bool, dk, dv int, ts ...DeviceTensor) int {
	esz := int64(dt.Size())
	for _, w := range []int64{16, 8, 4, 2} {
		if w < esz {
			break
		}
		ok := true
		for i, t := range ts {
			d := int64(dk)
			if i == 2 {
				d = int64(dv)
			}
			sb, sn, sh := seqStrides(t, varlen)
			if int64(t.ptr())%w != 0 || (d*esz)%w != 0 || (sb*esz)%w != 0 || (sn*esz)%w != 0 || (sh*esz)%w != 0 {
				ok = false
				break
			}
		}
		if ok {
			return int(w)
		}
	}
	return 2
}

// clampWindow maps a window extent larger than any distance in the problem
// to unbounded (-1), keeping the kernel's int32 arithmetic in range.
func clampWindow(x, n, m int) int32 {
	if x < 0 || x > n+m+1 {
		return -1
	}
	return int32(x)
}

// fwdRequest is what the forward planner takes: a validated problem, its
// device tensors and the backend's knobs.
type fwdRequest struct {
	p               *attn.Problem
	dt              attn.DType
	q, k, v, o, lse DeviceTensor
	bias            *DeviceTensor
	cuq, cuk        uint64 // device addresses of the packed batch's offsets
	// tiles overrides the tuning table when not nil (Backend.Tiles).
	tiles func(dt attn.DType, dk, dv int, narrow bool) (kernels.Tile, error)
	// staged says that q, k and v are staging copies whose rows are padded
	// with zeros to kernels.StagedDim, so that a copy may straddle the head
	// dim.
	staged bool
	// hopper allows the Hopper (WGMMA) kernel where it applies, tma its
	// tensor-map loads (Backend.WGMMA, Backend.TMA).
	hopper, tma bool
	// pipeline is the Hopper forward's pipeline where the variant allows
	// it (Backend.Pipeline).
	pipeline kernels.Pipeline
	// sms is the device's multiprocessor count, the CTAs of a persistent
	// launch (kernels.PersistentGrid).
	sms int
	// biasStaged stages a 16-bit bias through shared memory where the
	// variant and the bias's layout allow it; biasOverStoreO also where the
	// staged tiles need the room of O's staging tile, O then stored from
	// registers (Backend.BiasStaged, Backend.BiasStagedAuto).
	biasStaged, biasOverStoreO bool
	// lightTail orders a masked launch of one tile a CTA so that it ends
	// on its lightest query blocks (Backend.FwdLightTail).
	lightTail bool
	// narrowDoubleQ gives persistent launches whose two Q buffers do not
	// fit beside their key blocks narrower blocks that make room for them
	// (Backend.FwdNarrowDoubleQ).
	narrowDoubleQ bool
	// part, when set, holds staging copies of the heads that a flat-row
	// kernel cannot read in place (stagingAt with head masks): the plan is
	// then a kernels.Variant.FlatStaged one where the kernel and layouts
	// allow it.
	part *fwdStaging
}

// plan chooses the kernel variant of r and fills its parameters.
func plan(r fwdRequest) (launch, error) {
	var l launch
	p := r.p
	if err := checkDropoutAt(p); err != nil {
		return l, err
	}
	vr, flat, flatOK := fwdVariant(r)
	var tile kernels.Tile
	var err error
	ht, hok := kernels.HopperTile(vr)
	switch {
	case r.tiles != nil:
		tile, err = r.tiles(r.dt, vr.DK, vr.DV, vr.LoadBytes == 2)
	case r.hopper && hok:
		tile = ht
	default:
		tile, err = kernels.TileForVariant(vr)
	}
	if err != nil {
		return l, err
	}
	vr = tile.Apply(vr)
	var tstr [3][3]uint64 // byte strides (position, head, batch) of q, k, v for tensor maps
	switch {
	case flatOK:
		vr.TMA, vr.Flat, tstr = true, true, flat
		vr.FlatStaged = r.part != nil
		if !vr.WGMMA || vr.Validate() != nil {
			// not a kernel that reads flat rows: the planner without them
			r.tma, r.part = false, nil
			return plan(r)
		}
	case r.tma && vr.WGMMA && vr.LoadBytes == 16 && (!p.Varlen || packedTMARows(p)):
		var ok [3]bool
		for i, t := range []DeviceTensor{r.q, r.k, r.v} {
			tstr[i], ok[i] = tmaStrides(t)
		}
		vr.TMA = ok[0] && ok[1] && ok[2]
	}
	if vr.WGMMA {
		vr.Pipeline = pipelineFor(vr, r.pipeline)
		if vr.WarpSpecialized && r.tiles == nil {
			// the pipeline's own tile for the class or, where the lockstep kernels measured faster,
			// the parts of the pipeline they take: all but warp specialization and what needs it
			switch wt, ok := kernels.HopperWSTile(vr, p.M); {
			case !ok:
				lockstep := r.pipeline
				lockstep.WarpSpecialized, lockstep.PingPong, lockstep.Persistent = false, false, false
				vr.Pipeline = pipelineFor(vr, lockstep)
			case wt != (kernels.Tile{}):
				short, _ := kernels.HopperWSTile(vr, 0)
				vr = causalKeyTile(p, windowKeyTile(p, wt, short), short, vr.Persistent).Apply(vr)
				vr.Pipeline = pipelineFor(vr, r.pipeline)
			}
		}
		if r.narrowDoubleQ {
			vr = narrowForDoubleQ(vr, r.pipeline)
		}
		// the kernel counts its tiles in an int
		vr.Persistent = vr.Persistent && int64((p.N+vr.BlockM-1)/vr.BlockM)*int64(p.H)*int64(p.B) <= math.MaxInt32
	}
	pr := fwdParams(r)
	var bmap kernels.TMATensor // the bias's map, where it is staged
	if r.biasStaged && vr.WarpSpecialized && pr.BiasStrideN != 0 && biasStageable(pr.Bias, pr.BiasStrideM, pr.BiasStrideN, pr.BiasStrideH, pr.BiasStrideB) {
		bmap = vr.BiasTMATensor(&pr)
	}
	if bmap.Addr != 0 && tensorMapSpec(bmap).Check() == nil {
		w := vr
		w.BiasStaged = true
		if w.Validate() != nil && w.StoreO && r.biasOverStoreO {
			w.StoreO = false // the bias tiles take the room of O's staging tile
		}
		if w.Validate() == nil {
			vr = w
		}
	}
	if r.lightTail { // (Validate declines it unmasked or persistent)
		w := vr
		w.LightTail = true
		if w.Validate() == nil {
			vr = w
		}
	}
	if err := vr.Validate(); err != nil {
		return l, err
	}
	if p.H > 65535 || p.B > 65535 {
		return l, attn.Errorf(attn.ErrUnsupported, "cuda backend: grid of %d heads x %d batch elements (at most 65535 each)", p.H, p.B)
	}
	var omap kernels.TMATensor
	if vr.StoreO {
		// O by a tensor map where the encoder takes o's (the tiles' layout does not change without it)
		ostr, ok := tmaStrides(r.o)
		omap = vr.OutputTMATensor(&pr, ostr)
		vr.StoreO = ok && tensorMapSpec(omap).Check() == nil
	}
	l.v = vr
	l.params = pr
	switch {
	case vr.Flat:
		ts := vr.TMATensors(&pr, 0, 0, tstr[0], tstr[1], tstr[2])
		l.tma = []kernels.TMATensor{ts[0].OverFlatRows(p.DK), ts[1].OverFlatRows(p.DK), ts[2].OverFlatRows(p.DV)}
		if vr.FlatStaged {
			l.tma = append(l.tma, stagedHeadMaps(p, vr, r.part, l.tma)...)
		}
	case vr.TMA:
		ts := vr.TMATensors(&pr, uint64(kernels.TMACols(p.DK)), uint64(kernels.TMACols(p.DV)), tstr[0], tstr[1], tstr[2])
		if p.Varlen {
			ts = [3]kernels.TMATensor{ts[0].Packed(p.TotalQ), ts[1].Packed(p.TotalK), ts[2].Packed(p.TotalK)}
		}
		l.tma = ts[:]
		if vr.StoreO {
			l.tma = append(l.tma, omap)
		}
	}
	if vr.BiasStaged {
		l.tma = append(l.tma, bmap)
	}
	l.grid = [3]uint32{uint32((p.N + vr.BlockM - 1) / vr.BlockM), uint32(p.H), uint32(p.B)}
	if vr.Persistent {
		tiles := int(l.grid[0]) * p.H * p.B
		l.grid = [3]uint32{uint32(kernels.PersistentGrid(tiles, r.sms)), 1, 1}
	}
	return l, nil
}

// NarrowDoubleQKeys is the key block a persistent launch takes where its
// two Q buffers fit beside no wider one (Backend.FwdNarrowDoubleQ): at
// head dim 256 two 64 KB Q buffers and two stages of 48-key K and V blocks
// take 230528 of a CTA's 232448 bytes of shared memory (with 80-key
// blocks, 296064).
const NarrowDoubleQKeys = 48

// narrowForDoubleQ returns v on NarrowDoubleQKeys-key blocks with two Q
// buffers where v is persistent, wants two Q buffers (want.DoubleQ), has
// wider blocks and one Q buffer because two do not fit beside them, and the
// narrower blocks make room for two; O's staging tile (StoreO) gives way
// to them. Otherwise it returns v.
func narrowForDoubleQ(v kernels.Variant, want kernels.Pipeline) kernels.Variant {
	if !v.Persistent || v.DoubleQ || !want.DoubleQ || v.BlockN <= NarrowDoubleQKeys {
		return v
	}
	w := v
	w.BlockN = NarrowDoubleQKeys
	want.StoreO = false // two Q buffers in the room of O's staging tile
	w.Pipeline = pipelineFor(w, want)
	if !w.DoubleQ || !w.Persistent || w.Validate() != nil {
		return v
	}
	return w
}

// biasStageable reports whether a 16-bit bias at device address ptr, with
// element strides keys (between keys) and rows (rows, heads, batch
// elements; 0 where broadcast), can be staged through shared memory by
// tensor-map loads (kernels.Variant.BiasStaged, kernels.BwdVariant.BiasStaged;
// the variants check the type): contiguous keys, the start and every
// stride 16-byte aligned. The planners also need a map the encoder takes,
// which a bias broadcast over the rows is not (kernels.Variant.BiasTMATensor,
// kernels.BwdVariant.BiasTMATensor).
func biasStageable(ptr uint64, keys int64, rows ...int64) bool {
	if ptr == 0 || ptr%16 != 0 || keys != 1 {
		return false
	}
	for _, s := range rows {
		if s*2%16 != 0 {
			return false
		}
	}
	return true
}

// fwdVariant returns the variant of r before its tile is chosen, and
// whether (with the tensor maps' byte strides) the Hopper kernel may read
// q, k and v in place over flat rows.
func fwdVariant(r fwdRequest) (kernels.Variant, [3][3]uint64, bool) {
	p, opt := r.p, r.p.Opt
	rowK, rowV := p.DK, p.DV
	if r.staged {
		rowK, rowV = kernels.StagedDim(p.DK), kernels.StagedDim(p.DV)
	}
	lb := loadWidth(r.dt, p.Varlen, rowK, rowV, r.q, r.k, r.v)
	var flat [3][3]uint64 // byte strides of q, k, v read in place over flat rows (kernels.Variant.Flat)
	flatOK := false
	if lb < 16 && !r.staged && r.hopper && r.tma {
		flat, flatOK = flatRows(p, r.dt, r.q, r.k, r.v)
		// every head in place, or with part the heads that fit
		fits := kernels.FlatStagedHeads(p.DK) == 0 && kernels.FlatStagedHeads(p.DV) == 0
		flatOK = flatOK && (fits || r.part != nil)
		if flatOK {
			lb = 16 // the accelerator reads whole 16-byte units of every row
		}
	}
	vr := kernels.Variant{
		DType:     r.dt,
		DK:        kernels.CapacityDim(p.DK),
		DV:        kernels.CapacityDim(p.DV),
		LoadBytes: lb,
		Features: kernels.Features{
			Softcap: opt.Softcap > 0,
			Dropout: opt.Dropout > 0,
			Varlen:  p.Varlen,
		},
		PreScale: p.Scale < 0,
		LSE:      true,
	}
	if p.Masked {
		vr.Mask = kernels.MaskWindow
	}
	if r.bias != nil {
		vr.Bias = kernels.BiasFor(r.bias.DType)
	}
	return vr, flat, flatOK
}

// fwdParams fills the kernel parameters of r.
func fwdParams(r fwdRequest) kernels.Params {
	p, opt := r.p, r.p.Opt
	q, k, v, o, lse := r.q, r.k, r.v, r.o, r.lse
	pr := kernels.Params{
		Q: q.ptr(), K: k.ptr(), V: v.ptr(), O: o.ptr(), LSE: lse.ptr(),
		CuSeqlensQ: r.cuq, CuSeqlensK: r.cuk,
		B: int32(p.B), H: int32(p.H), Group: int32(p.H / p.Hkv),
		N: int32(p.N), M: int32(p.M), DK: int32(p.DK), DV: int32(p.DV),
		ScaleLog2: float32(p.Scale * math.Log2E),
		Scale:     float32(p.Scale),
		WinLeft:   clampWindow(p.Left, p.N, p.M),
		WinRight:  clampWindow(p.Right, p.N, p.M),
	}
	pr.QStrideB, pr.QStrideN, pr.QStrideH = seqStrides(q, p.Varlen)
	pr.KStrideB, pr.KStrideN, pr.KStrideH = seqStrides(k, p.Varlen)
	pr.VStrideB, pr.VStrideN, pr.VStrideH = seqStrides(v, p.Varlen)
	pr.OStrideB, pr.OStrideN, pr.OStrideH = seqStrides(o, p.Varlen)
	pr.LSEStrideB, pr.LSEStrideH, pr.LSEStrideN = lseStrides(lse, p.Varlen)
	if opt.Align == attn.AlignBottomRight {
		pr.AlignBR = 1
	}
	if opt.Softcap > 0 {
		pr.SoftcapIn = float32(p.Scale / opt.Softcap)
		pr.SoftcapOut = float32(opt.Softcap * math.Log2E)
	}
	osb, osn, osh := seqStrides(o, p.Varlen)
	esz := int64(r.dt.Size())
	if int64(o.ptr())%(2*esz) == 0 && p.DV%2 == 0 && osb%2 == 0 && osn%2 == 0 && osh%2 == 0 {
		pr.OVec2 = 1
	}
	if bias := r.bias; bias != nil {
		pr.Bias = bias.ptr()
		st := bias.strides()
		z := func(d int) int64 {
			if bias.Shape[d] <= 1 {
				return 0
			}
			return int64(st[d])
		}
		pr.BiasStrideB, pr.BiasStrideH, pr.BiasStrideN, pr.BiasStrideM = z(0), z(1), z(2), z(3)
	}
	if opt.Dropout > 0 {
		pr.DropThreshold, pr.DropScale = r.p.DropThreshold, float32(r.p.DropScale)
		pr.SeedLo, pr.SeedHi = uint32(opt.Seed), uint32(opt.Seed>>32)
		pr.DropOffset = opt.Offset
		head, heads, qo, ko := r.p.DropoutPlace(0)
		pr.DropQ0, pr.DropK0, pr.DropH0, pr.DropHeads = uint32(qo), uint32(ko), uint32(head), uint32(heads)
	}
	return pr
}

// stagedHeadMaps returns the tensor maps of a FlatStaged launch's staging
// copies (part: q, k, v holding only the heads that do not fit in place);
// a tensor with no such head gets its in-place map (inPlace), which the
// kernel then never reads.
func stagedHeadMaps(p *attn.Problem, vr kernels.Variant, part *fwdStaging, inPlace []kernels.TMATensor) []kernels.TMATensor {
	out := make([]kernels.TMATensor, 3)
	for i, sv := range part.views {
		heads := sv.Shape[2]
		if heads == 0 {
			out[i] = inPlace[i]
			continue
		}
		d, rows, box := p.DK, p.M, vr.BlockN
		switch i {
		case 0:
			rows, box = p.N, vr.BlockM
		case 2:
			d = p.DV
		}
		st, _ := tmaStrides(sv) // contiguous copies: strides every encoder takes
		out[i] = kernels.TMATensor{Addr: sv.ptr(), Cols: uint64(kernels.TMACols(d)), Rows: uint64(rows), Heads: uint64(heads),
			B: uint64(p.B), Strides: st, BoxRows: uint32(box)}
	}
	return out
}

// flatStagedHeads returns the head masks (kernels.FlatStagedHeads) with
// which a kernels.Variant.FlatStaged forward reads q, k and v of p: the
// layouts allow flat rows (flatRows), some heads do not fit in place, and
// fewer than half of them (of q's and k's heads and of v's) do not (the
// measured break-even: docs/kernels/odd-dims.md, "Some heads in place,
// the rest staged").
func flatStagedHeads(p *attn.Problem, dt attn.DType, q, k, v DeviceTensor) (*[3]uint8, bool) {
	mk, mv := kernels.FlatStagedHeads(p.DK), kernels.FlatStagedHeads(p.DV)
	if mk == 0 && mv == 0 {
		return nil, false
	}
	if 2*kernels.FlatStagedCount(p.H, mk) >= p.H || 2*kernels.FlatStagedCount(p.H, mv) >= p.H {
		return nil, false
	}
	if _, ok := flatRows(p, dt, q, k, v); !ok {
		return nil, false
	}
	return &[3]uint8{mk, mk, mv}, true
}

// flatRows reports whether the layouts of q, k and v of p let the Hopper
// forward read them in place over flat rows (kernels.Variant.Flat): 16-bit,
// fixed-length, one query head per key head, each tensor's layout one
// kernels.FlatRowsOK takes, and strides the encoder takes. Whether each
// head fits in place is kernels.FlatStagedHeads's to say. It returns the
// tensor maps' byte strides (position, head: set by
// TMATensor.OverFlatRows, batch).
func flatRows(p *attn.Problem, dt attn.DType, q, k, v DeviceTensor) ([3][3]uint64, bool) {
	var out [3][3]uint64
	if dt.Size() != 2 || p.Varlen || p.H != p.Hkv {
		return out, false
	}
	for i, t := range []DeviceTensor{q, k, v} {
		d := p.DK
		if i == 2 {
			d = p.DV
		}
		sb, sn, sh := seqStrides(t, false)
		if !kernels.FlatRowsOK(t.ptr(), t.Shape[2], d, sh, sn, sb, t.Shape[0]) {
			return out, false
		}
		out[i] = [3]uint64{kernels.TMAStride(t.Shape[1], sn, 2), 0, kernels.TMAStride(t.Shape[0], sb, 2)}
		if !cuda.TensorMapStrideOK(out[i][0]) || !cuda.TensorMapStrideOK(out[i][2]) {
			return out, false
		}
	}
	return out, true
}

// tmaStrides returns the byte strides (position, head, batch) of a
// [B, N, H, D] 16-bit tensor, or of a packed batch's [T, H, D] (one batch
// element), for its tensor map (kernels.TMAStride), and
// whether the tensor memory accelerator can read it: every stride one the
// encoder takes (cuda.TensorMapStrideOK).
func tmaStrides(t DeviceTensor) ([3]uint64, bool) {
	st := t.strides()
	dims := [3]int{1, 2, 0} // position, head, batch of [B, N, H, D]
	if len(t.Shape) == 3 {
		dims = [3]int{0, 1, -1} // [T, H, D]: a packed batch, one batch element
	}
	var out [3]uint64
	for i, d := range dims {
		if d < 0 {
			out[i] = kernels.TMAStride(1, 0, t.DType.Size())
			continue
		}
		out[i] = kernels.TMAStride(t.Shape[d], int64(st[d]), t.DType.Size())
		if !cuda.TensorMapStrideOK(out[i]) {
			return out, false
		}
	}
	return out, true
}

// packedTMARows reports whether the tensor-map kernels can address the rows
// of packed batch p: the kernels' row coordinates, the sequence's first row
// plus a tile's, are 32-bit.
func packedTMARows(p *attn.Problem) bool {
	return max(p.TotalQ, p.TotalK) <= math.MaxInt32-1024
}

// fwdCall is one validated forward call on device tensors.
type fwdCall struct {
	p               *attn.Problem
	dt              attn.DType
	q, k, v, o, lse DeviceTensor
	opt             DeviceOptions
}

// fwdPlan is the plan of one forward call: its launch and, when q, k and
// v are first copied into staging, the staging plan.
type fwdPlan struct {
	launch
	p  *attn.Problem
	st *fwdStaging // nil: no staging copies
}

// empty reports whether the call has nothing to compute (no query or no
// batch element).
func (pl *fwdPlan) empty() bool { return pl.p.N == 0 || pl.p.B == 0 }

// request returns the planner's request for c with the backend's knobs.
func (b *Backend) request(c *fwdCall) fwdRequest {
	r := fwdRequest{p: c.p, dt: c.dt, q: c.q, k: c.k, v: c.v, o: c.o, lse: c.lse, bias: c.opt.Bias,
		tiles: b.Tiles, hopper: b.WGMMA, tma: b.TMA, pipeline: b.forwardPipeline(c.p, c.opt.Bias != nil), lightTail: b.FwdLightTail, narrowDoubleQ: b.FwdNarrowDoubleQ}
	b.setBiasStaging(&r)
	if r.pipeline.Persistent {
		r.sms = b.dev.SMCount()
	}
	if c.p.Varlen {
		r.cuq, r.cuk = c.opt.CuSeqlensQ.Ptr(), c.opt.CuSeqlensK.Ptr()
	}
	return r
}

// setBiasStaging sets the bias staging of forward request r from the
// backend's knobs: staged wherever the tiles fit with BiasStaged or
// BiasStagedAuto, and with BiasStaged also in place of O's staging tile.
func (b *Backend) setBiasStaging(r *fwdRequest) {
	r.biasStaged, r.biasOverStoreO = b.biasStaged(), b.BiasStaged
}

// forwardPipeline returns the Hopper forward pipeline the backend asks for p
// (biased: with an additive bias): ShortPipeline where it is set and p has
// at most ShortKeys keys (plain: shortPlain; causal: ShortCausalKeys) or a
// short window (shortWindow), without a bias, else Pipeline. A biased call keeps
// Pipeline whatever its length: its bias tiles fit beside Pipeline's
// stages, not beside the short pipeline's O tile, and a bias read from
// global memory costs more than the short pipeline saves
// (docs/kernels/forward.md, "The bias staged in shared memory").
// Pipeline takes the early dropout bits besides where EarlyDropoutAuto and
// earlyDropoutFaster say so; either takes the lazy rescale with
// LazyRescale and the head-major tile order with FwdHeadMajor, or with
// FwdHeadMajorAuto at most HeadMajorQueries queries (which only the
// persistent launches keep); the producer's dropout keep bits with
// FwdProducerDropout (which only variants under dropout keep); two Q
// buffers with FwdDoubleQ (which only the persistent launches keep, where
// their shared memory fits); ping-pong's turns carried across tiles with
// FwdCarryTurns (persistent launches with ping-pong).
func (b *Backend) forwardPipeline(p *attn.Problem, biased bool) kernels.Pipeline {
	pl := b.Pipeline
	switch {
	case b.ShortPipeline != nil && !biased && (p.M <= ShortKeys || shortPlain(p) || p.Opt.Causal && p.M <= ShortCausalKeys || shortWindow(p)):
		pl = *b.ShortPipeline
	case b.EarlyDropoutAuto && earlyDropoutFaster(p):
		pl.EarlyDropout = true
	}
	pl.LazyRescale = pl.LazyRescale || b.LazyRescale
	pl.HeadMajor = pl.HeadMajor || b.FwdHeadMajor || b.FwdHeadMajorAuto && p.N <= HeadMajorQueries
	pl.ProducerDropout = pl.ProducerDropout || b.FwdProducerDropout // (pipelineFor keeps it under dropout only)
	pl.DoubleQ = pl.DoubleQ || b.FwdDoubleQ                         // (pipelineFor keeps it on persistent CTAs only)
	pl.CarryTurns = pl.CarryTurns || b.FwdCarryTurns                // (and this on persistent CTAs with ping-pong)
	pl.PolyExp = max(pl.PolyExp, b.FwdPolyExp)                      // (and this on the WGMMA kernels of 16-bit types)
	return pl
}

// HeadMajorQueries is the longest query sequence whose persistent forward
// takes the head-major tile order by default (Backend.FwdHeadMajorAuto):
// at 512 queries it measured 1.05–1.12× the L2 sections' order, at 1024
// 0.975–1.035×, from 2048 on 0.957–1.009× (docs/kernels/forward.md,
// "head-major").
const HeadMajorQueries = 512

// earlyDropoutFaster reports the problems whose forward measured faster
// with the dropout keep bits drawn while the S product runs
// (kernels.Pipeline.EarlyDropout) than after it: under dropout, head dims
// 96–128 (their larger); at 64–80 the bits' registers cost more than the
// overlap gains, at 192–256 they break even (docs/kernels/forward.md,
// "Pipelines", early-dropout).
func earlyDropoutFaster(p *attn.Problem) bool {
	d := max(p.DK, p.DV)
	return p.Opt.Dropout > 0 && d >= 96 && d <= 128
}

// windowKeyTile returns, of the pipeline's tile t and its short-call tile
// s (kernels.HopperWSTable's ShortN keys), the one whose key blocks compute
// fewer score pairs for p's window (windowPairs), t where p has no window
// bounded on the left, or a packed batch. Past 1024 keys the two tiles run
// within a few percent of each other per computed pair (BENCHMARKS.md,
// "The key tile by length"), but a window's query tile sees a band of keys
// that blocks not dividing the query tile cut badly: at (256, 0) with 128
// query rows, 160-key blocks compute 1.99 pairs for each visible one,
// 128-key blocks 1.49. s is taken where it computes at least 3 % fewer.
func windowKeyTile(p *attn.Problem, t, s kernels.Tile) kernels.Tile {
	if !p.Masked || p.Left < 0 || p.Varlen || s.BlockN == t.BlockN || s.BlockM != t.BlockM || s.BlockN == 0 {
		return t
	}
	if 100*windowPairs(p, s.BlockM, s.BlockN) <= 97*windowPairs(p, t.BlockM, t.BlockN) {
		return s
	}
	return t
}

// causalKeyTile returns, for a causal call on persistent CTAs (the short
// pipeline, at most ShortCausalKeys keys), the short-call tile s
// (kernels.HopperWSTable's ShortN keys), else t. Causal calls measured
// faster on 128 keys than on 160 at every length (1.02–1.03× at 2048 and
// 4096 keys; BENCHMARKS.md, "The key tile by length"), and 128 keys leave
// the shared memory for two Q buffers (kernels.Pipeline.DoubleQ).
func causalKeyTile(p *attn.Problem, t, s kernels.Tile, persistent bool) kernels.Tile {
	if !p.Opt.Causal || !persistent || s.BlockN == 0 || s.BlockM != t.BlockM {
		return t
	}
	return s
}

// windowPairs returns the score pairs a forward of p (fixed-length) computes
// with query tiles of bm rows and key blocks of bn keys: each tile's blocks
// from the first key its first row sees to the last key its last row sees,
// as the kernels' mask range takes them.
func windowPairs(p *attn.Problem, bm, bn int) int64 {
	var pairs int64
	for m0 := 0; m0 < p.N; m0 += bm {
		rows := min(bm, p.N-m0)
		lo, _ := p.KeyRange(m0, p.N, p.M)
		_, hi := p.KeyRange(m0+rows-1, p.N, p.M)
		if blocks := (hi+bn-1)/bn - lo/bn; hi > 0 && blocks > 0 { // (else the tile sees no key and computes none)
			pairs += int64(rows) * int64(blocks) * int64(bn)
		}
	}
	return pairs
}

// shortPlain reports whether p is a plain call (no mask, softcap or
// dropout) of at most ShortPlainKeys keys at head dims up to ShortPlainDim,
// which take persistent CTAs: with two Q buffers they measured 1.035× the
// launches of one tile a CTA at D = 128 and 1.048× at D = 64 (1024 keys),
// 1.037× at D = 128 and 2048 keys, and 0.987× at D = 256
// (docs/kernels/forward.md, "Pipelines", double-q).
func shortPlain(p *attn.Problem) bool {
	return !p.Masked && p.Opt.Softcap == 0 && p.Opt.Dropout == 0 && max(p.DK, p.DV) <= ShortPlainDim && p.M <= ShortPlainKeys
}

// shortWindow reports whether p's mask (resolved) is a window of both sides
// bounded, spanning at most ShortWindowKeys+1 keys a row: few key blocks a
// tile whatever the length, as in a short call.
func shortWindow(p *attn.Problem) bool {
	return p.Masked && p.Left >= 0 && p.Right >= 0 && p.Left+p.Right <= ShortWindowKeys
}

// planForward plans call c once: the launch on the caller's tensors or,
// when staging is wanted and they are 16-bit with rows that allow no
// 16-byte copies, the launch on staging copies (planStaging) with their
// staging plan. The copies go in ws; with ws nil they are laid out at
// stagingPlanBase, for their size and the kernel choice, and
// fwdPlan.relocate later moves them into a workspace.
func (b *Backend) planForward(c *fwdCall, ws *cuda.Buffer, staging bool) (fwdPlan, error) {
	countPlan()
	r := b.request(c)
	l, err := plan(r)
	pl := fwdPlan{launch: l, p: c.p}
	if err != nil || !staging || l.v.LoadBytes >= 16 || c.dt.Size() != 2 || pl.empty() {
		return pl, err
	}
	ls, st, err := planStaging(r, ws, stagingPlanBase)
	if err != nil {
		return pl, err
	}
	if ws != nil && st.bytes > ws.Size() {
		return pl, attn.Errorf(attn.ErrOption, "forward: staging workspace of %d bytes, %d needed", ws.Size(), st.bytes)
	}
	pl.launch, pl.st = ls, &st
	return pl, nil
}

// planStaging plans the forward launch of r on staging copies in ws (nil:
// at device address base, for sizes and the kernel choice only): of only
// the heads a flat-row kernel cannot read in place where the Hopper
// forward reads the others so (kernels.Variant.FlatStaged), else of every
// head of q, k and v.
func planStaging(r fwdRequest, ws *cuda.Buffer, base uint64) (launch, fwdStaging, error) {
	p := r.p
	if heads, ok := flatStagedHeads(p, r.dt, r.q, r.k, r.v); ok && r.hopper && r.tma {
		st := stagingAt(p, r.q, r.k, r.v, ws, base, heads)
		fr := r
		fr.part = &st
		l, err := plan(fr)
		if err == nil && l.v.FlatStaged {
			return l, st, nil
		}
	}
	st := stagingAt(p, r.q, r.k, r.v, ws, base, nil)
	sr := r
	sr.q, sr.k, sr.v, sr.staged = st.views[0], st.views[1], st.views[2], true
	l, err := plan(sr)
	if err != nil {
		return l, st, fmt.Errorf("gpu: forward on staging copies: %w", err)
	}
	return l, st, nil
}

// relocate moves the staging copies of a plan made with them at
// stagingPlanBase (planForward with ws nil) into workspace ws.
func (pl *fwdPlan) relocate(ws *cuda.Buffer) { pl.moveStaging(ws, ws.Ptr()) }

// moveStaging moves the staging copies from stagingPlanBase to device
// address to (in ws; nil: in no buffer): their views, the pack launch's
// destinations, and the kernel's addresses and tensor maps of them.
func (pl *fwdPlan) moveStaging(ws *cuda.Buffer, to uint64) {
	st := pl.st
	if st == nil {
		return
	}
	d := to - stagingPlanBase // modulo 2^64
	for i := range st.views {
		st.views[i].Buf = ws
		st.views[i].base += d
		if ws != nil {
			st.views[i].base = 0
		}
		if st.params[i].Dst != 0 {
			st.params[i].Dst += d
		}
	}
	if pl.v.FlatStaged {
		// q, k, v read in place; the maps after theirs are the copies' (or
		// an in-place one for a tensor with no copy)
		for i, sv := range st.views {
			if sv.Shape[2] > 0 {
				pl.tma[3+i].Addr += d
			}
		}
		return
	}
	pl.params.Q, pl.params.K, pl.params.V = pl.params.Q+d, pl.params.K+d, pl.params.V+d
	for i := range min(3, len(pl.tma)) { // (a StoreO map after them is the output's: not staged)
		pl.tma[i].Addr += d
	}
}

// pipelineFor returns the parts of want that Hopper variant v allows: warp
// specialization with tensor-map loads, one warpgroup per row group and one
// CTA per SM; ping-pong with two compute warpgroups besides; persistence
// with warp specialization where the rows are not read in place and the
// batch is not packed; the early rescale, the O store by tensor maps and
// the early dropout bits, the lazy rescale and the head-major tile order
// where the variant validates with them; the producer's dropout keep bits
// where the variant validates with them, in place of the early ones; two Q
// buffers where the variant validates with them beside the parts taken;
// ping-pong's turns carried across tiles on persistent CTAs with ping-pong.
func pipelineFor(v kernels.Variant, want kernels.Pipeline) kernels.Pipeline {
	var p kernels.Pipeline
	p.WarpSpecialized = want.WarpSpecialized && v.TMA && v.WarpsN == 1 && v.MinBlocks == 1
	p.PingPong = want.PingPong && p.WarpSpecialized && v.WarpsM == 8
	p.Persistent = want.Persistent && p.WarpSpecialized && !v.Flat && !v.Varlen
	// allows reports whether v validates on the pipeline parts
	allows := func(parts kernels.Pipeline) bool {
		w := v
		w.Pipeline = parts
		return w.Validate() == nil
	}
	p.StoreO = want.StoreO && allows(kernels.Pipeline{WarpSpecialized: p.WarpSpecialized, Persistent: p.Persistent, StoreO: true})
	p.EarlyRescale = want.EarlyRescale && allows(kernels.Pipeline{EarlyRescale: true})
	p.ProducerDropout = want.ProducerDropout && allows(kernels.Pipeline{WarpSpecialized: p.WarpSpecialized, Persistent: p.Persistent, ProducerDropout: true})
	p.EarlyDropout = want.EarlyDropout && !p.ProducerDropout && allows(kernels.Pipeline{EarlyDropout: true})
	p.LazyRescale = want.LazyRescale && allows(kernels.Pipeline{LazyRescale: true})
	p.HeadMajor = want.HeadMajor && allows(kernels.Pipeline{WarpSpecialized: p.WarpSpecialized, Persistent: p.Persistent, HeadMajor: true})
	p.DoubleQ = want.DoubleQ && allows(kernels.Pipeline{WarpSpecialized: p.WarpSpecialized, Persistent: p.Persistent, StoreO: p.StoreO, ProducerDropout: p.ProducerDropout, DoubleQ: true})
	p.CarryTurns = want.CarryTurns && allows(kernels.Pipeline{WarpSpecialized: p.WarpSpecialized, PingPong: p.PingPong, Persistent: p.Persistent, CarryTurns: true})
	if want.PolyExp > 0 && allows(kernels.Pipeline{PolyExp: want.PolyExp}) {
		p.PolyExp = want.PolyExp
	}
	return p
}
