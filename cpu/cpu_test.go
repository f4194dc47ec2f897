package cpu_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/conformance"
	"github.com/flashattn/flashattn/cpu"
	"github.com/flashattn/flashattn/internal/vec"
)

// useKernels makes the tile kernels of package vec run the named
// implementation until the end of the test or benchmark.
func useKernels(tb testing.TB, name string) {
	tb.Helper()
	prev := vec.Implementation()
	if err := vec.Use(name); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := vec.Use(prev); err != nil {
			tb.Fatal(err)
		}
	})
}

// TestConformance runs the conformance suite with every implementation of
// the tile kernels this machine has: the portable Go code and each SIMD
// level.
func TestConformance(t *testing.T) {
	for _, name := range vec.Implementations() {
		t.Run(name, func(t *testing.T) {
			useKernels(t, name)
			conformance.Run(t, cpu.New(), conformance.Config{Short: testing.Short()})
		})
	}
}

func randTensor(r *rand.Rand, dt attn.DType, shape ...int) attn.Tensor {
	t := attn.New(dt, shape...)
	n := t.NumElements()
	for i := 0; i < n; i++ {
		t.Store(i, float32(r.NormFloat64()))
	}
	return t
}

func bitsEqual(a, b attn.Tensor) bool {
	x, y := a.Float32s(), b.Float32s()
	if len(x) != len(y) {
		return false
	}
	for i := range x {
		if math.Float32bits(x[i]) != math.Float32bits(y[i]) {
			return false
		}
	}
	return true
}

// procCase is a problem of TestGOMAXPROCSIndependent.
type procCase struct {
	name            string
	b, n, m, h, hkv int
	d               int
	dt              attn.DType
	opt             attn.Options
	bias            []int
	seqQ, seqK      []int32
}

// TestGOMAXPROCSIndependent checks, with every implementation of the tile
// kernels, that forward and backward give bit-identical results with 1, 2
// and 3 threads, on problems that use every path of the work partition:
// GQA groups, several key chunks, masks, dropout, a broadcast bias gradient,
// a packed batch and the key chunks of a small forward.
func TestGOMAXPROCSIndependent(t *testing.T) {
	tests := []procCase{
		{name: "mqa-causal-dropout", b: 1, n: 300, m: 333, h: 4, hkv: 1, d: 32, dt: attn.Float32,
			opt: attn.Options{Causal: true, Dropout: 0.2, Seed: 7}},
		{name: "gqa-bias-softcap-bf16", b: 2, n: 200, m: 150, h: 4, hkv: 2, d: 24, dt: attn.BFloat16,
			opt: attn.Options{Softcap: 3, Window: &attn.Window{Left: 50, Right: 20}}, bias: []int{1, 1}},
		{name: "varlen-fp16", h: 2, hkv: 2, d: 16, dt: attn.Float16,
			seqQ: []int32{0, 100, 100, 290}, seqK: []int32{0, 130, 140, 400}},
		{name: "decode-key-chunks", b: 1, n: 3, m: 700, h: 2, hkv: 1, d: 40, dt: attn.Float32,
			opt: attn.Options{Causal: true}},
	}
	for _, kernels := range vec.Implementations() {
		for _, tc := range tests {
			t.Run(kernels+"/"+tc.name, func(t *testing.T) {
				useKernels(t, kernels)
				checkGOMAXPROCS(t, tc)
			})
		}
	}
}

// checkGOMAXPROCS runs forward and backward of tc with 1, 2 and 3 threads
// and fails unless the results are bit-identical.
func checkGOMAXPROCS(t *testing.T, tc procCase) {
	r := rand.New(rand.NewPCG(1, 1))
	opt := tc.opt
	var q, k, v attn.Tensor
	if tc.seqQ != nil {
		opt.CuSeqlensQ, opt.CuSeqlensK = tc.seqQ, tc.seqK
		tq, tk := int(tc.seqQ[len(tc.seqQ)-1]), int(tc.seqK[len(tc.seqK)-1])
		q, k, v = randTensor(r, tc.dt, tq, tc.h, tc.d), randTensor(r, tc.dt, tk, tc.hkv, tc.d), randTensor(r, tc.dt, tk, tc.hkv, tc.d)
	} else {
		q = randTensor(r, tc.dt, tc.b, tc.n, tc.h, tc.d)
		k, v = randTensor(r, tc.dt, tc.b, tc.m, tc.hkv, tc.d), randTensor(r, tc.dt, tc.b, tc.m, tc.hkv, tc.d)
	}
	if tc.bias != nil {
		opt.Bias = &attn.Bias{Tensor: randTensor(r, tc.dt, tc.bias[0], tc.bias[1], tc.n, tc.m), RequiresGrad: true}
	}
	var outs [][]attn.Tensor
	for _, procs := range []int{1, 2, 3} {
		prev := runtime.GOMAXPROCS(procs)
		b := cpu.New()
		res, err := b.Forward(q, k, v, opt)
		if err != nil {
			runtime.GOMAXPROCS(prev)
			t.Fatal(err)
		}
		dO := randTensor(rand.New(rand.NewPCG(2, 2)), tc.dt, res.O.Shape...)
		g, err := b.Backward(q, k, v, res.O, res.LSE, dO, opt)
		runtime.GOMAXPROCS(prev)
		if err != nil {
			t.Fatal(err)
		}
		o := []attn.Tensor{res.O, res.LSE, g.DQ, g.DK, g.DV}
		if g.DBias != nil {
			o = append(o, *g.DBias)
		}
		outs = append(outs, o)
	}
	for p := 1; p < len(outs); p++ {
		for i := range outs[0] {
			if !bitsEqual(outs[0][i], outs[p][i]) {
				t.Errorf("output %d differs between GOMAXPROCS 1 and %d", i, p+1)
			}
		}
	}
}

// TestVarlenMatchesPadded checks the packed layout against separate padded
// calls of each segment, for the reference and the fast path alike.
func TestVarlenMatchesPadded(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 9))
	seqQ, seqK := []int{3, 0, 70}, []int{5, 2, 66}
	const h, hkv, d = 2, 1, 8
	var cq, ck []int32
	cq, ck = append(cq, 0), append(ck, 0)
	for i := range seqQ {
		cq = append(cq, cq[i]+int32(seqQ[i]))
		ck = append(ck, ck[i]+int32(seqK[i]))
	}
	tq, tk := int(cq[len(seqQ)]), int(ck[len(seqK)])
	q, k, v := randTensor(r, attn.Float32, tq, h, d), randTensor(r, attn.Float32, tk, hkv, d), randTensor(r, attn.Float32, tk, hkv, d)
	opt := attn.Options{Causal: true, CuSeqlensQ: cq, CuSeqlensK: ck}
	packedRef, err := cpu.Reference(q, k, v, opt)
	if err != nil {
		t.Fatal(err)
	}
	packedFast, err := cpu.New().Forward(q, k, v, opt)
	if err != nil {
		t.Fatal(err)
	}
	fast := packedFast.O.Float64s()
	for s := range seqQ {
		segOpt := opt
		segOpt.CuSeqlensQ, segOpt.CuSeqlensK = nil, nil
		sl := func(x attn.Tensor, from, n, heads int) attn.Tensor {
			y := x
			y.Shape = []int{1, n, heads, d}
			y.Strides = []int{max(n, 1) * heads * d, heads * d, d, 1}
			y.Offset = from * heads * d
			return y
		}
		ref, err := cpu.Reference(sl(q, int(cq[s]), seqQ[s], h), sl(k, int(ck[s]), seqK[s], hkv), sl(v, int(ck[s]), seqK[s], hkv), segOpt)
		if err != nil {
			t.Fatal(err)
		}
		for i := range ref.O {
			if off := int(cq[s])*h*d + i; math.Abs(ref.O[i]-packedRef.O[off]) > 1e-12 || math.Abs(ref.O[i]-fast[off]) > 1e-5 {
				t.Fatalf("segment %d element %d: padded %v, packed reference %v, packed fast %v", s, i, ref.O[i], packedRef.O[off], fast[off])
			}
		}
	}
}

// benchKernels returns the implementations the benchmarks cover: the one
// in use first, then the others.
func benchKernels() []string {
	names := []string{vec.Implementation()}
	for _, n := range vec.Implementations() {
		if n != names[0] {
			names = append(names, n)
		}
	}
	return names
}

// benchCases runs f for every implementation of the tile kernels, dtype
// and sequence length of the benchmarks: B=1, H=8, N=M=2048 or 4096, D=64.
// Names read kernels/dtype/N=…, so -bench 'Forward/avx512/fp32' selects.
func benchCases(b *testing.B, f func(b *testing.B, q, k, v attn.Tensor, p *attn.Problem)) {
	const nb, h, d = 1, 8, 64
	for _, kernels := range benchKernels() {
		for _, dt := range []attn.DType{attn.Float32, attn.BFloat16, attn.Float16} {
			for _, n := range []int{2048, 4096} {
				b.Run(fmt.Sprintf("%s/%v/N=%d", kernels, dt, n), func(b *testing.B) {
					useKernels(b, kernels)
					r := rand.New(rand.NewPCG(1, 2))
					q, k, v := randTensor(r, dt, nb, n, h, d), randTensor(r, dt, nb, n, h, d), randTensor(r, dt, nb, n, h, d)
					p, err := attn.NewProblem(q, k, v, attn.Options{})
					if err != nil {
						b.Fatal(err)
					}
					f(b, q, k, v, p)
				})
			}
		}
	}
}

// BenchmarkForward times the forward pass and reports GFLOP/s
// (4·B·H·N·M·D operations).
func BenchmarkForward(b *testing.B) {
	benchCases(b, func(b *testing.B, q, k, v attn.Tensor, p *attn.Problem) {
		be := cpu.New()
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			if _, err := be.Forward(q, k, v, attn.Options{}); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(p.FLOPs()*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
	})
}

// BenchmarkBackward times the backward pass and reports GFLOP/s (counted
// as 2.5 times the forward's operations).
func BenchmarkBackward(b *testing.B) {
	benchCases(b, func(b *testing.B, q, k, v attn.Tensor, p *attn.Problem) {
		be := cpu.New()
		res, err := be.Forward(q, k, v, attn.Options{})
		if err != nil {
			b.Fatal(err)
		}
		dO := randTensor(rand.New(rand.NewPCG(3, 4)), q.DType, res.O.Shape...)
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			if _, err := be.Backward(q, k, v, res.O, res.LSE, dO, attn.Options{}); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(2.5*p.FLOPs()*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
	})
}

// Example runs causal attention over two queries and three keys (bottom-right
// aligned: the last query sees every key).
func Example() {
	q := attn.FromFloat32(attn.Float32, []float32{1, 0, 0, 1}, 1, 2, 1, 2) // [B=1, N=2, H=1, D=2]
	k := attn.FromFloat32(attn.Float32, []float32{1, 0, 0, 1, 1, 1}, 1, 3, 1, 2)
	v := attn.FromFloat32(attn.Float32, []float32{1, 2, 3, 4, 5, 6}, 1, 3, 1, 2)
	res, err := cpu.New().Forward(q, k, v, attn.Options{Causal: true, Scale: 1})
	if err != nil {
		fmt.Println(err)
		return
	}
	o, lse := res.O.Float32s(), res.LSE.Float32s()
	for i := 0; i < 2; i++ {
		fmt.Printf("query %d: O = [%.4f %.4f], LSE = %.4f\n", i, o[2*i], o[2*i+1], lse[i])
	}
	// Output:
	// query 0: O = [1.5379 2.5379], LSE = 1.3133
	// query 1: O = [3.5339 4.5339], LSE = 1.8620
}
