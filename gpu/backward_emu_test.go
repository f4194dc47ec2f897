package gpu

import (
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
	"github.com/flashattn/flashattn/kernels"
)

// The backward host emulator (see emu_test.go) runs the launch plan
// enqueueBackward would enqueue. It is slow, so it runs only when
// FLASHATTN_BWD_EMU is set.

// bwdEmuPointers are the device pointers of BwdParams.
var bwdEmuPointers = []string{"q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "dqacc", "delta", "lse2", "bias", "dbias_scratch", "dbias",
	"cuq", "cuk", "pq", "pk", "pv", "pdo", "nf_flag"}

// bwdEmuDriver names the backward kernels' parameters and the kernels of
// variant v for driver.h: with tensor maps, the dK/dV and dQ kernels take
// BwdTmaParams (the maps' addresses and the BwdParams in it relocated).
func bwdEmuDriver(v kernels.BwdVariant) string {
	first := emuParamSet{"BwdParams", bwdEmuPointers, kernels.BwdKernelNames(v)}
	if !v.TMA {
		return emuDriver2(first, emuParamSet{})
	}
	second := emuParamSet{ctype: "BwdTmaParams", pointers: []string{"a.w[0]", "b.w[0]"}, kernels: bwdEmuTMAKernels}
	if v.BiasStaged {
		second.pointers = append(second.pointers, "c.w[0]") // the bias's map
	}
	if v.DBiasByMap() {
		second.pointers = append(second.pointers, "d.w[0]") // dBias's map
	}
	if v.Persistent {
		second.pointers = append(second.pointers, "c.w[0]", "d.w[0]") // k's and v's maps
	}
	for _, p := range bwdEmuPointers {
		second.pointers = append(second.pointers, "p."+p)
	}
	first.kernels = slices.DeleteFunc(slices.Clone(first.kernels), func(k string) bool { return slices.Contains(bwdEmuTMAKernels, k) })
	return emuDriver2(first, second)
}

// emuBwdPlanned, when set, sees the variant of each emulated backward's
// plan (a test that must know which path its cases took).
var emuBwdPlanned func(kernels.BwdVariant)

// bwdEmuTMAKernels are the kernels of a tensor-map variant that take
// BwdTmaParams.
var bwdEmuTMAKernels = []string{kernels.BwdDKDVKernel, kernels.BwdDQKernel}

// emuRunOn runs one backward call on the host emulator and returns the
// gradients (with guard bands and NaN poisoning checked like bwdRun).
// kind says which kernels the plan must take;
// headMajor stores the inputs [B, H, N, D].
func emuRunOn(t *testing.T, in bwdInputs, algo DQAlgorithm, headMajor bool, kind emuKernels) attn.Gradients {
	t.Helper()
	return emuRunTiles(t, in, algo, headMajor, kind, kernels.BwdTiles{})
}

// emuRunTiles is emuRunOn with the tiles of the plan's kernels (zero: the
// tile table's).
func emuRunTiles(t *testing.T, in bwdInputs, algo DQAlgorithm, headMajor bool, kind emuKernels, tiles kernels.BwdTiles) attn.Gradients {
	t.Helper()
	return emuRunLaid(t, in, algo, kind, emuBwdLayout{headMajor: headMajor, tiles: tiles})
}

// emuBwdLayout is how an emulated backward lays out its inputs and which
// tiles its plan takes.
type emuBwdLayout struct {
	headMajor bool             // inputs stored [B, H, N, D]
	tiles     kernels.BwdTiles // the plan's tiles (zero: the tile table's)
	oShift    int              // bytes O starts past its 256-byte aligned place (its rows then leave 16-byte units)
}

// emuRunLaid is emuRunOn with the inputs laid out as l says.
func emuRunLaid(t *testing.T, in bwdInputs, algo DQAlgorithm, kind emuKernels, l emuBwdLayout) attn.Gradients {
	t.Helper()
	dt := in.q.DType
	ar := &emuArena{}
	a := bwdArgs{Tiles: l.tiles}
	for _, x := range []struct {
		t   attn.Tensor
		dst *bwdView
	}{{in.q, &a.Q}, {in.k, &a.K}, {in.v, &a.V}, {in.o, &a.O}, {in.dO, &a.DO}} {
		if l.headMajor {
			*x.dst = headMajorView(ar, x.t)
			continue
		}
		if x.dst == &a.O && l.oShift != 0 {
			*x.dst = seqView(ar.put(append(make([]byte, l.oShift), x.t.Bytes()...))+uint64(l.oShift), dt, x.t.Shape)
			continue
		}
		*x.dst = seqView(ar.put(x.t.Bytes()), dt, x.t.Shape)
	}
	a.LSE = lseView(ar.put(in.lse.Bytes()), in.lse.Shape)
	outs := []emuOut{ar.output(in.q.Shape, dt), ar.output(in.k.Shape, dt), ar.output(in.v.Shape, dt)}
	a.DQ = seqView(outs[0].ptr(), dt, in.q.Shape)
	a.DK = seqView(outs[1].ptr(), dt, in.k.Shape)
	a.DV = seqView(outs[2].ptr(), dt, in.v.Shape)
	if in.opt.Bias != nil {
		bt := in.opt.Bias.Tensor
		a.Bias = biasView(ar.put(bt.Bytes()), bt.DType, bt.Shape)
		if in.opt.Bias.RequiresGrad {
			o := ar.output(bt.Shape, bt.DType)
			outs = append(outs, o)
			a.DBias = biasView(o.ptr(), bt.DType, bt.Shape)
		}
	}
	if in.p.Varlen {
		a.CuSeqlensQ = ar.put(int32Bytes(in.opt.CuSeqlensQ))
		a.CuSeqlensK = ar.put(int32Bytes(in.opt.CuSeqlensK))
	}
	a.Workspace = ar.poisoned(int(BackwardWorkspaceBytes(in.p, in.q.DType, algo, in.opt.Bias != nil && in.opt.Bias.RequiresGrad)))
	hopper := kind != emuMMA
	tma := emuBwdTMA(kind) || kind == emuDefault
	q80 := kind == emuHopperBwdWSKeyRows80 || kind == emuHopperBwdWSKeyRows80Bulk
	q128 := kind == emuHopperBwdWSKeyRows128 || kind == emuHopperBwdWSKeyRows128Bulk
	bulk := kind == emuHopperBulk || kind == emuHopperBwdWSBulk || kind == emuHopperBwdWSKeyRowsBulk || kind == emuHopperBwdWSKeyRows80Bulk || kind == emuHopperBwdWSKeyRows128Bulk
	keyRows := kind == emuHopperBwdWSKeyRows || kind == emuHopperBwdWSKeyRowsBulk || q80 || q128
	queryStep := 0
	switch {
	case q80:
		queryStep = 80
	case q128:
		queryStep = 128
	}
	ws := kind == emuHopperBwdWS || kind == emuHopperBwdWSBulk || keyRows
	deep := true // the emulator checks the Hopper kernels past 256 whether or not a backend allows them
	keyRowsAuto := false
	if kind == emuDefault {
		kb := emuDefaultKnobs()
		ws, bulk, keyRows, keyRowsAuto, deep = kb.BwdPipeline.WarpSpecialized, kb.BulkDQ, kb.BwdKeyRows, kb.BwdKeyRowsAuto, kb.BwdDeep
	}
	knobs := emuBiasKnobs(kind)
	pl, err := planBackward(bwdRequest{p: in.p, dt: dt, a: a, algo: algo, sms: 4, hopper: hopper, tma: tma, bulkDQ: bulk, ws: ws, keyRows: keyRows,
		keyRowsAuto: keyRowsAuto, queryStep: queryStep, biasStaged: knobs.biasStaged(), lightTail: emuBwdLightTail(hopper), persistent: hopper && envSet(os.Getenv(EnvBwdPersistent)), producerDropout: hopper && envSet(os.Getenv(EnvBwdProducerDropout)), deep: deep,
		dbiasAtomic: knobs.DBiasAtomic, dbiasAtomicAuto: knobs.DBiasAtomicAuto, dbiasDirect: knobs.DBiasDirect, dbiasTiles: knobs.DBiasTiles, dbiasStore: knobs.DBiasStore, dbiasReduce: knobs.DBiasReduce})
	if err != nil {
		t.Fatalf("plan: %v", err)
	}
	if tail := emuBwdLightTail(hopper); pl.v.LightTail != (tail && pl.v.Masked()) {
		t.Fatalf("plan %s: light tail %v under %s=%v", pl.v.Name(), pl.v.LightTail, EnvBwdLightTail, tail)
	}
	if pl.v.BulkDQ {
		// the bulk reduce-adds stay inside the dQ accumulator
		ar.reduce = [][2]uint64{{a.Workspace + uint64(pl.w.dqacc), a.Workspace + uint64(pl.w.dqacc+pl.w.dqaccBytes)}}
	}
	if pl.v.DBiasPath == kernels.DBiasTiles {
		// and dBias's into its tiles
		end := pl.w.dbias + 4*kernels.DBiasTilesFloats(a.Bias.Batches*a.Bias.Heads, in.p.N, in.p.M)
		ar.reduce = append(ar.reduce, [2]uint64{a.Workspace + uint64(pl.w.dbias), a.Workspace + uint64(end)})
	}
	if kind == emuDefault {
		t.Logf("%s", pl.v.Name())
	} else {
		emuCheckBwdPlan(t, pl, in.p, kind, hopper, tma, bulk, ws, keyRows)
	}
	if emuBwdPlanned != nil {
		emuBwdPlanned(pl.v)
	}
	src, err := pl.v.Source()
	if err != nil {
		t.Fatal(err)
	}
	var more []string
	if pl.v.WGMMA {
		more = append(more, hopperEmuBlock(pl.v.HopperProducts(), pl.v.TMA || pl.v.BulkDQ, pl.v.BulkDQ || pl.v.WarpSpecialized))
	}
	bin := emuBinary(t, src, "bwd.h", bwdEmuDriver(pl.v), more...)
	// On finite inputs the main kernels must leave the non-finite flag
	// down: a raised flag would only cost time (the fix-up recomputes), so
	// the fix-up is left out and the flag checked below.
	finite := in.finite()
	var launches []emuLaunch
	for _, l := range pl.launches {
		if finite && l.kernel == kernels.BwdNonFiniteKernel {
			continue
		}
		launches = append(launches, emuLaunch{l.kernel, l.grid, l.threads})
	}
	var maps [][128]byte
	for _, x := range pl.tma {
		maps = append(maps, emuTensorMap(x))
	}
	args := pl.kernelArgs(maps)
	var params2 map[string][]byte
	if pl.v.TMA {
		params2 = map[string][]byte{}
		for _, k := range bwdEmuTMAKernels {
			params2[k] = args(k)
		}
	}
	emuExec(t, bin, pl.v.Name(), args(kernels.BwdPreKernel), ar, launches, params2)
	if flag := ar.at(a.Workspace+uint64(pl.w.nf), 8); !slices.Equal(flag, make([]byte, 8)) {
		if finite {
			t.Fatalf("non-finite flag and counter %v after the main kernels on finite inputs, want zero", flag)
		}
		t.Fatalf("non-finite flag and counter %v after the fix-up, want zero", flag)
	}
	if !in.p.Varlen {
		checkDelta(t, ar.at(a.Workspace+uint64(pl.w.delta), 4*in.p.B*in.p.H*in.p.N), pl.w, in)
	}
	ts := make([]attn.Tensor, len(outs))
	for i, o := range outs {
		ts[i] = ar.read(t, i, o)
	}
	g := attn.Gradients{DQ: ts[0], DK: ts[1], DV: ts[2]}
	if len(ts) > 3 {
		g.DBias = &ts[3]
	}
	return g
}

// finite reports whether every input of the call (q, k, v, dO and the
// bias) is finite.
func (in bwdInputs) finite() bool {
	return allFinite(in.opt, in.q, in.k, in.v, in.dO)
}

// allFinite reports whether every element of ts and of opt's bias is
// finite.
func allFinite(opt attn.Options, ts ...attn.Tensor) bool {
	if opt.Bias != nil {
		ts = append(ts, opt.Bias.Tensor)
	}
	for _, x := range ts {
		for _, f := range x.Float32s() {
			if math.IsNaN(float64(f)) || math.IsInf(float64(f), 0) {
				return false
			}
		}
	}
	return true
}

// checkDelta compares the preprocess's Delta (the workspace's bytes at
// delta) with rowsum(dO∘O) in float64, to within fp32 rounding of the sum
// of the products' magnitudes: a term missed or taken from a neighbouring
// head fails it, where the gradients' tolerance could absorb it.
func checkDelta(t *testing.T, delta []byte, w bwdWorkspace, in bwdInputs) {
	t.Helper()
	p := in.p
	for b := 0; b < p.B; b++ {
		for h := 0; h < p.H; h++ {
			for i := 0; i < p.N; i++ {
				var want, mag float64
				for d := 0; d < p.DV; d++ {
					x := float64(in.o.At(b, i, h, d)) * float64(in.dO.At(b, i, h, d))
					want += x
					mag += math.Abs(x)
				}
				at := 4 * (int64(b)*w.statBatch + int64(h)*w.statHead + int64(i))
				got := float64(math.Float32frombits(binary.LittleEndian.Uint32(delta[at:])))
				if math.Abs(got-want) > 1e-5*mag+1e-6 {
					t.Fatalf("Delta (batch %d, head %d, row %d) = %g, want %g", b, h, i, got, want)
				}
			}
		}
	}
}

// headMajorView stores a [B, N, H, D] tensor in the arena as [B, H, N, D]
// and returns its strided view: rows D apart, heads N·D apart, so that no
// two (row, head) pairs are back to back.
func headMajorView(ar *emuArena, x attn.Tensor) bwdView {
	bn, n, h, d := x.Shape[0], x.Shape[1], x.Shape[2], x.Shape[3]
	es := x.DType.Size()
	src := x.Bytes()
	out := make([]byte, len(src))
	for b := 0; b < bn; b++ {
		for r := 0; r < n; r++ {
			for hh := 0; hh < h; hh++ {
				from := (((b*n+r)*h + hh) * d) * es
				to := (((b*h+hh)*n + r) * d) * es
				copy(out[to:to+d*es], src[from:from+d*es])
			}
		}
	}
	return bwdView{Ptr: ar.put(out), DType: x.DType, Batch: int64(h * n * d), Row: int64(d), Head: int64(n * d)}
}

func emuCases() []bwdCase {
	bf := []attn.DType{attn.BFloat16}
	return []bwdCase{
		{name: "plain", b: 1, n: 70, m: 150, h: 2, hkv: 1, dk: 64, dv: 64, dtypes: []attn.DType{attn.BFloat16, attn.Float16, attn.Float32}},
		// fewer queries than half a 128-query step, two batch elements and heads: the tiled dQ
		// accumulator has one block a head, which the step's second half must not add into
		{name: "n40-d64", b: 2, n: 40, m: 72, h: 2, hkv: 2, dk: 64, dv: 64, dtypes: bf},
		{name: "causal-br-masked-rows", b: 1, n: 150, m: 70, h: 1, hkv: 1, dk: 32, dv: 48, causal: true, dtypes: bf},
		{name: "causal-tl-window", b: 1, n: 90, m: 140, h: 2, hkv: 2, dk: 64, dv: 64, causal: true, align: attn.AlignTopLeft, window: &attn.Window{Left: 20, Right: 5}, dtypes: bf},
		{name: "d59-scalar", b: 1, n: 40, m: 45, h: 1, hkv: 1, dk: 59, dv: 59, dtypes: []attn.DType{attn.BFloat16, attn.Float32}},
		{name: "d199-257", b: 1, n: 20, m: 33, h: 1, hkv: 1, dk: 199, dv: 257, dtypes: bf},
		{name: "d272-288-causal", b: 1, n: 70, m: 100, h: 2, hkv: 1, dk: 272, dv: 288, causal: true, dtypes: bf},
		{name: "d16-512", b: 1, n: 20, m: 40, h: 1, hkv: 1, dk: 16, dv: 512, dtypes: bf},
		{name: "d320-gqa-causal", b: 1, n: 37, m: 50, h: 2, hkv: 1, dk: 320, dv: 320, causal: true, dtypes: bf},
		// the Hopper kernels past 256 (transposed dK and dV, 32 keys a block): every feature, uneven slices
		// of dK and dV with a staged odd dim, packed batches, strided heads
		{name: "d512-softcap-bias-dropout", b: 1, n: 40, m: 70, h: 2, hkv: 1, dk: 512, dv: 512, softcap: 4, bias: []int{1, 2}, biasGrad: true, dropout: 0.1, causal: true, dtypes: bf},
		{name: "d301-384-window", b: 1, n: 50, m: 75, h: 2, hkv: 2, dk: 301, dv: 384, window: &attn.Window{Left: 20, Right: 5}, dtypes: []attn.DType{attn.Float16}},
		{name: "varlen-d320-gqa", h: 4, hkv: 2, dk: 320, dv: 320, cuQ: []int32{0, 37, 37, 100}, cuK: []int32{0, 50, 81, 81}, causal: true, dtypes: bf},
		{name: "head-major-d288", b: 2, n: 37, m: 45, h: 2, hkv: 1, dk: 288, dv: 288, headMajor: true, dtypes: []attn.DType{attn.Float16}},
		{name: "softcap-bias-dropout", b: 2, n: 33, m: 70, h: 2, hkv: 1, dk: 64, dv: 64, softcap: 4, bias: []int{1, 2}, biasGrad: true, dropout: 0.2, causal: true, dtypes: []attn.DType{attn.BFloat16, attn.Float32}},
		// dropout on the key-rows step: 64-, 80- and 128-query steps with a partial last one, two key
		// blocks, GQA; at D = 64 under a window (the 128-query step's split dQ rows)
		{name: "dropout-d128-gqa", b: 1, n: 150, m: 140, h: 4, hkv: 2, dk: 128, dv: 128, dropout: 0.3, dtypes: bf},
		{name: "dropout-d64-window", b: 2, n: 140, m: 150, h: 2, hkv: 2, dk: 64, dv: 64, dropout: 0.15, window: &attn.Window{Left: 40, Right: 10}, dtypes: bf},
		// the element-wise features without dropout, DK ≠ DV
		{name: "softcap-bias-grad-window-d64-96", b: 2, n: 45, m: 90, h: 2, hkv: 1, dk: 64, dv: 96, softcap: 4, bias: []int{2, 1}, biasGrad: true, window: &attn.Window{Left: 20, Right: 5}, dtypes: []attn.DType{attn.BFloat16, attn.Float16}},
		// a bias alone (the key-rows step addresses it once a step): GQA, two key blocks, a partial
		// last step; causal over a row length whose rows are not 16-byte aligned (not staged)
		{name: "bias-grad-d128-gqa", b: 2, n: 70, m: 150, h: 4, hkv: 2, dk: 128, dv: 128, bias: []int{1, 4}, biasGrad: true, dtypes: bf},
		{name: "bias-causal-d64-m150", b: 2, n: 150, m: 150, h: 2, hkv: 2, dk: 64, dv: 64, bias: []int{2, 1}, causal: true, dtypes: []attn.DType{attn.Float16}},
		{name: "varlen", h: 2, hkv: 1, dk: 64, dv: 64, cuQ: []int32{0, 5, 5, 70}, cuK: []int32{0, 7, 20, 20}, causal: true, dtypes: bf},
		// tiles that run into the next sequence's rows (by tensor maps they are not zeros)
		{name: "varlen-crossing-gqa", h: 4, hkv: 2, dk: 128, dv: 128, cuQ: []int32{0, 37, 207, 357}, cuK: []int32{0, 50, 180, 470}, causal: true, dtypes: []attn.DType{attn.BFloat16, attn.Float16}},
		{name: "varlen-staged-gqa", h: 4, hkv: 2, dk: 37, dv: 59, cuQ: []int32{0, 17, 17, 60}, cuK: []int32{0, 30, 41, 41}, causal: true, dtypes: []attn.DType{attn.Float16, attn.Float32}},
		{name: "head-major-staged-gqa", b: 2, n: 37, m: 45, h: 4, hkv: 2, dk: 59, dv: 37, causal: true, headMajor: true, dtypes: []attn.DType{attn.BFloat16, attn.Float16}},
		{name: "d199-gqa-causal", b: 1, n: 40, m: 70, h: 2, hkv: 1, dk: 199, dv: 199, causal: true, dtypes: bf},
		{name: "gqa-d128", b: 1, n: 65, m: 130, h: 4, hkv: 2, dk: 128, dv: 128, dtypes: bf},
		{name: "flat-d8-100-causal", b: 1, n: 128, m: 128, h: 2, hkv: 2, dk: 8, dv: 100, causal: true, dtypes: []attn.DType{attn.BFloat16, attn.Float16}},
		{name: "d256", b: 1, n: 65, m: 70, h: 1, hkv: 1, dk: 256, dv: 256, dropout: 0.1, dtypes: bf},
		// odd head dims the Hopper kernels read in place with tensor maps (flat rows; eight heads or
		// more take every shift); the emulator's other kernels run them staged
		{name: "flat-d199-causal", b: 2, n: 70, m: 90, h: 16, hkv: 16, dk: 199, dv: 199, causal: true, dtypes: []attn.DType{attn.BFloat16, attn.Float16}},
		{name: "flat-d201-185-softcap-bias-dropout", b: 1, n: 40, m: 70, h: 8, hkv: 8, dk: 201, dv: 185, softcap: 4, bias: []int{1, 8}, biasGrad: true, dropout: 0.1, dtypes: bf},
		{name: "flat-d121-window", b: 1, n: 60, m: 80, h: 16, hkv: 16, dk: 121, dv: 121, window: &attn.Window{Left: 20, Right: 5}, dtypes: bf},
	}
}

// emuCheckBwdPlan fails t unless pl runs the kernels kind asks for.
func emuCheckBwdPlan(t *testing.T, pl *bwdPlan, p *attn.Problem, kind emuKernels, hopper, tma, bulk, ws, keyRows bool) {
	t.Helper()
	if pl.v.WGMMA != hopper || pl.v.TMA != tma {
		t.Fatalf("plan %s: not the kernels asked for (%d)", pl.v.Name(), kind)
	}
	if want := bulk && pl.v.AtomicDQ && !pl.v.Flat && max(pl.v.DKPad(), pl.v.DVPad()) <= 128; pl.v.BulkDQ != want {
		t.Fatalf("plan %s: BulkDQ = %v, want %v", pl.v.Name(), pl.v.BulkDQ, want)
	}
	// (the Hopper kernels past head dim 256 have only the lockstep pipeline)
	if want := ws && !bwdWSSlower(p) && max(pl.v.DKPad(), pl.v.DVPad()) <= 256; pl.v.WarpSpecialized != want {
		t.Fatalf("plan %s: WarpSpecialized = %v, want %v", pl.v.Name(), pl.v.WarpSpecialized, want)
	}
	if want := keyRows && kernels.KeyRowsOK(pl.v); pl.v.KeyRows != want {
		t.Fatalf("plan %s: KeyRows = %v, want %v", pl.v.Name(), pl.v.KeyRows, want)
	}
	q80 := kind == emuHopperBwdWSKeyRows80 || kind == emuHopperBwdWSKeyRows80Bulk
	if want := q80 && pl.v.KeyRows && (!pl.v.AtomicDQ || pl.v.BulkDQ); (pl.v.QueryStep == 80) != want {
		t.Fatalf("plan %s: QueryStep = %d, want 80: %v", pl.v.Name(), pl.v.QueryStep, want)
	}
	q128 := kind == emuHopperBwdWSKeyRows128 || kind == emuHopperBwdWSKeyRows128Bulk
	if want := q128 && pl.v.KeyRows && max(pl.v.DKPad(), pl.v.DVPad()) <= 64 && !(pl.v.Dropout && (pl.v.Softcap || pl.v.Bias != kernels.BiasNone)); (pl.v.QueryStep == 128) != want {
		t.Fatalf("plan %s: QueryStep = %d, want 128: %v", pl.v.Name(), pl.v.QueryStep, want)
	}
	staged16 := pl.v.Bias == kernels.BiasBF16 || pl.v.Bias == kernels.BiasF16
	staged := pl.v
	staged.BiasStaged = true
	if want := envSet(os.Getenv(EnvBiasStaged)) && pl.v.KeyRows && staged16 && !p.Varlen && p.M%8 == 0 && staged.Validate() == nil; pl.v.BiasStaged != want {
		t.Fatalf("plan %s: BiasStaged = %v, want %v", pl.v.Name(), pl.v.BiasStaged, want)
	}
	persistent := pl.v
	persistent.Persistent = true
	if want := envSet(os.Getenv(EnvBwdPersistent)) && pl.v.KeyRows && persistent.Validate() == nil; pl.v.Persistent != want {
		t.Fatalf("plan %s: Persistent = %v, want %v", pl.v.Name(), pl.v.Persistent, want)
	}
	keep := pl.v
	keep.ProducerDropout = true
	if want := envSet(os.Getenv(EnvBwdProducerDropout)) && keep.Validate() == nil; pl.v.ProducerDropout != want {
		t.Fatalf("plan %s: ProducerDropout = %v, want %v", pl.v.Name(), pl.v.ProducerDropout, want)
	}
	if want := strings.Contains(t.Name(), "/flat-") && tma; pl.v.Flat != want {
		t.Fatalf("plan %s: Flat = %v, want %v", pl.v.Name(), pl.v.Flat, want)
	}
}

// TestBackwardEmulated checks the generated kernels on the host emulator
// against the float64 reference (FLASHATTN_BWD_EMU=1; needs g++).
func TestBackwardEmulated(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	emuBackwardCases(t, emuMMA)
}

// TestBackwardEmulatedHopper runs the 16-bit cases whose dims the Hopper
// kernels take on those kernels against the float64 reference, with their
// tiles loaded by cp.async and, for fixed-length batches, by tensor maps
// (warpgroup products, mbarriers and bulk tensor copies emulated;
// FLASHATTN_BWD_EMU=1; needs g++).
func TestBackwardEmulatedHopper(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	for _, c := range bwdEmuFamilies[1:] {
		t.Run(c.name, func(t *testing.T) {
			if ran := emuBackwardCases(t, c.kind); ran == 0 && os.Getenv("FLASHATTN_BWD_EMU_CASE") == "" {
				t.Fatal("no case ran")
			}
		})
	}
}

// emuBackwardCases runs the emulator cases (those named by
// FLASHATTN_BWD_EMU_CASE, when set), both dQ algorithms each, on the
// kernels of kind (only the cases they take), and returns how many ran.
func emuBackwardCases(t *testing.T, kind emuKernels) int {
	only := os.Getenv("FLASHATTN_BWD_EMU_CASE")
	ran := 0
	for ci, c := range emuCases() {
		if only != "" && !strings.Contains(c.name, only) {
			continue
		}
		if strings.HasPrefix(c.name, "flat-") && kind == emuMMA {
			continue // rows read in place are for the Hopper kernels
		}
		for _, dt := range c.dtypes {
			if kind != emuMMA && !bwdHopperTakes(dt, c.dk, c.dv) {
				continue
			}
			ran += emuCheckCase(t, c, dt, uint64(ci+100), kind)
		}
	}
	return ran
}

// emuCheckCase runs case c in dt (inputs drawn with seed) with both dQ
// algorithms on the kernels of kind against the float64 reference, one
// subtest each, and returns how many ran.
func emuCheckCase(t *testing.T, c bwdCase, dt attn.DType, seed uint64, kind emuKernels) int {
	t.Helper()
	in := c.inputs(t, dt, seed)
	ref, naive := in.oracles(t)
	ran := 0
	for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
		ran++
		t.Run(fmt.Sprintf("%s/%v/%v", c.name, dt, algo), func(t *testing.T) {
			g := emuRunOn(t, in, algo, c.headMajor, kind)
			checkGrads(t, dt, g, ref, naive)
			if c.biasGrad {
				checkGrad(t, "dBias", dt, *g.DBias, ref.DBias, naive.DBias)
			}
			checkMaskedRowsZero(t, in, g.DQ)
		})
	}
	return ran
}

// TestBackwardEmulatedDefaultRandom draws backward calls in the layouts
// the Hopper kernels read by tensor maps (16-bit, contiguous, head dims a
// multiple of 8, DK ≠ DV among them) with masks, softcap, dropout, GQA and
// rows with no key, and runs each with both dQ algorithms through the plan
// a new backend makes, against the float64 reference
// (FLASHATTN_BWD_EMU=1; needs g++; 4 calls, 16 with
// FLASHATTN_EMU_RANDOM=all).
func TestBackwardEmulatedDefaultRandom(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	for i, d := range drawEmuCalls(13, 4, 16, 300) {
		c := bwdCase{name: d.name(i), b: d.b, n: d.n, m: d.m, h: d.h, hkv: d.hkv, dk: d.dk, dv: d.dv, causal: d.opt.Causal, align: d.opt.Align,
			window: d.opt.Window, softcap: d.opt.Softcap, dropout: d.opt.Dropout, dtypes: []attn.DType{d.dt}}
		emuCheckCase(t, c, d.dt, uint64(2000+i), emuDefault)
	}
}

// TestBackwardEmulatedCross runs the cross product of bwdCrossCases — DK ≠
// DV both ways, small against large, × every mask kind — with both dQ
// algorithms on every kernel family the planner can pick for the case's
// dims (bwdEmuFamilies: the mma.sync kernels; the Hopper kernels with
// tiles by cp.async and by tensor maps, lockstep and warp-specialized)
// against the float64 reference (FLASHATTN_BWD_EMU=1; needs g++). Each
// case runs in one 16-bit dtype, alternating so that every head-dim pair
// and every mask kind sees both; TestBackwardGradientsCross runs both
// dtypes of every case on the GPU. FLASHATTN_BWD_EMU_CASE selects cases by
// name as in TestBackwardEmulated.
func TestBackwardEmulatedCross(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	alt := func(di, mi int) []attn.DType {
		if (di+mi)%2 == 0 {
			return []attn.DType{attn.BFloat16}
		}
		return []attn.DType{attn.Float16}
	}
	only := os.Getenv("FLASHATTN_BWD_EMU_CASE")
	for _, k := range bwdEmuFamilies {
		t.Run(k.name, func(t *testing.T) {
			for ci, c := range bwdCrossCases(70, 150, alt) {
				if only != "" && !strings.Contains(c.name, only) {
					continue
				}
				for _, dt := range c.dtypes {
					if k.kind != emuMMA && !bwdHopperTakes(dt, c.dk, c.dv) {
						continue // the planner picks the mma.sync kernels
					}
					emuCheckCase(t, c, dt, uint64(ci+700), k.kind)
				}
			}
		})
	}
}

// TestBackwardEmulatedUnalignedO runs backwards whose O starts 2 bytes
// past a 16-byte boundary (a caller's view at an odd element offset), on
// the mma.sync kernels and the default plan (FLASHATTN_BWD_EMU=1; needs
// g++): the preprocess's flag then sends Delta down its row-a-warp path,
// since O's rows leave the 16-byte units its grouped sum loads (which path
// ran the emulator cannot tell: it loads misaligned 16-byte units as
// readily as aligned ones). The driver checks Delta against O and dO, and
// the test the gradients against the float64 reference.
func TestBackwardEmulatedUnalignedO(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	cases := []bwdCase{
		{name: "d128-causal", b: 2, n: 70, m: 90, h: 2, hkv: 1, dk: 128, dv: 128, causal: true, dtypes: []attn.DType{attn.BFloat16}},
		{name: "d64-dv96", b: 1, n: 50, m: 60, h: 2, hkv: 2, dk: 64, dv: 96, dtypes: []attn.DType{attn.Float16}},
		{name: "d256", b: 1, n: 40, m: 40, h: 1, hkv: 1, dk: 256, dv: 256, dtypes: []attn.DType{attn.BFloat16}},
	}
	for _, kind := range []emuKernels{emuMMA, emuDefault} {
		for ci, c := range cases {
			dt := c.dtypes[0]
			in := c.inputs(t, dt, uint64(ci+1300))
			ref, naive := in.oracles(t)
			t.Run(fmt.Sprintf("%s/%s", map[emuKernels]string{emuMMA: "mma", emuDefault: "default"}[kind], c.name), func(t *testing.T) {
				g := emuRunLaid(t, in, DQAtomic, kind, emuBwdLayout{oShift: 2})
				checkGrads(t, dt, g, ref, naive)
			})
		}
	}
}

// TestBackwardEmulatedFP32LargeScale runs the fp32 forward and then the
// backward with the forward's O and LSE on the host emulator, at head dims
// 160 to 256 with a logit scale of 0.3, and checks the gradients against
// FlashAttention's criterion with the float32 baseline (checkF32Criterion)
// (FLASHATTN_BWD_EMU=1; needs g++). The backward recomputes P from the
// forward's LSE, so it must compute S as the forward did, sum for sum
// (d160, d256 fail otherwise); its Delta = rowsum(dO∘O) takes the
// forward's O, which must not drift over the keys in the emulated tensor
// cores' truncating accumulators (d192 over 512 keys fails otherwise), and
// its LSE must not drift by the online softmax's rescale factors (the
// 64x1024 cases fail if the compiler fuses max·SC − ms into one FMA, which
// the emulator does as the device compiler does: emuCXXFlags).
func TestBackwardEmulatedFP32LargeScale(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	for ci, c := range []bwdCase{
		{name: "d160-causal", b: 1, n: 64, m: 96, h: 1, hkv: 1, dk: 160, dv: 160, scale: 0.3, causal: true},
		{name: "d192-512keys", b: 1, n: 32, m: 512, h: 1, hkv: 1, dk: 192, dv: 192, scale: 0.3},
		{name: "d256", b: 1, n: 64, m: 96, h: 1, hkv: 1, dk: 256, dv: 256, scale: 0.3},
		{name: "d160-64x1024", b: 1, n: 64, m: 1024, h: 1, hkv: 1, dk: 160, dv: 160, scale: 0.3},
		{name: "d192-64x1024", b: 1, n: 64, m: 1024, h: 1, hkv: 1, dk: 192, dv: 192, scale: 0.3},
		{name: "d256-64x1024", b: 1, n: 64, m: 1024, h: 1, hkv: 1, dk: 256, dv: 256, scale: 0.3},
	} {
		t.Run(c.name, func(t *testing.T) {
			in := c.inputs(t, attn.Float32, uint64(ci+500))
			res, _ := fwdEmuRun(t, in.q, in.k, in.v, in.opt)
			in.o, in.lse = res.O, res.LSE
			ref, err := cpu.ReferenceBackward(in.q, in.k, in.v, in.dO, in.opt)
			if err != nil {
				t.Fatal(err)
			}
			var naive [3][]float64
			naive[0], naive[1], naive[2] = naiveF32Backward(in.p, in.q, in.k, in.v, in.dO)
			for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
				t.Run(algo.String(), func(t *testing.T) {
					checkF32Criterion(t, emuRunOn(t, in, algo, false, emuMMA), ref, naive)
				})
			}
		})
	}
}

// bwdEmuFamilies are the backward kernel families the emulator runs: the
// mma.sync kernels and the Hopper kernels with tiles by cp.async and by
// tensor maps, the latter also with the atomic dQ by bulk reduce-adds, with
// the warp-specialized dK/dV kernel, and with both.
var bwdEmuFamilies = []struct {
	name string
	kind emuKernels
}{{"mma.sync", emuMMA}, {"hopper-cp.async", emuHopper}, {"hopper-tma", emuHopperTMA}, {"hopper-tma-bulkdq", emuHopperBulk},
	{"hopper-tma-ws", emuHopperBwdWS}, {"hopper-tma-ws-bulkdq", emuHopperBwdWSBulk}, {"hopper-tma-ws-keyrows", emuHopperBwdWSKeyRows},
	{"hopper-tma-ws-keyrows-bulkdq", emuHopperBwdWSKeyRowsBulk}, {"hopper-tma-ws-keyrows-q80", emuHopperBwdWSKeyRows80},
	{"hopper-tma-ws-keyrows-bulkdq-q80", emuHopperBwdWSKeyRows80Bulk}, {"hopper-tma-ws-keyrows-q128", emuHopperBwdWSKeyRows128},
	{"hopper-tma-ws-keyrows-bulkdq-q128", emuHopperBwdWSKeyRows128Bulk}}

// TestBackwardEmulatedBiasEarly runs biased backwards on the key-rows
// families with the bias from global memory (EnvBiasStaged=0) at head dims
// whose step loads it while its products run (the early loads of
// kernels.BwdVariant's key-rows step): bf16 and fp16 biases, broadcast
// over the batch or the heads, queries past the last step and keys past
// M, both dQ algorithms, on the host emulator against the float64
// reference (FLASHATTN_BWD_EMU=1; needs g++).
func TestBackwardEmulatedBiasEarly(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	t.Setenv(EnvBiasStaged, "0")
	cases := []bwdCase{
		{name: "d128-bias-bcast-b-m136", b: 2, n: 100, m: 136, h: 2, hkv: 1, dk: 128, dv: 128, bias: []int{1, 2}, dtypes: []attn.DType{attn.BFloat16}},
		{name: "d96-bias-bcast-h-m130", b: 2, n: 70, m: 130, h: 2, hkv: 2, dk: 96, dv: 96, bias: []int{2, 1}, dtypes: []attn.DType{attn.Float16}},
	}
	emuKeyRowsCases(t, cases, 970)
}

// TestBackwardEmulatedBiasStaged runs biased backwards on the key-rows
// families with the bias staged through shared memory (EnvBiasStaged,
// kernels.BwdVariant.BiasStaged) on the host emulator against the float64
// reference, both dQ algorithms: dBias and softcap, a causal mask with a
// batch-broadcast bias, queries past the last step and keys past M, and a
// bias whose rows are not 16-byte aligned, which keeps the global loads
// (FLASHATTN_BWD_EMU=1; needs g++).
func TestBackwardEmulatedBiasStaged(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	t.Setenv(EnvBiasStaged, "1")
	cases := []bwdCase{
		{name: "d128-bias-grad-softcap-m136", b: 1, n: 100, m: 136, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, softcap: 4, dtypes: []attn.DType{attn.BFloat16}},
		{name: "d64-96-causal-bias-bcast-m200", b: 2, n: 90, m: 200, h: 2, hkv: 1, dk: 64, dv: 96, bias: []int{1, 2}, causal: true, dtypes: []attn.DType{attn.Float16}},
		{name: "d128-bias-n90-m136", b: 1, n: 90, m: 136, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, dtypes: []attn.DType{attn.BFloat16}}, // partial blocks, no mask: the zeros past n and m
		{name: "d128-bias-m130-unaligned", b: 1, n: 70, m: 130, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 1}, biasGrad: true, dtypes: []attn.DType{attn.BFloat16}},
	}
	emuKeyRowsCases(t, cases, 950)
	// head dims up to 64: the step of 128 queries, whose tiles with the bias's and the bulk dQ's fill
	// shared memory without the slack to align the base
	q128 := []bwdCase{
		{name: "d64-q128-bias-grad-n200-m200", b: 2, n: 200, m: 200, h: 2, hkv: 2, dk: 64, dv: 64, bias: []int{1, 2}, biasGrad: true, dtypes: []attn.DType{attn.BFloat16}},
		{name: "d56-64-q128-causal-gqa-bias-bcast-n150-m136", b: 1, n: 150, m: 136, h: 4, hkv: 2, dk: 56, dv: 64, bias: []int{1, 1}, causal: true, dtypes: []attn.DType{attn.Float16}},
	}
	emuKeyRowsCases(t, q128, 960, emuHopperBwdWSKeyRows128, emuHopperBwdWSKeyRows128Bulk)
}

// emuKeyRowsCases runs cases on the key-rows families of the host emulator
// named by kinds (by default the two over the table's step: the atomic dQ
// by vector atomics and by bulk reduce-adds), both dQ algorithms each, case
// i's inputs drawn from seed seed + i.
func emuKeyRowsCases(t *testing.T, cases []bwdCase, seed uint64, kinds ...emuKernels) {
	if len(kinds) == 0 {
		kinds = []emuKernels{emuHopperBwdWSKeyRows, emuHopperBwdWSKeyRowsBulk}
	}
	for _, f := range bwdEmuFamilies {
		if !slices.Contains(kinds, f.kind) {
			continue
		}
		t.Run(f.name, func(t *testing.T) {
			for ci, c := range cases {
				for _, dt := range c.dtypes {
					emuCheckCase(t, c, dt, seed+uint64(ci), f.kind)
				}
			}
		})
	}
}

// TestBackwardEmulatedDBiasTiles runs backwards that add the gradient of
// a bias broadcast over the batch by tiles (EnvDBiasTiles,
// kernels.DBiasTiles: each warpgroup's 64 × 64 share of a step through
// shared memory and one bulk reduce-add into a tiled accumulator) on the
// host emulator against the float64 reference: the key-rows family with
// the bulk dQ at head dims padded to 128, batches of two to four, a bias
// shared by the heads too, causal and window masks, softcap, dropout,
// GQA, DK ≠ DV, query and key counts off the tiles (the accumulator's
// padding), a second warpgroup whose keys all lie past M, and rows that
// see no key; every case must take the path.
func TestBackwardEmulatedDBiasTiles(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	t.Setenv(EnvDBiasAtomic, "1")
	t.Setenv(EnvDBiasTiles, "1")
	t.Setenv(EnvDBiasReduce, "0")
	bf := []attn.DType{attn.BFloat16}
	tiles, bulk := kernels.DBiasTiles, emuHopperBwdWSKeyRowsBulk
	emuCheckDBiasPaths(t, 1990, []emuDBiasCase{
		{bwdCase{name: "d128-b3-causal-gqa", b: 3, n: 100, m: 136, h: 4, hkv: 2, dk: 128, dv: 128, bias: []int{1, 4}, biasGrad: true, causal: true, dtypes: []attn.DType{attn.Float16}}, tiles, bulk},
		{bwdCase{name: "d128-b2-m130-wg1-past-m", b: 2, n: 90, m: 130, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, dtypes: bf}, tiles, bulk},
		{bwdCase{name: "d120-b2-shared-window-softcap", b: 2, n: 129, m: 70, h: 2, hkv: 1, dk: 120, dv: 96, bias: []int{1, 1}, biasGrad: true, softcap: 4, window: &attn.Window{Left: 30, Right: 7}, dtypes: bf}, tiles, bulk},
		{bwdCase{name: "d128-b4-dropout-causal-br-rows-without-keys", b: 4, n: 150, m: 64, h: 1, hkv: 1, dk: 128, dv: 128, bias: []int{1, 1}, biasGrad: true, dropout: 0.2, causal: true, dtypes: bf}, tiles, bulk},
	})
}

// emuDBiasCase is a backward case of emuCheckDBiasPaths, the dBias path
// its plans with the atomic dQ must take, and its kernel family.
type emuDBiasCase struct {
	c    bwdCase
	want kernels.DBiasPath
	kind emuKernels
}

// emuCheckDBiasPaths runs each case on its kernel family (seeds from seed
// on) against the float64 reference, and fails a case whose plans with
// the atomic dQ (the separate dQ's key-rows step has neither a dQ tile
// nor a dS tile) took another dBias path than its want.
func emuCheckDBiasPaths(t *testing.T, seed uint64, cases []emuDBiasCase) {
	t.Helper()
	var paths []kernels.DBiasPath
	emuBwdPlanned = func(v kernels.BwdVariant) {
		if v.AtomicDQ {
			paths = append(paths, v.DBiasPath)
		}
	}
	t.Cleanup(func() { emuBwdPlanned = nil })
	for ci, x := range cases {
		for _, dt := range x.c.dtypes {
			paths = paths[:0]
			emuCheckCase(t, x.c, dt, seed+uint64(ci), x.kind)
			if len(paths) == 0 {
				t.Fatalf("%s: no backward planned with the atomic dQ", x.c.name)
			}
			for _, p := range paths {
				if p != x.want {
					t.Errorf("%s %v: dBias by %v, want %v", x.c.name, dt, p, x.want)
				}
			}
		}
	}
}

// TestBackwardEmulatedDBiasStore runs backwards that store the gradient
// of a bias of every batch element and head by tensor maps (EnvDBiasStore,
// kernels.DBiasStore: each warpgroup's share of the step's dS tile into
// dBias) on the host emulator against the float64 reference: the key-rows
// family with the bulk dQ at head dims padded to 128, bf16 and fp16, causal
// and window masks (dBias's hidden pairs zeroed by the preprocess),
// dropout, GQA, DK ≠ DV, query and key counts off the tiles (the store
// drops what lies past N and M), rows that see no key; a key count whose
// rows are not whole 16-byte units keeps the element stores (the map's
// strides), as does a softcap.
func TestBackwardEmulatedDBiasStore(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	t.Setenv(EnvDBiasDirect, "1")
	t.Setenv(EnvDBiasStore, "1")
	t.Setenv(EnvBiasStaged, "1") // as the backends' BiasStagedAuto has it: the store's map follows the bias's
	bf := []attn.DType{attn.BFloat16}
	store, direct, bulk := kernels.DBiasStore, kernels.DBiasDirect, emuHopperBwdWSKeyRowsBulk
	emuCheckDBiasPaths(t, 2990, []emuDBiasCase{
		{bwdCase{name: "d128-b2-causal-gqa-m136", b: 2, n: 100, m: 136, h: 4, hkv: 2, dk: 128, dv: 128, bias: []int{2, 4}, biasGrad: true, causal: true, dtypes: []attn.DType{attn.Float16}}, store, bulk},
		// the vector atomics' steps (no tiled dQ: the store's own wait before the next step's barrier), 64 and 128 queries
		{bwdCase{name: "d128-atomics-b2-m200", b: 2, n: 150, m: 200, h: 2, hkv: 1, dk: 128, dv: 128, bias: []int{2, 2}, biasGrad: true, dtypes: bf}, store, emuHopperBwdWSKeyRows},
		{bwdCase{name: "d64-q128-b2-causal-n300", b: 2, n: 300, m: 264, h: 2, hkv: 2, dk: 64, dv: 64, bias: []int{2, 2}, biasGrad: true, causal: true, dtypes: []attn.DType{attn.BFloat16, attn.Float16}}, store, emuHopperBwdWSKeyRows128},
		{bwdCase{name: "d128-b1-m200-wg1-past-m", b: 1, n: 70, m: 200, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, dtypes: bf}, store, bulk},
		{bwdCase{name: "d120-dv96-b2-window", b: 2, n: 129, m: 72, h: 2, hkv: 1, dk: 120, dv: 96, bias: []int{2, 2}, biasGrad: true, window: &attn.Window{Left: 30, Right: 7}, dtypes: bf}, store, bulk},
		{bwdCase{name: "d128-b2-dropout-causal-br-rows-without-keys", b: 2, n: 150, m: 64, h: 1, hkv: 1, dk: 128, dv: 128, bias: []int{2, 1}, biasGrad: true, dropout: 0.2, causal: true, dtypes: bf}, store, bulk},
		{bwdCase{name: "d128-m90-rows-not-16-byte-units", b: 1, n: 80, m: 90, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, dtypes: bf}, direct, bulk},
		{bwdCase{name: "d128-softcap", b: 1, n: 80, m: 96, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, softcap: 4, dtypes: bf}, direct, bulk},
	})
}

// TestBackwardEmulatedDBiasReduce runs backwards that add the gradient of
// a bias broadcast over the batch by tensor-map reduce-adds into dBias
// itself (EnvDBiasReduce, kernels.DBiasReduce: each warpgroup's share of
// the step's dS tile, in dBias's element type) on the host emulator
// against the float64 reference: the key-rows family with the bulk dQ at
// head dims padded to 128 and the vector atomics' steps of 64 queries at
// D = 128 and of 128 at D = 64, bf16 and fp16, batches of two to
// kernels.DBiasReduceMaxBatch, a
// bias shared by the heads too, causal and window masks (dBias's hidden
// pairs left as the preprocess zeroed them), dropout, GQA, DK ≠ DV, query
// and key counts off the tiles, a second warpgroup whose keys all lie past
// M, rows that see no key; a key count whose rows are not whole 16-byte
// units keeps the tiles (the map's strides), as does a softcap.
func TestBackwardEmulatedDBiasReduce(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	t.Setenv(EnvDBiasAtomic, "1")
	t.Setenv(EnvDBiasTiles, "1")
	t.Setenv(EnvDBiasReduce, "1")
	t.Setenv(EnvBiasStaged, "1") // as the backends' BiasStagedAuto has it: dBias's map follows the bias's
	bf, both := []attn.DType{attn.BFloat16}, []attn.DType{attn.BFloat16, attn.Float16}
	reduce, tiles, bulk := kernels.DBiasReduce, kernels.DBiasTiles, emuHopperBwdWSKeyRowsBulk
	emuCheckDBiasPaths(t, 3990, []emuDBiasCase{
		{bwdCase{name: "d128-b3-causal-gqa-m136-wg1-past-m", b: 3, n: 100, m: 136, h: 4, hkv: 2, dk: 128, dv: 128, bias: []int{1, 4}, biasGrad: true, causal: true, dtypes: []attn.DType{attn.Float16}}, reduce, bulk},
		{bwdCase{name: "d120-dv96-b2-shared-window", b: 2, n: 129, m: 72, h: 2, hkv: 1, dk: 120, dv: 96, bias: []int{1, 1}, biasGrad: true, window: &attn.Window{Left: 30, Right: 7}, dtypes: bf}, reduce, bulk},
		{bwdCase{name: "d128-b4-dropout-causal-br-rows-without-keys", b: 4, n: 150, m: 64, h: 1, hkv: 1, dk: 128, dv: 128, bias: []int{1, 1}, biasGrad: true, dropout: 0.2, causal: true, dtypes: bf}, reduce, bulk},
		{bwdCase{name: "d128-b6-n200", b: 6, n: 200, m: 128, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, dtypes: both}, reduce, bulk},
		// the largest batch it takes (kernels.DBiasReduceMaxBatch): the most roundings of dBias's running sums
		{bwdCase{name: "d128-b32-shared", b: kernels.DBiasReduceMaxBatch, n: 64, m: 64, h: 1, hkv: 1, dk: 128, dv: 128, bias: []int{1, 1}, biasGrad: true, dtypes: both}, reduce, bulk},
		// the vector atomics' steps (no tiled dQ: the add's own wait before the next step's barrier), 64 and 128 queries
		{bwdCase{name: "d128-atomics-b2-m200", b: 2, n: 150, m: 200, h: 2, hkv: 1, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, dtypes: bf}, reduce, emuHopperBwdWSKeyRows},
		{bwdCase{name: "d64-q128-b2-causal-n300", b: 2, n: 300, m: 264, h: 2, hkv: 2, dk: 64, dv: 64, bias: []int{1, 2}, biasGrad: true, causal: true, dtypes: both}, reduce, emuHopperBwdWSKeyRows128},
		{bwdCase{name: "d128-m90-rows-not-16-byte-units", b: 2, n: 80, m: 90, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, dtypes: bf}, tiles, bulk},
		{bwdCase{name: "d128-softcap", b: 2, n: 80, m: 96, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, softcap: 4, dtypes: bf}, tiles, bulk},
	})
}

// TestBackwardEmulatedDBiasPaths runs backwards that compute dBias with
// dS added by atomic adds into an accumulator of dBias's shape (a bias
// broadcast over the batch: EnvDBiasAtomic, kernels.DBiasAtomic) or stored
// into dBias directly (a bias of every batch element and head:
// EnvDBiasDirect, kernels.DBiasDirect) on the host emulator against the
// float64 reference, both dQ algorithms, on the mma.sync kernels and the
// warp-specialized Hopper kernels (the table's step and the key-rows
// steps): batches of one to three, a bias shared by the heads too, causal
// and window masks, softcap, GQA, an fp32 bias and fp32 inputs (mma.sync),
// key counts that are not multiples of four (the accumulator's rows zeroed
// element by element) and rows that see no key.
func TestBackwardEmulatedDBiasPaths(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	t.Setenv(EnvDBiasAtomic, "1")
	t.Setenv(EnvDBiasDirect, "1")
	t.Setenv(EnvDBiasReduce, "0")
	bf := []attn.DType{attn.BFloat16}
	cases := []bwdCase{
		{name: "atomic-d64-b2-causal-softcap", b: 2, n: 70, m: 90, h: 2, hkv: 2, dk: 64, dv: 64, bias: []int{1, 2}, biasGrad: true, softcap: 4, causal: true, dtypes: bf},
		{name: "atomic-d64-b2-shared-window", b: 2, n: 64, m: 81, h: 2, hkv: 1, dk: 64, dv: 64, bias: []int{1, 1}, biasGrad: true, window: &attn.Window{Left: 10, Right: 3}, dtypes: []attn.DType{attn.BFloat16, attn.Float32}},
		{name: "atomic-d128-b3-causal-gqa", b: 3, n: 100, m: 136, h: 4, hkv: 2, dk: 128, dv: 128, bias: []int{1, 4}, biasGrad: true, causal: true, dtypes: []attn.DType{attn.Float16}},
		{name: "atomic-d128-b2-f32bias-m130", b: 2, n: 90, m: 130, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, biasF32: true, dtypes: bf},
		{name: "direct-d64-b2-causal-br-rows-without-keys", b: 2, n: 120, m: 90, h: 2, hkv: 1, dk: 64, dv: 64, bias: []int{2, 2}, biasGrad: true, causal: true, dtypes: bf},
		{name: "direct-d128-b1-window-softcap", b: 1, n: 100, m: 136, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, softcap: 4, window: &attn.Window{Left: 20, Right: 5}, dtypes: []attn.DType{attn.Float16}},
		{name: "direct-d128-b2-f32bias", b: 2, n: 90, m: 130, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{2, 2}, biasGrad: true, biasF32: true, dtypes: bf},
	}
	for _, f := range bwdEmuFamilies {
		switch f.kind {
		case emuMMA, emuHopperBwdWSBulk, emuHopperBwdWSKeyRows, emuHopperBwdWSKeyRowsBulk, emuHopperBwdWSKeyRows128Bulk:
		default:
			continue
		}
		t.Run(f.name, func(t *testing.T) {
			for ci, c := range cases {
				for _, dt := range c.dtypes {
					if f.kind != emuMMA && !bwdHopperTakes(dt, c.dk, c.dv) {
						continue // the planner picks the mma.sync kernels (fp32)
					}
					emuCheckCase(t, c, dt, uint64(990+ci), f.kind)
				}
			}
		})
	}
}
