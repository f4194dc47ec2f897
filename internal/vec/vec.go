package vec

import (
	"fmt"
	"math"
)

// kernels is one implementation of the package's tile kernels. The
// exported functions validate their arguments and then call the selected
// implementation, which may assume valid arguments with m, n, k > 0.
type kernels struct {
	name     string
	matMulNT func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool)
	matMulNN func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool)
	matMulTN func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool)
	expSub   func(x []float32, m float32) float32
	max      func(x []float32) float32
	scale    func(x []float32, s float32)
	bf16     func(dst []float32, src []uint16)
	fp16     func(dst []float32, src []uint16)
}

// pureGo is the portable implementation.
var pureGo = kernels{
	name:     "go",
	matMulNT: matMulNTGo,
	matMulNN: matMulNNGo,
	matMulTN: matMulTNGo,
	expSub:   expSubGo,
	max:      maxGo,
	scale:    scaleGo,
	bf16:     bf16ToFloat32Go,
	fp16:     float16ToFloat32Go,
}

// impl is the implementation the exported functions use, chosen at
// start-up (see selectKernels in the architecture-specific files).
var impl = selectKernels()

// Implementation reports the name of the implementation in use: "avx512",
// "avx2" or "go".
func Implementation() string { return impl.name }

// MatMulNT computes C = A·Bᵀ (acc false) or C += A·Bᵀ (acc true), where A is
// m×k with leading dimension lda, B is n×k with leading dimension ldb and C is
// m×n with leading dimension ldc:
//
//	C[i*ldc+j] (+)= Σ_p A[i*lda+p]·B[j*ldb+p]
//
// It panics if a dimension is negative, a leading dimension is shorter than
// its row or a slice is too short.
func MatMulNT(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	checkMat("MatMulNT", "a", a, m, k, lda)
	checkMat("MatMulNT", "b", b, n, k, ldb)
	if !prologue("MatMulNT", m, n, k, c, ldc, acc) {
		return
	}
	impl.matMulNT(m, n, k, a, lda, b, ldb, c, ldc, acc)
}

// MatMulNN computes C = A·B (acc false) or C += A·B (acc true), where A is m×k
// with leading dimension lda, B is k×n with leading dimension ldb and C is m×n
// with leading dimension ldc:
//
//	C[i*ldc+j] (+)= Σ_p A[i*lda+p]·B[p*ldb+j]
//
// It panics if a dimension is negative, a leading dimension is shorter than
// its row or a slice is too short.
func MatMulNN(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	checkMat("MatMulNN", "a", a, m, k, lda)
	checkMat("MatMulNN", "b", b, k, n, ldb)
	if !prologue("MatMulNN", m, n, k, c, ldc, acc) {
		return
	}
	impl.matMulNN(m, n, k, a, lda, b, ldb, c, ldc, acc)
}

// MatMulTN computes C = Aᵀ·B (acc false) or C += Aᵀ·B (acc true), where A is
// k×m with leading dimension lda, B is k×n with leading dimension ldb and C is
// m×n with leading dimension ldc:
//
//	C[i*ldc+j] (+)= Σ_p A[p*lda+i]·B[p*ldb+j]
//
// It panics if a dimension is negative, a leading dimension is shorter than
// its row or a slice is too short.
func MatMulTN(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	checkMat("MatMulTN", "a", a, k, m, lda)
	checkMat("MatMulTN", "b", b, k, n, ldb)
	if !prologue("MatMulTN", m, n, k, c, ldc, acc) {
		return
	}
	impl.matMulTN(m, n, k, a, lda, b, ldb, c, ldc, acc)
}

// ExpSub replaces every x[i] by exp(x[i]-m) and returns the sum of the new
// values. exp(-Inf) is 0, so masked scores (-Inf) contribute nothing. The
// result is accurate to a few units in the last place for x[i]-m ≤ 0 (the
// softmax range); arguments above about 88.7 overflow to +Inf and arguments
// below about -103.9 underflow to 0. When m is -Inf (a row with no visible
// key) every -Inf element becomes 0 and every other element +Inf. NaN
// propagates.
func ExpSub(x []float32, m float32) float32 {
	if len(x) == 0 {
		return 0
	}
	if math.IsInf(float64(m), -1) {
		return expSubNegInf(x)
	}
	return impl.expSub(x, m)
}

// expSubNegInf is ExpSub for m = -Inf, where x[i]-m would be NaN for x[i] =
// -Inf: those elements become 0 and all others exp(+Inf) = +Inf (or NaN).
func expSubNegInf(x []float32) float32 {
	var sum float32
	for i, v := range x {
		switch {
		case math.IsInf(float64(v), -1):
			x[i] = 0
		case v != v:
			// NaN stays NaN.
		default:
			x[i] = float32(math.Inf(1))
		}
		sum += x[i]
	}
	return sum
}

// Max returns the largest element of x, or -Inf if x is empty. NaN elements
// are ignored.
func Max(x []float32) float32 {
	if len(x) == 0 {
		return float32(math.Inf(-1))
	}
	return impl.max(x)
}

// Scale multiplies every element of x by s.
func Scale(x []float32, s float32) {
	if len(x) == 0 {
		return
	}
	impl.scale(x, s)
}

// BF16ToFloat32 converts the bfloat16 values in src to float32 in dst,
// exactly (NaN payloads are kept). It panics if dst is shorter than src.
func BF16ToFloat32(dst []float32, src []uint16) {
	if len(dst) < len(src) {
		panic(fmt.Sprintf("vec.BF16ToFloat32: len(dst) = %d < len(src) = %d", len(dst), len(src)))
	}
	if len(src) == 0 {
		return
	}
	impl.bf16(dst[:len(src)], src)
}

// Float16ToFloat32 converts the IEEE 754 binary16 values in src to float32 in
// dst, exactly (subnormals, infinities and NaN payloads included). It panics if
// dst is shorter than src.
func Float16ToFloat32(dst []float32, src []uint16) {
	if len(dst) < len(src) {
		panic(fmt.Sprintf("vec.Float16ToFloat32: len(dst) = %d < len(src) = %d", len(dst), len(src)))
	}
	if len(src) == 0 {
		return
	}
	impl.fp16(dst[:len(src)], src)
}

// checkMat panics unless x can hold a rows×cols matrix with leading
// dimension ld.
func checkMat(fn, name string, x []float32, rows, cols, ld int) {
	if rows < 0 || cols < 0 {
		panic(fmt.Sprintf("vec.%s: negative dimension %d×%d for %s", fn, rows, cols, name))
	}
	if rows == 0 || cols == 0 {
		return
	}
	if ld < cols {
		panic(fmt.Sprintf("vec.%s: ld%s = %d < %d", fn, name, ld, cols))
	}
	if need := (rows-1)*ld + cols; len(x) < need {
		panic(fmt.Sprintf("vec.%s: len(%s) = %d < %d", fn, name, len(x), need))
	}
}

// prologue validates C and handles the degenerate cases: it returns false
// when there is nothing left for a kernel to do (m or n is 0, or k is 0, in
// which case C is zeroed unless acc).
func prologue(fn string, m, n, k int, c []float32, ldc int, acc bool) bool {
	checkMat(fn, "c", c, m, n, ldc)
	if m == 0 || n == 0 {
		return false
	}
	if k == 0 {
		if !acc {
			for i := 0; i < m; i++ {
				clear(c[i*ldc : i*ldc+n])
			}
		}
		return false
	}
	return true
}
