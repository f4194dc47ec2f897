package vec

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkMatMul times 64×64×64 tiles of each product with every
// implementation the machine has and reports GFLOP/s (2·m·n·k per call).
func BenchmarkMatMul(b *testing.B) {
	const m, n, k = 64, 64, 64
	r := rand.New(rand.NewPCG(7, 7))
	eachProduct(func(im kernels, kd kind) {
		a, ac, bm, bc := kd.operands(r, m, n, k)
		c := make([]float32, m*n)
		f := kd.fn(im)
		b.Run(kd.String()+"/"+im.name, func(b *testing.B) {
			for b.Loop() {
				f(m, n, k, a, ac, bm, bc, c, n, true)
			}
			b.ReportMetric(2*m*n*k*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
	})
}

// BenchmarkExpSub times ExpSub on 4096 elements in the softmax range and
// reports billions of elements per second.
func BenchmarkExpSub(b *testing.B) {
	const n = 4096
	r := rand.New(rand.NewPCG(8, 8))
	src := make([]float32, n)
	for i := range src {
		src[i] = -20 * r.Float32()
	}
	x := make([]float32, n)
	for _, im := range available() {
		b.Run(im.name, func(b *testing.B) {
			for b.Loop() {
				copy(x, src)
				im.expSub(x, 0.5)
			}
			b.ReportMetric(n*float64(b.N)/b.Elapsed().Seconds()/1e9, "Gelem/s")
		})
	}
}

// BenchmarkMax times Max on 4096 elements.
func BenchmarkMax(b *testing.B) {
	const n = 4096
	r := rand.New(rand.NewPCG(9, 9))
	x := make([]float32, n)
	for i := range x {
		x[i] = r.Float32()
	}
	for _, im := range available() {
		b.Run(im.name, func(b *testing.B) {
			for b.Loop() {
				im.max(x)
			}
			b.ReportMetric(n*float64(b.N)/b.Elapsed().Seconds()/1e9, "Gelem/s")
		})
	}
}

// BenchmarkConvert times the 16-bit converters on 4096 elements.
func BenchmarkConvert(b *testing.B) {
	src := allHalves()[:4096]
	dst := make([]float32, len(src))
	for _, im := range available() {
		b.Run("bf16/"+im.name, func(b *testing.B) {
			for b.Loop() {
				im.bf16(dst, src)
			}
			b.ReportMetric(float64(len(src))*float64(b.N)/b.Elapsed().Seconds()/1e9, "Gelem/s")
		})
		b.Run("fp16/"+im.name, func(b *testing.B) {
			for b.Loop() {
				im.fp16(dst, src)
			}
			b.ReportMetric(float64(len(src))*float64(b.N)/b.Elapsed().Seconds()/1e9, "Gelem/s")
		})
	}
}

// BenchmarkMatMulBF16 times 64×64×64 bfloat16 tiles with every
// implementation and reports GFLOP/s (2·m·n·k per call).
func BenchmarkMatMulBF16(b *testing.B) {
	const m, n, k = 64, 64, 64
	r := rand.New(rand.NewPCG(7, 8))
	a := bf16Mat(r, m, k, k)
	bm := bf16Mat(r, k/2, 2*n, 2*n)
	c := make([]float32, m*n)
	for _, im := range available() {
		b.Run(im.name, func(b *testing.B) {
			for b.Loop() {
				im.matMulBF16(m, n, k, a, k, bm, 2*n, c, n, true)
			}
			b.ReportMetric(2*m*n*k*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
	}
}

// BenchmarkSoftmaxOnline times the online-softmax update of a 64×64 score
// tile and reports billions of elements per second.
func BenchmarkSoftmaxOnline(b *testing.B) {
	const rows, cols = 64, 64
	r := rand.New(rand.NewPCG(10, 10))
	src := make([]float32, rows*cols)
	for i := range src {
		src[i] = 8 * float32(r.NormFloat64())
	}
	s := make([]float32, rows*cols)
	m, l, alpha := make([]float32, rows), make([]float32, rows), make([]float32, rows)
	for _, im := range available() {
		b.Run(im.name, func(b *testing.B) {
			for b.Loop() {
				copy(s, src)
				for i := range m {
					m[i], l[i] = 1, 1
				}
				im.softmaxOnline(s, cols, rows, cols, 0.125, m, l, alpha)
			}
			b.ReportMetric(rows*cols*float64(b.N)/b.Elapsed().Seconds()/1e9, "Gelem/s")
		})
	}
}
