package gpu

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/conformance"
	"github.com/flashattn/flashattn/cpu"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
	"github.com/flashattn/flashattn/philox"
)

var (
	testOnce sync.Once
	testB    *Backend
	testErr  error
)

// fwdBackend returns the shared test backend, or skips when there is no GPU.
func fwdBackend(t *testing.T) *Backend {
	t.Helper()
	testOnce.Do(func() { testB, testErr = Open() })
	if testErr != nil {
		if cuda.Unavailable(testErr) {
			t.Skipf("no GPU: %v", testErr)
		}
		t.Fatalf("Open: %v", testErr)
	}
	return testB
}

func TestMain(m *testing.M) {
	code := m.Run()
	if testB != nil {
		fmt.Println("compiled kernels (NVRTC time, load time, cache hit, registers, stack, spills):")
		for _, s := range testB.KernelStats() {
			fmt.Printf("  %-110s %7.2fs %6.3fs %-5v %3d %4d %4d %v\n", s.Name, s.CompileTime.Seconds(), s.LoadTime.Seconds(),
				s.CacheHit, s.Registers, s.StackBytes, s.SpillBytes, errString(s.Err))
		}
		testB.Close()
	}
	os.Exit(code)
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// TestOpen checks that Open either works or says there is no GPU.
func TestOpen(t *testing.T) {
	b, err := Open()
	if err != nil {
		if !errors.Is(err, cuda.ErrNoDriver) && !errors.Is(err, cuda.ErrNoDevice) {
			t.Fatalf("Open without a usable GPU: %v, want an error wrapping cuda.ErrNoDriver or ErrNoDevice", err)
		}
		t.Skipf("no GPU: %v", err)
	}
	defer b.Close()
	if b.Name() != "cuda" {
		t.Errorf("Name = %q", b.Name())
	}
	var _ attn.Backend = b
}

func TestConformance(t *testing.T) {
	b := fwdBackend(t)
	conformance.Run(t, b, conformance.Config{AllowUnsupported: true, Short: testing.Short()})
}

// fwdRand returns a contiguous tensor of normal values times sd.
func fwdRand(r *rand.Rand, dt attn.DType, sd float64, shape ...int) attn.Tensor {
	x := make([]float32, attn.NumElements(shape))
	for i := range x {
		x[i] = float32(r.NormFloat64() * sd)
	}
	return attn.FromFloat32(dt, x, shape...)
}

// fwdProblem is one attention problem of the GPU-specific tests.
type fwdProblem struct {
	name        string
	dt          attn.DType
	b, n, m     int
	h, hkv      int
	dk, dv      int
	segQ, segK  []int // packed batch segment lengths
	opt         attn.Options
	biasB, bias int        // bias [biasB, biasH, N, M] when bias > 0 (biasH)
	biasDT      attn.DType // the bias's dtype (0: dt)
}

// inputs returns the tensors and options of pr.
func (pr fwdProblem) inputs(seed uint64) (q, k, v attn.Tensor, opt attn.Options) {
	r := rand.New(rand.NewPCG(seed, 7))
	opt = pr.opt
	if pr.segQ != nil {
		tq, tk := 0, 0
		cq, ck := []int32{0}, []int32{0}
		for i := range pr.segQ {
			tq += pr.segQ[i]
			tk += pr.segK[i]
			cq, ck = append(cq, int32(tq)), append(ck, int32(tk))
		}
		opt.CuSeqlensQ, opt.CuSeqlensK = cq, ck
		return fwdRand(r, pr.dt, 1, tq, pr.h, pr.dk), fwdRand(r, pr.dt, 1, tk, pr.hkv, pr.dk),
			fwdRand(r, pr.dt, 1, tk, pr.hkv, pr.dv), opt
	}
	q = fwdRand(r, pr.dt, 1, pr.b, pr.n, pr.h, pr.dk)
	k = fwdRand(r, pr.dt, 1, pr.b, pr.m, pr.hkv, pr.dk)
	v = fwdRand(r, pr.dt, 1, pr.b, pr.m, pr.hkv, pr.dv)
	if pr.bias > 0 {
		bdt := pr.dt
		if pr.biasDT != 0 {
			bdt = pr.biasDT
		}
		opt.Bias = &attn.Bias{Tensor: fwdRand(r, bdt, 1, pr.biasB, pr.bias, pr.n, pr.m)}
	}
	return q, k, v, opt
}

// fwdCheck applies the accuracy criterion (error at most twice that of
// the naive computation in storage precision, plus one unit roundoff; fp32:
// 1e-5 relative) to a forward result against the float64 oracle.
func fwdCheck(t *testing.T, dt attn.DType, q, k, v attn.Tensor, opt attn.Options, res attn.Result) {
	t.Helper()
	ref, err := cpu.Reference(q, k, v, opt)
	if err != nil {
		t.Fatalf("Reference: %v", err)
	}
	o, lse := res.O.Float64s(), res.LSE.Float64s()
	e, at, mag := conformance.MaxError(o, ref.O)
	var bound float64
	var naive *cpu.RefOutput
	if dt == attn.Float32 {
		bound = 1e-5 * max(mag, 1)
	} else {
		if naive, err = cpu.NaiveForward(dt, q, k, v, opt); err != nil {
			t.Fatalf("NaiveForward: %v", err)
		}
		ne, _, _ := conformance.MaxError(naive.O, ref.O)
		bound = 2*ne + conformance.UnitRoundoff(dt)*max(mag, 1)
	}
	if !(e <= bound) {
		t.Errorf("O: max error %.3g at %d (got %v, oracle %v) exceeds %.3g", e, at, o[at], ref.O[at], bound)
	} else {
		t.Logf("O: max error %.3g, bound %.3g", e, bound)
	}
	for i := range ref.LSE {
		if math.IsInf(ref.LSE[i], -1) != math.IsInf(lse[i], -1) {
			t.Fatalf("LSE[%d] = %v, oracle %v", i, lse[i], ref.LSE[i])
		}
		if math.IsInf(ref.LSE[i], -1) {
			continue
		}
		b := 1e-5 * max(1, math.Abs(ref.LSE[i]))
		if naive != nil {
			b = max(b, 2*math.Abs(naive.LSE[i]-ref.LSE[i])+conformance.UnitRoundoff(dt))
		}
		if d := math.Abs(lse[i] - ref.LSE[i]); !(d <= b) {
			t.Fatalf("LSE[%d] = %v, oracle %v: error %.3g exceeds %.3g", i, lse[i], ref.LSE[i], d, b)
		}
	}
}

// TestShapes runs shapes that have broken kernels before (GUIDE.md) against
// the float64 oracle, beyond what the conformance suite covers.
func TestShapes(t *testing.T) {
	b := fwdBackend(t)
	tl := attn.AlignTopLeft
	cases := []fwdProblem{
		{name: "seq4224-causal-bf16", dt: attn.BFloat16, b: 1, n: 4224, m: 4224, h: 1, hkv: 1, dk: 32, dv: 32, opt: attn.Options{Causal: true}},
		{name: "d199-1023x1024-fp16", dt: attn.Float16, b: 1, n: 1023, m: 1024, h: 2, hkv: 2, dk: 199, dv: 199},
		{name: "dk257-dv64-causal-top-left", dt: attn.BFloat16, b: 1, n: 200, m: 300, h: 2, hkv: 1, dk: 257, dv: 64, opt: attn.Options{Causal: true, Align: tl}},
		{name: "d111-gqa8-window", dt: attn.Float16, b: 1, n: 333, m: 333, h: 8, hkv: 1, dk: 111, dv: 111, opt: attn.Options{Window: &attn.Window{Left: 50, Right: 20}}},
		{name: "d127-gqa6:2-n>m", dt: attn.BFloat16, b: 2, n: 203, m: 113, h: 6, hkv: 2, dk: 127, dv: 127, opt: attn.Options{Causal: true}},
		{name: "d320-fp32", dt: attn.Float32, b: 1, n: 130, m: 170, h: 2, hkv: 1, dk: 320, dv: 320},
		{name: "d384-varlen-bf16", dt: attn.BFloat16, h: 2, hkv: 2, dk: 384, dv: 384, segQ: []int{129, 0, 300, 1}, segK: []int{64, 5, 300, 0}, opt: attn.Options{Causal: true}},
		{name: "d512-causal-fp16", dt: attn.Float16, b: 1, n: 257, m: 257, h: 2, hkv: 2, dk: 512, dv: 512, opt: attn.Options{Causal: true}},
		{name: "d512-fp32-window", dt: attn.Float32, b: 1, n: 100, m: 90, h: 1, hkv: 1, dk: 512, dv: 512, opt: attn.Options{Window: &attn.Window{Left: 30, Right: 3}}},
		{name: "d448-bf16-bias-softcap-window", dt: attn.BFloat16, b: 1, n: 200, m: 230, h: 2, hkv: 1, dk: 448, dv: 448, opt: attn.Options{Softcap: 8, Window: &attn.Window{Left: 40, Right: 7}}, biasB: 1, bias: 2},
		{name: "d352-fp16-dropout-gqa-causal", dt: attn.Float16, b: 2, n: 97, m: 150, h: 4, hkv: 2, dk: 352, dv: 352, opt: attn.Options{Causal: true, Dropout: 0.3, Seed: 5}},
		{name: "dk384-dv512-causal-top-left", dt: attn.BFloat16, b: 1, n: 150, m: 260, h: 2, hkv: 2, dk: 384, dv: 512, opt: attn.Options{Causal: true, Align: tl}},
		{name: "d59-fp32-bias-softcap", dt: attn.Float32, b: 2, n: 77, m: 91, h: 2, hkv: 1, dk: 59, dv: 59, opt: attn.Options{Softcap: 4}, biasB: 1, bias: 2},
		// a bias shared by the batch, not by the heads, over three batch elements
		{name: "d128-bf16-bias-1h-b3-n700", dt: attn.BFloat16, b: 3, n: 700, m: 700, h: 2, hkv: 2, dk: 128, dv: 128, biasB: 1, bias: 2},
		{name: "d64-fp16-bias-1h-b3-causal", dt: attn.Float16, b: 3, n: 333, m: 400, h: 4, hkv: 2, dk: 64, dv: 64, opt: attn.Options{Causal: true}, biasB: 1, bias: 4},
		{name: "d128-bf16-bias-n1100-m1104", dt: attn.BFloat16, b: 1, n: 1100, m: 1104, h: 2, hkv: 2, dk: 128, dv: 128, biasB: 1, bias: 2},
		{name: "d128-fp16-bias-softcap-causal", dt: attn.Float16, b: 2, n: 600, m: 640, h: 2, hkv: 1, dk: 128, dv: 128, opt: attn.Options{Softcap: 6, Causal: true}, biasB: 2, bias: 1},
		{name: "d64-fp32bias-m258", dt: attn.BFloat16, b: 1, n: 300, m: 258, h: 2, hkv: 2, dk: 64, dv: 64, biasB: 1, bias: 2, biasDT: attn.Float32},
		{name: "negative-scale", dt: attn.BFloat16, b: 1, n: 100, m: 100, h: 2, hkv: 1, dk: 64, dv: 64, opt: attn.Options{Scale: -0.2}},
		{name: "d1-seq1", dt: attn.Float16, b: 3, n: 1, m: 1, h: 1, hkv: 1, dk: 1, dv: 1},
		{name: "d1-dv512", dt: attn.BFloat16, b: 1, n: 70, m: 40, h: 1, hkv: 1, dk: 1, dv: 512},
		{name: "dropout-d256", dt: attn.BFloat16, b: 1, n: 150, m: 140, h: 2, hkv: 2, dk: 256, dv: 256, opt: attn.Options{Dropout: 0.2, Seed: 77, Offset: 1}},
		{name: "window-all-masked-rows", dt: attn.Float16, b: 1, n: 300, m: 100, h: 1, hkv: 1, dk: 64, dv: 64, opt: attn.Options{Window: &attn.Window{Left: 3, Right: 0}, Align: tl}},
		// persistent CTAs through several tiles each (512 tiles of the short pipeline on at most 132
		// SMs), so that each reuses its Q buffers and barrier phases
		{name: "d128-n512-b8-h16-tiles-per-cta", dt: attn.BFloat16, b: 8, n: 512, m: 512, h: 16, hkv: 16, dk: 128, dv: 128},
		{name: "d128-n1024-b4-h8-causal-tiles-per-cta", dt: attn.BFloat16, b: 4, n: 1024, m: 1024, h: 8, hkv: 8, dk: 128, dv: 128, opt: attn.Options{Causal: true}},
		// plain calls of 1024 and 2048 keys, which take the short pipeline at head dims up to 128
		{name: "d128-n1024-b4-h8-tiles-per-cta", dt: attn.BFloat16, b: 4, n: 1024, m: 1024, h: 8, hkv: 8, dk: 128, dv: 128},
		{name: "d64-n2048-b2-h8-tiles-per-cta", dt: attn.Float16, b: 2, n: 2048, m: 2048, h: 8, hkv: 4, dk: 64, dv: 64},
		// D = 256 on the short pipeline's one Q buffer (512 keys), 256 tiles over at most 132 SMs
		{name: "d256-n512-b8-h8-tiles-per-cta", dt: attn.BFloat16, b: 8, n: 512, m: 512, h: 8, hkv: 8, dk: 256, dv: 256},
	}
	for i, pr := range cases {
		t.Run(pr.name, func(t *testing.T) {
			q, k, v, opt := pr.inputs(uint64(i) + 1)
			res, err := b.Forward(q, k, v, opt)
			if err != nil {
				t.Fatalf("Forward: %v", err)
			}
			fwdCheck(t, pr.dt, q, k, v, opt, res)
		})
	}
}

// fwdDeviceRun uploads the inputs, runs ForwardDevice into NaN-poisoned
// outputs surrounded by guard margins, and returns the outputs; it fails
// the test if a guard byte changed or an output element kept the poison.
func fwdDeviceRun(t *testing.T, b *Backend, q, k, v attn.Tensor, opt attn.Options) attn.Result {
	t.Helper()
	return fwdDeviceRunStaging(t, b, q, k, v, opt, false)
}

// fwdDeviceRunStaging is fwdDeviceRun, with (staging) a NaN-poisoned
// staging workspace of PrepareForward's size passed to ForwardDevice.
func fwdDeviceRunStaging(t *testing.T, b *Backend, q, k, v attn.Tensor, opt attn.Options, staging bool) attn.Result {
	t.Helper()
	return fwdDeviceRunShifted(t, b, q, k, v, opt, staging, 0)
}

// fwdDeviceRunShifted is fwdDeviceRunStaging with O's first element oShift
// elements further into its buffer (odd: rows of 16-bit elements that allow
// no paired stores, nor a tensor map).
func fwdDeviceRunShifted(t *testing.T, b *Backend, q, k, v attn.Tensor, opt attn.Options, staging bool, oShift int64) attn.Result {
	t.Helper()
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		t.Fatalf("NewProblem: %v", err)
	}
	var free []DeviceTensor
	defer func() {
		for _, x := range free {
			x.Free()
		}
	}()
	up := func(x attn.Tensor) DeviceTensor {
		d, err := b.Upload(x)
		if err != nil {
			t.Fatalf("upload: %v", err)
		}
		free = append(free, d)
		return d
	}
	dq, dk, dv := up(q), up(k), up(v)
	dopt := DeviceOptions{Options: opt}
	dopt.Options.Bias = nil
	if opt.Bias != nil {
		db := up(opt.Bias.Tensor)
		dopt.Bias = &db
	}
	if p.Varlen {
		for _, x := range []struct {
			cu  []int32
			dst **cuda.Buffer
		}{{opt.CuSeqlensQ, &dopt.CuSeqlensQ}, {opt.CuSeqlensK, &dopt.CuSeqlensK}} {
			buf, err := b.dev.Alloc(int64(4 * len(x.cu)))
			if err != nil {
				t.Fatal(err)
			}
			free = append(free, DeviceTensor{Buf: buf})
			if err := b.dev.CopyToDevice(buf, 0, cuda.AsBytes(x.cu)); err != nil {
				t.Fatal(err)
			}
			*x.dst = buf
		}
	}
	const guard = 4096 // elements on each side
	guarded := func(dt attn.DType, shape []int, shift int64) (DeviceTensor, int64) {
		n := int64(attn.NumElements(shape))
		buf, err := b.dev.Alloc((n + 2*guard + shift) * int64(dt.Size()))
		if err != nil {
			t.Fatal(err)
		}
		if err := b.dev.Memset8(buf, 0xff); err != nil { // NaN in every dtype
			t.Fatal(err)
		}
		d := DeviceTensor{Buf: buf, Offset: guard + shift, DType: dt, Shape: shape, Strides: attn.ContiguousStrides(shape)}
		free = append(free, d)
		return d, n
	}
	do, no := guarded(q.DType, p.OutputShape(), oShift)
	dl, nl := guarded(attn.Float32, p.LSEShape(), 0)
	if staging {
		need, err := b.PrepareForward(dq, dk, dv, do, dl, dopt)
		if err != nil {
			t.Fatalf("PrepareForward: %v", err)
		}
		if need == 0 {
			t.Fatalf("PrepareForward: no staging for a problem that needs it")
		}
		ws, _ := guarded(attn.Float32, []int{int(need / 4)}, 0)
		dopt.Staging = ws.Buf
		vr, err := b.Variant(dq, dk, dv, do, dl, dopt)
		if err != nil || vr.LoadBytes != 16 {
			t.Fatalf("staged variant: load bytes %d, %v (want 16-byte copies)", vr.LoadBytes, err)
		}
	}
	if err := b.ForwardDevice(b.stream, dq, dk, dv, do, dl, dopt); err != nil {
		t.Fatalf("ForwardDevice: %v", err)
	}
	if err := b.stream.Synchronize(); err != nil {
		t.Fatalf("synchronize: %v", err)
	}
	res := attn.Result{O: attn.New(q.DType, p.OutputShape()...), LSE: attn.New(attn.Float32, p.LSEShape()...)}
	for _, x := range []struct {
		name string
		d    DeviceTensor
		n    int64
		h    attn.Tensor
	}{{"O", do, no, res.O}, {"LSE", dl, nl, res.LSE}} {
		esz := int64(x.d.DType.Size())
		all := make([]byte, (x.n+guard+x.d.Offset)*esz)
		if err := b.dev.CopyFromDevice(all, x.d.Buf, 0); err != nil {
			t.Fatal(err)
		}
		for i, c := range all[:x.d.Offset*esz] {
			if c != 0xff {
				t.Fatalf("%s: guard byte %d before the tensor changed to %#x", x.name, i, c)
			}
		}
		for i, c := range all[(x.d.Offset+x.n)*esz:] {
			if c != 0xff {
				t.Fatalf("%s: guard byte %d after the tensor changed to %#x", x.name, i, c)
			}
		}
		body := all[x.d.Offset*esz : (x.d.Offset+x.n)*esz]
		if x.h.DType == attn.Float32 {
			copy(cuda.AsBytes(x.h.F32), body)
		} else {
			copy(cuda.AsBytes(x.h.Bits), body)
		}
		for i := int64(0); i < x.n; i++ {
			if poisonedAt(x.h, int(i)) {
				t.Fatalf("%s element %d was not written (still the poison)", x.name, i)
			}
		}
	}
	return res
}

// poisonedAt reports whether element e (in storage order) of t still holds
// the all-ones bytes the outputs are poisoned with, a NaN no kernel writes
// (NaN results are 0x7fff, 0x7fffffff on the device; the emulator's have
// other payloads).
func poisonedAt(t attn.Tensor, e int) bool {
	if t.DType == attn.Float32 {
		return math.Float32bits(t.F32[e]) == 0xffffffff
	}
	return t.Bits[e] == 0xffff
}

// TestPoisonGuards runs the device API into NaN-poisoned, guarded outputs:
// every element must be written, no byte outside.
func TestPoisonGuards(t *testing.T) {
	b := fwdBackend(t)
	cases := []fwdProblem{
		{name: "bf16-d64-causal", dt: attn.BFloat16, b: 2, n: 300, m: 200, h: 3, hkv: 1, dk: 64, dv: 64, opt: attn.Options{Causal: true}},
		{name: "fp16-d128-window-rows-masked", dt: attn.Float16, b: 1, n: 257, m: 100, h: 2, hkv: 2, dk: 128, dv: 128, opt: attn.Options{Window: &attn.Window{Left: 2, Right: 1}, Align: attn.AlignTopLeft}},
		{name: "fp32-d59", dt: attn.Float32, b: 1, n: 130, m: 67, h: 2, hkv: 1, dk: 59, dv: 59},
		{name: "bf16-d257-varlen", dt: attn.BFloat16, h: 2, hkv: 1, dk: 257, dv: 257, segQ: []int{0, 130, 5}, segK: []int{9, 0, 70}},
		{name: "fp16-d512-dropout", dt: attn.Float16, b: 1, n: 70, m: 70, h: 2, hkv: 2, dk: 512, dv: 512, opt: attn.Options{Dropout: 0.5, Seed: 3}},
		{name: "bf16-d199-dv111", dt: attn.BFloat16, b: 1, n: 129, m: 129, h: 1, hkv: 1, dk: 199, dv: 111},
	}
	for i, pr := range cases {
		t.Run(pr.name, func(t *testing.T) {
			q, k, v, opt := pr.inputs(uint64(100 + i))
			res := fwdDeviceRun(t, b, q, k, v, opt)
			fwdCheck(t, pr.dt, q, k, v, opt, res)
		})
	}
}

// TestForwardUnalignedOutput runs the device API into an O that starts one
// element past a 4-byte boundary (rows that allow no paired stores, nor a
// tensor map) at shapes whose persistent CTAs take several tiles each: O
// leaves each tile from registers while the next tile's loads land.
func TestForwardUnalignedOutput(t *testing.T) {
	b := fwdBackend(t)
	cases := []fwdProblem{
		{name: "bf16-d128-n512", dt: attn.BFloat16, b: 8, n: 512, m: 512, h: 16, hkv: 16, dk: 128, dv: 128},
		{name: "bf16-d256-n512", dt: attn.BFloat16, b: 8, n: 512, m: 512, h: 8, hkv: 8, dk: 256, dv: 256},
		{name: "fp16-d128-n1024-causal-gqa", dt: attn.Float16, b: 4, n: 1024, m: 1024, h: 8, hkv: 2, dk: 128, dv: 128, opt: attn.Options{Causal: true}},
		{name: "bf16-d64-n2048", dt: attn.BFloat16, b: 2, n: 2048, m: 2048, h: 8, hkv: 8, dk: 64, dv: 64},
	}
	for i, pr := range cases {
		t.Run(pr.name, func(t *testing.T) {
			q, k, v, opt := pr.inputs(uint64(200 + i))
			res := fwdDeviceRunShifted(t, b, q, k, v, opt, false, 1)
			fwdCheck(t, pr.dt, q, k, v, opt, res)
		})
	}
}

// TestForwardStaging runs 16-bit problems whose rows are only 2-byte
// aligned through the staging copies (odd head dims, DK ≠ DV, GQA, packed
// batches with empty segments, masks, dropout), into NaN-poisoned outputs
// and a NaN-poisoned workspace, and checks them against the oracle.
func TestForwardStaging(t *testing.T) {
	b := fwdBackend(t)
	cases := []fwdProblem{
		{name: "bf16-d59", dt: attn.BFloat16, b: 2, n: 300, m: 200, h: 3, hkv: 1, dk: 59, dv: 59, opt: attn.Options{Causal: true}},
		{name: "fp16-d127-window", dt: attn.Float16, b: 1, n: 257, m: 190, h: 2, hkv: 2, dk: 127, dv: 127, opt: attn.Options{Window: &attn.Window{Left: 20, Right: 3}}},
		{name: "bf16-d199-dv111-varlen", dt: attn.BFloat16, h: 4, hkv: 2, dk: 199, dv: 111, segQ: []int{0, 130, 5}, segK: []int{9, 0, 70}, opt: attn.Options{Causal: true}},
		{name: "bf16-d257-dropout", dt: attn.BFloat16, b: 1, n: 129, m: 140, h: 2, hkv: 1, dk: 257, dv: 257, opt: attn.Options{Dropout: 0.25, Seed: 11}},
		{name: "fp16-d1-dv3", dt: attn.Float16, b: 1, n: 40, m: 33, h: 1, hkv: 1, dk: 1, dv: 3},
		{name: "bf16-d36-8byte-rows", dt: attn.BFloat16, b: 2, n: 100, m: 120, h: 2, hkv: 1, dk: 36, dv: 36, opt: attn.Options{Causal: true, Align: attn.AlignTopLeft}},
		{name: "fp16-d62-4byte-rows", dt: attn.Float16, b: 1, n: 77, m: 64, h: 3, hkv: 3, dk: 62, dv: 62, opt: attn.Options{Softcap: 4}},
	}
	for i, pr := range cases {
		t.Run(pr.name, func(t *testing.T) {
			q, k, v, opt := pr.inputs(uint64(700 + i))
			res := fwdDeviceRunStaging(t, b, q, k, v, opt, true)
			fwdCheck(t, pr.dt, q, k, v, opt, res)
		})
	}
}

// TestForwardFlat runs odd head dims that the Hopper forward reads in place
// over flat rows (kernels.Variant.Flat: eight or more heads, one query head
// per key head, so every shift of a head within its 16-byte unit occurs)
// without a staging workspace (FlatStaged: with one, which then holds only
// the heads that do not fit in place), and checks that the planner took
// that kernel where the device has it.
func TestForwardFlat(t *testing.T) {
	b := fwdBackend(t)
	cases := []fwdProblem{
		{name: "bf16-d199-causal", dt: attn.BFloat16, b: 2, n: 300, m: 260, h: 16, hkv: 16, dk: 199, dv: 199, opt: attn.Options{Causal: true}},
		{name: "fp16-d201-dv185-softcap-bias-dropout", dt: attn.Float16, b: 1, n: 190, m: 230, h: 8, hkv: 8, dk: 201, dv: 185, opt: attn.Options{Softcap: 4, Dropout: 0.1, Seed: 3}, biasB: 1, bias: 8},
		{name: "bf16-d257-window", dt: attn.BFloat16, b: 1, n: 200, m: 200, h: 16, hkv: 16, dk: 257, dv: 257, opt: attn.Options{Window: &attn.Window{Left: 40, Right: 9}}},
		{name: "bf16-d121-16heads", dt: attn.BFloat16, b: 3, n: 129, m: 129, h: 16, hkv: 16, dk: 121, dv: 121},
		// head dims with fewer than 7 padding columns: the heads that fit read in place, the rest from
		// staging copies of them alone (kernels.Variant.FlatStaged)
		{name: "flatstaged-bf16-d59-causal", dt: attn.BFloat16, b: 2, n: 300, m: 260, h: 16, hkv: 16, dk: 59, dv: 59, opt: attn.Options{Causal: true}},
		{name: "flatstaged-fp16-d123-dv64-softcap-bias-dropout", dt: attn.Float16, b: 1, n: 190, m: 230, h: 8, hkv: 8, dk: 123, dv: 64, opt: attn.Options{Softcap: 4, Dropout: 0.1, Seed: 3}, biasB: 1, bias: 8},
		{name: "flatstaged-bf16-d187-dv59-window", dt: attn.BFloat16, b: 1, n: 200, m: 200, h: 24, hkv: 24, dk: 187, dv: 59, opt: attn.Options{Window: &attn.Window{Left: 40, Right: 9}}},
	}
	for i, pr := range cases {
		t.Run(pr.name, func(t *testing.T) {
			q, k, v, opt := pr.inputs(uint64(900 + i))
			p, err := attn.NewProblem(q, k, v, opt)
			if err != nil {
				t.Fatal(err)
			}
			fake := func(dt attn.DType, shape []int) DeviceTensor {
				return DeviceTensor{DType: dt, Shape: shape, base: 1 << 40}
			}
			fq, fk, fv, fo, fl := fake(pr.dt, q.Shape), fake(pr.dt, k.Shape), fake(pr.dt, v.Shape), fake(pr.dt, p.OutputShape()), fake(attn.Float32, p.LSEShape())
			staged := strings.HasPrefix(pr.name, "flatstaged-")
			var l launch
			if staged {
				dopt := DeviceOptions{}
				if opt.Bias != nil {
					bias := fake(opt.Bias.Tensor.DType, opt.Bias.Tensor.Shape)
					dopt.Bias = &bias
				}
				l, _, err = b.planStagingFor(p, fq, fk, fv, fo, fl, dopt)
			} else {
				l, err = plan(fwdRequest{p: p, dt: pr.dt, q: fq, k: fk, v: fv, o: fo, lse: fl, hopper: b.WGMMA, tma: b.TMA})
			}
			if err != nil {
				t.Fatalf("plan: %v", err)
			}
			if want := b.WGMMA && b.TMA; l.v.Flat != want || l.v.FlatStaged != (want && staged) {
				t.Fatalf("plan %s: Flat = %v, FlatStaged = %v, want %v, %v", l.v.Name(), l.v.Flat, l.v.FlatStaged, want, want && staged)
			}
			res := fwdDeviceRunStaging(t, b, q, k, v, opt, staged)
			fwdCheck(t, pr.dt, q, k, v, opt, res)
		})
	}
}

// TestDropoutKeepMask reads the kernel's keep mask back through V = I (so
// O[i, j] = keep(i, j)·P(i, j)·256/T) and compares it with package philox
// bit for bit, padded and packed.
func TestDropoutKeepMask(t *testing.T) {
	b := fwdBackend(t)
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float32} {
		for _, packed := range []bool{false, true} {
			t.Run(fmt.Sprintf("%v-packed=%v", dt, packed), func(t *testing.T) {
				checkForwardKeepMask(t, dt, packed, 3, 200, 100, 57, func(q, k, v attn.Tensor, opt attn.Options) attn.Result {
					res, err := b.Forward(q, k, v, opt)
					if err != nil {
						t.Fatalf("Forward: %v", err)
					}
					return res
				})
			})
		}
	}
}

// checkForwardKeepMask runs a forward call through run whose V is the
// identity (DV = m keys; two sequences of n and, packed, n2 queries over m
// and m·3/4 keys, h heads, dropout 0.3) so that O[i, j] is key j's dropped
// probability, and compares O ≠ 0 with package philox's keep decisions bit
// for bit, then O with the oracle.
func checkForwardKeepMask(t *testing.T, dt attn.DType, packed bool, h, m, n, n2 int, run func(q, k, v attn.Tensor, opt attn.Options) attn.Result) {
	t.Helper()
	const dk, p = 32, 0.3
	segQ, segK := []int{n, n2}, []int{m, m * 3 / 4}
	if !packed {
		segQ, segK = []int{n, n}, []int{m, m}
	}
	r := rand.New(rand.NewPCG(1, 2))
	tq, tk := segQ[0]+segQ[1], segK[0]+segK[1]
	q := fwdRand(r, dt, 0.5, tq, h, dk)
	k := fwdRand(r, dt, 0.5, tk, 1, dk)
	v := attn.New(dt, tk, 1, m)
	for s, k0 := 0, 0; s < 2; k0, s = k0+segK[s], s+1 {
		for j := 0; j < segK[s]; j++ {
			v.Set(1, k0+j, 0, j)
		}
	}
	opt := attn.Options{Dropout: p, Seed: 0x1234_5678_9abc, Offset: 11}
	th, err := philox.Threshold(p)
	if err != nil {
		t.Fatal(err)
	}
	if packed {
		opt.CuSeqlensQ, opt.CuSeqlensK = []int32{0, int32(segQ[0]), int32(tq)}, []int32{0, int32(segK[0]), int32(tk)}
	} else {
		q.Shape, k.Shape, v.Shape = []int{2, n, h, dk}, []int{2, m, 1, dk}, []int{2, m, 1, m}
		q.Strides, k.Strides, v.Strides = nil, nil, nil
	}
	res := run(q, k, v, opt)
	bad, kept, total := 0, 0, 0
	for s, q0 := 0, 0; s < 2; q0, s = q0+segQ[s], s+1 {
		for hh := 0; hh < h; hh++ {
			mask := philox.NewMask(opt.Seed, opt.Offset, th, s, hh, h)
			for i := 0; i < segQ[s]; i++ {
				for j := 0; j < segK[s]; j++ {
					var o float32
					if packed {
						o = res.O.At(q0+i, hh, j)
					} else {
						o = res.O.At(s, i, hh, j)
					}
					want := mask.Keep(i, j)
					if (o != 0) != want {
						if bad < 5 {
							t.Errorf("segment %d head %d (i %d, j %d): O = %v, keep = %v", s, hh, i, j, o, want)
						}
						bad++
					}
					if want {
						kept++
					}
					total++
				}
			}
		}
	}
	if bad > 0 {
		t.Fatalf("%d of %d keep decisions differ from philox", bad, total)
	}
	t.Logf("%d of %d kept (%.3f, want %.3f)", kept, total, float64(kept)/float64(total), float64(th)/philox.Levels)
	fwdCheck(t, dt, q, k, v, opt, res)
}

// TestRepeatBitIdentical runs one forward (causal, GQA, partial tiles,
// with and without dropout) once through ForwardDevice and many times
// through Forward, and checks that every run is bit-identical: the host
// path's repeats with each other, and with the device path. A difference
// is reported by where it lies (element count, first batch, row, head).
func TestRepeatBitIdentical(t *testing.T) {
	b := fwdBackend(t)
	for _, dropout := range []float64{0, 0.1} {
		t.Run(fmt.Sprintf("dropout=%g", dropout), func(t *testing.T) {
			pr := fwdProblem{dt: attn.BFloat16, b: 2, n: 500, m: 700, h: 4, hkv: 2, dk: 128, dv: 128, opt: attn.Options{Causal: true, Dropout: dropout, Seed: 5}}
			q, k, v, opt := pr.inputs(9)
			first, err := b.Forward(q, k, v, opt)
			if err != nil {
				t.Fatalf("Forward: %v", err)
			}
			for rep := 1; rep < 50; rep++ {
				res, err := b.Forward(q, k, v, opt)
				if err != nil {
					t.Fatalf("Forward: %v", err)
				}
				if d := resultDiff(pr, first, res); d != "" {
					t.Fatalf("host repeat %d differs from the first host run: %s", rep, d)
				}
			}
			if d := resultDiff(pr, first, fwdDeviceRun(t, b, q, k, v, opt)); d != "" {
				t.Fatalf("the device path differs from the host path: %s", d)
			}
		})
	}
}

// resultDiff describes where two forward results of pr differ bitwise
// ("" when they do not): how many O and LSE elements differ, and the
// batch element, query row and head of the first of each.
func resultDiff(pr fwdProblem, a, b attn.Result) string {
	var parts []string
	count := func(name string, x, y []byte, size int, at func(i int) string) {
		n, first := 0, -1
		for i := 0; i+size <= len(x) && i+size <= len(y); i += size {
			if !bytes.Equal(x[i:i+size], y[i:i+size]) {
				if n == 0 {
					first = i / size
				}
				n++
			}
		}
		if n > 0 {
			parts = append(parts, fmt.Sprintf("%s: %d of %d elements, first at %s", name, n, len(x)/size, at(first)))
		}
	}
	count("O", cuda.AsBytes(a.O.Bits), cuda.AsBytes(b.O.Bits), 2, func(i int) string { // [B, N, H, DV]
		return fmt.Sprintf("b=%d row=%d head=%d col=%d", i/(pr.n*pr.h*pr.dv), i/(pr.h*pr.dv)%pr.n, i/pr.dv%pr.h, i%pr.dv)
	})
	count("LSE", cuda.AsBytes(a.LSE.F32), cuda.AsBytes(b.LSE.F32), 4, func(i int) string { // [B, H, N]
		return fmt.Sprintf("b=%d head=%d row=%d", i/(pr.h*pr.n), i/pr.n%pr.h, i%pr.n)
	})
	return strings.Join(parts, "; ")
}

// TestDeviceErrors checks ForwardDevice's validation.
func TestDeviceErrors(t *testing.T) {
	b := fwdBackend(t)
	dev := b.Device()
	mk := func(dt attn.DType, shape ...int) DeviceTensor {
		d, err := NewDeviceTensor(dev, dt, shape...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Free() })
		return d
	}
	q, k, v := mk(attn.BFloat16, 1, 64, 2, 32), mk(attn.BFloat16, 1, 64, 2, 32), mk(attn.BFloat16, 1, 64, 2, 32)
	o, lse := mk(attn.BFloat16, 1, 64, 2, 32), mk(attn.Float32, 1, 2, 64)
	if err := b.ForwardDevice(nil, q, k, v, o, lse, DeviceOptions{}); err != nil {
		t.Fatalf("valid call: %v", err)
	}
	strided := q
	strided.Shape, strided.Strides = []int{1, 32, 2, 32}, []int{4096, 64, 2048, 2}
	over := q
	over.Offset = 10
	cases := []struct {
		name      string
		q, o, lse DeviceTensor
		opt       DeviceOptions
		want      error
	}{
		{"feature stride", strided, o, lse, DeviceOptions{}, attn.ErrUnsupported},
		{"past the buffer", over, o, lse, DeviceOptions{}, attn.ErrLayout},
		{"o dtype", q, mk(attn.Float16, 1, 64, 2, 32), lse, DeviceOptions{}, attn.ErrDType},
		{"lse shape", q, o, mk(attn.Float32, 1, 2, 63), DeviceOptions{}, attn.ErrShape},
		{"dropout", q, o, lse, DeviceOptions{Options: attn.Options{Dropout: 1}}, attn.ErrOption},
		{"host bias", q, o, lse, DeviceOptions{Options: attn.Options{Bias: &attn.Bias{}}}, attn.ErrOption},
	}
	for _, c := range cases {
		if err := b.ForwardDevice(nil, c.q, k, v, c.o, c.lse, c.opt); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	if err := dev.Synchronize(); err != nil {
		t.Fatal(err)
	}
}

// TestHugeTensor runs tensors of more than 2^31 elements (64-bit offsets)
// with a cheap sliding window, filled on the device, and checks sampled rows
// (including the last ones) against a float64 computation on the host.
func TestHugeTensor(t *testing.T) {
	b := fwdBackend(t)
	if testing.Short() {
		t.Skip("short: allocates 17 GB")
	}
	free, _, err := b.Device().MemInfo()
	if err != nil {
		t.Fatal(err)
	}
	const h, d, left = 4, 128, 63
	n := 1<<31/(h*d) + 200 // q has n·h·d > 2^31 elements
	if need := int64(4*n*h*d*2) + 1<<30; free < need {
		t.Skipf("needs %d GB of device memory, %d GB free", need>>30, free>>30)
	}
	dt := attn.BFloat16
	shape := []int{1, n, h, d}
	var ts []DeviceTensor
	defer func() {
		for _, x := range ts {
			x.Free()
		}
	}()
	for i := 0; i < 4; i++ {
		x, err := NewDeviceTensor(b.dev, dt, shape...)
		if err != nil {
			t.Fatal(err)
		}
		ts = append(ts, x)
	}
	lse, err := NewDeviceTensor(b.dev, attn.Float32, 1, h, n)
	if err != nil {
		t.Fatal(err)
	}
	ts = append(ts, lse)
	seeds := []uint64{11, 22, 33}
	for i := 0; i < 3; i++ {
		if err := b.FillRandom(b.stream, ts[i], seeds[i]); err != nil {
			t.Fatal(err)
		}
	}
	opt := DeviceOptions{Options: attn.Options{Causal: true, Window: &attn.Window{Left: left, Right: 0}}}
	if err := b.ForwardDevice(b.stream, ts[0], ts[1], ts[2], ts[3], lse, opt); err != nil {
		t.Fatal(err)
	}
	if err := b.stream.Synchronize(); err != nil {
		t.Fatal(err)
	}
	scale := 1 / math.Sqrt(d)
	val := func(s uint64, i, hh, f int) float64 { return float64(FillValue(dt, s, int64((i*h+hh)*d+f))) }
	for _, i := range []int{0, 1, 777, n / 2, n - 129, n - 2, n - 1} {
		for _, hh := range []int{0, h - 1} {
			got := make([]uint16, d)
			off := int64((i*h + hh) * d)
			if err := b.dev.CopyFromDevice(cuda.AsBytes(got), ts[3].Buf, off*2); err != nil {
				t.Fatal(err)
			}
			var lg [1]float32
			if err := b.dev.CopyFromDevice(cuda.AsBytes(lg[:]), lse.Buf, int64(hh*n+i)*4); err != nil {
				t.Fatal(err)
			}
			lo := max(0, i-left)
			sc := make([]float64, i-lo+1)
			mx := math.Inf(-1)
			for j := lo; j <= i; j++ {
				s := 0.0
				for f := 0; f < d; f++ {
					s += val(seeds[0], i, hh, f) * val(seeds[1], j, hh, f)
				}
				sc[j-lo] = s * scale
				mx = max(mx, sc[j-lo])
			}
			sum := 0.0
			for j := range sc {
				sc[j] = math.Exp(sc[j] - mx)
				sum += sc[j]
			}
			if want := mx + math.Log(sum); math.Abs(float64(lg[0])-want) > 1e-2 {
				t.Errorf("row %d head %d: LSE %v, want %v", i, hh, lg[0], want)
			}
			for f := 0; f < d; f++ {
				want := 0.0
				for j := lo; j <= i; j++ {
					want += sc[j-lo] / sum * val(seeds[2], j, hh, f)
				}
				g := float64(attn.Tensor{DType: dt, Shape: []int{d}, Bits: got}.At(f))
				if math.Abs(g-want) > 1e-2 {
					t.Fatalf("row %d head %d feature %d: O %v, want %v", i, hh, f, g, want)
				}
			}
		}
	}
}

// TestForwardGraphFlatStaged captures a forward whose staged heads come
// from the pack kernel it was launched early after (kernels.Variant.FlatStaged,
// cuda.Device.LaunchEarly) in a CUDA graph, and checks that replays
// reproduce the eager run bit for bit and that the eager run is right.
func TestForwardGraphFlatStaged(t *testing.T) {
	b := fwdBackend(t)
	dev := b.Device()
	s := testStream(t, dev)
	pr := fwdProblem{name: "graph-d59", dt: attn.BFloat16, b: 2, n: 300, m: 260, h: 16, hkv: 16, dk: 59, dv: 59, opt: attn.Options{Causal: true}}
	q, k, v, opt := pr.inputs(77)
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		t.Fatal(err)
	}
	bufs := newTestBufs(t, b)
	dq, dk, dv := bufs.upload(q), bufs.upload(k), bufs.upload(v)
	o, lse := bufs.alloc(pr.dt, p.OutputShape()...), bufs.alloc(attn.Float32, p.LSEShape()...)
	dopt := DeviceOptions{Options: opt}
	wsBytes, err := b.PrepareForward(dq, dk, dv, o, lse, dopt)
	if err != nil {
		t.Fatalf("PrepareForward: %v", err)
	}
	if wsBytes == 0 {
		t.Fatal("PrepareForward: no staging for an odd head dim")
	}
	ws, err := dev.Alloc(wsBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Free()
	dopt.Staging = ws
	if vr, err := b.Variant(dq, dk, dv, o, lse, dopt); err != nil || vr.FlatStaged != (b.WGMMA && b.TMA) {
		t.Fatalf("variant %s (err %v): FlatStaged = %v, want %v", vr.Name(), err, vr.FlatStaged, b.WGMMA && b.TMA)
	}
	read := func() [2][]byte {
		var out [2][]byte
		for i, x := range []DeviceTensor{o, lse} {
			out[i] = make([]byte, x.NumElements()*x.DType.Size())
			if err := dev.CopyFromDevice(out[i], x.Buf, 0); err != nil {
				t.Fatal(err)
			}
		}
		return out
	}
	if err := b.ForwardDevice(s, dq, dk, dv, o, lse, dopt); err != nil {
		t.Fatalf("ForwardDevice: %v", err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	eager := read()
	fwdCheck(t, pr.dt, q, k, v, opt, attn.Result{O: tensorFromBytes(pr.dt, eager[0], p.OutputShape()), LSE: tensorFromBytes(attn.Float32, eager[1], p.LSEShape())})
	poison := func() {
		for _, x := range []*cuda.Buffer{o.Buf, lse.Buf, ws} {
			if err := dev.Memset8(x, bwdPoison); err != nil {
				t.Fatal(err)
			}
		}
	}
	// eager repeats on a poisoned workspace: a block of a staged head that read its copies before the
	// pack kernel wrote them would read the poison
	for rep := 0; rep < 20; rep++ {
		poison()
		if err := b.ForwardDevice(s, dq, dk, dv, o, lse, dopt); err != nil {
			t.Fatalf("ForwardDevice: %v", err)
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		got := read()
		for i := range got {
			if !bytes.Equal(got[i], eager[i]) {
				t.Fatalf("repeat %d: output %d differs from the first run", rep, i)
			}
		}
	}
	graph := captureGraph(t, s, func() {
		if err := b.ForwardDevice(s, dq, dk, dv, o, lse, dopt); err != nil {
			t.Fatalf("ForwardDevice in capture: %v", err)
		}
	})
	defer graph.Close()
	checkReplays(t, s, graph, 3, poison, func() [][]byte { r := read(); return r[:] }, eager[:])
}

// captureGraph captures what enqueue enqueues on s in a CUDA graph.
func captureGraph(t *testing.T, s *cuda.Stream, enqueue func()) *cuda.Graph {
	t.Helper()
	if err := s.BeginCapture(cuda.CaptureThreadLocal); err != nil {
		t.Fatal(err)
	}
	enqueue()
	graph, err := s.EndCapture()
	if err != nil {
		t.Fatalf("capture: %v", err)
	}
	return graph
}

// checkReplays launches graph on s reps times, each after poison, and
// fails t unless read returns want every time, byte for byte.
func checkReplays(t *testing.T, s *cuda.Stream, graph *cuda.Graph, reps int, poison func(), read func() [][]byte, want [][]byte) {
	t.Helper()
	for rep := 0; rep < reps; rep++ {
		poison()
		if err := graph.Launch(s); err != nil {
			t.Fatal(err)
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		for i, got := range read() {
			if !bytes.Equal(got, want[i]) {
				t.Fatalf("graph replay %d: output %d differs from the eager run", rep, i)
			}
		}
	}
}

// testBufs holds a device test's tensors and frees them when it ends.
type testBufs struct {
	t  *testing.T
	b  *Backend
	ts []DeviceTensor
}

// newTestBufs returns an empty testBufs for t on b's device.
func newTestBufs(t *testing.T, b *Backend) *testBufs {
	tb := &testBufs{t: t, b: b}
	t.Cleanup(func() {
		for _, x := range tb.ts {
			_ = x.Free()
		}
	})
	return tb
}

// upload copies x to the device.
func (tb *testBufs) upload(x attn.Tensor) DeviceTensor {
	tb.t.Helper()
	d, err := tb.b.Upload(x)
	if err != nil {
		tb.t.Fatal(err)
	}
	tb.ts = append(tb.ts, d)
	return d
}

// alloc allocates a contiguous device tensor.
func (tb *testBufs) alloc(dt attn.DType, shape ...int) DeviceTensor {
	tb.t.Helper()
	d, err := NewDeviceTensor(tb.b.Device(), dt, shape...)
	if err != nil {
		tb.t.Fatal(err)
	}
	tb.ts = append(tb.ts, d)
	return d
}

// testStream returns a non-blocking stream on dev, closed when t ends.
func testStream(t testing.TB, dev *cuda.Device) *cuda.Stream {
	t.Helper()
	s, err := dev.NewStreamNonBlocking()
	if err != nil {
		t.Fatalf("stream: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// fwdPoison plants a non-finite value in one row of an input of a
// fwdProblem: tensor 'q', 'k' or 'v'; batch element b and sequence position
// pos (packed batches: b 0 and pos the packed row); head (of that tensor);
// element col, or the whole row when col < 0.
type fwdPoison struct {
	tensor            byte
	b, pos, head, col int
	val               float64
}

// fwdNaNCase is a fwdProblem with non-finite values planted in its inputs.
type fwdNaNCase struct {
	fwdProblem
	poison []fwdPoison
}

// inputs returns the tensors and options of c, poisoned.
func (c fwdNaNCase) inputs(seed uint64) (q, k, v attn.Tensor, opt attn.Options) {
	q, k, v, opt = c.fwdProblem.inputs(seed)
	for _, p := range c.poison {
		x := map[byte]attn.Tensor{'q': q, 'k': k, 'v': v}[p.tensor]
		idx := []int{p.b, p.pos, p.head, 0}
		if c.segQ != nil {
			idx = []int{p.pos, p.head, 0}
		}
		for e := 0; e < x.Shape[len(x.Shape)-1]; e++ {
			if p.col < 0 || e == p.col {
				idx[len(idx)-1] = e
				x.Set(float32(p.val), idx...)
			}
		}
	}
	return q, k, v, opt
}

// fwdNaNCases are the non-finite inputs of the forward kernels (GUIDE.md: a
// NaN gives NaN wherever it is visible and nowhere else; a NaN query row is
// not a row that sees no key): NaN and ±Inf in query, key and value rows,
// whole rows and single elements, where some query rows see them and where
// none does (masked by causal or window masks, in the diagonal and
// window-edge tiles and in tiles a CTA skips, or past a packed segment),
// both causal alignments, one and several tiles, odd and wide head dims.
func fwdNaNCases() []fwdNaNCase {
	nan, inf := math.NaN(), math.Inf(1)
	tl := attn.AlignTopLeft
	causal := attn.Options{Causal: true}
	// fwdProblem with b = 1 and one query head per key head
	pr := func(name string, dt attn.DType, n, m, h, d int, opt attn.Options) fwdProblem {
		return fwdProblem{name: name, dt: dt, b: 1, n: n, m: m, h: h, hkv: h, dk: d, dv: d, opt: opt}
	}
	mixed := []fwdPoison{
		{'q', 0, 10, 0, -1, nan},  // a NaN query row
		{'v', 0, 120, 0, -1, nan}, // a value row the early rows do not see
		{'k', 0, 160, 1, -1, inf}, // a key row of infinities: NaN scores where seen
		{'v', 0, 199, 1, 7, -inf}, // the last key: seen by the last rows only (bottom-right), by none (top-left)
		{'k', 0, 60, 1, 3, inf},   // an infinite key element: scores +Inf or -Inf by the query's sign
	}
	return []fwdNaNCase{
		// the shape: causal N = M = 16, one tile
		{pr("d64-n16-q-nan", attn.BFloat16, 16, 16, 2, 64, causal), []fwdPoison{{'q', 0, 5, 0, -1, nan}}},
		{pr("d64-n16-v12-nan", attn.BFloat16, 16, 16, 2, 64, causal), []fwdPoison{{'v', 0, 12, 0, -1, nan}}},
		{pr("d64-n16-v12-inf", attn.Float16, 16, 16, 2, 64, causal), []fwdPoison{{'v', 0, 12, 1, -1, inf}}},
		{pr("d64-n16-v12-elem-nan", attn.BFloat16, 16, 16, 2, 64, causal), []fwdPoison{{'v', 0, 12, 0, 5, nan}}},
		{pr("d64-n16-k12-nan", attn.BFloat16, 16, 16, 2, 64, causal), []fwdPoison{{'k', 0, 12, 1, -1, nan}}},
		{pr("d64-n16-q-inf-elem", attn.BFloat16, 16, 16, 2, 64, causal), []fwdPoison{{'q', 0, 9, 0, 2, inf}, {'k', 0, 3, 1, 0, -inf}}},
		// several tiles, N < M, both alignments, a window
		{pr("d64-150x200-causal", attn.BFloat16, 150, 200, 2, 64, causal), mixed},
		{pr("d64-150x200-causal-top-left", attn.BFloat16, 150, 200, 2, 64, attn.Options{Causal: true, Align: tl}), mixed},
		{pr("d64-200-window", attn.Float16, 200, 200, 2, 64, attn.Options{Window: &attn.Window{Left: 30, Right: 7}}), []fwdPoison{
			{'v', 0, 50, 0, -1, nan}, {'k', 0, 100, 1, -1, nan}, {'v', 0, 150, 0, 9, inf}, {'q', 0, 199, 1, -1, nan}}},
		{pr("d128-200-causal", attn.BFloat16, 200, 200, 2, 128, causal), []fwdPoison{
			{'v', 0, 100, 0, -1, nan}, {'v', 0, 101, 1, 127, -inf}, {'k', 0, 180, 0, -1, nan}, {'q', 0, 3, 1, 4, nan}}},
		// odd head dims (sixteen heads: the Hopper forward reads them in place, each head beside its
		// neighbours in the row; the key NaN sits in a column no neighbour's tile holds, see
		// docs/kernels/nonfinite.md), wide ones (value columns split over warps), fp32
		{pr("d59-200-causal", attn.BFloat16, 200, 200, 16, 59, causal), []fwdPoison{
			{'v', 0, 120, 3, -1, nan}, {'v', 0, 121, 4, 0, inf}, {'k', 0, 130, 6, 30, nan}, {'q', 0, 20, 7, -1, nan}}},
		{pr("d384-70-causal", attn.BFloat16, 70, 70, 1, 384, causal), []fwdPoison{{'v', 0, 40, 0, -1, nan}, {'k', 0, 50, 0, 100, nan}}},
		{pr("fp32-d64-100-causal", attn.Float32, 100, 100, 2, 64, causal), []fwdPoison{
			{'v', 0, 60, 0, -1, nan}, {'q', 0, 30, 1, -1, nan}, {'v', 0, 70, 1, 3, inf}}},
		// a packed batch: the rows past a segment belong to the next one
		{fwdProblem{name: "varlen-causal", dt: attn.BFloat16, h: 2, hkv: 1, dk: 64, dv: 64, segQ: []int{30, 40}, segK: []int{35, 50}, opt: causal},
			[]fwdPoison{{'v', 0, 35, 0, 5, nan}, {'k', 0, 34, 0, -1, nan}, {'v', 0, 36, 0, 2, inf}, {'v', 0, 80, 0, -1, nan}}},
	}
}

// fwdCheckNonFinite checks a forward result of inputs with non-finite
// values against the float64 oracle: NaN and ±Inf exactly where the oracle
// has them (LSE: also −Inf), the finite elements within fwdCheck's bound.
func fwdCheckNonFinite(t *testing.T, dt attn.DType, q, k, v attn.Tensor, opt attn.Options, res attn.Result) {
	t.Helper()
	ref, err := cpu.Reference(q, k, v, opt)
	if err != nil {
		t.Fatalf("Reference: %v", err)
	}
	naive := ref
	if dt != attn.Float32 {
		if naive, err = cpu.NaiveForward(dt, q, k, v, opt); err != nil {
			t.Fatalf("NaiveForward: %v", err)
		}
	}
	// bound gives the error bound from the naive computation's error ne and the magnitude mag
	check := func(name string, got, want, base []float64, bound func(ne, mag float64) float64) {
		t.Helper()
		var e, ne, mag float64
		at, bad, nonFinite := -1, 0, 0
		for i, w := range want {
			g := got[i]
			switch {
			case math.IsNaN(w) || math.IsInf(w, 0):
				nonFinite++
				if !(math.IsNaN(w) && math.IsNaN(g) || g == w) {
					if bad++; bad <= 5 {
						t.Errorf("%s[%d] = %v, oracle %v", name, i, g, w)
					}
				}
			case math.IsNaN(g) || math.IsInf(g, 0):
				if bad++; bad <= 5 {
					t.Errorf("%s[%d] = %v, oracle %v", name, i, g, w)
				}
			default:
				if d := math.Abs(g - w); d > e {
					e, at = d, i
				}
				if b := base[i]; !math.IsNaN(b) && !math.IsInf(b, 0) {
					ne = max(ne, math.Abs(b-w))
				}
				mag = max(mag, math.Abs(w))
			}
		}
		if bad > 0 {
			t.Fatalf("%s: %d of %d elements non-finite where the oracle is not or the other way round (%d non-finite in the oracle)", name, bad, len(want), nonFinite)
		}
		b := bound(ne, mag)
		if e > b {
			t.Errorf("%s: max error %.3g at %d (got %v, oracle %v) exceeds %.3g", name, e, at, got[at], want[at], b)
		}
		t.Logf("%s: %d non-finite elements as the oracle's, max error %.3g (bound %.3g)", name, nonFinite, e, b)
	}
	u := conformance.UnitRoundoff(dt)
	check("O", res.O.Float64s(), ref.O, naive.O, func(ne, mag float64) float64 {
		if dt == attn.Float32 {
			return 1e-5 * max(mag, 1)
		}
		return 2*ne + u*max(mag, 1)
	})
	check("LSE", res.LSE.Float64s(), ref.LSE, naive.LSE, func(ne, mag float64) float64 {
		if dt == attn.Float32 {
			return 1e-5 * max(mag, 1)
		}
		return max(1e-5*max(mag, 1), 2*ne+u)
	})
}

// TestForwardNonFinite runs fwdNaNCases on the device through every forward
// kernel family the planner can pick there: the mma.sync kernels (odd head
// dims with register-staged loads), the Hopper kernels with tiles by
// cp.async and by tensor maps (odd head dims: from staging copies, and over
// flat rows with the heads that do not fit staged), into poisoned, guarded
// outputs; NaN and ±Inf must come out exactly where the float64 oracle has
// them, every other element within the accuracy bound.
func TestForwardNonFinite(t *testing.T) {
	b := fwdBackend(t)
	wgmma, tma := b.WGMMA, b.TMA
	defer func() { b.WGMMA, b.TMA = wgmma, tma }()
	families := []struct {
		name       string
		wgmma, tma bool
	}{{"mma", false, false}, {"hopper-cp.async", true, false}, {"hopper-tensor-maps", true, true}}
	for _, f := range families {
		for i, c := range fwdNaNCases() {
			t.Run(f.name+"/"+c.name, func(t *testing.T) {
				switch {
				case f.wgmma && !wgmma, f.tma && !tma:
					t.Skip("not a kernel family of this device")
				case f.wgmma && c.dt == attn.Float32:
					t.Skip("the Hopper kernels take 16-bit types")
				}
				b.WGMMA, b.TMA = f.wgmma, f.tma
				q, k, v, opt := c.inputs(uint64(1100 + i))
				// odd head dims: the Hopper kernels read staging copies (with tensor maps only of the heads
				// that do not fit in place), the mma.sync kernels the rows in place, 2 bytes at a time
				staged := f.wgmma && c.dk%8 != 0
				vr := fwdPlanned(t, b, q, k, v, opt, staged)
				t.Logf("%s", vr.Name())
				if vr.WGMMA != f.wgmma || vr.TMA != f.tma || vr.Flat != (f.tma && staged) {
					t.Fatalf("plan %s: not the %s kernels", vr.Name(), f.name)
				}
				res := fwdDeviceRunStaging(t, b, q, k, v, opt, staged)
				fwdCheckNonFinite(t, c.dt, q, k, v, opt, res)
			})
		}
	}
}

// fwdPlanned returns the kernel variant b plans for host tensors q, k, v
// (on the device, contiguous; with staged, given a staging workspace).
func fwdPlanned(t *testing.T, b *Backend, q, k, v attn.Tensor, opt attn.Options, staged bool) kernels.Variant {
	t.Helper()
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		t.Fatal(err)
	}
	fake := func(dt attn.DType, shape []int) DeviceTensor {
		return DeviceTensor{DType: dt, Shape: shape, base: 1 << 40}
	}
	fq, fk, fv := fake(q.DType, q.Shape), fake(k.DType, k.Shape), fake(v.DType, v.Shape)
	fo, fl := fake(q.DType, p.OutputShape()), fake(attn.Float32, p.LSEShape())
	var cuq, cuk uint64
	if p.Varlen {
		cuq, cuk = 1<<41, 1<<42
	}
	var l launch
	if staged {
		l, _, err = b.planStagingFor(p, fq, fk, fv, fo, fl, DeviceOptions{Options: opt})
	} else {
		l, err = plan(fwdRequest{p: p, dt: q.DType, q: fq, k: fk, v: fv, o: fo, lse: fl, cuq: cuq, cuk: cuk, hopper: b.WGMMA, tma: b.TMA})
	}
	if err != nil {
		t.Fatalf("plan: %v", err)
	}
	return l.v
}

// TestDropoutAt runs a call placed inside a larger problem
// (Options.DropoutAt) forward and backward on the GPU against the float64
// reference with the same origin, in bf16 and fp32, and checks that a key
// origin the kernels do not take is refused with ErrUnsupported.
func TestDropoutAt(t *testing.T) {
	b := fwdBackend(t)
	c := bwdCase{name: "dropout-at", b: 2, n: 70, m: 96, h: 2, hkv: 1, dk: 64, dv: 64, dropout: 0.25, causal: true,
		dropAt: &attn.DropoutOrigin{Query: 37, Key: 48, Head: 1, Heads: 5}}
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float32} {
		t.Run(dt.String(), func(t *testing.T) {
			in := c.inputs(t, dt, 41)
			res, err := b.Forward(in.q, in.k, in.v, in.opt)
			if err != nil {
				t.Fatalf("Forward: %v", err)
			}
			fwdCheck(t, dt, in.q, in.k, in.v, in.opt, res)
			ref, naive := in.oracles(t)
			g, err := b.Backward(in.q, in.k, in.v, in.o, in.lse, in.dO, in.opt)
			if err != nil {
				t.Fatalf("Backward: %v", err)
			}
			checkGrads(t, dt, g, ref, naive)
		})
	}
	in := c.inputs(t, attn.BFloat16, 41)
	in.opt.DropoutAt = &attn.DropoutOrigin{Key: 8}
	if _, err := b.Forward(in.q, in.k, in.v, in.opt); !errors.Is(err, attn.ErrUnsupported) {
		t.Errorf("key origin 8: %v, want ErrUnsupported", err)
	}
}
