package cpu

import (
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

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

// minUnits is the number of work units a call aims for: when the natural
// units (query blocks in the forward, key heads in the backward) are fewer,
// the keys are split into a fixed number of chunks, so that a few cores
// stay busy on small batches too. It depends on nothing but the problem.
const minUnits = 16

// maxChunks bounds the number of key chunks; each costs a float32 partial
// result the size of O (forward) or dQ (backward).
const maxChunks = 8

// chunksFor returns the number of key chunks for base natural work units
// over nkb key blocks.
func chunksFor(base, nkb int) int {
	if base >= minUnits || base == 0 {
		return 1
	}
	return max(1, min(maxChunks, (minUnits+base-1)/base, nkb))
}

// arena hands out the working buffers of one call (packed inputs, partial
// results) from one slice, reused from call to call: fresh memory costs
// page faults and zeroing on every call, which on small problems take
// longer than the attention itself. Its contents are not zeroed; every
// buffer is written before it is read.
type arena[T float32 | uint16] struct {
	buf []T
	off int
}

// take returns the next n elements.
func (a *arena[T]) take(n int) []T {
	s := a.buf[a.off : a.off+n : a.off+n]
	a.off += n
	return s
}

// maxKeptBytes bounds the one arena of each element type that is kept
// between calls whatever the garbage collector does; other arenas go to a
// sync.Pool, which it empties.
const maxKeptBytes = 64 << 20

// arenaCache recycles the arenas of one element type.
type arenaCache[T float32 | uint16] struct {
	mu   sync.Mutex
	kept *arena[T]
	pool sync.Pool // *arena[T]
}

var arenas32 arenaCache[float32]
var arenas16 arenaCache[uint16]

// get returns an arena of at least n elements.
func (c *arenaCache[T]) get(n int) *arena[T] {
	c.mu.Lock()
	a := c.kept
	if a != nil && cap(a.buf) >= n {
		c.kept = nil
	} else {
		a = nil
	}
	c.mu.Unlock()
	if a == nil {
		a, _ = c.pool.Get().(*arena[T])
	}
	if a == nil || cap(a.buf) < n {
		a = &arena[T]{buf: make([]T, n)}
	}
	a.buf, a.off = a.buf[:cap(a.buf)], 0
	return a
}

// put recycles a; none of its buffers may be used afterwards.
func (c *arenaCache[T]) put(a *arena[T]) {
	var zero T
	if cap(a.buf)*int(unsafe.Sizeof(zero)) <= maxKeptBytes {
		c.mu.Lock()
		if c.kept == nil || cap(c.kept.buf) < cap(a.buf) {
			a, c.kept = c.kept, a
		}
		c.mu.Unlock()
	}
	if a != nil {
		c.pool.Put(a)
	}
}

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
	q, k, v src
	bias    biasRows
	hasBias bool
	scale   float32
	softcap float32
	inv     float32 // the scale of a kept probability: 256/T under dropout (attn.Problem.DropScale), else 1
	// kblk[b] is the index of the first key block of segment b in the
	// packed key buffers; kblk[B] is their number per key head.
	kblk []int
	// Packed keys and values, in blocks of blockK keys of one (segment, key
	// head), block (kblk[b]+jb)·Hkv + kh: kt holds Kᵀ (DK×blockK), vr the
	// rows of V (blockK×DV); the backward also uses vt (Vᵀ, DV×blockK) and
	// kr (the rows of K, blockK×DK). Rows past the end of a segment are
	// never read.
	kt, vr, vt, kr []float32
	// With bf16 set (bfloat16 inputs and native bfloat16 dot products),
	// the products with Kᵀ and Vᵀ (and the forward's P·V) multiply
	// bfloat16 values directly: ktb and vtb hold Kᵀ and Vᵀ in pairs of
	// rows (dkp/2 rows of 2·blockK, dvp/2 rows: the two values of a key
	// that multiply one pair of q or dO are adjacent), vrb the rows of V in
	// pairs (blockK/2 rows of 2·DV); dkp and dvp are DK and DV rounded up
	// to even, the padding zero. Buffers a call does not use are nil.
	bf16          bool
	dkp, dvp      int
	ktb, vtb, vrb []uint16
	// With a mask, a masked key's P (and dS) is 0, but 0 times a NaN or
	// infinite operand is NaN. The forward scans V (scanV) and the
	// backward K (scanK) while packing them, and nonfinite[blk] records a
	// key block holding such a value; the masked tiles of that block then
	// multiply by the visible keys only (visiblePV, visibleGrads). Finite
	// inputs cost the scan alone.
	scanK, scanV bool
	nonfinite    []bool
}

func newCall(q, k, v attn.Tensor, opt attn.Options) (*call, error) {
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return nil, err
	}
	c := &call{p: p, segs: segments(p), scale: float32(p.Scale), softcap: float32(opt.Softcap), inv: 1}
	if opt.Dropout > 0 {
		c.inv = float32(p.DropScale)
	}
	if opt.Softcap > 0 && (c.softcap == 0 || math.IsInf(float64(c.softcap), 0)) {
		return nil, attn.Errorf(attn.ErrUnsupported, "softcap %v is outside the float32 range", opt.Softcap)
	}
	if math.IsInf(float64(c.scale), 0) || c.scale == 0 {
		return nil, attn.Errorf(attn.ErrUnsupported, "scale %v is outside the float32 range", p.Scale)
	}
	c.q, c.k, c.v = newSrc(q), newSrc(k), newSrc(v)
	c.dkp, c.dvp = p.DK+p.DK%2, p.DV+p.DV%2
	if opt.Bias != nil {
		c.hasBias = true
		c.bias = newBiasRows(opt.Bias.Tensor)
	}
	c.kblk = make([]int, p.B+1)
	for b, sg := range c.segs {
		c.kblk[b+1] = c.kblk[b] + (sg.m+blockK-1)/blockK
	}
	c.nonfinite = make([]bool, c.kblk[p.B]*p.Hkv)
	return c, nil
}

// block returns the index of key block jb of (sg, kh) in the packed buffers.
func (c *call) block(sg seg, kh, jb int) int { return (c.kblk[sg.b]+jb)*c.p.Hkv + kh }

// scratch is the per-goroutine working memory: a few tiles, independent of
// the sequence lengths.
type scratch struct {
	q             []float32 // blockQ×DK query tile
	s, pd, dp, th []float32 // blockQ×blockK tiles: scores/probabilities, dropped P, dP/dS, tanh
	acc           []float32 // blockQ×DV output accumulator
	dk, dv        []float32 // blockK×DK and blockK×DV gradient accumulators
	m, l, alpha   []float32 // blockQ running max, sum and rescale factor
	rows          []float32 // blockK×max(DK, DV) rows being packed
	bias          []float32 // blockK: a row of a 16-bit bias, converted
	touched       uint32    // what biasRows.touch returned, kept
	keep          []bool    // blockK dropout decisions
	poisoned      []bool    // blockQ rows whose scores so far are all NaN or -Inf, with a NaN
	qb, pb, kb    []uint16  // bfloat16 tiles: blockQ×dkp queries, blockQ×blockK P, blockK rows of keys or values
	bits          []uint16  // two bfloat16 rows of max(DK, DV)
}

func (c *call) newScratch() *scratch {
	t := blockQ * blockK
	d := max(c.p.DK, c.p.DV)
	sc := &scratch{
		q: make([]float32, blockQ*c.p.DK),
		s: make([]float32, t), pd: make([]float32, t), dp: make([]float32, t), th: make([]float32, t),
		acc: make([]float32, blockQ*c.p.DV),
		dk:  make([]float32, blockK*c.p.DK), dv: make([]float32, blockK*c.p.DV),
		m: make([]float32, blockQ), l: make([]float32, blockQ), alpha: make([]float32, blockQ),
		rows: make([]float32, blockK*d), bias: make([]float32, blockK),
		keep: make([]bool, blockK), poisoned: make([]bool, blockQ),
	}
	if c.bf16 {
		sc.qb, sc.pb, sc.kb = make([]uint16, blockQ*c.dkp), make([]uint16, blockQ*blockK), make([]uint16, blockK*max(c.dkp, c.dvp))
		sc.bits = make([]uint16, 2*d)
	}
	return sc
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

// packKeys packs key block jb of (sg, kh) into the buffers of c that are
// not nil: kt and kr from K, vr and vt from V (float32), ktb, vtb and vrb
// (bfloat16).
func (c *call) packKeys(sc *scratch, sg seg, kh, jb int) {
	p := c.p
	j0 := jb * blockK
	cols := min(blockK, sg.m-j0)
	blk := c.block(sg, kh, jb)
	pack := func(s src, d int, rowsOut, transOut []float32, scan bool) {
		if rowsOut == nil && transOut == nil {
			return
		}
		rows := sc.rows[:blockK*d]
		if rowsOut != nil {
			rows = rowsOut[blk*blockK*d : (blk+1)*blockK*d]
		}
		for j := 0; j < cols; j++ {
			s.load(rows[j*d:(j+1)*d], sg.vb, sg.k0+j0+j, kh)
		}
		if scan && !finite(rows[:cols*d]) {
			c.nonfinite[blk] = true
		}
		if transOut != nil {
			vec.Transpose(cols, d, rows, d, transOut[blk*d*blockK:(blk+1)*d*blockK], blockK)
		}
	}
	pack(c.k, p.DK, c.kr, c.kt, c.scanK)
	pack(c.v, p.DV, c.vr, c.vt, c.scanV)
	// Transposed in pairs: rows padded to an even length with a zero.
	packPairs := func(s src, d, dp int, out []uint16) {
		if out == nil {
			return
		}
		rows := sc.kb[:blockK*dp]
		for j := 0; j < cols; j++ {
			s.loadBits(rows[j*dp:j*dp+d], sg.vb, sg.k0+j0+j, kh)
			if d < dp {
				rows[j*dp+d] = 0
			}
		}
		vec.TransposePairs(cols, dp/2, rows, dp, out[blk*dp*blockK:(blk+1)*dp*blockK], 2*blockK)
	}
	packPairs(c.k, p.DK, c.dkp, c.ktb)
	packPairs(c.v, p.DV, c.dvp, c.vtb)
	if c.vrb != nil {
		dv := p.DV
		vr := c.vrb[blk*blockK*dv : (blk+1)*blockK*dv]
		even, odd := sc.bits[:dv], sc.bits[dv:2*dv]
		for j := 0; j < cols; j += 2 {
			c.v.loadBits(even, sg.vb, sg.k0+j0+j, kh)
			if j+1 < cols {
				c.v.loadBits(odd, sg.vb, sg.k0+j0+j+1, kh)
				vec.Interleave(vr[j*dv:(j+2)*dv], even, odd)
			} else {
				vec.Interleave(vr[j*dv:(j+2)*dv], even, nil)
			}
		}
		if c.scanV && !finiteBF16(vr[:cols*dv]) {
			c.nonfinite[blk] = true
		}
	}
}

// finite reports whether every element of x is finite: v·0 is 0 for a
// finite v and NaN for an infinity or NaN, summed in eight independent
// chains.
func finite(x []float32) bool {
	var a, b, c, d, e, f, g, h float32
	i := 0
	for ; i+8 <= len(x); i += 8 {
		y := x[i : i+8 : i+8]
		a += y[0] * 0
		b += y[1] * 0
		c += y[2] * 0
		d += y[3] * 0
		e += y[4] * 0
		f += y[5] * 0
		g += y[6] * 0
		h += y[7] * 0
	}
	for ; i < len(x); i++ {
		a += x[i] * 0
	}
	return a+b+c+d+e+f+g+h == 0
}

// finiteBF16 reports whether every element of x, bfloat16 bit patterns, is
// finite (its exponent is not all ones).
func finiteBF16(x []uint16) bool {
	const exp = 0x7f80
	var a, b uint16 // exponent bits plus one in their lowest place carry into the sign bit when all ones
	i := 0
	for ; i+2 <= len(x); i += 2 {
		a |= x[i]&exp + 0x80
		b |= x[i+1]&exp + 0x80
	}
	for ; i < len(x); i++ {
		a |= x[i]&exp + 0x80
	}
	return (a|b)&0x8000 == 0
}

// keyUnits returns the number of key blocks of every (segment, key head),
// the units of packKeys, and a function that runs unit u.
func (c *call) keyUnits() (int, func(sc *scratch, u int)) {
	n := c.kblk[c.p.B] * c.p.Hkv
	return n, func(sc *scratch, u int) {
		blk, kh := u/c.p.Hkv, u%c.p.Hkv
		b := 0
		for c.kblk[b+1] <= blk {
			b++
		}
		c.packKeys(sc, c.segs[b], kh, blk-c.kblk[b])
	}
}

// plainTile reports whether the tile of queries i0 … i0+rows-1 and keys
// j0 … j0+cols-1 of sg needs nothing beyond scale·q·k: no softcap, no bias,
// and every key visible to every query.
func (c *call) plainTile(sg seg, i0, rows, j0, cols int) bool {
	if c.softcap > 0 || c.hasBias {
		return false
	}
	return !c.maskedTile(sg, i0, rows, j0, cols)
}

// maskedTile reports whether the mask hides some key of j0 … j0+cols-1 of
// sg from some query of i0 … i0+rows-1.
func (c *call) maskedTile(sg seg, i0, rows, j0, cols int) bool {
	if !c.p.Masked {
		return false
	}
	lo, _ := c.p.KeyRange(i0+rows-1, sg.n, sg.m)
	_, hi := c.p.KeyRange(i0, sg.n, sg.m)
	return lo > j0 || hi < j0+cols
}

// visibleIn returns the keys [lo, hi) of j0 … j0+cols-1 that query i of sg
// sees; lo ≥ hi when it sees none of them.
func (c *call) visibleIn(sg seg, i, j0, cols int) (lo, hi int) {
	lo, hi = c.p.KeyRange(i, sg.n, sg.m)
	return max(lo, j0), min(hi, j0+cols)
}

// adjust turns the products q·k in the tile sc.s (leading dimension blockK)
// of query head h, queries i0 … i0+rows-1 and keys j0 … j0+cols-1 of sg
// into scores: scale·q·k, softcapped (the tanh values left in sc.th),
// biased and masked to -Inf.
func (c *call) adjust(sc *scratch, sg seg, h, i0, rows, j0, cols int) {
	p := c.p
	if c.hasBias {
		sc.touched += c.bias.touch(sg.b, h, i0, rows, j0, cols)
	}
	for r := 0; r < rows; r++ {
		x := sc.s[r*blockK : r*blockK+cols]
		vec.Scale(x, c.scale)
		if c.softcap > 0 {
			softcapRow(x, sc.th[r*blockK:r*blockK+cols], c.softcap)
		}
		if c.hasBias {
			c.bias.add(x, sg.b, h, i0+r, j0, sc.bias)
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

// softcapRow replaces each score s of x by softcap·tanh(s/softcap) and
// leaves tanh(s/softcap) in th (of x's length). Past |s/softcap| = 1/4
// the tanh is (1 − e)/(1 + e) with e = exp(−2|s/softcap|) from the vector
// kernels, within a few float32 roundings of the exact value; below, where
// 1 − e would cancel, its Taylor series to x⁹ (relative error under 1e-8).
func softcapRow(x, th []float32, softcap float32) {
	const sign = 1 << 31
	abs := func(f float32) float32 { return math.Float32frombits(math.Float32bits(f) &^ sign) }
	inv := 1 / softcap
	// the exponentials only where some |s/softcap| (or a NaN) needs them
	for _, v := range x {
		if !(abs(v*inv) < 1.0/4) {
			for j, v := range x {
				th[j] = -2 * abs(v*inv)
			}
			vec.ExpSub(th, 0)
			break
		}
	}
	for j, v := range x {
		y := v * inv
		var t float32
		if abs(y) < 1.0/4 {
			y2 := y * y
			t = y * (1 + y2*(-1.0/3+y2*(2.0/15+y2*(-17.0/315+y2*(62.0/2835)))))
		} else {
			e := th[j]
			t = math.Float32frombits(math.Float32bits((1-e)/(1+e)) | math.Float32bits(y)&sign)
		}
		th[j] = t
		x[j] = softcap * t
	}
}

// dropMask fills sc.keep[:cols] for row i of (sg, h) from key j0.
func (c *call) dropMask(sc *scratch, sg seg, h, i, j0, cols int) []bool {
	o := c.p.Opt
	head, heads, qo, ko := c.p.DropoutPlace(h)
	philox.NewMask(o.Seed, o.Offset, c.p.DropThreshold, sg.b, head, heads).KeepRow(i+qo, j0+ko, sc.keep[:cols])
	return sc.keep[:cols]
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
		if sg.n == 0 {
			continue
		}
		for h := 0; h < c.p.H; h++ {
			for i0 := 0; i0 < sg.n; i0 += blockQ {
				units = append(units, qunit{sg: sg, h: h, i0: i0, rows: min(blockQ, sg.n-i0)})
			}
		}
	}
	return units
}

// fwd is the state of one Forward call on top of call.
type fwd struct {
	*call
	res attn.Result
	// With chunks > 1, the keys of every query block are split into chunks
	// and each chunk leaves its partial maxima, sums and (unnormalized)
	// outputs in pm, pl and po, laid out like the LSE (and O rows) in
	// head-major order; combine merges them in chunk order.
	chunks     int
	rowsTotal  int
	pm, pl, po []float32
}

// Forward computes O (in q's dtype, contiguous) and the float32 LSE.
//
// Each unit is a block of up to blockQ queries of one head (and, for small
// problems, one of a fixed number of chunks of its keys): the query tile is
// converted to float32 once, and for every block of blockK keys the scores
// S = Q·Kᵀ, the online-softmax update and O += P·V are computed in tiles,
// with K and V packed once per call.
func (b *Backend) Forward(q, k, v attn.Tensor, opt attn.Options) (attn.Result, error) {
	c, err := newCall(q, k, v, opt)
	if err != nil {
		return attn.Result{}, err
	}
	p := c.p
	f := &fwd{call: c, res: attn.Result{O: attn.New(q.DType, p.OutputShape()...), LSE: attn.New(attn.Float32, p.LSEShape()...)}}
	units := c.queryUnits()
	f.chunks = chunksFor(len(units), (p.M+blockK-1)/blockK)
	f.rowsTotal = attn.NumElements(p.LSEShape())
	nblk := c.kblk[p.B] * p.Hkv
	nkt, nvr := nblk*p.DK*blockK, nblk*blockK*p.DV
	var npart int
	if f.chunks > 1 {
		npart = f.chunks * f.rowsTotal * (2 + p.DV)
	}
	c.bf16 = q.DType == attn.BFloat16 && vec.NativeBF16()
	c.scanV = p.Masked
	n32 := npart
	if !c.bf16 {
		n32 += nkt + nvr
	}
	a := arenas32.get(n32)
	defer arenas32.put(a)
	if c.bf16 {
		a16 := arenas16.get(nblk * blockK * (c.dkp + p.DV))
		defer arenas16.put(a16)
		c.ktb, c.vrb = a16.take(nblk*c.dkp*blockK), a16.take(nblk*blockK*p.DV)
	} else {
		c.kt, c.vr = a.take(nkt), a.take(nvr)
	}
	if f.chunks > 1 {
		f.pm = a.take(f.chunks * f.rowsTotal)
		f.pl = a.take(f.chunks * f.rowsTotal)
		f.po = a.take(f.chunks * f.rowsTotal * p.DV)
	}
	nk, pack := c.keyUnits()
	if err := c.runUnits(nk, pack); err != nil {
		return attn.Result{}, err
	}

	if err := c.runUnits(len(units)*f.chunks, func(sc *scratch, u int) {
		f.unit(sc, units[u/f.chunks], u%f.chunks)
	}); err != nil {
		return attn.Result{}, err
	}
	if f.chunks > 1 {
		if err := c.runUnits(len(units), func(sc *scratch, u int) { f.combine(sc, units[u]) }); err != nil {
			return attn.Result{}, err
		}
	}
	return f.res, nil
}

// unit computes chunk ch of the keys for the queries of u.
func (f *fwd) unit(sc *scratch, u qunit, ch int) {
	p := f.p
	sg, h, i0, rows := u.sg, u.h, u.i0, u.rows
	kh := h / p.Group()
	dk, dv := p.DK, p.DV
	dkp := f.dkp
	q, qb := sc.q[:rows*dk], sc.qb
	for r := 0; r < rows; r++ {
		if f.bf16 {
			f.q.loadBits(qb[r*dkp:r*dkp+dk], sg.vb, sg.q0+i0+r, h)
			if dk < dkp {
				qb[r*dkp+dk] = 0
			}
			continue
		}
		f.q.load(q[r*dk:(r+1)*dk], sg.vb, sg.q0+i0+r, h)
	}
	acc := sc.acc[:rows*dv]
	clear(acc)
	m, l, alpha := sc.m[:rows], sc.l[:rows], sc.alpha[:rows]
	poisoned := sc.poisoned[:rows]
	for r := range m {
		m[r], l[r], poisoned[r] = negInf, 0, false
	}
	lo, hi := 0, sg.m
	if p.Masked {
		lo, hi = keySpan(p, sg.n, sg.m, i0, i0+rows)
	}
	if lo < hi {
		b0, b1 := lo/blockK, (hi+blockK-1)/blockK
		nb := b1 - b0
		for jb := b0 + ch*nb/f.chunks; jb < b0+(ch+1)*nb/f.chunks; jb++ {
			j0 := jb * blockK
			cols := min(blockK, sg.m-j0)
			blk := f.block(sg, kh, jb)
			if f.bf16 {
				vec.MatMulBF16(rows, cols, dkp, qb, dkp, f.ktb[blk*dkp*blockK:], 2*blockK, sc.s, blockK, false)
			} else {
				vec.MatMulNN(rows, cols, dk, q, dk, f.kt[blk*dk*blockK:], blockK, sc.s, blockK, false)
			}
			scale := f.scale
			plain := f.plainTile(sg, i0, rows, j0, cols)
			if !plain {
				f.adjust(sc, sg, h, i0, rows, j0, cols)
				scale = 1
			}
			// SoftmaxOnline ignores NaN scores in its maximum, so a row
			// whose scores so far are all NaN or -Inf would pass for one
			// that sees no key: remember it is NaN. (Elsewhere a NaN
			// reaches the row's sum.)
			for r, mr := range m {
				if mr != negInf || poisoned[r] {
					continue
				}
				lo, hi := j0, j0+cols
				if !plain {
					lo, hi = f.visibleIn(sg, i0+r, j0, cols)
				}
				if lo < hi && lostNaN(sc.s[r*blockK+lo-j0:r*blockK+hi-j0]) {
					poisoned[r] = true
				}
			}
			vec.SoftmaxOnline(sc.s, blockK, rows, cols, scale, m, l, alpha)
			for r, a := range alpha {
				if a != 1 {
					vec.Scale(acc[r*dv:(r+1)*dv], a)
				}
			}
			if p.Opt.Dropout > 0 {
				for r := 0; r < rows; r++ {
					x := sc.s[r*blockK : r*blockK+cols]
					for j, kept := range f.dropMask(sc, sg, h, i0+r, j0, cols) {
						if !kept {
							x[j] = 0
						}
					}
				}
			}
			careful := !plain && f.nonfinite[blk] && f.maskedTile(sg, i0, rows, j0, cols)
			if f.bf16 {
				// P is rounded to bfloat16 for the product with V;
				// l keeps the float32 sum.
				colsp := cols + cols%2
				vec.ScaleToBF16(sc.pb[:rows*blockK], sc.s[:rows*blockK], 1)
				if cols < colsp {
					for r := 0; r < rows; r++ {
						sc.pb[r*blockK+cols] = 0
					}
				}
				if careful {
					f.visiblePV(sc, sg, i0, rows, j0, cols, blk, acc)
					continue
				}
				vec.MatMulBF16(rows, dv, colsp, sc.pb, blockK, f.vrb[blk*blockK*dv:], 2*dv, acc, dv, true)
				continue
			}
			if careful {
				f.visiblePV(sc, sg, i0, rows, j0, cols, blk, acc)
				continue
			}
			vec.MatMulNN(rows, dv, cols, sc.s, blockK, f.vr[blk*blockK*dv:], dv, acc, dv, true)
		}
	}
	for r, bad := range poisoned {
		if bad {
			l[r] = nan
		}
	}
	if f.chunks > 1 {
		li := lseIndex(p, sg, i0, h)
		o := ch*f.rowsTotal + li
		copy(f.pm[o:o+rows], m)
		copy(f.pl[o:o+rows], l)
		copy(f.po[o*dv:(o+rows)*dv], acc)
		return
	}
	f.finish(sg, h, i0, rows, m, l, acc)
}

// visiblePV adds P·V of key block blk to acc (rows×DV) as the matrix
// product of unit does, but row by row over the keys each query sees: a
// masked key's P is 0, and 0 times a NaN or infinite value would leak into
// the row. P is sc.s, or sc.pb (rounded to bfloat16) on the bfloat16 path.
func (f *fwd) visiblePV(sc *scratch, sg seg, i0, rows, j0, cols, blk int, acc []float32) {
	dv := f.p.DV
	for r := 0; r < rows; r++ {
		a := acc[r*dv : (r+1)*dv]
		lo, hi := f.visibleIn(sg, i0+r, j0, cols)
		for j := lo; j < hi; j++ {
			c := j - j0
			if f.bf16 {
				// Row c of V is interleaved with its pair: element d at 2d + c%2.
				pj := bf16Float(sc.pb[r*blockK+c])
				pair := f.vrb[blk*blockK*dv+(c&^1)*dv : blk*blockK*dv+(c&^1+2)*dv]
				for d := range a {
					a[d] += pj * bf16Float(pair[2*d+c&1])
				}
				continue
			}
			pj := sc.s[r*blockK+c]
			for d, x := range f.vr[(blk*blockK+c)*dv : (blk*blockK+c+1)*dv] {
				a[d] += pj * x
			}
		}
	}
}

// bf16Float returns the bfloat16 bit pattern b as float32 (exactly).
func bf16Float(b uint16) float32 { return math.Float32frombits(uint32(b) << 16) }

// lostNaN reports whether the scores x hold a NaN but no value above -Inf:
// SoftmaxOnline, whose maximum ignores NaN, would take them for a row that
// sees no key. It stops at the first value above -Inf, usually the first.
func lostNaN(x []float32) bool {
	nan := false
	for _, v := range x {
		if v > negInf {
			return false
		}
		nan = nan || v != v
	}
	return nan
}

// finish writes the LSE and O rows of queries i0 … i0+rows-1 of (sg, h)
// from their maxima, sums and unnormalized outputs. A NaN sum marks a row
// that a NaN reached: its LSE and O are NaN.
func (f *fwd) finish(sg seg, h, i0, rows int, m, l, acc []float32) {
	p := f.p
	dv := p.DV
	for r := 0; r < rows; r++ {
		li := lseIndex(p, sg, i0+r, h)
		o := outRow(p, sg, i0+r, h, dv)
		row := acc[r*dv : (r+1)*dv]
		if l[r] != l[r] {
			f.res.LSE.F32[li] = nan
			storeRow(f.res.O, o, row, nan)
			continue
		}
		if l[r] == 0 || m[r] == negInf {
			f.res.LSE.F32[li] = negInf
			storeRow(f.res.O, o, row, 0)
			continue
		}
		f.res.LSE.F32[li] = float32(float64(m[r]) + math.Log(float64(l[r])))
		storeRow(f.res.O, o, row, f.inv/l[r])
	}
}

// combine merges the chunk partials of the queries of u, in chunk order:
// with M the largest chunk maximum, l = Σ l_c·exp(m_c − M) and
// O = Σ O_c·exp(m_c − M) / l, the weight of a chunk whose maximum is -Inf
// being 0 (so that its NaN, if any, still reaches l and O).
func (f *fwd) combine(sc *scratch, u qunit) {
	dv := f.p.DV
	li := lseIndex(f.p, u.sg, u.i0, u.h)
	m, l := sc.m[:u.rows], sc.l[:u.rows]
	acc := sc.acc[:u.rows*dv]
	for r := 0; r < u.rows; r++ {
		mx := negInf
		for ch := 0; ch < f.chunks; ch++ {
			mx = max(mx, f.pm[ch*f.rowsTotal+li+r])
		}
		m[r], l[r] = mx, 0
		row := acc[r*dv : (r+1)*dv]
		clear(row)
		for ch := 0; ch < f.chunks; ch++ {
			o := ch*f.rowsTotal + li + r
			var w float32
			if f.pm[o] != negInf {
				w = float32(math.Exp(float64(f.pm[o] - mx)))
			}
			l[r] += f.pl[o] * w
			for d, x := range f.po[o*dv : (o+1)*dv] {
				row[d] += x * w
			}
		}
	}
	f.finish(u.sg, u.h, u.i0, u.rows, m, l, acc)
}
