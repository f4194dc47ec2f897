package conformance

import (
	"fmt"
	"math/rand/v2"

	"github.com/flashattn/flashattn/attn"
)

// The suite's random draw: how many cases, the seed, how many of them are in
// the Short subset.
const (
	randomCount = 48
	randomSeed  = 20261205
	randomShort = 12
)

// RandomCase is one problem of the suite's random draw, for a backend's own
// tests to run outside the suite (on an emulator of its kernels, say).
type RandomCase struct {
	// Name is the case's name in the suite.
	Name string
	// B, N and M size a padded batch; SeqQ and SeqK are the segment
	// lengths of a packed one (nil otherwise).
	B, N, M    int
	SeqQ, SeqK []int
	H, Hkv     int
	DK, DV     int
	// Opt holds the options but the bias (CuSeqlensQ/K are set for a
	// packed batch); BiasB and BiasH, when positive, give the bias's
	// shape [BiasB, BiasH, N, M], and BiasGrad asks for its gradient.
	Opt          attn.Options
	BiasB, BiasH int
	BiasGrad     bool
	// Short reports whether the case is in the Short subset.
	Short bool
}

// RandomCases returns the suite's random cases, in the order Run runs them.
// The suite runs them in fp16 and bf16 (and fp32 up to head dims of 128),
// and with strided layouts too.
func RandomCases() []RandomCase {
	var out []RandomCase
	for _, tc := range randomCases(randomCount, randomSeed, randomShort) {
		_, _, _, _, opt := tc.shapes()
		out = append(out, RandomCase{Name: tc.name, B: tc.b, N: tc.n, M: tc.m, SeqQ: tc.seqQ, SeqK: tc.seqK, H: tc.h, Hkv: tc.hkv,
			DK: tc.dk, DV: tc.dv, Opt: opt, BiasB: tc.biasB, BiasH: tc.biasH, BiasGrad: tc.biasGrad, Short: tc.short})
	}
	return out
}

// randomCases returns n problems, the first short of them in the Short
// subset, drawn from the cross product the table of cases covers one
// feature at a time: head dims from 1 to 512 (odd, equal
// or not), GQA and MQA, padded batches of 1 to 130 tokens and packed ones
// with empty segments, every layout, causal masks in both alignments,
// windows (sides up to 2^40), softcap, a logit scale, dropout and biases
// of every broadcast with or without their gradient, each present or not
// at random. The draw is fixed by seed, so the cases and their names are
// the same in every run.
//
// They run in fp16 and bf16, where the criterion is relative to the naive
// computation's error, and in fp32 up to head dims of 128. Where the
// criterion cannot judge a result, the draw stays out, not because a
// backend fails there: fp32 past D = 128 (its fixed bound, 1e-5 of the
// largest output, is below what float32 arithmetic reaches when a gradient
// cancels terms of a few hundred dot products), logit scales far above
// 1/sqrt(DK) (scores of tens), and problems in which no row sees two keys
// (every gradient then cancels to zero, and the criterion's scale of the
// cancelled terms, 1, is too small once DV or the dropout scale is large).
func randomCases(n int, seed uint64, short int) []testCase {
	r := rand.New(rand.NewPCG(seed, 0x5eed))
	dims := []int{1, 2, 3, 7, 8, 15, 16, 31, 33, 64, 65, 100, 128, 129, 200, 256, 257, 300, 512}
	lens := []int{0, 1, 2, 5, 17, 40, 63, 64, 65, 100, 130}
	pick := func(xs []int) int { return xs[r.IntN(len(xs))] }
	var out []testCase
	for len(out) < n {
		tc := testCase{hkv: 1 + r.IntN(3)}
		tc.h = tc.hkv * (1 + r.IntN(3))
		tc.dk, tc.dv = pick(dims), pick(dims)
		if r.IntN(2) == 0 {
			tc.dv = tc.dk
		}
		if r.IntN(4) == 0 {
			for range 1 + r.IntN(4) {
				tc.seqQ = append(tc.seqQ, pick(lens))
				tc.seqK = append(tc.seqK, pick(lens))
			}
		} else {
			tc.b, tc.n, tc.m = 1+r.IntN(2), 1+r.IntN(130), 1+r.IntN(130)
		}
		tc.lay = layout(r.IntN(3))
		o := &tc.opt
		o.Causal = r.IntN(3) == 0
		if r.IntN(2) == 0 {
			o.Align = attn.AlignTopLeft
		}
		if r.IntN(4) == 0 {
			sides := []int{-1, 0, 1, 5, 30, 1 << 40}
			o.Window = &attn.Window{Left: pick(sides), Right: pick(sides)}
		}
		if r.IntN(4) == 0 {
			o.Softcap = []float64{0.5, 2, 30}[r.IntN(3)]
		}
		if r.IntN(4) == 0 {
			o.Scale = []float64{0.05, 0.1, 0.2}[r.IntN(3)]
		}
		if r.IntN(4) == 0 {
			o.Dropout = []float64{0.1, 0.3}[r.IntN(2)]
			o.Seed, o.Offset = r.Uint64(), r.Uint32()
		}
		if tc.seqQ == nil && r.IntN(4) == 0 {
			tc.biasB, tc.biasH = 1, 1
			if r.IntN(2) == 0 {
				tc.biasB = tc.b
			}
			if r.IntN(2) == 0 {
				tc.biasH = tc.h
			}
			tc.biasGrad = r.IntN(2) == 0
		}
		if !tc.someRowSeesTwoKeys() {
			continue
		}
		tc.name = fmt.Sprintf("random-%02d-%s", len(out), tc.describe())
		tc.short = len(out) < short
		tc.dtypes = []attn.DType{attn.Float16, attn.BFloat16}
		if max(tc.dk, tc.dv) <= 128 {
			tc.dtypes = append(tc.dtypes, attn.Float32)
		}
		out = append(out, tc)
	}
	return out
}

// someRowSeesTwoKeys reports whether a query row of tc sees at least two
// keys.
func (tc testCase) someRowSeesTwoKeys() bool {
	qs, ks, vs, _, opt := tc.shapes()
	p, err := attn.NewProblem(attn.New(attn.Float32, qs...), attn.New(attn.Float32, ks...), attn.New(attn.Float32, vs...), opt)
	if err != nil {
		panic(fmt.Sprintf("conformance: random case %+v: %v", tc, err))
	}
	for b := range p.B {
		_, n, _, m := p.Segment(b)
		for i := range n {
			if lo, hi := p.KeyRange(i, n, m); hi-lo >= 2 {
				return true
			}
		}
	}
	return false
}

// describe returns a short description of tc's shape and options for its
// name, such as "b2-n87-m97-h6/3-d300-causal-tl-win5,-1-cap2-drop0.1-bias1x6-grad".
func (tc testCase) describe() string {
	s := fmt.Sprintf("b%d-n%d-m%d", tc.b, tc.n, tc.m)
	if tc.seqQ != nil {
		s = fmt.Sprintf("q%v-k%v", tc.seqQ, tc.seqK)
	}
	s += fmt.Sprintf("-h%d/%d-d%d", tc.h, tc.hkv, tc.dk)
	if tc.dv != tc.dk {
		s += fmt.Sprintf("/%d", tc.dv)
	}
	s += []string{"", "-bhnd", "-gapped"}[tc.lay]
	o := tc.opt
	if o.Causal {
		s += "-causal"
	}
	if o.Align == attn.AlignTopLeft {
		s += "-tl"
	}
	if w := o.Window; w != nil {
		s += fmt.Sprintf("-win%d,%d", w.Left, w.Right)
	}
	if o.Softcap > 0 {
		s += fmt.Sprintf("-cap%g", o.Softcap)
	}
	if o.Scale > 0 {
		s += fmt.Sprintf("-scale%g", o.Scale)
	}
	if o.Dropout > 0 {
		s += fmt.Sprintf("-drop%g", o.Dropout)
	}
	if tc.biasB > 0 {
		s += fmt.Sprintf("-bias%dx%d", tc.biasB, tc.biasH)
		if tc.biasGrad {
			s += "-grad"
		}
	}
	return s
}
