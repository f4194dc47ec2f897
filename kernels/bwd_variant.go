package kernels

import (
	"fmt"
	"strings"

	"github.com/flashattn/flashattn/attn"
)

// Names of the backward kernels: every backward module defines the first
// five, Staged ones BwdPackKernel too (BwdKernelNames).
const (
	// BwdPreKernel computes Delta = rowsum(dO∘O), the base-2 LSE and, for the
	// atomic dQ algorithm, zeroes the fp32 dQ accumulator.
	BwdPreKernel = "fa_bwd_pre"
	// BwdDKDVKernel computes dK and dV (and, with AtomicDQ, adds dQ into the
	// fp32 accumulator and, with BiasGrad, writes dS to the dBias scratch).
	BwdDKDVKernel = "fa_bwd_dkdv"
	// BwdDQKernel computes dQ without atomics (the separate algorithm).
	BwdDQKernel = "fa_bwd_dq"
	// BwdDQConvertKernel scales the fp32 dQ accumulator and stores dQ.
	BwdDQConvertKernel = "fa_bwd_dq_convert"
	// BwdDBiasKernel reduces the dBias scratch over the bias's broadcast
	// dimensions in a fixed order and stores dBias.
	BwdDBiasKernel = "fa_bwd_dbias"
	// BwdPackKernel copies q, k, v and dO into the padded staging buffers
	// of a Staged variant (grid ceil(max(N, M)/BwdPreRows) × B × H).
	BwdPackKernel = "fa_bwd_pack"
)

// BwdKernelNames returns the names of the kernels v's module defines: the
// six of every variant, and BwdPackKernel for Staged ones.
func BwdKernelNames(v BwdVariant) []string {
	names := []string{BwdPreKernel, BwdDKDVKernel, BwdDQKernel, BwdDQConvertKernel, BwdDBiasKernel, BwdNonFiniteKernel}
	if v.Staged {
		names = append(names, BwdPackKernel)
	}
	return names
}

// BwdPreRows is the number of query rows one block of the preprocess and
// convert kernels handles (grid x = ceil(N / BwdPreRows)).
const BwdPreRows = 16

// BwdPreThreads is the block size of the preprocess and convert kernels.
const BwdPreThreads = 128

// BwdDBiasThreads is the block size of the dBias reduction kernel.
const BwdDBiasThreads = 256

// BwdVariant selects one specialisation of the backward kernels. The
// generated source is a pure function of it.
type BwdVariant struct {
	// DType is the storage type of q, k, v, o, dO and the gradients.
	DType attn.DType
	// DK and DV are the head dimensions (1..512).
	DK, DV int
	// Features: mask, softcap, bias (its element type also dBias's),
	// dropout, varlen.
	Features
	// BiasGrad asks for dBias (requires Bias).
	BiasGrad bool
	// DBiasPath (with BiasGrad) is how the dK/dV kernel hands each dS
	// element to dBias: through the scratch and a fixed-order reduction
	// (the zero value), by atomic adds, stored directly, by bulk
	// reduce-adds of tiles, stored by tensor maps, or added into dBias by
	// tensor-map reduce-adds (DBiasPath's constants).
	DBiasPath DBiasPath
	// AtomicDQ makes the dK/dV kernel accumulate dQ with fp32 atomic adds
	// (then BwdDQConvertKernel finishes dQ); otherwise BwdDQKernel computes it.
	AtomicDQ bool
	// Vector is set when every row of q, k, v, o and dO starts on a 16-byte
	// boundary and DK and DV are multiples of 8 elements (16 bytes for fp32:
	// multiples of 4), so tiles move with 16-byte asynchronous copies.
	Vector bool
	// Staged is set when the head dims are not multiples of 16 bytes (odd
	// head dims): BwdPackKernel first copies q, k, v and dO into workspace
	// buffers whose rows hold BwdStagedDim elements (zero beyond DK or DV),
	// and the main kernels read those with 16-byte asynchronous copies. The
	// gradients are still stored element by element. Excludes Vector.
	Staged bool
	// Flat has the Hopper kernels read q, k, v and dO of such head dims in
	// place, as the forward's Variant.Flat does: tensor maps over a
	// position's concatenated heads for the streamed tiles, 16-byte copies
	// from flat_shift columns before the head's start (a multiple of 16
	// elements where the head fits after it, else of 8) for the tiles loaded
	// once, those tiles' columns outside the shifted head zeroed (which
	// makes S and dP exact), and every gradient stored from its shift (the
	// atomic dQ accumulator keeps K's shifted columns; the conversion
	// reads them back). Needs WGMMA, TMA, a fixed-length batch, one query
	// head per key head, heads contiguous in each tensor, and room for the
	// shift (FlatFits). Excludes Vector and Staged.
	Flat bool
	// Tiles overrides the default tile shapes when its fields are non-zero.
	Tiles BwdTiles
	// WGMMA selects the Hopper dK/dV and dQ kernels (sm_90a; see
	// bwd_dkdv_sm90.go, bwd_dq_sm90.go and BwdHopperOK for what they
	// take). The module then runs only on sm_90.
	WGMMA bool
	// TMA (with WGMMA) loads the streamed tiles of
	// the Hopper kernels with the tensor memory accelerator: q and dO in the
	// dK/dV kernel, k and v in the dQ kernel. Those two kernels then take
	// the argument of BwdTMAArgs (see bwd_tma.go). In a packed batch the
	// maps span every sequence's rows (TMATensor.Packed): a tile's rows past
	// its sequence are the next sequence's, which the kernels mask (keys)
	// or give no probability (queries).
	TMA bool
	// BulkDQ (with WGMMA and AtomicDQ, head dims up to 128, not Flat) adds
	// each step's dQ tile to the fp32 accumulator with bulk reduce-adds
	// (cp.reduce.async.bulk .add.f32, one per row of the tile, from shared
	// memory) instead of vector atomics from registers: the tile goes to
	// shared memory and one lane of each quad issues its two rows, which
	// the copy engine adds while the warpgroup goes on.
	BulkDQ bool
	// WarpSpecialized (with WGMMA and TMA) runs the Hopper dK/dV and dQ
	// kernels on a warp-specialized pipeline (bwd_sm90_ws.go): a producer
	// warp loads every step's streamed tiles (q, dO, LSE2 and Delta; k and
	// v) against full and empty mbarriers per stage, and the two compute
	// warpgroups, with the producer's registers (setmaxnreg), meet only
	// where one reads what the other wrote.
	WarpSpecialized bool
	// KeyRows (with WarpSpecialized and padded head dims up to 128:
	// KeyRowsOK) computes S and dP in the dK/dV kernel
	// transposed, keys as rows, so that P and dS feed the dV and dK
	// products from registers instead of through shared memory
	// (bwd_sm90_keyrows.go).
	KeyRows bool
	// QueryStep is the number of queries a step of the Hopper dK/dV
	// kernel takes: 0 for the default (64); 80 with KeyRows and the
	// separate dQ or the atomic one by bulk reduce-adds (QueryStepOK),
	// FlashAttention-3's step at head dim 128, whose S and dP products are
	// 80 queries wide, whose dV and dK products take five k16 steps
	// instead of four, and whose atomic dQ is computed transposed (dQᵀ =
	// Kᵀ·dSᵀ: a warpgroup product has 64 rows).
	QueryStep int
	// BiasStaged (with KeyRows, a 16-bit bias whose keys are contiguous
	// and whose rows, like its start, are 16-byte aligned: the host checks;
	// fixed length) has the producer load each step's [BM][BN] bias tile
	// by a tensor map into a shared stage beside q and dO, and the key-rows
	// step read its elements there instead of from global memory
	// (bwd_sm90_bias.go; the launch passes the bias's map, BiasTMATensor).
	BiasStaged bool
	// LightTail (with a mask) orders the launch's CTAs so that it ends on
	// its lightest blocks (cta_order, kernels/cta_order.go): the blocks of one
	// (batch, head) pair after another, heaviest first, as without it, but
	// the last pairs' blocks, about three waves of CTAs, block by block
	// across those pairs — where a masked launch otherwise ends on its last
	// pair's heaviest blocks while the other SMs run dry.
	LightTail bool
	// Persistent (with the key-rows step, 16-byte loads, no bias, rows
	// not read in place and a fixed-length batch: PersistentOK) launches
	// the dK/dV kernel with one CTA per multiprocessor (at most,
	// PersistentGrid), the CTAs taking the launch's key tiles from a
	// counter as they free up, in the grid's order (LightTail's order
	// under it): the producer loads the next tile's K and V (by the dQ
	// kernel's tensor maps) and its first q and dO while the compute
	// warpgroups store the last tile's dK and dV (bwd_sm90_persistent.go).
	Persistent bool
	// ProducerDropout (the warp-specialized key-rows dK/dV kernel under
	// dropout, one tile a CTA) has the producer warpgroup's three idle
	// warps draw each step's dropout keep bits into the step's stage, for
	// the compute warps to read instead of drawing them
	// (bwd_sm90_dropout_producer.go). The mask is the same bit for bit.
	ProducerDropout bool
}

// BwdTile is the shape of one backward kernel's thread block.
type BwdTile struct {
	// BlockM query rows and BlockN keys per tile.
	BlockM, BlockN int
	// Warps per block.
	Warps int
	// Stages of the streamed operand (1: no prefetch, 2: double buffer).
	Stages int
	// MinBlocks is the occupancy asked of the compiler (__launch_bounds__).
	MinBlocks int
}

// BwdTiles are the tiles of the dK/dV and dQ kernels.
type BwdTiles struct {
	DKDV, DQ BwdTile
}

// elem returns the storage size in bytes of the variant's dtype.
func (v BwdVariant) elem() int { return v.DType.Size() }

// DKPad returns DK as padded inside the kernels (see bwdPadDim; the Hopper
// kernels, whose warpgroup products take any multiple of 16, pad to 16).
func (v BwdVariant) DKPad() int { return v.padDim(v.DK) }

// DVPad returns DV as padded inside the kernels (see DKPad).
func (v BwdVariant) DVPad() int { return v.padDim(v.DV) }

// padDim returns head dim d as padded inside v's kernels.
func (v BwdVariant) padDim(d int) int {
	if v.WGMMA {
		return padMMA(d)
	}
	return bwdPadDim(d)
}

// ResolvedTiles returns the tiles the variant's kernels use: Tiles where
// set, the default table otherwise.
func (v BwdVariant) ResolvedTiles() BwdTiles {
	t := defaultBwdTiles(v.DType, v.DKPad(), v.DVPad())
	if v.WGMMA {
		t.DKDV, t.DQ = v.bwdHopperTile(), v.bwdHopperDQTile()
		if v.bwdHopperDeep() {
			t.DKDV, t.DQ = v.bwdDeepTile(true), v.bwdDeepTile(false)
		}
	}
	if v.Tiles.DKDV.BlockM != 0 {
		t.DKDV = v.Tiles.DKDV
	}
	if v.Tiles.DQ.BlockM != 0 {
		t.DQ = v.Tiles.DQ
	}
	return t
}

// padRow returns the padded row length in elements of a shared-memory
// tile of cols columns: one 16-byte chunk more, which keeps 16-byte
// alignment and spreads the rows of ldmatrix / scalar reads over all banks.
func (v BwdVariant) padRow(cols int) int { return cols + 16/v.elem() }

// DKDVSharedBytes returns the dynamic shared memory of the dK/dV kernel.
func (v BwdVariant) DKDVSharedBytes() int {
	l, _ := v.layouts()
	return l.total
}

// DQSharedBytes returns the dynamic shared memory of the dQ kernel.
func (v BwdVariant) DQSharedBytes() int {
	_, l := v.layouts()
	return l.total
}

// layouts returns the shared-memory maps of the dK/dV and dQ kernels.
func (v BwdVariant) layouts() (dkdv, dq bwdSmemLayout) {
	if v.WGMMA && v.bwdHopperDeep() {
		return v.bwdDeepLayout(true), v.bwdDeepLayout(false)
	}
	if v.WGMMA {
		return v.bwdHopperLayout(), v.bwdHopperDQLayout()
	}
	t := v.ResolvedTiles()
	return v.dkdvLayout(t.DKDV), v.dqLayout(t.DQ)
}

// bwdSmemLayout is the byte offsets of the shared-memory tiles of a kernel.
type bwdSmemLayout struct {
	off   map[string]int
	total int // every byte the kernel asks for: the tiles, and slack if any
	slack int // bytes past the tiles the kernel may skip to align its base (alignSlack)
	order []string
}

// alignSlack ends the map of a Hopper backward kernel, whose tiles start
// on the swizzle's 1024-byte period from a base the kernel aligns: it
// reserves the 1024 bytes the aligning may skip, unless they alone would
// carry the map past MaxSharedBytes. Then the kernel uses its base as it
// comes and traps unless it lies on the period (hopperPreamble), as
// dynamic shared memory does on sm_90: it starts 1024 bytes into the
// block's window, after the bytes the system reserves.
func (l *bwdSmemLayout) alignSlack() {
	if l.total+swizzlePeriod <= MaxSharedBytes {
		l.slack = swizzlePeriod
		l.total += l.slack
	}
}

// swizzlePeriod is the bytes after which the 128-byte swizzle repeats: the
// alignment of every swizzled tile, and the most a kernel skips to align
// its base.
const swizzlePeriod = 1024

// withSlack returns the bytes of the map with the aligning slack whether
// or not alignSlack reserved it: what a choice between a larger map and a
// smaller one (two stages or one, two buffers or one) compares with
// MaxSharedBytes, so that only a map with no smaller choice goes without
// its slack.
func (l bwdSmemLayout) withSlack() int { return l.tileBytes() + swizzlePeriod }

// tileBytes returns the bytes of the map's tiles, without the slack.
func (l bwdSmemLayout) tileBytes() int { return l.total - l.slack }

func (l *bwdSmemLayout) add(name string, bytes int) {
	if l.off == nil {
		l.off = map[string]int{}
	}
	l.off[name] = l.total
	l.order = append(l.order, name)
	l.total += (bytes + 15) / 16 * 16
}

func (v BwdVariant) dkdvLayout(t BwdTile) bwdSmemLayout {
	e := v.elem()
	dkp, dvp := v.DKPad(), v.DVPad()
	var l bwdSmemLayout
	l.add("sK", t.BlockN*v.padRow(dkp)*e)
	l.add("sV", t.BlockN*v.padRow(dvp)*e)
	l.add("sQ", t.Stages*t.BlockM*v.padRow(dkp)*e)
	l.add("sdO", t.Stages*t.BlockM*v.padRow(dvp)*e)
	l.add("sP", t.BlockM*v.padRow(t.BlockN)*e)
	l.add("sdS", t.BlockM*v.padRow(t.BlockN)*e)
	l.add("sL", t.Stages*t.BlockM*4)
	l.add("sD", t.Stages*t.BlockM*4)
	return l
}

func (v BwdVariant) dqLayout(t BwdTile) bwdSmemLayout {
	e := v.elem()
	dkp, dvp := v.DKPad(), v.DVPad()
	var l bwdSmemLayout
	l.add("sQ", t.BlockM*v.padRow(dkp)*e)
	l.add("sdO", t.BlockM*v.padRow(dvp)*e)
	l.add("sK", t.Stages*t.BlockN*v.padRow(dkp)*e)
	l.add("sV", t.Stages*t.BlockN*v.padRow(dvp)*e)
	l.add("sdS", t.BlockM*v.padRow(t.BlockN)*e)
	l.add("sL", t.BlockM*4)
	l.add("sD", t.BlockM*4)
	return l
}

// Validate reports whether the variant can be generated: dtypes, head
// dimensions, feature combinations, tile shapes and shared memory.
func (v BwdVariant) Validate() error {
	if !v.DType.Valid() {
		return attn.Errorf(attn.ErrDType, "backward variant: dtype %d", int(v.DType))
	}
	if v.DK < 1 || v.DK > attn.MaxHeadDim || v.DV < 1 || v.DV > attn.MaxHeadDim {
		return attn.Errorf(attn.ErrShape, "backward variant: head dims DK=%d DV=%d outside 1..%d", v.DK, v.DV, attn.MaxHeadDim)
	}
	if v.Mask > MaskWindow {
		return attn.Errorf(attn.ErrOption, "backward variant: mask kind %d", v.Mask)
	}
	if v.Bias > BiasBF16 {
		return attn.Errorf(attn.ErrDType, "backward variant: bias kind %d", v.Bias)
	}
	if v.BiasGrad && !v.Biased() {
		return attn.Errorf(attn.ErrOption, "backward variant: BiasGrad without Bias")
	}
	if v.Biased() && v.Varlen {
		return attn.Errorf(attn.ErrUnsupported, "backward variant: bias with a packed variable-length batch")
	}
	if v.DBiasPath > DBiasReduce {
		return attn.Errorf(attn.ErrOption, "backward variant: dBias path %d", v.DBiasPath)
	}
	if v.DBiasPath != DBiasScratch && (!v.BiasGrad || v.Varlen) {
		return attn.Errorf(attn.ErrOption, "backward variant: dBias %v needs BiasGrad and a fixed-length batch", v.DBiasPath)
	}
	if v.Vector && BwdNeedsStaging(v.DType, v.DK, v.DV) {
		return attn.Errorf(attn.ErrLayout, "backward variant: Vector needs DK=%d and DV=%d multiples of %d", v.DK, v.DV, 16/v.elem())
	}
	if v.Vector && v.Staged {
		return attn.Errorf(attn.ErrOption, "backward variant: Vector and Staged are exclusive")
	}
	if v.Flat && (v.Vector || v.Staged || !v.WGMMA || !v.TMA || v.Varlen || !FlatFits(v.DK, v.DV)) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: rows read in place (Flat) need the Hopper kernels with tensor maps, a fixed-length batch and room for the shift, without Vector or Staged", v.Name())
	}
	if v.WGMMA && !BwdHopperOK(v) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: the Hopper kernels want 16-bit elements, 16-byte loads, padded head dims both at most 128, both 129..256 or both 257..512, and no tile override", v.Name())
	}
	if v.WGMMA && v.bwdHopperDeep() && (v.AtomicDQ || v.Flat || v.WarpSpecialized) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: the Hopper kernels past head dim 256 take the separate dQ, rows not read in place and the lockstep pipeline", v.Name())
	}
	if v.BulkDQ && (!v.WGMMA || !v.AtomicDQ || v.Flat || v.bwdHopperWide()) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: bulk reduce-adds of dQ need the Hopper kernels with the atomic dQ, padded head dims up to 128 and rows not read in place", v.Name())
	}
	if v.WarpSpecialized && (!v.WGMMA || !v.TMA) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: the warp-specialized dK/dV kernel needs the Hopper kernels with tensor-map loads", v.Name())
	}
	if v.KeyRows && !KeyRowsOK(v) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: keys as rows need the warp-specialized Hopper kernels, padded head dims up to 128, and the separate dQ unless the warpgroups split the atomic one's columns or rows (KeyRowsOK)", v.Name())
	}
	if v.BiasStaged && !bwdBiasStageOK(v) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: a bias staged through shared memory needs the key-rows step, a 16-bit bias and a fixed-length batch", v.Name())
	}
	if v.DBiasPath == DBiasTiles && !DBiasTilesOK(v) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: dBias by tiles needs the key-rows step with the tiled dQ accumulator at padded DK 128 and steps of 64 queries (DBiasTilesOK)", v.Name())
	}
	if v.DBiasPath == DBiasStore && !DBiasStoreOK(v) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: dBias by tensor-map stores needs the key-rows step with the atomic dQ, a staged bias of the inputs' element type and no softcap (DBiasStoreOK)", v.Name())
	}
	if v.DBiasPath == DBiasReduce && !DBiasReduceOK(v) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: dBias by tensor-map reduce-adds needs the key-rows step with the atomic dQ, a staged bias of the inputs' element type and no softcap (DBiasReduceOK)", v.Name())
	}
	if v.LightTail && !v.Masked() {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: the light-tail CTA order needs a mask (unmasked blocks all weigh the same)", v.Name())
	}
	if v.Persistent && !PersistentOK(v) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: a persistent dK/dV kernel needs the key-rows step (not over 80 queries), 16-byte loads, no bias, rows not read in place and a fixed-length batch (PersistentOK)", v.Name())
	}
	if v.ProducerDropout && !bwdProducerDropoutOK(v) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: the producer's dropout keep bits need the warp-specialized key-rows dK/dV kernel under dropout, one tile a CTA", v.Name())
	}
	if !QueryStepOK(v) {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: a step of %d queries is 0 (the default, 64), 80 with the key-rows step and the separate dQ or the atomic one by bulk reduce-adds, or 128 with the key-rows step at padded head dims up to 64", v.Name(), v.QueryStep)
	}
	if v.TMA && !v.WGMMA {
		return attn.Errorf(attn.ErrUnsupported, "backward variant %s: tensor-map loads need the Hopper kernels", v.Name())
	}
	t := v.ResolvedTiles()
	dkdvLayout, dqLayout := v.layouts()
	for _, x := range []struct {
		name string
		t    BwdTile
		l    bwdSmemLayout
	}{{"dkdv", t.DKDV, dkdvLayout}, {"dq", t.DQ, dqLayout}} {
		tt := x.t
		if tt.BlockM <= 0 || tt.BlockN <= 0 || tt.BlockM%16 != 0 || tt.BlockN%16 != 0 {
			return attn.Errorf(attn.ErrUnsupported, "backward %s tile %dx%d: sides must be positive multiples of 16", x.name, tt.BlockM, tt.BlockN)
		}
		if tt.Warps <= 0 || tt.Warps > 16 || tt.Stages < 1 || tt.Stages > 2 || tt.MinBlocks < 1 {
			return attn.Errorf(attn.ErrUnsupported, "backward %s tile: %d warps, %d stages, %d min blocks", x.name, tt.Warps, tt.Stages, tt.MinBlocks)
		}
		if x.l.total > MaxSharedBytes {
			return attn.Errorf(attn.ErrUnsupported, "backward %s kernel needs %d bytes of shared memory (DK=%d DV=%d %v), limit %d",
				x.name, x.l.total, v.DK, v.DV, v.DType, MaxSharedBytes)
		}
	}
	for _, pr := range v.products() {
		if _, _, err := bwdWarpGrid(pr.M, pr.N, pr.warps); err != nil {
			return attn.Errorf(attn.ErrUnsupported, "backward product %s: %v", pr.name, err)
		}
	}
	return nil
}

// Name returns a short unique name of the variant, usable as a cache key,
// label or file name.
func (v BwdVariant) Name() string {
	var b strings.Builder
	fmt.Fprintf(&b, "bwd_%v_dk%d_dv%d", v.DType, v.DK, v.DV)
	flags := []struct {
		on   bool
		name string
	}{{v.Masked(), "mask"}, {v.Softcap, "cap"}, {v.Biased(), "bias" + v.Bias.DType().String()}, {v.BiasGrad, "dbias"}, {v.DBiasPath == DBiasAtomic, "dbadd"}, {v.DBiasPath == DBiasDirect, "dbdirect"}, {v.DBiasPath == DBiasTiles, "dbtiles"}, {v.DBiasPath == DBiasStore, "dbstore"}, {v.DBiasPath == DBiasReduce, "dbred"},
		{v.Dropout, "drop"}, {v.Varlen, "varlen"}, {v.AtomicDQ, "atomic"}, {v.Vector, "vec"}, {v.Staged, "staged"}, {v.Flat, "flat"}, {v.WGMMA, "sm90a"}, {v.TMA, "tma"}, {v.BulkDQ, "bulkdq"}, {v.WarpSpecialized, "ws"}, {v.KeyRows, "keyrows"}, {v.BiasStaged, "bs"}, {v.LightTail, "lt"}, {v.Persistent, "pers"}, {v.ProducerDropout, "pd"}}
	for _, f := range flags {
		if f.on {
			b.WriteString("_" + f.name)
		}
	}
	t := v.ResolvedTiles()
	fmt.Fprintf(&b, "_t%dx%dw%ds%d_q%dx%dw%ds%d", t.DKDV.BlockM, t.DKDV.BlockN, t.DKDV.Warps, t.DKDV.Stages,
		t.DQ.BlockM, t.DQ.BlockN, t.DQ.Warps, t.DQ.Stages)
	return b.String()
}

// String returns Name.
func (v BwdVariant) String() string { return v.Name() }

// Source returns the CUDA C++ source of the backward kernels of v
// (BwdKernelNames), each taking one BwdParams argument by value. It fails
// with attn.ErrUnsupported (or another sentinel) when v cannot be
// generated.
func (v BwdVariant) Source() (string, error) {
	if err := v.Validate(); err != nil {
		return "", err
	}
	g := newBwdGen(v)
	return g.source(), nil
}
