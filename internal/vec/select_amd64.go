//go:build !purego

package vec

import (
	"math"
	"sync"
	"unsafe"

	"golang.org/x/sys/cpu"
)

// Which assembly kernels this CPU (and its operating system, for the
// vector register state) supports. The AVX-512 kernels also use AVX2-era
// instructions and BMI2's BZHI for their masks.
var (
	hasAVX2   = cpu.X86.HasAVX2 && cpu.X86.HasFMA
	hasAVX512 = hasAVX2 && cpu.X86.HasAVX512F && cpu.X86.HasBMI2
	hasBF16   = hasAVX512 && cpu.X86.HasAVX512BF16
)

// avx512 is the AVX-512F implementation.
var avx512 = kernels{
	name:     "avx512",
	matMulNT: matMulNTWith(transpose512, gemmRowA512, panel512),
	matMulNN: matMulNNWith(gemmRowA512, panel512),
	matMulTN: matMulTNWith(gemmColA512, panel512),
	expSub:   expSub512,
	max:      max512,
	scale:    scale512,
	bf16:     func(dst []float32, src []uint16) { convertTail(dst, src, 16, bf16ToFloat32512, bf16ToFloat32Go) },
	fp16:     func(dst []float32, src []uint16) { convertTail(dst, src, 16, float16ToFloat32512, float16ToFloat32Go) },
	softmaxOnline: func(s []float32, lds, rows, cols int, scale float32, m, l, alpha []float32) {
		softmaxOnline512(&s[0], lds, rows, cols, scale, &m[0], &l[0], &alpha[0])
	},
	expRows: func(s []float32, lds, rows, cols int, scale float32, lse []float32) {
		expRows512(&s[0], lds, rows, cols, scale, &lse[0])
	},
	softmaxGrad: func(p []float32, ldp int, dp []float32, lddp, rows, cols int, delta []float32) {
		softmaxGrad512(&p[0], ldp, &dp[0], lddp, rows, cols, &delta[0])
	},
	scaleTo:    scaleTo512,
	toBF16:     toBF16512,
	toFP16:     toFloat16512,
	dot:        dot512,
	transpose:  transposeWith(transpose512, 16),
	matMulBF16: matMulBF16Go,

	transposePairs: transposePairsWith(transpose512, 16),
	interleave: func(dst, a, b []uint16) {
		n := len(a) - len(a)%16
		if n > 0 {
			interleave512(dst, a[:n], b)
		}
		interleaveGo(dst[2*n:], a[n:], b[n:])
	},
}

// avx512BF16 is avx512 with the bfloat16 products of AVX512_BF16.
var avx512BF16 = func() kernels {
	k := avx512
	k.name = "avx512bf16"
	k.matMulBF16 = matMulBF16512
	k.nativeBF16 = true
	return k
}()

// avx2 is the AVX2+FMA implementation.
var avx2 = kernels{
	name:     "avx2",
	matMulNT: matMulNTWith(transposeAVX2, gemmRowAAVX2, panelAVX2),
	matMulNN: matMulNNWith(gemmRowAAVX2, panelAVX2),
	matMulTN: matMulTNWith(gemmColAAVX2, panelAVX2),
	expSub:   expSubAVX2Tail,
	max:      maxAVX2Tail,
	scale:    scaleAVX2Tail,
	bf16:     func(dst []float32, src []uint16) { convertTail(dst, src, 8, bf16ToFloat32AVX2, bf16ToFloat32Go) },
	fp16:     func(dst []float32, src []uint16) { convertTail(dst, src, 8, float16ToFloat32AVX2, float16ToFloat32Go) },
	// The tile kernels of the softmax run the AVX2 row kernels; the rest
	// is the portable code.
	softmaxOnline: softmaxOnlineWith(maxAVX2Tail, expSubAVX2Tail, scaleAVX2Tail),
	expRows:       expRowsWith(expSubAVX2Tail, scaleAVX2Tail),
	softmaxGrad:   softmaxGradGo,
	scaleTo:       scaleToGo,
	toBF16:        toBF16Go,
	toFP16:        toFP16Go,
	dot:           dotGo,
	transpose:     transposeWith(transposeAVX2, 8),
	matMulBF16:    matMulBF16Go,

	transposePairs: transposePairsWith(transposeAVX2, 8),
	interleave:     interleaveGo,
}

// selectKernels returns the fastest implementation the CPU supports.
func selectKernels() kernels {
	switch {
	case hasBF16:
		return avx512BF16
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
	if hasBF16 {
		ks = append(ks, avx512BF16)
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

// gemmPanel is the signature of the assembly product kernels: C (+)= A·B
// for a panel of mr ≤ panel rows of C (gemmRowA*: A row-major; gemmColA*:
// A stored transposed, its rows are columns).
type gemmPanel func(mr, k, n int, a *float32, lda int, b *float32, ldb int, c *float32, ldc int, acc bool)

// transposeBlock is the signature of the assembly transposes.
type transposeBlock func(rows, cols int, src *float32, lds int, dst *float32, ldd int)

// matMulNNWith runs gemm (row-major A) panel by panel: MatMulNN.
func matMulNNWith(gemm gemmPanel, panel int) func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	return func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
		for i := 0; i < m; i += panel {
			gemm(min(panel, m-i), k, n, &a[i*lda], lda, &b[0], ldb, &c[i*ldc], ldc, acc)
		}
	}
}

// matMulTNWith runs gemm (transposed A) panel by panel: MatMulTN.
func matMulTNWith(gemm gemmPanel, panel int) func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	return func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
		for i := 0; i < m; i += panel {
			gemm(min(panel, m-i), k, n, &a[i], lda, &b[0], ldb, &c[i*ldc], ldc, acc)
		}
	}
}

// matMulNTWith is MatMulNT from a transpose and a row-major-A product:
// B is transposed ntKC×ntNC at a time into a pooled buffer and multiplied
// from there. It sums over k in chunks of ntKC: each chunk adds its partial
// products to C, so an element's summation order depends only on k.
func matMulNTWith(transpose transposeBlock, gemm gemmPanel, panel int) func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	return func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
		bt := ntBuffers.Get().(*[ntKC * ntNC]float32)
		defer ntBuffers.Put(bt)
		for j := 0; j < n; j += ntNC {
			nc := min(ntNC, n-j)
			for p := 0; p < k; p += ntKC {
				kc := min(ntKC, k-p)
				transpose(nc, kc, &b[j*ldb+p], ldb, &bt[0], ntNC)
				for i := 0; i < m; i += panel {
					gemm(min(panel, m-i), kc, nc, &a[i*lda+p], lda, &bt[0], ntNC, &c[i*ldc+j], ldc, acc || p > 0)
				}
			}
		}
	}
}

// matMulBF16512 runs gemmBF16512 panel by panel.
func matMulBF16512(m, n, k int, a []uint16, lda int, b []uint16, ldb int, c []float32, ldc int, acc bool) {
	for i := 0; i < m; i += panel512 {
		gemmBF16512(min(panel512, m-i), k/2, n, &a[i*lda], lda, &b[0], ldb, &c[i*ldc], ldc, acc)
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

// transposeWith builds Transpose from an assembly kernel that handles
// whole groups of lanes rows (it would zero-fill a partial group) and the
// portable code for the remaining rows.
func transposeWith(kernel func(rows, cols int, src *float32, lds int, dst *float32, ldd int), lanes int) func(rows, cols int, src []float32, lds int, dst []float32, ldd int) {
	return func(rows, cols int, src []float32, lds int, dst []float32, ldd int) {
		full := rows - rows%lanes
		if full > 0 {
			kernel(full, cols, &src[0], lds, &dst[0], ldd)
		}
		if full < rows {
			transposeGo(rows-full, cols, src[full*lds:], lds, dst[full:], ldd)
		}
	}
}

// transposePairsWith builds TransposePairs from a float32 transpose kernel:
// a pair of 16-bit values moves as one 32-bit lane, which the kernel's
// loads, shuffles and stores carry bit for bit.
func transposePairsWith(kernel func(rows, cols int, src *float32, lds int, dst *float32, ldd int), lanes int) func(rows, pairs int, src []uint16, lds int, dst []uint16, ldd int) {
	return func(rows, pairs int, src []uint16, lds int, dst []uint16, ldd int) {
		full := rows - rows%lanes
		if full > 0 {
			kernel(full, pairs, (*float32)(unsafe.Pointer(&src[0])), lds/2, (*float32)(unsafe.Pointer(&dst[0])), ldd/2)
		}
		if full < rows {
			transposePairsGo(rows-full, pairs, src[full*lds:], lds, dst[2*full:], ldd)
		}
	}
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
