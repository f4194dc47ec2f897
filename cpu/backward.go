package cpu

import (
	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/internal/vec"
)

// maxChunks bounds how many key chunks one (sequence, key head) is split
// into in the backward; each chunk costs one float32 dQ accumulator the size
// of dQ.
const maxChunks = 4

// bwd is the state of one Backward call on top of call.
type bwd struct {
	*call
	do     view
	lse    []float32 // contiguous LSE (LSEShape), -Inf for rows that see no key
	delta  []float32 // Delta = rowsum(dO∘O), laid out like lse
	chunks int
	dqp    []float32 // chunks partial dQ accumulators, each shaped like q (contiguous)
	g      attn.Gradients
}

// Backward computes dQ, dK, dV (and dBias when the bias asks for it), each
// contiguous in its input's dtype and shape, from the forward's inputs, its
// outputs o and lse, and dO.
//
// The work is cut into fixed units, independent of GOMAXPROCS: dK and dV of
// one key block are accumulated by one goroutine looping over the query
// heads of the group and the query blocks in order; the keys of a (sequence,
// key head) are split into a fixed number of chunks, each with its own dQ
// accumulator, and the accumulators are summed in chunk order. dBias is
// reduced by a separate pass over its own tiles. The results are therefore
// bit-identical from run to run and whatever GOMAXPROCS is.
func (b *Backend) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	c, err := newCall(q, k, v, opt)
	if err != nil {
		return attn.Gradients{}, err
	}
	p := c.p
	if err := p.CheckBackward(q, o, lse, dO); err != nil {
		return attn.Gradients{}, err
	}
	w := &bwd{call: c, do: newView(dO, false)}
	w.g = attn.Gradients{DQ: attn.New(q.DType, q.Shape...), DK: attn.New(k.DType, k.Shape...), DV: attn.New(v.DType, v.Shape...)}
	units := c.queryUnits()

	// Pass 1: LSE in a contiguous buffer and Delta.
	nl := attn.NumElements(p.LSEShape())
	w.lse, w.delta = make([]float32, nl), make([]float32, nl)
	ov := newView(o, false)
	if err := c.runUnits(len(units), func(_ *scratch, u int) { w.prepare(units[u], ov, lse) }); err != nil {
		return attn.Gradients{}, err
	}

	// Pass 2: dK, dV and the dQ partials.
	nkb := (p.M + blockK - 1) / blockK
	w.chunks = 1
	if base := p.B * p.Hkv; base < 16 {
		w.chunks = max(1, min(maxChunks, (16+base-1)/base, nkb))
	}
	w.dqp = make([]float32, w.chunks*q.NumElements())
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

// prepare fills lse and delta for the rows of u.
func (w *bwd) prepare(u qunit, ov view, lse attn.Tensor) {
	p := w.p
	st := lse.Strides
	if st == nil {
		st = attn.ContiguousStrides(lse.Shape)
	}
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
		oo := ov.row(u.sg.vb, u.sg.q0+i, u.h)
		do := w.do.row(u.sg.vb, u.sg.q0+i, u.h)
		var d float64
		for j, x := range w.do.data[do : do+p.DV] {
			d += float64(x) * float64(ov.data[oo+j])
		}
		w.delta[li] = float32(d)
	}
}

// tileGrads computes, for query head h, queries i0 … i0+rows-1 and keys
// j0 … j0+cols-1 of sg: P in sc.s, dS in sc.dp (times the softcap
// derivative when deriv is set) and returns the dropped-and-rescaled P
// (sc.pd, or sc.s itself without dropout). All tiles have leading
// dimension blockK.
func (w *bwd) tileGrads(sc *scratch, sg seg, h, i0, rows, j0, cols int, deriv bool) []float32 {
	p := w.p
	kh := h / p.Group()
	deriv = deriv && w.softcap > 0
	w.scores(sc, sg, h, i0, rows, j0, cols, deriv)
	vec.MatMulNT(rows, cols, p.DV, w.do.data[w.do.row(sg.vb, sg.q0+i0, h):], w.do.si,
		w.v.data[w.v.row(sg.vb, sg.k0+j0, kh):], w.v.si, sc.dp, blockK, false)
	dropout := p.Opt.Dropout > 0
	pd := sc.s
	if dropout {
		pd = sc.pd
	}
	for r := 0; r < rows; r++ {
		li := lseIndex(p, sg, i0+r, h)
		x := sc.s[r*blockK : r*blockK+cols]
		dp := sc.dp[r*blockK : r*blockK+cols]
		if w.lse[li] == negInf {
			clear(x)
			clear(dp)
			if dropout {
				clear(pd[r*blockK : r*blockK+cols])
			}
			continue
		}
		vec.ExpSub(x, w.lse[li])
		delta := w.delta[li]
		if dropout {
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
		for j, pj := range x {
			dp[j] = pj * (dp[j] - delta)
		}
		if deriv {
			for j, t := range sc.th[r*blockK : r*blockK+cols] {
				dp[j] *= 1 - t*t
			}
		}
	}
	return pd
}

// keyUnit accumulates dK and dV of the key blocks of chunk ch of (sg, kh),
// and that chunk's share of dQ.
func (w *bwd) keyUnit(sc *scratch, sg seg, kh, ch int) {
	p := w.p
	nkb := (sg.m + blockK - 1) / blockK
	dk, dv := p.DK, p.DV
	dqp := w.dqp[ch*w.g.DQ.NumElements():]
	for kb := ch * nkb / w.chunks; kb < (ch+1)*nkb/w.chunks; kb++ {
		j0 := kb * blockK
		cols := min(blockK, sg.m-j0)
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
				pd := w.tileGrads(sc, sg, h, i0, rows, j0, cols, true)
				vec.MatMulTN(cols, dv, rows, pd, blockK, w.do.data[w.do.row(sg.vb, sg.q0+i0, h):], w.do.si, accV, dv, true)
				vec.MatMulTN(cols, dk, rows, sc.dp, blockK, w.q.data[w.q.row(sg.vb, sg.q0+i0, h):], w.q.si, accK, dk, true)
				vec.MatMulNN(rows, dk, cols, sc.dp, blockK, w.k.data[w.k.row(sg.vb, sg.k0+j0, kh):], w.k.si,
					dqp[outRow(p, sg, i0, h, dk):], p.H*dk, true)
			}
		}
		for j := 0; j < cols; j++ {
			storeRow(w.g.DK, keyRow(p, sg, j0+j, kh, dk), accK[j*dk:(j+1)*dk], w.scale)
			storeRow(w.g.DV, keyRow(p, sg, j0+j, kh, dv), accV[j*dv:(j+1)*dv], 1)
		}
	}
}

// sumDQ writes dQ for the rows of u: Scale times the sum of the chunk
// partials, added in chunk order.
func (w *bwd) sumDQ(u qunit) {
	p := w.p
	dk := p.DK
	size := w.g.DQ.NumElements()
	for r := 0; r < u.rows; r++ {
		o := outRow(p, u.sg, u.i0+r, u.h, dk)
		row := w.dqp[o : o+dk]
		for ch := 1; ch < w.chunks; ch++ {
			part := w.dqp[ch*size+o : ch*size+o+dk]
			for d, x := range part {
				row[d] += x
			}
		}
		storeRow(w.g.DQ, o, row, w.scale)
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
	for j0 := lo; j0 < hi; j0 += blockK {
		cols := min(blockK, hi-j0)
		clear(acc)
		for b := b0; b < b1; b++ {
			for h := h0; h < h1; h++ {
				w.tileGrads(sc, w.segs[b], h, i0, rows, j0, cols, false)
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
