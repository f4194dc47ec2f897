package gpu

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/kernels"
)

// The merge kernels on the host emulator (see emu_test.go), against the
// semantics of package cp's host merge (accum.merge, mirrored by
// mergeRef). They run when FLASHATTN_CP_EMU is set.

// mergeEmuEnv is the environment variable that runs the merge kernels'
// emulator tests.
const mergeEmuEnv = "FLASHATTN_CP_EMU"

// mergeEmuDriver names the merge kernels' parameters for driver.h.
var mergeEmuDriver = emuDriver("MergeParams", []string{"src", "src_lse", "acc", "acc_lse", "dst", "dst_lse"}, kernels.MergeKernels)

// mergeExec runs merge calls over tensors it holds: on the host emulator
// (mergeEmu) or on a GPU (mergeDev, merge_gpu_test.go).
type mergeExec interface {
	// place stores an allocation's bytes and returns the tensor viewing it
	// from element off with the given strides, and a handle for fetch.
	place(buf []byte, dt attn.DType, shape, strides []int, off int) (DeviceTensor, any)
	// fetch returns the allocation's bytes after the calls run so far.
	fetch(handle any, n int) []byte
	// run launches the call's kernel as launchMerge does.
	run(c *mergeCall)
}

// mergeEmu is a mergeExec on the host emulator: the calls run one by one
// over one arena.
type mergeEmu struct {
	t   *testing.T
	bin string
	ar  *emuArena
}

func (e *mergeEmu) place(buf []byte, dt attn.DType, shape, strides []int, off int) (DeviceTensor, any) {
	addr := e.ar.put(buf)
	return DeviceTensor{DType: dt, Shape: shape, Strides: strides, base: addr + uint64(off*dt.Size())}, addr
}

func (e *mergeEmu) fetch(handle any, n int) []byte { return e.ar.at(handle.(uint64), n) }

func (e *mergeEmu) run(c *mergeCall) {
	e.t.Helper()
	p, blocks := c.params()
	if blocks == 0 {
		return
	}
	emuExec(e.t, e.bin, c.kernel, p.Pack(), e.ar, []emuLaunch{{c.kernel, [3]int{int(blocks), 1, 1}, kernels.MergeThreads}}, nil)
}

// emuLayout is how a test tensor lies in its allocation: extra elements
// before element 0, and per stride dimension (all but the last) extra
// elements beyond the contiguous stride.
type emuLayout struct {
	offset int
	pad    []int
}

// stridesFor returns the strides of shape under the layout's padding.
func (l emuLayout) stridesFor(shape []int) []int {
	st := make([]int, len(shape))
	st[len(shape)-1] = 1
	for i := len(shape) - 2; i >= 0; i-- {
		st[i] = st[i+1] * shape[i+1]
		if i < len(l.pad) {
			st[i] += l.pad[i]
		}
	}
	return st
}

// placed is a test tensor in a mergeExec: its view, its allocation as
// written and the allocation's slots the view covers.
type placed struct {
	dev      DeviceTensor
	handle   any
	off      int
	occupied []bool
	written  []byte
}

// slot returns the allocation slot of element lin (row-major) of the view.
func (p placed) slot(lin int) int {
	at := p.off
	for i := len(p.dev.Shape) - 1; i >= 0; i-- {
		at += (lin % p.dev.Shape[i]) * p.dev.Strides[i]
		lin /= p.dev.Shape[i]
	}
	return at
}

// putTensor places x (contiguous) under layout l, every slot the tensor
// does not cover poisoned.
func putTensor(x mergeExec, t attn.Tensor, l emuLayout) placed {
	st := l.stridesFor(t.Shape)
	span := l.offset + 1
	for i, n := range t.Shape {
		span += (n - 1) * st[i]
	}
	es := t.DType.Size()
	p := placed{off: l.offset, occupied: make([]bool, span), written: make([]byte, span*es)}
	for i := range p.written {
		p.written[i] = bwdPoison
	}
	p.dev = DeviceTensor{DType: t.DType, Shape: t.Shape, Strides: st}
	raw := t.Bytes()
	for lin := range t.NumElements() {
		at := p.slot(lin)
		p.occupied[at] = true
		copy(p.written[at*es:(at+1)*es], raw[lin*es:(lin+1)*es])
	}
	p.dev, p.handle = x.place(p.written, t.DType, t.Shape, st, l.offset)
	return p
}

// readTensor returns the placed tensor's elements (contiguous) after the
// calls run so far, failing t when a slot it does not cover changed.
func readTensor(t *testing.T, x mergeExec, p placed) attn.Tensor {
	t.Helper()
	got := x.fetch(p.handle, len(p.written))
	es := p.dev.DType.Size()
	for slot, in := range p.occupied {
		if !in && string(got[slot*es:(slot+1)*es]) != string(p.written[slot*es:(slot+1)*es]) {
			t.Fatalf("slot %d outside the tensor written", slot)
		}
	}
	out := make([]byte, 0, p.dev.NumElements()*es)
	for lin := range p.dev.NumElements() {
		at := p.slot(lin)
		out = append(out, got[at*es:(at+1)*es]...)
	}
	return tensorFromBytes(p.dev.DType, out, p.dev.Shape)
}

// mergeRef is the host reference: package cp's accum.merge (float64 row
// scalars, the same formula), with O and the LSE kept in float32 between
// merges as the device accumulator keeps them.
type mergeRef struct {
	b, n, h, d int
	o, lse     []float32
}

func newMergeRef(b, n, h, d int) *mergeRef {
	r := &mergeRef{b: b, n: n, h: h, d: d, o: make([]float32, b*n*h*d), lse: make([]float32, b*h*n)}
	for i := range r.lse {
		r.lse[i] = float32(math.Inf(-1))
	}
	return r
}

// merge folds the partial O [b, rows, h, d] and LSE [b, h, rows] into rows
// r0 … as accum.merge does, row by row (mergeWeights).
func (a *mergeRef) merge(o, lse []float32, rows, r0 int) {
	for row := range a.b * a.h * rows { // (b, h, i)
		b, h, i := row/(a.h*rows), row/rows%a.h, row%rows
		li := (b*a.h+h)*a.n + r0 + i
		l, w1, w2, ok := mergeWeights(float64(a.lse[li]), float64(lse[row]))
		if !ok {
			continue
		}
		src := o[((b*rows+i)*a.h+h)*a.d:][:a.d]
		dst := a.o[((b*a.n+r0+i)*a.h+h)*a.d:][:a.d]
		for d, x := range src {
			dst[d] = float32(w1*float64(dst[d]) + w2*float64(x))
		}
		a.lse[li] = float32(l)
	}
}

// mergeWeights returns the merged LSE of an accumulator row at l1 and a
// partial row at l2 and the weights of both rows, as accum.merge computes
// them: ok is false when the partial row saw no key (l2 = −inf), and a
// row still at −inf takes the partial as it is (weights 0 and 1).
func mergeWeights(l1, l2 float64) (l, w1, w2 float64, ok bool) {
	switch {
	case math.IsInf(l2, -1):
		return l1, 1, 0, false
	case math.IsInf(l1, -1):
		return l2, 0, 1, true
	}
	m := max(l1, l2)
	l = m + math.Log(math.Exp(l1-m)+math.Exp(l2-m))
	return l, math.Exp(l1 - l), math.Exp(l2 - l), true
}

// mergeClose reports whether got matches want: the same class (NaN, ±inf)
// and, finite, within tol·max(1, |want|).
func mergeClose(got, want float32, tol float64) bool {
	g, w := float64(got), float64(want)
	switch {
	case math.IsNaN(w):
		return math.IsNaN(g)
	case math.IsInf(w, 0):
		return g == w
	}
	return math.Abs(g-w) <= tol*max(1, math.Abs(w))
}

// sameBits reports whether two tensors of one dtype hold the same bits
// (any NaN matching any NaN), and the first element where they differ.
func sameBits(a, b attn.Tensor) (int, bool) {
	x, y := a.Float32s(), b.Float32s()
	for i := range x {
		if math.IsNaN(float64(x[i])) && math.IsNaN(float64(y[i])) {
			continue
		}
		if math.Float32bits(x[i]) != math.Float32bits(y[i]) {
			return i, false
		}
	}
	return 0, true
}

// mergeLayouts are the layouts the partial results and outputs take in
// the emulator tests: contiguous, and strided with an odd offset (which
// keeps the kernels off the 16-byte path).
var mergeLayouts = []struct {
	name      string
	rows, lse emuLayout
}{
	{"contiguous", emuLayout{}, emuLayout{}},
	{"strided", emuLayout{offset: 3, pad: []int{5, 16, 3}}, emuLayout{offset: 1, pad: []int{7, 2}}},
}

// TestMergeEmulated runs the forward merge on the host emulator: an
// accumulator reset, three partial results merged at row offsets (whole
// rows, a strided block in the middle, the last rows), then finished; the
// partial LSEs hold −inf rows, NaN rows, +inf, gaps of ±80 to the
// accumulator's, and rows the accumulator has not seen yet, and one
// partial O holds a NaN. The accumulator must match the reference to a
// few float32 units in the last place, NaN and infinities exactly; the
// finished O must be the accumulator rounded to the dtype bit for bit and
// the finished LSE its copy.
func TestMergeEmulated(t *testing.T) {
	emuSkip(t, mergeEmuEnv, "merge")
	runMergeEmu(t, []int{128, 59, 8, 3}, mergeCase)
}

// mergeCaseFunc is a merge test case on e for dtype dt and head dim d,
// with the layouts of its strided tensors.
type mergeCaseFunc func(t *testing.T, e mergeExec, dt attn.DType, d int, rowsL, lseL emuLayout)

// runMergeEmu runs fn on the host emulator as parallel subtests, for every
// element type, head dim of ds and layout of mergeLayouts.
func runMergeEmu(t *testing.T, ds []int, fn mergeCaseFunc) {
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float16, attn.Float32} {
		src, err := kernels.MergeSource(dt)
		if err != nil {
			t.Fatal(err)
		}
		bin := emuBinary(t, src, "merge.h", mergeEmuDriver)
		for _, d := range ds {
			for _, l := range mergeLayouts {
				t.Run(fmt.Sprintf("%v-d%d-%s", dt, d, l.name), func(t *testing.T) {
					t.Parallel()
					fn(t, &mergeEmu{t: t, bin: bin, ar: &emuArena{}}, dt, d, l.rows, l.lse)
				})
			}
		}
	}
}

// mergeCase is one TestMergeEmulated case on e: the middle partial result
// and the outputs lie in the layouts rowsL and lseL, the rest contiguous.
func mergeCase(t *testing.T, e mergeExec, dt attn.DType, d int, rowsL, lseL emuLayout) {
	const bsz, n, h = 2, 24, 3
	rng := rand.New(rand.NewPCG(uint64(d), uint64(dt)))
	// the accumulator starts as NaN: the reset must set every element
	acc := putTensor(e, nanTensor(bsz, n, h, d), emuLayout{})
	accLSE := putTensor(e, nanTensor(bsz, h, n), emuLayout{})
	a := Accumulator{O: acc.dev, LSE: &accLSE.dev}
	c, err := mergeAccumulator(a)
	if err != nil {
		t.Fatal(err)
	}
	c.kernel, c.dt, c.rows = kernels.MergeResetKernel, attn.Float32, c.n
	e.run(c)
	ref := newMergeRef(bsz, n, h, d)
	ninf, pinf, nan := float32(math.Inf(-1)), float32(math.Inf(1)), float32(math.NaN())
	type part struct {
		r0, rows int
		special  map[int]float32 // LSE by (b·h + head)·rows + row: −inf, NaN, +inf
		gap      float32         // ±80 relative to the accumulator's LSE on some rows
		nanAt    int             // an O element set to NaN (-1: none)
	}
	parts := []part{
		{0, n, map[int]float32{1: ninf, 30: ninf, 31: ninf, 50: nan}, 0, -1},
		{4, 11, map[int]float32{2: ninf, 40: pinf}, 80, 3*h*d + d + 1},
		{n - 7, 7, map[int]float32{3: ninf, 12: nan}, -80, -1},
	}
	for pi, pt := range parts {
		ov := make([]float32, bsz*pt.rows*h*d)
		for i := range ov {
			ov[i] = float32(rng.NormFloat64())
		}
		if pt.nanAt >= 0 {
			ov[pt.nanAt] = nan
		}
		o := attn.FromFloat32(dt, ov, bsz, pt.rows, h, d)
		lv := make([]float32, bsz*h*pt.rows)
		for i := range lv {
			lv[i] = float32(rng.Float64()*6 - 3)
			b, hh, r := i/(h*pt.rows), i/pt.rows%h, i%pt.rows
			if pt.gap != 0 && r%3 == 0 {
				if at := ref.lse[(b*h+hh)*n+pt.r0+r]; !math.IsInf(float64(at), 0) && !math.IsNaN(float64(at)) {
					lv[i] = at + pt.gap
				}
			}
			if x, ok := pt.special[i]; ok {
				lv[i] = x
			}
		}
		lse := attn.FromFloat32(attn.Float32, lv, bsz, h, pt.rows)
		lay, llay := emuLayout{}, emuLayout{}
		if pi == 1 {
			lay, llay = rowsL, lseL
		}
		po, pl := putTensor(e, o, lay), putTensor(e, lse, llay)
		c, err := mergeAccumulator(a)
		if err == nil {
			err = c.partial(po.dev, &pl.dev, pt.r0)
		}
		if err != nil {
			t.Fatal(err)
		}
		c.kernel = kernels.MergeKernel
		// the 16-byte path: whole chunks, every row 16-byte aligned (not under an odd offset)
		if p, _ := c.params(); p.Vec != (d%kernels.MergeChunk == 0 && (pi != 1 || lay.offset == 0)) {
			t.Fatalf("partial %d: 16-byte path %v", pi, p.Vec)
		}
		e.run(c)
		ref.merge(o.Float32s(), lv, pt.rows, pt.r0)
		got, gotLSE := readTensor(t, e, acc).Float32s(), readTensor(t, e, accLSE).Float32s()
		for i, w := range ref.o {
			if !mergeClose(got[i], w, 1e-6) {
				t.Fatalf("after partial %d: O element %d = %v, want %v", pi, i, got[i], w)
			}
		}
		for i, w := range ref.lse {
			if !mergeClose(gotLSE[i], w, 4e-7) {
				t.Fatalf("after partial %d: LSE %d = %v, want %v", pi, i, gotLSE[i], w)
			}
		}
	}
	out := putTensor(e, attn.FromFloat32(dt, make([]float32, bsz*n*h*d), bsz, n, h, d), rowsL)
	outLSE := putTensor(e, attn.FromFloat32(attn.Float32, make([]float32, bsz*h*n), bsz, h, n), lseL)
	c, err = mergeAccumulator(a)
	if err == nil {
		err = c.output(out.dev, &outLSE.dev)
	}
	if err != nil {
		t.Fatal(err)
	}
	c.kernel = kernels.MergeFinishKernel
	e.run(c)
	accT := readTensor(t, e, acc)
	if i, ok := sameBits(readTensor(t, e, out), attn.FromFloat32(dt, accT.Float32s(), bsz, n, h, d)); !ok {
		t.Fatalf("finished O element %d is not the accumulator rounded to %v", i, dt)
	}
	if i, ok := sameBits(readTensor(t, e, outLSE), readTensor(t, e, accLSE)); !ok {
		t.Fatalf("finished LSE %d is not the accumulator's", i)
	}
}

// TestMergeGradientEmulated runs the gradient accumulation on the host
// emulator: a reset, three partial gradients added at row offsets (one
// strided, one holding a NaN and an infinity), then finished. The
// accumulator must equal the float32 sums in the same order bit for bit,
// and the finished gradient the accumulator rounded to the dtype.
func TestMergeGradientEmulated(t *testing.T) {
	emuSkip(t, mergeEmuEnv, "merge")
	runMergeEmu(t, []int{64, 59}, gradCase)
}

// gradCase is one TestMergeGradientEmulated case on e; the middle partial
// and the output lie in layout lay (a gradient has no LSE).
func gradCase(t *testing.T, e mergeExec, dt attn.DType, d int, lay, _ emuLayout) {
	const bsz, n, h = 2, 20, 2
	rng := rand.New(rand.NewPCG(uint64(d), 7))
	acc := putTensor(e, nanTensor(bsz, n, h, d), emuLayout{})
	a := Accumulator{O: acc.dev}
	c, err := mergeAccumulator(a)
	if err != nil {
		t.Fatal(err)
	}
	c.kernel, c.dt, c.rows = kernels.MergeResetKernel, attn.Float32, c.n
	e.run(c)
	want := make([]float32, bsz*n*h*d)
	for pi, pt := range []struct{ r0, rows int }{{0, n}, {3, 9}, {n - 5, 5}} {
		gv := make([]float32, bsz*pt.rows*h*d)
		for i := range gv {
			gv[i] = float32(rng.NormFloat64())
		}
		if pi == 2 {
			gv[1], gv[d+2] = float32(math.NaN()), float32(math.Inf(1))
		}
		g := attn.FromFloat32(dt, gv, bsz, pt.rows, h, d)
		l := emuLayout{}
		if pi == 1 {
			l = lay
		}
		pg := putTensor(e, g, l)
		c, err := mergeAccumulator(a)
		if err == nil {
			err = c.partial(pg.dev, nil, pt.r0)
		}
		if err != nil {
			t.Fatal(err)
		}
		c.kernel = kernels.MergeAddKernel
		e.run(c)
		row := h * d
		for b := range bsz {
			for i, x := range g.Float32s()[b*pt.rows*row : (b+1)*pt.rows*row] {
				want[(b*n+pt.r0)*row+i] += x
			}
		}
	}
	accT := readTensor(t, e, acc)
	if i, ok := sameBits(accT, attn.FromFloat32(attn.Float32, want, bsz, n, h, d)); !ok {
		t.Fatalf("accumulator element %d = %v, want %v", i, accT.Float32s()[i], want[i])
	}
	out := putTensor(e, attn.FromFloat32(dt, make([]float32, bsz*n*h*d), bsz, n, h, d), lay)
	c, err = mergeAccumulator(a)
	if err == nil {
		err = c.output(out.dev, nil)
	}
	if err != nil {
		t.Fatal(err)
	}
	c.kernel = kernels.MergeFinishKernel
	e.run(c)
	if i, ok := sameBits(readTensor(t, e, out), attn.FromFloat32(dt, want, bsz, n, h, d)); !ok {
		t.Fatalf("finished gradient element %d is not the sum rounded to %v", i, dt)
	}
}

// nanTensor returns a float32 tensor of the shape, every element NaN.
func nanTensor(shape ...int) attn.Tensor { return nanTensorOf(attn.Float32, shape...) }

// TestCombineEmulated runs the combine on the host emulator: four partial
// results in the slots of one tensor, each covering some rows (the rest
// of a slot: LSE −inf and O NaN, which must not be read), with −inf, NaN
// and +inf LSEs, gaps of ±80 between slots and a NaN in one O, folded
// into the finished O and LSE. They must match merging the slots one by
// one into an accumulator and finishing it (mergeRef) within the rounding
// of the dtype; NaN and infinities exactly.
func TestCombineEmulated(t *testing.T) {
	emuSkip(t, mergeEmuEnv, "merge")
	runMergeEmu(t, []int{128, 59, 8, 3}, combineCase)
}

// combineCase is one TestCombineEmulated case on e: the slots and the
// outputs lie in the layouts rowsL and lseL.
func combineCase(t *testing.T, e mergeExec, dt attn.DType, d int, rowsL, lseL emuLayout) {
	const k, bsz, n, h = 4, 2, 24, 3
	rng := rand.New(rand.NewPCG(uint64(d), uint64(dt)+5))
	ninf, pinf, nan := float32(math.Inf(-1)), float32(math.Inf(1)), float32(math.NaN())
	covers := []struct{ r0, rows int }{{0, n}, {4, 11}, {n - 7, 7}, {0, 12}}
	ov := make([]float32, k*bsz*n*h*d)
	lv := make([]float32, k*bsz*h*n)
	for i := range ov {
		ov[i] = nan
	}
	for i := range lv {
		lv[i] = ninf
	}
	ref := newMergeRef(bsz, n, h, d)
	for s, cv := range covers {
		for b := range bsz {
			for i := cv.r0; i < cv.r0+cv.rows; i++ {
				for hh := range h {
					li := ((s*bsz+b)*h+hh)*n + i
					lv[li] = float32(rng.Float64()*6 - 3)
					if s > 0 && i%3 == 0 {
						lv[li] = lv[((b*h)+hh)*n+i] + float32(80*(2*(s%2)-1)) // ±80 from slot 0's
					}
					for j := range d {
						ov[(((s*bsz+b)*n+i)*h+hh)*d+j] = float32(rng.NormFloat64())
					}
				}
			}
		}
	}
	// specials (slot, b, head, row): NaN seen by several slots and by one, +inf seen by several and by one
	at := func(s, b, hh, i int) int { return ((s*bsz+b)*h+hh)*n + i }
	lv[at(1, 0, 1, 5)] = nan
	lv[at(2, 1, 0, n-1)], lv[at(0, 1, 0, n-1)] = nan, ninf
	lv[at(3, 0, 2, 1)] = pinf
	lv[at(1, 1, 2, 14)], lv[at(0, 1, 2, 14)] = pinf, ninf
	lv[at(0, 0, 0, 20)] = ninf                          // a row only slot 2 sees
	lv[at(0, 1, 1, 3)], lv[at(3, 1, 1, 3)] = ninf, ninf // a row no slot sees
	ov[(((2*bsz+0)*n+n-3)*h+1)*d+d/2] = nan             // a NaN in a partial O
	parts := attn.FromFloat32(dt, ov, k, bsz, n, h, d)
	partsLSE := attn.FromFloat32(attn.Float32, lv, k, bsz, h, n)
	pv, plv := parts.Float32s(), partsLSE.Float32s() // as the dtype holds them
	for s := range k {
		ref.merge(pv[s*bsz*n*h*d:][:bsz*n*h*d], plv[s*bsz*h*n:][:bsz*h*n], n, 0)
	}
	pp, pl := putTensor(e, parts, rowsL), putTensor(e, partsLSE, lseL)
	out := putTensor(e, nanTensorOf(dt, bsz, n, h, d), rowsL)
	outLSE := putTensor(e, nanTensor(bsz, h, n), lseL)
	c, err := combineCall(pp.dev, pl.dev, out.dev, outLSE.dev)
	if err != nil {
		t.Fatal(err)
	}
	if p, _ := c.params(); p.Vec != (d%kernels.MergeChunk == 0 && rowsL.offset == 0) {
		t.Fatalf("16-byte path %v", p.Vec)
	}
	e.run(c)
	tol := map[attn.DType]float64{attn.BFloat16: 1.0 / 128, attn.Float16: 1.0 / 1024, attn.Float32: 2e-6}[dt]
	got, gotLSE := readTensor(t, e, out).Float32s(), readTensor(t, e, outLSE).Float32s()
	for i, w := range ref.o {
		if !mergeClose(got[i], w, tol) {
			t.Fatalf("O element %d = %v, want %v", i, got[i], w)
		}
	}
	for i, w := range ref.lse {
		if !mergeClose(gotLSE[i], w, 1e-6) {
			t.Fatalf("LSE %d = %v, want %v", i, gotLSE[i], w)
		}
	}
}

// TestCombineNoSlotsEmulated runs the combine of no partial result at
// all (a rank whose calls are all masked out): every row O = 0, LSE = −inf.
func TestCombineNoSlotsEmulated(t *testing.T) {
	emuSkip(t, mergeEmuEnv, "merge")
	runMergeEmu(t, []int{64}, func(t *testing.T, e mergeExec, dt attn.DType, d int, rowsL, lseL emuLayout) {
		const bsz, n, h = 2, 5, 3
		out := putTensor(e, nanTensorOf(dt, bsz, n, h, d), rowsL)
		outLSE := putTensor(e, nanTensor(bsz, h, n), lseL)
		parts := DeviceTensor{DType: dt, Shape: []int{0, bsz, n, h, d}}
		partsLSE := DeviceTensor{DType: attn.Float32, Shape: []int{0, bsz, h, n}}
		c, err := combineCall(parts, partsLSE, out.dev, outLSE.dev)
		if err != nil {
			t.Fatal(err)
		}
		e.run(c)
		for i, x := range readTensor(t, e, out).Float32s() {
			if x != 0 {
				t.Fatalf("O element %d = %v, want 0", i, x)
			}
		}
		for i, x := range readTensor(t, e, outLSE).Float32s() {
			if !math.IsInf(float64(x), -1) {
				t.Fatalf("LSE %d = %v, want -inf", i, x)
			}
		}
	})
}

// nanTensorOf returns a tensor of dtype dt and the shape, every element NaN.
func nanTensorOf(dt attn.DType, shape ...int) attn.Tensor {
	x := attn.New(dt, shape...)
	x.Fill(float32(math.NaN()))
	return x
}
