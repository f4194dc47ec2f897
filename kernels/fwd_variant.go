package kernels

import (
	"fmt"

	"github.com/flashattn/flashattn/attn"
)

// KernelName is the name of the forward kernel's entry point in every
// generated module.
const KernelName = "flash_fwd"

// Variant describes one forward kernel. Its zero value is not valid; fill
// every tile field (Tile does it from the tuning table). The source of the
// kernel is a pure function of the Variant.
type Variant struct {
	// DType is the element type of q, k, v and o.
	DType attn.DType
	// DK and DV are the head-dimension capacities (1..512). The kernel
	// handles any actual dims up to them, given at run time; inside, they are
	// padded with zero-filled columns to a multiple of 16 (DV to a multiple
	// of 16·WarpsN).
	DK, DV int
	// BlockM is the number of query rows per CTA, a multiple of 16·WarpsM;
	// each warp owns BlockM/WarpsM rows (16 or 32).
	BlockM int
	// BlockN is the number of keys per tile, a multiple of 16·WarpsN.
	BlockN int
	// WarpsM is the number of warps along the query rows.
	WarpsM int
	// WarpsN is the number of warps (warpgroups, with WGMMA) that split one
	// tile's keys in S and the value dimension in O (1 or 2). With 2, P and
	// the row maxima go through shared memory.
	WarpsN int
	// Stages is the number of shared-memory buffers for K and V (1 or 2).
	Stages int
	// LoadBytes is the width of one global load: 16, 8 or 4 bytes through
	// cp.async, or 2 bytes (16-bit types only) through registers. The host
	// picks the widest that every row start, stride and head dim allows.
	LoadBytes int
	// QInRegs keeps the Q fragments in registers for the whole kernel
	// instead of reading them from shared memory at every key block.
	QInRegs bool
	// Features: mask, softcap, bias, dropout, varlen.
	Features
	// PreScale multiplies the scores by scale·log2(e) before the row
	// maximum (needed when the scale is negative; implied by Softcap and
	// Bias, which transform the scores anyway).
	PreScale bool
	// LSE writes the log-sum-exp.
	LSE bool
	// MinBlocks is the number of CTAs per SM the register allocation must
	// allow (__launch_bounds__).
	MinBlocks int
	// WGMMA selects the Hopper kernel (sm_90a only; see fwd_sm90.go): warpgroup
	// matrix products (wgmma.mma_async) on 128-byte-swizzled shared tiles,
	// one warpgroup per 64 query rows, the P·V product of a key block
	// overlapping the softmax of the next. It needs 16-bit elements, 16-byte
	// loads, Stages = 2, and either WarpsN = 1 with BlockM = 16·WarpsM,
	// WarpsM a multiple of 4 (up to 3 warpgroups), padded DV at most 320, or
	// WarpsN = 2 with one row group of 64 (WarpsM = 4), BlockN a multiple
	// of 16 up to 64, padded DV at most 512.
	WGMMA bool
	// TMA loads the Q, K and V tiles of a WGMMA kernel with the tensor memory
	// accelerator (bulk tensor copies completing on mbarriers; see tma.go)
	// instead of per-thread cp.async. The launch passes TMAParams: the tensor
	// maps of q, k and v, then Params. In a packed batch (Varlen) the maps
	// span every sequence's rows (TMATensor.Packed): a tile's rows past its
	// sequence are the next sequence's, which the kernel masks (keys) or
	// never stores (queries).
	TMA bool
	// Flat reads q, k and v of head dims whose rows start only 2- or 4-byte
	// aligned in place, without staging copies (TMA only; fixed-length,
	// one query head per key head, each tensor's heads contiguous: head
	// stride = head dim). Their tensor maps run over the concatenated heads
	// of a position (extent H·D); head h's tile starts at column h·D
	// rounded down to a multiple of 8 (16 bytes, which the accelerator
	// needs), so the tile holds the head shifted right by s = h·D mod 8
	// columns, its neighbours' elements around it. The kernel zeroes Q's
	// columns outside [s, s + DK), which makes S exact whatever K holds
	// there, and stores O's columns from s on. The padded head dims leave
	// room for every head's shift (FlatStagedHeads is 0: 7 columns, FlatFits,
	// hold any shift; D = 60 has only the shifts 0 and 4), unless
	// FlatStaged.
	Flat bool
	// FlatStaged, with Flat, reads the heads whose shift would run past
	// the padded width (FlatStagedHeads; h·D mod 8 + D > FlatWidth(D)) from
	// staging copies instead: the launch passes three more tensor maps, of
	// q, k and v copies that hold only those heads, in order, zero past the
	// head dim (the pack kernel's HeadMask). The other heads are read in
	// place. For head dims with fewer than 7 padding columns where most
	// heads fit (59, 123, 187: six in eight), only the copies of the rest
	// are made. The launch may start before the pack kernel that makes
	// them has finished (cuda.Device.LaunchEarly): the blocks of staged
	// heads wait for it (griddepcontrol.wait), the others do not.
	FlatStaged bool
	// Pipeline selects the Hopper forward's pipeline (fwd_sm90_ws.go).
	Pipeline
	// BiasStaged (WGMMA, WarpSpecialized, WarpsN = 1, a 16-bit bias whose
	// keys are contiguous and whose rows, like its start, are 16-byte
	// aligned, its rows not broadcast: the host checks) has the producer
	// load each key block's bias tile into shared memory by a tensor map
	// after the block's K tile, and the softmax read it from there, instead
	// of loading every element from global memory while the block's S
	// product runs (fwd_sm90_bias.go; the launch passes the bias's map last,
	// TMAMapNames).
	BiasStaged bool
	// LightTail (with a mask, not Persistent) orders the launch's CTAs so
	// that it ends on its lightest query blocks: the backward's cta_order
	// (cta_order.go) over the grid's (query blocks, heads, batch), the
	// query blocks last first.
	LightTail bool
}

// Pipeline is the schedule of a Hopper (WGMMA) forward kernel beyond its
// tiles. The zero value is the lockstep pipeline: every warp loads, and a
// block-wide barrier guards the reuse of each buffer.
type Pipeline struct {
	// WarpSpecialized runs a TMA kernel on a warp-specialized pipeline
	// (fwd_sm90_ws.go): a producer warpgroup more, whose one thread issues
	// every tile load, lowers its register budget (setmaxnreg) for the
	// consumer warpgroups to raise theirs, and each K and V buffer has an
	// "empty" mbarrier besides its "full" one, on which the consumers
	// release it, so that no block-wide barrier remains in the main loop.
	// WarpsN = 1 only.
	WarpSpecialized bool
	// PingPong orders the two compute warpgroups of a warp-specialized
	// kernel (BlockM = 128) with named barriers so that they take turns on
	// the tensor cores: one issues its products while the other runs its
	// softmax (fwd_sm90_ws.go).
	PingPong bool
	// EarlyRescale rescales O by the last softmax's factors while S = Q·Kᵀ
	// of the next block runs, just before O += P·V is issued, instead of
	// after that product completes (WGMMA, WarpsN = 1, padded DV at most
	// 256).
	EarlyRescale bool
	// Persistent launches one CTA per multiprocessor (at most) for a
	// warp-specialized kernel, each working through tiles until none is
	// left: numbered in sections of heads whose K and V fit in L2, taken
	// statically (blockIdx.x + k·gridDim.x) without a mask and from a
	// counter in global memory, heaviest first, under a window mask. The
	// producer loads the next tile's Q, K and V while the compute
	// warpgroups finish the last one (fwd_sm90_ws.go). The grid is
	// PersistentGrid. Not with Flat (its O goes through the shared tiles).
	Persistent bool
	// StoreO stores O by the tensor memory accelerator (fwd_epilogue.go):
	// each warpgroup writes its 64 rows of O into a staging tile of its own
	// in the map's swizzled layout, and one of its threads issues the bulk
	// tensor stores, which the copy engine completes while the warpgroup
	// goes on (with Persistent, into the next tile). A fourth tensor map,
	// o's, follows those of q, k and v; it clips the stores at the call's
	// head dim and length. WGMMA with TMA, WarpsN = 1, rows not read in
	// place, a fixed-length batch, and the variant's DV a multiple of 8.
	StoreO bool
	// EarlyDropout draws a key block's dropout keep bits between issuing
	// S = Q·Kᵀ and waiting for it, while the tensor cores run, instead of
	// after the softmax (fwd_sm90.go); the softmax then only applies them.
	// WGMMA with Dropout. The mask is the same bit for bit.
	EarlyDropout bool
	// ProducerDropout has the producer warpgroup's three idle warps draw
	// each key block's dropout keep bits into shared memory, two stages
	// deep, for the compute warps to read while S = Q·Kᵀ runs
	// (fwd_sm90_dropout_producer.go): the compute warps run no Philox.
	// Warp-specialized (one tile a CTA or persistent), one warpgroup per
	// row group, with Dropout; BlockN a multiple of 32. The mask is the
	// same bit for bit.
	ProducerDropout bool
	// LazyRescale keeps each row's reference maximum (the subtrahend of its
	// exponents) until a key block's maximum passes it by more than
	// lazyRescaleBits in base 2, as FlashAttention-4 does, instead of
	// moving it to every new maximum: a block's probabilities then reach at
	// most 2^lazyRescaleBits, O and the row sums are rescaled only in the
	// blocks that move a reference, and a warp none of whose rows moved one
	// skips the multiplies of O (fwd_softmax.go). WGMMA, one warpgroup per
	// row group, 16-bit element types.
	LazyRescale bool
	// HeadMajor numbers a persistent launch's tiles head by head, the query
	// blocks of a (batch element, head) pair together (under a window mask
	// the pair's heaviest first), instead of in L2 sections query block by
	// query block (fwd_sm90_ws.go): the CTAs that read a pair's K and V
	// then run at the same time. Persistent only.
	HeadMajor bool
	// DoubleQ gives a persistent CTA two Q buffers, used by its tiles in
	// turn, each with its own full and empty barrier and tile index
	// (fwd_sm90_ws.go): the producer loads the next tile's Q, and then its
	// first K and V, as soon as the tile before the current one released
	// its buffer, instead of after the current tile's last S. Persistent
	// only; not with a staged bias or the producer's dropout keep bits
	// (whose barriers and tile index take the places the second buffer's
	// do).
	DoubleQ bool
	// CarryTurns carries ping-pong's turns across a persistent CTA's
	// tiles (fwd_sm90_ws.go): warpgroup 1 gives warpgroup 0 the first turn
	// once, before the CTA's first tile, and passes the turn after its last
	// products of a tile too, so that warpgroup 0 issues the next tile's
	// first S while warpgroup 1 still writes the last tile's O. Persistent
	// with PingPong.
	CarryTurns bool
	// PolyExp is how many of every four 8-key column groups of a key block
	// take their probabilities' 2^x from ex2Poly, a cubic on the FMA and
	// integer pipes, instead of the MUFU's ex2 (0: none, at most 4), as
	// FlashAttention-4 does where the exponentials outrun the tensor cores
	// (fwd_softmax.go). WGMMA with a 16-bit element type.
	PolyExp int
}

// geom holds the quantities derived from a Variant that the generator uses.
type geom struct {
	esz      int // bytes per element of q, k, v
	dkp, dvp int // padded head dims
	mt       int // m16 tiles per warp
	warps    int
	threads  int
	ntS      int // n8 tiles of S per warp (keys per warp / 8)
	ntO      int // n8 tiles of O per warp (value columns per warp / 8)
	kch, vch int // 16-byte chunks per row of the Q/K and V tiles
	pch      int // 16-byte chunks per row of the P tile (WarpsN > 1)
	ksteps   int // k-steps of the QK product (32 bytes of DK each)
	psteps   int // k-steps of the PV product over the tile's keys
	sq, sk   int // shared bytes of the Q tile and of all K buffers
	sv, sp   int // shared bytes of all V buffers and of the P tile
	red      int // shared bytes of the row-statistics exchange (WarpsN > 1)
	so       int // shared bytes of the O staging tiles (StoreO)
	sb       int // shared bytes of the staged bias tiles (BiasStaged)
	skeep    int // shared bytes of the dropout keep stages (ProducerDropout)
	smem     int // total dynamic shared memory
	ka, va   int // WGMMA: 64-column swizzle atoms of a Q/K row and of a V row
}

func (v Variant) geom() geom {
	var g geom
	g.esz = v.DType.Size()
	wn := max(v.WarpsN, 1)
	g.dkp = padMMA(v.DK)
	g.dvp = fwdPadDV(v.DV, wn)
	g.warps = v.WarpsM * wn
	g.threads = 32 * g.warps
	if v.WarpsM > 0 {
		g.mt = v.BlockM / (16 * v.WarpsM)
	}
	g.ntS = v.BlockN / wn / 8
	g.ntO = g.dvp / wn / 8
	g.kch = g.dkp * g.esz / 16
	g.vch = g.dvp * g.esz / 16
	g.pch = v.BlockN * g.esz / 16
	g.ksteps = g.dkp * g.esz / 32
	if g.esz == 4 {
		g.psteps = v.BlockN / 8
	} else {
		g.psteps = v.BlockN / 16
	}
	// tiles have a pitch of one extra 16-byte chunk per row (see fwd_load.go)
	g.sq = v.BlockM * (g.kch + 1) * 16
	g.sk = v.Stages * v.BlockN * (g.kch + 1) * 16
	g.sv = v.Stages * v.BlockN * (g.vch + 1) * 16
	if wn > 1 {
		g.sp = v.BlockM * (g.pch + 1) * 16
		g.red = wn * v.BlockM * 4
	}
	g.smem = g.sq + g.sk + g.sv + g.sp + g.red
	if v.WGMMA {
		g.hopperGeom(v)
	}
	return g
}

// Threads returns the number of threads per CTA.
func (v Variant) Threads() int { return v.geom().threads }

// SharedBytes returns the dynamic shared memory one CTA needs.
func (v Variant) SharedBytes() int { return v.geom().smem }

// splitKeys reports whether the warps (warpgroups, in Hopper kernels) of a
// row group split each tile's keys, so that row statistics are exchanged
// through shared memory.
func (v Variant) splitKeys() bool { return v.WarpsN > 1 }

// warpIndexExpr returns the C++ expression of the thread's warp index in
// the Hopper forward: warpIndex, uniform to the compiler, except where the
// index computed per lane (tid >> 5) measured faster: with dropout or a
// softcap at padded head dims 65–128.
func (v Variant) warpIndexExpr() string {
	if d := hopperTileDim(v.DK, v.DV); (v.Dropout || v.Softcap) && d > 64 && d <= 128 {
		return "tid >> 5"
	}
	return warpIndex
}

// prescaled reports whether scores are scaled (into base-2 units, or
// natural ones: naturalScores) before the row maximum.
func (v Variant) prescaled() bool { return v.PreScale || v.Softcap || v.Bias != BiasNone }

// naturalScores reports whether v's prescaled scores stay in natural units,
// scale·s + bias (one multiply-add, where base-2 units take a multiply
// more for the bias's log2(e)), with log2(e) folded into the softmax's
// exponent instead: a bias without softcap.
func (v Variant) naturalScores() bool { return v.Bias != BiasNone && !v.Softcap }

// extras reports whether v has per-element extras on its scores (bias,
// softcap, dropout, prescaled scores), which take registers the plain
// tiles do not leave.
func (v Variant) extras() bool { return v.Bias != BiasNone || v.Softcap || v.Dropout || v.PreScale }

// Name returns a short unique name of the variant, usable in file names.
func (v Variant) Name() string {
	b := func(x bool) int {
		if x {
			return 1
		}
		return 0
	}
	kind := "fwd"
	if v.WGMMA {
		kind = "fwd90a"
	}
	return fmt.Sprintf("%s_%v_k%d_v%d_m%dn%d_w%dx%d_s%d_l%d_q%d_mask-%v_cap%d_ps%d_bias-%v_drop%d_var%d_lse%d_mb%d",
		kind, v.DType, v.DK, v.DV, v.BlockM, v.BlockN, v.WarpsM, v.WarpsN, v.Stages, v.LoadBytes, b(v.QInRegs),
		v.Mask, b(v.Softcap), b(v.PreScale), v.Bias, b(v.Dropout), b(v.Varlen), b(v.LSE), v.MinBlocks) + suffixIf(v.TMA, "_tma") + flatSuffix(v.Flat, v.FlatStaged) + wsSuffix(v.Pipeline) + suffixIf(v.BiasStaged, "_bs") + suffixIf(v.LightTail, "_lt")
}

// suffixIf returns the name suffix s of a variant part that is on, else "".
func suffixIf(on bool, s string) string {
	if on {
		return s
	}
	return ""
}

// flatSuffix is the name suffix of Flat (and FlatStaged) variants.
func flatSuffix(flat, staged bool) string {
	switch {
	case flat && staged:
		return "_flatstaged"
	case flat:
		return "_flat"
	}
	return ""
}

// wsSuffix is the name suffix of warp-specialized (ws), ping-pong (pp),
// early-rescale (er), persistent (pt), O-by-tensor-maps (so),
// early-dropout (ed), producer-dropout (pd), lazy-rescale (lr),
// head-major (hm), double-Q (q2), carried-turns (ct) and polynomial-exponential (peN) variants.
func wsSuffix(p Pipeline) string {
	return suffixIf(p.WarpSpecialized, "_ws") + suffixIf(p.PingPong, "_pp") + suffixIf(p.EarlyRescale, "_er") +
		suffixIf(p.Persistent, "_pt") + suffixIf(p.StoreO, "_so") + suffixIf(p.EarlyDropout, "_ed") + suffixIf(p.ProducerDropout, "_pd") + suffixIf(p.LazyRescale, "_lr") + suffixIf(p.HeadMajor, "_hm") + suffixIf(p.DoubleQ, "_q2") + suffixIf(p.CarryTurns, "_ct") + suffixIf(p.PolyExp > 0, fmt.Sprintf("_pe%d", p.PolyExp))
}

// String returns Name.
func (v Variant) String() string { return v.Name() }

// Validate reports whether the generator can write this variant. Fields out
// of their domain give errors wrapping attn.ErrShape (tile geometry) or
// attn.ErrOption (kinds, flags); valid but unhandled combinations give errors
// wrapping attn.ErrUnsupported.
func (v Variant) Validate() error {
	if !v.DType.Valid() {
		return attn.Errorf(attn.ErrOption, "kernels: dtype %d", int(v.DType))
	}
	if v.DK < 1 || v.DK > attn.MaxHeadDim || v.DV < 1 || v.DV > attn.MaxHeadDim {
		return attn.Errorf(attn.ErrShape, "kernels: head dims DK=%d DV=%d outside 1..%d", v.DK, v.DV, attn.MaxHeadDim)
	}
	if v.WarpsM < 1 || v.WarpsN < 1 || v.WarpsN > 2 {
		return attn.Errorf(attn.ErrShape, "kernels: warps %dx%d: want WarpsM ≥ 1, WarpsN 1 or 2", v.WarpsM, v.WarpsN)
	}
	if w := v.WarpsM * v.WarpsN; w > 16 {
		return attn.Errorf(attn.ErrShape, "kernels: %d warps, at most 16", w)
	}
	if v.BlockM <= 0 || v.BlockM%(16*v.WarpsM) != 0 || v.BlockM/(16*v.WarpsM) > 4 {
		return attn.Errorf(attn.ErrShape, "kernels: BlockM=%d must be 16·WarpsM·t with t in 1..4 (WarpsM=%d)", v.BlockM, v.WarpsM)
	}
	kq := 16 * v.WarpsN // keys of a tile per warp column group, in k16 steps
	if v.WGMMA {
		kq = 16 // (Hopper warpgroups split value columns, not keys)
	}
	if v.BlockN <= 0 || v.BlockN%kq != 0 || v.BlockN > 256 {
		return attn.Errorf(attn.ErrShape, "kernels: BlockN=%d must be a multiple of %d, at most 256", v.BlockN, kq)
	}
	if v.Stages != 1 && v.Stages != 2 {
		return attn.Errorf(attn.ErrShape, "kernels: Stages=%d, want 1 or 2", v.Stages)
	}
	switch v.LoadBytes {
	case 16, 8, 4:
	case 2:
		if v.DType == attn.Float32 {
			return attn.Errorf(attn.ErrShape, "kernels: 2-byte loads of fp32")
		}
		if v.Stages != 1 {
			return attn.Errorf(attn.ErrUnsupported, "kernels: register-staged (2-byte) loads with %d stages", v.Stages)
		}
	default:
		return attn.Errorf(attn.ErrShape, "kernels: LoadBytes=%d, want 16, 8, 4 or 2", v.LoadBytes)
	}
	if v.Mask > MaskWindow {
		return attn.Errorf(attn.ErrOption, "kernels: mask kind %d", v.Mask)
	}
	if v.Bias > BiasBF16 {
		return attn.Errorf(attn.ErrOption, "kernels: bias kind %d", v.Bias)
	}
	if v.Bias != BiasNone && v.Varlen {
		return attn.Errorf(attn.ErrUnsupported, "kernels: bias with packed variable-length batches")
	}
	if v.BiasStaged && (v.Bias != BiasBF16 && v.Bias != BiasF16 || !v.WGMMA || !v.WarpSpecialized || v.WarpsN != 1 || !biasStageRowsOK(v)) {
		return attn.Errorf(attn.ErrUnsupported, "kernels: a bias staged through shared memory needs a 16-bit bias, the warp-specialized WGMMA kernel with one warpgroup a row group and a key tile of a multiple of 64")
	}
	if v.MinBlocks < 1 || v.MinBlocks > 8 {
		return attn.Errorf(attn.ErrShape, "kernels: MinBlocks=%d outside 1..8", v.MinBlocks)
	}
	if v.TMA && !v.WGMMA {
		return attn.Errorf(attn.ErrUnsupported, "kernels: tensor-map loads without the WGMMA kernel")
	}
	if v.Flat && (!v.TMA || v.Varlen || v.BlockM*(v.geom().dvp+8)*2 > v.SharedBytes()-1024) {
		return attn.Errorf(attn.ErrUnsupported, "kernels: rows read in place (Flat) need tensor-map loads of a fixed-length batch and room to stage O")
	}
	if v.FlatStaged && !v.Flat {
		return attn.Errorf(attn.ErrUnsupported, "kernels: FlatStaged without Flat")
	}
	if v.WarpSpecialized && (!v.TMA || v.WarpsN != 1 || v.MinBlocks != 1) {
		return attn.Errorf(attn.ErrUnsupported, "kernels: a warp-specialized forward needs tensor-map loads, one warpgroup per row group and one CTA per SM (TMA %v, WarpsN %d, MinBlocks %d)", v.TMA, v.WarpsN, v.MinBlocks)
	}
	if v.LightTail && (v.Mask != MaskWindow || v.Persistent) {
		return attn.Errorf(attn.ErrUnsupported, "kernels: the light-tail CTA order needs a mask and a launch of one tile a CTA (Mask %v, Persistent %v)", v.Mask, v.Persistent)
	}
	if v.Persistent && (!v.WarpSpecialized || v.Flat || v.Varlen) {
		return attn.Errorf(attn.ErrUnsupported, "kernels: a persistent forward needs the warp-specialized pipeline, rows not read in place and a fixed-length batch (WarpSpecialized %v, Flat %v, Varlen %v)", v.WarpSpecialized, v.Flat, v.Varlen)
	}
	if v.StoreO && (!v.WGMMA || !v.TMA || v.WarpsN != 1 || v.Flat || v.Varlen || v.DV%8 != 0) {
		return attn.Errorf(attn.ErrUnsupported, "kernels: O stored by tensor maps needs the Hopper kernel with tensor-map loads, one warpgroup per row group, rows not read in place, a fixed-length batch and DV a multiple of 8 (TMA %v, WarpsN %d, Flat %v, Varlen %v, DV %d)", v.TMA, v.WarpsN, v.Flat, v.Varlen, v.DV)
	}
	if v.PingPong && (!v.WarpSpecialized || v.WarpsM != 8) {
		return attn.Errorf(attn.ErrUnsupported, "kernels: ping-pong needs a warp-specialized forward with two compute warpgroups (WarpSpecialized %v, WarpsM %d)", v.WarpSpecialized, v.WarpsM)
	}
	if v.EarlyDropout && (!v.WGMMA || !v.Dropout) {
		return attn.Errorf(attn.ErrUnsupported, "kernels: the early dropout bits need the WGMMA forward with dropout (WGMMA %v, Dropout %v)", v.WGMMA, v.Dropout)
	}
	if err := v.validateProducerDropout(); err != nil {
		return err
	}
	if v.HeadMajor && !v.Persistent {
		return attn.Errorf(attn.ErrUnsupported, "kernels: the head-major tile order needs persistent CTAs")
	}
	if v.DoubleQ && (!v.Persistent || v.BiasStaged || v.ProducerDropout) {
		return attn.Errorf(attn.ErrUnsupported, "kernels: two Q buffers need persistent CTAs without a staged bias or the producer's dropout keep bits (Persistent %v, BiasStaged %v, ProducerDropout %v)", v.Persistent, v.BiasStaged, v.ProducerDropout)
	}
	if v.CarryTurns && (!v.Persistent || !v.PingPong) {
		return attn.Errorf(attn.ErrUnsupported, "kernels: ping-pong's turns carried across tiles need persistent CTAs with ping-pong (Persistent %v, PingPong %v)", v.Persistent, v.PingPong)
	}
	if v.PolyExp < 0 || v.PolyExp > 4 || v.PolyExp > 0 && (!v.WGMMA || v.DType == attn.Float32) {
		return attn.Errorf(attn.ErrUnsupported, "kernels: the polynomial exponentials (%d of every 4 key groups) need 0..4 groups and the WGMMA forward with a 16-bit element type (WGMMA %v, %v)", v.PolyExp, v.WGMMA, v.DType)
	}
	if v.LazyRescale && (!v.WGMMA || v.WarpsN != 1 || v.DType == attn.Float32) {
		return attn.Errorf(attn.ErrUnsupported, "kernels: the lazy rescale needs the WGMMA forward with one warpgroup per row group and a 16-bit element type (WGMMA %v, WarpsN %d, %v)", v.WGMMA, v.WarpsN, v.DType)
	}
	if v.EarlyRescale && (!v.WGMMA || v.WarpsN != 1 || v.geom().dvp > 256) {
		// past 256 value columns O += P·V is two products, and ptxas serializes them around the rescale
		return attn.Errorf(attn.ErrUnsupported, "kernels: the early rescale of O needs the WGMMA forward with one warpgroup per row group and at most 256 value columns (one P·V product)")
	}
	if v.WGMMA {
		if err := v.validateHopper(); err != nil {
			return err
		}
	}
	if s := v.SharedBytes(); s > MaxSharedBytes {
		return attn.Errorf(attn.ErrUnsupported, "kernels: %s needs %d bytes of shared memory, more than %d", v.Name(), s, MaxSharedBytes)
	}
	return nil
}
