package vec

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/half"
)

// kind names one of the three products.
type kind int

const (
	nt kind = iota
	nn
	tn
)

func (k kind) String() string { return [...]string{"NT", "NN", "TN"}[k] }

// fn returns the product of kind k in implementation im.
func (k kind) fn(im kernels) func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	return [...]func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool){im.matMulNT, im.matMulNN, im.matMulTN}[k]
}

// exported returns the exported function of kind k.
func (k kind) exported() func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	return [...]func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool){MatMulNT, MatMulNN, MatMulTN}[k]
}

// shapes returns the (rows, cols) of A and B for a product of kind kd.
func (kd kind) shapes(m, n, k int) (ar, ac, br, bc int) {
	switch kd {
	case nt:
		return m, k, n, k
	case nn:
		return m, k, k, n
	default:
		return k, m, k, n
	}
}

// eachProduct calls f for every product kind with every implementation
// the machine has.
func eachProduct(f func(im kernels, kd kind)) {
	for _, im := range available() {
		for _, kd := range []kind{nt, nn, tn} {
			f(im, kd)
		}
	}
}

// operands draws from r the operands of an m×n×k product of kind kd with
// packed rows: a and its row length, then b and its row length.
func (kd kind) operands(r *rand.Rand, m, n, k int) (a []float32, lda int, b []float32, ldb int) {
	ar, ac, br, bc := kd.shapes(m, n, k)
	return newMat(r, ar, ac, ac), ac, newMat(r, br, bc, bc), bc
}

// aAt and bAt read the operands as the product of kind kd defines them.
func (kd kind) aAt(a []float32, lda, i, p int) float32 {
	if kd == tn {
		return a[p*lda+i]
	}
	return a[i*lda+p]
}

func (kd kind) bAt(b []float32, ldb, p, j int) float32 {
	if kd == nt {
		return b[j*ldb+p]
	}
	return b[p*ldb+j]
}

// poison is the value that fills every element a kernel must neither read
// nor write.
var poison = float32(math.NaN())

// newMat returns a rows×cols matrix with leading dimension ld whose padding
// (and a guard of 16 elements after it) holds poison and whose elements are
// uniform in [-1, 1).
func newMat(r *rand.Rand, rows, cols, ld int) []float32 {
	x := make([]float32, rows*ld+16)
	for i := range x {
		x[i] = poison
	}
	for i := 0; i < rows; i++ {
		for j := 0; j < cols; j++ {
			x[i*ld+j] = 2*r.Float32() - 1
		}
	}
	return x
}

func TestMatMul(t *testing.T) {
	dims := []int{1, 3, 17, 64, 67}
	eachProduct(func(im kernels, kd kind) {
		for _, pad := range []int{0, 5} {
			for _, acc := range []bool{false, true} {
				name := fmt.Sprintf("%s/%s/pad=%d/acc=%v", im.name, kd, pad, acc)
				t.Run(name, func(t *testing.T) {
					r := rand.New(rand.NewPCG(1, uint64(kd)))
					for _, m := range dims {
						for _, n := range dims {
							for _, k := range dims {
								checkProduct(t, r, kd.fn(im), kd, m, n, k, pad, acc)
							}
						}
					}
				})
			}
		}
	})
}

// TestMatMulShapes covers every remainder of the register blocks, through
// the exported (dispatched) functions and every implementation.
func TestMatMulShapes(t *testing.T) {
	r := rand.New(rand.NewPCG(2, 2))
	eachProduct(func(im kernels, kd kind) {
		t.Run(im.name+"/"+kd.String(), func(t *testing.T) {
			for m := 1; m <= 13; m++ {
				for n := 1; n <= 50; n++ {
					for _, k := range []int{1, 2, 5, 16, 33} {
						checkProduct(t, r, kd.fn(im), kd, m, n, k, (m+n)%3, n%2 == 0)
					}
				}
			}
		})
	})
	// Larger than one block of the transposed B in MatMulNT (128×64).
	eachProduct(func(im kernels, kd kind) {
		checkProduct(t, r, kd.fn(im), kd, 9, 131, 300, 1, false)
		checkProduct(t, r, kd.fn(im), kd, 20, 200, 129, 0, true)
	})
	for _, kd := range []kind{nt, nn, tn} {
		checkProduct(t, r, kd.exported(), kd, 64, 64, 64, 0, false)
		checkProduct(t, r, kd.exported(), kd, 67, 17, 128, 3, true)
	}
}

// checkProduct runs one product against a float64 reference computed from
// the same inputs and reports the first wrong element.
func checkProduct(t *testing.T, r *rand.Rand, f func(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool), kd kind, m, n, k, pad int, acc bool) {
	t.Helper()
	ar, ac, br, bc := kd.shapes(m, n, k)
	lda, ldb, ldc := ac+pad, bc+2*pad, n+pad
	a := newMat(r, ar, ac, lda)
	b := newMat(r, br, bc, ldb)
	c := newMat(r, m, n, ldc)
	c0 := append([]float32(nil), c...)
	f(m, n, k, a, lda, b, ldb, c, ldc, acc)
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			var want, mag float64
			if acc {
				want = float64(c0[i*ldc+j])
				mag = math.Abs(want)
			}
			for p := 0; p < k; p++ {
				x := float64(kd.aAt(a, lda, i, p)) * float64(kd.bAt(b, ldb, p, j))
				want += x
				mag += math.Abs(x)
			}
			got := float64(c[i*ldc+j])
			if !(math.Abs(got-want) <= 1e-5*mag+1e-30) {
				t.Fatalf("m=%d n=%d k=%d pad=%d acc=%v: C[%d,%d] = %v, want %v (|err| %.3g, magnitude %.3g)",
					m, n, k, pad, acc, i, j, got, want, math.Abs(got-want), mag)
			}
		}
	}
	// Padding and the guard after C must be untouched.
	for idx := range c {
		if i, j := idx/ldc, idx%ldc; i < m && j < n {
			continue
		}
		if math.Float32bits(c[idx]) != math.Float32bits(c0[idx]) {
			t.Fatalf("m=%d n=%d k=%d pad=%d: element %d outside C was written", m, n, k, pad, idx)
		}
	}
}

// TestMatMulDeterministic checks that repeated calls give identical bits and
// that the result does not depend on where the operands start in memory.
func TestMatMulDeterministic(t *testing.T) {
	const m, n, k = 64, 67, 64
	r := rand.New(rand.NewPCG(3, 3))
	eachProduct(func(im kernels, kd kind) {
		a, ac, b, bc := kd.operands(r, m, n, k)
		want := make([]float32, m*n)
		kd.fn(im)(m, n, k, a, ac, b, bc, want, n, false)
		for off := 0; off < 4; off++ {
			a2 := append(make([]float32, off), a...)[off:]
			b2 := append(make([]float32, off+1), b...)[off+1:]
			got := make([]float32, m*n+off)[off:]
			for rep := 0; rep < 3; rep++ {
				kd.fn(im)(m, n, k, a2, ac, b2, bc, got, n, false)
				for i := range want {
					if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
						t.Fatalf("%s/%s offset %d repeat %d: element %d = %v, first run gave %v", im.name, kd, off, rep, i, got[i], want[i])
					}
				}
			}
		}
	})
}

func TestMatMulDegenerate(t *testing.T) {
	for _, kd := range []kind{nt, nn, tn} {
		c := []float32{1, 2, 3, 4}
		kd.exported()(2, 2, 0, nil, 0, nil, 0, c, 2, true)
		if c[0] != 1 || c[3] != 4 {
			t.Errorf("%s: k=0 with acc changed C to %v", kd, c)
		}
		kd.exported()(2, 2, 0, nil, 0, nil, 0, c, 2, false)
		for _, v := range c {
			if v != 0 {
				t.Errorf("%s: k=0 without acc left C = %v, want zeros", kd, c)
				break
			}
		}
		kd.exported()(0, 0, 3, nil, 0, nil, 0, nil, 0, false)
	}
}

func TestMatMulPanics(t *testing.T) {
	checkPanics(t, []panicCase{
		{"short a", func() { MatMulNT(2, 2, 2, make([]float32, 3), 2, make([]float32, 4), 2, make([]float32, 4), 2, false) }},
		{"short b", func() { MatMulNN(2, 2, 2, make([]float32, 4), 2, make([]float32, 3), 2, make([]float32, 4), 2, false) }},
		{"short c", func() { MatMulTN(2, 2, 2, make([]float32, 4), 2, make([]float32, 4), 2, make([]float32, 3), 2, false) }},
		{"small lda", func() { MatMulNT(2, 2, 2, make([]float32, 8), 1, make([]float32, 4), 2, make([]float32, 4), 2, false) }},
		{"small ldc", func() { MatMulNN(2, 2, 2, make([]float32, 4), 2, make([]float32, 4), 2, make([]float32, 8), 1, false) }},
		{"negative", func() { MatMulTN(-1, 2, 2, nil, 2, make([]float32, 4), 2, nil, 2, false) }},
	})
}

// ulps returns the distance between got and the float32 nearest to want, in
// units of the last place of float32 (subnormal spacing below the normal
// range).
func ulps(got float32, want float64) float64 {
	w := float32(want)
	if got == w {
		return 0
	}
	spacing := math.Abs(float64(math.Nextafter32(w, float32(math.Inf(1)))) - float64(w))
	if s := math.Abs(float64(w) - float64(math.Nextafter32(w, 0))); s > 0 && s < spacing {
		spacing = s
	}
	if w == 0 {
		spacing = float64(math.SmallestNonzeroFloat32)
	}
	return math.Abs(float64(got)-want) / spacing
}

// expInputs returns arguments spanning the softmax range, the underflow
// boundary and the special values.
func expInputs() []float32 {
	xs := []float32{0, float32(math.Copysign(0, -1)), float32(math.Inf(-1)), -1e-30, -1e-7, -0.5, -1, -math.Ln2, -10, -20,
		-80, -87.33654, -87.5, -88, -100, -103, -103.9, -103.97, -104, -110, -1e4, -math.MaxFloat32,
		1e-7, 0.5, 1, 10, 88, 88.72283, 88.8, 200, float32(math.Inf(1))}
	r := rand.New(rand.NewPCG(4, 4))
	for i := 0; i < 20000; i++ {
		xs = append(xs, -110*r.Float32())
	}
	for i := 0; i < 2000; i++ {
		xs = append(xs, -r.Float32()*float32(math.Pow(2, -float64(r.IntN(30)))))
	}
	for i := 0; i < 500; i++ {
		xs = append(xs, 88*r.Float32())
	}
	return xs
}

func TestExpSub(t *testing.T) {
	xs := expInputs()
	for _, im := range available() {
		for _, m := range []float32{0, 3.25, -7.5} {
			// Lengths around every vector width, then the full sweep.
			for _, n := range []int{1, 2, 7, 8, 15, 16, 17, 31, 33, 64, 100, len(xs)} {
				t.Run(fmt.Sprintf("%s/m=%v/n=%d", im.name, m, n), func(t *testing.T) {
					x := make([]float32, n+8)
					for i := range x {
						x[i] = poison
					}
					for i := 0; i < n; i++ {
						x[i] = xs[i] + m
					}
					in := append([]float32(nil), x...)
					sum := im.expSub(x[:n], m)
					var wantSum, maxErr float64
					for i := 0; i < n; i++ {
						d := in[i] - m
						want := math.Exp(float64(d))
						// Beyond float32's range the result must be +Inf; just
						// below it, +Inf is accepted in place of the largest
						// values (the contract's accuracy is for d ≤ 0).
						if math.IsInf(float64(float32(want)), 1) || d > 88 && math.IsInf(float64(x[i]), 1) {
							if !math.IsInf(float64(x[i]), 1) {
								t.Fatalf("exp(%v) = %v, want +Inf", d, x[i])
							}
							wantSum = math.Inf(1)
							continue
						}
						if e := ulps(x[i], want); e > maxErr {
							maxErr = e
							if e > 2 {
								t.Fatalf("exp(%v) = %v (bits %#x), want %v: %.2f ulp", d, x[i], math.Float32bits(x[i]), want, e)
							}
						}
						wantSum += float64(x[i])
					}
					for i := n; i < len(x); i++ {
						if math.Float32bits(x[i]) != math.Float32bits(in[i]) {
							t.Fatalf("element %d beyond the slice was written", i)
						}
					}
					if math.IsInf(wantSum, 1) {
						if !math.IsInf(float64(sum), 1) {
							t.Fatalf("sum = %v, want +Inf", sum)
						}
					} else if math.Abs(float64(sum)-wantSum) > 1e-6*wantSum {
						t.Fatalf("sum = %v, want %v", sum, wantSum)
					}
				})
			}
		}
	}
}

func TestExpSubSpecial(t *testing.T) {
	inf := float32(math.Inf(1))
	nan := float32(math.NaN())
	tests := []struct {
		name    string
		x       []float32
		m       float32
		want    []float32
		wantSum float32
	}{
		{"masked", []float32{-inf, 0, -inf}, 0, []float32{0, 1, 0}, 1},
		{"all masked", []float32{-inf, -inf}, -inf, []float32{0, 0}, 0},
		{"m -inf finite x", []float32{-inf, 2}, -inf, []float32{0, inf}, inf},
		{"nan", []float32{nan, 0}, 0, []float32{nan, 1}, nan},
		{"empty", nil, 0, nil, 0},
	}
	for _, im := range available() {
		for _, tt := range tests {
			t.Run(im.name+"/"+tt.name, func(t *testing.T) {
				// Long inputs send the values through the vector loop too.
				for _, reps := range []int{1, 40} {
					var x, want []float32
					for r := 0; r < reps; r++ {
						x = append(x, tt.x...)
						want = append(want, tt.want...)
					}
					saved := impl.Load()
					impl.Store(&im)
					sum := ExpSub(x, tt.m)
					impl.Store(saved)
					for i := range x {
						if !(x[i] == want[i] || x[i] != x[i] && want[i] != want[i]) {
							t.Fatalf("reps %d: x[%d] = %v, want %v", reps, i, x[i], want[i])
						}
					}
					ws := tt.wantSum * float32(reps)
					if !(sum == ws || sum != sum && ws != ws) {
						t.Fatalf("reps %d: sum = %v, want %v", reps, sum, ws)
					}
				}
			})
		}
	}
}

func TestMax(t *testing.T) {
	inf := float32(math.Inf(1))
	nan := float32(math.NaN())
	if got := Max(nil); !math.IsInf(float64(got), -1) {
		t.Fatalf("Max(nil) = %v, want -Inf", got)
	}
	r := rand.New(rand.NewPCG(5, 5))
	for _, im := range available() {
		for n := 1; n <= 140; n++ {
			for pos := 0; pos < n; pos += 1 + n/7 {
				x := make([]float32, n)
				for i := range x {
					x[i] = -10 * r.Float32()
				}
				x[pos] = 1 + r.Float32()
				want := x[pos]
				if n > 2 {
					x[(pos+1)%n] = nan
					x[(pos+2)%n] = float32(math.Inf(-1))
				}
				if got := im.max(x); got != want {
					t.Fatalf("%s: n=%d pos=%d: Max = %v, want %v", im.name, n, pos, got, want)
				}
			}
		}
		tests := []struct {
			x    []float32
			want float32
		}{
			{[]float32{float32(math.Inf(-1))}, float32(math.Inf(-1))},
			{[]float32{nan, 1, nan}, 1},
			{[]float32{-3, inf, 2}, inf},
			{[]float32{float32(math.Copysign(0, -1)), -1}, 0},
		}
		for _, tt := range tests {
			if got := im.max(tt.x); got != tt.want {
				t.Errorf("%s: Max(%v) = %v, want %v", im.name, tt.x, got, tt.want)
			}
		}
	}
}

func TestScale(t *testing.T) {
	r := rand.New(rand.NewPCG(6, 6))
	for _, im := range available() {
		for n := 1; n <= 100; n++ {
			x := make([]float32, n+4)
			for i := range x {
				x[i] = r.Float32() - 0.5
			}
			in := append([]float32(nil), x...)
			s := 0.125 + r.Float32()
			im.scale(x[:n], s)
			for i := 0; i < n; i++ {
				if x[i] != in[i]*s {
					t.Fatalf("%s: n=%d: x[%d] = %v, want %v", im.name, n, i, x[i], in[i]*s)
				}
			}
			for i := n; i < len(x); i++ {
				if x[i] != in[i] {
					t.Fatalf("%s: n=%d: element %d beyond the slice changed", im.name, n, i)
				}
			}
		}
		x := []float32{1, -2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19}
		im.scale(x, 0.5)
		for i, v := range x {
			want := float32(i+1) * 0.5
			if i == 1 {
				want = -1
			}
			if v != want {
				t.Fatalf("%s: Scale(...,0.5)[%d] = %v, want %v", im.name, i, v, want)
			}
		}
	}
	x := []float32{2, 4, 6}
	Scale(x, 1.5)
	if x[0] != 3 || x[1] != 6 || x[2] != 9 {
		t.Fatalf("Scale = %v, want [3 6 9]", x)
	}
	Scale(nil, 2)
}

// allHalves returns every 16-bit pattern, in an order that puts specials in
// every vector lane.
func allHalves() []uint16 {
	src := make([]uint16, 1<<16)
	for i := range src {
		src[i] = uint16(i * 40503) // odd multiplier: a permutation
	}
	return src
}

func TestConvert(t *testing.T) {
	src := allHalves()
	for _, im := range available() {
		for _, n := range []int{1, 5, 8, 15, 16, 17, 31, 33, len(src)} {
			dst := make([]float32, n+3)
			for i := range dst {
				dst[i] = poison
			}
			im.bf16(dst[:n], src[:n])
			for i := 0; i < n; i++ {
				if want := uint32(src[i]) << 16; math.Float32bits(dst[i]) != want {
					t.Fatalf("%s: BF16ToFloat32(%#04x) = %#08x, want %#08x", im.name, src[i], math.Float32bits(dst[i]), want)
				}
			}
			for i := n; i < len(dst); i++ {
				if math.Float32bits(dst[i]) != math.Float32bits(poison) {
					t.Fatalf("%s: bf16 wrote beyond n", im.name)
				}
			}
			im.fp16(dst[:n], src[:n])
			for i := 0; i < n; i++ {
				if want := math.Float32bits(half.Float16(src[i]).Float32()); math.Float32bits(dst[i]) != want {
					t.Fatalf("%s: Float16ToFloat32(%#04x) = %#08x, want %#08x", im.name, src[i], math.Float32bits(dst[i]), want)
				}
			}
			for i := n; i < len(dst); i++ {
				if math.Float32bits(dst[i]) != math.Float32bits(poison) {
					t.Fatalf("%s: fp16 wrote beyond n", im.name)
				}
			}
		}
	}
	dst := make([]float32, 2)
	BF16ToFloat32(dst, []uint16{0x3f80, 0xc000})
	Float16ToFloat32(dst[1:], []uint16{0x3c00})
	if dst[0] != 1 || dst[1] != 1 {
		t.Fatalf("converters gave %v, want [1 1]", dst)
	}
	defer func() {
		if recover() == nil {
			t.Errorf("short dst did not panic")
		}
	}()
	BF16ToFloat32(dst[:1], []uint16{1, 2})
}

// panicCase is a call that must panic.
type panicCase struct {
	name string
	call func()
}

// checkPanics runs each case as a subtest and fails those that return
// without a panic.
func checkPanics(t *testing.T, tests []panicCase) {
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Errorf("no panic")
				}
			}()
			tt.call()
		})
	}
}
