//go:build !purego

package vec

import (
	"math"
	"sync"

	"golang.org/x/sys/cpu"
)

// Which assembly kernels this CPU (and its operating system, for the
// vector register state) supports. The AVX-512 kernels also use AVX2-era
// instructions and BMI2's BZHI for their masks.
var (
	hasAVX2   = cpu.X86.HasAVX2 && cpu.X86.HasFMA
	hasAVX512 = hasAVX2 && cpu.X86.HasAVX512F && cpu.X86.HasBMI2
)

// avx512 is the AVX-512F implementation.
var avx512 = kernels{
	name:     "avx512",
	matMulNT: matMulNT512,
	matMulNN: matMulNN512,
	matMulTN: matMulTN512,
	expSub:   expSub512,
	max:      max512,
	scale:    scale512,
	bf16:     func(dst []float32, src []uint16) { convertTail(dst, src, 16, bf16ToFloat32512, bf16ToFloat32Go) },
	fp16:     func(dst []float32, src []uint16) { convertTail(dst, src, 16, float16ToFloat32512, float16ToFloat32Go) },
}

// avx2 is the AVX2+FMA implementation.
var avx2 = kernels{
	name:     "avx2",
	matMulNT: matMulNTAVX2,
	matMulNN: matMulNNAVX2,
	matMulTN: matMulTNAVX2,
	expSub:   expSubAVX2Tail,
	max:      maxAVX2Tail,
	scale:    scaleAVX2Tail,
	bf16:     func(dst []float32, src []uint16) { convertTail(dst, src, 8, bf16ToFloat32AVX2, bf16ToFloat32Go) },
	fp16:     func(dst []float32, src []uint16) { convertTail(dst, src, 8, float16ToFloat32AVX2, float16ToFloat32Go) },
}

// selectKernels returns the fastest implementation the CPU supports.
func selectKernels() kernels {
	switch {
	case hasAVX512:
		return avx512
	case hasAVX2:
		return avx2
	}
	return pureGo
}

// available lists every implementation this machine can run.
func available() []kernels {
	ks := []kernels{pureGo}
	if hasAVX2 {
		ks = append(ks, avx2)
	}
	if hasAVX512 {
		ks = append(ks, avx512)
	}
	return ks
}

// Blocking of MatMulNT: B is transposed ntKC×ntNC at a time into a pooled
// buffer, and C (+)= A·Bᵀ is computed from it with the A·B panels.
const (
	ntKC = 128
	ntNC = 64
)

// ntBuffers holds *[ntKC * ntNC]float32 buffers for the transposed B. A pool
// rather than a stack array: the array would be zeroed on every call, and
// the zeroing costs more than the transpose and evicts the operands from L1.
var ntBuffers = sync.Pool{New: func() any { return new([ntKC * ntNC]float32) }}

func matMulNN512(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	for i := 0; i < m; i += panel512 {
		gemmRowA512(min(panel512, m-i), k, n, &a[i*lda], lda, &b[0], ldb, &c[i*ldc], ldc, acc)
	}
}

func matMulTN512(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	for i := 0; i < m; i += panel512 {
		gemmColA512(min(panel512, m-i), k, n, &a[i], lda, &b[0], ldb, &c[i*ldc], ldc, acc)
	}
}

// matMulNT512 sums over k in chunks of ntKC: each chunk adds its partial
// products to C, so an element's summation order depends only on k.
func matMulNT512(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	bt := ntBuffers.Get().(*[ntKC * ntNC]float32)
	defer ntBuffers.Put(bt)
	for j := 0; j < n; j += ntNC {
		nc := min(ntNC, n-j)
		for p := 0; p < k; p += ntKC {
			kc := min(ntKC, k-p)
			transpose512(nc, kc, &b[j*ldb+p], ldb, &bt[0], ntNC)
			for i := 0; i < m; i += panel512 {
				gemmRowA512(min(panel512, m-i), kc, nc, &a[i*lda+p], lda, &bt[0], ntNC, &c[i*ldc+j], ldc, acc || p > 0)
			}
		}
	}
}

func matMulNNAVX2(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	for i := 0; i < m; i += panelAVX2 {
		gemmRowAAVX2(min(panelAVX2, m-i), k, n, &a[i*lda], lda, &b[0], ldb, &c[i*ldc], ldc, acc)
	}
}

func matMulTNAVX2(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	for i := 0; i < m; i += panelAVX2 {
		gemmColAAVX2(min(panelAVX2, m-i), k, n, &a[i], lda, &b[0], ldb, &c[i*ldc], ldc, acc)
	}
}

// matMulNTAVX2 is matMulNT512 with the AVX2 kernels.
func matMulNTAVX2(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	bt := ntBuffers.Get().(*[ntKC * ntNC]float32)
	defer ntBuffers.Put(bt)
	for j := 0; j < n; j += ntNC {
		nc := min(ntNC, n-j)
		for p := 0; p < k; p += ntKC {
			kc := min(ntKC, k-p)
			transposeAVX2(nc, kc, &b[j*ldb+p], ldb, &bt[0], ntNC)
			for i := 0; i < m; i += panelAVX2 {
				gemmRowAAVX2(min(panelAVX2, m-i), kc, nc, &a[i*lda+p], lda, &bt[0], ntNC, &c[i*ldc+j], ldc, acc || p > 0)
			}
		}
	}
}

// expSubAVX2Tail runs expSubAVX2 on whole vectors and on the last partial
// vector padded with -Inf (which contributes exp(-Inf) = 0 to the sum).
func expSubAVX2Tail(x []float32, m float32) float32 {
	n8 := len(x) &^ 7
	var sum float32
	if n8 > 0 {
		sum = expSubAVX2(x[:n8], m)
	}
	if n8 < len(x) {
		var t [8]float32
		for i := range t {
			t[i] = float32(math.Inf(-1))
		}
		copy(t[:], x[n8:])
		sum += expSubAVX2(t[:], m)
		copy(x[n8:], t[:])
	}
	return sum
}

// maxAVX2Tail runs maxAVX2 on whole vectors and the portable code on the
// rest.
func maxAVX2Tail(x []float32) float32 {
	n8 := len(x) &^ 7
	m := float32(math.Inf(-1))
	if n8 > 0 {
		m = maxAVX2(x[:n8])
	}
	for _, v := range x[n8:] {
		if v > m {
			m = v
		}
	}
	return m
}

// scaleAVX2Tail runs scaleAVX2 on whole vectors and the portable code on
// the rest.
func scaleAVX2Tail(x []float32, s float32) {
	n8 := len(x) &^ 7
	if n8 > 0 {
		scaleAVX2(x[:n8], s)
	}
	scaleGo(x[n8:], s)
}

// convertTail runs the vector converter vec on whole vectors of lanes
// elements and the portable one on the rest.
func convertTail(dst []float32, src []uint16, lanes int, vec, tail func([]float32, []uint16)) {
	nv := len(src) - len(src)%lanes
	if nv > 0 {
		vec(dst[:nv], src[:nv])
	}
	tail(dst[nv:], src[nv:])
}
