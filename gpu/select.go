package gpu

import (
	"fmt"
	"math"
	"slices"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
	"github.com/flashattn/flashattn/philox"
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

// plan chooses the kernel variant and fills its parameters for a validated
// problem on device tensors. tiles overrides the tuning table when not nil.
// staged says that q, k and v are staging copies whose rows are padded with
// zeros to kernels.StagedDim, so that a copy may straddle the head dim.
// hopper allows the Hopper (WGMMA) kernel where it applies. part, when
// set, holds staging copies of the heads that a flat-row kernel cannot
// read in place (stagingFor with head masks): the plan is then a
// kernels.Variant.FlatStaged one where the kernel and layouts allow it.
func plan(p *attn.Problem, dt attn.DType, q, k, v, o, lse DeviceTensor, bias *DeviceTensor, cuq, cuk uint64,
	tiles func(dt attn.DType, dk, dv int, narrow bool) (kernels.Tile, error), staged, hopper, tma bool, part *fwdStaging) (launch, error) {
	var l launch
	opt := p.Opt
	rowK, rowV := p.DK, p.DV
	if staged {
		rowK, rowV = kernels.StagedDim(p.DK), kernels.StagedDim(p.DV)
	}
	lb := loadWidth(dt, p.Varlen, rowK, rowV, q, k, v)
	var flat [3][3]uint64 // byte strides of q, k, v read in place over flat rows (kernels.Variant.Flat)
	flatOK := false
	if lb < 16 && !staged && hopper && tma {
		flat, flatOK = flatRows(p, dt, q, k, v)
		// every head in place, or with part the heads that fit
		fits := kernels.FlatStagedHeads(p.DK) == 0 && kernels.FlatStagedHeads(p.DV) == 0
		flatOK = flatOK && (fits || part != nil)
		if flatOK {
			lb = 16 // the accelerator reads whole 16-byte units of every row
		}
	}
	vr := kernels.Variant{
		DType:     dt,
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
	if bias != nil {
		vr.Bias = kernels.BiasFor(bias.DType)
	}
	var tile kernels.Tile
	var err error
	ht, hok := kernels.HopperTile(vr)
	switch {
	case tiles != nil:
		tile, err = tiles(dt, vr.DK, vr.DV, lb == 2)
	case hopper && hok:
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
		vr.FlatStaged = part != nil
		if !vr.WGMMA || vr.Validate() != nil {
			// not a kernel that reads flat rows: the planner without them
			return plan(p, dt, q, k, v, o, lse, bias, cuq, cuk, tiles, staged, hopper, false, nil)
		}
	case tma && vr.WGMMA && !p.Varlen && lb == 16:
		var ok [3]bool
		for i, t := range []DeviceTensor{q, k, v} {
			tstr[i], ok[i] = tmaStrides(t)
		}
		vr.TMA = ok[0] && ok[1] && ok[2]
	}
	if err := vr.Validate(); err != nil {
		return l, err
	}
	if p.H > 65535 || p.B > 65535 {
		return l, attn.Errorf(attn.ErrUnsupported, "cuda backend: grid of %d heads x %d batch elements (at most 65535 each)", p.H, p.B)
	}

	pr := kernels.Params{
		Q: q.ptr(), K: k.ptr(), V: v.ptr(), O: o.ptr(), LSE: lse.ptr(),
		CuSeqlensQ: cuq, CuSeqlensK: cuk,
		B: int32(p.B), H: int32(p.H), Group: int32(p.H / p.Hkv),
		N: int32(p.N), M: int32(p.M), DK: int32(p.DK), DV: int32(p.DV),
		ScaleLog2: float32(p.Scale * math.Log2E),
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
	esz := int64(dt.Size())
	if int64(o.ptr())%(2*esz) == 0 && p.DV%2 == 0 && osb%2 == 0 && osn%2 == 0 && osh%2 == 0 {
		pr.OVec2 = 1
	}
	if bias != nil {
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
		pr.DropThreshold = philox.Threshold(opt.Dropout)
		pr.DropScale = float32(1 / (1 - opt.Dropout))
		pr.SeedLo, pr.SeedHi = uint32(opt.Seed), uint32(opt.Seed>>32)
		pr.DropOffset = opt.Offset
	}
	l.v = vr
	l.params = pr
	switch {
	case vr.Flat:
		ts := vr.TMATensors(&pr, 0, 0, tstr[0], tstr[1], tstr[2])
		l.tma = []kernels.TMATensor{ts[0].OverFlatRows(p.DK), ts[1].OverFlatRows(p.DK), ts[2].OverFlatRows(p.DV)}
		if vr.FlatStaged {
			l.tma = append(l.tma, stagedHeadMaps(p, vr, part, l.tma)...)
		}
	case vr.TMA:
		ts := vr.TMATensors(&pr, uint64(kernels.TMACols(p.DK)), uint64(kernels.TMACols(p.DV)), tstr[0], tstr[1], tstr[2])
		l.tma = ts[:]
	}
	l.grid = [3]uint32{uint32((p.N + vr.BlockM - 1) / vr.BlockM), uint32(p.H), uint32(p.B)}
	return l, nil
}

func roundUp(x, m int) int { return (x + m - 1) / m * m }

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
// fewer than half of them (of q's and k's heads and of v's) do not.
//
// The half is measured (bf16, B = 1, H = 16, N = 4096, H200): at D = 59,
// two heads in eight staged, the forward took 0.178 ms against 0.185 with
// every head staged; at D = 127, six in eight, 0.307 against 0.303.
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
// [B, N, H, D] 16-bit tensor for its tensor map (kernels.TMAStride), and
// whether the tensor memory accelerator can read it: every stride one the
// encoder takes (cuda.TensorMapStrideOK).
func tmaStrides(t DeviceTensor) ([3]uint64, bool) {
	st := t.strides()
	var out [3]uint64
	for i, d := range [3]int{1, 2, 0} {
		out[i] = kernels.TMAStride(t.Shape[d], int64(st[d]), t.DType.Size())
		if !cuda.TensorMapStrideOK(out[i]) {
			return out, false
		}
	}
	return out, true
}

// tensorMapCache keeps the tensor maps of the last TMA launch. Each encode
// is a driver call on the executor thread, three or four per launch, while
// a training loop or a benchmark launches on the same buffers again and
// again; a map depends on nothing but its TMATensor.
type tensorMapCache struct {
	key  []kernels.TMATensor
	maps [][128]byte // as kernels.PackTMA and BwdTMAArgs take them
}

// get returns the maps of the tensors described by key (names: theirs, for
// errors), encoding them with encode unless they are the last ones encoded.
func (c *tensorMapCache) get(key []kernels.TMATensor, names []string, encode func(kernels.TMATensor) (cuda.TensorMap, error)) ([][128]byte, error) {
	if c.maps != nil && slices.Equal(c.key, key) {
		return c.maps, nil
	}
	maps := make([][128]byte, len(key))
	for i, t := range key {
		m, err := encode(t)
		if err != nil {
			return nil, fmt.Errorf("tensor map of %s: %w", names[i], err)
		}
		maps[i] = m
	}
	c.key, c.maps = slices.Clone(key), maps
	return maps, nil
}

// tensorMapSpec is the tensor map of one TMA tensor: boxes of 64 columns
// (one 128-byte swizzle atom) by BoxRows positions of one head and batch
// element, stored with the 128-byte swizzle.
func tensorMapSpec(t kernels.TMATensor) cuda.TensorMapSpec {
	return cuda.TensorMapSpec{
		Addr:       t.Addr,
		Dims:       []uint64{t.Cols, t.Rows, t.Heads, t.B},
		Strides:    t.Strides[:],
		Box:        []uint32{64, t.BoxRows, 1, 1},
		Swizzle128: true,
	}
}

// fwdTMANames names the forward's tensor maps in errors.
var fwdTMANames = []string{"q", "k", "v", "q copy", "k copy", "v copy"}
