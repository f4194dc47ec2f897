package gpu

import (
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// The backward benchmark (FLASHATTN_BWD_BENCH=1): throughput at the
// FlashAttention-3 sweep shapes (B·N = 16384, H·D = 2048, bf16, random
// data, one input set of 5 × 64 MiB, larger than the 50 MiB L2) and the
// GQA contention ratios. Times are CUDA-event medians after warm-up.

// bwdBenchSet is the device data of one benchmark shape.
type bwdBenchSet struct {
	p                               *attn.Problem
	q, k, v, o, lse, dO, dq, dk, dv DeviceTensor
	ws                              *cuda.Buffer
	opt                             attn.Options
}

func (s *bwdBenchSet) free() {
	for _, x := range []DeviceTensor{s.q, s.k, s.v, s.o, s.lse, s.dO, s.dq, s.dk, s.dv} {
		_ = x.Free()
	}
	if s.ws != nil {
		_ = s.ws.Free()
	}
}

// newBwdBenchSet allocates and fills a problem on the device; o and lse
// come from the forward.
func newBwdBenchSet(t *testing.T, b *Backend, s *cuda.Stream, bsz, n, h, hkv, d int, causal bool) *bwdBenchSet {
	t.Helper()
	dt := attn.BFloat16
	set := &bwdBenchSet{opt: attn.Options{Causal: causal}}
	alloc := func(dt attn.DType, shape ...int) DeviceTensor {
		x, err := NewDeviceTensor(b.Device(), dt, shape...)
		if err != nil {
			t.Fatal(err)
		}
		return x
	}
	set.q, set.k, set.v = alloc(dt, bsz, n, h, d), alloc(dt, bsz, n, hkv, d), alloc(dt, bsz, n, hkv, d)
	set.o, set.dO, set.lse = alloc(dt, bsz, n, h, d), alloc(dt, bsz, n, h, d), alloc(attn.Float32, bsz, h, n)
	set.dq, set.dk, set.dv = alloc(dt, bsz, n, h, d), alloc(dt, bsz, n, hkv, d), alloc(dt, bsz, n, hkv, d)
	for i, x := range []DeviceTensor{set.q, set.k, set.v, set.dO} {
		if err := b.FillRandom(s, x, uint64(17*i+n+d)); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.ForwardDevice(s, set.q, set.k, set.v, set.o, set.lse, DeviceOptions{Options: set.opt}); err != nil {
		t.Fatalf("forward: %v", err)
	}
	p, _, err := bwdDeviceArgs(set.q, set.k, set.v, set.o, set.lse, set.dO, set.dq, set.dk, set.dv, BackwardOptions{DeviceOptions: DeviceOptions{Options: set.opt}})
	if err != nil {
		t.Fatal(err)
	}
	set.p = p
	ws, err := b.Device().Alloc(max(BackwardWorkspaceBytes(p, dt, DQAtomic, false), BackwardWorkspaceBytes(p, dt, DQSeparate, false)))
	if err != nil {
		t.Fatal(err)
	}
	set.ws = ws
	return set
}

// autoDQ returns the dQ algorithm a DQAuto backward of set uses on dev.
func (s *bwdBenchSet) autoDQ(t *testing.T, dev *cuda.Device) DQAlgorithm {
	t.Helper()
	_, a, err := bwdDeviceArgs(s.q, s.k, s.v, s.o, s.lse, s.dO, s.dq, s.dk, s.dv, BackwardOptions{DeviceOptions: DeviceOptions{Options: s.opt}})
	if err != nil {
		t.Fatal(err)
	}
	return resolveDQ(s.p, DQAuto, DQKernels{Hopper: bwdHopperRuns(s.p, attn.BFloat16, &a, hopperCapable(dev), envBwdDeep())})
}

// bwdKernelTimes runs the backward of set with algo reps times after
// warm-up and returns the median milliseconds of each kernel and of the
// whole call.
func bwdKernelTimes(t *testing.T, b *Backend, s *cuda.Stream, set *bwdBenchSet, algo DQAlgorithm, warm, reps int) (map[string]float64, string) {
	return bwdKernelTimesTiles(t, b, s, set, algo, kernels.BwdTiles{}, warm, reps)
}

// bwdKernelTimesTiles is bwdKernelTimes with the tile table overridden.
func bwdKernelTimesTiles(t *testing.T, b *Backend, s *cuda.Stream, set *bwdBenchSet, algo DQAlgorithm, tiles kernels.BwdTiles, warm, reps int) (map[string]float64, string) {
	t.Helper()
	dev := b.Device()
	_, a, err := bwdDeviceArgs(set.q, set.k, set.v, set.o, set.lse, set.dO, set.dq, set.dk, set.dv, BackwardOptions{DeviceOptions: DeviceOptions{Options: set.opt}})
	if err != nil {
		t.Fatal(err)
	}
	a.Workspace = set.ws.Ptr()
	a.Tiles = tiles
	pl, err := planBackward(b.bwdRequest(set.p, attn.BFloat16, a, algo))
	if err != nil {
		t.Fatal(err)
	}
	m, err := b.module(bwdModuleSpec(pl.v))
	if err != nil {
		t.Fatal(err)
	}
	args, err := b.bwdLaunchArgs(pl)
	if err != nil {
		t.Fatal(err)
	}
	evs := make([]*cuda.Event, len(pl.launches)+1)
	for i := range evs {
		if evs[i], err = dev.NewEvent(); err != nil {
			t.Fatal(err)
		}
		defer evs[i].Close()
	}
	samples := map[string][]float64{}
	for r := 0; r < warm+reps; r++ {
		for i, l := range pl.launches {
			if err := evs[i].Record(s); err != nil {
				t.Fatal(err)
			}
			g := [3]uint32{uint32(l.grid[0]), uint32(l.grid[1]), uint32(l.grid[2])}
			if err := dev.Launch(m.function(l.kernel), g, [3]uint32{uint32(l.threads), 1, 1}, uint32(l.smem), s, args(l.kernel)); err != nil {
				t.Fatal(err)
			}
		}
		if err := evs[len(pl.launches)].Record(s); err != nil {
			t.Fatal(err)
		}
		if err := s.Synchronize(); err != nil {
			t.Fatalf("%s: %v", pl.v.Name(), err)
		}
		if r < warm {
			continue
		}
		var total float64
		for i, l := range pl.launches {
			ms, err := cuda.ElapsedMs(evs[i], evs[i+1])
			if err != nil {
				t.Fatal(err)
			}
			samples[l.kernel] = append(samples[l.kernel], float64(ms))
			total += float64(ms)
		}
		samples["total"] = append(samples["total"], total)
	}
	med := map[string]float64{}
	for k, x := range samples {
		sort.Float64s(x)
		med[k] = x[len(x)/2]
	}
	return med, pl.v.Name()
}

// TestBackwardBench prints the throughput table and the contention ratios.
func TestBackwardBench(t *testing.T) {
	if os.Getenv("FLASHATTN_BWD_BENCH") == "" {
		t.Skip("the backward benchmark runs with FLASHATTN_BWD_BENCH=1")
	}
	b := fwdBackend(t)
	dev := b.Device()
	s := testStream(t, dev)
	start := time.Now()
	var vs []kernels.BwdVariant
	for _, d := range []int{64, 128, 256} {
		for _, masked := range []bool{false, true} {
			for _, atomic := range []bool{false, true} {
				vs = append(vs, kernels.BwdVariant{DType: attn.BFloat16, DK: d, DV: d, Features: kernels.Features{Mask: kernels.MaskFor(masked)}, AtomicDQ: atomic, Vector: true})
			}
		}
	}
	spectrum, only := bwdSpectrumDims, bwdDimsFor(t, os.Getenv("FLASHATTN_BWD_BENCH_DIMS"))
	if only != nil {
		spectrum = only
	}
	for _, d := range spectrum {
		for _, atomic := range []bool{false, true} {
			vs = append(vs, kernels.BwdVariant{DType: attn.BFloat16, DK: d, DV: d, Vector: d%8 == 0, Staged: d%8 != 0, AtomicDQ: atomic})
		}
	}
	if hopperCapable(dev) {
		// the variants the planner picks on this device: compile those ahead
		for i, v := range vs {
			if v.WGMMA = true; kernels.BwdHopperOK(v) {
				vs[i] = v
			}
		}
	}
	sweep := bwdTileSweepFor(os.Getenv("FLASHATTN_BWD_BENCH_TILES"))
	for _, c := range sweep {
		for _, tl := range c.tiles {
			for _, atomic := range []bool{false, true} {
				vs = append(vs, bwdSweepVariant(c.d, atomic, tl))
			}
		}
	}
	bwdPrewarm(t, dev, vs)
	var out strings.Builder
	if len(sweep) > 0 {
		fmt.Fprintf(&out, "tile sweep, bf16, N=4096, B=4, H·D=2048, not causal (ms; dkdv+atomic includes the dQ atomics)\n")
		fmt.Fprintf(&out, "| D | dK/dV tile | dQ tile | dkdv | dq | dkdv+atomic | atomic total | separate total |\n|---|---|---|---|---|---|---|---|\n")
		for _, c := range sweep {
			set := newBwdBenchSet(t, b, s, 4, 4096, 2048/c.d, 2048/c.d, c.d, false)
			for _, tl := range c.tiles {
				ts, _ := bwdKernelTimesTiles(t, b, s, set, DQSeparate, tl, 1, 5)
				ta, _ := bwdKernelTimesTiles(t, b, s, set, DQAtomic, tl, 1, 5)
				fmt.Fprintf(&out, "| %d | %v | %v | %.3f | %.3f | %.3f | %.3f | %.3f |\n", c.d, tl.DKDV, tl.DQ,
					ts[kernels.BwdDKDVKernel], ts[kernels.BwdDQKernel], ta[kernels.BwdDKDVKernel], ta["total"], ts["total"])
			}
			set.free()
		}
	}
	fmt.Fprintf(&out, "backward bf16 on %s, %s\n", dev.Name(), time.Now().UTC().Format("2006-01-02"))
	fmt.Fprintf(&out, "| D | causal | N | atomic ms | atomic TFLOP/s | separate ms | separate TFLOP/s | auto picks |\n|---|---|---|---|---|---|---|---|\n")
	dims := []int{64, 128, 256}
	if only != nil {
		// the asked dims alone: in this table those of 64, 128 and 256 it has
		dims = slices.DeleteFunc(dims, func(d int) bool { return !slices.Contains(only, d) })
	}
	lens := []int{1024, 4096, 16384}
	if s := os.Getenv("FLASHATTN_BWD_BENCH_QUICK"); s != "" {
		lens = []int{4096}
	}
	for _, d := range dims {
		for _, causal := range []bool{false, true} {
			for _, n := range lens {
				bsz, h := 16384/n, 2048/d
				set := newBwdBenchSet(t, b, s, bsz, n, h, h, d, causal)
				flops := 2.5 * 4 * float64(bsz) * float64(h) * float64(n) * float64(n) * float64(d)
				if causal {
					flops /= 2
				}
				ta, _ := bwdKernelTimes(t, b, s, set, DQAtomic, 2, 7)
				ts, _ := bwdKernelTimes(t, b, s, set, DQSeparate, 2, 7)
				fmt.Fprintf(&out, "| %d | %v | %d | %.3f | %.0f | %.3f | %.0f | %v |\n", d, causal, n,
					ta["total"], flops/ta["total"]/1e9, ts["total"], flops/ts["total"]/1e9, set.autoDQ(t, dev))
				fmt.Fprintf(&out, "|   | kernels | | atomic: dkdv %.3f conv %.3f pre %.3f | | separate: dkdv %.3f dq %.3f | | |\n",
					ta[kernels.BwdDKDVKernel], ta[kernels.BwdDQConvertKernel], ta[kernels.BwdPreKernel], ts[kernels.BwdDKDVKernel], ts[kernels.BwdDQKernel])
				set.free()
			}
		}
	}
	fmt.Fprintf(&out, "\nhead-dim spectrum: B=1, H=16, N=M=4096, not causal, dQ algorithm of the table\n")
	fmt.Fprintf(&out, "| D | table picks | atomic ms | atomic TFLOP/s | separate ms | separate TFLOP/s |\n|---|---|---|---|---|---|\n")
	for _, d := range spectrum {
		set := newBwdBenchSet(t, b, s, 1, 4096, 16, 16, d, false)
		ta, _ := bwdKernelTimes(t, b, s, set, DQAtomic, 1, 5)
		ts, _ := bwdKernelTimes(t, b, s, set, DQSeparate, 1, 5)
		flops := 2.5 * 4 * 16 * 4096.0 * 4096.0 * float64(d)
		fmt.Fprintf(&out, "| %d | %v | %.3f | %.0f | %.3f | %.0f |\n", d, set.autoDQ(t, dev),
			ta["total"], flops/ta["total"]/1e9, ts["total"], flops/ts["total"]/1e9)
		fmt.Fprintf(&out, "|   | kernels | atomic: dkdv %.3f conv %.3f pre %.3f | | separate: dkdv %.3f dq %.3f pre %.3f | |\n",
			ta[kernels.BwdDKDVKernel], ta[kernels.BwdDQConvertKernel], ta[kernels.BwdPreKernel],
			ts[kernels.BwdDKDVKernel], ts[kernels.BwdDQKernel], ts[kernels.BwdPreKernel])
		set.free()
	}
	fmt.Fprintf(&out, "\ncontention: H=8, D=64, B·N=32768, ratio = time(Hkv=4) / time(Hkv=8)\n")
	fmt.Fprintf(&out, "| N | dK/dV (separate) | dQ separate | dK/dV+atomic dQ | atomic total | separate total |\n|---|---|---|---|---|---|\n")
	contention := []int{128, 256, 512, 1024, 2048, 4096}
	if only != nil {
		contention = nil
	}
	for _, n := range contention {
		var res [2][2]map[string]float64
		for hi, hkv := range []int{4, 8} {
			set := newBwdBenchSet(t, b, s, 32768/n, n, 8, hkv, 64, false)
			res[hi][0], _ = bwdKernelTimes(t, b, s, set, DQAtomic, 2, 9)
			res[hi][1], _ = bwdKernelTimes(t, b, s, set, DQSeparate, 2, 9)
			set.free()
		}
		r := func(algo int, k string) float64 { return res[0][algo][k] / res[1][algo][k] }
		fmt.Fprintf(&out, "| %d | %.3f | %.3f | %.3f | %.3f | %.3f |\n", n, r(1, kernels.BwdDKDVKernel), r(1, kernels.BwdDQKernel),
			r(0, kernels.BwdDKDVKernel), r(0, "total"), r(1, "total"))
	}
	fmt.Fprintf(&out, "benchmark wall time %.1fs\n", time.Since(start).Seconds())
	t.Log("\n" + out.String())
	if dir := os.Getenv("OUT"); dir != "" {
		_ = os.WriteFile(dir+"/bwd_bench.md", []byte(out.String()), 0o644)
	}
}

// bwdTileCase is one head dimension's tile candidates for the sweep.
type bwdTileCase struct {
	d     int
	tiles []kernels.BwdTiles
}

// bwdTileSweep lists the tile candidates the benchmark compares per head
// dim (kernels' defaultBwdTiles holds the winners).
func bwdTileSweep() []bwdTileCase {
	T := func(bm, bn, w, st, mb int) kernels.BwdTile {
		return kernels.BwdTile{BlockM: bm, BlockN: bn, Warps: w, Stages: st, MinBlocks: mb}
	}
	return []bwdTileCase{
		{64, []kernels.BwdTiles{
			{DKDV: T(64, 128, 8, 2, 1), DQ: T(128, 64, 8, 2, 1)},
			{DKDV: T(128, 128, 8, 2, 1), DQ: T(64, 128, 8, 2, 1)},
			{DKDV: T(64, 64, 4, 2, 2), DQ: T(64, 64, 4, 2, 2)},
			{DKDV: T(128, 64, 8, 2, 1), DQ: T(128, 128, 8, 2, 1)},
		}},
		{128, []kernels.BwdTiles{
			{DKDV: T(64, 128, 8, 2, 1), DQ: T(128, 64, 8, 2, 1)},
			{DKDV: T(128, 64, 8, 2, 1), DQ: T(64, 128, 8, 2, 1)},
			{DKDV: T(64, 64, 4, 2, 1), DQ: T(64, 64, 4, 2, 1)},
			{DKDV: T(32, 128, 8, 2, 1), DQ: T(128, 32, 8, 2, 1)},
		}},
		{256, []kernels.BwdTiles{
			{DKDV: T(64, 64, 8, 2, 1), DQ: T(64, 64, 8, 2, 1)},
			{DKDV: T(32, 64, 8, 2, 1), DQ: T(128, 32, 8, 2, 1)},
			{DKDV: T(64, 32, 8, 2, 1), DQ: T(32, 64, 8, 2, 1)},
			{DKDV: T(32, 128, 8, 1, 1), DQ: T(64, 64, 8, 1, 1)},
		}},
		{384, []kernels.BwdTiles{
			{DKDV: T(32, 32, 8, 2, 1), DQ: T(32, 32, 8, 2, 1)},
			{DKDV: T(64, 32, 8, 1, 1), DQ: T(32, 32, 8, 2, 1)},
			{DKDV: T(32, 32, 8, 1, 1), DQ: T(32, 32, 8, 1, 1)},
			{DKDV: T(16, 32, 4, 2, 1), DQ: T(32, 32, 8, 2, 1)},
			{DKDV: T(32, 64, 8, 1, 1), DQ: T(32, 64, 8, 1, 1)},
		}},
		{320, []kernels.BwdTiles{
			{DKDV: T(16, 32, 4, 2, 1), DQ: T(32, 32, 8, 2, 1)},
			{DKDV: T(32, 64, 8, 1, 1), DQ: T(32, 64, 8, 1, 1)},
			{DKDV: T(32, 64, 8, 1, 1), DQ: T(32, 32, 8, 2, 1)},
			{DKDV: T(16, 64, 4, 1, 1), DQ: T(32, 32, 8, 2, 1)},
		}},
		{512, []kernels.BwdTiles{
			{DKDV: T(32, 32, 8, 2, 1), DQ: T(32, 32, 8, 2, 1)},
			{DKDV: T(64, 32, 8, 1, 1), DQ: T(32, 32, 8, 2, 1)},
			{DKDV: T(16, 32, 4, 2, 1), DQ: T(32, 32, 8, 2, 1)},
			{DKDV: T(32, 64, 8, 1, 1), DQ: T(32, 32, 8, 2, 1)},
			{DKDV: T(64, 32, 4, 1, 1), DQ: T(64, 32, 8, 1, 1)},
			{DKDV: T(64, 16, 4, 1, 1), DQ: T(32, 64, 8, 1, 1)},
			{DKDV: T(64, 32, 8, 1, 1), DQ: T(64, 32, 8, 1, 1)},
			{DKDV: T(32, 32, 4, 1, 1), DQ: T(16, 32, 4, 2, 1)},
		}},
		{288, []kernels.BwdTiles{
			{DKDV: T(16, 32, 4, 2, 1), DQ: T(32, 32, 8, 2, 1)},
			{DKDV: T(32, 64, 8, 1, 1), DQ: T(32, 32, 8, 2, 1)},
		}},
		// Odd head dims (staged; padded to 208 and 272).
		{199, []kernels.BwdTiles{
			{DKDV: T(64, 64, 8, 2, 1), DQ: T(128, 32, 8, 2, 1)},
			{DKDV: T(64, 32, 8, 2, 1), DQ: T(64, 64, 8, 2, 1)},
			{DKDV: T(32, 64, 8, 2, 1), DQ: T(64, 32, 8, 2, 1)},
			{DKDV: T(32, 32, 4, 2, 1), DQ: T(32, 64, 4, 2, 1)},
		}},
		{257, []kernels.BwdTiles{
			{DKDV: T(16, 32, 4, 2, 1), DQ: T(32, 32, 8, 2, 1)},
			{DKDV: T(32, 32, 8, 2, 1), DQ: T(32, 32, 8, 2, 1)},
			{DKDV: T(64, 32, 8, 1, 1), DQ: T(64, 32, 8, 1, 1)},
			{DKDV: T(32, 64, 8, 1, 1), DQ: T(32, 64, 8, 1, 1)},
			{DKDV: T(32, 64, 8, 1, 1), DQ: T(32, 32, 8, 2, 1)},
		}},
	}
}

// bwdTileSweepFor returns the sweep cases FLASHATTN_BWD_BENCH_TILES asks
// for: none when empty, every case for "1", else the head dims of a
// comma-separated list.
func bwdTileSweepFor(env string) []bwdTileCase {
	if env == "" {
		return nil
	}
	all := bwdTileSweep()
	if env == "1" {
		return all
	}
	var sel []bwdTileCase
	for _, c := range all {
		for _, f := range strings.Split(env, ",") {
			if strings.TrimSpace(f) == fmt.Sprint(c.d) {
				sel = append(sel, c)
			}
		}
	}
	return sel
}

// bwdSweepVariant is the bf16 backward variant of the tile sweep at head
// dim d: 16-byte loads, from staging copies when d is not a multiple of 8.
func bwdSweepVariant(d int, atomic bool, tl kernels.BwdTiles) kernels.BwdVariant {
	return kernels.BwdVariant{DType: attn.BFloat16, DK: d, DV: d, AtomicDQ: atomic, Vector: d%8 == 0, Staged: d%8 != 0, Tiles: tl}
}

// TestBwdTileSweepValid checks that every benchmark tile candidate is a
// valid variant (shared memory, warp tilings).
func TestBwdTileSweepValid(t *testing.T) {
	for _, c := range bwdTileSweep() {
		for _, tl := range c.tiles {
			for _, atomic := range []bool{false, true} {
				v := bwdSweepVariant(c.d, atomic, tl)
				if err := v.Validate(); err != nil {
					t.Errorf("D=%d tiles %+v: %v", c.d, tl, err)
				}
			}
		}
	}
}

// bwdDimsFor parses FLASHATTN_BWD_BENCH_DIMS (comma-separated head dims;
// empty: nil). With it the benchmark times those dims alone (in the
// throughput table where it has them, and in the spectrum) and skips the
// contention table: a quick look, or a short run under a profiler.
func bwdDimsFor(t *testing.T, s string) []int {
	if s == "" {
		return nil
	}
	var dims []int
	for _, f := range strings.Split(s, ",") {
		d, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || d < 1 || d > attn.MaxHeadDim {
			t.Fatalf("FLASHATTN_BWD_BENCH_DIMS: %q is not a head dim from 1 to %d", f, attn.MaxHeadDim)
		}
		dims = append(dims, d)
	}
	return dims
}

// bwdSpectrumDims are the head dimensions of the spectrum table.
var bwdSpectrumDims = []int{59, 64, 96, 127, 128, 160, 192, 199, 256, 257, 320, 384, 512}
