package kernels

import (
	"fmt"
	"strings"
)

// The Hopper backward kernels (BwdVariant.WGMMA, sm_90a): the dK/dV kernel
// here, the separate dQ kernel in bwd_dq_sm90.go, what both share in
// bwd_sm90.go, their warp-specialized pipeline in bwd_sm90_ws.go.
//
// The dK/dV kernel.
//
// A block owns BN keys of one (batch, key head) and two warpgroups. For
// every query head of the group and every query block of BM = 64 rows that
// sees the keys:
//
//	S  = Q·Kᵀ, dP = dO·Vᵀ     warpgroup w: the 64 queries × keys
//	                          w·BN/2 .. (w+1)·BN/2 − 1 (both operands from
//	                          shared memory, K-major); committed apart, so
//	                          that P is computed while dP still runs
//	P, dS                      the mma.sync kernel's element-wise code
//	                          (masks, softcap, bias, dropout), written to
//	                          shared memory in the swizzled layout
//	dV += Pᵀ·dO, dK += dSᵀ·Q   Pᵀ and dSᵀ read transposed from shared memory
//	dQ += dS·K (AtomicDQ)      the block's dS over all BN keys times K, added
//	                          to the fp32 accumulator with vector atomics
//
// Two ways to share dK and dV (fp32 registers, the largest state) between
// the warpgroups:
//
//   - head dims up to 128: BN = 128, warpgroup w owns keys 64w .. 64w+63 and
//     all their columns; dQ is split by columns when DK is 128 (one
//     warpgroup computes it otherwise);
//   - head dims 129 to 256: BN = 64, each warpgroup owns all 64 keys and
//     a share of the columns. With equal padded dims (DKP = DVP) the shares
//     cross: warpgroup 0 holds dV's first 128 columns and dK's rest,
//     warpgroup 1 dK's first 128 and dV's rest, so both run one 128-column
//     and one (DKP − 128)-column product of the same shapes and no column
//     past the head dim is computed. Otherwise warpgroup w owns columns
//     128w .. 128w+127 of dK and dV (the last warpgroup's columns past the
//     head dim computed and never stored). The atomic dQ is split
//     128 + 128 either way.
//
// Every product is a warpgroup instruction (wgmma.mma_async); dK and dV
// stay in registers for the whole loop. Tiles in shared memory use the
// forward's 128-byte swizzle (see fwd_sm90.go): rows of 64 elements, 16-byte
// chunk c of row r at chunk c ^ (r mod 8), wider rows as several such atoms.

// bwdHopperBM is the number of query rows per step of the Hopper kernel
// unless the variant sets another (BwdVariant.QueryStep).
const bwdHopperBM = 64

// QueryStepOK reports whether v's QueryStep is one its Hopper dK/dV kernel
// takes: the default (0); 80 on the key-rows step with the separate dQ
// or the atomic one by bulk reduce-adds, which then computes dQ
// transposed (bwdDQTransposed; the vector atomics add pairs of
// consecutive columns, which the transposed product does not hold); or
// 128 on the key-rows step at padded head dims up to 64, FlashAttention-3's
// step there, whose atomic dQ each warpgroup computes for half of the
// step's queries (bwdDQRowHalves), except under dropout with a softcap or a
// bias, whose registers beside the keep bits spill the step's
// (docs/kernels/backward.md, "Dropout in the key-rows step").
func QueryStepOK(v BwdVariant) bool {
	switch v.QueryStep {
	case 0:
		return true
	case 80:
		return v.KeyRows && (!v.AtomicDQ || v.BulkDQ)
	case 128:
		return v.KeyRows && v.DKPad() <= 64 && v.DVPad() <= 64 && !(v.Dropout && (v.Softcap || v.Bias != BiasNone))
	}
	return false
}

// bwdDQRowHalves reports whether v's dK/dV kernel splits the atomic dQ's
// rows over the warpgroups: on a step of 128 queries (at padded head dims
// up to 64) warpgroup w computes dQ of the step's queries 64w .. 64w+63,
// every column, over the block's BN keys.
func (v BwdVariant) bwdDQRowHalves() bool {
	return v.AtomicDQ && v.bwdHopperTile().BlockM == 128
}

// DQAccTiled reports whether v's fp32 dQ accumulator is tiled: a Hopper
// dK/dV kernel adding a fixed-length batch's dQ by bulk reduce-adds, by
// query rows (not transposed), at padded DK 128 (the warpgroups split dQ's
// columns) or 64 (warpgroup 0 computes them). Each warpgroup's 64 × 64 tile
// of a step is then one contiguous 16 KB block of the accumulator
// (BwdDQTileFloats), added by one bulk reduce-add, where rows of the row
// layout need one each. The accumulator of batch b, head h holds blocks of
// BwdDQTileRows query rows, each DKP/64 such tiles (columns 0..63, 64..127),
// rows of 64 floats whose 8-float chunks are swizzled by the row (chunk c
// of row r at c ^ (r mod 8), so that a warp's paired stores into the shared
// tile fall on distinct banks); dqa_sh is a head's floats, dqa_sb a batch
// element's, dqa_sr unused (BwdDQAccTiledStrides). The pre kernel zeroes it
// and the convert kernel reads it in that order.
func (v BwdVariant) DQAccTiled() bool {
	return v.BulkDQ && v.WGMMA && !v.Varlen && !v.bwdDQTransposed() && BwdDQAccTiledCols(v.DK) > 0
}

// dqAccTiles returns the tiles of a block of v's tiled dQ accumulator.
func (v BwdVariant) dqAccTiles() int { return BwdDQAccTiledCols(v.DK) / 64 }

// BwdDQTileRows is the query rows of a block of the tiled dQ accumulator
// (BwdVariant.DQAccTiled), BwdDQTileFloats the floats of one of its tiles.
const (
	BwdDQTileRows   = bwdHopperBM
	BwdDQTileFloats = BwdDQTileRows * 64
)

// BwdDQAccTiledCols returns the columns of the tiled dQ accumulator of
// head dim dk (BwdVariant.DQAccTiled), 64 or 128, or 0 where the padded
// head dim takes the row layout.
func BwdDQAccTiledCols(dk int) int {
	switch p := padMMA(dk); p {
	case 64, 128:
		return p
	}
	return 0
}

// BwdDQAccTiledStrides returns the batch and head strides, in floats, of
// the tiled dQ accumulator of n queries, h heads and cols columns
// (BwdDQAccTiledCols): blocks of BwdDQTileRows rows (n rounded up), cols/64
// tiles a block.
func BwdDQAccTiledStrides(n, h, cols int) (batch, head int64) {
	head = int64((n+BwdDQTileRows-1)/BwdDQTileRows) * int64(cols/64) * BwdDQTileFloats
	return int64(h) * head, head
}

// dqAccTiledAt returns the C expression of the float offset, from a head's
// start, of element (row i, column d) of v's tiled dQ accumulator: its
// tile's, then its place in the tile (dqTileAt). The tile's offset is
// 64-bit: a head's accumulator passes 2^31 floats from 2^24 queries.
func (v BwdVariant) dqAccTiledAt(i, d string) string {
	return fmt.Sprintf("((long long)(((%[1]s) >> 6) * %[4]d + ((%[2]s) >> 6)) * %[3]d + %[5]s)", i, d, BwdDQTileFloats, v.dqAccTiles(),
		dqTileAt("(("+i+") & 63)", "(("+d+") & 63)"))
}

// dqTileAt returns the C expression of the float offset of element (row
// i, column d) within a 64 × 64 tile of the tiled dQ accumulator, whose
// 8-float chunks are swizzled by the row; the shared tile a warpgroup adds
// from has the same order.
func dqTileAt(i, d string) string {
	return fmt.Sprintf("(%[1]s * 64 + (%[2]s ^ ((%[1]s & 7) << 3)))", i, d)
}

// bwdDQTransposed reports whether v's dK/dV kernel computes the atomic dQ
// transposed, dQᵀ = Kᵀ·dSᵀ (this warpgroup's dQ columns as the product's
// 64 rows, the step's queries as its columns): on a step of 80 queries,
// which a warpgroup product's 64 rows cannot hold.
func (v BwdVariant) bwdDQTransposed() bool {
	return v.AtomicDQ && v.bwdHopperTile().BlockM == 80
}

// bwdDQPitch returns the row pitch, in floats, of the bulk dQ tile in
// shared memory: a warpgroup's nq columns and a pad that spreads a warp's
// stores over the banks. Rows of nq + 8 take the paired stores of the
// product by query rows (the eight rows a warp reaches at once fall on
// distinct banks in each half-warp); nq + 4 the single stores of the
// transposed product (a warp's eight columns and four rows, two apart,
// fall on 32 distinct banks). Both keep rows 16-byte aligned for the
// bulk copies.
func (v BwdVariant) bwdDQPitch() int {
	_, _, nq := v.bwdHopperCols()
	if v.DQAccTiled() {
		return nq // the accumulator's tile as it is, its chunks swizzled instead of its rows padded
	}
	if v.bwdDQTransposed() {
		return nq + 4
	}
	return nq + 8
}

// bwdHopperWide reports whether v's Hopper kernel splits columns (head dims
// past 128) rather than keys between its warpgroups.
func (v BwdVariant) bwdHopperWide() bool { return v.DKPad() > 128 }

// bwdHopperCrossed reports whether v's wide Hopper dK/dV kernel crosses the
// warpgroups' column shares (equal padded head dims): warpgroup 0 computes
// dV's columns 0 .. 127 and dK's 128 .. DKP−1, warpgroup 1 the other two.
func (v BwdVariant) bwdHopperCrossed() bool {
	return v.bwdHopperWide() && v.DKPad() == v.DVPad()
}

// bwdHopperTile returns the dK/dV tile of v's Hopper kernel.
func (v BwdVariant) bwdHopperTile() BwdTile {
	bn := 128
	if v.bwdHopperWide() {
		bn = 64
	}
	warps := 8
	if v.WarpSpecialized {
		warps = 12 // and the producer warpgroup
	}
	bm := bwdHopperBM
	if v.QueryStep != 0 {
		bm = v.QueryStep
	}
	return BwdTile{BlockM: bm, BlockN: bn, Warps: warps, Stages: 2, MinBlocks: 1}
}

// bwdHopperAtoms returns the 64-column atoms of the q and k tiles (ka), of
// the dO tile (va) and of the v tile (vka). With split columns every
// warpgroup's products span 128 columns, so q, k and dO hold 256 (the
// columns past the head dim are never loaded; they only feed output
// columns that are never stored).
func (v BwdVariant) bwdHopperAtoms() (ka, va, vka int) {
	ka, va, vka = swizzleAtoms(v.DKPad()), swizzleAtoms(v.DVPad()), swizzleAtoms(v.DVPad())
	if v.bwdHopperWide() {
		ka, va = 4, 4
	}
	return ka, va, vka
}

// bwdHopperLayout is the shared-memory map of the Hopper dK/dV kernel:
// every tile starts on a 1024-byte boundary (the swizzle's period) from a
// base the kernel aligns (alignSlack).
func (v BwdVariant) bwdHopperLayout() bwdSmemLayout {
	return v.bwdHopperLayoutBuffers(v.bwdWSBuffers())
}

// bwdHopperLayoutBuffers is bwdHopperLayout with bufs buffers of the P and
// dS tiles.
func (v BwdVariant) bwdHopperLayoutBuffers(bufs int) bwdSmemLayout {
	ka, va, vka := v.bwdHopperAtoms()
	t := v.bwdHopperTile()
	bm, bn := t.BlockM, t.BlockN
	var l bwdSmemLayout
	add := l.addSwizzled
	add("sK", ka*bn*128)    // [KATOMS][BN][64]
	add("sV", vka*bn*128)   // [VKATOMS][BN][64]
	add("sQ", 2*ka*bm*128)  // [2][KATOMS][BM][64]
	add("sdO", 2*va*bm*128) // [2][VATOMS][BM][64]
	// P and dS [buffers][BN/64][BM][64]; the key-rows step keeps P in registers, and dS too unless
	// the atomic dQ reads it
	sp, sds := bufs*bn/64*bm*128, bufs*bn/64*bm*128
	if v.KeyRows {
		sp = 0
		if !v.AtomicDQ {
			sds = 0
		}
	}
	add("sP", sp)
	add("sdS", sds)
	if v.BiasStaged {
		l.add("sB", 2*bm*bn*2) // [2][BN/64][BM][64] 16-bit, swizzled (sw_off): each stage's bias tile
	}
	add("sL", 2*bm*4) // [2][BM] LSE2
	add("sD", 2*bm*4) // [2][BM] Delta
	if v.ProducerDropout {
		l.add("sKeep", 2*v.bwdKeepStageBytes()) // [2][BN/16][16][KR] 32-bit keep words
	}
	if v.TMA {
		l.add("bar", 16) // [2] mbarriers: stage s of q and dO landed
	}
	if v.WarpSpecialized {
		l.add("empty", 16) // [2] mbarriers: stage s released by every compute warp
	}
	if v.Persistent {
		l.add("kvbar", 32) // mbarriers: the tile's K and V landed, released; then the tile's number
	}
	if v.BulkDQ {
		rows := bm
		if v.bwdDQRowHalves() {
			rows = 64 // each warpgroup's half of the step's queries
		}
		l.add("sdQ", v.bwdHopperDQWarpgroups()*rows*v.bwdDQPitch()*4) // [warpgroups][rows][pitch] fp32
	}
	l.alignSlack()
	return l
}

// bwdHopperDQWarpgroups returns the number of warpgroups that compute the
// atomic dQ: both when they split its columns or its rows, else
// warpgroup 0.
func (v BwdVariant) bwdHopperDQWarpgroups() int {
	if v.bwdHopperSplitDQ() || v.bwdDQRowHalves() {
		return 2
	}
	return 1
}

// bwdHopperSplitDQ reports whether the atomic dQ's columns are split over
// the warpgroups (one warpgroup computes them all otherwise).
func (v BwdVariant) bwdHopperSplitDQ() bool {
	_, _, nq := v.bwdHopperCols()
	return nq < v.DKPad()
}

// bwdHopperCols returns the columns of one warpgroup's products in the
// dK/dV kernel: dV += Pᵀ·dO (nv), dK += dSᵀ·Q (nk) and the atomic dQ = dS·K
// (nq; fewer than DKP when the warpgroups split dQ's columns). With split
// columns every product spans 128 (the last warpgroup's columns past the
// head dim are never stored).
func (v BwdVariant) bwdHopperCols() (nv, nk, nq int) {
	dkp, dvp := v.DKPad(), v.DVPad()
	switch {
	case v.bwdHopperWide():
		return 128, 128, 128
	case dkp == 128:
		return dvp, dkp, 64
	}
	return dvp, dkp, dkp
}

// dkdvKernelHopper writes BwdDKDVKernel for WGMMA variants, stage by
// stage: the block's setup and its key tiles' loads, the dK/dV
// accumulators, the matrix descriptors, one query block's step, and the
// stores of dK and dV; for a persistent variant all but the setup inside
// the compute warpgroups' loop over the CTA's tiles
// (bwd_sm90_persistent.go).
func (g *bwdGen) dkdvKernelHopper(b *strings.Builder) {
	g.ws = g.v.WarpSpecialized
	defer func() { g.ws = false }()
	kl, vl := g.dkdvSM90Setup(b)
	body := b // the block's work, or a persistent CTA's work on one tile
	var tile strings.Builder
	if g.v.Persistent {
		g.persistentComputeOpen(b)
		body = &tile
	}
	tdk, tdv, accA, accB := g.dkdvSM90Accumulators(body)
	g.dkdvSM90Descriptors(body, kl, vl)
	if g.v.KeyRows {
		g.dkdvSM90StepKeyRows(body)
	} else {
		g.dkdvSM90Step(body)
	}
	g.dkdvSM90Store(body, tdk, tdv, accA, accB)
	if g.v.Persistent {
		b.WriteString(indentLines(tile.String(), "  ") + "  }\n")
	}
	g.dkdvSM90End(b)
}

// dkdvSM90Setup writes the dK/dV kernel's header, shared-memory tiles,
// query range and the addressing of its key tiles; it returns the row
// limits of the k and v tile loads.
func (g *bwdGen) dkdvSM90Setup(b *strings.Builder) (kl, vl string) {
	v := g.v
	t := v.bwdHopperTile()
	l := v.bwdHopperLayout()
	ka, va, _ := v.bwdHopperAtoms()
	wide := v.bwdHopperWide()
	crossed := v.bwdHopperCrossed()
	owner := "warpgroup w owns keys 64w .. 64w+63: their dK and dV stay in its registers"
	switch {
	case crossed:
		owner = "warpgroup 0 owns columns 0 .. 127 of dV and 128 .. DKP-1 of dK for all the keys,\n// warpgroup 1 the other columns"
	case wide:
		owner = "warpgroup w owns columns 128w .. 128w+127 of dK and dV for all the keys"
	}
	fmt.Fprintf(b, `// dK/dV (Hopper, warpgroup products): one block per (key block of %[1]d keys, batch, key head); loops
// over the query heads of the group and the query blocks that see the keys; %[4]s,
// written once. grid (ceil(M/%[1]d), B, Hkv), 256 threads, %[2]d bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(%[7]d, 1) %[3]s(%[5]s) {
%[6]s`, t.BlockN, l.total, BwdDKDVKernel, owner, g.hopperArg(), g.hopperArgAlias(), 32*t.Warps)
	g.hopperPreamble(b, t, l, "Q_STAGE", ka*t.BlockM*128, "DO_STAGE", va*t.BlockM*128, "q and dO")
	g.wsBwdConstants(b, true)
	for _, name := range []string{"sK", "sV", "sQ", "sdO"} {
		fmt.Fprintf(b, "  const u32 %s = s0 + %d;\n", name, l.off[name])
	}
	fmt.Fprintf(b, `  T* sP = reinterpret_cast<T*>(smem + %d);    // P  [BN/64][BM][64], swizzled
  T* sdS = reinterpret_cast<T*>(smem + %d);   // dS [BN/64][BM][64], swizzled
  float* sL = reinterpret_cast<float*>(smem + %d);
  float* sD = reinterpret_cast<float*>(smem + %d);
  const u32 sPa = s0 + %d, sdSa = s0 + %d;
`, l.off["sP"], l.off["sdS"], l.off["sL"], l.off["sD"], l.off["sP"], l.off["sdS"])
	if v.BulkDQ {
		_, _, nq := v.bwdHopperCols()
		layout := fmt.Sprintf("rows padded by %d", v.bwdDQPitch()-nq)
		if v.DQAccTiled() {
			layout = "in the accumulator tile's order"
		}
		rows := "BM"
		if v.bwdDQRowHalves() {
			rows = "64" // each warpgroup's half of the step's queries
		}
		fmt.Fprintf(b, "  float* sdQ = reinterpret_cast<float*>(smem + %d);  // [warpgroups][%s][%d]: each step's dQ tile, fp32, %s\n", l.off["sdQ"], rows, v.bwdDQPitch(), layout)
	}
	g.bwdBiasStageDecls(b, l)
	g.bwdKeepDecls(b, l)
	if v.WarpSpecialized {
		g.wsBwdBarriers(b, l, g.bwdKeepFullCount(), "NCOMPUTE", "the producer warp's 32 lanes stored LSE2 and Delta,\n  // and the q and dO tiles landed")
	} else {
		g.tmaBarriers(b, l, "q and dO", 2)
	}
	if v.Persistent {
		g.persistentTiles(b, l)
	} else {
		g.dkdvQueryRange(b)
		g.dkdvKVRows(b)
	}
	if v.Flat {
		kl, vl = ", sk_ + DK", ", sv_ + DV"
	}
	switch {
	case v.WarpSpecialized:
		g.wsBwdProducer(b)
	default:
		g.loadQ(b)
	}
	return kl, vl
}

// dkdvKVRows writes the addresses of the block's K and V rows (gk, gv;
// for Flat variants shifted by their flat_shift columns).
func (g *bwdGen) dkdvKVRows(b *strings.Builder) {
	fmt.Fprintf(b, `  const T* gk = %s;
  const T* gv = %s;
`, g.in("k").at("j0", "kvh"), g.in("v").at("j0", "kvh"))
	if g.v.Flat {
		b.WriteString(`  // flat rows: k and v tiles from flat_shift columns before the head's start, the head shifted
  // right by sk_ (k; with one query head per key head also q and dK) and sv_ (v, dO and dV) columns
  const int sk_ = flat_shift(kvh, DK, DKP), sv_ = flat_shift(kvh, DV, DVP);
  gk -= sk_;
  gv -= sv_;
`)
	}
}

// dkdvSM90Accumulators declares the dK and dV accumulators and returns
// their layouts over the warps and the names of the two accumulators.
func (g *bwdGen) dkdvSM90Accumulators(b *strings.Builder) (tdk, tdv bwdWarpTile, accA, accB string) {
	v := g.v
	dkp, dvp := v.DKPad(), v.DVPad()
	wide := v.bwdHopperWide()
	crossed := v.bwdHopperCrossed()
	// dK and dV accumulators and their layouts over the warps (rows: keys)
	tdk = bwdWarpTile{Wm: 8, Wn: 1, TM: 16, TN: dkp, MT: 1, NT: dkp / 8, Warps: 8}
	tdv = bwdWarpTile{Wm: 8, Wn: 1, TM: 16, TN: dvp, MT: 1, NT: dvp / 8, Warps: 8}
	if wide {
		tdk = bwdWarpTile{Wm: 4, Wn: 2, TM: 16, TN: 128, MT: 1, NT: 16, Warps: 8}
		tdv = tdk
	}
	// the crossed split's accumulators: the 128-column share (accW: dV on warpgroup 0, dK on 1) and
	// the rest (accR: dK's columns from 128 on warpgroup 0, dV's on 1)
	accA, accB = "accdV", "accdK"
	if crossed {
		accA, accB = "accW", "accR"
		b.WriteString("  // accW: dV columns 0..127 (warpgroup 0) or dK columns 0..127 (warpgroup 1), keys x 128\n  ")
		b.WriteString(strings.ReplaceAll(tdk.accDecl("accW"), "\n", "\n  "))
		b.WriteString("// accR: dK columns 128..DKP-1 (warpgroup 0) or dV columns 128..DVP-1 (warpgroup 1)\n  ")
		tr := bwdWarpTile{Wm: 4, Wn: 2, TM: 16, TN: dkp - 128, MT: 1, NT: (dkp - 128) / 8, Warps: 8}
		b.WriteString(strings.ReplaceAll(tr.accDecl("accR"), "\n", "\n  "))
	} else {
		b.WriteString("  " + strings.ReplaceAll(tdk.accDecl("accdK"), "\n", "\n  "))
		b.WriteString(strings.ReplaceAll(tdv.accDecl("accdV"), "\n", "\n  "))
	}
	return tdk, tdv, accA, accB
}

// dkdvSM90Descriptors writes the first loads of the key tiles and the
// matrix descriptors of the products.
func (g *bwdGen) dkdvSM90Descriptors(b *strings.Builder, kl, vl string) {
	v := g.v
	wide := v.bwdHopperWide()
	crossed := v.bwdHopperCrossed()
	_, _, nq := v.bwdHopperCols()
	split := v.bwdHopperSplitDQ()
	firstQ, landed := "\n    load_q(0, 0);", ""
	if v.WarpSpecialized {
		// the producer loads every step's q and dO; K and V must have landed for both warpgroups
		firstQ = ""
		landed = "  cp_async_wait0();\n  fence_proxy_async();\n  bar_sync(1, NCOMPUTE);  // K and V in shared memory for both warpgroups\n"
	}
	if v.Persistent {
		b.WriteString("// (the tile's K and V landed: its number was read after kvbar's phase)\n")
	} else {
		fmt.Fprintf(b, `if (iters > 0) {
    load_sw<BN, KCH, DK, NTH>(sK, gk, %s, m - j0%s);
    load_sw<BN, VCH, DV, NTH>(sV, gv, %s, m - j0%s);%s
    cp_async_commit();%s
  }
%s`, g.in("k").sr, kl, g.in("v").sr, vl, firstQ, g.flatZero("sK", "BN", "DKP", "sk_", "DK", "sV", "BN", "DVP", "sv_", "DV"), landed)
	}
	b.WriteString(`  // ---- matrix descriptors (128-byte swizzle; 8-row groups 1024 bytes apart)
  // S = Q·Kᵀ, dP = dO·Vᵀ: this warpgroup's BN/2 rows of K and V, K-major
  const u64 dKs = sw128_desc(sK + wg * (BN / 2) * 128, 16, 1024), dVs = sw128_desc(sV + wg * (BN / 2) * 128, 16, 1024);
`)
	switch {
	case crossed:
		b.WriteString(`  // dV += Pᵀ·dO, dK += dSᵀ·Q: P and dS of all BN = 64 keys, read M-major. The 128-column product
  // (accW) takes Pᵀ and dO (warpgroup 0) or dSᵀ and Q (warpgroup 1) from column 0, the rest (accR)
  // dSᵀ and Q (warpgroup 0) or Pᵀ and dO (warpgroup 1) from column 128 (atom 2); B read N-major
  const u64 dPt = sw128_desc(sPa, 16, 1024), dSt = sw128_desc(sdSa, 16, 1024);
  const u64 aW = wg ? dSt : dPt, aR = wg ? dPt : dSt;
`)
	case wide:
		b.WriteString(`  // dV += Pᵀ·dO, dK += dSᵀ·Q: P and dS of all BN = 64 keys, read M-major; dO and Q from this
  // warpgroup's first column (atom 2·wg), read N-major
  const int c0 = wg * 128;  // first dK/dV/dQ column of this warpgroup
  const u64 dPt = sw128_desc(sPa, 16, 1024), dSt = sw128_desc(sdSa, 16, 1024);
`)
	default:
		b.WriteString(`  // dV += Pᵀ·dO, dK += dSᵀ·Q: this warpgroup's 64 keys (atom wg) of P and dS, read M-major
  constexpr int c0 = 0;  // (every column of dK and dV)
  const u64 dPt = sw128_desc(sPa + wg * BM * 128, 16, 1024), dSt = sw128_desc(sdSa + wg * BM * 128, 16, 1024);
`)
	}
	if v.AtomicDQ {
		switch {
		case v.bwdDQTransposed():
			fmt.Fprintf(b, `  // dQᵀ = Kᵀ·dSᵀ: K read M-major from this warpgroup's first dQ column (its 64 columns, one atom, are
  // the product's rows); dS K-major as B (the step's queries its columns, atoms of 64 keys BM·128 bytes apart)
  const int dq0 = wg * %d;
  const u64 dSk = sw128_desc(sdSa, 16, 1024), dKt = sw128_desc(sK + dq0 / 64 * BN * 128, 16, 1024);
`, nq)
		case v.bwdDQRowHalves():
			b.WriteString(`  // dQ = dS·K over this warpgroup's half of the step's queries (rows dqi ..): dS K-major from its
  // first row (atoms of 64 keys BM·128 bytes apart); K read N-major, every column
  constexpr int dq0 = 0;
  const int dqi = 64 * wg;  // this warpgroup's first query of the step
  const u64 dSk = sw128_desc(sdSa + wg * 64 * 128, 16, 1024), dKn = sw128_desc(sK, BN * 128, 1024);
`)
		case split:
			fmt.Fprintf(b, `  // dQ = dS·K: dS K-major (atoms of 64 keys BM·128 bytes apart); K read N-major from this
  // warpgroup's first dQ column (the next 64 columns BN·128 bytes further)
  const int dq0 = wg * %d;
  const u64 dSk = sw128_desc(sdSa, 16, 1024), dKn = sw128_desc(sK + dq0 / 64 * BN * 128, BN * 128, 1024);
`, nq)
		default:
			b.WriteString(`  // dQ = dS·K (warpgroup 0 alone): dS K-major (atoms of 64 keys BM·128 bytes apart); K read N-major
  constexpr int dq0 = 0;
  const u64 dSk = sw128_desc(sdSa, 16, 1024), dKn = sw128_desc(sK, BN * 128, 1024);
`)
		}
	}
}

// dkdvSM90Step writes the loop over query blocks: S and dP, P and dS,
// dV += Pᵀ·dO and dK += dSᵀ·Q, and with AtomicDQ dQ += dS·K.
func (g *bwdGen) dkdvSM90Step(b *strings.Builder) {
	v := g.v
	t := v.bwdHopperTile()
	dkp := v.DKPad()
	crossed := v.bwdHopperCrossed()
	nv, nk, _ := v.bwdHopperCols()
	b.WriteString(stepLoop("  ", "h", "i0", "0") + "    const int st = it & 1;\n")
	if g.ws {
		g.wsBwdStepStart(b)
	} else {
		g.lockstepStepStart(b, 2, "load_q", "iters")
	}
	g.fullMask(b)
	wgScores(b, "wg_s", "64 queries x this warpgroup's BN/2 keys",
		"      const u64 dq = sw128_desc(sQ + st * Q_STAGE, 16, 1024), ddo = sw128_desc(sdO + st * DO_STAGE, 16, 1024);\n",
		"dq", "dKs", "ddo", "dVs", "BM", "BN", t.BlockN/16, "")
	g.wsBwdRelease(b)
	st := bwdWarpTile{Wm: 4, Wn: 2, TM: 16, TN: t.BlockN / 2, MT: 1, NT: t.BlockN / 16, Warps: 8}
	g.tileAt = func(tile string) string { return tile + " + sw_elem<BM>(il, jl)" }
	if g.ws {
		g.tileAt = func(tile string) string { return tile + "b + sw_elem<BM>(il, jl)" } // this step's buffer
	}
	g.probs(b, st, "(sL + st * BM)", "(sD + st * BM)", true)
	b.WriteString("    wgmma_wait<0>();  // dP\n    fence_acc(accP[0]);\n")
	g.dsFromDP(b, st, true)
	g.tileAt = nil
	if crossed {
		fmt.Fprintf(b, `    fence_proxy_async();
    %[2]s
    // ---- dV += Pᵀ·dO, dK += dSᵀ·Q over the BM queries, crossed: accW from column 0 (dO on warpgroup 0,
    // Q on 1), accR from column 128 (Q on warpgroup 0, dO on 1); B read N-major
    {
      const u32 sqs = sQ + st * Q_STAGE, sdos = sdO + st * DO_STAGE;
      const u64 bW = sw128_desc(wg ? sqs : sdos, BM * 128, 1024);
      const u64 bR = sw128_desc((wg ? sdos : sqs) + 2 * BM * 128, BM * 128, 1024);
      fence_acc(accW[0]);
      fence_acc(accR[0]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        wg_t128(accW[0], aW%[3]s + (u64)((kk * 2048) >> 4), bW + (u64)((kk * 2048) >> 4), 1);
        wg_t%[1]d(accR[0], aR%[3]s + (u64)((kk * 2048) >> 4), bR + (u64)((kk * 2048) >> 4), 1);
      }
`, dkp-128, g.pdsSync(), g.psBuf())
	} else {
		b.WriteString(`    fence_proxy_async();
    ` + g.pdsSync() + `
    // ---- dV += Pᵀ·dO, dK += dSᵀ·Q over the BM queries; dO and Q read N-major from column c0
    {
      const u64 ddo = sw128_desc(sdO + st * DO_STAGE + c0 / 64 * BM * 128, BM * 128, 1024);
      const u64 dq = sw128_desc(sQ + st * Q_STAGE + c0 / 64 * BM * 128, BM * 128, 1024);
      fence_acc(accdV[0]);
      fence_acc(accdK[0]);
      wgmma_fence();
`)
		// the products of this warpgroup's columns: nv value and nk key columns
		fmt.Fprintf(b, `#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        wg_t%[1]d(accdV[0], dPt%[3]s + (u64)((kk * 2048) >> 4), ddo + (u64)((kk * 2048) >> 4), 1);
        wg_t%[2]d(accdK[0], dSt%[4]s + (u64)((kk * 2048) >> 4), dq + (u64)((kk * 2048) >> 4), 1);
      }
`, nv, nk, g.psBuf(), g.psBuf())
	}
	b.WriteString("      wgmma_commit();\n    }\n")
	g.dqAtomic(b)
}

// dqAtomic writes, for AtomicDQ, the end of a dK/dV step: dQ += dS·K over
// the block's BN keys (dS of this step's buffer in shared memory, stored
// and ordered by the barrier before), added to the fp32 accumulator
// (dqReduce) once it is complete.
func (g *bwdGen) dqAtomic(b *strings.Builder) {
	if !g.v.AtomicDQ {
		return
	}
	_, _, nq := g.v.bwdHopperCols()
	fmt.Fprintf(b, `    // ---- dQ += dS·K over the block's BN keys (columns dq0 .. dq0 + %[1]d), added to the fp32 accumulator
    %[2]s{
      float accQ[%[3]d][4];
`, nq, g.dqCond(), nq/8)
	g.dqProduct(b)
	g.dqReduce(b, "      wgmma_commit();\n      wgmma_wait<0>();\n")
}

// dqCond returns the condition on the warpgroup that computes the atomic
// dQ: none where both split its columns or its rows, else warpgroup 0
// alone.
func (g *bwdGen) dqCond() string {
	if g.v.bwdHopperSplitDQ() || g.v.bwdDQRowHalves() {
		return ""
	}
	return "if (wg == 0) "
}

// dqProduct writes the atomic dQ's product into accQ: dS of this step's
// buffer times K, over the block's BN keys (transposed, Kᵀ times dSᵀ:
// bwdDQTransposed).
func (g *bwdGen) dqProduct(b *strings.Builder) {
	if g.v.bwdDQTransposed() {
		fmt.Fprintf(b, `#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        wg_qt(accQ, dKt + (u64)((kk * 2048) >> 4), dSk%[1]s + (u64)(((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4), kk > 0);
`, g.psBuf())
		return
	}
	_, _, nq := g.v.bwdHopperCols()
	fmt.Fprintf(b, `#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        wg_n%[1]d(accQ, dSk%[2]s + (u64)(((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4), dKn + (u64)((kk * 2048) >> 4), kk > 0);
`, nq, g.psBuf())
}

// dqReduce writes, after pre (the statements that complete the dQ
// product) and accQ's fence, the addition of accQ to the fp32 accumulator: by vector
// atomics, or with BulkDQ by bulk reduce-adds (dqBulk); it closes the
// block dqAtomic opened.
func (g *bwdGen) dqReduce(b *strings.Builder, pre string) {
	v := g.v
	_, _, nq := v.bwdHopperCols()
	b.WriteString(pre + "      fence_acc(accQ);\n")
	if v.bwdDQTransposed() {
		g.dqBulkTransposed(b, nq)
		return
	}
	if v.BulkDQ {
		g.dqBulk(b, nq)
		return
	}
	fmt.Fprintf(b, `      float* gq = p.dqacc + b * p.dqa_sb + (qr0 + %[3]s) * p.dqa_sr + h * p.dqa_sh + dq0;
#pragma unroll
      for (int nt = 0; nt < %[1]d; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int il = (warp & 3) * 16 + g + hh * 8, jl = nt * 8 + 2 * t4;
          if (%[3]s + il < n && dq0 + jl < %[2]s) red_add_pair(gq + il * p.dqa_sr + jl, accQ[nt][2 * hh], accQ[nt][2 * hh + 1]);
        }
    }
`, nq/8, g.flatLimit("sk_", "DK"), g.dqRow0())
}

// dqRow0 returns the first query of the step that this warpgroup's dQ
// rows hold: the step's (i0), or with the rows split over the
// warpgroups its half's (bwdDQRowHalves).
func (g *bwdGen) dqRow0() string {
	if g.v.bwdDQRowHalves() {
		return "(i0 + dqi)"
	}
	return "i0"
}

// dqBulk writes the end of the atomic dQ step with BulkDQ, once the
// product is complete: the tile (this
// warpgroup's nq columns of the block's BM rows) into shared memory, then
// one bulk reduce-add per row into the fp32 accumulator, issued by lane 0
// of the quad that holds the row. Each such lane first waits until its
// reduce-adds of the last step are done reading their rows (they were
// issued a whole step ago); a row is written by its quad alone, so a warp
// barrier orders the lanes' stores, their proxy fences and the issue. The
// columns past the head dim (up to the accumulator's padded width, the
// head stride dqa_sh) are zeros: K's columns there are zero-filled.
func (g *bwdGen) dqBulk(b *strings.Builder, nq int) {
	if g.v.DQAccTiled() {
		g.dqBulkTiled(b)
		return
	}
	tile := fmt.Sprintf("(dq0 / %d) * BM * QP", nq)
	if g.v.bwdDQRowHalves() {
		tile = "wg * 64 * QP"
	}
	fmt.Fprintf(b, `      constexpr int QP = %[1]d;  // row pitch of the shared dQ tile (floats)
      float* sq = sdQ + %[5]s;  // this warpgroup's tile
      if (t4 == 0) bulk_wait_read<0>();  // this lane's reduce-adds of the last step no longer read its rows
      __syncwarp();
#pragma unroll
      for (int nt = 0; nt < %[3]d; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int il = (warp & 3) * 16 + g + hh * 8, jl = nt * 8 + 2 * t4;
          *reinterpret_cast<float2*>(sq + il * QP + jl) = make_float2(accQ[nt][2 * hh], accQ[nt][2 * hh + 1]);
        }
      fence_proxy_async();  // the stores, before the copy engine reads them
      __syncwarp();
      if (t4 == 0) {  // the quad's two rows: g and g + 8 of this warp's 16
        float* gq = p.dqacc + b * p.dqa_sb + (qr0 + %[4]s) * p.dqa_sr + h * p.dqa_sh + dq0;
        const int cols = min(%[2]d, (int)p.dqa_sh - dq0);  // up to the accumulator's padded width (a multiple of 32)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int il = (warp & 3) * 16 + g + hh * 8;
          if (%[4]s + il < n) bulk_reduce_add_f32(gq + il * p.dqa_sr, smem_u32(sq + il * QP), cols * 4);
        }
        bulk_commit();
      }
    }
`, g.v.bwdDQPitch(), nq, nq/8, g.dqRow0(), tile)
}

// dqBulkTiled is dqBulk for the tiled accumulator (DQAccTiled): the
// warpgroup's 64 × 64 tile goes to shared memory in the accumulator tile's
// own order, and the warpgroup's first thread adds the whole tile with one
// bulk reduce-add (wgTileReduce).
func (g *bwdGen) dqBulkTiled(b *strings.Builder) {
	tile := "dq0 / 64" // this warpgroup's columns' tile
	if g.v.bwdDQRowHalves() {
		tile = "wg" // this warpgroup's rows' tile
	}
	g.wgTileReduce(b, fmt.Sprintf(`      float* sq = sdQ + (%[2]s) * %[1]d;  // this warpgroup's tile, in the accumulator tile's order
      const bool issuer = %[3]s;  // the thread that adds the tile
`, BwdDQTileFloats, tile, wgIssuer), "issuer", fmt.Sprintf(`#pragma unroll
      for (int nt = 0; nt < 64 / 8; ++nt)  // the tile's 64 columns (a warpgroup's share of dQ, nq)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int il = (warp & 3) * 16 + g + hh * 8, jl = nt * 8 + 2 * t4;
          *reinterpret_cast<float2*>(sq + %[1]s) = make_float2(accQ[nt][2 * hh], accQ[nt][2 * hh + 1]);
        }
`, dqTileAt("il", "jl")), fmt.Sprintf(`        %[5]sbulk_reduce_add_f32(p.dqacc + b * p.dqa_sb + h * p.dqa_sh + (long long)((%[4]s >> 6) * %[3]d + dq0 / 64) * %[1]d, smem_u32(sq), %[2]d);
`, BwdDQTileFloats, BwdDQTileFloats*4, g.v.dqAccTiles(), g.dqRow0(), g.dqHalfGuard()))
}

// dqHalfGuard returns, with the dQ rows split over the warpgroups
// (bwdDQRowHalves), the condition before a warpgroup's reduce-add of its
// tile: its half of the step begins before the last query (the second
// half of a last step past n has no tile in the accumulator).
func (g *bwdGen) dqHalfGuard() string {
	if !g.v.bwdDQRowHalves() {
		return ""
	}
	return "if (i0 + dqi < n) "
}

// dqBulkTransposed is dqBulk for the transposed product (bwdDQTransposed):
// each thread stores its elements at their (query, column) place of a tile
// of query rows, and thread r of the warpgroup adds row r (wgTileReduce).
func (g *bwdGen) dqBulkTransposed(b *strings.Builder, nq int) {
	g.wgTileReduce(b, fmt.Sprintf(`      constexpr int QP = %[1]d;  // row pitch of the shared dQ tile (floats)
      float* sq = sdQ + wg * BM * QP;  // this warpgroup's tile
      const int r = tid & 127;  // the tile row this thread issues (r < BM)
`, g.v.bwdDQPitch()), "r < BM", `#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sq[(nt * 8 + 2 * t4 + (e & 1)) * QP + 16 * (warp & 3) + g + 8 * (e >> 1)] = accQ[nt][e];
`, fmt.Sprintf(`        if (i0 + r < n) {
          float* gq = p.dqacc + b * p.dqa_sb + (qr0 + i0 + r) * p.dqa_sr + h * p.dqa_sh + dq0;
          bulk_reduce_add_f32(gq, smem_u32(sq + r * QP), min(%[1]d, (int)p.dqa_sh - dq0) * 4);
        }
`, nq))
}

// wgTileReduce writes the end of an atomic dQ step whose shared tile rows
// gather elements of every warp of the warpgroup (dqBulkTiled,
// dqBulkTransposed): decls (the tile, the issuing threads); the issuing
// threads (issuer) wait until their reduce-adds of the last step are done
// reading the tile, and the warpgroup meets (named barrier 2 + wg); the
// stores; the proxy fence and a second meeting, after which the tile is
// whole; the issuing threads' reduce-adds (issue) and their commit. It
// closes the block dqAtomic opened.
func (g *bwdGen) wgTileReduce(b *strings.Builder, decls, issuer, stores, issue string) {
	fmt.Fprintf(b, `%[1]s%[5]s%[3]s      fence_proxy_async();  // the stores, before the copy engine reads them
      bar_sync(2 + wg, 128);  // the tile is whole
      if (%[2]s) {
%[4]s        bulk_commit();
      }
    }
`, decls, issuer, stores, issue, wgTileFree("      ", issuer))
}

// wgTileFree returns the wait after which the warpgroup may write a shared
// tile that its issuing threads (issuer) hand to bulk copies: they wait
// until their copies of the last step are done reading it, and the
// warpgroup meets (named barrier 2 + wg); indent before each line.
func wgTileFree(indent, issuer string) string {
	return indent + "if (" + issuer + ") bulk_wait_read<0>();  // this thread's reduce-adds of the last step no longer read the tile\n" +
		indent + "bar_sync(2 + wg, 128);  // nobody in the warpgroup still reads the tile\n"
}

// wgIssuer is the condition of the thread of each warpgroup that issues
// the warpgroup's bulk copies of a whole tile (the tiled dQ's reduce-adds,
// dBias's tiles and stores).
const wgIssuer = "(tid & 127) == 0"

// dkdvSM90Store closes the loop and stores dK and dV (through shared
// memory for odd head dims); in a persistent kernel it first ends the tile
// (persistentTileEnd).
func (g *bwdGen) dkdvSM90Store(b *strings.Builder, tdk, tdv bwdWarpTile, accA, accB string) {
	v := g.v
	l := v.bwdHopperLayout()
	dkp := v.DKPad()
	crossed := v.bwdHopperCrossed()
	fmt.Fprintf(b, `    wgmma_wait<0>();
    fence_acc(%[1]s[0]);
    fence_acc(%[2]s[0]);
  }
`, accA, accB)
	g.persistentTileEnd(b)
	b.WriteString(`  T* gdk = p.dk + b * p.dk_sb + (kr0 + j0) * p.dk_sr + kvh * p.dk_sh;
  T* gdv = p.dv + b * p.dv_sb + (kr0 + j0) * p.dv_sr + kvh * p.dv_sh;
`)
	// flat rows: dK stored from Q's shift, dV from dO's; rows of an odd head dim (Staged, Flat) go
	// through shared memory and out whole
	shared := !v.Vector
	ok := bwdStoreOpt{Shift: g.flatName("sk_"), Shared: shared}
	ov := bwdStoreOpt{Shift: g.flatName("sv_"), Shared: shared}
	dk, dv, rk, rv := "gdk", "gdv", "p.dk_sr", "p.dv_sr"
	if shared {
		fmt.Fprintf(b, `  // ---- dK and dV through shared memory (rows of an odd head dim allow no paired stores): row-major
  // tiles [BN][DKP + 8] and [BN][DVP + 8] over the free tiles, then one warp a row
  constexpr int PK = DKP + 8, PV = DVP + 8;
  T* sgk = reinterpret_cast<T*>(smem);
  T* sgv = sgk + BN * PK;
  static_assert(BN * (PK + PV) * 2 <= %d, "the staged gradients exceed the tiles");
  %s  // every warpgroup is done with the tiles
`, l.tileBytes(), g.computeSync())
		dk, dv, rk, rv = "sgk", "sgv", "PK", "PV"
	}
	if crossed {
		b.WriteString("  if (wg == 0) {  // accW: dV columns 0..127, accR: dK columns 128..\n")
		bwdStoreWarpgroup(b, "accW", 128, dv, rv, "m - j0", "DV", "1.f", 0, ov)
		bwdStoreWarpgroup(b, "accR", dkp-128, dk, rk, "m - j0", "DK", "p.scale", 128, ok)
		b.WriteString("  } else {  // accW: dK columns 0..127, accR: dV columns 128..\n")
		bwdStoreWarpgroup(b, "accW", 128, dk, rk, "m - j0", "DK", "p.scale", 0, ok)
		bwdStoreWarpgroup(b, "accR", dkp-128, dv, rv, "m - j0", "DV", "1.f", 128, ov)
		b.WriteString("  }\n")
	} else {
		bwdStoreAcc(b, tdk, "accdK", dk, rk, "m - j0", "DK", "p.scale", ok)
		bwdStoreAcc(b, tdv, "accdV", dv, rv, "m - j0", "DV", "1.f", ov)
	}
	if shared {
		b.WriteString("  " + g.computeSync() + "\n")
		bwdRowsOut(b, "sgk", "PK", "gdk", "p.dk_sr", "BN", "m - j0", "DK")
		bwdRowsOut(b, "sgv", "PV", "gdv", "p.dv_sr", "BN", "m - j0", "DV")
	}
	accs := nfAll(accA, accB)
	if v.bwdHopperWide() && !crossed {
		// warpgroup 1's columns past a padded head dim come from tiles never loaded there
		accs = []nfAcc{{"accdK", "c0", "DKP"}, {"accdV", "c0", "DVP"}}
	}
	nfKeysCheck(b, g.ws, accs...)
}

// dkdvSM90End writes the end of the dK/dV kernel: the waits for its bulk
// copies still in flight.
func (g *bwdGen) dkdvSM90End(b *strings.Builder) {
	v := g.v
	switch {
	case v.DQAccTiled():
		b.WriteString("  if (" + wgIssuer + ") bulk_wait<0>();  // every reduce-add of dQ complete before the block ends\n")
	case v.bwdDQTransposed():
		b.WriteString("  if ((tid & 127) < BM) bulk_wait<0>();  // every reduce-add of dQ complete before the block ends\n")
	case v.BulkDQ:
		b.WriteString("  if (t4 == 0) bulk_wait<0>();  // every reduce-add of dQ complete before the block ends\n")
	}
	if v.DBiasByMap() && !v.BulkDQ {
		b.WriteString("  if (" + wgIssuer + ") bulk_wait<0>();  // every store or add of dBias complete before the block ends\n")
	}
	b.WriteString("}\n\n")
}
