package kernels

import "github.com/flashattn/flashattn/attn"

// Tile is the tile configuration of a forward kernel: the Variant fields
// that only affect speed.
type Tile struct {
	BlockM, BlockN int
	WarpsM, WarpsN int
	Stages         int
	QInRegs        bool
	MinBlocks      int
	// WGMMA selects the Hopper (sm_90a) kernel; see Variant.WGMMA.
	WGMMA bool
}

// TuneRow is one row of the tuning table: the tile for one element type,
// one load kind and head dims up to MaxD (the larger of DK and DV).
type TuneRow struct {
	DType attn.DType
	// Narrow rows serve register-staged (2-byte) loads.
	Narrow bool
	MaxD   int
	Tile
}

// TuneTable holds the forward tiles, measured on an NVIDIA H200 (see
// docs/kernels/forward.md). Rows are searched in order; the first row of the dtype and
// load kind whose MaxD covers the head dims wins. fp16 uses the bf16 rows.
var TuneTable = []TuneRow{
	// bf16 / fp16, cp.async loads
	{attn.BFloat16, false, 64, Tile{128, 128, 4, 1, 1, false, 1, false}},
	{attn.BFloat16, false, 128, Tile{128, 64, 4, 1, 1, false, 1, false}},
	{attn.BFloat16, false, 256, Tile{64, 64, 4, 1, 1, false, 1, false}},
	{attn.BFloat16, false, 512, Tile{64, 64, 4, 2, 1, false, 1, false}},
	// bf16 / fp16, register-staged loads (rows only 2-byte aligned)
	{attn.BFloat16, true, 64, Tile{128, 64, 8, 1, 1, false, 1, false}},
	{attn.BFloat16, true, 256, Tile{128, 32, 8, 1, 1, false, 1, false}},
	{attn.BFloat16, true, 512, Tile{64, 32, 4, 2, 1, false, 1, false}},
	// fp32 (split-tf32), cp.async loads
	{attn.Float32, false, 128, Tile{64, 32, 4, 1, 1, false, 1, false}},
	{attn.Float32, false, 256, Tile{64, 32, 4, 2, 1, false, 1, false}},
	{attn.Float32, false, 512, Tile{32, 32, 2, 2, 1, false, 1, false}},
}

// TileFor returns the tuned tile for head dims dk, dv of element type dt,
// with register-staged loads when narrow is set.
func TileFor(dt attn.DType, dk, dv int, narrow bool) (Tile, error) {
	if dt == attn.Float16 {
		dt = attn.BFloat16
	}
	d := max(dk, dv)
	for _, r := range TuneTable {
		if r.DType == dt && r.Narrow == narrow && d <= r.MaxD {
			return r.Tile, nil
		}
	}
	return Tile{}, attn.Errorf(attn.ErrUnsupported, "kernels: no forward tile for %v head dims %d/%d (narrow loads %v)", dt, dk, dv, narrow)
}

// TileForVariant returns the tuned tile for v's element type, head dims and
// load width, adjusted for its features: the fastest plain tiles give each
// warp 32 rows at the 255-register limit, so variants with per-element
// extras (bias, softcap, dropout, prescaled scores) get 16 rows per warp
// (twice the warps for the same BlockM), which leaves them registers.
func TileForVariant(v Variant) (Tile, error) {
	t, err := TileFor(v.DType, v.DK, v.DV, v.LoadBytes == 2)
	if err != nil {
		return t, err
	}
	if v.extras() && t.WarpsM > 0 && t.BlockM/(16*t.WarpsM) > 1 && 2*t.WarpsM*t.WarpsN <= 16 {
		t.WarpsM *= 2
	}
	return t, nil
}

// Apply returns v with the tile's fields set.
func (t Tile) Apply(v Variant) Variant {
	v.BlockM, v.BlockN = t.BlockM, t.BlockN
	v.WarpsM, v.WarpsN = t.WarpsM, t.WarpsN
	v.Stages, v.QInRegs, v.MinBlocks = t.Stages, t.QInRegs, t.MinBlocks
	v.WGMMA = t.WGMMA
	return v
}

// HopperTable holds the tiles of the Hopper (WGMMA) forward, 16-bit types,
// by the larger padded head dim; rows are searched in order. Two warpgroups
// share each K and V tile. ExtrasN is the keys per tile of variants with
// per-element extras (bias, softcap, dropout, prescaled scores) where one
// warpgroup holds a row group's whole S: their extra live values do not fit
// beside the full tile's registers (ptxas spilled). Measured on the H200
// (docs/kernels/forward.md).
var HopperTable = []struct {
	MaxD    int
	ExtrasN int
	Tile
}{
	{64, 32, Tile{BlockM: 128, BlockN: 64, WarpsM: 8, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true}},
	{128, 64, Tile{BlockM: 128, BlockN: 96, WarpsM: 8, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true}},
	{256, 32, Tile{BlockM: 128, BlockN: 80, WarpsM: 8, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true}},
	{272, 16, Tile{BlockM: 128, BlockN: 48, WarpsM: 8, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true}},
	{320, 16, Tile{BlockM: 128, BlockN: 32, WarpsM: 8, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true}},
	// past 320: two warpgroups share 64 query rows, each with half of the keys of S and half of O
	// (the full key tile also with extras)
	{384, 48, Tile{BlockM: 64, BlockN: 48, WarpsM: 4, WarpsN: 2, Stages: 2, MinBlocks: 1, WGMMA: true}},
	{512, 32, Tile{BlockM: 64, BlockN: 32, WarpsM: 4, WarpsN: 2, Stages: 2, MinBlocks: 1, WGMMA: true}},
}

// HopperTile returns the Hopper (WGMMA, sm_90a) tile for v, and false when
// that kernel cannot run v (32-bit elements, loads narrower than 16 bytes).
// The caller decides whether the device is one where it runs. Variants with
// per-element extras take the row's ExtrasN keys per tile.
func HopperTile(v Variant) (Tile, bool) {
	if (v.DType != attn.BFloat16 && v.DType != attn.Float16) || v.LoadBytes != 16 {
		return Tile{}, false
	}
	d := hopperTileDim(v.DK, v.DV)
	for _, r := range HopperTable {
		if d <= r.MaxD {
			t := r.Tile
			if v.extras() {
				t.BlockN = r.ExtrasN
			}
			return t, true
		}
	}
	return Tile{}, false
}

// HopperWSTable holds the tiles of the warp-specialized Hopper forward
// (Pipeline.WarpSpecialized), by the larger padded head dim: for problems
// without a mask (Plain) and with a causal or window mask (Masked), and
// for variants with per-element extras, masked or not (Extras): compute
// warpgroups with 240 registers (160 with three) take wider tiles than
// HopperTable's. A zero Plain or Masked tile keeps the lockstep kernels on
// HopperTable's tile for the class, where they measured faster; a zero
// Extras tile, and head dims past the last row, take HopperTable's tile on
// the pipeline. Calls with at most ShortKeys keys take ShortN keys a
// Plain or Masked tile (zero: the tile's own): 160 keys pad 512 keys to
// 640 and 1024 to 1120. Plain and Masked measured on the H200, Extras and
// ShortN on the H100 (docs/kernels/forward.md, "Tiles of the
// warp-specialized forward").
var HopperWSTable = []struct {
	MaxD                  int
	Plain, Masked, Extras Tile
	ShortKeys, ShortN     int
}{
	{64, Tile{BlockM: 192, BlockN: 128, WarpsM: 12, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true}, Tile{},
		Tile{BlockM: 128, BlockN: 128, WarpsM: 8, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true}, 0, 0},
	{128, Tile{BlockM: 128, BlockN: 160, WarpsM: 8, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true},
		Tile{BlockM: 128, BlockN: 160, WarpsM: 8, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true},
		Tile{BlockM: 128, BlockN: 128, WarpsM: 8, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true},
		1024, 128},
}

// HopperWSTile returns the tile of v's warp-specialized Hopper forward for
// a call with keys keys a row (HopperWSTable; zero: HopperTable's tile)
// and whether the pipeline runs v at all (false: the lockstep pipeline
// measured faster for v's class).
func HopperWSTile(v Variant, keys int) (Tile, bool) {
	d := hopperTileDim(v.DK, v.DV)
	for _, r := range HopperWSTable {
		if d > r.MaxD {
			continue
		}
		if v.extras() {
			return r.Extras, true
		}
		t := r.Plain
		if v.Mask != MaskNone {
			t = r.Masked
		}
		if t != (Tile{}) && r.ShortN != 0 && keys <= r.ShortKeys {
			t.BlockN = r.ShortN
		}
		return t, t != (Tile{})
	}
	return Tile{}, true
}

// defaultBwdTiles returns the tile table row for the variant's dtype and
// padded head dimensions. The table is data: one row per head-dim class.
func defaultBwdTiles(dt attn.DType, dkp, dvp int) BwdTiles {
	d := max(dkp, dvp)
	if dt == attn.Float32 {
		switch {
		case d <= 64:
			return BwdTiles{DKDV: BwdTile{64, 64, 8, 2, 1}, DQ: BwdTile{64, 64, 8, 2, 1}}
		case d <= 128:
			return BwdTiles{DKDV: BwdTile{32, 64, 8, 2, 1}, DQ: BwdTile{64, 32, 8, 2, 1}}
		case d <= 256:
			return BwdTiles{DKDV: BwdTile{32, 32, 8, 2, 1}, DQ: BwdTile{32, 32, 8, 2, 1}}
		default:
			return BwdTiles{DKDV: BwdTile{32, 16, 4, 1, 1}, DQ: BwdTile{16, 32, 4, 1, 1}}
		}
	}
	// Measured on the H200 (bf16, N=4096, see docs/kernels/backward.md): each row is
	// the fastest dK/dV and dQ tile of the candidates swept.
	switch {
	case d <= 64:
		return BwdTiles{DKDV: BwdTile{128, 128, 8, 2, 1}, DQ: BwdTile{64, 64, 4, 2, 2}}
	case d <= 128:
		return BwdTiles{DKDV: BwdTile{64, 128, 8, 2, 1}, DQ: BwdTile{64, 64, 4, 2, 1}}
	case d <= 256:
		return BwdTiles{DKDV: BwdTile{64, 64, 8, 2, 1}, DQ: BwdTile{128, 32, 8, 2, 1}}
	default:
		// 32 query rows and 64 keys, one stage: the fastest of the sweep for every head dim
		// past 256 (docs/kernels/backward.md, "Past D = 256")
		return BwdTiles{DKDV: BwdTile{32, 64, 8, 1, 1}, DQ: BwdTile{32, 32, 8, 2, 1}}
	}
}
