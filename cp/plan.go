package cp

import (
	"math"

	"github.com/flashattn/flashattn/attn"
)

// chunk is a run of consecutive positions of the global sequence held
// contiguously in a local buffer.
type chunk struct {
	local, global, n int
}

// chunksFor returns the chunks of rank r's shard of a sequence cut into
// chunks of c positions.
func chunksFor(l Layout, p, r, c int) []chunk {
	var out []chunk
	for i, ch := range l.chunksOf(p, r) {
		out = append(out, chunk{local: i * c, global: ch * c, n: c})
	}
	return out
}

// task is one backend call of a ring step: local query rows [q0, q0+nq)
// against the visiting keys [k0, k0+nk), under window (nil: every pair
// visible), with the diagonal aligned top-left. gq0 and gk0 are the
// global positions of its first query and first key; under dropout its
// rows and keys are consecutive in the global sequence too, so that they
// place its dropout mask. cuQ and cuK, set for a packed batch, are the
// call's cu_seqlens (see packedTasks).
type task struct {
	q0, nq, k0, nk int
	gq0, gk0       int
	window         *attn.Window
	cuQ, cuK       []int32
}

// block is the visible part of one (query chunk, key chunk) pair.
type block struct {
	task
	qi, ki int  // chunk indices in the local lists
	whole  bool // the task covers both chunks entirely with no mask
}

// planBlock returns the smallest rectangle of qc × kc holding every visible
// (query, key) pair of the global problem gp, and the top-left window that
// masks it exactly; ok is false when no pair is visible. Inside the
// rectangle the first row sees the first key's column at or after its
// band's start and the last key at or before its band's end, which keeps
// both sides of the shifted window non-negative: a band of the global
// problem is always a band of the rectangle. It returns an error wrapping
// attn.ErrUnsupported should the window not reproduce the mask.
func planBlock(gp *attn.Problem, qc, kc chunk) (t task, ok bool, err error) {
	r0, r1, k0, k1 := -1, -1, kc.n, 0
	full := true
	var first [2]int
	for i := range qc.n {
		lo, hi := gp.KeyRange(qc.global+i, gp.N, gp.M)
		lo = max(lo, kc.global) - kc.global
		hi = min(hi, kc.global+kc.n) - kc.global
		if lo >= hi {
			continue
		}
		if r0 < 0 {
			r0, first = i, [2]int{lo, hi}
		} else if lo != first[0] || hi != first[1] {
			full = false
		}
		if i != r1+1 && r1 >= 0 {
			return task{}, false, attn.Errorf(attn.ErrUnsupported, "cp: the visible rows of a block are not contiguous")
		}
		r1 = i
		k0, k1 = min(k0, lo), max(k1, hi)
	}
	if r0 < 0 {
		return task{}, false, nil
	}
	t = task{q0: qc.local + r0, nq: r1 + 1 - r0, k0: kc.local + k0, nk: k1 - k0, gq0: qc.global + r0, gk0: kc.global + k0}
	if full {
		return t, true, nil
	}
	// The global diagonal of query row r0 sits at key (qc.global+r0)+off;
	// delta is its distance from the rectangle's first key.
	off := 0
	if gp.Opt.Align == attn.AlignBottomRight {
		off = gp.M - gp.N
	}
	delta := qc.global + r0 + off - (kc.global + k0)
	w := attn.Window{Left: -1, Right: -1}
	if gp.Left >= 0 {
		w.Left = gp.Left - delta
	}
	if gp.Right >= 0 {
		w.Right = gp.Right + delta
	}
	if (gp.Left >= 0 && w.Left < 0) || (gp.Right >= 0 && w.Right < 0) {
		return task{}, false, attn.Errorf(attn.ErrUnsupported, "cp: block mask not expressible as a window (sides %d, %d)", w.Left, w.Right)
	}
	t.window = &w
	lp := attn.Problem{N: t.nq, M: t.nk, Opt: attn.Options{Align: attn.AlignTopLeft, Window: t.window}}
	lp.ResolveMask()
	for i := range t.nq {
		lo, hi := gp.KeyRange(qc.global+r0+i, gp.N, gp.M)
		lo = max(lo, kc.global+k0) - (kc.global + k0)
		hi = min(hi, kc.global+k1) - (kc.global + k0)
		llo, lhi := lp.KeyRange(i, t.nq, t.nk)
		llo, lhi = max(llo, 0), min(lhi, t.nk)
		if max(lo, 0) != llo || max(hi, lo) != max(lhi, llo) {
			return task{}, false, attn.Errorf(attn.ErrUnsupported, "cp: the window %+v does not reproduce the mask of row %d", w, r0+i)
		}
	}
	return t, true, nil
}

// plan returns the backend calls of one ring step: the local query chunks
// qs against the visiting key chunks ks. Blocks with no visible pair are
// skipped; when the visible blocks are all wholly visible and form one
// rectangle of consecutive local chunks, they become one call (under
// dropout only when the chunks are consecutive globally too), and so do
// blocks whose visible pairs one window masks in the local order (band).
func plan(gp *attn.Problem, qs, ks []chunk) ([]task, error) {
	var blocks []block
	for qi, qc := range qs {
		for ki, kc := range ks {
			t, ok, err := planBlock(gp, qc, kc)
			if err != nil {
				return nil, err
			}
			if ok {
				whole := t.window == nil && t.nq == qc.n && t.nk == kc.n
				blocks = append(blocks, block{task: t, qi: qi, ki: ki, whole: whole})
			}
		}
	}
	if t, ok := rectangle(blocks, qs, ks, gp.Opt.Dropout > 0); ok {
		return []task{t}, nil
	}
	if len(blocks) > 1 {
		if t, ok := band(gp, qs, ks); ok {
			return []task{t}, nil
		}
	}
	tasks := make([]task, len(blocks))
	for i, b := range blocks {
		tasks[i] = b.task
	}
	return tasks, nil
}

// rectangle reports whether blocks, all whole, are exactly the pairs of a
// run of consecutive query chunks and a run of consecutive key chunks
// (consecutive globally too when global is set), and returns the one task
// covering them.
func rectangle(blocks []block, qs, ks []chunk, global bool) (task, bool) {
	if len(blocks) < 2 {
		return task{}, false
	}
	qlo, qhi, klo, khi := len(qs), -1, len(ks), -1
	for _, b := range blocks {
		if !b.whole {
			return task{}, false
		}
		qlo, qhi = min(qlo, b.qi), max(qhi, b.qi)
		klo, khi = min(klo, b.ki), max(khi, b.ki)
	}
	if len(blocks) != (qhi-qlo+1)*(khi-klo+1) {
		return task{}, false
	}
	t := task{q0: qs[qlo].local, k0: ks[klo].local, gq0: qs[qlo].global, gk0: ks[klo].global}
	var ok bool
	if t.nq, ok = span(qs[qlo:qhi+1], global); !ok {
		return task{}, false
	}
	if t.nk, ok = span(ks[klo:khi+1], global); !ok {
		return task{}, false
	}
	return t, true
}

// span returns the length of a run of chunks, and, when global is set,
// whether each follows the previous one in the global sequence as well as
// locally.
func span(cs []chunk, global bool) (int, bool) {
	n := 0
	for i, c := range cs {
		if global && i > 0 && c.global != cs[i-1].global+cs[i-1].n {
			return 0, false
		}
		n += c.n
	}
	return n, true
}

// band reports whether the visible pairs of a step, over all its query
// chunks qs and key chunks ks (each list contiguous in the local buffers),
// are exactly those of one top-left window over a rectangle of local rows
// and keys, and returns that one call. Zigzag's own-block step is one: its
// query and key chunks r and 2P−1−r hold two causal triangles and the
// whole block between them, which in the local order are one causal
// triangle. Each local row's visible keys must be one run, the rows with
// any one run, and every row's run that of the window. Dropout places its
// mask by global positions, which a call over chunks apart in the global
// sequence cannot, so it is declined.
func band(gp *attn.Problem, qs, ks []chunk) (task, bool) {
	if gp.Opt.Dropout > 0 || !localRun(qs) || !localRun(ks) {
		return task{}, false
	}
	type run struct{ lo, hi int } // visible keys of a local row, from ks[0].local
	var rows []run
	r0, r1, kmin, kmax := -1, -1, math.MaxInt, 0
	for _, qc := range qs {
		for i := range qc.n {
			g := qc.global + i
			x := run{-1, -1}
			lo, hi := gp.KeyRange(g, gp.N, gp.M)
			for _, kc := range ks {
				a, b := max(lo, kc.global), min(hi, kc.global+kc.n)
				if a >= b {
					continue
				}
				a, b = a-kc.global+kc.local-ks[0].local, b-kc.global+kc.local-ks[0].local
				switch {
				case x.lo < 0:
					x = run{a, b}
				case a == x.hi:
					x.hi = b
				default:
					return task{}, false // two runs in one row
				}
			}
			at := len(rows)
			rows = append(rows, x)
			if x.lo < 0 {
				continue
			}
			if r1 >= 0 && at != r1+1 {
				return task{}, false // the visible rows are not contiguous
			}
			if r0 < 0 {
				r0 = at
			}
			r1 = at
			kmin, kmax = min(kmin, x.lo), max(kmax, x.hi)
		}
	}
	if r0 < 0 {
		return task{}, false
	}
	nk := kmax - kmin
	// the window's sides, from the first row whose run a side cuts (none: that side open)
	left, right := -1, -1
	cutLeft, cutRight := false, false
	for i, x := range rows[r0 : r1+1] {
		if lo := x.lo - kmin; lo > 0 && !cutLeft {
			left, cutLeft = i-lo, true
		}
		if hi := x.hi - kmin; hi < nk && !cutRight {
			right, cutRight = hi-1-i, true
		}
	}
	if (cutLeft && left < 0) || (cutRight && right < 0) {
		return task{}, false // a side a window cannot have
	}
	for i, x := range rows[r0 : r1+1] {
		lo, hi := 0, nk
		if left >= 0 {
			lo = max(0, i-left)
		}
		if right >= 0 {
			hi = min(nk, i+right+1)
		}
		if x.lo-kmin != lo || x.hi-kmin != hi {
			return task{}, false
		}
	}
	t := task{q0: qs[0].local + r0, nq: r1 + 1 - r0, k0: ks[0].local + kmin, nk: nk, gq0: globalAt(qs, r0), gk0: globalAt(ks, kmin)}
	if left >= 0 || right >= 0 {
		t.window = &attn.Window{Left: left, Right: right}
	}
	return t, true
}

// localRun reports whether the chunks follow each other in the local
// buffer.
func localRun(cs []chunk) bool {
	for i := 1; i < len(cs); i++ {
		if cs[i].local != cs[i-1].local+cs[i-1].n {
			return false
		}
	}
	return len(cs) > 0
}

// globalAt returns the global position of the position at local offset
// off from the first of the chunks cs (a run in the local buffer).
func globalAt(cs []chunk, off int) int {
	for _, c := range cs {
		if at := off - (c.local - cs[0].local); at < c.n {
			return c.global + at
		}
	}
	return cs[len(cs)-1].global + cs[len(cs)-1].n
}
