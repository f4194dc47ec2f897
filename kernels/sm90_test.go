package kernels

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// hopperVariant builds a Hopper variant as the GPU backend does, or fails
// the test when HopperTile refuses it.
func hopperVariant(t testing.TB, dt attn.DType, dk, dv int, f func(*Variant)) Variant {
	t.Helper()
	v := Variant{DType: dt, DK: roundUp(dk, 16), DV: roundUp(dv, 16), LoadBytes: 16, LSE: true}
	if f != nil {
		f(&v)
	}
	tile, ok := HopperTile(v)
	if !ok {
		t.Fatalf("HopperTile(%v) refused", v)
	}
	return tile.Apply(v)
}

// hopperDims are the head-dim pairs the Hopper kernel takes: the main ones,
// staged odd dims (padded rows), DK ≠ DV.
var hopperDims = [][2]int{{64, 64}, {128, 128}, {256, 256}, {32, 32}, {59, 59}, {127, 127}, {199, 199}, {16, 256}, {256, 96}, {8, 8},
	{257, 257}, {320, 320}, {384, 384}, {512, 512}, {512, 64}, {64, 512}}

func TestHopperSource(t *testing.T) {
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float16} {
		for _, d := range hopperDims {
			for _, f := range fwdFeatures {
				v := hopperVariant(t, dt, d[0], d[1], f.set)
				src, err := v.Source()
				if err != nil {
					t.Fatalf("%v: %v", v, err)
				}
				for _, want := range []string{"wgmma.mma_async.sync.aligned.m64n", "extern \"C\" __global__", "fence.proxy.async", "load_sw<BM, KCH>"} {
					if !strings.Contains(src, want) {
						t.Fatalf("%v: source lacks %q", v, want)
					}
				}
				if v.SharedBytes() > MaxSharedBytes || v.Threads() != 32*v.WarpsM*v.WarpsN {
					t.Errorf("%v: %d threads, %d bytes of shared memory", v, v.Threads(), v.SharedBytes())
				}
			}
		}
	}
}

func TestHopperTileRefuses(t *testing.T) {
	tests := []struct {
		name string
		v    Variant
	}{
		{"fp32", Variant{DType: attn.Float32, DK: 64, DV: 64, LoadBytes: 16}},
		{"narrow loads", Variant{DType: attn.BFloat16, DK: 64, DV: 64, LoadBytes: 8}},
		{"register-staged", Variant{DType: attn.Float16, DK: 64, DV: 64, LoadBytes: 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tile, ok := HopperTile(tt.v); ok {
				t.Errorf("HopperTile gave %+v", tile)
			}
		})
	}
}

func TestHopperValidate(t *testing.T) {
	ok := hopperVariant(t, attn.BFloat16, 128, 128, nil)
	tests := []struct {
		name string
		set  func(*Variant)
		want error
	}{
		{"ok", func(*Variant) {}, nil},
		{"fp32", func(v *Variant) { v.DType = attn.Float32 }, attn.ErrUnsupported},
		{"8-byte loads", func(v *Variant) { v.LoadBytes = 8 }, attn.ErrUnsupported},
		{"split keys", func(v *Variant) { v.WarpsN, v.BlockN = 2, 128 }, attn.ErrShape},
		{"six warps", func(v *Variant) { v.WarpsM, v.BlockM = 6, 96 }, attn.ErrShape},
		{"two row groups split", func(v *Variant) { v.WarpsN = 2 }, attn.ErrShape},
		{"one stage", func(v *Variant) { v.Stages = 1 }, attn.ErrShape},
		{"dv 336", func(v *Variant) { v.DV = 336 }, attn.ErrUnsupported},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := ok
			tt.set(&v)
			err := v.Validate()
			if tt.want == nil && err != nil || tt.want != nil && !errors.Is(err, tt.want) {
				t.Errorf("Validate = %v, want %v", err, tt.want)
			}
		})
	}
}

// TestCompileHopper compiles Hopper variants for sm_90a with NVRTC (12.0 or
// later; skipped otherwise) and checks ptxas's report: no spills, and no
// serialization of the asynchronous products (ptxas warning C7514 and
// kin), which would quietly cost the overlap the kernel is built for.
func TestCompileHopper(t *testing.T) {
	c := compilerOrSkip(t)
	if major, _ := c.Version(); major < 12 {
		t.Skipf("NVRTC %s cannot target sm_90a", c.VersionString())
	}
	var vs []Variant
	for _, d := range [][2]int{{64, 64}, {128, 128}, {256, 256}, {320, 320}, {512, 512}, {384, 384}, {272, 272}, {288, 288}, {208, 208}} {
		for _, f := range fwdFeatures {
			vs = append(vs, hopperVariant(t, attn.BFloat16, d[0], d[1], f.set))
		}
	}
	if testing.Short() {
		vs = []Variant{vs[0], vs[6], vs[11], vs[16], vs[21]}
	}
	// tensor-map loads: every dim, plain, causal, softcap with bias, and packed batches (with dropout and a window)
	for _, d := range [][2]int{{64, 64}, {128, 128}, {208, 208}, {256, 256}, {272, 272}, {320, 320}, {384, 384}, {512, 512}} {
		for _, f := range fwdFeatures[:4] {
			v := hopperVariant(t, attn.BFloat16, d[0], d[1], f.set)
			v.TMA = true
			vs = append(vs, v)
			if testing.Short() {
				break
			}
		}
	}
	// odd head dims read in place (flat rows; the variant's dims are the padded ones)
	for _, d := range [][2]int{{208, 208}, {208, 192}, {272, 272}, {128, 128}} {
		v := hopperVariant(t, attn.BFloat16, d[0], d[1], fwdFeatures[0].set)
		v.TMA, v.Flat = true, true
		vs = append(vs, v)
	}
	// ... and with the heads that do not fit read from staging copies (59, 127)
	for _, d := range [][2]int{{64, 64}, {128, 128}} {
		v := hopperVariant(t, attn.BFloat16, d[0], d[1], fwdFeatures[0].set)
		v.TMA, v.Flat, v.FlatStaged = true, true, true
		vs = append(vs, v)
	}
	checkHopperCompiles(t, c, vs)
}

// TestCompileHopperWarpSpecialized compiles warp-specialized forward
// variants for sm_90a (NVRTC 12.0 or later) over every head-dim class of one
// warpgroup per row group, plain and with the element-wise features, packed
// batches and flat rows too, with ping-pong and the early rescale (and persistent) and
// without, and checks
// ptxas's report as TestCompileHopper does: no spills
// under the compute warpgroups' raised register budget, no serialized
// products.
func TestCompileHopperWarpSpecialized(t *testing.T) {
	c := compilerOrSkip(t)
	if major, _ := c.Version(); major < 12 {
		t.Skipf("NVRTC %s cannot target sm_90a", c.VersionString())
	}
	var vs []Variant
	for _, d := range [][2]int{{64, 64}, {128, 128}, {208, 208}, {256, 256}, {320, 320}} {
		for _, f := range fwdFeatures[:4] {
			v := hopperVariant(t, attn.BFloat16, d[0], d[1], f.set)
			v.TMA, v.WarpSpecialized = true, true
			vs = append(vs, v)
			v.PingPong = true
			v.EarlyRescale = v.geom().dvp <= 256
			vs = append(vs, v)
			if v.Varlen {
				continue // (persistent CTAs take fixed-length batches)
			}
			v.Persistent = true
			vs = append(vs, v)
			if testing.Short() {
				break
			}
		}
	}
	v := hopperVariant(t, attn.Float16, 128, 128, fwdFeatures[0].set)
	v.TMA, v.Flat, v.FlatStaged, v.WarpSpecialized = true, true, true, true
	vs = append(vs, v)
	// the light-tail CTA order on a causal warp-specialized variant
	lt := hopperVariant(t, attn.BFloat16, 128, 128, fwdFeatures[1].set)
	lt.TMA, lt.Pipeline, lt.LightTail = true, Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}, true
	vs = append(vs, lt)
	// the early dropout bits on the extras' 128-key tile at D = 64 and 128, and on the persistent pipeline
	for _, d := range []int{64, 128} {
		ed := hopperVariant(t, attn.BFloat16, d, d, func(v *Variant) { v.Dropout = true })
		ed.BlockN, ed.TMA, ed.Pipeline = 128, true, Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, EarlyDropout: true}
		if ed.Validate() == nil {
			vs = append(vs, ed)
			ed.Persistent, ed.StoreO = true, true
			if ed.Validate() == nil {
				vs = append(vs, ed)
			}
		}
		// the keep bits drawn by the producer's warps instead, masked (causal, windows) too, one tile a CTA and persistent
		for _, causal := range []bool{false, true} {
			pd := hopperVariant(t, attn.BFloat16, d, d, func(v *Variant) { v.Dropout = true })
			pd.BlockN, pd.TMA, pd.Pipeline = 128, true, Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, ProducerDropout: true}
			if causal {
				pd.Mask = MaskWindow
			}
			if pd.Validate() == nil {
				vs = append(vs, pd)
			}
			pd.Persistent, pd.StoreO = true, true // the short pipeline's
			if pd.Validate() == nil {
				vs = append(vs, pd)
			}
		}
	}
	// the lazy rescale on the long pipeline (D = 64, 128, with dropout), the short one and the lockstep kernels
	for _, d := range []int{64, 128} {
		for _, f := range []func(*Variant){func(*Variant) {}, func(v *Variant) { v.Dropout = true }} {
			lr := hopperVariant(t, attn.BFloat16, d, d, f)
			lr.TMA, lr.Pipeline = true, Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, LazyRescale: true}
			vs = append(vs, lr)
		}
	}
	lr := hopperVariant(t, attn.Float16, 128, 128, fwdFeatures[1].set)
	lr.TMA, lr.Pipeline = true, Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true, StoreO: true, LazyRescale: true}
	vs = append(vs, lr)
	lr.Pipeline = Pipeline{EarlyRescale: true, LazyRescale: true}
	vs = append(vs, lr)
	// the polynomial exponentials on the long pipeline (D = 64 and 128 with softcap), the short one and the lockstep kernels
	for _, d := range []int{64, 128} {
		f := func(*Variant) {}
		if d == 128 {
			f = func(v *Variant) { v.Softcap = true }
		}
		pe := hopperVariant(t, attn.BFloat16, d, d, f)
		pe.TMA, pe.Pipeline = true, Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, PolyExp: 1}
		vs = append(vs, pe)
		pe.Pipeline = Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true, StoreO: true, DoubleQ: true, CarryTurns: true, PolyExp: 2}
		vs = append(vs, pe)
	}
	pe := hopperVariant(t, attn.Float16, 64, 64, fwdFeatures[1].set)
	pe.TMA, pe.Pipeline = true, Pipeline{EarlyRescale: true, PolyExp: 2}
	vs = append(vs, pe)
	// the head-major tile order of the short pipeline, D = 64 and 128 unmasked, and causal (the counter's schedule)
	for _, d := range []int{64, 128, -128} {
		f := fwdFeatures[0].set
		if d < 0 {
			d, f = -d, fwdFeatures[1].set
		}
		hm := hopperVariant(t, attn.BFloat16, d, d, f)
		hm.TMA, hm.Pipeline = true, Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true, StoreO: true, HeadMajor: true}
		vs = append(vs, hm)
	}
	// two Q buffers on the short pipeline, D = 64 and 128 (at 128 keys) unmasked, and causal (the counter's schedule);
	// and with ping-pong's turns carried across tiles
	for _, d := range []int{64, 128, -128} {
		f := fwdFeatures[0].set
		if d < 0 {
			d, f = -d, fwdFeatures[1].set
		}
		q2 := hopperVariant(t, attn.BFloat16, d, d, f)
		q2.BlockN, q2.TMA, q2.Pipeline = 128, true, Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true, StoreO: true, LazyRescale: true, DoubleQ: true}
		vs = append(vs, q2)
		ct := q2
		ct.CarryTurns = true
		vs = append(vs, ct)
	}
	// two Q buffers at D = 256 on 48-key blocks, O from registers (gpu's narrowForDoubleQ), plain and causal
	for _, f := range fwdFeatures[:2] {
		nq := hopperVariant(t, attn.BFloat16, 256, 256, f.set)
		nq.BlockN, nq.TMA, nq.Pipeline = 48, true, Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true, LazyRescale: true, DoubleQ: true, CarryTurns: true}
		vs = append(vs, nq)
	}
	// O stored by tensor maps, on the lockstep and on the full pipeline, where it fits
	for _, d := range []int{64, 128, 208, 256} {
		for _, f := range fwdFeatures[:2] {
			v := hopperVariant(t, attn.BFloat16, d, d, f.set)
			v.TMA, v.StoreO = true, true
			if v.Validate() != nil {
				continue
			}
			vs = append(vs, v)
			v.WarpSpecialized, v.PingPong, v.EarlyRescale, v.Persistent = true, true, true, true
			vs = append(vs, v)
		}
	}
	checkHopperCompiles(t, c, vs)
}

// fwdSpillLimit returns the bytes a Hopper forward kernel of v may spill:
// none, or with the producer's dropout keep bits 16 (32 persistent), whose
// keep warps at the producer's 24 registers keep a few values in local
// memory across key blocks and tiles (loads once a block, outside the loop
// of Philox calls; NVRTC 12.4: 4–12 bytes, 28–32 persistent).
func fwdSpillLimit(v Variant) int {
	switch {
	case v.ProducerDropout && v.Persistent:
		return 32
	case v.ProducerDropout:
		return 16
	}
	return 0
}

// checkHopperCompiles compiles vs for sm_90a and fails on more spills than
// fwdSpillLimit allows and on serialized warpgroup products in ptxas's
// report.
func checkHopperCompiles(t *testing.T, c *cuda.Compiler, vs []Variant) {
	t.Helper()
	res, logs := compileAllLogs(t, c, "sm_90a", vs)
	for i, v := range vs {
		r := res[i]
		t.Logf("%s: %d registers, %d B stack, spills %d/%d", v, r.Registers, r.StackBytes, r.SpillStores, r.SpillLoads)
		if limit := fwdSpillLimit(v); r.SpillStores > limit || r.StackBytes > limit {
			t.Errorf("%s spills: %d B stack, %d B stores (at most %d)", v, r.StackBytes, r.SpillStores, limit)
		}
		if strings.Contains(logs[i], "wgmma.mma_async instructions are serialized") {
			t.Errorf("%s: ptxas serialized the warpgroup products:\n%s", v, grepLines(logs[i], "serialized"))
		}
	}
}

// grepLines returns the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// bwdHopperVariants are Hopper backward variants over both warpgroup
// splits (keys up to 128, columns past it), odd staged dims, DK ≠ DV and
// the element-wise features.
func bwdHopperVariants() []BwdVariant {
	var vs []BwdVariant
	for _, d := range [][2]int{{64, 64}, {128, 128}, {96, 96}, {32, 128}, {256, 256}, {192, 192}, {160, 256}, {208, 208}, {144, 224}, {80, 112}} {
		for _, atomic := range []bool{true, false} {
			for _, masked := range []bool{false, true} {
				vs = append(vs, BwdVariant{DType: attn.BFloat16, DK: d[0], DV: d[1], Features: Features{Mask: MaskFor(masked)}, Vector: true, AtomicDQ: atomic, WGMMA: true})
			}
		}
	}
	return append(vs,
		BwdVariant{DType: attn.BFloat16, DK: 199, DV: 199, Staged: true, AtomicDQ: true, WGMMA: true},
		BwdVariant{DType: attn.Float16, DK: 127, DV: 127, Features: Features{Mask: MaskWindow}, Staged: true, WGMMA: true},
		BwdVariant{DType: attn.Float16, DK: 64, DV: 64, Features: Features{Mask: MaskWindow, Softcap: true, Bias: BiasF32, Dropout: true}, Vector: true, AtomicDQ: true, BiasGrad: true, WGMMA: true},
		BwdVariant{DType: attn.BFloat16, DK: 256, DV: 256, Features: Features{Softcap: true, Dropout: true, Varlen: true}, Vector: true, AtomicDQ: true, WGMMA: true},
		// past 256 (the deep kernels, separate dQ only): equal and uneven slices, every feature, a staged odd dim
		BwdVariant{DType: attn.BFloat16, DK: 272, DV: 272, Vector: true, WGMMA: true},
		BwdVariant{DType: attn.BFloat16, DK: 320, DV: 320, Features: Features{Mask: MaskFor(true)}, Vector: true, WGMMA: true},
		BwdVariant{DType: attn.BFloat16, DK: 384, DV: 384, Vector: true, WGMMA: true},
		BwdVariant{DType: attn.BFloat16, DK: 512, DV: 512, Vector: true, WGMMA: true},
		BwdVariant{DType: attn.BFloat16, DK: 512, DV: 512, Features: Features{Mask: MaskFor(true)}, Vector: true, WGMMA: true},
		BwdVariant{DType: attn.Float16, DK: 512, DV: 512, Features: Features{Mask: MaskWindow, Softcap: true, Bias: BiasF32, Dropout: true}, Vector: true, BiasGrad: true, WGMMA: true},
		BwdVariant{DType: attn.Float16, DK: 301, DV: 384, Features: Features{Mask: MaskWindow}, Staged: true, WGMMA: true},
		BwdVariant{DType: attn.BFloat16, DK: 320, DV: 320, Features: Features{Mask: MaskFor(true), Dropout: true, Varlen: true}, Vector: true, WGMMA: true},
	)
}

// bwdHopperTMAVariants returns the fixed-length variants of
// bwdHopperVariants with tensor-map loads.
func bwdHopperTMAVariants() []BwdVariant {
	var vs []BwdVariant
	for _, v := range bwdHopperVariants() {
		if !v.Varlen {
			v.TMA = true
			vs = append(vs, v)
		}
	}
	// odd head dims read in place (flat rows): both warpgroup splits, crossed and not
	return append(vs,
		BwdVariant{DType: attn.BFloat16, DK: 199, DV: 199, Flat: true, WGMMA: true, TMA: true},
		BwdVariant{DType: attn.BFloat16, DK: 199, DV: 199, Features: Features{Mask: MaskWindow}, Flat: true, AtomicDQ: true, WGMMA: true, TMA: true},
		BwdVariant{DType: attn.Float16, DK: 201, DV: 185, Features: Features{Mask: MaskWindow, Softcap: true, Bias: BiasF16, Dropout: true}, Flat: true, BiasGrad: true, WGMMA: true, TMA: true},
		BwdVariant{DType: attn.BFloat16, DK: 121, DV: 121, Flat: true, AtomicDQ: true, WGMMA: true, TMA: true},
	)
}

// TestBwdTMASource checks the tensor-map kernels: their argument, the
// accelerator loads of the streamed tiles (and no per-thread copies of
// them), the stage barriers, and the refusal of packed batches.
func TestBwdTMASource(t *testing.T) {
	for _, v := range bwdHopperTMAVariants() {
		src, err := v.Source()
		if err != nil {
			t.Fatalf("%s: %v", v.Name(), err)
		}
		wait := func(stages int) string { // the wait for a step's streamed tiles
			if stages == 1 {
				return "mbar_wait(bar, it & 1);"
			}
			return "mbar_wait(bar + 8 * st, (it >> 1) & 1);"
		}
		tiles := v.ResolvedTiles()
		for _, want := range []string{
			BwdDKDVKernel + "(const __grid_constant__ BwdTmaParams tp)", BwdDQKernel + "(const __grid_constant__ BwdTmaParams tp)",
			"static_assert(sizeof(BwdTmaParams) ==", "tma_rows<BM, QA>(sQ + s * Q_STAGE, &tp.a", "tma_rows<BM, DA>(sdO + s * DO_STAGE, &tp.b",
			"(sK + s * K_STAGE, &tp.a", "(sV + s * V_STAGE, &tp.b", wait(tiles.DKDV.Stages), wait(tiles.DQ.Stages),
			BwdPreKernel + "(const BwdParams p)",
		} {
			if !strings.Contains(src, want) {
				t.Errorf("%s: source lacks %q", v.Name(), want)
			}
		}
		for _, not := range []string{"load_sw<BM, KCH, DK, NTH>(sQ + s * Q_STAGE", "load_sw<BN, KCH, DK, NTH>(sK + s * K_STAGE"} {
			if strings.Contains(src, not) {
				t.Errorf("%s: source still copies a streamed tile by the threads (%q)", v.Name(), not)
			}
		}
		if !strings.Contains(v.Name(), "_tma_") {
			t.Errorf("key %s lacks _tma", v.Name())
		}
	}
	v := BwdVariant{DType: attn.BFloat16, DK: 64, DV: 64, Features: Features{Varlen: true}, Vector: true, WGMMA: true, TMA: true}
	src, err := v.Source()
	if err != nil {
		t.Fatalf("packed batch with tensor maps: %v", err)
	}
	// a packed batch's boxes start at the sequence's first row (qr0, kr0) of batch element 0
	for _, want := range []string{"&tp.a, bar + 8 * s, (int)qr0 + iq, hq, 0);", "&tp.a, bar + 8 * s, (int)kr0 + jk, kvh, 0);"} {
		if !strings.Contains(src, want) {
			t.Errorf("packed batch with tensor maps: source lacks %q", want)
		}
	}
	v.Varlen, v.WGMMA = false, false
	if err := v.Validate(); !errors.Is(err, attn.ErrUnsupported) {
		t.Errorf("mma.sync kernels with tensor maps: Validate = %v, want ErrUnsupported", err)
	}
}

// TestBwdTMAArgs checks the argument layout of the tensor-map kernels and
// the tensors their maps describe (the staging copies for a staged
// variant; placeholder strides on dims of one).
func TestBwdTMAArgs(t *testing.T) {
	var a, b [128]byte
	a[0], b[127] = 1, 2
	p := BwdParams{Q: 0x1000, DO: 0x2000, K: 0x3000, V: 0x4000, PQ: 0x5000, PDO: 0x6000, PK: 0x7000, PV: 0x8000,
		B: 1, N: 300, M: 200, H: 8, Hkv: 2,
		QS: BwdStrides{Batch: 0, Row: 8 * 64, Head: 64}, DOS: BwdStrides{Row: 8 * 64, Head: 64},
		KS: BwdStrides{Row: 2 * 64, Head: 64}, VS: BwdStrides{Row: 2 * 64, Head: 64}}
	params := p.Pack()
	args := BwdTMAArgs(params, a, b)
	if len(args)%64 != 0 || len(args) < 256+len(params) || args[0] != 1 || args[255] != 2 || !bytes.Equal(args[256:256+len(params)], params) {
		t.Fatalf("argument of %d bytes: maps or params misplaced", len(args))
	}
	v := BwdVariant{DType: attn.BFloat16, DK: 64, DV: 64, Vector: true, WGMMA: true, TMA: true}
	dkdv, dq := v.TMATensors(&p)
	tl := v.ResolvedTiles()
	want := TMATensor{Addr: 0x1000, Cols: 64, Rows: 300, Heads: 8, B: 1, Strides: [3]uint64{1024, 128, 16}, BoxRows: uint32(tl.DKDV.BlockM)}
	if dkdv[0] != want {
		t.Errorf("q: %+v, want %+v", dkdv[0], want)
	}
	want = TMATensor{Addr: 0x4000, Cols: 64, Rows: 200, Heads: 2, B: 1, Strides: [3]uint64{256, 128, 16}, BoxRows: uint32(tl.DQ.BlockN)}
	if dq[1] != want {
		t.Errorf("v: %+v, want %+v", dq[1], want)
	}
	for _, x := range append(dkdv[:], dq[:]...) {
		for i, st := range x.Strides {
			if st == 0 || st%16 != 0 {
				t.Errorf("%+v: stride %d not a positive multiple of 16 bytes", x, i)
			}
		}
	}
	v = BwdVariant{DType: attn.BFloat16, DK: 199, DV: 199, Staged: true, WGMMA: true, TMA: true}
	p.PKS = BwdStrides{Row: 2 * 208, Head: 208}
	_, dq = v.TMATensors(&p)
	if dq[0].Addr != 0x7000 || dq[0].Cols != 208 || dq[0].Strides[0] != 2*208*2 {
		t.Errorf("staged k: %+v, want the copy at 0x7000, 208 columns, rows 832 bytes apart", dq[0])
	}
}

func TestBwdHopperSource(t *testing.T) {
	for _, v := range bwdHopperVariants() {
		src, err := v.Source()
		if err != nil {
			t.Fatalf("%s: %v", v.Name(), err)
		}
		for _, want := range []string{"wgmma.mma_async.sync.aligned.m64n", "fence.proxy.async", "sw_elem<BM>(il, jl)", BwdDKDVKernel, BwdDQKernel} {
			if !strings.Contains(src, want) {
				t.Fatalf("%s: source lacks %q", v.Name(), want)
			}
		}
		if s := v.DKDVSharedBytes(); s > MaxSharedBytes {
			t.Errorf("%s: %d bytes of shared memory", v.Name(), s)
		}
	}
}

func TestBwdHopperOK(t *testing.T) {
	tests := []struct {
		name string
		v    BwdVariant
		want bool
	}{
		{"bf16 128", BwdVariant{DType: attn.BFloat16, DK: 128, DV: 128, Vector: true}, true},
		{"fp16 staged 199", BwdVariant{DType: attn.Float16, DK: 199, DV: 199, Staged: true}, true},
		{"fp32", BwdVariant{DType: attn.Float32, DK: 64, DV: 64, Vector: true}, false},
		{"element-wise loads", BwdVariant{DType: attn.BFloat16, DK: 64, DV: 64}, false},
		{"dk 64 dv 256", BwdVariant{DType: attn.BFloat16, DK: 64, DV: 256, Vector: true}, false},
		{"dk 320 (the deep kernels)", BwdVariant{DType: attn.BFloat16, DK: 320, DV: 320, Vector: true}, true},
		{"dk 512 dv 256", BwdVariant{DType: attn.BFloat16, DK: 512, DV: 256, Vector: true}, false},
		{"tile override", BwdVariant{DType: attn.BFloat16, DK: 64, DV: 64, Vector: true, Tiles: BwdTiles{DKDV: BwdTile{64, 64, 4, 2, 1}}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := BwdHopperOK(tt.v); got != tt.want {
				t.Errorf("BwdHopperOK = %v, want %v", got, tt.want)
			}
			w := tt.v
			w.WGMMA = true
			if err := w.Validate(); (err == nil) != tt.want {
				t.Errorf("Validate with WGMMA = %v", err)
			}
		})
	}
}

// TestBwdCompileHopper compiles the Hopper backward variants (dK/dV and dQ
// kernels) for sm_90a
// (NVRTC 12.0 or later; skipped otherwise): no serialized warpgroup
// products, and at most 32 bytes of spills (head dim 128 with softcap,
// dropout or bias sits at the register limit); the light-tail order on one
// masked variant each of the lockstep and key-rows kernels too.
func TestBwdCompileHopper(t *testing.T) {
	c := compilerOrSkip(t)
	if major, _ := c.Version(); major < 12 {
		t.Skipf("NVRTC %s cannot target sm_90a", c.VersionString())
	}
	vs := bwdHopperVariants()
	tma := bwdHopperTMAVariants()
	bulk := bwdHopperBulkDQVariants()
	ws := bwdHopperWSVariants()
	keyRows := bwdHopperKeyRowsVariants()
	keyRowsDropout := bwdHopperKeyRowsDropoutVariants()
	if testing.Short() {
		vs = []BwdVariant{vs[1], vs[5], vs[17]}
		tma = []BwdVariant{tma[1], tma[9], tma[len(tma)-3]}
		bulk = bulk[:2]
		ws = []BwdVariant{ws[0], ws[len(ws)/2], ws[len(ws)-1]}
		keyRows = []BwdVariant{keyRows[0], keyRows[len(keyRows)-1]}
		keyRowsDropout = keyRowsDropout[:1]
	}
	// the light-tail CTA order on a masked variant of each of the lockstep and key-rows kernels
	var tails []BwdVariant
	for _, group := range [][]BwdVariant{tma, keyRows} {
		for _, v := range group {
			if v.LightTail = true; v.Validate() == nil {
				tails = append(tails, v)
				break
			}
		}
	}
	// the persistent dK/dV kernel on every key-rows variant above that takes it (PersistentOK)
	var persistent []BwdVariant
	for _, v := range append(append(append([]BwdVariant(nil), keyRows...), tails...), keyRowsDropout...) {
		if v.Persistent = true; v.Validate() == nil {
			persistent = append(persistent, v)
		}
	}
	// the producer's dropout keep bits on every dropout variant above that takes them
	var keep []BwdVariant
	for _, v := range append(append([]BwdVariant(nil), keyRows...), keyRowsDropout...) {
		if v.ProducerDropout = true; v.Validate() == nil {
			keep = append(keep, v)
		}
	}
	checkBwdHopperCompiles(t, c, append(append(append(append(append(append(append(append(vs, tma...), bulk...), ws...), keyRows...), tails...), keyRowsDropout...), persistent...), keep...))
}

// bwdHopperKeyRowsDropoutVariants returns key-rows variants under dropout
// as the planner takes them (atomic dQ by bulk reduce-adds, steps of 128
// queries at D ≤ 64), alone and with each feature that costs registers
// beside the keep bits: the mask, the softcap, a bias, the bias gradient;
// those that Validate declines are left out.
func bwdHopperKeyRowsDropoutVariants() []BwdVariant {
	var vs []BwdVariant
	for _, d := range []int{64, 128} {
		for _, f := range []Features{
			{Dropout: true},
			{Dropout: true, Mask: MaskFor(true)},
			{Dropout: true, Softcap: true},
			{Dropout: true, Bias: BiasBF16},
			{Dropout: true, Bias: BiasBF16, Mask: MaskWindow},
		} {
			for _, grad := range []bool{false, true} {
				if grad && f.Bias == BiasNone {
					continue
				}
				v := BwdVariant{DType: attn.BFloat16, DK: d, DV: d, Features: f, Vector: true, AtomicDQ: true, BulkDQ: true, BiasGrad: grad,
					WGMMA: true, TMA: true, WarpSpecialized: true, KeyRows: true}
				if d <= 64 {
					v.QueryStep = 128
				}
				if v.Validate() != nil {
					continue // declined (QueryStepOK): the planner serves it with the table's kernels
				}
				vs = append(vs, v)
			}
		}
	}
	return vs
}

// bwdHopperKeyRowsVariants returns the variants of bwdHopperWSVariants
// that take the key-rows step, with it, and those that take it over steps
// of 80 queries and of 128 (QueryStepOK), the atomic dQ at D ≤ 64 only
// there.
func bwdHopperKeyRowsVariants() []BwdVariant {
	var vs, steps []BwdVariant
	for _, v := range bwdHopperWSVariants() {
		if !KeyRowsOK(v) {
			// the atomic dQ at D ≤ 64 takes the key-rows step only over 128 queries (its rows split)
			if v.KeyRows, v.QueryStep = true, 128; v.Validate() == nil {
				steps = append(steps, v)
			}
			continue
		}
		v.KeyRows = true
		vs = append(vs, v)
		for _, q := range []int{80, 128} {
			if v.QueryStep = q; QueryStepOK(v) {
				steps = append(steps, v)
			}
		}
	}
	return append(vs, steps...)
}

// TestKeyRowsSource checks the key-rows step's source: S and dP with the
// key tiles as A, the dV and dK products from registers, P never stored
// and dS only with the atomic dQ (at its query-row place, before the
// barrier and the dQ product, reduced once dV and dQ are complete), a
// bias from global memory addressed once a step, the Pᵀ loop's test-free
// copy where it applies; and that Validate refuses it where KeyRowsOK does
// not hold.
func TestKeyRowsSource(t *testing.T) {
	vs := append(bwdHopperKeyRowsVariants(), bwdHopperKeyRowsDropoutVariants()...)
	for _, v := range bwdHopperKeyRowsDropoutVariants() { // and their biased forms without dropout
		if v.Dropout = false; v.Biased() && v.Validate() == nil {
			vs = append(vs, v)
		}
	}
	for _, grad := range []bool{false, true} { // a bias on the 128-query step (Validate declines it under dropout)
		v := BwdVariant{DType: attn.BFloat16, DK: 64, DV: 64, Features: Features{Bias: BiasBF16}, BiasGrad: grad, Vector: true, AtomicDQ: true, BulkDQ: true,
			WGMMA: true, TMA: true, WarpSpecialized: true, KeyRows: true, QueryStep: 128}
		if err := v.Validate(); err != nil {
			t.Fatalf("%s: %v", v.Name(), err)
		}
		vs = append(vs, v)
	}
	if len(vs) < 4 {
		t.Fatalf("%d key-rows variants", len(vs))
	}
	biased, earlies, prefetches := 0, 0, 0 // variants that read a bias from global memory: addressed once a step, loaded early, prefetched
	defer func() {
		if biased == 0 || earlies == 0 || prefetches == 0 {
			t.Errorf("key-rows variants with a bias from global memory checked: %d hoisted, %d loaded early, %d prefetched; want some of each", biased, earlies, prefetches)
		}
	}()
	for _, v := range vs {
		src, err := v.Source()
		if err != nil {
			t.Fatalf("%s: %v", v.Name(), err)
		}
		for _, want := range []string{v.keyRowsScores() + "(accS[0], dKs + ", "wg_rq(accdK[0], as, dqn", "(accdV[0], ap, ddn",
			fmt.Sprintf("constexpr int BM = %d, BN = 128", v.ResolvedTiles().DKDV.BlockM)} {
			if !strings.Contains(src, want) {
				t.Errorf("%s: source lacks %q", v.Name(), want)
			}
		}
		if strings.Contains(src, "sw_elem<BM>(il, jl)") {
			t.Errorf("%s: the key-rows step stores P or dS by query rows", v.Name())
		}
		// under dropout: the warp's bits drawn once a step, dP kept or zeroed before dS, P dropped after it for dV
		draw := strings.Index(src, "drop_bits_kr<BM / 8>(dkeep, (u32)(i0 + p.drop_q0)")
		dp := strings.Index(src, "((kw >> c) & 1u ? accP[0][nt][hh * 2 + c] * p.drop_scale : 0.f)")
		dropP := strings.Index(src, "pk[nt][hh] = pack2((kw & 1u) ? pr[0] * p.drop_scale : 0.f")
		dv := strings.Index(src, "(accdV[0], ap, ddn")
		if v.Dropout != (draw >= 0) || v.Dropout != (dp >= 0) || v.Dropout != (dropP >= 0) {
			t.Errorf("%s: dropout %v, keep bits drawn %v, dP dropped %v, P dropped %v", v.Name(), v.Dropout, draw >= 0, dp >= 0, dropP >= 0)
		} else if v.Dropout && !(draw < dp && dp < dropP && dropP < dv) {
			t.Errorf("%s: bits at %d, dP at %d, P dropped at %d, dV product at %d: want them in that order", v.Name(), draw, dp, dropP, dv)
		}
		// a bias from global memory without softcap or dropout, above DK = 64 only with dBias: the thread's two key addresses once a step, an element's one add away
		hoisted := strings.Contains(src, "const BT* bkr[2];") && strings.Contains(src, "bt_to_f(bkr[hh][(nt * 8 + c) * bsi])")
		if want := v.Biased() && !v.BiasStaged && !v.Softcap && !v.Dropout && (v.DK <= 64 || v.BiasGrad); hoisted != want || want && strings.Contains(src, "(qi + c) * p.bias_si") {
			t.Errorf("%s: bias addresses hoisted %v, want %v (or the 64-bit index an element left)", v.Name(), hoisted, want)
		} else if hoisted {
			biased++
		}
		// a bias from global memory on the 128-query step: its rows prefetched into L1 before the products
		prefetched := strings.Contains(src, "prefetch_l1(row);")
		if want := v.Biased() && !v.BiasStaged && v.bwdHopperTile().BlockM > 64; prefetched != want {
			t.Errorf("%s: bias rows prefetched %v, want %v", v.Name(), prefetched, want)
		} else if prefetched {
			if pf, s := strings.Index(src, "prefetch_l1(row);"), strings.Index(src, "wgmma_commit();  // S"); pf > s {
				t.Errorf("%s: the bias prefetch at %d, after S's commit at %d", v.Name(), pf, s)
			}
			prefetches++
		}
		// a 16-bit bias from global memory without a mask, dBias, softcap or dropout, on steps of at most 64 queries: loaded while S and dP run, at the step's hoisted addresses
		early := strings.Contains(src, "u32 bpre[BM / 8][2];") && strings.Contains(src, "_to_f32((u16)(bpre[nt][hh] >> (16 * c)))")
		if want := v.Biased() && v.Bias.DType() != attn.Float32 && !v.BiasStaged && !v.Masked() && !v.Softcap && !v.Dropout && !v.BiasGrad &&
			v.bwdHopperTile().BlockM <= 64; early != want {
			t.Errorf("%s: bias loaded while the products run %v, want %v", v.Name(), early, want)
		} else if early {
			decl, loads, wait := strings.Index(src, "const BT* bkr[2];"), strings.Index(src, "bpre[nt][hh] = w;"), strings.Index(src, "wgmma_wait<1>();  // S is done")
			if dp := strings.Index(src, "wgmma_commit();  // dP"); !(decl >= 0 && decl < dp && dp < loads && loads < wait) {
				t.Errorf("%s: the bias addresses at %d and loads at %d, want them before dP's commit (%d) and between it and S's wait (%d)", v.Name(), decl, loads, dp, wait)
			}
			if strings.Contains(src, "(qi + c) * p.bias_si") {
				t.Errorf("%s: an element's 64-bit bias index left beside the early loads", v.Name())
			}
			earlies++
		}
		// the Pᵀ loop twice (a copy without the visibility test for full steps) only without a mask or an element-wise feature
		loops, split := strings.Count(src, "pk[nt][hh] = pack2(ex2f(x[0]), ex2f(x[1]));"), strings.Contains(src, "if (full) {  // every key of the step in the sequence")
		if want := !v.Masked() && !v.Biased() && !v.Softcap && !v.Dropout; split != want || loops != map[bool]int{false: 1, true: 2}[want] {
			t.Errorf("%s: Pᵀ loop split %v (%d copies), want %v", v.Name(), split, loops, want)
		}
		inRegs := strings.Contains(src, "float lc[BM / 8][2], dc[BM / 8][2];") && strings.Contains(src, "const float2 l2 = *reinterpret_cast<const float2*>(sL + st * BM + nt * 8 + 2 * t4);") &&
			strings.Contains(src, "const float2 d2 = *reinterpret_cast<const float2*>(sD + st * BM + nt * 8 + 2 * t4);")
		fromStage := strings.Contains(src, "const float* lcs = sL + st * BM + 2 * t4;") && strings.Contains(src, "const float2 lc2 = *reinterpret_cast<const float2*>(lcs + nt * 8);") && strings.Contains(src, "const float2 dc2 = *reinterpret_cast<const float2*>(dcs + nt * 8);")
		if wantStage := v.QueryStep == 128; inRegs == wantStage || fromStage != wantStage {
			t.Errorf("%s: LSE2 and Delta in registers %v, read from the stage %v; want the stage %v", v.Name(), inRegs, fromStage, wantStage)
		}
		store := strings.Index(src, "stsm_x4_t(smem_u32(sdSb + sw_elem<BM>(")
		if !v.AtomicDQ {
			if store >= 0 {
				t.Errorf("%s: dS stored without the atomic dQ", v.Name())
			}
			continue
		}
		barrier := strings.Index(src, "in shared memory for the dQ product")
		product := -1 // the dQ product, after the barrier
		marker := "(accQ, dSk"
		if v.bwdDQTransposed() {
			marker = "wg_qt(accQ, dKt"
		}
		if k := strings.Index(src[max(barrier, 0):], marker); barrier >= 0 && k >= 0 {
			product = barrier + k
		}
		if v.bwdDQRowHalves() && v.DQAccTiled() && !strings.Contains(src, "if (i0 + dqi < n) bulk_reduce_add_f32(") {
			t.Errorf("%s: a warpgroup's half past the last query adds its tile", v.Name())
		}
		reduce := strings.Index(src, "wgmma_wait<1>();  // dV and dQ complete")
		if store < 0 || barrier < store || product < barrier || reduce < product {
			t.Errorf("%s: dS store at %d, barrier at %d, dQ product at %d, reduction at %d: want them in that order", v.Name(), store, barrier, product, reduce)
		}
	}
	base := BwdVariant{DType: attn.BFloat16, DK: 128, DV: 128, Vector: true, WGMMA: true, TMA: true, WarpSpecialized: true, KeyRows: true}
	for _, w := range []BwdVariant{base, edited(base, func(v *BwdVariant) { v.AtomicDQ = true }), edited(base, func(v *BwdVariant) { v.AtomicDQ, v.BulkDQ = true, true }),
		edited(base, func(v *BwdVariant) { v.QueryStep = 80 }), edited(base, func(v *BwdVariant) { v.DK, v.DV, v.QueryStep = 64, 64, 128 }),
		edited(base, func(v *BwdVariant) { v.DK, v.DV, v.QueryStep = 48, 64, 128 }),
		edited(base, func(v *BwdVariant) { v.DK, v.DV, v.QueryStep, v.AtomicDQ = 64, 64, 128, true }),
		edited(base, func(v *BwdVariant) { v.DK, v.DV, v.QueryStep, v.AtomicDQ, v.BulkDQ = 64, 64, 128, true, true }),
		edited(base, func(v *BwdVariant) { v.Dropout = true }), edited(base, func(v *BwdVariant) { v.Dropout, v.AtomicDQ = true, true }),
		edited(base, func(v *BwdVariant) { v.DK, v.DV, v.QueryStep, v.AtomicDQ, v.Dropout = 64, 64, 128, true, true })} {
		if err := w.Validate(); err != nil {
			t.Errorf("%s: %v", w.Name(), err)
		}
	}
	wantUnsupported(t, map[string]BwdVariant{
		"lockstep":                edited(base, func(v *BwdVariant) { v.WarpSpecialized = false }),
		"d192":                    edited(base, func(v *BwdVariant) { v.DK, v.DV = 192, 192 }),
		"80 queries, atomic dQ":   edited(base, func(v *BwdVariant) { v.QueryStep, v.AtomicDQ = 80, true }),
		"80 queries, no key rows": edited(base, func(v *BwdVariant) { v.QueryStep, v.KeyRows = 80, false }),
		"64 queries named":        edited(base, func(v *BwdVariant) { v.QueryStep = 64 }),
		"96 queries":              edited(base, func(v *BwdVariant) { v.QueryStep = 96 }),
		"128 queries at d128":     edited(base, func(v *BwdVariant) { v.QueryStep = 128 }),
		"128 queries at d64-96":   edited(base, func(v *BwdVariant) { v.DK, v.DV, v.QueryStep = 64, 96, 128 }),
	})
	if err := base.Validate(); err != nil {
		t.Errorf("base: %v", err)
	}
}

// bwdHopperWSVariants returns the variants of bwdHopperTMAVariants with
// the warp-specialized dK/dV kernel, and those of them that take the
// atomic dQ by bulk reduce-adds too.
func bwdHopperWSVariants() []BwdVariant {
	var vs []BwdVariant
	for _, v := range bwdHopperTMAVariants() {
		v.WarpSpecialized = true
		if v.Validate() != nil {
			continue
		}
		vs = append(vs, v)
		if w := v; v.AtomicDQ {
			w.BulkDQ = true
			if w.Validate() == nil {
				vs = append(vs, w)
			}
		}
	}
	return vs
}

// bwdSpillLimit returns the bytes a Hopper backward kernel of v may spill:
// 32, or 256 for the key-rows step under dropout with a bias at padded
// head dims past 64 (44–176 bytes with the bias gradient or a mask), which
// measured 1.36–1.46× faster than the table's kernels all the same
// (docs/kernels/backward.md, "Dropout in the key-rows step"), or 64 for
// the deep kernels past D = 448, whose dKᵀ and dVᵀ slices take 128 of a
// thread's 255 registers and whose masked dK/dV kernel by tensor maps
// spills 56 bytes ("Past D = 256: the deep kernels"), or 320 for the
// key-rows step over 80 queries at padded head dims past 64, an option off
// by default that spills beside its 80-query tiles (40–216 bytes with
// NVRTC 12.4, 76–276 with 13.0; "Steps of 80 queries"), or 128 for the
// persistent key-rows kernel, whose tile loop keeps a few of the step's
// shared addresses in local memory (up to 108 bytes with NVRTC 12.4; "The
// persistent dK/dV kernel").
func bwdSpillLimit(v BwdVariant) int {
	switch {
	case v.Persistent:
		return 128
	case v.KeyRows && v.Dropout && v.Bias != BiasNone && max(v.DKPad(), v.DVPad()) > 64:
		return 256
	case v.KeyRows && v.QueryStep == 80 && max(v.DKPad(), v.DVPad()) > 64:
		return 320
	case v.WGMMA && v.bwdHopperDeep() && max(v.DKPad(), v.DVPad()) > 448:
		return 64
	}
	return 32
}

// checkBwdHopperCompiles compiles the Hopper backward variants vs for
// sm_90a and fails on more spilled bytes by their dK/dV or dQ kernel than
// bwdSpillLimit allows and on serialized warpgroup products in ptxas's
// report.
func checkBwdHopperCompiles(t *testing.T, c *cuda.Compiler, vs []BwdVariant) {
	t.Helper()
	only := os.Getenv("FLASHATTN_COMPILE_ONLY") // a regular expression: only the variants whose names match
	for _, v := range vs {
		if only != "" && !regexp.MustCompile(only).MatchString(v.Name()) {
			continue
		}
		src, err := v.Source()
		if err != nil {
			t.Fatalf("%s: %v", v.Name(), err)
		}
		out, err := c.Compile(cuda.CompileRequest{Name: v.Name() + ".cu", Source: src, Arch: "sm_90a", Verbose: true, NoCache: true})
		if err != nil {
			t.Errorf("%s: %v", v.Name(), err)
			continue
		}
		for _, r := range out.Stats.Resources {
			if r.Name != BwdDKDVKernel && r.Name != BwdDQKernel {
				continue
			}
			t.Logf("%s %s: %d registers, spills %d/%d", v.Name(), r.Name, r.Registers, r.SpillStores, r.SpillLoads)
			if limit := bwdSpillLimit(v); r.SpillStores > limit {
				t.Errorf("%s spills %d bytes, more than %d", v.Name(), r.SpillStores, limit)
			}
		}
		if strings.Contains(out.Stats.Log, "wgmma.mma_async instructions are serialized") {
			t.Errorf("%s: ptxas serialized the warpgroup products:\n%s", v.Name(), grepLines(out.Stats.Log, "serialized"))
		}
	}
}

// bwdHopperBulkDQVariants returns the variants of bwdHopperVariants and
// bwdHopperTMAVariants that take the atomic dQ by bulk reduce-adds.
func bwdHopperBulkDQVariants() []BwdVariant {
	var vs []BwdVariant
	for _, v := range append(bwdHopperVariants(), bwdHopperTMAVariants()...) {
		v.BulkDQ = true
		if v.Validate() == nil {
			vs = append(vs, v)
		}
	}
	return vs
}

// TestHopperTable checks that the Hopper tile of every 16-bit head-dim pair
// (as the backend pads them, to 16) and feature set validates, and that the
// whole range 1..512 is covered.
func TestHopperTable(t *testing.T) {
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float16} {
		for dk := 16; dk <= attn.MaxHeadDim; dk += 16 {
			for _, dv := range []int{16, dk, attn.MaxHeadDim + 16 - dk} {
				for _, f := range fwdFeatures {
					v := Variant{DType: dt, DK: dk, DV: dv, LoadBytes: 16, LSE: true}
					if f.set != nil {
						f.set(&v)
					}
					tile, ok := HopperTile(v)
					if !ok {
						t.Fatalf("HopperTile(%v, %d/%d, %s) refused", dt, dk, dv, f.name)
					}
					if err := tile.Apply(v).Validate(); err != nil {
						t.Fatalf("Hopper tile of %v %d/%d %s: %v", dt, dk, dv, f.name, err)
					}
				}
			}
		}
	}
}

// TestBwdHopperValidAll checks that every 16-bit head-dim pair the Hopper
// backward takes validates with both dQ algorithms and the features.
func TestBwdHopperValidAll(t *testing.T) {
	for d := 1; d <= 256; d++ {
		for _, atomic := range []bool{false, true} {
			v := BwdVariant{DType: attn.BFloat16, DK: d, DV: d, Features: Features{Mask: MaskWindow, Softcap: true, Bias: BiasBF16, Dropout: true}, Vector: d%8 == 0, Staged: d%8 != 0, AtomicDQ: atomic, BiasGrad: true, WGMMA: true}
			if !BwdHopperOK(v) {
				t.Fatalf("BwdHopperOK refused D=%d", d)
			}
			if err := v.Validate(); err != nil {
				t.Fatalf("D=%d atomic=%v: %v", d, atomic, err)
			}
		}
	}
}

// TestHopperTileKeys checks the keys per tile the table gives with and
// without per-element extras.
func TestHopperTileKeys(t *testing.T) {
	softcap := func(v *Variant) { v.Softcap = true }
	tests := []struct {
		d      int
		set    func(*Variant)
		bm, bn int
		warpsN int
		name   string
	}{
		{64, nil, 128, 64, 1, "64"},
		{128, nil, 128, 96, 1, "128"},
		{128, softcap, 128, 64, 1, "128 softcap"},
		{199, nil, 128, 80, 1, "199 (208)"},
		{256, softcap, 128, 32, 1, "256 softcap"},
		{257, nil, 128, 48, 1, "257 (272)"},
		{257, softcap, 128, 16, 1, "257 softcap"},
		{320, nil, 128, 32, 1, "320"},
		{384, softcap, 64, 48, 2, "384 softcap: the full tile"},
		{512, nil, 64, 32, 2, "512"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := hopperVariant(t, attn.BFloat16, tt.d, tt.d, tt.set)
			if v.BlockM != tt.bm || v.BlockN != tt.bn || v.WarpsN != tt.warpsN {
				t.Errorf("tile %dx%d WarpsN %d, want %dx%d WarpsN %d", v.BlockM, v.BlockN, v.WarpsN, tt.bm, tt.bn, tt.warpsN)
			}
		})
	}
}

// TestBwdHopperPad checks the padded head dims: the Hopper kernels pad to
// the 16 elements of a warpgroup product's k step (D = 199: 208, so the
// products and the dQ accumulator are 7 % narrower than at 224), the
// mma.sync kernels keep the 32-element granule above 64.
func TestBwdHopperPad(t *testing.T) {
	for _, c := range []struct {
		d     int
		wgmma bool
		want  int
	}{
		{59, true, 64}, {59, false, 64}, {80, true, 80}, {80, false, 96}, {127, true, 128},
		{144, true, 144}, {144, false, 160}, {199, true, 208}, {199, false, 224}, {256, true, 256},
	} {
		v := BwdVariant{DType: attn.BFloat16, DK: c.d, DV: c.d, WGMMA: c.wgmma}
		if got, gotV := v.DKPad(), v.DVPad(); got != c.want || gotV != c.want {
			t.Errorf("D=%d wgmma=%v: padded to %d, %d, want %d", c.d, c.wgmma, got, gotV, c.want)
		}
	}
}

// TestDeepProductsUnbranched checks that no warpgroup product of the deep
// kernels lies in a branch (a block opened by if or else): ptxas
// serializes every warpgroup product of a kernel that has one in a
// divergent branch.
func TestDeepProductsUnbranched(t *testing.T) {
	product := regexp.MustCompile(`\bwg_(s|t32|n\d+)\(`)
	literal := regexp.MustCompile(`"([^"\\]|\\.)*"`)
	for v, src := range deepSources(t) {
		src = src[strings.Index(src, `extern "C" __global__`):]
		var stack []bool // each open block: opened by if or else
		for i, line := range strings.Split(src, "\n") {
			if c := strings.Index(line, "//"); c >= 0 {
				line = line[:c]
			}
			line = literal.ReplaceAllString(line, `""`)
			branch := strings.Contains(line, "if (") || strings.Contains(line, "else")
			if product.MatchString(line) && slices.Contains(stack, true) {
				t.Errorf("%s: line %d: a warpgroup product in a branch: %s", v.Name(), i+1, strings.TrimSpace(line))
			}
			for _, r := range line {
				switch r {
				case '{':
					stack = append(stack, branch)
				case '}':
					if len(stack) > 0 {
						stack = stack[:len(stack)-1]
					}
				}
			}
		}
	}
}

// deepSources returns the sources of the deep test variants of
// bwdHopperVariants and bwdHopperTMAVariants, failing t on fewer than six.
func deepSources(t *testing.T) map[BwdVariant]string {
	t.Helper()
	out := map[BwdVariant]string{}
	for _, v := range append(bwdHopperVariants(), bwdHopperTMAVariants()...) {
		if !v.bwdHopperDeep() {
			continue
		}
		src, err := v.Source()
		if err != nil {
			t.Fatalf("%s: %v", v.Name(), err)
		}
		out[v] = src
	}
	if len(out) < 6 {
		t.Fatalf("%d deep variants", len(out))
	}
	return out
}

// TestDeepDescriptorsOpaque checks that the deep Hopper kernels hide the
// base descriptors of their long products from loop-invariant hoisting:
// S and dP in both kernels, the transposed dV and dK products in the
// dK/dV kernel.
func TestDeepDescriptorsOpaque(t *testing.T) {
	for v, src := range deepSources(t) {
		for _, want := range []string{"opaque(dq); opaque(ddo); opaque(dk); opaque(dv);", "opaque(da); opaque(db);"} {
			if !strings.Contains(src, want) {
				t.Errorf("%s: source lacks %q", v.Name(), want)
			}
		}
		if c := strings.Count(src, "opaque(dq); opaque(ddo); opaque(dk); opaque(dv);"); c != 2 {
			t.Errorf("%s: S and dP descriptors hidden in %d kernels, want 2", v.Name(), c)
		}
	}
}

// TestDQAccTiledSource checks where the dQ accumulator is tiled (the bulk
// dQ by query rows at padded DK 64 or 128, fixed length) and that those
// kernels add each warpgroup's tile with one 16 KB bulk reduce-add from its
// first thread, zero and read the accumulator in the tile order, and issue
// no per-row reduce-adds.
func TestDQAccTiledSource(t *testing.T) {
	base := BwdVariant{DType: attn.BFloat16, DK: 128, DV: 128, Vector: true, AtomicDQ: true, BulkDQ: true, WGMMA: true, TMA: true, WarpSpecialized: true}
	edit := func(f func(*BwdVariant)) BwdVariant { v := base; f(&v); return v }
	for _, tc := range []struct {
		name  string
		v     BwdVariant
		tiled bool
	}{
		{"d128", base, true},
		{"d128 key rows", edit(func(v *BwdVariant) { v.KeyRows = true }), true},
		{"d128 lockstep", edit(func(v *BwdVariant) { v.WarpSpecialized = false }), true},
		{"d64", edit(func(v *BwdVariant) { v.DK, v.DV = 64, 64 }), true},
		{"d120-96", edit(func(v *BwdVariant) { v.DK, v.DV = 120, 96 }), true},
		{"d96", edit(func(v *BwdVariant) { v.DK, v.DV = 96, 96 }), false},
		{"d128 varlen", edit(func(v *BwdVariant) { v.Varlen, v.TMA, v.WarpSpecialized = true, false, false }), false},
		{"d128 vector atomics", edit(func(v *BwdVariant) { v.BulkDQ = false }), false},
		{"d128 80 queries (transposed)", edit(func(v *BwdVariant) { v.KeyRows, v.QueryStep = true, 80 }), false},
	} {
		if got := tc.v.DQAccTiled(); got != tc.tiled {
			t.Errorf("%s: DQAccTiled %v, want %v", tc.name, got, tc.tiled)
			continue
		}
		src, err := tc.v.Source()
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		whole := "smem_u32(sq), 16384);"
		if got := strings.Count(src, whole); tc.tiled != (got == 1) {
			t.Errorf("%s: %d whole-tile reduce-adds", tc.name, got)
		}
		if tc.tiled && (strings.Count(src, "the tiled accumulator") != 2 || strings.Contains(src, "smem_u32(sq + il * QP)")) {
			t.Errorf("%s: the pre or convert kernel not in the tile order, or rows reduced one by one", tc.name)
		}
	}
}

// TestBiasStagedSource checks the staged bias (Variant.BiasStaged): the
// producer's tensor-map loads of each block's tile after its K tile, behind
// the buffer's empty barrier; the compute warps' wait on its full barrier,
// ldmatrix reads and release, no copies of their own and no per-element
// global bias loads; and that Validate refuses it
// off the warp-specialized kernels, for a float32 bias and for key tiles
// that are not a multiple of 64.
func TestBiasStagedSource(t *testing.T) {
	base := hopperVariant(t, attn.BFloat16, 128, 128, func(v *Variant) { v.Bias = BiasBF16 })
	base.TMA, base.Pipeline = true, Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}
	base.BiasStaged = true
	src, err := base.Source()
	if err != nil {
		t.Fatal(err)
	}
	// the producer loads each block's tile right after its K tile, once the tile two before released the buffer
	prod := strings.Index(src, "// ---- producer warpgroup")
	kload := strings.Index(src, "tma_tile<BN, KATOMS>(sK + (g & 1) * K_STAGE")
	empty := strings.Index(src, "if (g >= 2) mbar_wait(emptyB + 8 * (g & 1), ((g >> 1) - 1) & 1);")
	load := strings.Index(src, "tma_rows<64, BN / 64>(s_base + SB_OFF + (g & 1) * (BM * BN * 2) + w * (64 * BN * 2), &tp.bias, barB + 8 * (g & 1),")
	coords := strings.Index(src, "m0 + 64 * w, p.bias_sh != 0 ? h : 0, p.bias_sb != 0 ? b : 0, (nb_hi - 1 - s) * BN);")
	if prod < 0 || kload < prod || empty < kload || load < empty || coords < load {
		t.Errorf("the producer's bias loads: producer %d, K load %d, empty wait %d, load %d, coordinates %d", prod, kload, empty, load, coords)
	}
	// each block's compute waits on its tile's full barrier (the first block's tile number 0, the loop's it + 1),
	// reads it by ldmatrix, and each warp releases the buffer
	read := strings.Index(src, "const int bg = 0;")
	wait := strings.Index(src, "mbar_wait(barB + 8 * (bg & 1), (bg >> 1) & 1);")
	loop := strings.Index(src, "const int bg = it + 1;")
	release := strings.Index(src, "if (lane == 0) mbar_arrive(emptyB + 8 * (bg & 1));")
	if read < prod || wait < read || release < wait || loop < release {
		t.Errorf("the compute warps' bias reads: first block %d, wait %d, release %d, loop's block %d", read, wait, release, loop)
	}
	if strings.Contains(src, "cp_async(sdst") || strings.Contains(src, "bias_tile") || strings.Contains(src, "bar_sync(6 + wg") {
		t.Error("the compute warps still copy the bias or meet on a barrier for it")
	}
	if strings.Contains(src, "br != nullptr && j < m ? bias_load") || strings.Contains(src, "const char* brow[MT][2]") || strings.Contains(src, "prefetch_l1(") {
		t.Error("a staged bias still loaded (or prefetched) element by element from global memory in the main kernel")
	}
	if rd := strings.Index(src, "ldsm4(r, sb + sw_off<64, BN / 8>(lr + mt * 16, ((key0 + nt * 8) >> 3) + lch));"); rd < wait || rd > release || strings.Contains(src, "reinterpret_cast<const u32*>(sb") {
		t.Error("the staged tile not read by ldmatrix between its barrier's wait and the release")
	}
	// from global memory instead: each block's loads, after the prefetch of the next block's rows into L1
	for _, pipe := range []Pipeline{base.Pipeline, {}} {
		v := edited(base, func(v *Variant) { v.BiasStaged, v.Pipeline = false, pipe })
		src, err := v.Source()
		if err != nil {
			t.Fatal(err)
		}
		for _, blk := range []string{"n0", "(nb - 1) * BN"} {
			pf := strings.Index(src, "prefetch_l1(brow[mt][hf] + (i64)(("+blk+") - BN + key0) * bias_km);")
			if ld := strings.Index(src[max(pf, 0):], "const int nb0 = "+blk+";"); pf < 0 || ld < 0 {
				t.Errorf("%s: the prefetch of the block after %s's bias rows missing, or not before its loads", v.Name(), blk)
			}
		}
	}
	wantUnsupported(t, map[string]Variant{
		"lockstep": edited(base, func(v *Variant) { v.Pipeline = Pipeline{} }),
		"float32":  edited(base, func(v *Variant) { v.Bias = BiasF32 }),
		"no bias":  edited(base, func(v *Variant) { v.Bias = BiasNone }),
		"keys 96":  edited(base, func(v *Variant) { v.BlockN = 96 }),
	})
}

// TestNaturalScoresSource checks where the forward keeps prescaled scores
// in natural units (Variant.naturalScores): a bias without softcap, on the
// Hopper and mma.sync kernels, scale·s + bias by one multiply-add and
// log2(e) in SC; a softcap (with or without a bias) and a negative scale
// alone keep base-2 units.
func TestNaturalScoresSource(t *testing.T) {
	hop := hopperVariant(t, attn.BFloat16, 128, 128, func(v *Variant) { v.Bias = BiasBF16 })
	sync := hop
	sync.WGMMA, sync.BlockM, sync.BlockN, sync.WarpsM = false, 128, 64, 8
	cases := []struct {
		name    string
		v       Variant
		natural bool
		fma     string
	}{
		{"hopper bias", hop, true, "t = fmaf(t, p.scale, bpre[mt][nt][e]);"},
		{"hopper bias, staged", edited(hop, func(v *Variant) {
			v.TMA, v.Pipeline, v.BiasStaged = true, Pipeline{WarpSpecialized: true, PingPong: true}, true
		}), true, "t = fmaf(t, p.scale, bpre[mt][nt][e]);"},
		{"mma.sync bias", sync, true, "t = fmaf(t, p.scale, br != nullptr && j < m ? bias_load(br + j * bias_km) : 0.f);"},
		{"hopper softcap and bias", edited(hop, func(v *Variant) { v.Softcap = true }), false, "t += bpre[mt][nt][e] * LOG2E;"},
		{"mma.sync softcap and bias", edited(sync, func(v *Variant) { v.Softcap = true }), false, "t += bias_load(br + j * bias_km) * LOG2E;"},
		{"negative scale", edited(hop, func(v *Variant) { v.Bias, v.PreScale = BiasNone, true }), false, "t *= p.scale_log2;"},
	}
	for _, tc := range cases {
		src, err := tc.v.Source()
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got := strings.Contains(src, "constexpr float SC = LOG2E;"); got != tc.natural {
			t.Errorf("%s: natural units %v, want %v", tc.name, got, tc.natural)
		}
		if !strings.Contains(src, tc.fma) {
			t.Errorf("%s: no %q", tc.name, tc.fma)
		}
	}
}

// TestBwdBiasStagedSource checks the backward's staged bias
// (BwdVariant.BiasStaged): the producer's tensor-map load of the step's
// tile, its bytes announced on the stage's full barrier, the bias's map in
// the argument, the key-rows
// step reading the stage by transposed ldmatrix before its Pᵀ loop and the
// logit from those registers instead of global memory; Validate refuses it off
// the key-rows step and for a float32 bias.
func TestBwdBiasStagedSource(t *testing.T) {
	base := BwdVariant{DType: attn.BFloat16, DK: 128, DV: 128, Features: Features{Bias: BiasBF16}, BiasGrad: true, Vector: true, AtomicDQ: true, BulkDQ: true,
		WGMMA: true, TMA: true, WarpSpecialized: true, KeyRows: true, BiasStaged: true}
	for _, v := range []BwdVariant{base} {
		src, err := v.Source()
		if err != nil {
			t.Fatal(err)
		}
		bytes := strings.Index(src, "mbar_expect_tx(bar + 8 * s, (QA + DA) * BM * 128 + B_STAGE);")
		load := strings.Index(src, "tma_rows<BM, BN / 64>(sB + s * B_STAGE, &tp.c, bar + 8 * s, iq, p.bias_sh != 0 ? hq : 0, p.bias_sb != 0 ? b : 0, j0);")
		read := strings.Index(src, "ldsm_x4_t(bst, smem_u32(sBst + sw_elem<BM>(")
		use := strings.Index(src, "const float sv = fmaf(s, p.scale, bf16_to_f32((u16)(bst[2 * (nt & 1) + hh] >> (16 * c))));")
		if bytes < 0 || load < bytes || read < load || use < read || strings.Contains(src, "cp_async_sw(sB") {
			t.Errorf("%s: the tile's bytes announced at %d, its load at %d, staged read at %d, its use at %d", v.Name(), bytes, load, read, use)
		}
		if !strings.Contains(src, "TensorMap c;") {
			t.Errorf("%s: no bias map in the argument", v.Name())
		}
		// dBias addressed from the thread's first element, the tests skipped for a tile inside the sequences
		if !strings.Contains(src, "if (dbin || (qi + c < n && kj < m)) *(dbp + (8 * nt + c) * dbm + 8 * hh) = d;") ||
			!strings.Contains(src, "const bool dbin = i0 + BM <= n && j0 + BN <= m;") {
			t.Errorf("%s: dBias not addressed from the thread's first element", v.Name())
		}
		unstaged := v
		unstaged.BiasStaged = false
		if src, err := unstaged.Source(); err != nil || strings.Contains(src, "dbp + (8 * nt + c) * dbm") || !strings.Contains(src, "if (qi + c < n && kj < m) *(p.dbias_scratch + ") {
			t.Errorf("%s: dBias of an unstaged bias not addressed element by element (%v)", unstaged.Name(), err)
		}
		step := strings.Index(src, "keys as rows: this warpgroup's BN/2 keys")
		if end := strings.Index(src[max(step, 0):], "---- dV += Pᵀ·dO"); step < 0 || end < 0 || strings.Contains(src[step:step+end], "sv += bt_to_f(p.bias[") {
			t.Errorf("%s: the key-rows step still reads the bias from global memory", v.Name())
		}
	}
	wantUnsupported(t, map[string]BwdVariant{
		"other step": edited(base, func(v *BwdVariant) { v.KeyRows, v.AtomicDQ, v.BulkDQ = false, false, false }),
		"float32":    edited(base, func(v *BwdVariant) { v.Bias = BiasF32 }),
		"no bias":    edited(base, func(v *BwdVariant) { v.Bias, v.BiasGrad = BiasNone, false }),
	})
}

// edited returns a copy of base changed by f.
func edited[V any](base V, f func(*V)) V {
	f(&base)
	return base
}

// wantUnsupported checks that Validate refuses every variant of cases with
// an error wrapping attn.ErrUnsupported.
func wantUnsupported[V interface{ Validate() error }](t *testing.T, cases map[string]V) {
	t.Helper()
	for name, v := range cases {
		if err := v.Validate(); !errors.Is(err, attn.ErrUnsupported) {
			t.Errorf("%s: Validate = %v, want ErrUnsupported", name, err)
		}
	}
}

// TestBwdAlignSlack checks the Hopper backward's aligning slack: reserved
// (and the base aligned) wherever the tiles leave room for it; left out
// only where it alone would exceed shared memory — D = 64's 128-query step
// with a staged bias and the bulk dQ — where the kernel then checks its
// base instead, and the map still fits.
func TestBwdAlignSlack(t *testing.T) {
	staged64 := BwdVariant{DType: attn.BFloat16, DK: 64, DV: 64, Features: Features{Bias: BiasBF16}, Vector: true, AtomicDQ: true, BulkDQ: true,
		WGMMA: true, TMA: true, WarpSpecialized: true, KeyRows: true, QueryStep: 128, BiasStaged: true}
	for _, tc := range []struct {
		name  string
		v     BwdVariant
		slack bool
	}{
		{"d64-q128-staged-bulk", staged64, false},
		{"d64-q128-staged", edited(staged64, func(v *BwdVariant) { v.BulkDQ = false }), true},
		{"d64-q128-bulk", edited(staged64, func(v *BwdVariant) { v.BiasStaged = false }), true},
		{"d128-staged-bulk", edited(staged64, func(v *BwdVariant) { v.DK, v.DV, v.QueryStep = 128, 128, 0 }), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.v.Validate(); err != nil {
				t.Fatal(err)
			}
			l := tc.v.bwdHopperLayout()
			if got := l.slack == swizzlePeriod; got != tc.slack || l.total > MaxSharedBytes {
				t.Fatalf("slack %d, total %d (tiles %d), want slack %v within %d", l.slack, l.total, l.tileBytes(), tc.slack, MaxSharedBytes)
			}
			if !tc.slack && l.withSlack() <= MaxSharedBytes {
				t.Errorf("slack left out of a map that fits with it (%d bytes)", l.withSlack())
			}
			src, err := tc.v.Source()
			if err != nil {
				t.Fatal(err)
			}
			k := strings.Index(src, " "+BwdDKDVKernel+"(") // the dK/dV kernel's text, to the next kernel
			if k < 0 {
				t.Fatal("no dK/dV kernel")
			}
			dkdv := src[k:]
			if e := strings.Index(dkdv, "extern \"C\" __global__"); e >= 0 {
				dkdv = dkdv[:e]
			}
			check, align := strings.Contains(dkdv, "if (smem_u32(smem) & 1023u) __trap();"), strings.Contains(dkdv, "+ 1023u) & ~1023u)")
			if check == tc.slack || align != tc.slack {
				t.Errorf("base checked %v, aligned %v; want the check only without the slack", check, align)
			}
		})
	}
}
