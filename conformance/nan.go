package conformance

import (
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// nanCase is a problem (batch 1, two query heads sharing one key head) with
// one row of one input filled with a non-finite value.
type nanCase struct {
	name   string
	n, m   int
	opt    attn.Options
	tensor string  // the poisoned input: "q", "k", "v" or "do"
	row    int     // its position (query or key)
	head   int     // its head (query head for q and do; k and v have one)
	value  float64 // NaN or ±Inf
	short  bool
}

const nanHeads, nanDim = 2, 16

func nanCases() []nanCase {
	nan, inf := math.NaN(), math.Inf(1)
	tl := attn.AlignTopLeft
	causal := attn.Options{Causal: true}
	win := func(l, r int, al attn.Align) attn.Options {
		return attn.Options{Window: &attn.Window{Left: l, Right: r}, Align: al}
	}
	return []nanCase{
		{name: "v-row-12-causal", n: 16, m: 16, opt: causal, tensor: "v", row: 12, value: nan, short: true},
		{name: "k-row-12-causal", n: 16, m: 16, opt: causal, tensor: "k", row: 12, value: nan, short: true},
		{name: "q-row-3-causal", n: 16, m: 16, opt: causal, tensor: "q", row: 3, head: 1, value: nan, short: true},
		{name: "do-row-5-causal", n: 16, m: 16, opt: causal, tensor: "do", row: 5, head: 0, value: nan, short: true},
		{name: "v-row-12-inf-causal", n: 16, m: 16, opt: causal, tensor: "v", row: 12, value: inf},
		{name: "k-row-12-minus-inf-causal", n: 16, m: 16, opt: causal, tensor: "k", row: 12, value: -inf},
		{name: "q-row-of-no-key", n: 20, m: 12, opt: causal, tensor: "q", row: 2, head: 0, value: nan, short: true},
		{name: "v-row-20-window", n: 40, m: 40, opt: win(3, 2, attn.AlignBottomRight), tensor: "v", row: 20, value: nan, short: true},
		{name: "k-row-10-window-top-left-n>m", n: 50, m: 30, opt: win(4, 4, tl), tensor: "k", row: 10, value: nan},
		{name: "q-row-20-window", n: 40, m: 40, opt: win(2, 0, attn.AlignBottomRight), tensor: "q", row: 20, head: 1, value: nan},
		{name: "do-row-7-window", n: 30, m: 45, opt: win(5, 1, tl), tensor: "do", row: 7, head: 1, value: nan},
		{name: "v-row-150-causal-200", n: 200, m: 200, opt: causal, tensor: "v", row: 150, value: nan},
		{name: "k-row-70-window-200", n: 200, m: 200, opt: win(100, 0, attn.AlignBottomRight), tensor: "k", row: 70, value: nan},
		{name: "q-row-130-causal-200", n: 200, m: 200, opt: causal, tensor: "q", row: 130, head: 0, value: nan},
		{name: "v-row-30-causal-dropout", n: 40, m: 40, opt: attn.Options{Causal: true, Dropout: 0.2, Seed: 7}, tensor: "v", row: 30, value: nan, short: true},
		{name: "k-row-9-causal-softcap", n: 24, m: 24, opt: attn.Options{Causal: true, Softcap: 5}, tensor: "k", row: 9, value: nan},
	}
}

// nanPropagation checks that a non-finite input reaches exactly the outputs
// that depend on it by the definition: a NaN in a row of q, k, v or dO
// makes NaN every element of O, LSE, dQ, dK and dV that a visible (query,
// key) pair connects it to, and nothing else, because a masked key
// contributes nothing (not 0·NaN) and a NaN query is not a row that sees
// no key. Every other element must equal the backend's result on the clean
// inputs, within rounding.
func nanPropagation(t *testing.T, b attn.Backend, dt attn.DType, cfg Config) {
	for _, tc := range nanCases() {
		if cfg.Short && !tc.short {
			continue
		}
		t.Run(tc.name, func(t *testing.T) { tc.check(t, b, dt, cfg) })
	}
}

// poisoned is the set of outputs a nanCase makes non-finite: query rows
// (row·H + head) of O, LSE and dQ, key rows of dK and dV.
type poisoned struct {
	o, lse, dq []bool // query rows
	dk, dv     []bool // key rows
}

// expect derives the poisoned outputs from the mask alone.
func (tc nanCase) expect(p *attn.Problem) poisoned {
	h := p.H
	e := poisoned{o: make([]bool, tc.n*h), lse: make([]bool, tc.n*h), dq: make([]bool, tc.n*h),
		dk: make([]bool, tc.m), dv: make([]bool, tc.m)}
	sees := func(i int) bool { lo, hi := p.KeyRange(i, tc.n, tc.m); return max(lo, 0) < min(hi, tc.m) }
	// spread marks the keys that the poisoned query rows rows see.
	spread := func(rows []bool, keys []bool) {
		for r, bad := range rows {
			for j := 0; bad && j < tc.m; j++ {
				if p.Visible(r/h, j, tc.n, tc.m) {
					keys[j] = true
				}
			}
		}
	}
	// pRows: rows whose P (or dO) is NaN, the ones that spread to dV.
	pRows := make([]bool, tc.n*h)
	switch tc.tensor {
	case "q":
		if sees(tc.row) {
			r := tc.row*h + tc.head
			e.o[r], e.lse[r], e.dq[r], pRows[r] = true, true, true, true
		}
	case "k", "v":
		for i := 0; i < tc.n; i++ {
			if !p.Visible(i, tc.row, tc.n, tc.m) {
				continue
			}
			for hh := 0; hh < h; hh++ {
				r := i*h + hh
				e.o[r], e.dq[r] = true, true
				if tc.tensor == "k" {
					e.lse[r], pRows[r] = true, true
				}
			}
		}
	case "do":
		if sees(tc.row) {
			r := tc.row*h + tc.head
			e.dq[r], pRows[r] = true, true
		}
	}
	spread(e.dq, e.dk)
	spread(pRows, e.dv)
	return e
}

// inputs returns clean q, k, v, dO and the same with the case's row poisoned.
func (tc nanCase) inputs(dt attn.DType) (clean, bad [4]attn.Tensor) {
	h := fnv.New64a()
	h.Write([]byte(tc.name))
	r := rand.New(rand.NewPCG(h.Sum64(), uint64(dt)+7))
	shapes := [4][]int{{1, tc.n, nanHeads, nanDim}, {1, tc.m, 1, nanDim}, {1, tc.m, 1, nanDim}, {1, tc.n, nanHeads, nanDim}}
	for i, s := range shapes {
		clean[i] = randTensor(r, dt, contiguous, 1, s...)
		bad[i] = attn.FromFloat32(dt, clean[i].Float32s(), s...)
	}
	x := map[string]int{"q": 0, "k": 1, "v": 2, "do": 3}[tc.tensor]
	for d := 0; d < nanDim; d++ {
		bad[x].Set(float32(tc.value), 0, tc.row, tc.head, d)
	}
	return clean, bad
}

func (tc nanCase) check(t *testing.T, b attn.Backend, dt attn.DType, cfg Config) {
	clean, bad := tc.inputs(dt)
	opt := tc.opt
	p, err := attn.NewProblem(clean[0], clean[1], clean[2], opt)
	if err != nil {
		t.Fatalf("NewProblem: %v", err)
	}
	run := func(in [4]attn.Tensor) (attn.Result, attn.Gradients) {
		res, err := b.Forward(in[0], in[1], in[2], opt)
		if err != nil {
			unsupported(t, err, cfg)
			t.Fatalf("Forward: %v", err)
		}
		g, err := b.Backward(in[0], in[1], in[2], res.O, res.LSE, in[3], opt)
		if err != nil {
			unsupported(t, err, cfg)
			t.Fatalf("Backward: %v", err)
		}
		return res, g
	}
	cr, cg := run(clean)
	br, bg := run(bad)
	want := tc.expect(p)
	// LSE is [1, H, N]: row i of head h at h·N + i; the others are [1, rows, heads, D].
	lseRow := func(k int) int { return (k%p.H)*p.N + k/p.H }
	for _, x := range []struct {
		name      string
		got, ref  attn.Tensor
		rows      []bool
		width     int
		rowOf     func(k int) int // the index of row k in the tensor's rows
		valueType attn.DType
	}{
		{"O", br.O, cr.O, want.o, p.DV, nil, dt},
		{"LSE", br.LSE, cr.LSE, want.lse, 1, lseRow, attn.Float32},
		{"dQ", bg.DQ, cg.DQ, want.dq, p.DK, nil, dt},
		{"dK", bg.DK, cg.DK, want.dk, p.DK, nil, dt},
		{"dV", bg.DV, cg.DV, want.dv, p.DV, nil, dt},
	} {
		got, ref := x.got.Float64s(), x.ref.Float64s()
		if len(got) != len(x.rows)*x.width || len(ref) != len(got) {
			t.Errorf("%s: %d elements, clean %d, want %d", x.name, len(got), len(ref), len(x.rows)*x.width)
			continue
		}
		var scale float64 = 1
		for _, v := range ref {
			if !math.IsInf(v, 0) {
				scale = max(scale, math.Abs(v))
			}
		}
		tol := 1e-5 * scale
		if x.valueType != attn.Float32 {
			tol = 8 * UnitRoundoff(x.valueType) * scale
		}
		for k, bad := range x.rows {
			at := k
			if x.rowOf != nil {
				at = x.rowOf(k)
			}
			for d := 0; d < x.width; d++ {
				g, c := got[at*x.width+d], ref[at*x.width+d]
				switch {
				case bad && math.IsNaN(tc.value) && !math.IsNaN(g):
					t.Errorf("%s: row %s element %d = %v, want NaN (it sees the poisoned %s row)", x.name, tc.rowName(k, x.name), d, g, tc.tensor)
				case bad:
				case g == c: // equal, equal infinities (the LSE of a row that sees no key) included
				case math.IsNaN(g) || math.IsInf(g, 0) || !(math.Abs(g-c) <= tol):
					t.Errorf("%s: row %s element %d = %v, want %v as without the poisoned %s row (it cannot see it)", x.name, tc.rowName(k, x.name), d, g, c, tc.tensor)
				default:
					continue
				}
				if t.Failed() {
					return
				}
			}
		}
	}
}

// rowName names row k of output name for messages.
func (tc nanCase) rowName(k int, name string) string {
	if name == "dK" || name == "dV" {
		return fmt.Sprintf("key %d", k)
	}
	return fmt.Sprintf("query %d head %d", k/nanHeads, k%nanHeads)
}
