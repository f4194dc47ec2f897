package gpu

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/kernels"
	"github.com/flashattn/flashattn/philox"
)

// dropProbeCase is one warp fragment that drop_probe draws keep bits for:
// mt row tiles of 16 rows by nt key tiles of 8 keys, first key j0 (a
// multiple of 8).
type dropProbeCase struct {
	mt, nt int
	j0     uint32
}

// dropProbeCases covers one to four row tiles, one to 32 key tiles (the
// forward's 256-key tiles), first keys 16-aligned and not, an odd number of
// units (a lone last unit), and keys near 2^32.
var dropProbeCases = []dropProbeCase{
	{1, 1, 0}, {1, 1, 8}, {1, 2, 16}, {1, 2, 24}, {1, 3, 8}, {1, 3, 32}, {1, 4, 0}, {2, 3, 40},
	{2, 6, 0}, {3, 5, 8}, {1, 12, 96}, {4, 16, 0}, {2, 10, 8}, {1, 32, 256}, {4, 32, 8}, {3, 7, 0xffff_0008},
}

// words is the number of u32 of keep bits a lane writes for c.
func (c dropProbeCase) words() int { return c.mt * ((c.nt + 7) / 8) }

// dropProbeRows and dropProbeKeys are the extent of drop_u8_probe's grid of
// elements.
const dropProbeRows, dropProbeKeys = 40, 100

// dropProbeSource is the emulator's source of the dropout probe kernels:
// drop_probe (block x: dropProbeCases[x], one warp) writes each lane's keep
// bits from drop_bits_any, drop_u8_probe (block r: row i0 + r, one warp)
// each element's 8-bit number from drop_u8. Its block of primitives is
// empty (testdata/emu/dropout.h).
func dropProbeSource() string {
	var b strings.Builder
	b.WriteString(`typedef unsigned int u32;
#define DEV static __device__ __forceinline__
` + kernels.PrimitivesBegin + "\n" + kernels.PrimitivesEnd + "\n" + kernels.DropoutSource + `
struct DropProbe {
  u32* bits;  // per case: [32 lanes][MT][(NT + 7) / 8]
  u32* u;     // [ROWS][KEYS]: u of rows i0 + r, keys jb + c
  u32 i0, bh, off, k0, k1, t, jb;
`)
	fmt.Fprintf(&b, "  u32 j0[%d];\n};\n", len(dropProbeCases))
	fmt.Fprintf(&b, "constexpr int ROWS = %d, KEYS = %d;\n", dropProbeRows, dropProbeKeys)
	b.WriteString(`template <int MT, int NT>
DEV void probe_case(const DropProbe& p, int cs, u32 at) {
  const int lane = threadIdx.x & 31;
  u32 bits[MT][(NT + 7) / 8];
  drop_bits_any<MT, NT>(bits, p.i0, p.j0[cs], p.bh, p.off, p.k0, p.k1, p.t, lane);
  for (int mt = 0; mt < MT; ++mt)
    for (int x = 0; x < (NT + 7) / 8; ++x) p.bits[at + (lane * MT + mt) * ((NT + 7) / 8) + x] = bits[mt][x];
}
__global__ void drop_probe(const __grid_constant__ DropProbe p) {
  switch (blockIdx.x) {
`)
	at := 0
	for i, c := range dropProbeCases {
		fmt.Fprintf(&b, "  case %d: probe_case<%d, %d>(p, %d, %du); break;\n", i, c.mt, c.nt, i, at)
		at += 32 * c.words()
	}
	b.WriteString(`  }
}
__global__ void drop_u8_probe(const __grid_constant__ DropProbe p) {
  const u32 r = blockIdx.x;
  for (u32 c = threadIdx.x; c < KEYS; c += 32) p.u[r * KEYS + c] = drop_u8(p.i0 + r, p.jb + c, p.bh, p.off, p.k0, p.k1);
}
`)
	return b.String()
}

// TestDropoutMaskEmulated runs the kernels' dropout mask functions on the
// host emulator and compares them bit for bit with package philox: every
// keep bit drop_bits draws for every lane of each dropProbeCases fragment
// (the forward's and the backward's S tiles in the mma C layout), at
// thresholds 1, 179 (p = 0.3) and 255, and drop_u8 (the non-finite
// fix-ups') over a grid of elements, with rows and keys near 2^32.
func TestDropoutMaskEmulated(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "dropout mask")
	bin := emuBinary(t, dropProbeSource(), "dropout.h", emuDriver("DropProbe", []string{"bits", "u"}, []string{"drop_probe", "drop_u8_probe"}))
	total := 0
	for _, c := range dropProbeCases {
		total += 32 * c.words()
	}
	runs := []struct {
		seed       uint64
		off, i0    uint32
		bh, thresh uint32
		jb         uint32
	}{
		{0x1234_5678_9abc, 11, 5, 7, 179, 3},
		{0xffff_ffff_ffff_ffff, 0xffff_ffff, 0xffff_fff0, 0xffff_ffff, 1, 0xffff_ff00},
		{42, 0, 1000, 0, 255, 16},
	}
	for _, r := range runs {
		t.Run(fmt.Sprintf("seed%x-T%d", r.seed, r.thresh), func(t *testing.T) {
			ar := &emuArena{}
			bitsAt := ar.poisoned(4 * total)
			uAt := ar.poisoned(4 * dropProbeRows * dropProbeKeys)
			params := binary.LittleEndian.AppendUint64(nil, bitsAt)
			params = binary.LittleEndian.AppendUint64(params, uAt)
			for _, x := range []uint32{r.i0, r.bh, r.off, uint32(r.seed), uint32(r.seed >> 32), r.thresh, r.jb} {
				params = binary.LittleEndian.AppendUint32(params, x)
			}
			for _, c := range dropProbeCases {
				params = binary.LittleEndian.AppendUint32(params, c.j0)
			}
			for len(params)%8 != 0 {
				params = append(params, 0)
			}
			emuExec(t, bin, "drop_probe", params, ar, []emuLaunch{
				{"drop_probe", [3]int{len(dropProbeCases), 1, 1}, 32},
				{"drop_u8_probe", [3]int{dropProbeRows, 1, 1}, 32},
			}, nil)
			mask := philox.NewMask(r.seed, r.off, r.thresh, 0, int(r.bh), 1)
			bits := ar.at(bitsAt, 4*total)
			at, bad := 0, 0
			for _, c := range dropProbeCases {
				w := (c.nt + 7) / 8
				for lane := 0; lane < 32; lane++ {
					g, q := lane/4, lane%4
					for mt := 0; mt < c.mt; mt++ {
						for nt := 0; nt < c.nt; nt++ {
							word := binary.LittleEndian.Uint32(bits[4*(at+(lane*c.mt+mt)*w+nt/8):])
							for e := 0; e < 4; e++ {
								i := int(r.i0) + 16*mt + g + 8*(e>>1)
								j := int(c.j0) + 8*nt + 2*q + e&1
								got := word>>(4*(nt%8)+e)&1 == 1
								if want := mask.Keep(i, j); got != want && bad < 5 {
									t.Errorf("case %+v lane %d tile (%d, %d) element %d (row %d, key %d): keep %v, want %v", c, lane, mt, nt, e, uint32(i), j, got, want)
									bad++
								}
							}
						}
					}
				}
				at += 32 * c.words()
			}
			us := ar.at(uAt, 4*dropProbeRows*dropProbeKeys)
			for row := 0; row < dropProbeRows; row++ {
				for k := 0; k < dropProbeKeys; k++ {
					i, j := int(r.i0)+row, int(r.jb)+k
					if got, want := binary.LittleEndian.Uint32(us[4*(row*dropProbeKeys+k):]), mask.Byte(i, j); got != want && bad < 10 {
						t.Errorf("drop_u8 (row %d, key %d) = %#x, want %#x", uint32(i), j, got, want)
						bad++
					}
				}
			}
		})
	}
}

// TestDropoutKeepMaskEmulated is TestDropoutKeepMask on the host emulator:
// the forward kernels' keep mask read back through V = I and compared with
// package philox bit for bit, on every forward kernel family (the mma.sync
// kernels in bf16 and fp32, padded and packed; the Hopper kernels with
// tiles by cp.async, padded and packed, by tensor maps, warp-specialized,
// ping-pong, persistent).
func TestDropoutKeepMaskEmulated(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "forward")
	kinds := []struct {
		name string
		kind emuKernels
		dts  []attn.DType
	}{
		{"mma", emuMMA, []attn.DType{attn.BFloat16, attn.Float32}},
		{"cp.async", emuHopper, []attn.DType{attn.BFloat16}},
		{"tensor-maps", emuHopperTMA, []attn.DType{attn.Float16}},
		{"warp-specialized", emuHopperWS, []attn.DType{attn.BFloat16}},
		{"ping-pong", emuHopperPP, []attn.DType{attn.BFloat16}},
		{"persistent", emuHopperPT, []attn.DType{attn.BFloat16}},
		{"producer-dropout", emuHopperPD, []attn.DType{attn.BFloat16}},
		{"producer-dropout-persistent", emuHopperPDPT, []attn.DType{attn.BFloat16}},
	}
	for _, kd := range kinds {
		for _, dt := range kd.dts {
			for _, packed := range []bool{false, true} {
				// 120 keys: one key block of the Hopper tiles; 248 (value columns too, V = I): several,
				// so that the bits of the main loop's blocks are read back as well
				for _, m := range []int{120, 248} {
					if m == 248 && (kd.kind == emuMMA || packed) {
						continue
					}
					t.Run(fmt.Sprintf("%s/%v-packed=%v-m%d", kd.name, dt, packed, m), func(t *testing.T) {
						t.Parallel()
						checkForwardKeepMask(t, dt, packed, 2, m, 70, 37, func(q, k, v attn.Tensor, opt attn.Options) attn.Result {
							res, vr := fwdEmuRunOn(t, q, k, v, opt, kd.kind)
							t.Logf("%s", vr.Name())
							return res
						})
					})
				}
			}
		}
	}
}

// TestDropoutKeepMaskBackwardEmulated is TestDropoutKeepMaskBackward on the
// host emulator: the backward kernels' keep mask read back through dV and
// the sign of dQ (dropoutMaskInputs) on every backward kernel family, with
// both dQ algorithms, compared with package philox bit for bit; and on the
// mma.sync kernels with dK/dV tiles of 48 keys over 4×2 warps, whose
// second warp column starts 8 keys into a 16-key block (drop_bits_any).
func TestDropoutKeepMaskBackwardEmulated(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	const h, n, m = 2, 63, 120
	for _, fam := range bwdEmuFamilies {
		for _, dt := range []attn.DType{attn.BFloat16, attn.Float32} {
			if fam.kind != emuMMA && !bwdHopperTakes(dt, m, n+1) {
				continue
			}
			in := dropoutMaskInputs(t, dt, h, n, m)
			for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
				t.Run(fmt.Sprintf("%s/%v/%v", fam.name, dt, algo), func(t *testing.T) {
					t.Parallel()
					checkBackwardKeepMask(t, in, emuRunOn(t, in, algo, false, fam.kind))
				})
			}
		}
	}
	odd := kernels.BwdTiles{DKDV: kernels.BwdTile{BlockM: 64, BlockN: 48, Warps: 8, Stages: 2, MinBlocks: 1},
		DQ: kernels.BwdTile{BlockM: 64, BlockN: 48, Warps: 8, Stages: 2, MinBlocks: 1}}
	in := dropoutMaskInputs(t, attn.BFloat16, h, n, m)
	for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
		t.Run(fmt.Sprintf("mma.sync-t64x48/%v", algo), func(t *testing.T) {
			t.Parallel()
			checkBackwardKeepMask(t, in, emuRunTiles(t, in, algo, false, emuMMA, odd))
		})
	}
}

// TestDropoutAtEmulated runs calls placed inside a larger problem
// (Options.DropoutAt: query, key and head origins) on the host emulator,
// forward and backward, on the mma.sync kernels and the Hopper ones by
// tensor maps (lockstep and the persistent pipeline; bulk dQ backward; the
// key-rows backward step over 128 queries),
// against the float64 reference with the same origin; the outputs must
// also differ from the call's own mask, so that the origin reached the
// kernels.
func TestDropoutAtEmulated(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "forward")
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	at := &attn.DropoutOrigin{Query: 37, Key: 48, Head: 1, Heads: 5}
	c := bwdCase{name: "dropout-at", b: 2, n: 70, m: 96, h: 2, hkv: 1, dk: 64, dv: 64, dropout: 0.25, causal: true, dropAt: at}
	own := c
	own.dropAt = nil
	for _, kd := range []struct {
		name     string
		fwd, bwd emuKernels
	}{{"mma", emuMMA, emuMMA}, {"tensor-maps", emuHopperTMA, emuHopperTMA}, {"persistent-bulkdq", emuHopperPT, emuHopperBulk},
		{"keyrows-q128-bulkdq", emuHopperTMA, emuHopperBwdWSKeyRows128Bulk}} {
		t.Run(kd.name, func(t *testing.T) {
			t.Parallel()
			in, base := c.inputs(t, attn.BFloat16, 41), own.inputs(t, attn.BFloat16, 41)
			res, vr := fwdEmuRunOn(t, in.q, in.k, in.v, in.opt, kd.fwd)
			t.Logf("%s", vr.Name())
			fwdCheck(t, attn.BFloat16, in.q, in.k, in.v, in.opt, res)
			if ownRes, _ := fwdEmuRunOn(t, base.q, base.k, base.v, base.opt, kd.fwd); bytes.Equal(ownRes.O.Bytes(), res.O.Bytes()) {
				t.Fatal("forward: O with the origin equals O without it: the origin did not reach the kernel")
			}
			ref, naive := in.oracles(t)
			g := emuRunOn(t, in, DQAtomic, false, kd.bwd)
			checkGrads(t, attn.BFloat16, g, ref, naive)
			if ownG := emuRunOn(t, base, DQAtomic, false, kd.bwd); bytes.Equal(ownG.DV.Bytes(), g.DV.Bytes()) {
				t.Fatal("backward: dV with the origin equals dV without it")
			}
		})
	}
}
