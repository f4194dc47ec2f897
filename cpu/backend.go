package cpu

import (
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/internal/vec"
	"github.com/flashattn/flashattn/philox"
)

// Tile sizes: blockQ query rows by blockK keys. They are fixed (never derived
// from GOMAXPROCS), so the order of every floating-point sum is fixed too.
const (
	blockQ = 64
	blockK = 64
)

// Backend is the fast CPU implementation of attn.Backend. The zero value is
// not usable; call New. A Backend is safe for concurrent use.
type Backend struct{}

// New returns the CPU backend.
func New() *Backend { return &Backend{} }

// Name returns "cpu".
func (*Backend) Name() string { return "cpu" }

var _ attn.Backend = (*Backend)(nil)

// call holds everything one Forward or Backward call shares between its
// goroutines; all of it is read-only while the workers run, except the
// disjoint output regions each work unit owns.
type call struct {
	p       *attn.Problem
	segs    []seg
	q, k, v view
	bias    view
	hasBias bool
	scale   float32
	softcap float32
	inv     float32 // 1/(1-p) for dropout
}

func newCall(q, k, v attn.Tensor, opt attn.Options) (*call, error) {
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return nil, err
	}
	c := &call{p: p, segs: segments(p), scale: float32(p.Scale), softcap: float32(opt.Softcap),
		inv: float32(1 / (1 - opt.Dropout))}
	if opt.Softcap > 0 && (c.softcap == 0 || math.IsInf(float64(c.softcap), 0)) {
		return nil, attn.Errorf(attn.ErrUnsupported, "softcap %v is outside the float32 range", opt.Softcap)
	}
	if math.IsInf(float64(c.scale), 0) || c.scale == 0 {
		return nil, attn.Errorf(attn.ErrUnsupported, "scale %v is outside the float32 range", p.Scale)
	}
	c.q, c.k, c.v = newView(q, false), newView(k, false), newView(v, false)
	if opt.Bias != nil {
		c.hasBias = true
		c.bias = newView(opt.Bias.Tensor, true)
	}
	return c, nil
}

// scratch is the per-goroutine working memory: a few tiles, independent of
// the sequence lengths.
type scratch struct {
	s, pd, dp, th []float32 // blockQ×blockK tiles: scores/probabilities, dropped P, dP/dS, tanh
	acc           []float32 // blockQ×DV output accumulator
	dk, dv        []float32 // blockK×DK and blockK×DV gradient accumulators
	m, l          []float32 // blockQ running max and sum
	keep          []bool    // blockK dropout decisions
}

func (c *call) newScratch() *scratch {
	t := blockQ * blockK
	return &scratch{
		s: make([]float32, t), pd: make([]float32, t), dp: make([]float32, t), th: make([]float32, t),
		acc: make([]float32, blockQ*c.p.DV),
		dk:  make([]float32, blockK*c.p.DK), dv: make([]float32, blockK*c.p.DV),
		m: make([]float32, blockQ), l: make([]float32, blockQ),
		keep: make([]bool, blockK),
	}
}

// runUnits runs work(sc, u) for u in [0, n) on up to GOMAXPROCS goroutines,
// each with its own scratch. Each unit writes its own output elements, so
// the result does not depend on which goroutine runs it. A panic in a unit
// (an internal error) is returned as an error.
func (c *call) runUnits(n int, work func(sc *scratch, u int)) error {
	var next atomic.Int64
	var firstErr error
	var once sync.Once
	worker := func() {
		defer func() {
			if r := recover(); r != nil {
				once.Do(func() { firstErr = fmt.Errorf("flashattn: cpu backend internal error: %v", r) })
				next.Store(int64(n)) // stop the others early
			}
		}()
		sc := c.newScratch()
		for {
			u := int(next.Add(1) - 1)
			if u >= n {
				return
			}
			work(sc, u)
		}
	}
	w := min(runtime.GOMAXPROCS(0), n)
	if w <= 1 {
		worker()
		return firstErr
	}
	var wg sync.WaitGroup
	for range w {
		wg.Add(1)
		go func() {
			defer wg.Done()
			worker()
		}()
	}
	wg.Wait()
	return firstErr
}

// scores computes the score tile of query head h, queries i0 … i0+rows-1
// and keys j0 … j0+cols-1 of sequence sg into sc.s (leading dimension
// blockK): scale·q·k, softcapped (tanh values saved in sc.th when wantTanh),
// biased and masked to -Inf.
func (c *call) scores(sc *scratch, sg seg, h, i0, rows, j0, cols int, wantTanh bool) {
	p := c.p
	kh := h / p.Group()
	vec.MatMulNT(rows, cols, p.DK, c.q.data[c.q.row(sg.vb, sg.q0+i0, h):], c.q.si,
		c.k.data[c.k.row(sg.vb, sg.k0+j0, kh):], c.k.si, sc.s, blockK, false)
	bb, bh := sg.b, h
	if c.hasBias {
		s := p.Opt.Bias.Tensor.Shape
		if s[0] == 1 {
			bb = 0
		}
		if s[1] == 1 {
			bh = 0
		}
	}
	for r := 0; r < rows; r++ {
		x := sc.s[r*blockK : r*blockK+cols]
		vec.Scale(x, c.scale)
		if c.softcap > 0 {
			inv := 1 / c.softcap
			th := sc.th[r*blockK : r*blockK+cols]
			for j, v := range x {
				t := float32(math.Tanh(float64(v * inv)))
				if wantTanh {
					th[j] = t
				}
				x[j] = c.softcap * t
			}
		}
		if c.hasBias {
			o := c.bias.row(bb, i0+r, bh) + j0
			for j, b := range c.bias.data[o : o+cols] {
				x[j] += b
			}
		}
		if p.Masked {
			lo, hi := p.KeyRange(i0+r, sg.n, sg.m)
			if lo > j0 || hi < j0+cols {
				for j := range x {
					if j0+j < lo || j0+j >= hi {
						x[j] = negInf
					}
				}
			}
		}
	}
}

// dropMask fills sc.keep[:cols] for row i of (sg, h) from key j0.
func (c *call) dropMask(sc *scratch, sg seg, h, i, j0, cols int) []bool {
	o := c.p.Opt
	philox.NewMask(o.Seed, o.Offset, o.Dropout, sg.b, h, c.p.H).KeepRow(i, j0, sc.keep[:cols])
	return sc.keep[:cols]
}

// Forward computes O (in q's dtype, contiguous) and the float32 LSE.
func (b *Backend) Forward(q, k, v attn.Tensor, opt attn.Options) (attn.Result, error) {
	c, err := newCall(q, k, v, opt)
	if err != nil {
		return attn.Result{}, err
	}
	p := c.p
	res := attn.Result{O: attn.New(q.DType, p.OutputShape()...), LSE: attn.New(attn.Float32, p.LSEShape()...)}
	units := c.queryUnits()
	err = c.runUnits(len(units), func(sc *scratch, u int) {
		c.forwardUnit(sc, units[u], res)
	})
	if err != nil {
		return attn.Result{}, err
	}
	return res, nil
}

// qunit is a block of queries of one head of one sequence.
type qunit struct {
	sg    seg
	h, i0 int
	rows  int
}

func (c *call) queryUnits() []qunit {
	var units []qunit
	for _, sg := range c.segs {
		for h := 0; h < c.p.H; h++ {
			for i0 := 0; i0 < sg.n; i0 += blockQ {
				units = append(units, qunit{sg: sg, h: h, i0: i0, rows: min(blockQ, sg.n-i0)})
			}
		}
	}
	return units
}

func (c *call) forwardUnit(sc *scratch, u qunit, res attn.Result) {
	p := c.p
	sg, h, i0, rows := u.sg, u.h, u.i0, u.rows
	kh := h / p.Group()
	dv := p.DV
	acc := sc.acc[:rows*dv]
	clear(acc)
	for r := 0; r < rows; r++ {
		sc.m[r], sc.l[r] = negInf, 0
	}
	lo, hi := 0, sg.m
	if p.Masked {
		lo, hi = keySpan(p, sg.n, sg.m, i0, i0+rows)
	}
	for j0 := lo; j0 < hi; j0 += blockK {
		cols := min(blockK, hi-j0)
		c.scores(sc, sg, h, i0, rows, j0, cols, false)
		for r := 0; r < rows; r++ {
			x := sc.s[r*blockK : r*blockK+cols]
			mNew := max(sc.m[r], vec.Max(x))
			if mNew == negInf {
				clear(x) // nothing visible yet: contributes nothing
				continue
			}
			switch {
			case sc.m[r] == mNew:
				sc.l[r] += vec.ExpSub(x, mNew)
			case sc.m[r] == negInf:
				sc.l[r] = vec.ExpSub(x, mNew) // acc is still 0
			default:
				alpha := float32(math.Exp(float64(sc.m[r] - mNew)))
				sc.l[r] = sc.l[r]*alpha + vec.ExpSub(x, mNew)
				vec.Scale(acc[r*dv:(r+1)*dv], alpha)
			}
			sc.m[r] = mNew
			if p.Opt.Dropout > 0 {
				for j, kept := range c.dropMask(sc, sg, h, i0+r, j0, cols) {
					if !kept {
						x[j] = 0
					}
				}
			}
		}
		vec.MatMulNN(rows, dv, cols, sc.s, blockK, c.v.data[c.v.row(sg.vb, sg.k0+j0, kh):], c.v.si, acc, dv, true)
	}
	for r := 0; r < rows; r++ {
		li := lseIndex(p, sg, i0+r, h)
		o := outRow(p, sg, i0+r, h, dv)
		if sc.l[r] == 0 || sc.m[r] == negInf {
			res.LSE.F32[li] = negInf
			clear(acc[r*dv : (r+1)*dv])
			storeRow(res.O, o, acc[r*dv:(r+1)*dv], 1)
			continue
		}
		res.LSE.F32[li] = float32(float64(sc.m[r]) + math.Log(float64(sc.l[r])))
		storeRow(res.O, o, acc[r*dv:(r+1)*dv], c.inv/sc.l[r])
	}
}
