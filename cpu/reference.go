package cpu

import (
	"math"
	"runtime"
	"sync"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/half"
	"github.com/flashattn/flashattn/philox"
)

// RefOutput is the float64 result of Reference or NaiveForward.
type RefOutput struct {
	// Problem is the validated problem.
	Problem *attn.Problem
	// O is row-major in Problem.OutputShape(): [B, N, H, DV] or [totalQ, H, DV].
	O []float64
	// LSE is row-major in Problem.LSEShape(): [B, H, N] or [H, totalQ];
	// -Inf for a row that sees no key, NaN for a row that a NaN reaches.
	LSE []float64
}

// RefGrads is the float64 result of ReferenceBackward or NaiveBackward. Each
// gradient is row-major in the shape of its input.
type RefGrads struct {
	// DQ, DK and DV are shaped like q, k and v.
	DQ, DK, DV []float64
	// DBias is in the bias's own (broadcast) shape; nil unless the bias has
	// RequiresGrad set.
	DBias []float64
}

// Reference computes the forward pass in float64, literally following the
// definitions of package attn. It is the oracle every backend is measured
// against. It returns the validation error of attn.NewProblem for bad input.
func Reference(q, k, v attn.Tensor, opt attn.Options) (*RefOutput, error) {
	return forwardWith(q, k, v, opt, nil)
}

// ReferenceBackward computes dQ, dK, dV and (when the bias asks for it)
// dBias in float64 for the output gradient dO, which must have the shape of
// O. The forward quantities it needs are recomputed in float64.
func ReferenceBackward(q, k, v, dO attn.Tensor, opt attn.Options) (*RefGrads, error) {
	return backwardWith(q, k, v, dO, opt, nil)
}

// NaiveForward computes the forward pass the straightforward way with every
// intermediate (scores, softcapped and biased scores, probabilities, dropped
// probabilities, O) rounded to dt's precision, the way an unfused
// implementation that stores its intermediates in dt would. Sums are
// accumulated in float64 and rounded once. Its error against Reference is the
// baseline of the accuracy criterion for backends storing dt. LSE is rounded
// to float32, the type in which it is stored.
func NaiveForward(dt attn.DType, q, k, v attn.Tensor, opt attn.Options) (*RefOutput, error) {
	if !dt.Valid() {
		return nil, attn.Errorf(attn.ErrDType, "naive forward: dtype %d", int(dt))
	}
	return forwardWith(q, k, v, opt, rounder(dt))
}

// NaiveBackward is the backward counterpart of NaiveForward: dP, Delta, dS,
// the softcap derivative's product and each gradient are rounded to dt, and
// Delta uses the rounded O of NaiveForward.
func NaiveBackward(dt attn.DType, q, k, v, dO attn.Tensor, opt attn.Options) (*RefGrads, error) {
	if !dt.Valid() {
		return nil, attn.Errorf(attn.ErrDType, "naive backward: dtype %d", int(dt))
	}
	return backwardWith(q, k, v, dO, opt, rounder(dt))
}

// forwardWith runs the reference forward, rounding every intermediate with
// round (nil: exact float64).
func forwardWith(q, k, v attn.Tensor, opt attn.Options, round func(float64) float64) (*RefOutput, error) {
	e, err := newEngine(q, k, v, opt, round)
	if err != nil {
		return nil, err
	}
	e.forward()
	return &RefOutput{Problem: e.p, O: e.o, LSE: e.lse}, nil
}

// backwardWith runs the reference forward and backward for dO, rounding
// every intermediate with round (nil: exact float64).
func backwardWith(q, k, v, dO attn.Tensor, opt attn.Options, round func(float64) float64) (*RefGrads, error) {
	e, err := newEngine(q, k, v, opt, round)
	if err != nil {
		return nil, err
	}
	if err := e.loadDO(dO); err != nil {
		return nil, err
	}
	e.forward()
	return e.backward(), nil
}

// rounder returns the function rounding a value to dt's precision.
func rounder(dt attn.DType) func(float64) float64 {
	switch dt {
	case attn.Float16:
		return func(x float64) float64 { return float64(half.RoundFloat16(float32(x))) }
	case attn.BFloat16:
		return func(x float64) float64 { return float64(half.RoundBFloat16(float32(x))) }
	}
	return func(x float64) float64 { return float64(float32(x)) }
}

// engine holds the float64 copies of the inputs and the outputs of the
// literal algorithm shared by Reference and the naive baselines.
type engine struct {
	p       *attn.Problem
	q, k, v []float64 // logical row-major copies
	do      []float64
	bias    []float64 // [bB, bH, N, M] or nil
	bB, bH  int
	rnd     func(float64) float64 // nil: exact float64
	o, lse  []float64
	softcap float64
	dropout float64
}

func newEngine(q, k, v attn.Tensor, opt attn.Options, rnd func(float64) float64) (*engine, error) {
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return nil, err
	}
	e := &engine{p: p, q: q.Float64s(), k: k.Float64s(), v: v.Float64s(), rnd: rnd,
		softcap: opt.Softcap, dropout: opt.Dropout}
	if opt.Bias != nil {
		e.bias = opt.Bias.Tensor.Float64s()
		e.bB, e.bH = opt.Bias.Tensor.Shape[0], opt.Bias.Tensor.Shape[1]
	}
	return e, nil
}

func (e *engine) loadDO(dO attn.Tensor) error {
	if err := dO.CheckLayout("dO"); err != nil {
		return err
	}
	want := e.p.OutputShape()
	if len(dO.Shape) != len(want) {
		return attn.Errorf(attn.ErrShape, "dO shape %v, want %v", dO.Shape, want)
	}
	for d := range want {
		if dO.Shape[d] != want[d] {
			return attn.Errorf(attn.ErrShape, "dO shape %v, want %v", dO.Shape, want)
		}
	}
	e.do = dO.Float64s()
	return nil
}

func (e *engine) r(x float64) float64 {
	if e.rnd == nil {
		return x
	}
	return e.rnd(x)
}

// qRow returns the token row of query i of batch element b (index into the
// leading dimensions of q and O); kRow the same for keys.
func (e *engine) qRow(b, i int) int {
	if e.p.Varlen {
		q0, _, _, _ := e.p.Segment(b)
		return q0 + i
	}
	return b*e.p.N + i
}

func (e *engine) kRow(b, j int) int {
	if e.p.Varlen {
		_, _, k0, _ := e.p.Segment(b)
		return k0 + j
	}
	return b*e.p.M + j
}

func (e *engine) lseIndex(b, h, i int) int {
	if e.p.Varlen {
		q0, _, _, _ := e.p.Segment(b)
		return h*e.p.TotalQ + q0 + i
	}
	return (b*e.p.H+h)*e.p.N + i
}

func (e *engine) biasIndex(b, h, i, j int) int {
	if e.bB == 1 {
		b = 0
	}
	if e.bH == 1 {
		h = 0
	}
	return ((b*e.bH+h)*e.p.N+i)*e.p.M + j
}

// visible returns the clamped visible key range of query i.
func (e *engine) visible(i, n, m int) (lo, hi int) {
	lo, hi = e.p.KeyRange(i, n, m)
	lo = max(lo, 0)
	hi = min(hi, m)
	return lo, hi
}

// rowScores fills sPre (scale·q·k, rounded) and s (after softcap and bias)
// for keys lo..hi-1 of query i of (b, h).
func (e *engine) rowScores(b, h, i, lo, hi int, sPre, s []float64) {
	p := e.p
	kh := h / p.Group()
	qo := (e.qRow(b, i)*p.H + h) * p.DK
	qi := e.q[qo : qo+p.DK]
	for j := lo; j < hi; j++ {
		ko := (e.kRow(b, j)*p.Hkv + kh) * p.DK
		kj := e.k[ko : ko+p.DK]
		var dot float64
		for d, x := range qi {
			dot += x * kj[d]
		}
		x := e.r(p.Scale * dot)
		sPre[j-lo] = x
		if e.softcap > 0 {
			x = e.r(e.softcap * math.Tanh(x/e.softcap))
		}
		if e.bias != nil {
			x = e.r(x + e.bias[e.biasIndex(b, h, i, j)])
		}
		s[j-lo] = x
	}
}

// rowProbs turns the scores s into probabilities in place and returns the
// LSE; it returns -Inf (and zeros s) when no key has a finite score, and
// NaN (s all NaN) when a score is NaN or +Inf (Go's max keeps a NaN).
func (e *engine) rowProbs(s []float64) float64 {
	mx := math.Inf(-1)
	for _, x := range s {
		mx = max(mx, x)
	}
	if math.IsInf(mx, -1) {
		clear(s)
		return math.Inf(-1)
	}
	var sum float64
	for _, x := range s {
		sum += math.Exp(x - mx)
	}
	lse := mx + math.Log(sum)
	for j, x := range s {
		if e.rnd == nil {
			s[j] = math.Exp(x - lse)
		} else {
			s[j] = e.r(math.Exp(x-mx) / sum)
		}
	}
	return lse
}

// rowKeep fills keep for keys lo..hi-1 of query i of (b, h) (all true without dropout).
func (e *engine) rowKeep(b, h, i, lo int, keep []bool) {
	if e.dropout == 0 {
		for j := range keep {
			keep[j] = true
		}
		return
	}
	head, heads, qo, ko := e.p.DropoutPlace(h)
	philox.NewMask(e.p.Opt.Seed, e.p.Opt.Offset, e.p.DropThreshold, b, head, heads).KeepRow(i+qo, lo+ko, keep)
}

// parallel runs f(t) for t in [0, n) on up to GOMAXPROCS goroutines. Each
// task writes disjoint outputs, so the result does not depend on scheduling.
func parallel(n int, f func(t int)) {
	w := min(runtime.GOMAXPROCS(0), n)
	if w <= 1 {
		for t := 0; t < n; t++ {
			f(t)
		}
		return
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	next := 0
	for range w {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				t := next
				next++
				mu.Unlock()
				if t >= n {
					return
				}
				f(t)
			}
		}()
	}
	wg.Wait()
}

func (e *engine) forward() {
	p := e.p
	if p.Varlen {
		e.o = make([]float64, p.TotalQ*p.H*p.DV)
		e.lse = make([]float64, p.H*p.TotalQ)
	} else {
		e.o = make([]float64, p.B*p.N*p.H*p.DV)
		e.lse = make([]float64, p.B*p.H*p.N)
	}
	inv := e.p.DropScale // 256/T (package philox)
	parallel(p.B*p.H, func(t int) {
		b, h := t/p.H, t%p.H
		kh := h / p.Group()
		_, n, _, m := p.Segment(b)
		sPre := make([]float64, m)
		s := make([]float64, m)
		keep := make([]bool, m)
		acc := make([]float64, p.DV)
		for i := 0; i < n; i++ {
			oo := (e.qRow(b, i)*p.H + h) * p.DV
			lo, hi := e.visible(i, n, m)
			if lo >= hi {
				e.lse[e.lseIndex(b, h, i)] = math.Inf(-1)
				continue
			}
			e.rowScores(b, h, i, lo, hi, sPre, s[:hi-lo])
			lse := e.rowProbs(s[:hi-lo])
			if e.rnd != nil {
				lse = float64(float32(lse))
			}
			e.lse[e.lseIndex(b, h, i)] = lse
			if math.IsInf(lse, -1) {
				continue // no key has a finite score: O = 0
			}
			e.rowKeep(b, h, i, lo, keep[:hi-lo])
			clear(acc)
			// Every visible key takes part, a dropped one with weight 0:
			// a NaN or infinite value poisons the rows that see it.
			for j := lo; j < hi; j++ {
				var pd float64
				if keep[j-lo] {
					pd = s[j-lo]
					if e.dropout > 0 {
						pd = e.r(pd * inv)
					}
				}
				vo := (e.kRow(b, j)*p.Hkv + kh) * p.DV
				for d, x := range e.v[vo : vo+p.DV] {
					acc[d] += pd * x
				}
			}
			for d, x := range acc {
				e.o[oo+d] = e.r(x)
			}
		}
	})
}

// backward computes the gradients; forward must have run.
func (e *engine) backward() *RefGrads {
	p := e.p
	g := &RefGrads{DQ: make([]float64, len(e.q)), DK: make([]float64, len(e.k)), DV: make([]float64, len(e.v))}
	wantDBias := p.Opt.Bias != nil && p.Opt.Bias.RequiresGrad
	if wantDBias {
		g.DBias = make([]float64, len(e.bias))
	}
	inv := e.p.DropScale // 256/T (package philox)
	task := func(t int) {
		b, kh := t/p.Hkv, t%p.Hkv
		_, n, _, m := p.Segment(b)
		sPre := make([]float64, m)
		s := make([]float64, m)
		keep := make([]bool, m)
		dq := make([]float64, p.DK)
		for h := kh * p.Group(); h < (kh+1)*p.Group(); h++ {
			for i := 0; i < n; i++ {
				lo, hi := e.visible(i, n, m)
				if lo >= hi {
					continue
				}
				e.rowScores(b, h, i, lo, hi, sPre, s[:hi-lo])
				if math.IsInf(e.rowProbs(s[:hi-lo]), -1) {
					continue
				}
				e.rowKeep(b, h, i, lo, keep[:hi-lo])
				qo := (e.qRow(b, i)*p.H + h) * p.DK
				oo := (e.qRow(b, i)*p.H + h) * p.DV
				doi := e.do[oo : oo+p.DV]
				var delta float64
				for d, x := range doi {
					delta += x * e.o[oo+d]
				}
				delta = e.r(delta)
				clear(dq)
				for j := lo; j < hi; j++ {
					pj := s[j-lo]
					ko := (e.kRow(b, j)*p.Hkv + kh) * p.DK
					vo := (e.kRow(b, j)*p.Hkv + kh) * p.DV
					var dp, pd float64
					if keep[j-lo] {
						for d, x := range doi {
							dp += x * e.v[vo+d]
						}
						dp = e.r(dp)
						pd = pj
						if e.dropout > 0 {
							dp = e.r(dp * inv)
							pd = e.r(pj * inv)
						}
					}
					ds := e.r(pj * (dp - delta))
					if wantDBias {
						g.DBias[e.biasIndex(b, h, i, j)] += ds
					}
					if e.softcap > 0 {
						th := math.Tanh(sPre[j-lo] / e.softcap)
						ds = e.r(ds * (1 - th*th))
					}
					for d := 0; d < p.DV; d++ {
						g.DV[vo+d] += pd * doi[d]
					}
					c := p.Scale * ds
					for d := 0; d < p.DK; d++ {
						dq[d] += c * e.k[ko+d]
						g.DK[ko+d] += c * e.q[qo+d]
					}
				}
				copy(g.DQ[qo:qo+p.DK], dq)
			}
		}
	}
	if wantDBias {
		// dBias sums over broadcast dimensions across tasks: run in order.
		for t := 0; t < p.B*p.Hkv; t++ {
			task(t)
		}
	} else {
		parallel(p.B*p.Hkv, task)
	}
	if e.rnd != nil {
		for _, x := range [][]float64{g.DQ, g.DK, g.DV, g.DBias} {
			for i := range x {
				x[i] = e.r(x[i])
			}
		}
	}
	return g
}
