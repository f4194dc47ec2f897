package vec

import (
	"math"

	"github.com/flashattn/flashattn/half"
)

// matMulNTGo is the portable C (+)= A·Bᵀ. For each row of A it forms four
// dot products at a time, each summed in order of p.
func matMulNTGo(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	for i := 0; i < m; i++ {
		ar := a[i*lda : i*lda+k]
		cr := c[i*ldc : i*ldc+n]
		j := 0
		for ; j+4 <= n; j += 4 {
			b0 := b[j*ldb : j*ldb+k]
			b1 := b[(j+1)*ldb : (j+1)*ldb+k]
			b2 := b[(j+2)*ldb : (j+2)*ldb+k]
			b3 := b[(j+3)*ldb : (j+3)*ldb+k]
			var s0, s1, s2, s3 float32
			for p, av := range ar {
				s0 += av * b0[p]
				s1 += av * b1[p]
				s2 += av * b2[p]
				s3 += av * b3[p]
			}
			if acc {
				s0 += cr[j]
				s1 += cr[j+1]
				s2 += cr[j+2]
				s3 += cr[j+3]
			}
			cr[j], cr[j+1], cr[j+2], cr[j+3] = s0, s1, s2, s3
		}
		for ; j < n; j++ {
			br := b[j*ldb : j*ldb+k]
			var s float32
			for p, av := range ar {
				s += av * br[p]
			}
			if acc {
				s += cr[j]
			}
			cr[j] = s
		}
	}
}

// matMulNNGo is the portable C (+)= A·B.
func matMulNNGo(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	matMulXNGo(m, n, k, a, lda, 1, b, ldb, c, ldc, acc)
}

// matMulTNGo is the portable C (+)= Aᵀ·B.
func matMulTNGo(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	matMulXNGo(m, n, k, a, 1, lda, b, ldb, c, ldc, acc)
}

// matMulXNGo computes C (+)= A·B where element (i, p) of A is at
// a[i*ai+p*ap]. Each row of C is updated with four rows of B at a time:
// c[j] = c[j] + a0·b0[j] + a1·b1[j] + a2·b2[j] + a3·b3[j], in that order.
func matMulXNGo(m, n, k int, a []float32, ai, ap int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	for i := 0; i < m; i++ {
		cr := c[i*ldc : i*ldc+n]
		if !acc {
			clear(cr)
		}
		p := 0
		for ; p+4 <= k; p += 4 {
			a0 := a[i*ai+p*ap]
			a1 := a[i*ai+(p+1)*ap]
			a2 := a[i*ai+(p+2)*ap]
			a3 := a[i*ai+(p+3)*ap]
			b0 := b[p*ldb : p*ldb+n]
			b1 := b[(p+1)*ldb : (p+1)*ldb+n]
			b2 := b[(p+2)*ldb : (p+2)*ldb+n]
			b3 := b[(p+3)*ldb : (p+3)*ldb+n]
			for j := range cr {
				cr[j] = cr[j] + a0*b0[j] + a1*b1[j] + a2*b2[j] + a3*b3[j]
			}
		}
		for ; p < k; p++ {
			a0 := a[i*ai+p*ap]
			b0 := b[p*ldb : p*ldb+n]
			for j := range cr {
				cr[j] += a0 * b0[j]
			}
		}
	}
}

// expSubGo is the portable ExpSub (m finite); the sum is accumulated in
// float64 in index order.
func expSubGo(x []float32, m float32) float32 {
	var sum float64
	for i, v := range x {
		e := exp32(v - m)
		x[i] = e
		sum += float64(e)
	}
	return float32(sum)
}

// exp32 returns exp(d), computed in float64 and rounded once to float32
// (within 0.51 ulp of the exact value): n = round(d·log2(e)), r = d − n·ln2,
// exp(r) by its Taylor series to degree 8 (|r| ≤ 0.35, relative error below
// 1e-9), scaled by 2ⁿ.
func exp32(d float32) float32 {
	x := float64(d)
	switch {
	case x != x:
		return d
	case x < -104: // exp(-104) rounds to 0, and so does everything below
		return 0
	case x > 89: // exp(89) overflows
		return float32(math.Inf(1))
	}
	const round = 0x1.8p52 // adding and subtracting it rounds to an integer
	n := (x*math.Log2E + round) - round
	r := x - n*math.Ln2
	p := 1 + r*(1+r*(1.0/2+r*(1.0/6+r*(1.0/24+r*(1.0/120+r*(1.0/720+r*(1.0/5040+r*(1.0/40320))))))))
	return float32(p * math.Float64frombits(uint64(int64(n)+1023)<<52))
}

// maxGo is the portable Max (len(x) > 0); NaN elements are ignored.
func maxGo(x []float32) float32 {
	m := float32(math.Inf(-1))
	for _, v := range x {
		if v > m {
			m = v
		}
	}
	return m
}

// scaleGo is the portable Scale.
func scaleGo(x []float32, s float32) {
	i := 0
	for ; i+4 <= len(x); i += 4 {
		x[i] *= s
		x[i+1] *= s
		x[i+2] *= s
		x[i+3] *= s
	}
	for ; i < len(x); i++ {
		x[i] *= s
	}
}

// bf16ToFloat32Go is the portable BF16ToFloat32 (len(dst) == len(src)).
func bf16ToFloat32Go(dst []float32, src []uint16) {
	dst = dst[:len(src)]
	for i, h := range src {
		dst[i] = math.Float32frombits(uint32(h) << 16)
	}
}

// float16ToFloat32Go is the portable Float16ToFloat32 (len(dst) == len(src)).
func float16ToFloat32Go(dst []float32, src []uint16) {
	dst = dst[:len(src)]
	for i, h := range src {
		dst[i] = half.Float16(h).Float32()
	}
}

// softmaxOnlineWith builds SoftmaxOnline from row kernels: scale (skipped
// when the scale is 1), max and expSub, one row at a time.
func softmaxOnlineWith(maxf func([]float32) float32, expSub func([]float32, float32) float32, scale func([]float32, float32)) func(s []float32, lds, rows, cols int, sc float32, m, l, alpha []float32) {
	return func(s []float32, lds, rows, cols int, sc float32, m, l, alpha []float32) {
		for r := 0; r < rows; r++ {
			x := s[r*lds : r*lds+cols]
			if sc != 1 {
				scale(x, sc)
			}
			mNew := m[r]
			if mx := maxf(x); mx > mNew {
				mNew = mx
			}
			if math.IsInf(float64(mNew), -1) {
				clear(x)
				alpha[r] = 1
				continue
			}
			a := float32(1)
			if m[r] != mNew {
				a = exp32(m[r] - mNew)
			}
			sum := expSub(x, mNew)
			l[r] = l[r]*a + sum
			m[r], alpha[r] = mNew, a
		}
	}
}

// expRowsWith builds ExpRows from row kernels: scale (skipped when the
// scale is 1) and expSub, one row at a time.
func expRowsWith(expSub func([]float32, float32) float32, scale func([]float32, float32)) func(s []float32, lds, rows, cols int, sc float32, lse []float32) {
	return func(s []float32, lds, rows, cols int, sc float32, lse []float32) {
		for r := 0; r < rows; r++ {
			x := s[r*lds : r*lds+cols]
			if math.IsInf(float64(lse[r]), -1) {
				clear(x)
				continue
			}
			if sc != 1 {
				scale(x, sc)
			}
			expSub(x, lse[r])
		}
	}
}

// softmaxGradGo is the portable SoftmaxGrad.
func softmaxGradGo(p []float32, ldp int, dp []float32, lddp, rows, cols int, delta []float32) {
	for r := 0; r < rows; r++ {
		pr := p[r*ldp : r*ldp+cols]
		dr := dp[r*lddp : r*lddp+cols]
		d := delta[r]
		for j, x := range pr {
			dr[j] = x * (dr[j] - d)
		}
	}
}

// scaleToGo is the portable ScaleTo (len(dst) == len(src)).
func scaleToGo(dst, src []float32, s float32) {
	dst = dst[:len(src)]
	for i, x := range src {
		dst[i] = x * s
	}
}

// toBF16Go is the portable ScaleToBF16 (len(dst) == len(src)).
func toBF16Go(dst []uint16, src []float32, s float32) {
	dst = dst[:len(src)]
	for i, x := range src {
		dst[i] = uint16(half.BFloat16FromFloat32(x * s))
	}
}

// toFP16Go is the portable ScaleToFloat16 (len(dst) == len(src)).
func toFP16Go(dst []uint16, src []float32, s float32) {
	dst = dst[:len(src)]
	for i, x := range src {
		dst[i] = uint16(half.Float16FromFloat32(x * s))
	}
}

// dotGo is the portable Dot (len(y) == len(x)): the products are summed in
// float64, in index order, and the sum rounded once.
func dotGo(x, y []float32) float32 {
	y = y[:len(x)]
	var s float64
	for i, a := range x {
		s += float64(a) * float64(y[i])
	}
	return float32(s)
}

// transposeGo is the portable Transpose.
func transposeGo(rows, cols int, src []float32, lds int, dst []float32, ldd int) {
	for j := 0; j < rows; j++ {
		for p, x := range src[j*lds : j*lds+cols] {
			dst[p*ldd+j] = x
		}
	}
}

// matMulBF16Go is the portable MatMulBF16: per element, the products of each
// pair added odd then even, C last, as the native instruction does (without
// its flushing of subnormals).
func matMulBF16Go(m, n, k int, a []uint16, lda int, b []uint16, ldb int, c []float32, ldc int, acc bool) {
	bf := func(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }
	for i := 0; i < m; i++ {
		ar := a[i*lda : i*lda+k]
		cr := c[i*ldc : i*ldc+n]
		for j := range cr {
			var s float32
			for p := 0; p < k; p += 2 {
				bp := b[(p/2)*ldb+2*j : (p/2)*ldb+2*j+2]
				s += bf(ar[p+1]) * bf(bp[1])
				s += bf(ar[p]) * bf(bp[0])
			}
			if acc {
				s += cr[j]
			}
			cr[j] = s
		}
	}
}

// transposePairsGo is the portable TransposePairs.
func transposePairsGo(rows, pairs int, src []uint16, lds int, dst []uint16, ldd int) {
	for j := 0; j < rows; j++ {
		sr := src[j*lds : j*lds+2*pairs]
		for p := 0; p < pairs; p++ {
			dst[p*ldd+2*j] = sr[2*p]
			dst[p*ldd+2*j+1] = sr[2*p+1]
		}
	}
}

// interleaveGo is the portable Interleave (len(b) == len(a), len(dst) ==
// 2·len(a)).
func interleaveGo(dst, a, b []uint16) {
	dst = dst[:2*len(a)]
	b = b[:len(a)]
	for i, x := range a {
		dst[2*i], dst[2*i+1] = x, b[i]
	}
}
