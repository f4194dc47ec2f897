package attn

import (
	"errors"
	"math"
	"math/big"
	"strings"
	"testing"
)

// TestLayoutOverflow checks that layouts whose index arithmetic overflows
// int are rejected with the right sentinel instead of wrapping around into
// a storage index that looks valid.
func TestLayoutOverflow(t *testing.T) {
	f32 := func(n int) []float32 { return make([]float32, n) }
	tests := []struct {
		name string
		t    Tensor
		want error
	}{
		{"offset near MaxInt", Tensor{DType: Float32, Shape: []int{16}, Strides: []int{1}, Offset: math.MaxInt - 3, F32: f32(16)}, ErrLayout},
		{"offset MaxInt, one element", Tensor{DType: Float32, Shape: []int{1}, Strides: []int{1}, Offset: math.MaxInt, F32: f32(16)}, ErrLayout},
		{"stride 2^60 on 16", Tensor{DType: Float32, Shape: []int{16}, Strides: []int{1 << 60}, F32: f32(16)}, ErrLayout},
		{"stride 2^60 on 16, 4-d", Tensor{DType: Float32, Shape: []int{1, 16, 1, 1}, Strides: []int{16, 1 << 60, 1, 1}, F32: f32(16)}, ErrLayout},
		{"strides summing past MaxInt", Tensor{DType: Float32, Shape: []int{2, 2}, Strides: []int{math.MaxInt / 2, math.MaxInt/2 + 2}, F32: f32(16)}, ErrLayout},
		{"stride MaxInt", Tensor{DType: Float32, Shape: []int{3}, Strides: []int{math.MaxInt}, F32: f32(16)}, ErrLayout},
		{"count overflows, contiguous", Tensor{DType: Float32, Shape: []int{1 << 40, 1 << 40}}, ErrShape},
		{"count overflows, explicit strides", Tensor{DType: Float32, Shape: []int{1 << 32, 1 << 32}, Strides: []int{1, 1}, F32: f32(16)}, ErrShape},
		{"count wraps to zero", Tensor{DType: Float32, Shape: []int{1 << 32, 1 << 32, 4}}, ErrShape},
		{"negative size", Tensor{DType: Float32, Shape: []int{2, -3}, F32: f32(16)}, ErrShape},
		{"negative size beside a zero", Tensor{DType: Float32, Shape: []int{0, -3}}, ErrShape},
		{"zero size beside huge ones", Tensor{DType: Float32, Shape: []int{0, math.MaxInt, math.MaxInt}}, nil},
		{"last element at the end", Tensor{DType: Float32, Shape: []int{4}, Strides: []int{5}, F32: f32(16)}, nil},
		{"one past the end", Tensor{DType: Float32, Shape: []int{4}, Strides: []int{5}, Offset: 1, F32: f32(16)}, ErrLayout},
		{"bytes overflow", Tensor{DType: Float32, Shape: []int{1 << 62}, Strides: []int{0}, F32: f32(16)}, ErrShape},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.t.CheckLayout("x")
			if tc.want == nil {
				if err != nil {
					t.Fatalf("unexpected error %v", err)
				}
				return
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("error %v, want one wrapping %v", err, tc.want)
			}
			// The bulk readers panic with the same error, not with an index
			// out of range.
			for name, f := range map[string]func(){
				"Float32s": func() { tc.t.Float32s() },
				"Bytes":    func() { tc.t.Bytes() },
				"Fill":     func() { tc.t.Fill(1) },
			} {
				r := catch(f)
				e, ok := r.(error)
				if !ok || !errors.Is(e, tc.want) {
					t.Errorf("%s: panic %v, want an error wrapping %v", name, r, tc.want)
				}
			}
		})
	}
}

// catch runs f and returns what it panicked with (nil if it returned).
func catch(f func()) (r any) {
	defer func() { r = recover() }()
	f()
	return nil
}

func TestLayoutSpan(t *testing.T) {
	tests := []struct {
		name            string
		shape, strides  []int
		offset, wantEnd int
		want            error
	}{
		{"contiguous", []int{2, 3, 4}, []int{12, 4, 1}, 0, 24, nil},
		{"offset and gaps", []int{2, 3}, []int{10, 3}, 5, 5 + 10 + 6 + 1, nil},
		{"empty", []int{2, 0, 4}, []int{1 << 62, 1 << 62, 1 << 62}, 7, 0, nil},
		{"rank 0", nil, nil, 3, 4, nil},
		{"end is MaxInt", []int{2}, []int{math.MaxInt - 1}, 0, math.MaxInt, nil},
		{"end past MaxInt", []int{2}, []int{math.MaxInt}, 0, 0, ErrLayout},
		{"offset past MaxInt", []int{2}, []int{1}, math.MaxInt, 0, ErrLayout},
		{"product overflows", []int{1 << 33}, []int{1 << 31}, 0, 0, ErrLayout},
		{"strides length", []int{2, 3}, []int{1}, 0, 0, ErrLayout},
		{"negative stride", []int{2, 3}, []int{3, -1}, 0, 0, ErrLayout},
		{"negative offset", []int{2}, []int{1}, -1, 0, ErrLayout},
		{"negative size", []int{2, -1}, []int{1, 1}, 0, 0, ErrShape},
		{"count overflows", []int{1 << 31, 1 << 31, 4}, []int{0, 0, 0}, 0, 0, ErrShape},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			end, err := LayoutSpan("x", tc.shape, tc.strides, tc.offset)
			if tc.want != nil {
				if !errors.Is(err, tc.want) {
					t.Fatalf("error %v, want one wrapping %v", err, tc.want)
				}
				if !strings.Contains(err.Error(), "x: ") {
					t.Errorf("error %q does not name the tensor", err)
				}
				return
			}
			if err != nil || end != tc.wantEnd {
				t.Fatalf("LayoutSpan = %d, %v; want %d", end, err, tc.wantEnd)
			}
		})
	}
}

func TestNewChecked(t *testing.T) {
	tests := []struct {
		name  string
		dt    DType
		shape []int
		want  error
		n     int
	}{
		{"plain", BFloat16, []int{2, 3}, nil, 6},
		{"rank 0", Float32, nil, nil, 1},
		{"empty", Float16, []int{4, 0}, nil, 0},
		{"negative dim", Float32, []int{3, -1}, ErrShape, 0},
		{"count overflows", Float32, []int{1 << 40, 1 << 40}, ErrShape, 0},
		{"bytes overflow", Float32, []int{1 << 62}, ErrShape, 0},
		{"invalid dtype", DType(9), []int{2}, ErrDType, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			x, err := NewChecked(tc.dt, tc.shape...)
			if tc.want != nil {
				if !errors.Is(err, tc.want) {
					t.Fatalf("NewChecked: error %v, want one wrapping %v", err, tc.want)
				}
				// New does not panic; its tensor fails CheckLayout with the same sentinel.
				var y Tensor
				if r := catch(func() { y = New(tc.dt, tc.shape...) }); r != nil {
					t.Fatalf("New panicked: %v", r)
				}
				if err := y.CheckLayout("y"); !errors.Is(err, tc.want) {
					t.Fatalf("CheckLayout of New's tensor: %v, want one wrapping %v", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := x.CheckLayout("x"); err != nil {
				t.Fatal(err)
			}
			if got := len(x.Float32s()); got != tc.n {
				t.Fatalf("%d elements, want %d", got, tc.n)
			}
		})
	}
}

// TestNewProblemOverflow checks that NewProblem, which every backend calls
// first, reports overflowing layouts with a sentinel.
func TestNewProblemOverflow(t *testing.T) {
	q := New(Float32, 1, 16, 1, 8)
	k := New(Float32, 1, 16, 1, 8)
	v := New(Float32, 1, 16, 1, 8)
	far := q
	far.Offset = math.MaxInt - 100
	wide := k
	wide.Strides = []int{128, 1 << 60, 8, 1}
	tests := []struct {
		name    string
		q, k, v Tensor
		want    error
	}{
		{"q offset near MaxInt", far, k, v, ErrLayout},
		{"k stride 2^60", q, wide, v, ErrLayout},
		{"v from New with a negative dim", q, k, New(Float32, 1, 16, -1, 8), ErrShape},
		{"q from New with an overflowing count", New(Float32, 1<<20, 1<<20, 1<<20, 8), k, v, ErrShape},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewProblem(tc.q, tc.k, tc.v, Options{})
			if !errors.Is(err, tc.want) {
				t.Fatalf("error %v, want one wrapping %v", err, tc.want)
			}
		})
	}
}

// visibleBig is the definition of the mask in exact arithmetic: key j is
// visible to query i (n queries over m keys) when it lies within the window
// around the diagonal and, with Causal, not after the diagonal.
func visibleBig(opt Options, i, j, n, m int) bool {
	d := big.NewInt(int64(i))
	if opt.Align == AlignBottomRight {
		d.Add(d, big.NewInt(int64(m-n)))
	}
	jb := big.NewInt(int64(j))
	if opt.Window != nil {
		if l := opt.Window.Left; l >= 0 && jb.Cmp(new(big.Int).Sub(d, big.NewInt(int64(l)))) < 0 {
			return false
		}
		if r := opt.Window.Right; r >= 0 && jb.Cmp(new(big.Int).Add(d, big.NewInt(int64(r)))) > 0 {
			return false
		}
	}
	return !opt.Causal || jb.Cmp(d) <= 0
}

// TestWindowOverflow checks KeyRange against the exact definition for
// window sides up to MaxInt, both with the sides resolved by NewProblem
// and with the raw sides (a Problem built by hand), whose arithmetic must
// saturate instead of wrapping.
func TestWindowOverflow(t *testing.T) {
	const mx = math.MaxInt
	sides := []int{-1, math.MinInt, 0, 1, 5, 6, 7, 8, mx / 2, mx - 1, mx}
	sizes := [][2]int{{1, 1}, {3, 7}, {7, 3}, {6, 6}, {0, 4}, {4, 0}}
	for _, sz := range sizes {
		n, m := sz[0], sz[1]
		for _, align := range []Align{AlignBottomRight, AlignTopLeft} {
			for _, causal := range []bool{false, true} {
				for _, l := range sides {
					for _, r := range sides {
						opt := Options{Window: &Window{Left: l, Right: r}, Align: align, Causal: causal}
						p, err := NewProblem(New(Float32, 1, n, 1, 4), New(Float32, 1, m, 1, 4), New(Float32, 1, m, 1, 4), opt)
						if err != nil {
							t.Fatal(err)
						}
						if p.Left >= max(n, m) || p.Right >= max(n, m) {
							t.Errorf("n=%d m=%d %+v: resolved sides %d, %d not below max(N, M)", n, m, *opt.Window, p.Left, p.Right)
						}
						raw := &Problem{N: n, M: m, Opt: opt}
						raw.Left, raw.Right, raw.Masked = opt.MaskBounds()
						for _, q := range []*Problem{p, raw} {
							for i := 0; i < n; i++ {
								for j := 0; j < m; j++ {
									if got, want := q.Visible(i, j, n, m), visibleBig(opt, i, j, n, m); got != want {
										t.Fatalf("n=%d m=%d %v causal=%v window %+v (resolved %d, %d): Visible(%d, %d) = %v, want %v",
											n, m, align, causal, *opt.Window, q.Left, q.Right, i, j, got, want)
									}
								}
							}
						}
					}
				}
			}
		}
	}
}

func TestResolveMask(t *testing.T) {
	const mx = math.MaxInt
	tests := []struct {
		name        string
		n, m        int
		opt         Options
		left, right int
		masked      bool
	}{
		{"window MaxInt both sides masks nothing", 16, 16, Options{Window: &Window{Left: mx, Right: mx}}, -1, -1, false},
		{"right MaxInt", 16, 16, Options{Window: &Window{Left: 0, Right: mx}}, 0, -1, true},
		{"left MaxInt is causal", 16, 16, Options{Window: &Window{Left: mx, Right: 0}}, -1, 0, true},
		{"causal with window MaxInt", 16, 9, Options{Causal: true, Window: &Window{Left: mx, Right: mx}}, -1, 0, true},
		{"side max(N, M) is unbounded", 5, 9, Options{Window: &Window{Left: 9, Right: 9}}, -1, -1, false},
		{"side max(N, M)-1 stays", 5, 9, Options{Window: &Window{Left: 8, Right: 8}}, 8, 8, true},
		{"varlen: longest segment", 0, 0, Options{Window: &Window{Left: 6, Right: 7}, CuSeqlensQ: []int32{0, 2, 9}, CuSeqlensK: []int32{0, 7, 10}}, 6, -1, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			q, k := New(Float32, 1, tc.n, 1, 4), New(Float32, 1, tc.m, 1, 4)
			if tc.opt.CuSeqlensQ != nil {
				q, k = New(Float32, 9, 1, 4), New(Float32, 10, 1, 4)
			}
			p, err := NewProblem(q, k, k, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			if p.Left != tc.left || p.Right != tc.right || p.Masked != tc.masked {
				t.Fatalf("resolved to left %d right %d masked %v, want %d %d %v", p.Left, p.Right, p.Masked, tc.left, tc.right, tc.masked)
			}
			// ResolveMask is idempotent and what NewProblem applies.
			again := *p
			again.ResolveMask()
			if again.Left != p.Left || again.Right != p.Right || again.Masked != p.Masked {
				t.Fatalf("ResolveMask again: %d %d %v", again.Left, again.Right, again.Masked)
			}
		})
	}
}
