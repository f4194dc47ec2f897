package vec

import (
	"fmt"
	"math"
	"sync/atomic"
)

// kernels is one implementation of the package's tile kernels. The
// exported functions validate their arguments and then call the selected
// implementation, which may assume valid arguments with every dimension
// (m, n, k, rows, cols, lengths) > 0.
type kernels struct {
	name          string
	matMulNT      func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool)
	matMulNN      func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool)
	matMulTN      func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool)
	expSub        func(x []float32, m float32) float32
	max           func(x []float32) float32
	scale         func(x []float32, s float32)
	bf16          func(dst []float32, src []uint16)
	fp16          func(dst []float32, src []uint16)
	softmaxOnline func(s []float32, lds, rows, cols int, scale float32, m, l, alpha []float32)
	expRows       func(s []float32, lds, rows, cols int, scale float32, lse []float32)
	softmaxGrad   func(p []float32, ldp int, dp []float32, lddp, rows, cols int, delta []float32)
	scaleTo       func(dst, src []float32, s float32)
	toBF16        func(dst []uint16, src []float32, s float32)
	toFP16        func(dst []uint16, src []float32, s float32)
	dot           func(x, y []float32) float32
	transpose     func(rows, cols int, src []float32, lds int, dst []float32, ldd int)
	// matMulBF16 is native (dedicated bfloat16 dot-product instructions)
	// when nativeBF16 is set, the portable code otherwise.
	matMulBF16 func(m, n, k int, a []uint16, lda int, b []uint16, ldb int, c []float32, ldc int, acc bool)
	nativeBF16 bool
	// transposePairs and interleave move 16-bit data (len(b) ≥ len(a)).
	transposePairs func(rows, pairs int, src []uint16, lds int, dst []uint16, ldd int)
	interleave     func(dst, a, b []uint16)
}

// pureGo is the portable implementation.
var pureGo = kernels{
	name:          "go",
	matMulNT:      matMulNTGo,
	matMulNN:      matMulNNGo,
	matMulTN:      matMulTNGo,
	expSub:        expSubGo,
	max:           maxGo,
	scale:         scaleGo,
	bf16:          bf16ToFloat32Go,
	fp16:          float16ToFloat32Go,
	softmaxOnline: softmaxOnlineWith(maxGo, expSubGo, scaleGo),
	expRows:       expRowsWith(expSubGo, scaleGo),
	softmaxGrad:   softmaxGradGo,
	scaleTo:       scaleToGo,
	toBF16:        toBF16Go,
	toFP16:        toFP16Go,
	dot:           dotGo,
	transpose:     transposeGo,
	matMulBF16:    matMulBF16Go,

	transposePairs: transposePairsGo,
	interleave:     interleaveGo,
}

// impl is the implementation the exported functions use: chosen at
// start-up (see selectKernels in the architecture-specific files), changed
// only by Use.
var impl atomic.Pointer[kernels]

func init() {
	k := selectKernels()
	impl.Store(&k)
}

// Implementation reports the name of the implementation in use:
// "avx512bf16", "avx512", "avx2" or "go".
func Implementation() string { return impl.Load().name }

// Implementations lists the names of the implementations this machine can
// run, the portable "go" first and the one chosen at start-up last.
func Implementations() []string {
	var names []string
	for _, k := range available() {
		names = append(names, k.name)
	}
	return names
}

// Use makes the named implementation (one of Implementations) the one every
// function of the package runs from now on, so that tests and benchmarks
// can exercise each of them. Calls already running finish with the
// implementation they started with. It returns an error, and changes
// nothing, when the machine cannot run that implementation.
func Use(name string) error {
	for _, k := range available() {
		if k.name == name {
			impl.Store(&k)
			return nil
		}
	}
	return fmt.Errorf("vec: implementation %q is not available on this machine (have %v)", name, Implementations())
}

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
	impl.Load().matMulNT(m, n, k, a, lda, b, ldb, c, ldc, acc)
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
	impl.Load().matMulNN(m, n, k, a, lda, b, ldb, c, ldc, acc)
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
	impl.Load().matMulTN(m, n, k, a, lda, b, ldb, c, ldc, acc)
}

// MatMulBF16 computes C = A·B (acc false) or C += A·B (acc true) for
// bfloat16 matrices (raw bit patterns): A is m×k with leading dimension lda,
// and B, k×n, is stored in pairs of rows, so that the two values of a
// column that multiply a pair of A are adjacent:
//
//	C[i*ldc+j] (+)= Σ_p A[i*lda+p]·B[(p/2)*ldb + 2j + p%2]
//
// k, lda and ldb must be even (pad with zeros). The products are exact in
// float32; for p = 0, 2, 4, … the product of p+1 and then that of p are
// added to the float32 sum, each rounded to nearest even, and C is added
// last. The native implementation (NativeBF16) flushes subnormal inputs,
// sums and results to zero. It panics if k, lda or ldb is odd, a dimension
// is negative, a leading dimension is shorter than its row or a slice is
// too short.
func MatMulBF16(m, n, k int, a []uint16, lda int, b []uint16, ldb int, c []float32, ldc int, acc bool) {
	if k%2 != 0 || lda%2 != 0 || ldb%2 != 0 {
		panic(fmt.Sprintf("vec.MatMulBF16: k = %d, lda = %d and ldb = %d must be even", k, lda, ldb))
	}
	checkBits("MatMulBF16", "a", len(a), m, k, lda)
	checkBits("MatMulBF16", "b", len(b), k/2, 2*n, ldb)
	if !prologue("MatMulBF16", m, n, k, c, ldc, acc) {
		return
	}
	impl.Load().matMulBF16(m, n, k, a, lda, b, ldb, c, ldc, acc)
}

// NativeBF16 reports whether the implementation in use computes MatMulBF16
// with bfloat16 dot-product instructions (AVX512_BF16). Without them,
// MatMulBF16 is portable code, slower than converting the operands to
// float32 and calling MatMulNN.
func NativeBF16() bool { return impl.Load().nativeBF16 }

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
	return impl.Load().expSub(x, m)
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
	return impl.Load().max(x)
}

// Scale multiplies every element of x by s.
func Scale(x []float32, s float32) {
	if len(x) == 0 {
		return
	}
	impl.Load().scale(x, s)
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
	impl.Load().bf16(dst[:len(src)], src)
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
	impl.Load().fp16(dst[:len(src)], src)
}

// SoftmaxOnline performs the online-softmax update of a rows×cols score
// tile s (leading dimension lds) with the running maxima m and sums l of its
// rows. For row r, with x its cols elements and t = scale·x:
//
//	mNew     = max(m[r], max t)            (NaN elements ignored)
//	x        = exp(t − mNew)
//	alpha[r] = exp(m[r] − mNew)            (0 when m[r] is -Inf, 1 when mNew = m[r])
//	l[r]     = l[r]·alpha[r] + Σ x
//	m[r]     = mNew
//
// A row whose mNew is -Inf (it has seen no finite score yet) becomes 0 and
// keeps m[r] = -Inf, l[r] and alpha[r] = 1. The caller rescales what it
// accumulated for row r by alpha[r]. The accuracy of exp is that of ExpSub.
// It panics if a slice is too short for the tile or lds < cols.
func SoftmaxOnline(s []float32, lds, rows, cols int, scale float32, m, l, alpha []float32) {
	checkMat("SoftmaxOnline", "s", s, rows, cols, lds)
	checkLen("SoftmaxOnline", "m", len(m), rows)
	checkLen("SoftmaxOnline", "l", len(l), rows)
	checkLen("SoftmaxOnline", "alpha", len(alpha), rows)
	if rows == 0 {
		return
	}
	if cols == 0 {
		for r := range rows {
			alpha[r] = 1
		}
		return
	}
	impl.Load().softmaxOnline(s, lds, rows, cols, scale, m, l, alpha)
}

// ExpRows sets every element x of row r of the rows×cols tile s (leading
// dimension lds) to exp(scale·x − lse[r]), and to 0 in the rows whose lse[r]
// is -Inf: the probabilities of a softmax whose log-sum-exp is known. The
// accuracy of exp is that of ExpSub. It panics if a slice is too short for
// the tile or lds < cols.
func ExpRows(s []float32, lds, rows, cols int, scale float32, lse []float32) {
	checkMat("ExpRows", "s", s, rows, cols, lds)
	checkLen("ExpRows", "lse", len(lse), rows)
	if rows == 0 || cols == 0 {
		return
	}
	impl.Load().expRows(s, lds, rows, cols, scale, lse)
}

// SoftmaxGrad sets dp[r*lddp+j] = p[r*ldp+j]·(dp[r*lddp+j] − delta[r]) for
// every element of the rows×cols tiles p and dp: the gradient of the scores
// of a softmax, given its probabilities p, the gradient dp of the
// probabilities and delta[r] = Σ_j p·dp of row r. It panics if a slice is too
// short for its tile or a leading dimension is smaller than cols.
func SoftmaxGrad(p []float32, ldp int, dp []float32, lddp, rows, cols int, delta []float32) {
	checkMat("SoftmaxGrad", "p", p, rows, cols, ldp)
	checkMat("SoftmaxGrad", "dp", dp, rows, cols, lddp)
	checkLen("SoftmaxGrad", "delta", len(delta), rows)
	if rows == 0 || cols == 0 {
		return
	}
	impl.Load().softmaxGrad(p, ldp, dp, lddp, rows, cols, delta)
}

// ScaleTo sets dst[i] = s·src[i] for every element of src. It panics if dst
// is shorter than src.
func ScaleTo(dst, src []float32, s float32) {
	checkLen("ScaleTo", "dst", len(dst), len(src))
	if len(src) == 0 {
		return
	}
	impl.Load().scaleTo(dst[:len(src)], src, s)
}

// ScaleToBF16 sets dst[i] to s·src[i], rounded to float32 and then to
// bfloat16 to nearest, ties to even, as half.BFloat16FromFloat32 does (NaN
// included). It panics if dst is shorter than src.
func ScaleToBF16(dst []uint16, src []float32, s float32) {
	checkLen("ScaleToBF16", "dst", len(dst), len(src))
	if len(src) == 0 {
		return
	}
	impl.Load().toBF16(dst[:len(src)], src, s)
}

// ScaleToFloat16 sets dst[i] to s·src[i], rounded to float32 and then to
// IEEE 754 binary16 to nearest, ties to even, as half.Float16FromFloat32
// does (subnormals, overflow to infinity and NaN included). It panics if dst
// is shorter than src.
func ScaleToFloat16(dst []uint16, src []float32, s float32) {
	checkLen("ScaleToFloat16", "dst", len(dst), len(src))
	if len(src) == 0 {
		return
	}
	impl.Load().toFP16(dst[:len(src)], src, s)
}

// Dot returns Σ x[i]·y[i] over the elements of x, summed in an order that
// depends only on len(x). It panics if y is shorter than x.
func Dot(x, y []float32) float32 {
	checkLen("Dot", "y", len(y), len(x))
	if len(x) == 0 {
		return 0
	}
	return impl.Load().dot(x, y[:len(x)])
}

// Transpose sets dst[p*ldd+j] = src[j*lds+p] for j < rows and p < cols: the
// rows×cols matrix src (leading dimension lds) becomes the cols×rows matrix
// dst (leading dimension ldd). It panics if a slice is too short or a leading
// dimension smaller than its row.
func Transpose(rows, cols int, src []float32, lds int, dst []float32, ldd int) {
	checkMat("Transpose", "src", src, rows, cols, lds)
	checkMat("Transpose", "dst", dst, cols, rows, ldd)
	if rows == 0 || cols == 0 {
		return
	}
	impl.Load().transpose(rows, cols, src, lds, dst, ldd)
}

// checkBits is checkMat for a 16-bit matrix stored in a slice of length n.
func checkBits(fn, name string, n, rows, cols, ld int) {
	if rows < 0 || cols < 0 {
		panic(fmt.Sprintf("vec.%s: negative dimension %d×%d for %s", fn, rows, cols, name))
	}
	if rows == 0 || cols == 0 {
		return
	}
	if ld < cols {
		panic(fmt.Sprintf("vec.%s: ld%s = %d < %d", fn, name, ld, cols))
	}
	if need := (rows-1)*ld + cols; n < need {
		panic(fmt.Sprintf("vec.%s: len(%s) = %d < %d", fn, name, n, need))
	}
}

// TransposePairs transposes a rows×pairs matrix whose elements are pairs
// of 16-bit values (src, leading dimension lds in uint16 units, both values
// of a pair adjacent):
//
//	dst[p*ldd+2j+t] = src[j*lds+2p+t]    for j < rows, p < pairs, t = 0, 1
//
// It panics if lds or ldd is odd, a slice is too short or a leading
// dimension smaller than its row.
func TransposePairs(rows, pairs int, src []uint16, lds int, dst []uint16, ldd int) {
	if lds%2 != 0 || ldd%2 != 0 {
		panic(fmt.Sprintf("vec.TransposePairs: lds = %d and ldd = %d must be even", lds, ldd))
	}
	checkBits("TransposePairs", "src", len(src), rows, 2*pairs, lds)
	checkBits("TransposePairs", "dst", len(dst), pairs, 2*rows, ldd)
	if rows == 0 || pairs == 0 {
		return
	}
	impl.Load().transposePairs(rows, pairs, src, lds, dst, ldd)
}

// Interleave sets dst[2i] = a[i] and dst[2i+1] = b[i] for every element of
// a; b nil stands for zeros. It panics if b (when not nil) is shorter than
// a or dst shorter than 2·len(a).
func Interleave(dst, a, b []uint16) {
	if b != nil {
		checkLen("Interleave", "b", len(b), len(a))
	}
	checkLen("Interleave", "dst", len(dst), 2*len(a))
	if len(a) == 0 {
		return
	}
	if b == nil {
		for i, x := range a {
			dst[2*i], dst[2*i+1] = x, 0
		}
		return
	}
	impl.Load().interleave(dst[:2*len(a)], a, b[:len(a)])
}

// checkLen panics unless a slice of length n holds at least need elements.
func checkLen(fn, name string, n, need int) {
	if n < need {
		panic(fmt.Sprintf("vec.%s: len(%s) = %d < %d", fn, name, n, need))
	}
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
