package gpu

import (
	"fmt"
	"math"
	"os"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/conformance"
	"github.com/flashattn/flashattn/cpu"
	"github.com/flashattn/flashattn/kernels"
)

// bwdPlant plants a non-finite value in one row of a backward input:
// tensor 'q', 'k', 'v' or 'd' (dO); batch element b and sequence position
// pos (packed batches: the packed row, b ignored); head (of that tensor);
// element col, or the whole row when col < 0.
type bwdPlant struct {
	tensor            byte
	b, pos, head, col int
	val               float64
}

// bwdNaNCase is a bwdCase with non-finite values planted in its inputs.
type bwdNaNCase struct {
	bwdCase
	poison []bwdPlant
}

// inputs draws the case's tensors in dt, plants the poison in q, k, v and
// dO, and computes O and LSE of the poisoned inputs with the float64
// reference (rounded to dt and float32), as the forward would give them.
func (c bwdNaNCase) inputs(t testing.TB, dt attn.DType, seed uint64) bwdInputs {
	t.Helper()
	in := c.bwdCase.inputs(t, dt, seed)
	for _, p := range c.poison {
		x := map[byte]attn.Tensor{'q': in.q, 'k': in.k, 'v': in.v, 'd': in.dO}[p.tensor]
		idx := []int{p.b, p.pos, p.head, 0}
		if c.cuQ != nil {
			idx = []int{p.pos, p.head, 0}
		}
		for e := 0; e < x.Shape[len(x.Shape)-1]; e++ {
			if p.col < 0 || e == p.col {
				idx[len(idx)-1] = e
				x.Set(float32(p.val), idx...)
			}
		}
	}
	ref, err := cpu.Reference(in.q, in.k, in.v, in.opt)
	if err != nil {
		t.Fatalf("reference: %v", err)
	}
	in.o = fromF64(dt, ref.O, in.p.OutputShape())
	in.lse = fromF64(attn.Float32, ref.LSE, in.p.LSEShape())
	return in
}

// bwdNaNCases are the non-finite inputs of the backward kernels (GUIDE.md:
// a NaN gives NaN wherever a visible pair connects it and nowhere else):
// NaN and ±Inf in q, k, v and dO, whole rows and single elements, where
// some pairs see them and where none does (masked by causal or window
// masks on the diagonal and window-edge tiles, in tiles a block skips,
// past a packed segment, rows that see no key, and the neighbouring heads
// of a flat row), both causal alignments, one tile and several, odd and
// wide head dims, fp32, softcap and dropout, GQA.
func bwdNaNCases() []bwdNaNCase {
	nan, inf := math.NaN(), math.Inf(1)
	bf, f16, f32 := []attn.DType{attn.BFloat16}, []attn.DType{attn.Float16}, []attn.DType{attn.Float32}
	tl, br := attn.AlignTopLeft, attn.AlignBottomRight
	// c returns a case of n queries over m keys, h query heads over hkv key heads, head dims dk, dv
	c := func(name string, dts []attn.DType, n, m, h, hkv, dk, dv int, causal bool, al attn.Align, w *attn.Window) bwdCase {
		return bwdCase{name: name, b: 1, n: n, m: m, h: h, hkv: hkv, dk: dk, dv: dv, causal: causal, align: al, window: w, dtypes: dts}
	}
	n16 := func(name string, dts []attn.DType, p ...bwdPlant) bwdNaNCase {
		return bwdNaNCase{c("n16-"+name, dts, 16, 16, 2, 1, 64, 64, true, br, nil), p}
	}
	// several tiles: the early rows do not see keys past them, the late rows see those
	mixed := func(n, m int) []bwdPlant {
		return []bwdPlant{
			{'q', 0, 10, 0, -1, nan},    // a NaN query row
			{'v', 0, 120, 0, -1, nan},   // a value row the early rows do not see
			{'k', 0, 140, 0, -1, inf},   // a key row of infinities: NaN scores where seen
			{'v', 0, m - 1, 0, 7, -inf}, // the last key
			{'k', 0, 60, 0, 3, inf},     // an infinite key element
			{'d', 0, 40, 1, -1, nan},    // a NaN dO row
			{'d', 0, n - 1, 0, 5, inf},  // an infinite dO element in the last row
			{'q', 0, 100, 1, 3, -inf},   // an infinite query element
		}
	}
	return []bwdNaNCase{
		// the shape: causal N = M = 16, one tile, one poisoned row each
		n16("k12-nan", bf, bwdPlant{'k', 0, 12, 0, -1, nan}),
		n16("v12-nan", bf, bwdPlant{'v', 0, 12, 0, -1, nan}),
		n16("q3-nan", bf, bwdPlant{'q', 0, 3, 1, -1, nan}),
		n16("do3-nan", bf, bwdPlant{'d', 0, 3, 0, -1, nan}),
		n16("v12-inf", f16, bwdPlant{'v', 0, 12, 0, -1, inf}),
		n16("k12-elem-minus-inf", f16, bwdPlant{'k', 0, 12, 0, 5, -inf}),
		n16("q9-do6-elem-inf", bf, bwdPlant{'q', 0, 9, 0, 2, inf}, bwdPlant{'d', 0, 6, 1, 7, -inf}),
		// several tiles, both alignments, rows that see no key, a window
		{c("150x200-causal-br", bf, 150, 200, 2, 1, 64, 64, true, br, nil), mixed(150, 200)},
		{c("150x200-causal-tl", bf, 150, 200, 2, 1, 64, 64, true, tl, nil), mixed(150, 200)},
		{c("200x150-causal-br-no-key-rows", bf, 200, 150, 2, 1, 64, 64, true, br, nil), []bwdPlant{
			{'q', 0, 20, 0, -1, nan}, {'d', 0, 30, 1, -1, nan}, {'v', 0, 100, 0, -1, nan}, {'k', 0, 140, 0, -1, nan}, {'q', 0, 120, 1, -1, nan}}},
		{c("200-window", f16, 200, 200, 2, 1, 64, 64, false, br, &attn.Window{Left: 30, Right: 7}), []bwdPlant{
			{'v', 0, 50, 0, -1, nan}, {'k', 0, 100, 0, -1, nan}, {'v', 0, 150, 0, 9, inf}, {'q', 0, 199, 1, -1, nan}, {'d', 0, 60, 0, -1, nan}}},
		{c("d128-200-causal", bf, 200, 200, 2, 2, 128, 128, true, br, nil), []bwdPlant{
			{'v', 0, 100, 0, -1, nan}, {'v', 0, 101, 1, 127, -inf}, {'k', 0, 180, 0, -1, nan}, {'q', 0, 3, 1, 4, nan}, {'d', 0, 130, 1, 100, nan}}},
		// odd head dims: from staging copies (D = 59), and over flat rows (eight heads of 57 or 199: the
		// Hopper kernels with tensor maps read each head beside its neighbours in the row); fp32 (whose
		// split-tf32 products make an infinite operand NaN: Inf - tf32(Inf) in the low part)
		{c("d59-150x200-causal", []attn.DType{attn.Float16, attn.Float32}, 150, 200, 4, 4, 59, 59, true, br, nil), []bwdPlant{
			{'q', 0, 30, 1, -1, nan}, {'k', 0, 100, 2, -1, nan}, {'v', 0, 120, 3, 0, inf}, {'d', 0, 70, 0, -1, nan}, {'v', 0, 160, 1, -1, nan}}},
		{c("flat-d57-150x200-causal", []attn.DType{attn.BFloat16, attn.Float32}, 150, 200, 8, 8, 57, 57, true, br, nil), []bwdPlant{
			{'q', 0, 30, 1, -1, nan}, {'k', 0, 100, 2, -1, nan}, {'v', 0, 120, 3, 0, inf}, {'d', 0, 70, 4, -1, nan}, {'v', 0, 160, 5, -1, nan},
			{'k', 0, 190, 6, 56, inf}, {'d', 0, 149, 7, 0, nan}, {'q', 0, 5, 0, -1, nan}}},
		{c("flat-d199-70x90-causal-tl", bf, 70, 90, 8, 8, 199, 199, true, tl, nil), []bwdPlant{
			{'q', 0, 30, 1, -1, nan}, {'k', 0, 60, 2, -1, nan}, {'v', 0, 80, 3, 198, inf}, {'d', 0, 10, 4, -1, nan}, {'v', 0, 40, 5, -1, nan}, {'k', 0, 85, 6, 0, -inf}}},
		// wide head dims: the Hopper dK/dV kernel's warpgroups split (and cross) columns
		{c("d192-70x100-causal-tl", bf, 70, 100, 1, 1, 192, 192, true, tl, nil), []bwdPlant{
			{'v', 0, 50, 0, -1, nan}, {'k', 0, 60, 0, 150, nan}, {'q', 0, 20, 0, -1, nan}, {'d', 0, 10, 0, 180, inf}}},
		{c("d144-224-70x100-window", bf, 70, 100, 1, 1, 144, 224, false, br, &attn.Window{Left: 20, Right: 3}), []bwdPlant{
			{'v', 0, 50, 0, 200, nan}, {'k', 0, 60, 0, -1, nan}, {'q', 0, 40, 0, 140, inf}, {'d', 0, 20, 0, -1, nan}}},
		// past 256: the deep Hopper kernels (dK and dV transposed, 32 keys a block)
		{c("d320-70x100-causal-tl", bf, 70, 100, 2, 1, 320, 320, true, tl, nil), []bwdPlant{
			{'v', 0, 50, 0, -1, nan}, {'k', 0, 60, 0, 300, nan}, {'q', 0, 20, 1, -1, nan}, {'d', 0, 10, 0, 310, inf}}},
		{c("fp32-d64-100-window", f32, 100, 100, 2, 2, 64, 64, false, br, &attn.Window{Left: 10, Right: 2}), []bwdPlant{
			{'v', 0, 60, 0, -1, nan}, {'q', 0, 30, 1, -1, nan}, {'v', 0, 70, 1, 3, inf}, {'k', 0, 80, 0, -1, nan}, {'d', 0, 20, 1, -1, nan},
			{'k', 0, 90, 1, 5, -inf}, {'q', 0, 95, 0, 7, inf}, {'d', 0, 50, 0, 2, inf}}},
		// softcap and dropout (a dropped visible key still passes its NaN on, as dropout(P)·V does)
		{bwdCase{name: "softcap-dropout-causal", b: 1, n: 40, m: 40, h: 2, hkv: 1, dk: 64, dv: 64, causal: true, softcap: 5, dropout: 0.2, dtypes: bf},
			[]bwdPlant{{'v', 0, 30, 0, -1, nan}, {'k', 0, 9, 0, -1, nan}, {'d', 0, 3, 1, -1, nan}}},
		// dBias of a bias shared by the batch: a masked NaN value row (its keys' pairs rewritten by the fix-up, every
		// batch element's dS in the element: kernels.BwdVariant.DBiasAtomic), a visible infinite key element
		{bwdCase{name: "dbias-bcast-b-causal", b: 2, n: 100, m: 130, h: 2, hkv: 1, dk: 64, dv: 64, causal: true, bias: []int{1, 2}, biasGrad: true, dtypes: bf},
			[]bwdPlant{{'v', 1, 120, 0, -1, nan}, {'k', 0, 20, 0, 3, inf}, {'d', 1, 50, 1, -1, nan}}},
		{bwdCase{name: "dbias-bcast-bh-d128", b: 2, n: 70, m: 90, h: 2, hkv: 2, dk: 128, dv: 128, causal: true, bias: []int{1, 1}, biasGrad: true, dtypes: f16},
			[]bwdPlant{{'v', 0, 80, 1, -1, nan}, {'q', 1, 10, 0, 5, nan}}},
		// ... added into dBias itself by tensor-map reduce-adds where the bias is staged (kernels.DBiasReduce: the
		// fix-up writes the exact sum of a poisoned key's elements and zeroes its hidden pairs)
		{bwdCase{name: "dbias-bcast-b-d128-m96", b: 3, n: 80, m: 96, h: 2, hkv: 2, dk: 128, dv: 128, causal: true, bias: []int{1, 2}, biasGrad: true, dtypes: bf},
			[]bwdPlant{{'v', 1, 90, 0, -1, nan}, {'k', 2, 30, 1, 7, inf}, {'d', 0, 60, 1, -1, nan}}},
		// dBias of a bias of every batch element and head (kernels.DBiasDirect: the fix-up zeroes the hidden pairs)
		{bwdCase{name: "dbias-full-causal", b: 2, n: 100, m: 130, h: 2, hkv: 1, dk: 64, dv: 64, causal: true, bias: []int{2, 2}, biasGrad: true, dtypes: bf},
			[]bwdPlant{{'v', 1, 125, 0, -1, nan}, {'d', 0, 40, 1, -1, nan}, {'k', 1, 7, 0, 2, inf}}},
		// a packed batch: the rows past a segment belong to the next one
		{bwdCase{name: "varlen-causal", h: 2, hkv: 1, dk: 64, dv: 64, cuQ: []int32{0, 30, 70}, cuK: []int32{0, 35, 85}, causal: true, dtypes: bf},
			[]bwdPlant{{'v', 0, 35, 0, 5, nan}, {'k', 0, 34, 0, -1, nan}, {'v', 0, 36, 0, 2, inf}, {'v', 0, 80, 0, -1, nan}, {'q', 0, 31, 1, -1, nan}, {'d', 0, 29, 0, -1, nan}}},
	}
}

// dbiasOf returns g's dBias, or an empty tensor where it has none.
func dbiasOf(g attn.Gradients) attn.Tensor {
	if g.DBias == nil {
		return attn.Tensor{}
	}
	return *g.DBias
}

// bwdCheckNonFinite checks gradients of inputs with non-finite values
// against the float64 oracle: every element written, NaN and ±Inf exactly
// where the oracle has them, the finite elements within checkGrad's bound
// (3× the naive computation's error plus one unit roundoff of the scale;
// 1e-5 of the scale in fp32). An element that keeps the all-ones poison
// counts as unwritten; with emulated, only where the oracle is finite (the
// emulator's NaNs keep their operands' payloads, and the inputs' NaNs
// include 0x7fff, which a negation makes the poison).
func bwdCheckNonFinite(t *testing.T, in bwdInputs, g attn.Gradients, emulated bool) {
	t.Helper()
	dt := in.q.DType
	ref, naive := in.oracles(t)
	for _, x := range []struct {
		name       string
		got        attn.Tensor
		want, base []float64
	}{{"dQ", g.DQ, ref.DQ, naive.DQ}, {"dK", g.DK, ref.DK, naive.DK}, {"dV", g.DV, ref.DV, naive.DV}, {"dBias", dbiasOf(g), ref.DBias, naive.DBias}} {
		if x.want == nil {
			continue // no dBias asked
		}
		got := x.got.Float64s()
		if len(got) != len(x.want) {
			t.Fatalf("%s: %d elements, want %d", x.name, len(got), len(x.want))
		}
		var e, ne float64
		s := 1.0
		at, bad, nonFinite := -1, 0, 0
		for i, w := range x.want {
			gv := got[i]
			switch {
			case poisonedAt(x.got, i) && (!emulated || !math.IsNaN(w)):
				t.Fatalf("%s element %d not written (still the poison)", x.name, i)
			case math.IsNaN(w) || math.IsInf(w, 0):
				nonFinite++
				if !(math.IsNaN(w) && math.IsNaN(gv) || gv == w) {
					if bad++; bad <= 5 {
						t.Errorf("%s[%d] = %v, oracle %v", x.name, i, gv, w)
					}
				}
			case math.IsNaN(gv) || math.IsInf(gv, 0):
				if bad++; bad <= 5 {
					t.Errorf("%s[%d] = %v, oracle %v", x.name, i, gv, w)
				}
			default:
				if d := math.Abs(gv - w); d > e {
					e, at = d, i
				}
				if b := x.base[i]; !math.IsNaN(b) && !math.IsInf(b, 0) {
					ne = max(ne, math.Abs(b-w))
				}
				s = max(s, math.Abs(w))
			}
		}
		if bad > 0 {
			t.Fatalf("%s: %d of %d elements non-finite where the oracle is not or the other way round (%d non-finite in the oracle)", x.name, bad, len(x.want), nonFinite)
		}
		bound := 3*ne + conformance.UnitRoundoff(dt)*s
		if dt == attn.Float32 {
			bound = 1e-5 * s
		}
		if e > bound {
			t.Errorf("%s: max error %.3g at %d (got %v, oracle %v) exceeds %.3g", x.name, e, at, got[at], x.want[at], bound)
		}
		t.Logf("%s: %d non-finite elements as the oracle's, max error %.3g (bound %.3g)", x.name, nonFinite, e, bound)
	}
	checkMaskedRowsZero(t, in, g.DQ)
}

// TestBackwardEmulatedNonFinite runs bwdNaNCases with both dQ algorithms
// through every backward kernel family on the host emulator: the mma.sync
// kernels, and the Hopper kernels with tiles by cp.async and by tensor maps
// (odd head dims there over flat rows) (FLASHATTN_BWD_EMU=1; needs g++;
// FLASHATTN_BWD_EMU_CASE selects cases by name).
func TestBackwardEmulatedNonFinite(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	only := os.Getenv("FLASHATTN_BWD_EMU_CASE")
	for _, k := range bwdEmuFamilies {
		t.Run(k.name, func(t *testing.T) {
			for ci, c := range bwdNaNCases() {
				if only != "" && !strings.Contains(c.name, only) {
					continue
				}
				for _, dt := range c.dtypes {
					switch {
					case k.kind != emuMMA && !bwdHopperTakes(dt, c.dk, c.dv):
						continue // the planner picks the mma.sync kernels
					}
					in := c.inputs(t, dt, uint64(ci+1200))
					for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
						t.Run(fmt.Sprintf("%s/%v/%v", c.name, dt, algo), func(t *testing.T) {
							bwdCheckNonFinite(t, in, emuRunOn(t, in, algo, false, k.kind), true)
						})
					}
				}
			}
		})
	}
}

// TestBackwardNonFinite runs bwdNaNCases with both dQ algorithms on the
// device through every backward kernel family the planner can pick there
// (bwdFamilies: the Hopper kernels with tiles by tensor maps, Flat for odd
// dims, and by cp.async; the mma.sync kernels), into poisoned, guarded
// outputs: NaN and ±Inf exactly where the float64 oracle has them, every
// other element within the accuracy bound.
func TestBackwardNonFinite(t *testing.T) {
	dev, s := bwdTestDevice(t)
	forBwdFamilies(t, dev, func(t *testing.T, fam bwdFamily) {
		b := bwdTestBackend(t, dev) // as bwdRun plans: the deep Hopper kernels past 256, which take the separate dQ
		type item struct {
			c  bwdNaNCase
			dt attn.DType
			in bwdInputs
		}
		var items []item
		var vs []kernels.BwdVariant
		for ci, c := range bwdNaNCases() {
			for _, dt := range c.dtypes {
				if fam.hopper && !bwdHopperDims(dt, c.dk, c.dv) {
					continue // the planner picks the mma.sync kernels
				}
				in := c.inputs(t, dt, uint64(ci+1200))
				items = append(items, item{c, dt, in})
				for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
					v := in.backendVariant(t, b, algo)
					if v.WGMMA != fam.hopper || v.TMA != fam.tma {
						t.Fatalf("%s %v %v: plan %s is not of the family", c.name, dt, algo, v.Name())
					}
					if want := fam.tma && strings.HasPrefix(c.name, "flat-") && dt != attn.Float32; v.Flat != want {
						t.Fatalf("%s %v %v: plan %s: Flat = %v, want %v", c.name, dt, algo, v.Name(), v.Flat, want)
					}
					vs = append(vs, v)
				}
			}
		}
		bwdPrewarm(t, dev, vs)
		for _, it := range items {
			for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
				t.Run(fmt.Sprintf("%s/%v/%v", it.c.name, it.dt, algo), func(t *testing.T) {
					bwdCheckNonFinite(t, it.in, bwdRun(t, dev, s, it.in, algo), false)
				})
			}
		}
	})
}
