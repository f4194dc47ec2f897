package cpu

import (
	"slices"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/internal/vec"
)

// bwd is the state of one Backward call on top of call.
type bwd struct {
	*call
	do, o src
	// Per query row, in the order of lseIndex: the LSE (-Inf for rows that
	// see no key), Delta = rowsum(dO∘O), and the rows of Q and dO packed
	// as float32 (rows×DK and rows×DV).
	lse, delta []float32
	qh, doh    []float32
	rowsTotal  int
	// rowbad[li] is set (with a mask) when the Q or dO row li holds a NaN
	// or an infinity: the masked tiles of that row then multiply by the
	// visible pairs only (see call.nonfinite and visibleGrads).
	rowbad []bool
	// With bf16 set, the rows of Q and dO are also kept as bfloat16, padded
	// to dkp and dvp, for the products with Kᵀ and Vᵀ.
	qb, dob []uint16
	// The keys of every (sequence, key head) are split into chunks, each
	// with its own float32 dQ accumulator dqp[ch] (rowsTotal×DK, rows in
	// the order of lseIndex).
	chunks int
	dqp    []float32
	g      attn.Gradients
	// gq, gk, gv write the rows of g.DQ, g.DK, g.DV in their layout.
	gq, gk, gv src
}

// Backward computes dQ, dK, dV (and dBias when the bias asks for it), each
// in its input's dtype, shape and memory order (attn.NewLike), from the
// forward's inputs, its outputs o and lse, and dO.
//
// Q, dO, K and V are first packed as float32 (K and V also transposed, in
// blocks of blockK keys). The work is then cut into fixed units,
// independent of GOMAXPROCS: dK and dV of one key block are accumulated by
// one goroutine looping over the query heads of the group and the query
// blocks in order; the keys of a (sequence, key head) are split into a
// fixed number of chunks, each with its own dQ accumulator, and the
// accumulators are summed in chunk order. dBias is reduced by a separate
// pass over its own tiles. The results are therefore bit-identical from run
// to run and whatever GOMAXPROCS is.
func (b *Backend) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	c, err := newCall(q, k, v, opt)
	if err != nil {
		return attn.Gradients{}, err
	}
	p := c.p
	if err := p.CheckBackward(q, o, lse, dO); err != nil {
		return attn.Gradients{}, err
	}
	w := &bwd{call: c, do: newSrc(dO), o: newSrc(o)}
	w.g = attn.Gradients{DQ: attn.NewLike(q.DType, q), DK: attn.NewLike(k.DType, k), DV: attn.NewLike(v.DType, v)}
	w.gq, w.gk, w.gv = newSrc(w.g.DQ), newSrc(w.g.DK), newSrc(w.g.DV)
	units := c.queryUnits()

	// Pass 1: pack Q, dO (with LSE and Delta) and the key blocks, and
	// clear the dQ accumulators.
	w.rowsTotal = attn.NumElements(p.LSEShape())
	nl := w.rowsTotal
	w.chunks = chunksFor(p.B*p.Hkv, (p.M+blockK-1)/blockK)
	nblk := c.kblk[p.B] * p.Hkv
	c.bf16 = q.DType == attn.BFloat16 && vec.NativeBF16()
	c.scanK = p.Masked
	if p.Masked {
		w.rowbad = make([]bool, nl)
	}
	nkeys := nblk * blockK * (2*p.DK + p.DV) // kr, kt, vt
	if c.bf16 {
		nkeys = nblk * blockK * p.DK // kr; ktb and vtb are bfloat16
	}
	a := arenas32.get(nl*(2+p.DK+p.DV+w.chunks*p.DK) + nkeys)
	defer arenas32.put(a)
	w.lse, w.delta = a.take(nl), a.take(nl)
	w.qh, w.doh = a.take(nl*p.DK), a.take(nl*p.DV)
	w.dqp = a.take(w.chunks * nl * p.DK)
	c.kr = a.take(nblk * blockK * p.DK)
	if c.bf16 {
		a16 := arenas16.get((nl + nblk*blockK) * (c.dkp + c.dvp))
		defer arenas16.put(a16)
		w.qb, w.dob = a16.take(nl*c.dkp), a16.take(nl*c.dvp)
		c.ktb, c.vtb = a16.take(nblk*c.dkp*blockK), a16.take(nblk*c.dvp*blockK)
	} else {
		c.kt, c.vt = a.take(nblk*p.DK*blockK), a.take(nblk*p.DV*blockK)
	}
	nk, pack := c.keyUnits()
	if err := c.runUnits(len(units)+nk, func(sc *scratch, u int) {
		if u < len(units) {
			w.prepare(sc, units[u], lse)
			return
		}
		pack(sc, u-len(units))
	}); err != nil {
		return attn.Gradients{}, err
	}

	// Pass 2: dK, dV and the dQ partials.
	nu := p.B * p.Hkv * w.chunks
	if err := c.runUnits(nu, func(sc *scratch, u int) {
		w.keyUnit(sc, c.segs[u/(p.Hkv*w.chunks)], u/w.chunks%p.Hkv, u%w.chunks)
	}); err != nil {
		return attn.Gradients{}, err
	}

	// Pass 3: dQ = Scale · Σ partials, in chunk order.
	if err := c.runUnits(len(units), func(_ *scratch, u int) { w.sumDQ(units[u]) }); err != nil {
		return attn.Gradients{}, err
	}

	// Pass 4: dBias.
	if opt.Bias != nil && opt.Bias.RequiresGrad {
		bs := opt.Bias.Tensor.Shape
		db := attn.New(opt.Bias.Tensor.DType, bs...)
		nqb := (p.N + blockQ - 1) / blockQ
		if err := c.runUnits(bs[0]*bs[1]*nqb, func(sc *scratch, u int) {
			w.biasUnit(sc, db, u/(bs[1]*nqb), u/nqb%bs[1], u%nqb*blockQ)
		}); err != nil {
			return attn.Gradients{}, err
		}
		w.g.DBias = &db
	}
	return w.g, nil
}

// prepare packs the Q and dO rows of u and fills their LSE and Delta.
func (w *bwd) prepare(sc *scratch, u qunit, lse attn.Tensor) {
	p := w.p
	st := lse.Strides
	if st == nil {
		st = attn.ContiguousStrides(lse.Shape)
	}
	orow := sc.rows[:p.DV]
	for r := 0; r < u.rows; r++ {
		i := u.i0 + r
		var off int
		if p.Varlen {
			off = lse.Offset + u.h*st[0] + (u.sg.q0+i)*st[1]
		} else {
			off = lse.Offset + u.sg.b*st[0] + u.h*st[1] + i*st[2]
		}
		li := lseIndex(p, u.sg, i, u.h)
		w.lse[li] = lse.F32[off]
		for ch := 0; ch < w.chunks; ch++ {
			o := (ch*w.rowsTotal + li) * p.DK
			clear(w.dqp[o : o+p.DK])
		}
		w.q.load(w.qh[li*p.DK:(li+1)*p.DK], u.sg.vb, u.sg.q0+i, u.h)
		do := w.doh[li*p.DV : (li+1)*p.DV]
		w.do.load(do, u.sg.vb, u.sg.q0+i, u.h)
		if w.bf16 {
			qb, db := w.qb[li*w.dkp:(li+1)*w.dkp], w.dob[li*w.dvp:(li+1)*w.dvp]
			w.q.loadBits(qb, u.sg.vb, u.sg.q0+i, u.h)
			w.do.loadBits(db, u.sg.vb, u.sg.q0+i, u.h)
			if p.DK < w.dkp {
				qb[p.DK] = 0
			}
			if p.DV < w.dvp {
				db[p.DV] = 0
			}
		}
		w.o.load(orow, u.sg.vb, u.sg.q0+i, u.h)
		w.delta[li] = vec.Dot(do, orow)
		if w.rowbad != nil {
			// A NaN or infinity in dO makes Delta NaN or infinite (so does
			// one in O, which is harmless here): dO needs no scan of its own.
			d := w.delta[li]
			w.rowbad[li] = d-d != 0 || !finite(w.qh[li*p.DK:(li+1)*p.DK])
		}
	}
}

// tileGrads computes, for query head h, queries i0 … i0+rows-1 (whose first
// row has index li in the packed query-side buffers) and key block jb of
// sg: P in sc.s, dS in sc.dp (times the softcap derivative when deriv is
// set), and returns the dropped-and-rescaled P (sc.pd, or sc.s itself
// without dropout). All tiles have leading dimension blockK.
func (w *bwd) tileGrads(sc *scratch, sg seg, h, i0, rows, jb, li int, deriv bool) []float32 {
	p := w.p
	kh := h / p.Group()
	j0 := jb * blockK
	cols := min(blockK, sg.m-j0)
	blk := w.block(sg, kh, jb)
	if w.bf16 {
		vec.MatMulBF16(rows, cols, w.dkp, w.qb[li*w.dkp:], w.dkp, w.ktb[blk*w.dkp*blockK:], 2*blockK, sc.s, blockK, false)
		vec.MatMulBF16(rows, cols, w.dvp, w.dob[li*w.dvp:], w.dvp, w.vtb[blk*w.dvp*blockK:], 2*blockK, sc.dp, blockK, false)
	} else {
		vec.MatMulNN(rows, cols, p.DK, w.qh[li*p.DK:], p.DK, w.kt[blk*p.DK*blockK:], blockK, sc.s, blockK, false)
		vec.MatMulNN(rows, cols, p.DV, w.doh[li*p.DV:], p.DV, w.vt[blk*p.DV*blockK:], blockK, sc.dp, blockK, false)
	}
	lse, delta := w.lse[li:li+rows], w.delta[li:li+rows]
	dropout := p.Opt.Dropout > 0
	if !dropout && w.plainTile(sg, i0, rows, j0, cols) {
		vec.ExpRows(sc.s, blockK, rows, cols, w.scale, lse)
		vec.SoftmaxGrad(sc.s, blockK, sc.dp, blockK, rows, cols, delta)
		return sc.s
	}
	deriv = deriv && w.softcap > 0
	w.adjust(sc, sg, h, i0, rows, j0, cols)
	vec.ExpRows(sc.s, blockK, rows, cols, 1, lse)
	pd := sc.s
	if dropout {
		pd = sc.pd
		for r := 0; r < rows; r++ {
			x := sc.s[r*blockK : r*blockK+cols]
			dp := sc.dp[r*blockK : r*blockK+cols]
			pr := pd[r*blockK : r*blockK+cols]
			for j, kept := range w.dropMask(sc, sg, h, i0+r, j0, cols) {
				if kept {
					pr[j] = x[j] * w.inv
					dp[j] *= w.inv
				} else {
					pr[j] = 0
					dp[j] = 0
				}
			}
		}
	}
	vec.SoftmaxGrad(sc.s, blockK, sc.dp, blockK, rows, cols, delta)
	masked := w.maskedTile(sg, i0, rows, j0, cols)
	for r := 0; r < rows; r++ {
		dp := sc.dp[r*blockK : r*blockK+cols]
		if lse[r] == negInf {
			clear(dp)
			continue
		}
		if deriv {
			for j, t := range sc.th[r*blockK : r*blockK+cols] {
				dp[j] *= 1 - t*t
			}
		}
		if masked {
			// A masked key's P and dS are 0 by definition; computed, they
			// are NaN where the LSE, Delta or dP (a masked V) is. (V is
			// not scanned: dS is its only way out.)
			lo, hi := w.visibleIn(sg, i0+r, j0, cols)
			for _, x := range [][]float32{sc.s[r*blockK : r*blockK+cols], pd[r*blockK : r*blockK+cols], dp} {
				zeroOutside(x, lo-j0, hi-j0)
			}
		}
	}
	return pd
}

// zeroOutside sets the elements of x outside [lo, hi) to 0 (all of them
// when lo ≥ hi).
func zeroOutside(x []float32, lo, hi int) {
	lo, hi = max(lo, 0), min(hi, len(x))
	if lo >= hi {
		clear(x)
		return
	}
	clear(x[:lo])
	clear(x[hi:])
}

// visibleGrads adds the tile's contributions to dV (accV += Pᵀ·dO), dK
// (accK += dSᵀ·Q) and the dQ partial (dqp += dS·K) as the matrix products
// of keyUnit do, but over the (query, key) pairs that the mask keeps only:
// a masked pair's P and dS are 0, and 0 times a NaN or infinite Q, dO or K
// row would leak into a gradient that the row or key cannot reach.
func (w *bwd) visibleGrads(sc *scratch, sg seg, i0, rows, j0, cols, blk, li int, pd, accK, accV, dqp []float32) {
	p := w.p
	dk, dv := p.DK, p.DV
	for r := 0; r < rows; r++ {
		q := w.qh[(li+r)*dk : (li+r+1)*dk]
		do := w.doh[(li+r)*dv : (li+r+1)*dv]
		dq := dqp[(li+r)*dk : (li+r+1)*dk]
		lo, hi := w.visibleIn(sg, i0+r, j0, cols)
		for j := lo; j < hi; j++ {
			c := j - j0
			pj, ds := pd[r*blockK+c], sc.dp[r*blockK+c]
			av := accV[c*dv : (c+1)*dv]
			for e, x := range do {
				av[e] += pj * x
			}
			ak := accK[c*dk : (c+1)*dk]
			for e, x := range q {
				ak[e] += ds * x
			}
			for e, x := range w.kr[(blk*blockK+c)*dk : (blk*blockK+c+1)*dk] {
				dq[e] += ds * x
			}
		}
	}
}

// keyUnit accumulates dK and dV of the key blocks of chunk ch of (sg, kh),
// and that chunk's share of dQ.
func (w *bwd) keyUnit(sc *scratch, sg seg, kh, ch int) {
	p := w.p
	nkb := (sg.m + blockK - 1) / blockK
	dk, dv := p.DK, p.DV
	dqp := w.dqp[ch*w.rowsTotal*dk : (ch+1)*w.rowsTotal*dk]
	for kb := ch * nkb / w.chunks; kb < (ch+1)*nkb/w.chunks; kb++ {
		j0 := kb * blockK
		cols := min(blockK, sg.m-j0)
		blk := w.block(sg, kh, kb)
		accK, accV := sc.dk[:cols*dk], sc.dv[:cols*dv]
		clear(accK)
		clear(accV)
		qi0, qi1 := 0, sg.n
		if p.Masked {
			qi0, qi1 = queryRange(p, sg.n, sg.m, j0, j0+cols)
		}
		for h := kh * p.Group(); h < (kh+1)*p.Group(); h++ {
			for i0 := qi0; i0 < qi1; i0 += blockQ {
				rows := min(blockQ, qi1-i0)
				li := lseIndex(p, sg, i0, h)
				pd := w.tileGrads(sc, sg, h, i0, rows, kb, li, true)
				if w.maskedTile(sg, i0, rows, j0, cols) && (w.nonfinite[blk] || slices.Contains(w.rowbad[li:li+rows], true)) {
					w.visibleGrads(sc, sg, i0, rows, j0, cols, blk, li, pd, accK, accV, dqp)
					continue
				}
				vec.MatMulTN(cols, dv, rows, pd, blockK, w.doh[li*dv:], dv, accV, dv, true)
				vec.MatMulTN(cols, dk, rows, sc.dp, blockK, w.qh[li*dk:], dk, accK, dk, true)
				vec.MatMulNN(rows, dk, cols, sc.dp, blockK, w.kr[blk*blockK*dk:], dk, dqp[li*dk:], dk, true)
			}
		}
		for j := 0; j < cols; j++ {
			w.gk.store(sg.vb, sg.k0+j0+j, kh, accK[j*dk:(j+1)*dk], w.scale)
			w.gv.store(sg.vb, sg.k0+j0+j, kh, accV[j*dv:(j+1)*dv], 1)
		}
	}
}

// sumDQ writes dQ for the rows of u: Scale times the sum of the chunk
// partials, added in chunk order.
func (w *bwd) sumDQ(u qunit) {
	p := w.p
	dk := p.DK
	size := w.rowsTotal * dk
	for r := 0; r < u.rows; r++ {
		o := lseIndex(p, u.sg, u.i0+r, u.h) * dk
		row := w.dqp[o : o+dk]
		for ch := 1; ch < w.chunks; ch++ {
			for d, x := range w.dqp[ch*size+o : ch*size+o+dk] {
				row[d] += x
			}
		}
		w.gq.store(u.sg.vb, u.sg.q0+u.i0+r, u.h, row, w.scale)
	}
}

// biasUnit computes rows i0 … of dBias[bb, bh] (db is contiguous in the
// bias's shape): the sum of dS over every (batch, head) that the bias
// broadcasts to that slice, added in batch-then-head order.
func (w *bwd) biasUnit(sc *scratch, db attn.Tensor, bb, bh, i0 int) {
	p := w.p
	bs := p.Opt.Bias.Tensor.Shape
	rows := min(blockQ, p.N-i0)
	b0, b1, h0, h1 := bb, bb+1, bh, bh+1
	if bs[0] == 1 {
		b0, b1 = 0, p.B
	}
	if bs[1] == 1 {
		h0, h1 = 0, p.H
	}
	lo, hi := 0, p.M
	if p.Masked {
		lo, hi = keySpan(p, p.N, p.M, i0, i0+rows)
	}
	if len(sc.acc) < blockQ*blockK {
		sc.acc = make([]float32, blockQ*blockK)
	}
	acc := sc.acc[:blockQ*blockK]
	for jb := lo / blockK; jb*blockK < hi; jb++ {
		j0 := jb * blockK
		cols := min(blockK, p.M-j0)
		clear(acc)
		for b := b0; b < b1; b++ {
			for h := h0; h < h1; h++ {
				sg := w.segs[b]
				w.tileGrads(sc, sg, h, i0, rows, jb, lseIndex(p, sg, i0, h), false)
				for r := 0; r < rows; r++ {
					a := acc[r*blockK : r*blockK+cols]
					for j, x := range sc.dp[r*blockK : r*blockK+cols] {
						a[j] += x
					}
				}
			}
		}
		for r := 0; r < rows; r++ {
			storeRow(db, ((bb*bs[1]+bh)*p.N+i0+r)*p.M+j0, acc[r*blockK:r*blockK+cols], 1)
		}
	}
}
