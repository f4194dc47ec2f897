package gpu

import (
	"bytes"
	"fmt"
	"math"
	"os"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/kernels"
)

// The forward host emulator (see emu_test.go) runs the launch plan
// ForwardDevice would enqueue. It is slow, so it runs only when
// FLASHATTN_FWD_EMU is set.

// fwdEmuPointers are the device pointers of Params.
var fwdEmuPointers = []string{"q", "k", "v", "o", "lse", "bias", "cu_q", "cu_k", "nf_flag"}

// fwdEmuDriver names the forward kernel's parameters for driver.h.
var fwdEmuDriver = emuDriver("Params", fwdEmuPointers, []string{kernels.KernelName, kernels.NonFiniteKernel})

// fwdEmuTMADriver is fwdEmuDriver for a tensor-map kernel, which takes
// TmaParams (the addresses of its maps, kernels.Variant.TMAMapNames, and
// the Params in it relocated).
func fwdEmuTMADriver(v kernels.Variant) string {
	var ptrs []string
	for _, m := range v.TMAMapNames() {
		ptrs = append(ptrs, m+".w[0]")
	}
	for _, p := range fwdEmuPointers {
		ptrs = append(ptrs, "p."+p)
	}
	return emuDriver("TmaParams", ptrs, []string{kernels.KernelName, kernels.NonFiniteKernel})
}

// fwdEmuRun runs one forward call on the host emulator and returns O and
// LSE, checking that the guard bands around them are untouched and that
// every element was written (the outputs start as all-ones NaN).
func fwdEmuRun(t *testing.T, q, k, v attn.Tensor, opt attn.Options) (attn.Result, kernels.Variant) {
	t.Helper()
	return fwdEmuRunOn(t, q, k, v, opt, emuMMA)
}

// fwdEmuRunOn is fwdEmuRun on the kernels of kind (a plan that takes
// other kernels fails the test).
func fwdEmuRunOn(t *testing.T, q, k, v attn.Tensor, opt attn.Options, kind emuKernels) (attn.Result, kernels.Variant) {
	t.Helper()
	return fwdEmuRunTiles(t, q, k, v, opt, kind, nil)
}

// fwdEmuRunTiles is fwdEmuRunOn with the tile chosen by tiles (nil: the
// tuning tables), as Backend.Tiles chooses it.
func fwdEmuRunTiles(t *testing.T, q, k, v attn.Tensor, opt attn.Options, kind emuKernels, tiles func(dt attn.DType, dk, dv int, narrow bool) (kernels.Tile, error)) (attn.Result, kernels.Variant) {
	t.Helper()
	return fwdEmuRunShifted(t, q, k, v, opt, kind, tiles, 0)
}

// fwdEmuRunShifted is fwdEmuRunTiles with O's first element oShift bytes
// past where the arena would put it (2: rows of 16-bit elements that allow
// no paired stores).
func fwdEmuRunShifted(t *testing.T, q, k, v attn.Tensor, opt attn.Options, kind emuKernels, tiles func(dt attn.DType, dk, dv int, narrow bool) (kernels.Tile, error), oShift int) (attn.Result, kernels.Variant) {
	t.Helper()
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		t.Fatal(err)
	}
	dt := q.DType
	ar := &emuArena{}
	dev := func(x attn.Tensor) DeviceTensor {
		return DeviceTensor{DType: x.DType, Shape: x.Shape, Strides: attn.ContiguousStrides(x.Shape), base: ar.put(x.Bytes())}
	}
	dq, dk, dv := dev(q), dev(k), dev(v)
	var bias *DeviceTensor
	if opt.Bias != nil {
		b := dev(opt.Bias.Tensor)
		bias = &b
	}
	var cuq, cuk uint64
	if p.Varlen {
		cuq = ar.put(int32Bytes(opt.CuSeqlensQ))
		cuk = ar.put(int32Bytes(opt.CuSeqlensK))
	}
	outs := []emuOut{ar.outputShifted(p.OutputShape(), dt, oShift), ar.output(p.LSEShape(), attn.Float32)}
	do := DeviceTensor{DType: dt, Shape: outs[0].shape, Strides: attn.ContiguousStrides(outs[0].shape), base: outs[0].ptr()}
	dl := DeviceTensor{DType: attn.Float32, Shape: outs[1].shape, Strides: attn.ContiguousStrides(outs[1].shape), base: outs[1].ptr()}
	var part *fwdStaging
	tma := kind == emuHopperTMA || emuPipeline(kind).WarpSpecialized || emuPipeline(kind).StoreO || kind == emuDefault
	if heads, ok := flatStagedHeads(p, dt, dq, dk, dv); ok && tma {
		// the heads that do not fit in place go through staging copies, made by the pack kernel first
		size := stagingAt(p, dq, dk, dv, nil, 0, heads).bytes
		st := stagingAt(p, dq, dk, dv, nil, ar.poisoned(int(size)), heads)
		part = &st
		pack := emuBinary(t, kernels.PrimitivesBegin+"\n"+kernels.PrimitivesEnd+"\n"+kernels.PackSource, "pack.h", packEmuDriver())
		g, args := kernels.PackLaunch(st.params[:], st.grids[:])
		emuExec(t, pack, kernels.PackKernel, args, ar, []emuLaunch{{kernels.PackKernel, [3]int{int(g[0]), int(g[1]), int(g[2])}, kernels.PackThreads}}, nil)
	}
	pipeline, narrowDoubleQ := emuPipeline(kind), false
	if kind == emuDefault {
		// the pipeline a new backend asks for this call: the short pipeline's parts, the lazy
		// rescale, two Q buffers, the carried turns, as New sets them
		kb := emuDefaultKnobs()
		pipeline, narrowDoubleQ = kb.forwardPipeline(p, bias != nil), kb.FwdNarrowDoubleQ
	}
	req := fwdRequest{p: p, dt: dt, q: dq, k: dk, v: dv, o: do, lse: dl, bias: bias, cuq: cuq, cuk: cuk, hopper: kind != emuMMA, tma: tma, pipeline: pipeline, sms: 2, part: part, tiles: tiles,
		lightTail: envSet(os.Getenv(EnvFwdLightTail)), narrowDoubleQ: narrowDoubleQ}
	emuBiasKnobs(kind).setBiasStaging(&req)
	l, err := plan(req)
	if err != nil {
		t.Fatalf("plan: %v", err)
	}
	if want := req.lightTail && l.v.Mask == kernels.MaskWindow && !l.v.Persistent; l.v.LightTail != want {
		t.Fatalf("plan %s: light tail %v, want %v", l.v.Name(), l.v.LightTail, want)
	}
	l.params.NFFlag = ar.put(make([]byte, 16)) // the stream's non-finite flag and done counter, a persistent launch's tile counter and CTAs done: zero
	if part != nil && !l.v.FlatStaged {
		t.Fatalf("plan %s: not FlatStaged with the heads' staging copies", l.v.Name())
	}
	ws := emuPipeline(kind).WarpSpecialized
	if _, ok := kernels.HopperWSTile(l.v, p.M); ws && tiles == nil && !ok {
		ws = false // a class whose lockstep kernels measured faster (kernels.HopperWSTable)
	}
	if kind != emuDefault && (l.v.WGMMA != (kind != emuMMA) || l.v.TMA != tma || l.v.WarpSpecialized != ws ||
		l.v.Persistent != (emuPipeline(kind).Persistent && ws && !l.v.Flat && !p.Varlen)) {
		t.Fatalf("plan %s: not the kernels asked for (%d)", l.v.Name(), kind)
	}
	if want := emuPipeline(kind).StoreO && !l.v.Flat && !p.Varlen && p.DV%8 == 0 && oShift%16 == 0; want && kind != emuDefault {
		w := l.v
		w.StoreO = true
		if want = w.Validate() == nil; l.v.StoreO != want {
			t.Fatalf("plan %s: StoreO = %v, want %v", l.v.Name(), l.v.StoreO, want)
		}
	}
	if want := emuPipeline(kind).EarlyDropout && l.v.Dropout && l.v.WGMMA; kind != emuDefault && l.v.EarlyDropout != want {
		t.Fatalf("plan %s: EarlyDropout = %v, want %v", l.v.Name(), l.v.EarlyDropout, want)
	}
	if want := emuPipeline(kind).ProducerDropout && l.v.Dropout && l.v.WarpSpecialized && l.v.BlockN%32 == 0; kind != emuDefault && l.v.ProducerDropout != want {
		t.Fatalf("plan %s: ProducerDropout = %v, want %v", l.v.Name(), l.v.ProducerDropout, want)
	}
	if emuPipeline(kind).DoubleQ && kind != emuDefault {
		w := l.v
		w.DoubleQ = true
		if want := l.v.Persistent && w.Validate() == nil; l.v.DoubleQ != want {
			t.Fatalf("plan %s: DoubleQ = %v, want %v", l.v.Name(), l.v.DoubleQ, want)
		}
	}
	if kind != emuDefault {
		w := l.v
		w.CarryTurns = true
		if want := emuPipeline(kind).CarryTurns && w.Validate() == nil; l.v.CarryTurns != want {
			t.Fatalf("plan %s: CarryTurns = %v, want %v", l.v.Name(), l.v.CarryTurns, want)
		}
	}
	src, err := l.v.Source()
	if err != nil {
		t.Fatal(err)
	}
	driver, params, more := fwdEmuDriver, l.params.Pack(), []string(nil)
	if l.v.WGMMA {
		more = append(more, hopperEmuBlock(l.v.HopperProducts(), l.v.TMA, l.v.WarpSpecialized || l.v.StoreO))
	}
	if l.v.TMA {
		maps := make([][128]byte, len(l.tma))
		for i, x := range l.tma {
			maps[i] = emuTensorMap(x)
		}
		driver, params = fwdEmuTMADriver(l.v), make([]byte, l.v.TMAParamsSize())
		l.v.PackTMA(params, &l.params, maps...)
	}
	bin := emuBinary(t, src, "fwd.h", driver, more...)
	grid := [3]int{int(l.grid[0]), int(l.grid[1]), int(l.grid[2])}
	// the main kernel, then the non-finite fix-up on a few blocks (so that they stride over the CTAs);
	// on finite inputs the main kernel alone, which must leave the flag down (a raised one would only
	// cost time: the fix-up recomputes)
	launches := []emuLaunch{{kernels.KernelName, grid, l.v.Threads()}}
	finite := allFinite(opt, q, k, v)
	if !finite {
		fix := [3]int{int(kernels.NonFiniteBlocks(l.grid, 3)), 1, 1}
		launches = append(launches, emuLaunch{kernels.NonFiniteKernel, fix, l.v.Threads()})
	}
	emuExec(t, bin, l.v.Name(), params, ar, launches, nil)
	if flag := ar.at(l.params.NFFlag, 16); !bytes.Equal(flag, make([]byte, 16)) {
		if finite {
			t.Fatalf("non-finite flag and counters %v after the main kernel on finite inputs, want zero", flag)
		}
		t.Fatalf("non-finite flag, fix-up counter and tile counters %v after the launch, want zero", flag)
	}
	var r attn.Result
	for i, o := range outs {
		tt := ar.read(t, i, o)
		for e := 0; e < tt.NumElements(); e++ {
			if poisonedAt(tt, e) {
				t.Fatalf("output %d element %d not written (still the poison)", i, e)
			}
		}
		if i == 0 {
			r.O = tt
		} else {
			r.LSE = tt
		}
	}
	return r, l.v
}

// TestForwardEmulated runs the generated forward kernels (every load path,
// warp split, mask, feature) on the host emulator against the oracle.
func TestForwardEmulated(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "forward")
	tl := attn.AlignTopLeft
	cases := []fwdProblem{
		{name: "bf16-d64-causal", dt: attn.BFloat16, b: 1, n: 70, m: 150, h: 2, hkv: 1, dk: 64, dv: 64, opt: attn.Options{Causal: true}},
		{name: "bf16-d128-window-top-left", dt: attn.BFloat16, b: 1, n: 150, m: 90, h: 1, hkv: 1, dk: 128, dv: 128, opt: attn.Options{Window: &attn.Window{Left: 30, Right: 7}, Align: tl}},
		{name: "fp16-d59-narrow-gqa", dt: attn.Float16, b: 1, n: 80, m: 70, h: 2, hkv: 1, dk: 59, dv: 59, opt: attn.Options{Causal: true}},
		{name: "bf16-d199-narrow", dt: attn.BFloat16, b: 1, n: 40, m: 50, h: 1, hkv: 1, dk: 199, dv: 199},
		{name: "bf16-d111-narrow-window", dt: attn.BFloat16, b: 1, n: 60, m: 60, h: 1, hkv: 1, dk: 111, dv: 111, opt: attn.Options{Window: &attn.Window{Left: 5, Right: 3}}},
		{name: "fp32-d64-softcap-bias", dt: attn.Float32, b: 2, n: 40, m: 60, h: 2, hkv: 2, dk: 64, dv: 64, opt: attn.Options{Softcap: 3}, biasB: 1, bias: 2},
		// a bias shared by the batch over three batch elements and two heads
		{name: "bf16-d64-bias-1h-b3", dt: attn.BFloat16, b: 3, n: 40, m: 60, h: 2, hkv: 1, dk: 64, dv: 64, biasB: 1, bias: 2},
		{name: "bf16-d512-dropout", dt: attn.BFloat16, b: 1, n: 30, m: 70, h: 1, hkv: 1, dk: 512, dv: 512, opt: attn.Options{Dropout: 0.2, Seed: 5}},
		{name: "bf16-varlen-causal", dt: attn.BFloat16, h: 2, hkv: 1, dk: 64, dv: 64, segQ: []int{0, 70, 5}, segK: []int{9, 0, 40}, opt: attn.Options{Causal: true}},
		{name: "fp16-d256-stages2", dt: attn.Float16, b: 1, n: 70, m: 130, h: 1, hkv: 1, dk: 256, dv: 256},
		{name: "bf16-d257-narrow-split", dt: attn.BFloat16, b: 1, n: 20, m: 40, h: 1, hkv: 1, dk: 257, dv: 257, opt: attn.Options{Causal: true}},
		{name: "bf16-d128-dropout-softcap", dt: attn.BFloat16, b: 1, n: 70, m: 80, h: 2, hkv: 1, dk: 128, dv: 128, opt: attn.Options{Dropout: 0.3, Seed: 9, Softcap: 5, Causal: true}},
		{name: "fp32-d40-dv72", dt: attn.Float32, b: 1, n: 33, m: 50, h: 1, hkv: 1, dk: 40, dv: 72},
	}
	for i, pr := range cases {
		t.Run(pr.name, func(t *testing.T) {
			t.Parallel()
			q, k, v, opt := pr.inputs(uint64(500 + i))
			res, vr := fwdEmuRun(t, q, k, v, opt)
			t.Logf("%s", vr.Name())
			fwdCheck(t, pr.dt, q, k, v, opt, res)
		})
	}
}

// TestForwardEmulatedHopper runs the Hopper (wgmma) forward kernels on the
// host emulator against the oracle, with tiles loaded by cp.async and by
// tensor maps (FLASHATTN_FWD_EMU=1; needs g++).
func TestForwardEmulatedHopper(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "forward")
	cases := []fwdProblem{
		{name: "bf16-d64-causal-gqa", dt: attn.BFloat16, b: 1, n: 70, m: 150, h: 2, hkv: 1, dk: 64, dv: 64, opt: attn.Options{Causal: true}},
		{name: "fp16-d128-window-top-left", dt: attn.Float16, b: 1, n: 150, m: 90, h: 1, hkv: 1, dk: 128, dv: 128, opt: attn.Options{Window: &attn.Window{Left: 30, Right: 7}, Align: attn.AlignTopLeft}},
		{name: "bf16-d208-softcap-bias", dt: attn.BFloat16, b: 2, n: 40, m: 60, h: 2, hkv: 2, dk: 208, dv: 208, opt: attn.Options{Softcap: 3}, biasB: 1, bias: 2},
		{name: "bf16-d128-bias-1h-b3-causal", dt: attn.BFloat16, b: 3, n: 70, m: 90, h: 2, hkv: 1, dk: 128, dv: 128, opt: attn.Options{Causal: true}, biasB: 1, bias: 2},
		{name: "bf16-d256-dropout", dt: attn.BFloat16, b: 1, n: 70, m: 130, h: 1, hkv: 1, dk: 256, dv: 256, opt: attn.Options{Dropout: 0.2, Seed: 5}},
		// D = 128 with extras: the warp-specialized pipeline's extras tile (kernels.HopperWSTable), three key blocks
		{name: "fp16-d128-softcap-bias-dropout-causal", dt: attn.Float16, b: 1, n: 150, m: 300, h: 2, hkv: 1, dk: 128, dv: 128,
			opt: attn.Options{Softcap: 5, Dropout: 0.2, Seed: 7, Causal: true}, biasB: 1, bias: 2},
		// a bias whose rows start at odd keys (M odd), and a float32 bias
		{name: "bf16-d128-bias-m301-causal", dt: attn.BFloat16, b: 1, n: 150, m: 301, h: 2, hkv: 2, dk: 128, dv: 128, opt: attn.Options{Causal: true}, biasB: 1, bias: 2},
		{name: "bf16-d64-bias-fp32", dt: attn.BFloat16, b: 2, n: 70, m: 90, h: 2, hkv: 1, dk: 64, dv: 64, biasB: 2, bias: 1, biasDT: attn.Float32},
		{name: "bf16-d320-causal", dt: attn.BFloat16, b: 1, n: 50, m: 70, h: 1, hkv: 1, dk: 320, dv: 320, opt: attn.Options{Causal: true}},
		{name: "bf16-d512", dt: attn.BFloat16, b: 1, n: 30, m: 40, h: 1, hkv: 1, dk: 512, dv: 512},
		// past 320 the warpgroups split the keys: each loads the bias of its own half
		{name: "fp16-d384-bias-causal", dt: attn.Float16, b: 1, n: 50, m: 110, h: 2, hkv: 1, dk: 384, dv: 384, opt: attn.Options{Causal: true}, biasB: 1, bias: 2},
		// many key blocks: every K and V buffer reused several times (the warp-specialized pipeline's
		// empty barriers through several phases)
		{name: "bf16-d128-long-causal", dt: attn.BFloat16, b: 1, n: 130, m: 1000, h: 3, hkv: 1, dk: 128, dv: 128, opt: attn.Options{Causal: true}},
		{name: "fp16-d64-long", dt: attn.Float16, b: 1, n: 70, m: 700, h: 1, hkv: 1, dk: 64, dv: 64},
		// DK ≠ DV below 128 on the pipeline's tile for calls of at most 1024 keys (128 keys)
		{name: "bf16-dk40-dv72-m300", dt: attn.BFloat16, b: 1, n: 90, m: 300, h: 2, hkv: 1, dk: 40, dv: 72},
		{name: "bf16-varlen-causal", dt: attn.BFloat16, h: 2, hkv: 1, dk: 64, dv: 64, segQ: []int{0, 70, 5}, segK: []int{9, 0, 40}, opt: attn.Options{Causal: true}},
		// unmasked D ≤ 64: the warp-specialized pipeline's three-warpgroup tile (kernels.HopperWSTable), DK ≠ DV, packed
		{name: "fp16-dk48-dv64-varlen", dt: attn.Float16, h: 4, hkv: 2, dk: 48, dv: 64, segQ: []int{200, 1, 0}, segK: []int{130, 333, 5}},
		// a packed batch whose tiles run into the next sequence's rows (by tensor maps they are not zeros)
		{name: "fp16-d128-varlen-crossing-window", dt: attn.Float16, h: 4, hkv: 2, dk: 128, dv: 128, segQ: []int{37, 170, 150}, segK: []int{50, 130, 290}, opt: attn.Options{Window: &attn.Window{Left: 70, Right: 20}}},
		// odd head dims read in place over flat rows (tensor maps only): sixteen heads take every shift
		// (h·D mod 16: from 32-byte box starts where the head fits, else 16-byte ones);
		// with fewer than 7 padding columns the heads that do not fit come from staging copies of them
		// alone (flatstaged/: 59, 123 and 187 have 2 such heads in 8)
		{name: "flat/bf16-d199-causal", dt: attn.BFloat16, b: 2, n: 70, m: 90, h: 16, hkv: 16, dk: 199, dv: 199, opt: attn.Options{Causal: true}},
		{name: "flat/fp16-d201-dv185-softcap-bias-dropout", dt: attn.Float16, b: 1, n: 50, m: 70, h: 8, hkv: 8, dk: 201, dv: 185, opt: attn.Options{Softcap: 4, Dropout: 0.1, Seed: 3}, biasB: 1, bias: 8},
		{name: "flat/bf16-d257", dt: attn.BFloat16, b: 1, n: 40, m: 50, h: 16, hkv: 16, dk: 257, dv: 257},
		{name: "flatstaged/bf16-d59-causal", dt: attn.BFloat16, b: 2, n: 70, m: 90, h: 16, hkv: 16, dk: 59, dv: 59, opt: attn.Options{Causal: true}},
		{name: "flatstaged/fp16-d123-dv64-bias", dt: attn.Float16, b: 1, n: 50, m: 70, h: 8, hkv: 8, dk: 123, dv: 64, biasB: 1, bias: 8},
		{name: "flatstaged/bf16-d187-dv59-dropout", dt: attn.BFloat16, b: 1, n: 40, m: 50, h: 8, hkv: 8, dk: 187, dv: 59, opt: attn.Options{Dropout: 0.2, Seed: 4}},
		{name: "flat/bf16-d60", dt: attn.BFloat16, b: 1, n: 40, m: 50, h: 8, hkv: 8, dk: 60, dv: 60},
	}
	for _, kind := range []emuKernels{emuHopper, emuHopperTMA, emuHopperWS, emuHopperPP, emuHopperPT, emuHopperSO, emuHopperPTSO, emuHopperLR, emuHopperHM, emuHopperPD, emuHopperPDPT, emuHopperQ2, emuHopperCT, emuHopperPE} {
		for i, pr := range cases {
			q, k, v, opt := pr.inputs(uint64(700 + i))
			name := fmt.Sprintf("%s/%s", map[emuKernels]string{emuHopper: "cp.async", emuHopperTMA: "tensor-maps", emuHopperWS: "warp-specialized", emuHopperPP: "ping-pong", emuHopperPT: "persistent",
				emuHopperSO: "tma-store", emuHopperPTSO: "persistent-tma-store", emuHopperLR: "lazy-rescale", emuHopperHM: "head-major", emuHopperPD: "producer-dropout", emuHopperPDPT: "producer-dropout-persistent", emuHopperQ2: "double-q", emuHopperCT: "carry-turns", emuHopperPE: "poly-exp"}[kind], pr.name)
			t.Run(name, func(t *testing.T) {
				if emuPipeline(kind).WarpSpecialized && max(pr.dk, pr.dv) > 320 {
					t.Skip("two warpgroups per row group keep the lockstep pipeline")
				}
				staged := strings.HasPrefix(pr.name, "flatstaged/")
				flat := staged || strings.HasPrefix(pr.name, "flat/")
				if flat && kind == emuHopper {
					t.Skip("rows read in place need tensor maps")
				}
				res, vr := fwdEmuRunOn(t, q, k, v, opt, kind)
				t.Logf("%s", vr.Name())
				if vr.Flat != flat || vr.FlatStaged != staged {
					t.Fatalf("plan %s: Flat = %v, FlatStaged = %v, want %v, %v", vr.Name(), vr.Flat, vr.FlatStaged, flat, staged)
				}
				fwdCheck(t, pr.dt, q, k, v, opt, res)
			})
		}
	}
}

// TestForwardEmulatedUnalignedO runs persistent forwards (among them the
// default's: these calls take the short pipeline) into an O that starts one
// 16-bit element past a 4-byte boundary (its rows allow no paired stores,
// nor a tensor map), two CTAs through several tiles each
// (FLASHATTN_FWD_EMU=1; needs g++): O leaves from registers element by
// element, since the producer is loading the next tile's tiles into the
// shared memory an O staged there would take.
func TestForwardEmulatedUnalignedO(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "forward")
	cases := []fwdProblem{
		{name: "bf16-d128", dt: attn.BFloat16, b: 1, n: 512, m: 200, h: 2, hkv: 2, dk: 128, dv: 128},
		{name: "fp16-d256-gqa", dt: attn.Float16, b: 1, n: 512, m: 170, h: 2, hkv: 1, dk: 256, dv: 256},
		{name: "bf16-d128-causal", dt: attn.BFloat16, b: 2, n: 300, m: 300, h: 2, hkv: 2, dk: 128, dv: 128, opt: attn.Options{Causal: true}},
		{name: "bf16-d128-window", dt: attn.BFloat16, b: 1, n: 400, m: 400, h: 2, hkv: 2, dk: 128, dv: 128, opt: attn.Options{Window: &attn.Window{Left: 60, Right: 10}}},
	}
	for _, kind := range []emuKernels{emuHopperPT, emuHopperCT, emuDefault} {
		for i, pr := range cases {
			name := map[emuKernels]string{emuHopperPT: "persistent", emuHopperCT: "carry-turns", emuDefault: "default"}[kind] + "/" + pr.name
			t.Run(name, func(t *testing.T) {
				q, k, v, opt := pr.inputs(uint64(900 + i))
				res, vr := fwdEmuRunShifted(t, q, k, v, opt, kind, nil, 2)
				t.Logf("%s", vr.Name())
				if !vr.Persistent || vr.StoreO {
					t.Fatalf("plan %s: want persistent CTAs storing O from registers", vr.Name())
				}
				fwdCheck(t, pr.dt, q, k, v, opt, res)
			})
		}
	}
}

// TestForwardEmulatedDefaultRandom draws forward calls in the layouts the
// Hopper kernels read by tensor maps (16-bit, contiguous, head dims a
// multiple of 8, DK ≠ DV among them) with every mask and feature a short
// call can take — causal either way, windows, softcap, dropout, GQA, rows
// with no key — and runs each through the plan a new backend makes on two
// emulated SMs, so that most take persistent CTAs through several tiles
// (FLASHATTN_FWD_EMU=1; needs g++; 10 calls, 40 with
// FLASHATTN_EMU_RANDOM=all).
func TestForwardEmulatedDefaultRandom(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "forward")
	for i, c := range drawEmuCalls(12, 10, 40, 600) {
		pr := fwdProblem{name: c.name(i), dt: c.dt, b: c.b, n: c.n, m: c.m, h: c.h, hkv: c.hkv, dk: c.dk, dv: c.dv, opt: c.opt}
		t.Run(pr.name, func(t *testing.T) {
			q, k, v, opt := pr.inputs(uint64(1000 + i))
			res, vr := fwdEmuRunOn(t, q, k, v, opt, emuDefault)
			t.Logf("%s", vr.Name())
			fwdCheck(t, pr.dt, q, k, v, opt, res)
		})
	}
}

// TestForwardEmulatedLazyRescale runs the lazy rescale
// (kernels.Pipeline.LazyRescale) on the host emulator with scores that grow
// toward the first keys, which the kernel visits last, so that rows move
// their references in late blocks as well as in the first, and some rows
// keep them (FLASHATTN_FWD_EMU=1; needs g++): against the oracle, with
// rows that see no key (bottom-right causal, N > M) among them.
func TestForwardEmulatedLazyRescale(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "forward")
	cases := []fwdProblem{
		{name: "bf16-d128", dt: attn.BFloat16, b: 1, n: 130, m: 700, h: 2, hkv: 1, dk: 128, dv: 128},
		{name: "fp16-d64-causal-empty-rows", dt: attn.Float16, b: 1, n: 300, m: 260, h: 2, hkv: 2, dk: 64, dv: 64, opt: attn.Options{Causal: true}},
	}
	for i, pr := range cases {
		t.Run(pr.name, func(t *testing.T) {
			q, k, v, opt := pr.inputs(uint64(1300 + i))
			q = fwdScaled(q, 2)
			kf := k.Float32s()
			for j := 0; j < pr.m; j++ { // key j's scores scaled by 1 + 6·(M−1−j)/(M−1)
				g := float32(1 + 6*float64(pr.m-1-j)/float64(pr.m-1))
				row := kf[j*pr.hkv*pr.dk : (j+1)*pr.hkv*pr.dk]
				for x := range row {
					row[x] *= g
				}
			}
			k = attn.FromFloat32(pr.dt, kf, k.Shape...)
			res, vr := fwdEmuRunOn(t, q, k, v, opt, emuHopperLR)
			if !vr.LazyRescale {
				t.Fatalf("plan %s: no lazy rescale", vr.Name())
			}
			fwdCheck(t, pr.dt, q, k, v, opt, res)
		})
	}
}

// fwdScaled returns x with every element multiplied by c.
func fwdScaled(x attn.Tensor, c float32) attn.Tensor {
	f := x.Float32s()
	for i := range f {
		f[i] *= c
	}
	return attn.FromFloat32(x.DType, f, x.Shape...)
}

// TestForwardEmulatedNonFinite runs inputs with NaN and ±Inf (fwdNaNCases,
// and fwdNaNTransformCases with dropout, a bias, a softcap and flat rows)
// through every forward kernel family on the host emulator: the mma.sync
// kernels, and the Hopper kernels with tiles by cp.async and by tensor maps
// (odd head dims there over flat rows, in place and staged), lockstep and
// warp-specialized.
func TestForwardEmulatedNonFinite(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "forward")
	kinds := []struct {
		name string
		kind emuKernels
	}{{"mma", emuMMA}, {"cp.async", emuHopper}, {"tensor-maps", emuHopperTMA}, {"warp-specialized", emuHopperWS}, {"ping-pong", emuHopperPP}, {"persistent", emuHopperPT},
		{"lazy-rescale", emuHopperLR}, {"head-major", emuHopperHM}, {"producer-dropout", emuHopperPD}, {"producer-dropout-persistent", emuHopperPDPT}, {"double-q", emuHopperQ2}, {"carry-turns", emuHopperCT}, {"poly-exp", emuHopperPE}}
	cases := fwdNaNTransformCases()
	for _, c := range fwdNaNCases() {
		cases = append(cases, fwdNaNTransformCase{fwdNaNCase: c, biasRow: -1})
	}
	for _, kd := range kinds {
		for i, c := range cases {
			t.Run(kd.name+"/"+c.name, func(t *testing.T) {
				hopper := kd.kind != emuMMA
				switch {
				case hopper && c.dt == attn.Float32:
					t.Skip("the Hopper kernels take 16-bit types")
				case kd.kind == emuHopper && c.dk%8 != 0:
					t.Skip("rows not 16-byte aligned: the Hopper kernels read them over flat rows, by tensor maps only")
				case emuPipeline(kd.kind).WarpSpecialized && max(c.dk, c.dv) > 320:
					t.Skip("two warpgroups per row group keep the lockstep pipeline")
				}
				t.Parallel()
				q, k, v, opt := c.inputs(uint64(1100 + i))
				res, vr := fwdEmuRunOn(t, q, k, v, opt, kd.kind)
				t.Logf("%s", vr.Name())
				fwdCheckNonFinite(t, c.dt, q, k, v, opt, res)
			})
		}
	}
}

// fwdNaNTransformCase is a fwdNaNCase whose bias, when biasRow >= 0, is
// −inf for every key of query position biasRow of head 0: a row whose
// scores are all −inf, which gets O = 0 and LSE = −inf whatever the values
// of the keys it sees.
type fwdNaNTransformCase struct {
	fwdNaNCase
	biasRow int
}

// inputs returns the tensors and options of c, poisoned.
func (c fwdNaNTransformCase) inputs(seed uint64) (q, k, v attn.Tensor, opt attn.Options) {
	q, k, v, opt = c.fwdNaNCase.inputs(seed)
	if c.biasRow >= 0 && opt.Bias != nil {
		bt := opt.Bias.Tensor
		for j := 0; j < bt.Shape[3]; j++ {
			bt.Set(float32(math.Inf(-1)), 0, 0, c.biasRow, j)
		}
	}
	return q, k, v, opt
}

// fwdNaNTransformCases are non-finite inputs of the forward kernels with
// the score transforms and dropout, which the kernels' slow path for
// non-finite O (kernels/fwd_mask.go) recomputes: NaN and ±Inf in value rows
// that the causal or window mask hides from some rows (in the diagonal and
// window-edge blocks) under dropout (a visible key's NaN or Inf reaches
// the row even where dropout drops it: 0·NaN, 0·Inf), a bias (with a row
// whose scores are all −inf), a softcap; and, over flat rows, NaN in key
// columns that a neighbouring head's tile holds.
func fwdNaNTransformCases() []fwdNaNTransformCase {
	nan, inf := math.NaN(), math.Inf(1)
	pr := func(name string, dt attn.DType, n, m, h, d int, opt attn.Options, bias int) fwdProblem {
		return fwdProblem{name: name, dt: dt, b: 1, n: n, m: m, h: h, hkv: h, dk: d, dv: d, opt: opt, biasB: 1, bias: bias}
	}
	win := &attn.Window{Left: 30, Right: 7}
	return []fwdNaNTransformCase{
		{fwdNaNCase{pr("d64-150x200-causal-dropout", attn.BFloat16, 150, 200, 2, 64, attn.Options{Causal: true, Dropout: 0.3, Seed: 11}, 0), []fwdPoison{
			{'v', 0, 120, 0, -1, nan}, {'v', 0, 160, 1, 5, inf}, {'v', 0, 199, 0, 2, -inf}, {'q', 0, 10, 1, -1, nan}}}, -1},
		// NaN query rows that see one to four keys (top-left): where dropout drops them all, O = 0·v
		{fwdNaNCase{pr("d64-40-causal-top-left-dropout", attn.BFloat16, 40, 40, 2, 64, attn.Options{Causal: true, Align: attn.AlignTopLeft, Dropout: 0.5, Seed: 9}, 0), []fwdPoison{
			{'q', 0, 0, 0, -1, nan}, {'q', 0, 1, 0, -1, nan}, {'q', 0, 2, 1, 0, nan}, {'q', 0, 3, 1, -1, nan}, {'v', 0, 1, 0, 3, inf}}}, -1},
		{fwdNaNCase{pr("d128-200-window-dropout", attn.Float16, 200, 200, 2, 128, attn.Options{Window: win, Dropout: 0.2, Seed: 4, Offset: 3}, 0), []fwdPoison{
			{'v', 0, 50, 0, -1, nan}, {'v', 0, 150, 1, 9, inf}, {'k', 0, 100, 1, -1, nan}}}, -1},
		{fwdNaNCase{pr("d64-150x200-causal-bias", attn.BFloat16, 150, 200, 2, 64, attn.Options{Causal: true}, 2), []fwdPoison{
			{'v', 0, 120, 0, -1, nan}, {'v', 0, 100, 0, 3, -inf}, {'v', 0, 190, 1, -1, inf}}}, 130},
		{fwdNaNCase{pr("d64-100-causal-softcap-bias-dropout", attn.BFloat16, 100, 100, 2, 64, attn.Options{Causal: true, Softcap: 5, Dropout: 0.2, Seed: 7}, 2), []fwdPoison{
			{'v', 0, 60, 0, -1, nan}, {'v', 0, 70, 1, 4, inf}, {'k', 0, 80, 0, -1, nan}}}, 50},
		{fwdNaNCase{pr("d128-120-window-softcap", attn.Float16, 120, 120, 1, 128, attn.Options{Window: win, Softcap: 3}, 0), []fwdPoison{
			{'v', 0, 40, 0, -1, nan}, {'v', 0, 90, 0, 100, -inf}}}, -1},
		// the key NaNs sit in columns that the neighbouring heads' tiles hold (flat rows), and a value's
		{fwdNaNCase{pr("d59-200-causal-neighbour-columns", attn.BFloat16, 200, 200, 16, 59, attn.Options{Causal: true}, 0), []fwdPoison{
			{'k', 0, 130, 6, 58, nan}, {'k', 0, 70, 9, 0, inf}, {'v', 0, 90, 3, 0, nan}, {'v', 0, 100, 12, 58, -inf}}}, -1},
	}
}

// TestForwardEmulatedWideTiles runs the wider tiles of the Hopper tile
// sweep (benchfwd's hsweep: three compute warpgroups at D = 64, 176 keys at
// D = 128) on the warp-specialized pipelines: three compute warpgroups
// take 160 registers each and no ping-pong, and the persistent schedule
// walks several tiles per CTA.
func TestForwardEmulatedWideTiles(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "forward")
	hl := func(bm, bn int) kernels.Tile {
		return kernels.Tile{BlockM: bm, BlockN: bn, WarpsM: bm / 16, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true}
	}
	cases := []struct {
		pr   fwdProblem
		tile kernels.Tile
	}{
		{fwdProblem{name: "bf16-d64-m192-causal", dt: attn.BFloat16, b: 1, n: 400, m: 500, h: 2, hkv: 1, dk: 64, dv: 64, opt: attn.Options{Causal: true}}, hl(192, 128)},
		{fwdProblem{name: "fp16-d128-n176", dt: attn.Float16, b: 1, n: 150, m: 600, h: 2, hkv: 2, dk: 128, dv: 128}, hl(128, 176)},
	}
	for i, c := range cases {
		for _, kind := range []emuKernels{emuHopperWS, emuHopperPT} {
			t.Run(fmt.Sprintf("%s/%v", c.pr.name, emuPipeline(kind)), func(t *testing.T) {
				t.Parallel()
				q, k, v, opt := c.pr.inputs(uint64(900 + i))
				res, vr := fwdEmuRunTiles(t, q, k, v, opt, kind, func(attn.DType, int, int, bool) (kernels.Tile, error) { return c.tile, nil })
				t.Logf("%s", vr.Name())
				if vr.BlockM != c.tile.BlockM || vr.BlockN != c.tile.BlockN || !vr.WarpSpecialized {
					t.Fatalf("plan %s: not the tile and pipeline asked for", vr.Name())
				}
				fwdCheck(t, c.pr.dt, q, k, v, opt, res)
			})
		}
	}
}

// TestForwardEmulatedBiasStaged runs biased forwards on the warp-specialized
// Hopper kernels with the bias staged through shared memory
// (EnvBiasStaged, kernels.Variant.BiasStaged) on the host emulator
// against the float64 reference: rows past the queries in the last block,
// keys past M, broadcast batch or head dims, both 16-bit bias types, a mask,
// softcap and dropout; a bias whose rows are not 16-byte aligned keeps the
// loads from global memory (FLASHATTN_FWD_EMU=1; needs g++).
func TestForwardEmulatedBiasStaged(t *testing.T) {
	emuSkip(t, "FLASHATTN_FWD_EMU", "forward")
	t.Setenv(EnvBiasStaged, "1")
	cases := []fwdProblem{
		{name: "bf16-d128-causal-m304", dt: attn.BFloat16, b: 1, n: 150, m: 304, h: 2, hkv: 1, dk: 128, dv: 128, opt: attn.Options{Causal: true}, biasB: 1, bias: 2},
		{name: "fp16-d64-softcap-window-m136", dt: attn.Float16, b: 2, n: 100, m: 136, h: 2, hkv: 2, dk: 64, dv: 64, opt: attn.Options{Softcap: 5, Window: &attn.Window{Left: 40, Right: 9}}, biasB: 2, bias: 1},
		{name: "bf16-d128-dropout-m264-fp16bias", dt: attn.BFloat16, b: 1, n: 130, m: 264, h: 2, hkv: 2, dk: 128, dv: 128, opt: attn.Options{Dropout: 0.2, Seed: 9}, biasB: 1, bias: 1, biasDT: attn.Float16},
		{name: "bf16-d128-m301-unaligned", dt: attn.BFloat16, b: 1, n: 70, m: 301, h: 2, hkv: 2, dk: 128, dv: 128, biasB: 1, bias: 2},
	}
	for _, kind := range []emuKernels{emuHopperWS, emuHopperPP, emuHopperPT} {
		for i, pr := range cases {
			q, k, v, opt := pr.inputs(uint64(900 + i))
			t.Run(fmt.Sprintf("%d/%s", kind, pr.name), func(t *testing.T) {
				res, vr := fwdEmuRunOn(t, q, k, v, opt, kind)
				want := pr.m%8 == 0 && vr.BlockN%64 == 0
				if vr.BiasStaged != want {
					t.Fatalf("plan %s: BiasStaged = %v, want %v", vr.Name(), vr.BiasStaged, want)
				}
				fwdCheck(t, pr.dt, q, k, v, opt, res)
			})
		}
	}
}
