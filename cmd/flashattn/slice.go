package main

import (
	"fmt"
	"math"

	"github.com/flashattn/flashattn"
	"github.com/flashattn/flashattn/cpu"
)

// checkSlice is the part of a padded, bottom-right aligned problem that the
// demo recomputes with the float64 reference: batch 0, query heads
// [0, heads) with their key/value heads [0, kvHeads), the last rows query
// rows, and all keys. For those rows the sub-problem has the same masks as
// the full one (bottom-right alignment keeps each row's diagonal), so O, LSE
// and dQ compare directly; dK and dV compare for the keys no other query row
// sees, whose gradients come from the checked rows alone.
type checkSlice struct {
	p              *flashattn.Problem
	row0, rows     int
	heads, kvHeads int
	keys           []int // the keys whose dK and dV are compared
	q, k, v, dO    flashattn.Tensor
	opt            flashattn.Options
}

// view returns the [1, rows, heads, D] view of t at batch 0, row row0,
// sharing t's storage.
func view(t flashattn.Tensor, row0, rows, heads int) flashattn.Tensor {
	return flashattn.Tensor{
		DType: t.DType, Shape: []int{1, rows, heads, t.Shape[3]}, Strides: t.Strides,
		Offset: t.Index(0, row0, 0, 0), F32: t.F32, Bits: t.Bits,
	}
}

// newSlice chooses the slice of p checked: the last maxRows query rows, or
// every row when no key would be seen by the checked rows alone.
func newSlice(p *flashattn.Problem, q, k, v, dO flashattn.Tensor, opt flashattn.Options, maxRows int) (*checkSlice, error) {
	if p.Varlen || opt.Align != flashattn.AlignBottomRight || opt.Bias != nil || opt.Dropout != 0 {
		return nil, fmt.Errorf("the slice check needs a padded, bottom-right aligned problem without bias or dropout")
	}
	s := &checkSlice{p: p, opt: opt, kvHeads: min(2, p.Hkv)}
	s.heads = s.kvHeads * p.Group()
	s.rows = min(maxRows, p.N)
	s.keys = s.ownKeys(p.N - s.rows)
	if len(s.keys) == 0 {
		s.rows = p.N
		s.keys = s.ownKeys(0)
	}
	s.row0 = p.N - s.rows
	s.q = view(q, s.row0, s.rows, s.heads)
	s.dO = view(dO, s.row0, s.rows, s.heads)
	s.k = view(k, 0, p.M, s.kvHeads)
	s.v = view(v, 0, p.M, s.kvHeads)
	return s, nil
}

// ownKeys returns the keys that no query row before row0 sees.
func (s *checkSlice) ownKeys(row0 int) []int {
	seen := make([]int, s.p.M+1) // difference array of the rows seeing each key
	for i := range row0 {
		lo, hi := s.p.KeyRange(i, s.p.N, s.p.M)
		if hi > lo {
			seen[lo]++
			seen[hi]--
		}
	}
	var keys []int
	n := 0
	for j := range s.p.M {
		n += seen[j]
		if n == 0 {
			keys = append(keys, j)
		}
	}
	return keys
}

// describe says what the slice covers.
func (s *checkSlice) describe() string {
	keys := "no key"
	if len(s.keys) > 0 {
		keys = fmt.Sprintf("%d keys", len(s.keys))
		if len(s.keys) == s.keys[len(s.keys)-1]-s.keys[0]+1 {
			keys = fmt.Sprintf("keys %d-%d", s.keys[0], s.keys[len(s.keys)-1])
		}
	}
	return fmt.Sprintf("batch 0, query heads 0-%d, query rows %d-%d (O, LSE, dQ), %s (dK, dV) against the float64 reference",
		s.heads-1, s.row0, s.p.N-1, keys)
}

// checkResult is one compared quantity: its error relative to the largest
// reference magnitude, and the limit it must not exceed.
type checkResult struct {
	name       string
	err, limit float64
}

// errStat accumulates the largest difference and the largest reference magnitude.
type errStat struct {
	maxDiff, maxRef float64
	nan             bool
}

func (e *errStat) add(got, ref float64) {
	if a := math.Abs(ref); !math.IsInf(a, 0) && a > e.maxRef {
		e.maxRef = a
	}
	if got == ref { // also equal infinities, such as the LSE of a row that sees no key
		return
	}
	d := math.Abs(got - ref)
	if math.IsNaN(d) {
		e.nan = true
	}
	if d > e.maxDiff {
		e.maxDiff = d
	}
}

// value returns the relative error (NaN when a NaN was compared).
func (e *errStat) value() float64 {
	if e.nan {
		return math.NaN()
	}
	if e.maxRef == 0 {
		return e.maxDiff
	}
	return e.maxDiff / e.maxRef
}

// check compares the backend's outputs on the slice with the float64
// reference. In float32 each relative error must stay below 1e-5; in 16-bit
// storage it must stay within 2× (forward) or 3× (gradients) the error of the
// same math done naively in that precision, plus 1e-5.
func (s *checkSlice) check(dt flashattn.DType, res flashattn.Result, g flashattn.Gradients) ([]checkResult, error) {
	ref, err := cpu.Reference(s.q, s.k, s.v, s.opt)
	if err != nil {
		return nil, err
	}
	refG, err := cpu.ReferenceBackward(s.q, s.k, s.v, s.dO, s.opt)
	if err != nil {
		return nil, err
	}
	// The naive baselines, in the reference's layout; nil in float32.
	var nO, nLSE, nDQ, nDK, nDV []float64
	if dt != flashattn.Float32 {
		naive, err := cpu.NaiveForward(dt, s.q, s.k, s.v, s.opt)
		if err != nil {
			return nil, err
		}
		naiveG, err := cpu.NaiveBackward(dt, s.q, s.k, s.v, s.dO, s.opt)
		if err != nil {
			return nil, err
		}
		nO, nLSE, nDQ, nDK, nDV = naive.O, naive.LSE, naiveG.DQ, naiveG.DK, naiveG.DV
	}
	const eps = 1e-5
	r, hs, kvs, m := s.rows, s.heads, s.kvHeads, s.p.M
	// compare walks the n[0]×n[1]×n[2] elements of one quantity, skipping
	// the a for which use(a) is false: at reads the backend's value and flat
	// gives the index in the reference's row-major arrays.
	compare := func(name string, factor float64, refv, naivev []float64, n [3]int,
		at func(a, b, c int) float64, flat func(a, b, c int) int, use func(a int) bool) checkResult {
		var got, base errStat
		for a := range n[0] {
			if !use(a) {
				continue
			}
			for b := range n[1] {
				for c := range n[2] {
					i := flat(a, b, c)
					got.add(at(a, b, c), refv[i])
					if naivev != nil {
						base.add(naivev[i], refv[i])
					}
				}
			}
		}
		limit := eps
		if naivev != nil {
			limit = factor*base.value() + eps
		}
		return checkResult{name: name, err: got.value(), limit: limit}
	}
	all := func(int) bool { return true }
	own := make([]bool, m)
	for _, j := range s.keys {
		own[j] = true
	}
	ownKey := func(j int) bool { return own[j] }
	dk, dv := s.p.DK, s.p.DV
	out := []checkResult{
		compare("O", 2, ref.O, nO, [3]int{r, hs, dv},
			func(i, h, d int) float64 { return float64(res.O.At(0, s.row0+i, h, d)) },
			func(i, h, d int) int { return (i*hs+h)*dv + d }, all),
		compare("LSE", 2, ref.LSE, nLSE, [3]int{hs, r, 1},
			func(h, i, _ int) float64 { return float64(res.LSE.At(0, h, s.row0+i)) },
			func(h, i, _ int) int { return h*r + i }, all),
		compare("dQ", 3, refG.DQ, nDQ, [3]int{r, hs, dk},
			func(i, h, d int) float64 { return float64(g.DQ.At(0, s.row0+i, h, d)) },
			func(i, h, d int) int { return (i*hs+h)*dk + d }, all),
	}
	if len(s.keys) > 0 {
		out = append(out,
			compare("dK", 3, refG.DK, nDK, [3]int{m, kvs, dk},
				func(j, h, d int) float64 { return float64(g.DK.At(0, j, h, d)) },
				func(j, h, d int) int { return (j*kvs+h)*dk + d }, ownKey),
			compare("dV", 3, refG.DV, nDV, [3]int{m, kvs, dv},
				func(j, h, d int) float64 { return float64(g.DV.At(0, j, h, d)) },
				func(j, h, d int) int { return (j*kvs+h)*dv + d }, ownKey))
	}
	return out, nil
}
