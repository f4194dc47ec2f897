package vec

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/half"
)

var negInf = float32(math.Inf(-1))

// expClose reports whether got is exp(arg) within a few units in the last
// place, plus the effect of an absolute error argErr in the argument and of
// rounding the argument to float32.
func expClose(got float32, arg, argErr float64) bool {
	if math.IsInf(arg, -1) {
		return got == 0
	}
	want := math.Exp(arg)
	tol := want * (4*0x1p-24 + argErr + 0x1p-24*math.Abs(arg))
	return math.Abs(float64(got)-want) <= tol+1e-44
}

// tileCols are the column counts of the tile tests: around every vector
// width and block of four vectors.
var tileCols = []int{1, 2, 7, 8, 15, 16, 17, 31, 33, 48, 63, 64, 65, 100, 130}

// newTile returns a rows×cols tile with leading dimension ld whose padding
// (and a guard after it) holds poison, with elements from f.
func newTile(rows, cols, ld int, f func(i, j int) float32) []float32 {
	x := make([]float32, rows*ld+16)
	for i := range x {
		x[i] = poison
	}
	for i := 0; i < rows; i++ {
		for j := 0; j < cols; j++ {
			x[i*ld+j] = f(i, j)
		}
	}
	return x
}

// checkPadding fails unless every element of got outside the tile equals
// the one in orig.
func checkPadding(t *testing.T, got, orig []float32, rows, cols, ld int) {
	t.Helper()
	for idx := range got {
		if i, j := idx/ld, idx%ld; i < rows && j < cols {
			continue
		}
		if math.Float32bits(got[idx]) != math.Float32bits(orig[idx]) {
			t.Fatalf("element %d outside the %d×%d tile (ld %d) was written", idx, rows, cols, ld)
		}
	}
}

func TestSoftmaxOnline(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 11))
	for _, im := range available() {
		for _, cols := range tileCols {
			for _, sc := range []struct {
				rows  int
				scale float32
			}{{7, 0.125}, {16, 1}, {37, -0.7}, {64, 0.25}} {
				rows, scale := sc.rows, sc.scale
				t.Run(fmt.Sprintf("%s/cols=%d/rows=%d/scale=%v", im.name, cols, rows, scale), func(t *testing.T) {
					ld := cols + 3
					s := newTile(rows, cols, ld, func(i, j int) float32 {
						switch {
						case scale < 0: // -Inf would become +Inf
						case i%7 == 1: // masked row that has seen nothing yet
							return negInf
						case i%7 == 2 && j%3 == 0: // partly masked
							return negInf
						}
						return 8 * float32(r.NormFloat64())
					})
					in := append([]float32(nil), s...)
					m0s := []float32{negInf, negInf, 0.5, 40, -3, negInf, 1}
					l0s := []float32{0, 0, 2, 7, 1.5, 0, 3}
					m, l := make([]float32, rows+1), make([]float32, rows+1)
					for i := range m {
						m[i], l[i] = m0s[i%7], l0s[i%7]
					}
					alpha := make([]float32, rows+1)
					alpha[rows] = 5 // guard
					m, l, alpha = m[:rows:rows+1], l[:rows:rows+1], alpha[:rows:rows+1]
					m0, l0 := append([]float32(nil), m...), append([]float32(nil), l...)
					im.softmaxOnline(s, ld, rows, cols, scale, m, l, alpha)
					checkPadding(t, s, in, rows, cols, ld)
					if m[:rows+1][rows] != m0s[rows%7] || l[:rows+1][rows] != l0s[rows%7] || alpha[:rows+1][rows] != 5 {
						t.Fatalf("m, l or alpha written beyond rows")
					}
					for i := 0; i < rows; i++ {
						mNew := m0[i]
						for j := 0; j < cols; j++ {
							mNew = max(mNew, in[i*ld+j]*scale)
						}
						if m[i] != mNew {
							t.Fatalf("row %d: m = %v, want %v", i, m[i], mNew)
						}
						if math.IsInf(float64(mNew), -1) {
							for j := 0; j < cols; j++ {
								if s[i*ld+j] != 0 {
									t.Fatalf("masked row %d: x[%d] = %v, want 0", i, j, s[i*ld+j])
								}
							}
							if alpha[i] != 1 || l[i] != l0[i] {
								t.Fatalf("masked row %d: alpha %v, l %v; want 1, %v", i, alpha[i], l[i], l0[i])
							}
							continue
						}
						var sum float64
						for j := 0; j < cols; j++ {
							xs := float64(in[i*ld+j]) * float64(scale)
							arg := xs - float64(mNew)
							if !expClose(s[i*ld+j], arg, 0x1p-24*math.Abs(xs)) {
								t.Fatalf("row %d col %d: exp(%v) = %v, want %v", i, j, arg, s[i*ld+j], math.Exp(arg))
							}
							sum += float64(s[i*ld+j])
						}
						wantAlpha := math.Exp(float64(m0[i]) - float64(mNew))
						if m0[i] == mNew {
							if alpha[i] != 1 {
								t.Fatalf("row %d: alpha = %v with an unchanged maximum, want 1", i, alpha[i])
							}
						} else if !expClose(alpha[i], float64(m0[i])-float64(mNew), 0) {
							t.Fatalf("row %d: alpha = %v, want %v", i, alpha[i], wantAlpha)
						}
						wantL := float64(l0[i])*float64(alpha[i]) + sum
						if math.Abs(float64(l[i])-wantL) > 1e-6*wantL {
							t.Fatalf("row %d: l = %v, want %v", i, l[i], wantL)
						}
					}
				})
			}
		}
	}
}

func TestExpRows(t *testing.T) {
	r := rand.New(rand.NewPCG(12, 12))
	for _, im := range available() {
		for _, cols := range tileCols {
			for _, scale := range []float32{0.125, 1} {
				t.Run(fmt.Sprintf("%s/cols=%d/scale=%v", im.name, cols, scale), func(t *testing.T) {
					const rows = 5
					ld := cols + 1
					s := newTile(rows, cols, ld, func(i, j int) float32 {
						if j%5 == 4 {
							return negInf
						}
						return 4 * float32(r.NormFloat64())
					})
					in := append([]float32(nil), s...)
					lse := []float32{3, negInf, 0.25, 20, -2}
					im.expRows(s, ld, rows, cols, scale, lse)
					checkPadding(t, s, in, rows, cols, ld)
					for i := 0; i < rows; i++ {
						for j := 0; j < cols; j++ {
							got := s[i*ld+j]
							if math.IsInf(float64(lse[i]), -1) {
								if got != 0 {
									t.Fatalf("row %d with lse -Inf: x[%d] = %v, want 0", i, j, got)
								}
								continue
							}
							xs := float64(in[i*ld+j]) * float64(scale)
							arg := xs - float64(lse[i])
							if !expClose(got, arg, 0x1p-24*math.Abs(xs)) {
								t.Fatalf("row %d col %d: exp(%v) = %v, want %v", i, j, arg, got, math.Exp(arg))
							}
						}
					}
				})
			}
		}
	}
}

func TestSoftmaxGrad(t *testing.T) {
	r := rand.New(rand.NewPCG(13, 13))
	for _, im := range available() {
		for _, cols := range tileCols {
			const rows = 6
			ldp, ldd := cols+2, cols+5
			p := newTile(rows, cols, ldp, func(int, int) float32 { return r.Float32() })
			dp := newTile(rows, cols, ldd, func(int, int) float32 { return float32(r.NormFloat64()) })
			delta := []float32{0.5, -1, 0, 2, 1e-3, -7}
			p0, dp0 := append([]float32(nil), p...), append([]float32(nil), dp...)
			im.softmaxGrad(p, ldp, dp, ldd, rows, cols, delta)
			checkPadding(t, dp, dp0, rows, cols, ldd)
			checkPadding(t, p, p0, 0, 0, ldp)
			for i := 0; i < rows; i++ {
				for j := 0; j < cols; j++ {
					d := dp0[i*ldd+j] - delta[i]
					want := p0[i*ldp+j] * d
					if got := dp[i*ldd+j]; got != want {
						t.Fatalf("%s cols=%d: dS[%d,%d] = %v, want %v", im.name, cols, i, j, got, want)
					}
				}
			}
		}
	}
}

// storeInputs returns float32 values around every rounding boundary of the
// 16-bit formats: each bfloat16 and binary16 value and its neighbours
// halfway, random bit patterns, the specials.
func storeInputs() []float32 {
	var xs []float32
	for h := 0; h < 1<<16; h += 7 {
		b := math.Float32frombits(uint32(h) << 16)
		f := half.Float16(h).Float32()
		for _, v := range []float32{b, f} {
			bits := math.Float32bits(v)
			xs = append(xs, v, math.Float32frombits(bits+1), math.Float32frombits(bits-1),
				math.Float32frombits(bits|0x8000), math.Float32frombits(bits+0x1000))
		}
	}
	r := rand.New(rand.NewPCG(14, 14))
	for i := 0; i < 20000; i++ {
		xs = append(xs, math.Float32frombits(r.Uint32()))
	}
	xs = append(xs, 65504, 65519.99, 65520, -65520, 0x1p-24, 0x1p-25, 0x1.8p-25, 0x1p-26,
		float32(math.Inf(1)), negInf, float32(math.NaN()), math.MaxFloat32, math.SmallestNonzeroFloat32)
	return xs
}

func TestScaleToStores(t *testing.T) {
	xs := storeInputs()
	for _, im := range available() {
		for _, s := range []float32{1, 0.75} {
			for _, n := range []int{1, 15, 16, 17, 64, 100, len(xs)} {
				src := xs[len(xs)-n:]
				f32 := make([]float32, n+3)
				b16 := make([]uint16, n+3)
				h16 := make([]uint16, n+3)
				for i := n; i < n+3; i++ {
					f32[i], b16[i], h16[i] = poison, 0xdead, 0xbeef
				}
				im.scaleTo(f32[:n], src, s)
				im.toBF16(b16[:n], src, s)
				im.toFP16(h16[:n], src, s)
				for i, x := range src {
					y := x * s
					if math.Float32bits(f32[i]) != math.Float32bits(y) {
						t.Fatalf("%s: ScaleTo(%v·%v) = %v, want %v", im.name, x, s, f32[i], y)
					}
					if want := uint16(half.BFloat16FromFloat32(y)); b16[i] != want {
						t.Fatalf("%s: ScaleToBF16(%v·%v) = %#04x, want %#04x (input bits %#08x)", im.name, x, s, b16[i], want, math.Float32bits(y))
					}
					if want := uint16(half.Float16FromFloat32(y)); h16[i] != want {
						t.Fatalf("%s: ScaleToFloat16(%v·%v) = %#04x, want %#04x (input bits %#08x)", im.name, x, s, h16[i], want, math.Float32bits(y))
					}
				}
				if math.Float32bits(f32[n]) != math.Float32bits(poison) || b16[n] != 0xdead || h16[n] != 0xbeef {
					t.Fatalf("%s: n=%d: a store wrote beyond the slice", im.name, n)
				}
			}
		}
	}
}

func TestDot(t *testing.T) {
	r := rand.New(rand.NewPCG(15, 15))
	for _, im := range available() {
		for n := 1; n <= 300; n += 1 + n/10 {
			x, y := make([]float32, n), make([]float32, n+1)
			var want, mag float64
			for i := range x {
				x[i], y[i] = float32(r.NormFloat64()), float32(r.NormFloat64())
				want += float64(x[i]) * float64(y[i])
				mag += math.Abs(float64(x[i]) * float64(y[i]))
			}
			y[n] = poison
			got := im.dot(x, y[:n])
			if math.Abs(float64(got)-want) > 1e-6*mag {
				t.Fatalf("%s: n=%d: Dot = %v, want %v", im.name, n, got, want)
			}
			if again := im.dot(x, y[:n]); math.Float32bits(again) != math.Float32bits(got) {
				t.Fatalf("%s: n=%d: Dot not repeatable", im.name, n)
			}
		}
	}
	if Dot(nil, nil) != 0 || Dot([]float32{2, 3}, []float32{4, 5, 6}) != 23 {
		t.Fatalf("Dot of small slices is wrong")
	}
}

func TestTranspose(t *testing.T) {
	r := rand.New(rand.NewPCG(16, 16))
	for _, im := range available() {
		for _, rows := range []int{1, 5, 8, 15, 16, 17, 40, 64} {
			for _, cols := range []int{1, 3, 16, 17, 64, 70} {
				lds, ldd := cols+1, rows+3
				src := newTile(rows, cols, lds, func(int, int) float32 { return r.Float32() })
				dst := newTile(cols, ldd, ldd, func(int, int) float32 { return poison })
				d0 := append([]float32(nil), dst...)
				impl.Store(&im)
				Transpose(rows, cols, src, lds, dst, ldd)
				checkPadding(t, dst, d0, cols, rows, ldd)
				for j := 0; j < rows; j++ {
					for p := 0; p < cols; p++ {
						if dst[p*ldd+j] != src[j*lds+p] {
							t.Fatalf("%s %d×%d: dst[%d,%d] = %v, want %v", im.name, rows, cols, p, j, dst[p*ldd+j], src[j*lds+p])
						}
					}
				}
			}
		}
	}
	k := selectKernels()
	impl.Store(&k)
}

func TestUse(t *testing.T) {
	defer func() {
		k := selectKernels()
		impl.Store(&k)
	}()
	names := Implementations()
	if names[0] != "go" || names[len(names)-1] != selectKernels().name {
		t.Fatalf("Implementations() = %v: want go first and %s last", names, selectKernels().name)
	}
	for _, name := range names {
		if err := Use(name); err != nil {
			t.Fatalf("Use(%q): %v", name, err)
		}
		if got := Implementation(); got != name {
			t.Fatalf("after Use(%q), Implementation() = %q", name, got)
		}
		x := []float32{1, 2, 3}
		if got := Dot(x, x); got != 14 {
			t.Fatalf("%s: Dot = %v, want 14", name, got)
		}
	}
	before := Implementation()
	if err := Use("no-such-kernels"); err == nil {
		t.Fatalf("Use of an unknown implementation succeeded")
	}
	if Implementation() != before {
		t.Fatalf("a failed Use changed the implementation")
	}
}

func TestTilePanics(t *testing.T) {
	checkPanics(t, []panicCase{
		{"softmax short s", func() {
			SoftmaxOnline(make([]float32, 5), 3, 2, 3, 1, make([]float32, 2), make([]float32, 2), make([]float32, 2))
		}},
		{"softmax short alpha", func() {
			SoftmaxOnline(make([]float32, 6), 3, 2, 3, 1, make([]float32, 2), make([]float32, 2), make([]float32, 1))
		}},
		{"exprows small ld", func() { ExpRows(make([]float32, 6), 2, 2, 3, 1, make([]float32, 2)) }},
		{"grad short delta", func() { SoftmaxGrad(make([]float32, 4), 2, make([]float32, 4), 2, 2, 2, make([]float32, 1)) }},
		{"scaleto short dst", func() { ScaleTo(make([]float32, 1), make([]float32, 2), 1) }},
		{"bf16 short dst", func() { ScaleToBF16(make([]uint16, 1), make([]float32, 2), 1) }},
		{"fp16 short dst", func() { ScaleToFloat16(nil, make([]float32, 2), 1) }},
		{"dot short y", func() { Dot(make([]float32, 3), make([]float32, 2)) }},
		{"transpose short dst", func() { Transpose(2, 3, make([]float32, 6), 3, make([]float32, 5), 2) }},
	})
}

// TestTileDegenerate checks the empty tiles: nothing is touched, except
// that SoftmaxOnline reports alpha = 1 for rows without columns.
func TestTileDegenerate(t *testing.T) {
	m, l, alpha := []float32{2}, []float32{3}, []float32{7}
	SoftmaxOnline(nil, 0, 1, 0, 1, m, l, alpha)
	if m[0] != 2 || l[0] != 3 || alpha[0] != 1 {
		t.Fatalf("SoftmaxOnline with no columns: m %v l %v alpha %v, want 2 3 1", m[0], l[0], alpha[0])
	}
	ExpRows(nil, 0, 0, 5, 1, nil)
	SoftmaxGrad(nil, 0, nil, 0, 3, 0, make([]float32, 3))
	Transpose(0, 4, nil, 4, nil, 0)
	ScaleTo(nil, nil, 2)
}

// bf16Mat returns a rows×cols bfloat16 matrix with leading dimension ld
// (padding 0xffff, a NaN) with normal values in about [-2, 2].
func bf16Mat(r *rand.Rand, rows, cols, ld int) []uint16 {
	x := make([]uint16, rows*ld+8)
	for i := range x {
		x[i] = 0xffff
	}
	for i := 0; i < rows; i++ {
		for j := 0; j < cols; j++ {
			x[i*ld+j] = uint16(half.BFloat16FromFloat32(2*r.Float32() - 1))
		}
	}
	return x
}

func TestMatMulBF16(t *testing.T) {
	r := rand.New(rand.NewPCG(17, 17))
	bf := func(h uint16) float64 { return float64(math.Float32frombits(uint32(h) << 16)) }
	dims := []int{1, 5, 6, 7, 16, 17, 33, 64, 65}
	for _, m := range []int{1, 5, 6, 7, 13, 64} {
		for _, n := range dims {
			for _, k := range []int{2, 6, 64, 130} {
				for _, acc := range []bool{false, true} {
					lda, ldb, ldc := k+2, 2*n+4, n+1
					a := bf16Mat(r, m, k, lda)
					b := bf16Mat(r, k/2, 2*n, ldb)
					c0 := newMat(r, m, n, ldc)
					var first []float32
					for _, im := range available() {
						c := append([]float32(nil), c0...)
						im.matMulBF16(m, n, k, a, lda, b, ldb, c, ldc, acc)
						checkPadding(t, c, c0, m, n, ldc)
						for i := 0; i < m; i++ {
							for j := 0; j < n; j++ {
								var want, mag float64
								if acc {
									want, mag = float64(c0[i*ldc+j]), math.Abs(float64(c0[i*ldc+j]))
								}
								for p := 0; p < k; p++ {
									x := bf(a[i*lda+p]) * bf(b[(p/2)*ldb+2*j+p%2])
									want += x
									mag += math.Abs(x)
								}
								if got := float64(c[i*ldc+j]); math.Abs(got-want) > 1e-5*mag+1e-30 {
									t.Fatalf("%s m=%d n=%d k=%d acc=%v: C[%d,%d] = %v, want %v", im.name, m, n, k, acc, i, j, got, want)
								}
							}
						}
						// Without subnormals every implementation adds the
						// same exact products in the same order.
						if first == nil {
							first = c
						} else {
							for i := range c {
								if math.Float32bits(c[i]) != math.Float32bits(first[i]) {
									t.Fatalf("%s m=%d n=%d k=%d: element %d = %v, the portable code gives %v", im.name, m, n, k, i, c[i], first[i])
								}
							}
						}
					}
				}
			}
		}
	}
	defer func() {
		if recover() == nil {
			t.Errorf("odd k did not panic")
		}
	}()
	MatMulBF16(1, 1, 3, make([]uint16, 4), 4, make([]uint16, 4), 2, make([]float32, 1), 1, false)
}

func TestTransposePairs(t *testing.T) {
	r := rand.New(rand.NewPCG(18, 18))
	for _, im := range available() {
		for _, rows := range []int{1, 7, 8, 16, 17, 64} {
			for _, pairs := range []int{1, 16, 17, 32} {
				lds, ldd := 2*pairs+2, 2*rows+4
				src := make([]uint16, rows*lds)
				for i := range src {
					src[i] = uint16(r.Uint32())
				}
				dst := make([]uint16, pairs*ldd+2)
				for i := range dst {
					dst[i] = 0xbeef
				}
				d0 := append([]uint16(nil), dst...)
				im.transposePairs(rows, pairs, src, lds, dst, ldd)
				for idx := range dst {
					p, c := idx/ldd, idx%ldd
					if p < pairs && c < 2*rows {
						if want := src[(c/2)*lds+2*p+c%2]; dst[idx] != want {
							t.Fatalf("%s %d×%d: dst[%d] = %#x, want %#x", im.name, rows, pairs, idx, dst[idx], want)
						}
					} else if dst[idx] != d0[idx] {
						t.Fatalf("%s %d×%d: dst[%d] outside the result was written", im.name, rows, pairs, idx)
					}
				}
			}
		}
	}
}

func TestInterleave(t *testing.T) {
	r := rand.New(rand.NewPCG(19, 19))
	for _, im := range available() {
		for _, n := range []int{1, 15, 16, 17, 64, 100} {
			a, b := make([]uint16, n), make([]uint16, n+1)
			for i := range a {
				a[i], b[i] = uint16(r.Uint32()), uint16(r.Uint32())
			}
			dst := make([]uint16, 2*n+2)
			dst[2*n], dst[2*n+1] = 0xbeef, 0xbeef
			impl.Store(&im)
			Interleave(dst, a, b)
			for i := 0; i < n; i++ {
				if dst[2*i] != a[i] || dst[2*i+1] != b[i] {
					t.Fatalf("%s n=%d: pair %d = %#x %#x, want %#x %#x", im.name, n, i, dst[2*i], dst[2*i+1], a[i], b[i])
				}
			}
			if dst[2*n] != 0xbeef || dst[2*n+1] != 0xbeef {
				t.Fatalf("%s n=%d: wrote beyond 2n", im.name, n)
			}
			Interleave(dst, a, nil)
			for i := 0; i < n; i++ {
				if dst[2*i] != a[i] || dst[2*i+1] != 0 {
					t.Fatalf("%s n=%d: with b nil, pair %d = %#x %#x", im.name, n, i, dst[2*i], dst[2*i+1])
				}
			}
		}
	}
	k := selectKernels()
	impl.Store(&k)
}
