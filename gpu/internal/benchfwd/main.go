// Command benchfwd times the CUDA forward kernels on the FlashAttention-3
// sweep shapes (B·N = 16384 tokens, H·D = 2048) and prints a table of
// TFLOP/s, with forward FLOPs = 4·B·H·N·M·D (halved when causal).
//
// Timing: CUDA events around each launch, after a warm-up, median of many
// repeats, rotating over several input sets (each larger than the 60 MB L2)
// filled with random nonzero values.
//
// Groups: main (the sweep shapes, tuned kernels), sync (the same with the
// mma.sync kernels only), odd, big, hsweep (Hopper kernel tiles at N=4096),
// sweep (mma.sync tile candidates, with -sweep).
//
//	benchfwd [-dtype bf16] [-reps 30] [-sets 3] [-sweep] [-only main,sync,odd,big,hsweep,sweep] [-dims 64,128] [-staging=false]
package main

import (
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/gpu"
	"github.com/flashattn/flashattn/kernels"
)

// shape is one benchmark shape.
type shape struct {
	d, n, h, b int
	causal     bool
	tile       *kernels.Tile // nil: the tuning table
	label      string
	noWGMMA    bool // time the mma.sync kernels even where the Hopper kernel applies
	// per-element extras: softcap (0: none), dropout probability (0: none),
	// and a bias [1, 1, N, N] of the element type
	softcap, dropout float64
	bias             bool
}

func (s shape) flops() float64 {
	f := 4 * float64(s.b) * float64(s.h) * float64(s.n) * float64(s.n) * float64(s.d)
	if s.causal {
		f /= 2
	}
	return f
}

// flashPeer is PyTorch's flash backend forward (TFLOP/s) from
// peers-h200.md, for the main shapes.
var flashPeer = map[[3]int]float64{
	{64, 0, 1024}: 287, {64, 0, 4096}: 305, {64, 0, 16384}: 310,
	{128, 0, 1024}: 327, {128, 0, 4096}: 340, {128, 0, 16384}: 351,
	{256, 0, 1024}: 310, {256, 0, 4096}: 319, {256, 0, 16384}: 330,
	{64, 1, 4096}: 283, {64, 1, 16384}: 301, {128, 1, 4096}: 306, {128, 1, 16384}: 326,
	{256, 1, 4096}: 284, {256, 1, 16384}: 294,
}

func main() {
	dtName := flag.String("dtype", "bf16", "element type")
	reps := flag.Int("reps", 30, "timed repeats per shape")
	sets := flag.Int("sets", 3, "rotated input sets")
	sweep := flag.Bool("sweep", false, "also time candidate tiles at N=4096")
	only := flag.String("only", "", "comma-separated groups to time (main, odd, big, hsweep, xsweep, nsweep, sweep); empty: all")
	dims := flag.String("dims", "", "comma-separated head dims the hsweep, xsweep and nsweep groups time; empty: all")
	flag.BoolVar(&useStaging, "staging", true, "copy rows that allow only 2-byte loads into a padded staging workspace first (timed)")
	flag.Parse()
	dt, err := attn.ParseDType(*dtName)
	if err != nil {
		fail(err)
	}
	b, err := gpu.Open()
	if err != nil {
		fail(err)
	}
	defer b.Close()
	dev := b.Device()
	fmt.Printf("device: %v; %s; %s\n", dev, time.Now().UTC().Format("2006-01-02 15:04 UTC"), dt)

	var shapes []shape
	add := func(group string, s shape) {
		if *only == "" || strings.Contains(","+*only+",", ","+group+",") {
			shapes = append(shapes, s)
		}
	}
	for _, d := range []int{64, 128, 256} {
		for _, causal := range []bool{false, true} {
			for _, n := range []int{1024, 4096, 16384} {
				add("main", shape{d: d, n: n, h: 2048 / d, b: 16384 / n, causal: causal})
				add("sync", shape{d: d, n: n, h: 2048 / d, b: 16384 / n, causal: causal, label: "sync", noWGMMA: true})
			}
		}
	}
	for _, d := range []int{59, 64, 111, 127, 128, 198, 199, 200, 208, 256, 257, 320} {
		add("odd", shape{d: d, n: 4096, h: max(1, (2048+d/2)/d), b: 4, label: "odd"})
	}
	for _, d := range []int{320, 384, 512} {
		for _, causal := range []bool{false, true} {
			add("big", shape{d: d, n: 4096, h: max(1, 2048/d), b: 4, causal: causal})
		}
	}
	// Hopper kernel tiles (two or three warpgroups of 64 rows; keys per tile)
	hop := map[int][]kernels.Tile{
		// (the wider key tiles for the warp-specialized pipelines, whose compute warpgroups have
		// 240 registers: FLASHATTN_FWD_PIPELINE)
		64:  {hl(128, 64), hl(192, 64), hl(128, 32), hl(128, 48), hl(128, 128), hl(128, 192), hl(192, 128)},
		128: {hl(128, 128), hl(128, 96), hl(128, 64), hl(128, 80), hl(128, 144), hl(128, 160), hl(128, 176)},
		256: {hl(128, 64), hl(128, 80), hl(192, 48)},
		199: {hl(128, 64), hl(128, 80), hl(128, 96), hl(192, 48)},
		208: {hl(128, 64), hl(192, 48)},
		257: {hl(128, 32), hl(128, 48), hl2(32), hl2(48)},
		288: {hl(128, 32), hl(128, 48)},
		320: {hl(128, 32), hl(128, 48), hl2(32), hl2(48)},
		352: {hl2(32), hl2(48)},
		384: {hl2(32), hl2(48)},
		512: {hl2(32), hl2(16)},
	}
	for _, d := range []int{64, 128, 256, 199, 208, 257, 288, 320, 352, 384, 512} {
		if *dims != "" && !strings.Contains(","+*dims+",", fmt.Sprintf(",%d,", d)) {
			continue
		}
		for _, causal := range []bool{false, true} {
			if causal && d%64 != 0 {
				continue // odd dims: the odd group's shape only
			}
			for i := range hop[d] {
				t := hop[d][i]
				add("hsweep", shape{d: d, n: 4096, h: max(1, (2048+d/2)/d), b: 4, causal: causal, tile: &t, label: "hsweep"})
			}
		}
	}
	// Hopper tiles of variants with per-element extras (softcap, dropout, bias) at D = 64 and
	// 128 (-dims picks), under the backend's forward pipeline (FLASHATTN_FWD_PIPELINE): keys per
	// tile, and at D = 64 also the plain kernel's three warpgroups of 64 rows
	xtiles := map[int][]kernels.Tile{
		64:  {hl(128, 32), hl(128, 64), hl(128, 128), hl(192, 128)},
		128: {hl(128, 64), hl(128, 96), hl(128, 128), hl(128, 160)},
	}
	for _, d := range []int{64, 128} {
		if *dims != "" && !strings.Contains(","+*dims+",", fmt.Sprintf(",%d,", d)) {
			continue
		}
		for _, x := range []shape{{softcap: 30, label: "softcap"}, {dropout: 0.1, label: "dropout"}, {bias: true, label: "bias"}} {
			for _, causal := range []bool{false, true} {
				for i := range xtiles[d] {
					t := xtiles[d][i]
					add("xsweep", shape{d: d, n: 4096, h: 2048 / d, b: 4, causal: causal, tile: &t, label: "x-" + x.label,
						softcap: x.softcap, dropout: x.dropout, bias: x.bias})
				}
			}
		}
	}
	// Hopper tiles by length (the default pipeline for each length: short sequences take
	// persistent CTAs): at D = 128 the keys, 160 padding a sequence of 512 to 640 keys where
	// 128 do not; at D = 64 the query rows, 192 (three warpgroups) padding 512 queries to 576
	// and 1024 to 1152 where 128 do not; at D = 256 the keys, 80 padding 512 to 560 where 64
	// do not (-dims picks)
	ntiles := map[int][]kernels.Tile{128: {hl(128, 128), hl(128, 160)}, 64: {hl(192, 128), hl(128, 128)},
		256: {hl(128, 80), hl(128, 64)}}
	for _, d := range []int{128, 64, 256} {
		if *dims != "" && !strings.Contains(","+*dims+",", fmt.Sprintf(",%d,", d)) {
			continue
		}
		for _, n := range []int{512, 1024, 2048, 4096, 4608, 16384} {
			for _, causal := range []bool{false, true} {
				for i := range ntiles[d] {
					t := ntiles[d][i]
					h, bs := 2048/d, max(1, 16384/n)
					if n == 4608 {
						h, bs = 3072/d, 1 // FLUX's step (H·D = 3072)
					}
					add("nsweep", shape{d: d, n: n, h: h, b: bs, causal: causal, tile: &t, label: "nsweep"})
				}
			}
		}
	}
	if *sweep {
		cands := map[int][]kernels.Tile{
			64:  {tl(128, 128, 4, 1, 1, false), tl(128, 128, 4, 1, 2, false)},
			128: {tl(128, 64, 4, 1, 1, false), tl(128, 128, 4, 1, 1, false)},
			256: {tl(128, 64, 8, 1, 2, false), tl(64, 64, 4, 1, 1, false), tl(64, 32, 4, 1, 1, false), tl(128, 32, 4, 1, 2, false)},
		}
		for _, d := range []int{64, 128, 256} {
			for _, causal := range []bool{false, true} {
				for i := range cands[d] {
					t := cands[d][i]
					add("sweep", shape{d: d, n: 4096, h: max(1, 2048/d), b: 4, causal: causal, tile: &t, label: "sweep"})
				}
			}
		}
		// head dims past 256 (two column groups of warps); 257 is staged to 264 and padded to 272
		wide := []kernels.Tile{tl(64, 64, 4, 2, 1, false), tl(64, 64, 4, 2, 2, false), tl(64, 32, 4, 2, 1, false),
			tl(128, 64, 8, 2, 1, false), tl(128, 32, 8, 2, 1, false), tl(32, 64, 2, 2, 1, false)}
		for _, d := range []int{257, 320} {
			for i := range wide { // (the mma.sync kernels; the Hopper ones are in hsweep)
				t := wide[i]
				add("sweep", shape{d: d, n: 4096, h: max(1, (2048+d/2)/d), b: 4, tile: &t, label: "sweep"})
			}
		}
	}

	// Plan every shape first so that all kernels compile in parallel.
	type planned struct {
		s   shape
		v   kernels.Variant
		err error
	}
	plans := make([]planned, len(shapes))
	for i, s := range shapes {
		v, err := variantOf(b, dt, s)
		plans[i] = planned{s, v, err}
		if err == nil {
			b.Prefetch(v)
		}
	}
	t0 := time.Now()
	stats := b.KernelStats()
	fmt.Printf("compiled %d kernels in %.1fs wall:\n", len(stats), time.Since(t0).Seconds())
	for _, st := range stats {
		fmt.Printf("  %-100s nvrtc %5.2fs regs %3d spill %3d %s\n", st.Name, st.CompileTime.Seconds(), st.Registers, st.SpillBytes, errText(st.Err))
	}

	s, err := dev.NewStream()
	if err != nil {
		fail(err)
	}
	fmt.Printf("\n%-6s %-4s %-6s %-6s %-3s %-4s %-44s %9s %8s %8s\n", "group", "D", "causal", "N", "B", "H", "tile", "ms", "TFLOP/s", "vs flash")
	for _, pl := range plans {
		if pl.err != nil {
			fmt.Printf("%v: %v\n", pl.s, pl.err)
			continue
		}
		ms, err := timeShape(b, s, dt, pl.s, *sets, *reps)
		if err != nil {
			fmt.Printf("D=%d N=%d causal=%v: %v\n", pl.s.d, pl.s.n, pl.s.causal, err)
			continue
		}
		tf := pl.s.flops() / (ms * 1e-3) / 1e12
		peer := ""
		if f, ok := flashPeer[[3]int{pl.s.d, b2i(pl.s.causal), pl.s.n}]; ok && pl.s.tile == nil && dt == attn.BFloat16 {
			peer = fmt.Sprintf("%.2fx", tf/f)
		}
		group := pl.s.label
		if group == "" {
			group = "main"
		}
		v := pl.v
		tile := fmt.Sprintf("%dx%d w%dx%d s%d q%d l%d", v.BlockM, v.BlockN, v.WarpsM, v.WarpsN, v.Stages, b2i(v.QInRegs), v.LoadBytes)
		if v.WGMMA {
			tile += " wgmma"
		}
		if v.TMA {
			tile += " tma"
		}
		fmt.Printf("%-6s %-4d %-6v %-6d %-3d %-4d %-44s %9.3f %8.1f %8s\n", group, pl.s.d, pl.s.causal, pl.s.n, pl.s.b, pl.s.h, tile, ms, tf, peer)
	}
}

// hl returns a Hopper (WGMMA) tile of bm query rows (64 per warpgroup) and
// bn keys.
func hl(bm, bn int) kernels.Tile {
	return kernels.Tile{BlockM: bm, BlockN: bn, WarpsM: bm / 16, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true}
}

// hl2 returns a Hopper (WGMMA) tile of 64 query rows shared by two
// warpgroups, each with half of the value columns, and bn keys.
func hl2(bn int) kernels.Tile {
	return kernels.Tile{BlockM: 64, BlockN: bn, WarpsM: 4, WarpsN: 2, Stages: 2, MinBlocks: 1, WGMMA: true}
}

// tl returns a tile (one CTA per SM assumed by the launch bounds).
func tl(bm, bn, wm, wn, stages int, qregs bool) kernels.Tile {
	return kernels.Tile{BlockM: bm, BlockN: bn, WarpsM: wm, WarpsN: wn, Stages: stages, QInRegs: qregs, MinBlocks: 1}
}

func b2i(x bool) int {
	if x {
		return 1
	}
	return 0
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return strings.SplitN(err.Error(), "\n", 2)[0]
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "benchfwd:", err)
	os.Exit(1)
}

// tensors allocates one input set of a shape.
func tensors(dev *cuda.Device, dt attn.DType, s shape) ([]gpu.DeviceTensor, error) {
	var out []gpu.DeviceTensor
	for _, sh := range [][]int{{s.b, s.n, s.h, s.d}, {s.b, s.n, s.h, s.d}, {s.b, s.n, s.h, s.d}, {s.b, s.n, s.h, s.d}} {
		t, err := gpu.NewDeviceTensor(dev, dt, sh...)
		if err != nil {
			return out, err
		}
		out = append(out, t)
	}
	l, err := gpu.NewDeviceTensor(dev, attn.Float32, s.b, s.h, s.n)
	out = append(out, l)
	if err != nil || !s.bias {
		return out, err
	}
	bias, err := gpu.NewDeviceTensor(dev, dt, 1, 1, s.n, s.n)
	return append(out, bias), err
}

// variantOf returns the kernel a shape runs.
func variantOf(b *gpu.Backend, dt attn.DType, s shape) (kernels.Variant, error) {
	one := s // one batch element: the shape's length and bias kept, which pick the pipeline (gpu.Backend.ShortPipeline)
	one.b = 1
	set, err := tensors(b.Device(), dt, one)
	defer freeAll(set)
	if err != nil {
		return kernels.Variant{}, err
	}
	// same alignment as the full shape: contiguous tensors from fresh buffers
	for i := range set {
		set[i].Shape = append([]int(nil), set[i].Shape...)
	}
	withTile(b, s.tile)
	defer withTile(b, nil)
	defer withWGMMA(b, !s.noWGMMA)()
	opt := options(s, set)
	ws, err := stagingFor(b, set, &opt)
	if err != nil {
		return kernels.Variant{}, err
	}
	if ws != nil {
		defer ws.Free()
	}
	return b.Variant(set[0], set[1], set[2], set[3], set[4], opt)
}

// useStaging is the -staging flag: give the forward a staging workspace
// where its rows allow only 2-byte loads.
var useStaging = true

// stagingFor sets opt.Staging to a new workspace when the forward of set can
// use one (and -staging is on); the caller frees it.
func stagingFor(b *gpu.Backend, set []gpu.DeviceTensor, opt *gpu.DeviceOptions) (*cuda.Buffer, error) {
	if !useStaging {
		return nil, nil
	}
	need, err := b.PrepareForward(set[0], set[1], set[2], set[3], set[4], *opt)
	if err != nil || need == 0 {
		return nil, err
	}
	ws, err := b.Device().Alloc(need)
	if err != nil {
		return nil, err
	}
	opt.Staging = ws
	return ws, nil
}

// options returns the forward options of s on the tensors of set (the bias,
// when s has one, is its sixth).
func options(s shape, set []gpu.DeviceTensor) gpu.DeviceOptions {
	opt := gpu.DeviceOptions{Options: attn.Options{Causal: s.causal, Softcap: s.softcap, Dropout: s.dropout, Seed: 1}}
	if s.bias {
		opt.Bias = &set[5]
	}
	return opt
}

// withTile makes the backend use tile t for every kernel (nil: the table).
func withTile(b *gpu.Backend, t *kernels.Tile) {
	if t == nil {
		b.Tiles = nil
		return
	}
	tile := *t
	b.Tiles = func(dt attn.DType, dk, dv int, narrow bool) (kernels.Tile, error) {
		if narrow { // the plan on rows only 2-byte aligned, made before the staging copies: the table's
			return kernels.TileFor(dt, dk, dv, true)
		}
		return tile, nil
	}
}

// withWGMMA allows the Hopper kernel (where the backend found it usable)
// only when on, and returns the function that restores the setting.
func withWGMMA(b *gpu.Backend, on bool) func() {
	was := b.WGMMA
	b.WGMMA = was && on
	return func() { b.WGMMA = was }
}

func freeAll(ts []gpu.DeviceTensor) {
	for _, t := range ts {
		t.Free()
	}
}

// timeShape returns the median time in ms of one forward launch.
func timeShape(b *gpu.Backend, s *cuda.Stream, dt attn.DType, sh shape, nsets, reps int) (float64, error) {
	dev := b.Device()
	sets := make([][]gpu.DeviceTensor, nsets)
	defer func() {
		for _, set := range sets {
			freeAll(set)
		}
	}()
	for i := range sets {
		set, err := tensors(dev, dt, sh)
		sets[i] = set
		if err != nil {
			return 0, err
		}
		for j := range set {
			if j == 4 {
				continue // the LSE: an output
			}
			if err := b.FillRandom(s, set[j], uint64(100*i+j+1)); err != nil {
				return 0, err
			}
		}
	}
	withTile(b, sh.tile)
	defer withTile(b, nil)
	defer withWGMMA(b, !sh.noWGMMA)()
	opt := options(sh, sets[0])
	ws, err := stagingFor(b, sets[0], &opt)
	if err != nil {
		return 0, err
	}
	if ws != nil {
		defer ws.Free()
	}
	run := func(i int) error {
		set := sets[i%nsets]
		return b.ForwardDevice(s, set[0], set[1], set[2], set[3], set[4], opt)
	}
	for i := 0; i < 3; i++ {
		if err := run(i); err != nil {
			return 0, err
		}
	}
	evs := make([]*cuda.Event, reps+1)
	for i := range evs {
		e, err := dev.NewEvent()
		if err != nil {
			return 0, err
		}
		defer e.Close()
		evs[i] = e
	}
	if err := evs[0].Record(s); err != nil {
		return 0, err
	}
	for i := 0; i < reps; i++ {
		if err := run(i); err != nil {
			return 0, err
		}
		if err := evs[i+1].Record(s); err != nil {
			return 0, err
		}
	}
	if err := s.Synchronize(); err != nil {
		return 0, err
	}
	ms := make([]float64, reps)
	for i := range ms {
		t, err := cuda.ElapsedMs(evs[i], evs[i+1])
		if err != nil {
			return 0, err
		}
		ms[i] = float64(t)
	}
	sort.Float64s(ms)
	return ms[reps/2], nil
}
