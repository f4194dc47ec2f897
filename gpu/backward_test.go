package gpu

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"regexp"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/conformance"
	"github.com/flashattn/flashattn/cpu"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
	"github.com/flashattn/flashattn/philox"
)

// bwdDev is the device the backward tests share.
var (
	bwdDevOnce sync.Once
	bwdDev     *cuda.Device
	bwdDevErr  error
)

// bwdTestDevice returns the shared device and a fresh stream, or skips.
func bwdTestDevice(t testing.TB) (*cuda.Device, *cuda.Stream) {
	t.Helper()
	bwdDevOnce.Do(func() { bwdDev, bwdDevErr = cuda.Open(0) })
	if bwdDevErr != nil {
		t.Skipf("no CUDA device: %v", bwdDevErr)
	}
	s := testStream(t, bwdDev)
	return bwdDev, s
}

// bwdCase is one backward test problem.
type bwdCase struct {
	name          string
	b, n, m       int
	h, hkv        int
	dk, dv        int
	causal        bool
	align         attn.Align
	window        *attn.Window
	softcap       float64
	scale         float64 // Options.Scale (0: 1/sqrt(DK))
	bias          []int   // bias shape [bB, bH] (N, M implied); nil: none
	biasGrad      bool
	biasF32       bool
	dropout       float64
	cuQ, cuK      []int32
	dtypes        []attn.DType
	deterministic bool
	headMajor     bool // inputs stored [B, H, N, D] (strided views; host emulator only)
	dropAt        *attn.DropoutOrigin
}

func bwdCases() []bwdCase {
	all := []attn.DType{attn.BFloat16, attn.Float16, attn.Float32}
	bf := []attn.DType{attn.BFloat16}
	return []bwdCase{
		{name: "plain", b: 2, n: 128, m: 128, h: 4, hkv: 4, dk: 64, dv: 64, dtypes: all},
		{name: "seq1", b: 1, n: 1, m: 1, h: 2, hkv: 1, dk: 64, dv: 64, dtypes: all},
		{name: "seq3-causal", b: 2, n: 3, m: 3, h: 2, hkv: 2, dk: 32, dv: 32, causal: true, dtypes: bf},
		{name: "113x203-causal-br", b: 1, n: 113, m: 203, h: 4, hkv: 2, dk: 128, dv: 128, causal: true, dtypes: all},
		{name: "203x113-causal-br-masked-rows", b: 1, n: 203, m: 113, h: 2, hkv: 2, dk: 128, dv: 128, causal: true, dtypes: bf},
		{name: "203x113-causal-tl", b: 1, n: 203, m: 113, h: 2, hkv: 1, dk: 64, dv: 64, causal: true, align: attn.AlignTopLeft, dtypes: bf},
		{name: "113x203-causal-tl", b: 1, n: 113, m: 203, h: 2, hkv: 1, dk: 64, dv: 64, causal: true, align: attn.AlignTopLeft, dtypes: bf},
		{name: "1023x1024-window", b: 1, n: 1023, m: 1024, h: 2, hkv: 1, dk: 64, dv: 64, window: &attn.Window{Left: 100, Right: 50}, dtypes: bf},
		{name: "d59", b: 1, n: 77, m: 90, h: 2, hkv: 2, dk: 59, dv: 59, dtypes: all},
		{name: "d111-127", b: 1, n: 70, m: 65, h: 2, hkv: 1, dk: 111, dv: 127, causal: true, dtypes: bf},
		{name: "d199-257", b: 1, n: 65, m: 97, h: 2, hkv: 2, dk: 199, dv: 257, dtypes: []attn.DType{attn.BFloat16, attn.Float32}},
		{name: "d256", b: 1, n: 130, m: 130, h: 2, hkv: 1, dk: 256, dv: 256, causal: true, dtypes: bf},
		{name: "d199", b: 1, n: 130, m: 200, h: 4, hkv: 2, dk: 199, dv: 199, causal: true, dtypes: []attn.DType{attn.BFloat16, attn.Float16}},
		{name: "d144-224", b: 1, n: 100, m: 140, h: 2, hkv: 1, dk: 144, dv: 224, dtypes: bf},
		// odd head dims the Hopper kernels read in place (flat rows: eight heads or more, one query head
		// per key head, every shift of a head in its 16-byte unit)
		{name: "flat-d199-causal", b: 2, n: 130, m: 150, h: 16, hkv: 16, dk: 199, dv: 199, causal: true, dtypes: []attn.DType{attn.BFloat16, attn.Float16}},
		{name: "flat-d201-185-bias-dropout", b: 1, n: 100, m: 140, h: 8, hkv: 8, dk: 201, dv: 185, bias: []int{1, 8}, biasGrad: true, dropout: 0.1, softcap: 4, dtypes: bf},
		{name: "flat-d121-window", b: 1, n: 120, m: 160, h: 16, hkv: 16, dk: 121, dv: 121, window: &attn.Window{Left: 30, Right: 9}, dtypes: bf},
		{name: "d80-112", b: 1, n: 100, m: 129, h: 2, hkv: 2, dk: 80, dv: 112, causal: true, dtypes: bf},
		{name: "d512", b: 1, n: 70, m: 70, h: 2, hkv: 2, dk: 512, dv: 512, dtypes: []attn.DType{attn.BFloat16, attn.Float32}},
		// the deep Hopper kernels (padded dims past 256): GQA, masks and every feature, uneven slices
		{name: "d320-gqa-causal-dropout", b: 1, n: 150, m: 170, h: 4, hkv: 2, dk: 320, dv: 320, causal: true, dropout: 0.1, dtypes: bf},
		{name: "d301-384-window-bias-softcap", b: 1, n: 100, m: 130, h: 2, hkv: 2, dk: 301, dv: 384, window: &attn.Window{Left: 25, Right: 7}, bias: []int{1, 2}, biasGrad: true, softcap: 4, dtypes: []attn.DType{attn.Float16}},
		{name: "d1", b: 1, n: 40, m: 33, h: 2, hkv: 2, dk: 1, dv: 1, dtypes: []attn.DType{attn.BFloat16, attn.Float16}},
		{name: "d16-512", b: 1, n: 50, m: 50, h: 2, hkv: 1, dk: 16, dv: 512, dtypes: bf},
		{name: "d96-32", b: 1, n: 80, m: 100, h: 2, hkv: 2, dk: 96, dv: 32, dtypes: bf},
		{name: "gqa6:1", b: 1, n: 100, m: 100, h: 6, hkv: 1, dk: 64, dv: 64, causal: true, dtypes: bf},
		{name: "gqa6:2", b: 2, n: 64, m: 64, h: 6, hkv: 2, dk: 64, dv: 64, dtypes: bf},
		{name: "gqa8:1", b: 1, n: 96, m: 160, h: 8, hkv: 1, dk: 128, dv: 128, dtypes: bf},
		{name: "softcap", b: 1, n: 100, m: 120, h: 2, hkv: 1, dk: 64, dv: 64, softcap: 5, dtypes: all},
		{name: "bias-full-grad", b: 2, n: 70, m: 90, h: 2, hkv: 1, dk: 64, dv: 64, bias: []int{2, 2}, biasGrad: true, dtypes: all},
		{name: "bias-bcast-b-grad-softcap", b: 2, n: 70, m: 90, h: 2, hkv: 2, dk: 64, dv: 64, bias: []int{1, 2}, biasGrad: true, softcap: 4, causal: true, dtypes: bf},
		{name: "bias-bcast-h-grad", b: 2, n: 64, m: 64, h: 4, hkv: 2, dk: 32, dv: 32, bias: []int{2, 1}, biasGrad: true, biasF32: true, dtypes: bf},
		{name: "bias-bcast-all-grad-window", b: 2, n: 64, m: 80, h: 2, hkv: 1, dk: 64, dv: 64, bias: []int{1, 1}, biasGrad: true, window: &attn.Window{Left: 10, Right: 3}, dtypes: []attn.DType{attn.BFloat16, attn.Float32}},
		{name: "bias-nograd", b: 1, n: 50, m: 50, h: 2, hkv: 2, dk: 64, dv: 64, bias: []int{1, 2}, dtypes: bf},
		{name: "dropout", b: 2, n: 100, m: 110, h: 2, hkv: 1, dk: 64, dv: 64, dropout: 0.2, dtypes: all},
		{name: "dropout-causal-softcap", b: 1, n: 130, m: 130, h: 2, hkv: 2, dk: 128, dv: 128, dropout: 0.1, causal: true, softcap: 7, dtypes: bf},
		{name: "varlen", h: 4, hkv: 2, dk: 64, dv: 64, cuQ: []int32{0, 5, 5, 100, 300}, cuK: []int32{0, 7, 20, 20, 150}, causal: true, dtypes: all},
		{name: "varlen-dropout", h: 2, hkv: 2, dk: 128, dv: 128, cuQ: []int32{0, 0, 130, 131}, cuK: []int32{0, 33, 33, 200}, dropout: 0.15, dtypes: bf},
		{name: "deterministic-flag", b: 1, n: 90, m: 90, h: 2, hkv: 1, dk: 64, dv: 64, deterministic: true, dtypes: bf},
	}
}

// bwdInputs holds one case's inputs for one dtype.
type bwdInputs struct {
	q, k, v, o, lse, dO attn.Tensor
	opt                 attn.Options
	p                   *attn.Problem
}

// oracles returns the float64 reference gradients of the inputs and the
// naive baseline's in their element type, failing the test on an error.
func (in bwdInputs) oracles(t *testing.T) (ref, naive *cpu.RefGrads) {
	t.Helper()
	ref, err := cpu.ReferenceBackward(in.q, in.k, in.v, in.dO, in.opt)
	if err != nil {
		t.Fatalf("reference: %v", err)
	}
	naive, err = cpu.NaiveBackward(in.q.DType, in.q, in.k, in.v, in.dO, in.opt)
	if err != nil {
		t.Fatalf("naive: %v", err)
	}
	return ref, naive
}

func randTensor(r *rand.Rand, dt attn.DType, sd float64, shape ...int) attn.Tensor {
	x := make([]float32, attn.NumElements(shape))
	for i := range x {
		x[i] = float32(r.NormFloat64() * sd)
	}
	return attn.FromFloat32(dt, x, shape...)
}

func fromF64(dt attn.DType, x []float64, shape []int) attn.Tensor {
	f := make([]float32, len(x))
	for i, v := range x {
		f[i] = float32(v)
	}
	return attn.FromFloat32(dt, f, shape...)
}

// inputs draws the case's tensors in dt and computes O and LSE with the
// float64 reference (rounded to dt and float32).
func (c bwdCase) inputs(t testing.TB, dt attn.DType, seed uint64) bwdInputs {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, 7))
	var in bwdInputs
	in.opt = attn.Options{Scale: c.scale, Softcap: c.softcap, Causal: c.causal, Align: c.align, Window: c.window, Dropout: c.dropout,
		Seed: 0x1234_5678_9abc_def0 ^ seed, Offset: 3, CuSeqlensQ: c.cuQ, CuSeqlensK: c.cuK, Deterministic: c.deterministic, DropoutAt: c.dropAt}
	if c.cuQ != nil {
		tq, tk := int(c.cuQ[len(c.cuQ)-1]), int(c.cuK[len(c.cuK)-1])
		in.q = randTensor(r, dt, 1, tq, c.h, c.dk)
		in.k = randTensor(r, dt, 1, tk, c.hkv, c.dk)
		in.v = randTensor(r, dt, 1, tk, c.hkv, c.dv)
	} else {
		in.q = randTensor(r, dt, 1, c.b, c.n, c.h, c.dk)
		in.k = randTensor(r, dt, 1, c.b, c.m, c.hkv, c.dk)
		in.v = randTensor(r, dt, 1, c.b, c.m, c.hkv, c.dv)
	}
	if c.bias != nil {
		bdt := dt
		if c.biasF32 {
			bdt = attn.Float32
		}
		in.opt.Bias = &attn.Bias{Tensor: randTensor(r, bdt, 1, c.bias[0], c.bias[1], c.n, c.m), RequiresGrad: c.biasGrad}
	}
	in.forward(t)
	in.dO = randTensor(r, dt, 1, in.p.OutputShape()...)
	return in
}

// forward sets the problem, O (in q's dtype) and the LSE of the inputs
// from cpu.Reference.
func (in *bwdInputs) forward(t testing.TB) {
	t.Helper()
	ref, err := cpu.Reference(in.q, in.k, in.v, in.opt)
	if err != nil {
		t.Fatalf("reference: %v", err)
	}
	in.p = ref.Problem
	in.o = fromF64(in.q.DType, ref.O, in.p.OutputShape())
	in.lse = fromF64(attn.Float32, ref.LSE, in.p.LSEShape())
}

// bwdPoison is the byte every output and guard is filled with: NaN in
// every dtype.
const bwdPoison = 0xFF

// bwdGuard is the number of guard bytes on each side of an output.
const bwdGuard = 512

// bwdRun runs the backward through bwdEnqueue with NaN-poisoned
// outputs surrounded by guard bands, checks the guards, and returns the
// gradients.
func bwdRun(t testing.TB, dev *cuda.Device, s *cuda.Stream, in bwdInputs, algo DQAlgorithm) attn.Gradients {
	t.Helper()
	dt := in.q.DType
	bb := &bwdBuffers{dev: dev}
	defer bb.free()
	a := bwdUploadInputs(t, bb, in)
	type out struct {
		shape []int
		dt    attn.DType
		buf   *cuda.Buffer
		n     int
	}
	guarded := func(shape []int, odt attn.DType) out {
		n := attn.NumElements(shape) * odt.Size()
		buf, err := bb.alloc(int64(n + 2*bwdGuard))
		if err != nil {
			t.Fatal(err)
		}
		if err := dev.Memset8(buf, bwdPoison); err != nil {
			t.Fatal(err)
		}
		return out{shape, odt, buf, n}
	}
	outs := []out{guarded(in.q.Shape, dt), guarded(in.k.Shape, dt), guarded(in.v.Shape, dt)}
	a.DQ = seqView(outs[0].buf.Ptr()+bwdGuard, dt, in.q.Shape)
	a.DK = seqView(outs[1].buf.Ptr()+bwdGuard, dt, in.k.Shape)
	a.DV = seqView(outs[2].buf.Ptr()+bwdGuard, dt, in.v.Shape)
	if in.opt.Bias != nil {
		bt := in.opt.Bias.Tensor
		buf, err := bb.upload(bt.Bytes())
		if err != nil {
			t.Fatal(err)
		}
		a.Bias = biasView(buf.Ptr(), bt.DType, bt.Shape)
		if in.opt.Bias.RequiresGrad {
			o := guarded(bt.Shape, bt.DType)
			outs = append(outs, o)
			a.DBias = biasView(o.buf.Ptr()+bwdGuard, bt.DType, bt.Shape)
		}
	}
	if in.p.Varlen {
		for _, x := range []struct {
			cu  []int32
			dst *uint64
		}{{in.opt.CuSeqlensQ, &a.CuSeqlensQ}, {in.opt.CuSeqlensK, &a.CuSeqlensK}} {
			buf, err := bb.upload(int32Bytes(x.cu))
			if err != nil {
				t.Fatal(err)
			}
			*x.dst = buf.Ptr()
		}
	}
	ws, err := bb.alloc(BackwardWorkspaceBytes(in.p, in.q.DType, algo, in.opt.Bias != nil && in.opt.Bias.RequiresGrad))
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.Memset8(ws, bwdPoison); err != nil {
		t.Fatal(err)
	}
	a.Workspace = ws.Ptr()
	if _, err := bwdEnqueue(t, dev, s, in.p, dt, a, algo); err != nil {
		t.Fatalf("backward: %v", err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatalf("backward: %v", err)
	}
	var g attn.Gradients
	for i, o := range outs {
		host := make([]byte, o.n+2*bwdGuard)
		if err := dev.CopyFromDevice(host, o.buf, 0); err != nil {
			t.Fatal(err)
		}
		for _, gb := range [][]byte{host[:bwdGuard], host[bwdGuard+o.n:]} {
			if !bytes.Equal(gb, bytes.Repeat([]byte{bwdPoison}, bwdGuard)) {
				t.Fatalf("output %d: guard band overwritten", i)
			}
		}
		tt := tensorFromBytes(o.dt, host[bwdGuard:bwdGuard+o.n], o.shape)
		switch i {
		case 0:
			g.DQ = tt
		case 1:
			g.DK = tt
		case 2:
			g.DV = tt
		case 3:
			g.DBias = &tt
		}
	}
	return g
}

func int32Bytes(x []int32) []byte {
	b := make([]byte, 4*len(x))
	for i, c := range x {
		b[4*i], b[4*i+1], b[4*i+2], b[4*i+3] = byte(c), byte(c>>8), byte(c>>16), byte(c>>24)
	}
	return b
}

// checkGrad applies FlashAttention's criterion: err ≤ 3·naive + u·s for
// 16-bit dtypes, err ≤ 1e-5·s for fp32, with s = max(1, max|ref|); every
// element finite.
func checkGrad(t testing.TB, name string, dt attn.DType, got attn.Tensor, ref, naive []float64) {
	t.Helper()
	g := got.Float64s()
	if len(g) != len(ref) {
		t.Errorf("%s: %d elements, want %d", name, len(g), len(ref))
		return
	}
	var e, en, s float64 = 0, 0, 1
	at := -1
	for i := range g {
		if math.IsNaN(g[i]) || math.IsInf(g[i], 0) {
			t.Errorf("%s: element %d is %v (unwritten or overflow)", name, i, g[i])
			return
		}
		if d := math.Abs(g[i] - ref[i]); d > e {
			e, at = d, i
		}
		en = max(en, math.Abs(naive[i]-ref[i]))
		s = max(s, math.Abs(ref[i]))
	}
	var bound float64
	if dt == attn.Float32 {
		bound = 1e-5 * s
	} else {
		bound = 3*en + conformance.UnitRoundoff(dt)*s
	}
	if e > bound {
		t.Errorf("%s: max error %.3g at %d (got %.6g want %.6g) > bound %.3g (naive %.3g, scale %.3g)", name, e, at, g[at], ref[at], bound, en, s)
	} else {
		t.Logf("%s: max error %.3g, bound %.3g (naive %.3g, scale %.3g)", name, e, bound, en, s)
	}
}

// checkGrads checks dQ, dK and dV of g against the reference gradients
// ref within the bound of checkGrad (naive: the baseline in dt).
func checkGrads(t *testing.T, dt attn.DType, g attn.Gradients, ref, naive *cpu.RefGrads) {
	t.Helper()
	checkGrad(t, "dQ", dt, g.DQ, ref.DQ, naive.DQ)
	checkGrad(t, "dK", dt, g.DK, ref.DK, naive.DK)
	checkGrad(t, "dV", dt, g.DV, ref.DV, naive.DV)
}

func TestBackwardGradients(t *testing.T) {
	dev, s := bwdTestDevice(t)
	b := bwdTestBackend(t, dev)
	var items []bwdItem
	var vs []kernels.BwdVariant
	only := os.Getenv("FLASHATTN_BWD_CASES") // a regular expression: only the cases whose names match
	for ci, c := range bwdCases() {
		if only != "" && !regexp.MustCompile(only).MatchString(c.name) {
			continue
		}
		for _, dt := range c.dtypes {
			in := c.inputs(t, dt, uint64(ci+1))
			items = append(items, newBwdItem(c, dt, in))
			vs = append(vs, in.backendVariant(t, b, DQAtomic), in.backendVariant(t, b, DQSeparate))
		}
	}
	bwdPrewarm(t, dev, vs)
	bwdCheckItems(t, dev, s, items)
}

// TestBackwardKeyRowsDefault runs the problems of the key-rows step's class
// (Backend.BwdKeyRowsAuto: D = 65–128, at least 512 queries without a mask
// and 1024 with one), which bwdCases' short sequences do not reach, with both dQ
// algorithms on a new backend: the dQ left atomic must plan the key-rows
// step with the bulk dQ on a Hopper device, and every gradient must meet
// the criterion. Skips without a GPU.
func TestBackwardKeyRowsDefault(t *testing.T) {
	dev, s := bwdTestDevice(t)
	b := bwdTestBackend(t, dev)
	both := []attn.DType{attn.BFloat16, attn.Float16}
	var items []bwdItem
	var vs []kernels.BwdVariant
	for ci, c := range []bwdCase{
		{name: "keyrows-d128-n1024", b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 128, dv: 128, dtypes: both},
		{name: "keyrows-d128-96-gqa-n1100-m1300", b: 2, n: 1100, m: 1300, h: 4, hkv: 2, dk: 128, dv: 96, dtypes: both[:1]},
		{name: "keyrows-d128-causal-br-gqa-n1040-m1100", b: 1, n: 1040, m: 1100, h: 4, hkv: 2, dk: 128, dv: 128, causal: true, dtypes: both[:1]},
		{name: "keyrows-d120-n600", b: 2, n: 600, m: 700, h: 2, hkv: 2, dk: 120, dv: 120, dtypes: both[:1]},
		{name: "keyrows-d128-bias-grad-softcap-n1024-m1040", b: 2, n: 1024, m: 1040, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, softcap: 4, dtypes: both[:1]},
		// a mask with a 16-bit bias: the bias staged by default (Backend.BiasStagedAuto)
		{name: "keyrows-d128-causal-bias-grad-n1040", b: 1, n: 1040, m: 1040, h: 2, hkv: 2, dk: 128, dv: 128, causal: true, bias: []int{1, 2}, biasGrad: true, dtypes: both},
		// dBias of a bias broadcast over the batch: by atomic adds, or by tiles under EnvDBiasTiles (the accumulator's padding past N and M)
		{name: "keyrows-d128-bias-bcast-b-grad-n1030-m1100", b: 3, n: 1030, m: 1100, h: 2, hkv: 1, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, dtypes: both},
		{name: "keyrows-d128-causal-bias-bcast-b-grad-n1104", b: 2, n: 1104, m: 1104, h: 2, hkv: 2, dk: 128, dv: 128, causal: true, bias: []int{1, 2}, biasGrad: true, dtypes: both[:1]},
		{name: "keyrows-d128-bias-bcast-b4-grad-n1030-m1088", b: 4, n: 1030, m: 1088, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, dtypes: both},
		// head dims 49–64: steps of 128 queries, dQ's rows split over the warpgroups; the last step's
		// second half partly (1100 = 8·128 + 76) or wholly (1030 = 8·128 + 6) past the queries
		{name: "keyrows-q128-d64-n1024", b: 2, n: 1024, m: 1024, h: 2, hkv: 2, dk: 64, dv: 64, dtypes: both},
		{name: "keyrows-q128-d56-64-causal-gqa-n1100", b: 1, n: 1100, m: 1100, h: 4, hkv: 2, dk: 56, dv: 64, causal: true, dtypes: both[:1]},
		{name: "keyrows-q128-d64-bias-n1030-m1200", b: 1, n: 1030, m: 1200, h: 2, hkv: 2, dk: 64, dv: 64, bias: []int{1, 2}, biasGrad: true, dtypes: both[:1]},
		{name: "keyrows-q128-d64-bias-bcast-b3-grad-causal-n1100-m1104", b: 3, n: 1100, m: 1104, h: 2, hkv: 1, dk: 64, dv: 64, causal: true, bias: []int{1, 2}, biasGrad: true, dtypes: both},
		// a 16-bit bias alone from global memory: loaded while the products run (padded D = 128), its rows prefetched (D = 64)
		{name: "keyrows-d128-bias-bcast-b-n1030-m1100", b: 2, n: 1030, m: 1100, h: 2, hkv: 1, dk: 128, dv: 128, bias: []int{1, 2}, dtypes: both},
		{name: "keyrows-d120-bias-bcast-h-n700", b: 2, n: 700, m: 700, h: 2, hkv: 2, dk: 120, dv: 120, bias: []int{2, 1}, dtypes: both[:1]},
		{name: "keyrows-q128-d64-bias-n1100", b: 2, n: 1100, m: 1100, h: 2, hkv: 2, dk: 64, dv: 64, bias: []int{1, 2}, dtypes: both[1:]},
		// dropout: the keep bits drawn by the key-rows step
		{name: "keyrows-d128-dropout-causal-n1040", b: 1, n: 1040, m: 1040, h: 2, hkv: 2, dk: 128, dv: 128, causal: true, dropout: 0.1, dtypes: both[:1]},
		{name: "keyrows-d128-dropout-bias-grad-n1024", b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 128, dv: 128, bias: []int{1, 2}, biasGrad: true, dropout: 0.2, dtypes: both[1:]},
		{name: "keyrows-q128-d64-dropout-n1100", b: 1, n: 1100, m: 1100, h: 2, hkv: 2, dk: 64, dv: 64, dropout: 0.15, dtypes: both[:1]},
	} {
		for _, dt := range c.dtypes {
			in := c.inputs(t, dt, uint64(200+ci))
			items = append(items, newBwdItem(c, dt, in))
			v := in.backendVariant(t, b, DQAtomic)
			if b.BwdKeyRowsAuto && b.BwdPipeline.WarpSpecialized && (!v.KeyRows || !v.BulkDQ) {
				t.Errorf("%s %v: %s, want the key-rows step with the bulk dQ", c.name, dt, v.Name())
			}
			if want := 0; b.BwdKeyRowsAuto && b.BwdPipeline.WarpSpecialized && b.BwdQueryStep == 0 {
				if max(c.dk, c.dv) <= 64 {
					want = 128
				}
				if v.QueryStep != want {
					t.Errorf("%s %v: %s, steps of %d queries, want %d", c.name, dt, v.Name(), v.QueryStep, want)
				}
			}
			// staged wherever the knob is on and the variant and the bias's rows (16-byte aligned) allow it
			staged := v
			staged.BiasStaged = true
			if want := v.KeyRows && c.bias != nil && b.biasStaged() && staged.Validate() == nil && c.m*2%16 == 0; v.BiasStaged != want {
				t.Errorf("%s %v: %s, staged bias %v, want %v", c.name, dt, v.Name(), v.BiasStaged, want)
			}
			// dBias by tiles, by tensor-map stores or by tensor-map reduce-adds, wherever the knobs are on and the
			// variant (and dBias's rows) allow it
			for _, x := range []struct {
				on   bool
				from []kernels.DBiasPath
				to   kernels.DBiasPath
			}{
				{b.DBiasTiles, []kernels.DBiasPath{kernels.DBiasAtomic}, kernels.DBiasTiles},
				{b.DBiasStore, []kernels.DBiasPath{kernels.DBiasDirect}, kernels.DBiasStore},
				{b.DBiasReduce, []kernels.DBiasPath{kernels.DBiasAtomic, kernels.DBiasTiles}, kernels.DBiasReduce},
			} {
				w := v
				w.DBiasPath = x.to
				if x.on && slices.Contains(x.from, v.DBiasPath) && w.Validate() == nil && c.m*2%16 == 0 {
					t.Errorf("%s %v: %s, dBias %v where %v is on and allowed", c.name, dt, v.Name(), v.DBiasPath, x.to)
				}
			}
			vs = append(vs, v, in.backendVariant(t, b, DQSeparate))
		}
	}
	bwdPrewarm(t, dev, vs)
	bwdCheckItems(t, dev, s, items)
	bwdCheckHost(t, b, items)
}

// bwdCheckHost runs every item through the host path (Backend.Backward on
// host tensors, the dQ algorithm left to the planner) and checks the
// gradients as bwdCheckItems does. The host path plans before it
// allocates its workspace and binds the plan to it afterwards: the same
// kernels and layouts as the device path's, which these runs check.
func bwdCheckHost(t *testing.T, b *Backend, items []bwdItem) {
	for _, it := range items {
		t.Run(fmt.Sprintf("%s/%v/host", it.c.name, it.dt), func(t *testing.T) {
			in := it.in
			g, err := b.Backward(in.q, in.k, in.v, in.o, in.lse, in.dO, in.opt)
			if err != nil {
				t.Fatal(err)
			}
			ref, naive := it.oracles.get(t, in)
			checkGrads(t, it.dt, g, ref, naive)
		})
	}
}

// bwdItem is one backward case in one dtype, with its inputs and their
// oracles, computed on first use.
type bwdItem struct {
	c       bwdCase
	dt      attn.DType
	in      bwdInputs
	oracles *bwdOracles
}

// newBwdItem returns the item of case c in dtype dt with inputs in.
func newBwdItem(c bwdCase, dt attn.DType, in bwdInputs) bwdItem {
	return bwdItem{c: c, dt: dt, in: in, oracles: &bwdOracles{}}
}

// bwdOracles holds an item's float64 reference and naive gradients,
// computed by the first subtest that asks (get), so that a run filtered
// by -run computes only those of the items it runs, and the device and
// host subtests of an item share them.
type bwdOracles struct {
	ref, naive *cpu.RefGrads // nil until computed
}

// get returns the oracles of inputs in, computing them on the first call.
func (o *bwdOracles) get(t *testing.T, in bwdInputs) (ref, naive *cpu.RefGrads) {
	t.Helper()
	if o.ref == nil {
		o.ref, o.naive = in.oracles(t)
	}
	return o.ref, o.naive
}

// bwdCheckItems runs every item with both dQ algorithms on the device, one
// subtest each, and checks dQ, dK, dV (and dBias) against the oracles and
// dQ's rows that see no key against 0.
func bwdCheckItems(t *testing.T, dev *cuda.Device, s *cuda.Stream, items []bwdItem) {
	for _, it := range items {
		c, dt, in := it.c, it.dt, it.in
		for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
			t.Run(fmt.Sprintf("%s/%v/%v", c.name, dt, algo), func(t *testing.T) {
				g := bwdRun(t, dev, s, in, algo)
				ref, naive := it.oracles.get(t, in)
				checkGrads(t, dt, g, ref, naive)
				if c.biasGrad {
					if g.DBias == nil {
						t.Fatalf("no dBias")
					}
					// dBias is stored in the bias's dtype but computed in the
					// problem's precision: the problem's criterion applies.
					checkGrad(t, "dBias", dt, *g.DBias, ref.DBias, naive.DBias)
				}
				checkMaskedRowsZero(t, in, g.DQ)
			})
		}
	}
}

// checkMaskedRowsZero checks that dQ is exactly 0 on rows that see no key.
func checkMaskedRowsZero(t testing.TB, in bwdInputs, dq attn.Tensor) {
	t.Helper()
	l := in.lse.Float64s()
	x := dq.Float64s()
	p := in.p
	for r, v := range l {
		if !math.IsInf(v, -1) {
			continue
		}
		// lse index r → (b, h, i) or (h, token); dq rows are (b, i, h) or (token, h)
		var row int
		if p.Varlen {
			h, tok := r/p.TotalQ, r%p.TotalQ
			row = tok*p.H + h
		} else {
			b, h, i := r/(p.H*p.N), (r/p.N)%p.H, r%p.N
			row = (b*p.N+i)*p.H + h
		}
		for d := 0; d < p.DK; d++ {
			if x[row*p.DK+d] != 0 {
				t.Errorf("dQ of a row with no visible key: element %d = %v", d, x[row*p.DK+d])
				return
			}
		}
	}
}

// TestBackwardVariant checks that BackwardVariant names the kernels
// PrepareBackward prepares: the dQ algorithm it resolves, and the
// backend's pipeline on a tensor-map Hopper case.
func TestBackwardVariant(t *testing.T) {
	b := fwdBackend(t)
	for _, c := range []bwdCase{
		{name: "d128", b: 1, n: 256, m: 256, h: 4, hkv: 2, dk: 128, dv: 128},
		{name: "d64 causal", b: 1, n: 256, m: 256, h: 2, hkv: 2, dk: 64, dv: 64, causal: true},
	} {
		in := c.inputs(t, attn.BFloat16, 31)
		q, k, v, o, lse, dO, dq, dk, dv := newTestBufs(t, b).bwdTensors(in)
		opt := BackwardOptions{DeviceOptions: DeviceOptions{Options: in.opt}}
		vr, err := b.BackwardVariant(q, k, v, o, lse, dO, dq, dk, dv, opt)
		if err != nil {
			t.Fatalf("%s: BackwardVariant: %v", c.name, err)
		}
		algo, _, err := b.PrepareBackward(q, k, v, o, lse, dO, dq, dk, dv, opt)
		if err != nil {
			t.Fatalf("%s: PrepareBackward: %v", c.name, err)
		}
		if vr.AtomicDQ != (algo == DQAtomic) {
			t.Errorf("%s: %s with dQ %v", c.name, vr.Name(), algo)
		}
		if want := b.WGMMA && b.TMA && b.BwdPipeline.WarpSpecialized; vr.WarpSpecialized != want {
			t.Errorf("%s: %s, WarpSpecialized %v, want %v", c.name, vr.Name(), vr.WarpSpecialized, want)
		}
	}
}

// TestBackwardDeterministic repeats the separate algorithm 50 times and
// demands bit-identical gradients (dBias included).
func TestBackwardDeterministic(t *testing.T) {
	dev, s := bwdTestDevice(t)
	c := bwdCase{name: "det", b: 2, n: 300, m: 300, h: 4, hkv: 2, dk: 64, dv: 64, causal: true, dropout: 0.1,
		bias: []int{1, 4}, biasGrad: true, softcap: 8}
	in := c.inputs(t, attn.BFloat16, 99)
	first := bwdRun(t, dev, s, in, DQSeparate)
	for rep := 1; rep < 50; rep++ {
		g := bwdRun(t, dev, s, in, DQSeparate)
		for _, x := range [][2]attn.Tensor{{first.DQ, g.DQ}, {first.DK, g.DK}, {first.DV, g.DV}, {*first.DBias, *g.DBias}} {
			if !bytes.Equal(x[0].Bytes(), x[1].Bytes()) {
				t.Fatalf("repeat %d differs from the first run", rep)
			}
		}
	}
}

// TestBackwardAtomicUnderLoad repeats the atomic algorithm 100 times while
// another stream keeps the GPU busy; every result must match the first
// within rounding (one unit in the last place of the dtype, relative to
// the gradient's scale).
func TestBackwardAtomicUnderLoad(t *testing.T) {
	dev, s := bwdTestDevice(t)
	busy := testStream(t, dev)
	c := bwdCase{name: "atomic", b: 2, n: 512, m: 512, h: 8, hkv: 2, dk: 64, dv: 64, causal: true}
	in := c.inputs(t, attn.BFloat16, 5)
	ref := bwdRun(t, dev, s, in, DQAtomic)
	// Load: a larger backward enqueued repeatedly on the other stream.
	load := bwdCase{name: "load", b: 4, n: 2048, m: 2048, h: 8, hkv: 8, dk: 128, dv: 128}
	lin := load.inputs(t, attn.BFloat16, 6)
	lb := &bwdBuffers{dev: dev}
	defer lb.free()
	la := bwdTestArgs(t, lb, lin, DQAtomic)
	u := conformance.UnitRoundoff(attn.BFloat16)
	for rep := 0; rep < 100; rep++ {
		if rep%10 == 0 {
			for i := 0; i < 3; i++ {
				if _, err := bwdEnqueue(t, dev, busy, lin.p, attn.BFloat16, la, DQAtomic); err != nil {
					t.Fatal(err)
				}
			}
		}
		g := bwdRun(t, dev, s, in, DQAtomic)
		for _, x := range []struct {
			name string
			a, b attn.Tensor
		}{{"dQ", ref.DQ, g.DQ}, {"dK", ref.DK, g.DK}, {"dV", ref.DV, g.DV}} {
			a, b := x.a.Float64s(), x.b.Float64s()
			var sc, e float64 = 1, 0
			for i := range a {
				sc = max(sc, math.Abs(a[i]))
				e = max(e, math.Abs(a[i]-b[i]))
			}
			if e > 2*u*sc || math.IsNaN(e) {
				t.Fatalf("repeat %d: %s differs by %.3g (scale %.3g)", rep, x.name, e, sc)
			}
		}
	}
	if err := busy.Synchronize(); err != nil {
		t.Fatal(err)
	}
}

// bwdUploadInputs uploads q, k, v, o, dO and lse of a case and returns
// their views.
func bwdUploadInputs(t testing.TB, bb *bwdBuffers, in bwdInputs) bwdArgs {
	t.Helper()
	var a bwdArgs
	for _, x := range []struct {
		t   attn.Tensor
		dst *bwdView
	}{{in.q, &a.Q}, {in.k, &a.K}, {in.v, &a.V}, {in.o, &a.O}, {in.dO, &a.DO}} {
		buf, err := bb.upload(x.t.Bytes())
		if err != nil {
			t.Fatal(err)
		}
		*x.dst = seqView(buf.Ptr(), x.t.DType, x.t.Shape)
	}
	lb, err := bb.upload(in.lse.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	a.LSE = lseView(lb.Ptr(), in.lse.Shape)
	return a
}

// bwdTestArgs uploads a case and allocates its outputs and workspace.
func bwdTestArgs(t testing.TB, bb *bwdBuffers, in bwdInputs, algo DQAlgorithm) bwdArgs {
	t.Helper()
	dt := in.q.DType
	a := bwdUploadInputs(t, bb, in)
	for _, x := range []struct {
		shape []int
		dst   *bwdView
	}{{in.q.Shape, &a.DQ}, {in.k.Shape, &a.DK}, {in.v.Shape, &a.DV}} {
		buf, err := bb.alloc(int64(attn.NumElements(x.shape) * dt.Size()))
		if err != nil {
			t.Fatal(err)
		}
		*x.dst = seqView(buf.Ptr(), dt, x.shape)
	}
	ws, err := bb.alloc(BackwardWorkspaceBytes(in.p, in.q.DType, algo, in.opt.Bias != nil && in.opt.Bias.RequiresGrad))
	if err != nil {
		t.Fatal(err)
	}
	a.Workspace = ws.Ptr()
	return a
}

// TestBackwardGraph captures the backward in a CUDA graph, replays it and
// compares with a direct run.
func TestBackwardGraph(t *testing.T) {
	dev, s := bwdTestDevice(t)
	c := bwdCase{name: "graph", b: 2, n: 200, m: 260, h: 4, hkv: 2, dk: 128, dv: 128, causal: true}
	in := c.inputs(t, attn.BFloat16, 11)
	for _, algo := range []DQAlgorithm{DQSeparate, DQAtomic} {
		bb := &bwdBuffers{dev: dev}
		a := bwdTestArgs(t, bb, in, algo)
		if err := bwdPrepare(t, dev, in.p, attn.BFloat16, a, algo); err != nil {
			t.Fatal(err)
		}
		if err := s.BeginCapture(cuda.CaptureThreadLocal); err != nil {
			t.Fatal(err)
		}
		_, err := bwdEnqueue(t, dev, s, in.p, attn.BFloat16, a, algo)
		graph, cerr := s.EndCapture()
		if err != nil || cerr != nil {
			t.Fatalf("capture: %v, %v", err, cerr)
		}
		read := func() [][]byte {
			var out [][]byte
			for _, x := range []struct {
				v     bwdView
				shape []int
			}{{a.DQ, in.q.Shape}, {a.DK, in.k.Shape}, {a.DV, in.v.Shape}} {
				host := make([]byte, attn.NumElements(x.shape)*2)
				buf := findBuf(bb, x.v.Ptr)
				if err := dev.CopyFromDevice(host, buf, 0); err != nil {
					t.Fatal(err)
				}
				out = append(out, host)
			}
			return out
		}
		for _, v := range []bwdView{a.DQ, a.DK, a.DV} {
			if err := dev.Memset8(findBuf(bb, v.Ptr), bwdPoison); err != nil {
				t.Fatal(err)
			}
		}
		if err := graph.Launch(s); err != nil {
			t.Fatal(err)
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		replay := read()
		direct := bwdRun(t, dev, s, in, algo)
		for i, d := range []attn.Tensor{direct.DQ, direct.DK, direct.DV} {
			want := d.Bytes()
			if algo == DQSeparate && !bytes.Equal(replay[i], want) {
				t.Errorf("%v: replayed output %d differs from a direct run", algo, i)
			}
			if algo == DQAtomic {
				gt := tensorFromBytes(attn.BFloat16, replay[i], d.Shape)
				a, b := gt.Float64s(), d.Float64s()
				var e, sc float64 = 0, 1
				for j := range a {
					e, sc = max(e, math.Abs(a[j]-b[j])), max(sc, math.Abs(b[j]))
				}
				if !(e <= 2*conformance.UnitRoundoff(attn.BFloat16)*sc) {
					t.Errorf("%v: replayed output %d differs by %.3g", algo, i, e)
				}
			}
		}
		_ = graph.Close()
		bb.free()
	}
}

// findBuf returns the buffer of bb starting at ptr.
func findBuf(bb *bwdBuffers, ptr uint64) *cuda.Buffer {
	for _, b := range bb.bufs {
		if b.Ptr() == ptr {
			return b
		}
	}
	return nil
}

// bwdTensors uploads the inputs of a backward call of in (q, k, v, dO)
// and allocates its forward outputs (o, lse) and gradients (dq, dk, dv).
func (tb *testBufs) bwdTensors(in bwdInputs) (q, k, v, o, lse, dO, dq, dk, dv DeviceTensor) {
	tb.t.Helper()
	dt := in.q.DType
	q, k, v, dO = tb.upload(in.q), tb.upload(in.k), tb.upload(in.v), tb.upload(in.dO)
	o, lse = tb.alloc(dt, in.p.OutputShape()...), tb.alloc(attn.Float32, in.p.LSEShape()...)
	dq, dk, dv = tb.alloc(dt, in.q.Shape...), tb.alloc(dt, in.k.Shape...), tb.alloc(dt, in.v.Shape...)
	return q, k, v, o, lse, dO, dq, dk, dv
}

// TestBackwardWholeStep enqueues the forward and the backward on one stream
// with no host synchronisation between them, captures both in a CUDA graph,
// replays the graph twice and checks that the replays reproduce the eager
// run bit for bit (deterministic dQ) and that the gradients pass the
// accuracy criterion.
func TestBackwardWholeStep(t *testing.T) {
	b := fwdBackend(t)
	dev := b.Device()
	s := testStream(t, dev)
	c := bwdCase{name: "step", b: 2, n: 256, m: 256, h: 4, hkv: 2, dk: 64, dv: 64, causal: true, dropout: 0.1, deterministic: true}
	in := c.inputs(t, attn.BFloat16, 21)
	q, k, v, o, lse, dO, dq, dk, dv := newTestBufs(t, b).bwdTensors(in)
	fopt := DeviceOptions{Options: in.opt}
	bopt := BackwardOptions{DeviceOptions: fopt}
	algo, wsBytes, err := b.PrepareBackward(q, k, v, o, lse, dO, dq, dk, dv, bopt)
	if err != nil {
		t.Fatalf("PrepareBackward: %v", err)
	}
	if algo != DQSeparate {
		t.Fatalf("deterministic problem got dQ algorithm %v", algo)
	}
	ws, err := dev.Alloc(wsBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Free()
	bopt.Workspace = ws
	step := func() {
		if err := b.ForwardDevice(s, q, k, v, o, lse, fopt); err != nil {
			t.Fatalf("ForwardDevice: %v", err)
		}
		if _, err := b.BackwardDevice(s, q, k, v, o, lse, dO, dq, dk, dv, bopt); err != nil {
			t.Fatalf("BackwardDevice: %v", err)
		}
	}
	read := func() [3][]byte {
		var out [3][]byte
		for i, x := range []DeviceTensor{dq, dk, dv} {
			out[i] = make([]byte, x.NumElements()*2)
			if err := dev.CopyFromDevice(out[i], x.Buf, 0); err != nil {
				t.Fatal(err)
			}
		}
		return out
	}
	poison := func() {
		for _, x := range []DeviceTensor{o, lse, dq, dk, dv} {
			if err := dev.Memset8(x.Buf, bwdPoison); err != nil {
				t.Fatal(err)
			}
		}
	}
	step() // eager (compiles the forward)
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	eager := read()
	ref, naive := in.oracles(t)
	checkGrad(t, "dQ", attn.BFloat16, tensorFromBytes(attn.BFloat16, eager[0], in.q.Shape), ref.DQ, naive.DQ)
	checkGrad(t, "dK", attn.BFloat16, tensorFromBytes(attn.BFloat16, eager[1], in.k.Shape), ref.DK, naive.DK)
	checkGrad(t, "dV", attn.BFloat16, tensorFromBytes(attn.BFloat16, eager[2], in.v.Shape), ref.DV, naive.DV)
	graph := captureGraph(t, s, step)
	defer graph.Close()
	checkReplays(t, s, graph, 2, poison, func() [][]byte { r := read(); return r[:] }, eager[:])
}

// bwdPrewarm compiles variants concurrently (NVRTC is thread-safe), so
// that a test's first calls do not compile one variant after another.
func bwdPrewarm(t testing.TB, dev *cuda.Device, vs []kernels.BwdVariant) {
	t.Helper()
	start := time.Now()
	seen := map[string]bool{}
	var uniq []kernels.BwdVariant
	for _, v := range vs {
		if !seen[v.Name()] {
			seen[v.Name()] = true
			uniq = append(uniq, v)
		}
	}
	b := bwdTestBackend(t, dev)
	errs := make([]error, len(uniq))
	sem := make(chan struct{}, max(1, runtime.NumCPU()))
	var wg sync.WaitGroup
	for i, v := range uniq {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			_, errs[i] = b.module(bwdModuleSpec(v))
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("compile %s: %v", uniq[i].Name(), err)
		}
	}
	hopper := 0
	for _, v := range uniq {
		if v.WGMMA {
			hopper++
		}
	}
	t.Logf("compiled %d backward variants (%d with the Hopper kernels) in %.1fs", len(uniq), hopper, time.Since(start).Seconds())
}

// variant returns the kernel variant a backward of in with algo uses
// (device buffers from cuMemAlloc are 256-byte aligned).
func (in bwdInputs) variant(t testing.TB, algo DQAlgorithm, hopper bool) kernels.BwdVariant {
	t.Helper()
	return in.plan(t, algo, hopper).v
}

// backendVariant is variant as the test backend b plans it
// (bwdTestRequest: its pipeline, bulk dQ, key rows and deep kernels), on
// in's fake views.
func (in bwdInputs) backendVariant(t testing.TB, b *Backend, algo DQAlgorithm) kernels.BwdVariant {
	t.Helper()
	pl, err := planBackward(bwdTestRequest(b, in.p, in.q.DType, in.request(algo).a, algo))
	if err != nil {
		t.Fatalf("plan: %v", err)
	}
	return pl.v
}

// plan returns the launch plan of a backward of in with algo on fake,
// 256-byte aligned device buffers.
func (in bwdInputs) plan(t testing.TB, algo DQAlgorithm, hopper bool) *bwdPlan {
	t.Helper()
	pl, err := in.tryPlan(algo, hopper)
	if err != nil {
		t.Fatalf("plan: %v", err)
	}
	return pl
}

// TestBackwardPlanTMA checks where the backward's Hopper kernels take
// tensor-map loads (16-bit batches, fixed-length or packed, direct or
// staged, unless FLASHATTN_NO_TMA is set) and the tensors of their maps: q
// and dO for the dK/dV kernel, k and v for the dQ kernel, or their staging
// copies; a packed batch's maps span its packed rows (batch extent 1).
func TestBackwardPlanTMA(t *testing.T) {
	cases := []struct {
		name   string
		c      bwdCase
		dt     attn.DType
		noTMA  string
		want   bool
		staged bool
	}{
		{"bf16 d64 gqa", bwdCase{b: 2, n: 300, m: 200, h: 8, hkv: 2, dk: 64, dv: 64}, attn.BFloat16, "", true, false},
		{"fp16 d199 staged", bwdCase{b: 1, n: 100, m: 90, h: 3, hkv: 1, dk: 199, dv: 199}, attn.Float16, "", true, true},
		{"bf16 d128 opted out", bwdCase{b: 1, n: 100, m: 90, h: 2, hkv: 2, dk: 128, dv: 128}, attn.BFloat16, "1", false, false},
		{"bf16 d64 packed", bwdCase{h: 2, hkv: 1, dk: 64, dv: 64, cuQ: []int32{0, 50, 120}, cuK: []int32{0, 40, 100}}, attn.BFloat16, "", true, false},
		{"fp16 d59 packed staged", bwdCase{h: 2, hkv: 2, dk: 59, dv: 59, cuQ: []int32{0, 50, 120}, cuK: []int32{0, 40, 100}}, attn.Float16, "", true, true},
		{"fp32 d64", bwdCase{b: 1, n: 100, m: 90, h: 2, hkv: 2, dk: 64, dv: 64}, attn.Float32, "", false, false},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(EnvNoTMA, c.noTMA)
			in := c.c.inputs(t, c.dt, uint64(40+i))
			for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
				pl := in.plan(t, algo, true)
				if pl.v.TMA != c.want || (len(pl.tma) == 4) != c.want {
					t.Fatalf("%v: variant %s, %d tensors; want tensor maps %v", algo, pl.v.Name(), len(pl.tma), c.want)
				}
				if !c.want {
					continue
				}
				q, do, k, v := pl.params.Q, pl.params.DO, pl.params.K, pl.params.V
				if c.staged {
					q, do, k, v = pl.params.PQ, pl.params.PDO, pl.params.PK, pl.params.PV
				}
				for j, addr := range []uint64{q, do, k, v} {
					if pl.tma[j].Addr != addr || tensorMapSpec(pl.tma[j]).Check() != nil {
						t.Errorf("%v: %s map %+v, want the tensor at %#x", algo, bwdTMANames[j], pl.tma[j], addr)
					}
				}
				rows, krows, batch := in.p.N, in.p.M, in.p.B
				if in.p.Varlen {
					rows, krows, batch = in.p.TotalQ, in.p.TotalK, 1
				}
				if pl.tma[0].Heads != uint64(in.p.H) || pl.tma[2].Heads != uint64(in.p.Hkv) || pl.tma[0].Rows != uint64(rows) || pl.tma[3].Rows != uint64(krows) ||
					pl.tma[0].B != uint64(batch) || pl.tma[3].B != uint64(batch) {
					t.Errorf("%v: extents q %+v, v %+v", algo, pl.tma[0], pl.tma[3])
				}
			}
		})
	}
}

// bwdCrossDims are the head dims of the cross-product tests: DK ≠ DV in
// both directions, a small dim against a large one. DK = 8 with DV = 100
// found an atomic dQ accumulator narrower than the columns the Flat Hopper
// kernel adds into (K's shift within the 16-padded width).
var bwdCrossDims = [][2]int{{8, 100}, {100, 8}, {16, 200}, {200, 16}}

// bwdMaskKind is one kind of mask of the cross-product tests.
type bwdMaskKind struct {
	name   string
	causal bool
	align  attn.Align
	window *attn.Window
}

// bwdMaskKinds are every kind of mask: none, causal under both
// alignments, and a window with both sides bounded.
var bwdMaskKinds = []bwdMaskKind{
	{name: "nomask"},
	{name: "causal-tl", causal: true, align: attn.AlignTopLeft},
	{name: "causal-br", causal: true, align: attn.AlignBottomRight},
	{name: "window", window: &attn.Window{Left: 40, Right: 9}},
}

// bwdCrossCases returns the cross product of bwdCrossDims and
// bwdMaskKinds on n queries over m keys (two heads, one query head per key
// head, so that odd dims take the Flat kernels), each case with the dtypes
// dts(dims index, mask index). Cases whose dims the Flat Hopper kernels
// read in place are named "flat-…".
func bwdCrossCases(n, m int, dts func(di, mi int) []attn.DType) []bwdCase {
	var cs []bwdCase
	for di, d := range bwdCrossDims {
		for mi, mk := range bwdMaskKinds {
			name := fmt.Sprintf("d%d-%d-%s-%dx%d", d[0], d[1], mk.name, n, m)
			if kernels.BwdNeedsStaging(attn.BFloat16, d[0], d[1]) && kernels.FlatFits(d[0], d[1]) {
				name = "flat-" + name
			}
			cs = append(cs, bwdCase{name: name, b: 1, n: n, m: m, h: 2, hkv: 2, dk: d[0], dv: d[1],
				causal: mk.causal, align: mk.align, window: mk.window, dtypes: dts(di, mi)})
		}
	}
	return cs
}

// bwdFamily is a kernel family the backward planner can pick, and the
// environment under which it picks it on an H200.
type bwdFamily struct {
	name           string
	noWGMMA, noTMA string // EnvNoWGMMA, EnvNoTMA
	hopper, tma    bool   // the plan's kernels: BwdVariant.WGMMA, BwdVariant.TMA
}

// bwdFamilies are the Hopper kernels with tiles by tensor maps (Flat for
// odd dims) and by cp.async, and the mma.sync kernels. The Hopper kernels
// take only some head dims (bwdHopperDims); the planner picks the mma.sync
// kernels for the others.
var bwdFamilies = []bwdFamily{
	{name: "hopper-tma", hopper: true, tma: true},
	{name: "hopper-cp.async", noTMA: "1", hopper: true},
	{name: "mma.sync", noWGMMA: "1"},
}

// forBwdFamilies runs f as one subtest per kernel family of bwdFamilies,
// with the environment that makes the planner pick it; the Hopper families
// skip where those kernels do not run.
func forBwdFamilies(t *testing.T, dev *cuda.Device, f func(t *testing.T, fam bwdFamily)) {
	for _, fam := range bwdFamilies {
		t.Run(fam.name, func(t *testing.T) {
			t.Setenv(EnvNoWGMMA, fam.noWGMMA)
			t.Setenv(EnvNoTMA, fam.noTMA)
			if fam.hopper && !hopperCapable(dev) {
				t.Skip("the Hopper kernels do not run on this device")
			}
			f(t, fam)
		})
	}
}

// TestBackwardGradientsCross checks the gradients of the cross product
// DK ≠ DV (both directions, small against large) × every mask kind × fp16
// and bf16 × both dQ algorithms, on every kernel family the planner can
// pick, at the shapes of issue 20's report (N = M = 128; N = 113, M = 300).
func TestBackwardGradientsCross(t *testing.T) {
	dev, s := bwdTestDevice(t)
	both := func(int, int) []attn.DType { return []attn.DType{attn.BFloat16, attn.Float16} }
	cases := append(bwdCrossCases(128, 128, both), bwdCrossCases(113, 300, both)...)
	forBwdFamilies(t, dev, func(t *testing.T, fam bwdFamily) {
		var items []bwdItem
		var vs []kernels.BwdVariant
		for ci, c := range cases {
			for _, dt := range c.dtypes {
				if fam.hopper && !bwdHopperDims(dt, c.dk, c.dv) {
					continue // the planner picks the mma.sync kernels
				}
				in := c.inputs(t, dt, uint64(300+ci))
				items = append(items, newBwdItem(c, dt, in))
				for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
					v := in.variant(t, algo, fam.hopper)
					if v.WGMMA != fam.hopper || v.TMA != fam.tma {
						t.Fatalf("%s %v %v: plan %s is not of the family", c.name, dt, algo, v.Name())
					}
					vs = append(vs, v)
				}
			}
		}
		bwdPrewarm(t, dev, vs)
		bwdCheckItems(t, dev, s, items)
	})
}

// bwdHopperDims reports whether the Hopper backward kernels take head dims
// dk, dv in dt (kernels.BwdHopperOK) and a new backend lets them (those
// past 256 unless EnvBwdDeep keeps them off), so that the planner picks
// them on an H200.
func bwdHopperDims(dt attn.DType, dk, dv int) bool {
	return bwdHopperTakes(dt, dk, dv) && (envBwdDeep() || max(dk, dv) <= 256)
}

// bwdHopperTakes reports whether the Hopper backward kernels take head dims
// dk, dv in dt (kernels.BwdHopperOK), those past 256 included: the
// emulator's families, whose requests allow them.
func bwdHopperTakes(dt attn.DType, dk, dv int) bool {
	return kernels.BwdHopperOK(kernels.BwdVariant{DType: dt, DK: dk, DV: dv, Vector: true, WGMMA: true})
}

// naiveF32Backward returns dQ, dK and dV of a fixed-length problem without
// softcap, bias or dropout as a framework's unfused attention computes them
// in float32 (PyTorch's math path): S = Q·Kᵀ, dP = dO·Vᵀ, dV = Pᵀ·dO,
// dQ = dS·K and dK = dSᵀ·Q each accumulated in float32 along its inner
// dimension (one fused multiply-add a term, in order), the softmax in
// float32 from the row maximum, and its gradient P∘(dP − rowsum(P∘dP)).
// cpu.NaiveBackward rounds each dot product once (float64 sums), which no
// float32 kernel can match at D = 256: it is the baseline of the 16-bit
// criterion, this one of fp32's.
func naiveF32Backward(p *attn.Problem, q, k, v, dO attn.Tensor) (dq, dk, dv []float64) {
	f32 := func(x float64) float64 { return float64(float32(x)) }
	fma := func(a, b, c float64) float64 { return f32(math.FMA(a, b, c)) }
	qf, kf, vf, df := q.Float64s(), k.Float64s(), v.Float64s(), dO.Float64s()
	dq, dk, dv = make([]float64, len(qf)), make([]float64, len(kf)), make([]float64, len(vf))
	scale := f32(p.Scale)
	n, m := p.N, p.M
	P, dS := make([]float64, n*m), make([]float64, n*m) // [N, M] of one (batch, head)
	for b := 0; b < p.B; b++ {
		for h := 0; h < p.H; h++ {
			kh := h / p.Group()
			qr := func(i int) []float64 { o := ((b*n+i)*p.H + h) * p.DK; return qf[o : o+p.DK] }
			kr := func(j int) []float64 { o := ((b*m+j)*p.Hkv + kh) * p.DK; return kf[o : o+p.DK] }
			vr := func(j int) []float64 { o := ((b*m+j)*p.Hkv + kh) * p.DV; return vf[o : o+p.DV] }
			dr := func(i int) []float64 { o := ((b*n+i)*p.H + h) * p.DV; return df[o : o+p.DV] }
			clear(P)
			clear(dS)
			for i := 0; i < n; i++ {
				lo, hi := p.KeyRange(i, n, m)
				if lo >= hi {
					continue
				}
				row, ds := P[i*m:(i+1)*m], dS[i*m:(i+1)*m]
				mx := math.Inf(-1)
				for j := lo; j < hi; j++ {
					var s float64
					for d, x := range qr(i) {
						s = fma(x, kr(j)[d], s)
					}
					row[j] = f32(s * scale)
					mx = max(mx, row[j])
				}
				var sum float64
				for j := lo; j < hi; j++ {
					row[j] = f32(math.Exp(f32(row[j] - mx)))
					sum = f32(sum + row[j])
				}
				var delta float64
				for j := lo; j < hi; j++ {
					row[j] = f32(row[j] / sum)
					var dp float64
					for d, x := range dr(i) {
						dp = fma(x, vr(j)[d], dp)
					}
					ds[j] = dp
					delta = fma(row[j], dp, delta)
				}
				for j := lo; j < hi; j++ {
					ds[j] = f32(row[j] * f32(ds[j]-delta))
				}
			}
			for i := 0; i < n; i++ {
				o := ((b*n+i)*p.H + h) * p.DK
				for d := 0; d < p.DK; d++ {
					var s float64
					for j := 0; j < m; j++ {
						s = fma(dS[i*m+j], kr(j)[d], s)
					}
					dq[o+d] = f32(s * scale)
				}
			}
			for j := 0; j < m; j++ {
				ok, ov := ((b*m+j)*p.Hkv+kh)*p.DK, ((b*m+j)*p.Hkv+kh)*p.DV
				for d := 0; d < p.DK; d++ {
					var s float64
					for i := 0; i < n; i++ {
						s = fma(dS[i*m+j], qr(i)[d], s)
					}
					dk[ok+d] = f32(dk[ok+d] + f32(s*scale)) // the group's heads, one after another
				}
				for d := 0; d < p.DV; d++ {
					var s float64
					for i := 0; i < n; i++ {
						s = fma(P[i*m+j], dr(i)[d], s)
					}
					dv[ov+d] = f32(dv[ov+d] + s)
				}
			}
		}
	}
	return dq, dk, dv
}

// TestBackwardFP32LargeScale checks fp32 gradients at head dims 160, 192
// and 256 with a logit scale of 0.3 (peaked softmax rows, scores up to
// about ±40) against FlashAttention's criterion with the float32 baseline
// of naiveF32Backward (checkF32Criterion), with O and the LSE from this
// backend's forward, as a training step has them. The backward
// recomputes P from that LSE, so a score it computes otherwise than the
// forward did moves P by the difference times the scale, and its Delta =
// rowsum(dO∘O) takes the forward's O: the fp32 forward chained its
// split-tf32 products through the tensor cores' truncating accumulators
// (S differed from the backward's, which rounds each k step's sum into its
// own, and O drifted toward zero over the keys), and dQ, dK and dV came out
// 5–16× the baseline's error. Over 1024 keys (16 key blocks) the forward's
// LSE drifted by the online softmax's rescale factor, fused by the compiler
// into 2^(rounding error of max·SC) ≠ 1 for every block whose row maximum
// held: dV at 3.8–5× the baseline's error.
func TestBackwardFP32LargeScale(t *testing.T) {
	fb := fwdBackend(t)
	dev, s := bwdTestDevice(t)
	for _, d := range []int{160, 192, 256} {
		for ci, c := range []bwdCase{
			{name: fmt.Sprintf("d%d-256x256", d), b: 1, n: 256, m: 256, h: 2, hkv: 2, dk: d, dv: d, scale: 0.3},
			{name: fmt.Sprintf("d%d-200x300-causal-gqa", d), b: 1, n: 200, m: 300, h: 4, hkv: 2, dk: d, dv: d, scale: 0.3, causal: true},
			{name: fmt.Sprintf("d%d-64x1024", d), b: 1, n: 64, m: 1024, h: 2, hkv: 2, dk: d, dv: d, scale: 0.3},
		} {
			in := c.inputs(t, attn.Float32, uint64(1000+10*d+ci))
			res, err := fb.Forward(in.q, in.k, in.v, in.opt)
			if err != nil {
				t.Fatalf("%s: forward: %v", c.name, err)
			}
			in.o, in.lse = res.O, res.LSE
			ref, err := cpu.ReferenceBackward(in.q, in.k, in.v, in.dO, in.opt)
			if err != nil {
				t.Fatalf("%s: reference: %v", c.name, err)
			}
			var naive [3][]float64
			naive[0], naive[1], naive[2] = naiveF32Backward(in.p, in.q, in.k, in.v, in.dO)
			for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
				t.Run(fmt.Sprintf("%s/%v", c.name, algo), func(t *testing.T) {
					checkF32Criterion(t, bwdRun(t, dev, s, in, algo), ref, naive)
				})
			}
		}
	}
}

// checkF32Criterion checks fp32 gradients g against FlashAttention's
// criterion with the float32 baseline naive (naiveF32Backward's dQ, dK,
// dV): err ≤ 3·naive + u·s, u = 2⁻²⁴, s = max(1, max|ref|). It logs each
// error and its ratio to the baseline's. (At a logit scale of 0.3 the
// baseline itself nears the 1e-5·s bound the other fp32 tests hold outputs
// to: 9e-6·s over 1024 keys at D = 160.)
func checkF32Criterion(t *testing.T, g attn.Gradients, ref *cpu.RefGrads, naive [3][]float64) {
	t.Helper()
	u := conformance.UnitRoundoff(attn.Float32)
	for i, x := range []struct {
		name string
		got  attn.Tensor
		ref  []float64
	}{{"dQ", g.DQ, ref.DQ}, {"dK", g.DK, ref.DK}, {"dV", g.DV, ref.DV}} {
		e, _, sc := maxErr(x.got.Float64s(), x.ref)
		en, _, _ := maxErr(naive[i], x.ref)
		t.Logf("%s: error %.3g, naive fp32 %.3g (%.2fx), scale %.3g", x.name, e, en, e/en, sc)
		if !(e <= 3*en+u*sc) {
			t.Errorf("%s: error %.3g > 3 x naive fp32 %.3g + u·s (s = %.3g)", x.name, e, en, sc)
		}
	}
}

// maxErr returns the largest |got − ref|, where it is, and s = max(1,
// max|ref|); a NaN in got is an infinite error.
func maxErr(got, ref []float64) (e float64, at int, s float64) {
	s, at = 1, -1
	for i := range ref {
		d := math.Abs(got[i] - ref[i])
		if math.IsNaN(d) {
			d = math.Inf(1)
		}
		if d > e || at < 0 {
			e, at = d, i
		}
		s = max(s, math.Abs(ref[i]))
	}
	return e, at, s
}

// dropoutMaskInputs returns a backward problem whose gradients expose the
// dropout keep mask element by element: b = 2 sequences of n queries over
// m keys, h heads (no GQA), dropout 0.3, q = 0 (every visible P = 1/m),
// K the identity (DK = m: key j is e_j), every value e_0 and
// dO_i = e_0 + e_{i+1} (DV = n + 1). Then dV[j, i + 1] = keep(i, j)·256/(T·m)
// (the dK/dV kernel's dropped P), and dS_ij = (keep(i, j)·256/T − Δ_i)/m with
// Δ_i = O_i[0] = (kept keys of row i)·256/(T·m), so dQ[i, j] = scale·dS_ij is
// positive where key j is kept and negative where it is dropped (for a row
// that keeps some keys and drops others). O and the LSE come from
// cpu.Reference.
func dropoutMaskInputs(t testing.TB, dt attn.DType, h, n, m int) bwdInputs {
	t.Helper()
	var in bwdInputs
	in.opt = attn.Options{Dropout: 0.3, Seed: 0x0ddba11_5eed, Offset: 5}
	in.q = attn.New(dt, 2, n, h, m)
	in.k = attn.New(dt, 2, m, h, m)
	in.v = attn.New(dt, 2, m, h, n+1)
	in.dO = attn.New(dt, 2, n, h, n+1)
	for b := 0; b < 2; b++ {
		for hh := 0; hh < h; hh++ {
			for j := 0; j < m; j++ {
				in.k.Set(1, b, j, hh, j)
				in.v.Set(1, b, j, hh, 0)
			}
			for i := 0; i < n; i++ {
				in.dO.Set(1, b, i, hh, 0)
				in.dO.Set(1, b, i, hh, i+1)
			}
		}
	}
	in.forward(t)
	return in
}

// checkBackwardKeepMask compares the keep mask that g (the gradients of
// dropoutMaskInputs) exposes through dV (the dK/dV kernel's P) and the
// sign of dQ (dS, in whichever kernel computes dQ) with package philox bit
// for bit, then the gradients with the oracle.
func checkBackwardKeepMask(t *testing.T, in bwdInputs, g attn.Gradients) {
	t.Helper()
	p := in.p
	bad := 0
	for b := 0; b < p.B; b++ {
		for h := 0; h < p.H; h++ {
			mask := philox.NewMask(in.opt.Seed, in.opt.Offset, p.DropThreshold, b, h, p.H)
			for i := 0; i < p.N; i++ {
				kept := 0
				for j := 0; j < p.M; j++ {
					if mask.Keep(i, j) {
						kept++
					}
				}
				mixed := kept > 0 && kept < p.M
				for j := 0; j < p.M; j++ {
					want := mask.Keep(i, j)
					dv, dq := g.DV.At(b, j, h, i+1), g.DQ.At(b, i, h, j)
					if (dv != 0) != want || mixed && (dq > 0) != want {
						if bad < 5 {
							t.Errorf("batch %d head %d (i %d, j %d): dV = %v, dQ = %v, keep = %v", b, h, i, j, dv, dq, want)
						}
						bad++
					}
				}
			}
		}
	}
	if bad > 0 {
		t.Fatalf("%d keep decisions of the backward differ from philox", bad)
	}
	ref, naive := in.oracles(t)
	checkGrads(t, in.q.DType, g, ref, naive)
}

// TestDropoutKeepMaskBackward reads the backward kernels' keep mask back
// through dV and dQ (dropoutMaskInputs) on every kernel family, with both
// dQ algorithms, and compares it with package philox bit for bit.
func TestDropoutKeepMaskBackward(t *testing.T) {
	dev, s := bwdTestDevice(t)
	forBwdFamilies(t, dev, func(t *testing.T, fam bwdFamily) {
		for _, dt := range []attn.DType{attn.BFloat16, attn.Float16, attn.Float32} {
			const h, n, m = 2, 127, 200
			if fam.hopper && !bwdHopperDims(dt, m, n+1) {
				continue
			}
			in := dropoutMaskInputs(t, dt, h, n, m)
			for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
				t.Run(fmt.Sprintf("%v/%v", dt, algo), func(t *testing.T) {
					checkBackwardKeepMask(t, in, bwdRun(t, dev, s, in, algo))
				})
			}
		}
	})
}

// TestBackwardPersistent checks the persistent dK/dV kernel
// (EnvBwdPersistent) against the kernels of one key tile a CTA, with both
// dQ algorithms, on shapes of more key tiles than the device has
// multiprocessors (so that CTAs take several tiles and carry their stages
// and barrier phases from one to the next): dK and dV bit for bit (each
// tile's arithmetic is the same), dQ within one unit in the last place of
// the dtype relative to its scale (the atomic algorithm's reduce-adds come
// in another order; the separate dQ kernel is the same kernel).
func TestBackwardPersistent(t *testing.T) {
	dev, s := bwdTestDevice(t)
	if !hopperCapable(dev) {
		t.Skip("the persistent dK/dV kernel is a Hopper kernel")
	}
	sms := dev.SMCount()
	cases := []bwdCase{
		{name: "d128", b: 3, n: 384, m: 384, h: 16, hkv: 16, dk: 128, dv: 128},
		{name: "d128-causal-br-gqa", b: 5, n: 400, m: 430, h: 16, hkv: 8, dk: 128, dv: 128, causal: true, align: attn.AlignBottomRight},
		{name: "d64-q128", b: 3, n: 384, m: 384, h: 16, hkv: 16, dk: 64, dv: 64},
		{name: "d128-dropout-causal", b: 3, n: 384, m: 384, h: 16, hkv: 16, dk: 128, dv: 128, causal: true, dropout: 0.1},
	}
	u := conformance.UnitRoundoff(attn.BFloat16)
	for ci, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if tiles := (c.m + 127) / 128 * c.b * c.hkv; tiles <= sms {
				t.Fatalf("%d key tiles on %d multiprocessors: every CTA would take one", tiles, sms)
			}
			in := c.inputs(t, attn.BFloat16, uint64(ci+40))
			// the key-rows step (the persistent kernel's) with the bulk dQ, as the default takes it from 512 queries
			t.Setenv(EnvBwdKeyRows, "1")
			t.Setenv(EnvBulkDQ, "1")
			if c.dk <= 64 {
				t.Setenv(EnvBwdQueryStep, "128") // (the atomic dQ's rows split between the warpgroups)
			}
			for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
				t.Setenv(EnvBwdPersistent, "")
				base := bwdRun(t, dev, s, in, algo)
				t.Setenv(EnvBwdPersistent, "1")
				var planned kernels.BwdVariant
				bwdPlanned = func(v kernels.BwdVariant) { planned = v }
				got := bwdRun(t, dev, s, in, algo)
				bwdPlanned = nil
				if !planned.Persistent {
					t.Fatalf("%v: %s is not persistent", algo, planned.Name())
				}
				for _, x := range []struct {
					name string
					a, b attn.Tensor
				}{{"dK", base.DK, got.DK}, {"dV", base.DV, got.DV}} {
					if !bytes.Equal(x.a.Bytes(), x.b.Bytes()) {
						t.Errorf("%v: %s differs from the kernels of one tile a CTA", algo, x.name)
					}
				}
				a, b := base.DQ.Float64s(), got.DQ.Float64s()
				scale := 0.0
				for _, x := range a {
					scale = max(scale, math.Abs(x))
				}
				for i := range a {
					if d := math.Abs(a[i] - b[i]); !(d <= 2*u*scale) {
						t.Fatalf("%v: dQ[%d] = %g, the kernels of one tile a CTA %g (scale %g)", algo, i, b[i], a[i], scale)
					}
				}
				t.Logf("%v: %s, dK and dV identical, dQ within %g", algo, planned.Name(), 2*u*scale)
			}
		})
	}
}
