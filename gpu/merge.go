package gpu

import (
	"fmt"
	"math"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// The merge kernels of context parallelism (kernels.MergeSource): a call
// split over key blocks runs one ForwardDevice per block into a partial O
// and LSE, and MergeForward folds each into a float32 Accumulator through
// the LSEs; FinishAccumulator rounds the sum to the attention dtype once,
// at the end. A backward split the same way adds each block's gradients
// into a float32 Accumulator with AddGradient. All of them enqueue on the
// caller's stream and neither allocate nor synchronize.

// Accumulator is the float32 running result of a call split over key
// blocks, on the device: O [B, n, H, D] and, for a forward, its LSE
// [B, H, n] in the natural log the forward kernels write (a gradient
// accumulator has no LSE). Its tensors may have any strides, O's feature
// dim contiguous.
type Accumulator struct {
	O   DeviceTensor
	LSE *DeviceTensor
}

// NewAccumulator allocates a contiguous accumulator on dev: O [b, n, h, d]
// and, with lse set, the LSE [b, h, n], both float32. Its contents are
// undefined until ResetAccumulator.
func NewAccumulator(dev *cuda.Device, b, n, h, d int, lse bool) (Accumulator, error) {
	o, err := NewDeviceTensor(dev, attn.Float32, b, n, h, d)
	if err != nil {
		return Accumulator{}, err
	}
	a := Accumulator{O: o}
	if lse {
		l, err := NewDeviceTensor(dev, attn.Float32, b, h, n)
		if err != nil {
			o.Free()
			return Accumulator{}, err
		}
		a.LSE = &l
	}
	return a, nil
}

// Free frees the accumulator's buffers.
func (a Accumulator) Free() error {
	err := a.O.Free()
	if a.LSE != nil {
		if e := a.LSE.Free(); err == nil {
			err = e
		}
	}
	return err
}

// ResetAccumulator enqueues on s the reset of a to no key seen: O = 0 and
// LSE = −inf (a gradient accumulator: 0). It fails, wrapping attn's
// sentinels, for tensors that are not a well-formed accumulator.
func (b *Backend) ResetAccumulator(s *cuda.Stream, a Accumulator) error {
	c, err := mergeAccumulator(a)
	if err != nil {
		return fmt.Errorf("gpu: reset accumulator: %w", err)
	}
	c.kernel, c.dt, c.rows = kernels.MergeResetKernel, attn.Float32, c.n
	return b.launchMerge(s, c, "reset accumulator")
}

// MergeForward enqueues on s the merge of a partial forward result into
// rows [r0, r0+rows) of the accumulator a (which must have an LSE): o
// [B, rows, H, D] of the attention dtype and lse [B, H, rows] float32 as
// ForwardDevice writes them for query rows r0 … r0+rows−1 against some
// keys, merged through the LSEs with the overflow-safe formula O =
// w1·O1 + w2·O2, w_x = exp(LSE_x − LSE), LSE = m + log(exp(LSE1 − m) +
// exp(LSE2 − m)), m = max(LSE1, LSE2), the row scalars in double
// precision. A partial row whose LSE is −inf (it saw no key) leaves its
// row as it was; a row of a still at −inf takes the partial row as it is;
// a NaN stays NaN. These are the semantics of package cp's host merge,
// with the LSE kept in float32. It fails with errors wrapping
// attn.ErrShape (shapes that do not fit a, rows outside it), attn.ErrDType
// or attn.ErrLayout, and attn.ErrOption for an accumulator without an LSE.
func (b *Backend) MergeForward(s *cuda.Stream, a Accumulator, r0 int, o, lse DeviceTensor) error {
	c, err := mergeAccumulator(a)
	if err == nil && a.LSE == nil {
		err = attn.Errorf(attn.ErrOption, "a gradient accumulator (no LSE) cannot merge forward results")
	}
	if err == nil {
		err = c.partial(o, &lse, r0)
	}
	if err != nil {
		return fmt.Errorf("gpu: merge forward: %w", err)
	}
	c.kernel = kernels.MergeKernel
	return b.launchMerge(s, c, "merge forward")
}

// AddGradient enqueues on s the sum of a partial gradient g [B, rows, H,
// D] (of the attention dtype) into rows [r0, r0+rows) of the accumulator
// a, in float32. It fails as MergeForward does.
func (b *Backend) AddGradient(s *cuda.Stream, a Accumulator, r0 int, g DeviceTensor) error {
	c, err := mergeAccumulator(a)
	if err == nil {
		err = c.partial(g, nil, r0)
	}
	if err != nil {
		return fmt.Errorf("gpu: add gradient: %w", err)
	}
	c.kernel = kernels.MergeAddKernel
	return b.launchMerge(s, c, "add gradient")
}

// FinishAccumulator enqueues on s the result of the accumulator a: out
// [B, n, H, D] in the attention dtype (rounded to nearest, ties to even)
// and, when a has an LSE, lse [B, H, n] float32, its copy (lse must be nil
// when a has none). It fails as MergeForward does.
func (b *Backend) FinishAccumulator(s *cuda.Stream, a Accumulator, out DeviceTensor, lse *DeviceTensor) error {
	c, err := mergeAccumulator(a)
	if err == nil && (lse == nil) != (a.LSE == nil) {
		err = attn.Errorf(attn.ErrOption, "an accumulator with an LSE finishes into an output LSE, one without into none")
	}
	if err == nil {
		err = c.output(out, lse)
	}
	if err != nil {
		return fmt.Errorf("gpu: finish accumulator: %w", err)
	}
	c.kernel = kernels.MergeFinishKernel
	return b.launchMerge(s, c, "finish accumulator")
}

// CombineForward enqueues on s the combination of K partial forward
// results of one call into its finished result: parts [K, B, n, H, D] of
// the attention dtype and partsLSE [K, B, H, n] float32, slot k holding O
// and LSE as ForwardDevice writes them for rows of the call against one
// block of keys, into out [B, n, H, D] and lse [B, H, n]. A slot row whose
// LSE is −inf saw no key there and its O is not read, so the rows of a slot
// no call wrote need only their LSE set to −inf. The result is that of
// merging the slots in order into a reset Accumulator (MergeForward) and
// finishing it (FinishAccumulator), with the same semantics, but without
// the accumulator: each partial result is read once and nothing float32 is
// written. It fails as MergeForward does.
func (b *Backend) CombineForward(s *cuda.Stream, parts, partsLSE, out, lse DeviceTensor) error {
	c, err := combineCall(parts, partsLSE, out, lse)
	if err != nil {
		return fmt.Errorf("gpu: combine forward: %w", err)
	}
	return b.launchMerge(s, c, "combine forward")
}

// combineCall validates the tensors of a combine and returns its call:
// slot 0 of parts and partsLSE as the partial result, out and lse as the
// output.
func combineCall(parts, partsLSE, out, lse DeviceTensor) (*mergeCall, error) {
	if len(parts.Shape) != 5 {
		return nil, attn.Errorf(attn.ErrShape, "partial results shape %v, want [K, B, n, H, D]", parts.Shape)
	}
	if len(partsLSE.Shape) != 4 {
		return nil, attn.Errorf(attn.ErrShape, "partial LSEs shape %v, want [K, B, H, n]", partsLSE.Shape)
	}
	sh := parts.Shape
	c := &mergeCall{kernel: kernels.MergeCombineKernel, bsz: sh[1], n: sh[2], h: sh[3], d: sh[4]}
	if c.d > kernels.MergeMaxD {
		return nil, attn.Errorf(attn.ErrShape, "partial results: feature dim %d past %d", c.d, kernels.MergeMaxD)
	}
	if err := sameShape("partial LSEs", partsLSE.Shape, sh[0], c.bsz, c.h, c.n); err != nil {
		return nil, err
	}
	if sh[0] > 0 { // (no slot: nothing to read, every row O = 0 and LSE = −inf)
		c.parts, c.partsLSE = parts, partsLSE
		ps, ls := parts.strides(), partsLSE.strides()
		slot0, slot0LSE := parts, partsLSE
		slot0.Shape, slot0.Strides = sh[1:], ps[1:]
		slot0LSE.Shape, slot0LSE.Strides = partsLSE.Shape[1:], ls[1:]
		if err := c.partial(slot0, &slot0LSE, 0); err != nil {
			return nil, err
		}
	}
	if err := c.output(out, &lse); err != nil {
		return nil, err
	}
	if out.DType != parts.DType {
		return nil, attn.Errorf(attn.ErrDType, "output dtype %v, partial results %v", out.DType, parts.DType)
	}
	return c, nil
}

// PrepareMerge compiles the merge kernels of dtype dt ahead of their first
// launch (as a CUDA graph capture needs).
func (b *Backend) PrepareMerge(dt attn.DType) error {
	_, err := b.module(mergeModuleSpec(dt))
	return err
}

// mergeModuleSpec is the module of the merge kernels of dtype dt.
func mergeModuleSpec(dt attn.DType) moduleSpec {
	name := fmt.Sprintf("fa_cp_merge_%v", dt)
	return moduleSpec{key: name, name: name, what: "merge kernels",
		source: func() (string, error) { return kernels.MergeSource(dt) }, functions: kernels.MergeKernels}
}

// mergeCall is one merge kernel launch: its tensors, validated.
type mergeCall struct {
	kernel   string
	dt       attn.DType // the attention dtype (of src and dst)
	bsz, n   int        // batch and accumulator rows
	h, d     int
	r0, rows int
	// parts and partsLSE are a combine's partial results, [K, B, n, H, D]
	// and [K, B, H, n] (unset for none): src and srcLSE are their slot 0
	parts, partsLSE DeviceTensor
	acc             DeviceTensor
	accLSE          *DeviceTensor
	src             DeviceTensor
	srcLSE          *DeviceTensor
	dst             DeviceTensor
	dstLSE          *DeviceTensor
}

// mergeAccumulator validates the shapes and dtypes of a and returns a
// call on it; the layouts are checked once the call is whole (layouts).
func mergeAccumulator(a Accumulator) (*mergeCall, error) {
	if a.O.DType != attn.Float32 {
		return nil, attn.Errorf(attn.ErrDType, "accumulator: dtype %v, want float32", a.O.DType)
	}
	if len(a.O.Shape) != 4 {
		return nil, attn.Errorf(attn.ErrShape, "accumulator shape %v, want [B, n, H, D]", a.O.Shape)
	}
	sh := a.O.Shape
	c := &mergeCall{bsz: sh[0], n: sh[1], h: sh[2], d: sh[3], acc: a.O, accLSE: a.LSE}
	if c.d > kernels.MergeMaxD {
		return nil, attn.Errorf(attn.ErrShape, "accumulator: feature dim %d past %d", c.d, kernels.MergeMaxD)
	}
	if a.LSE != nil {
		if err := lseArg("accumulator LSE", *a.LSE, c.bsz, c.h, c.n); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// lseArg fails, wrapping attn.ErrDType or attn.ErrShape, when lse is not a
// float32 [b, h, n] tensor.
func lseArg(name string, lse DeviceTensor, b, h, n int) error {
	if lse.DType != attn.Float32 {
		return attn.Errorf(attn.ErrDType, "%s: dtype %v, want float32", name, lse.DType)
	}
	return sameShape(name, lse.Shape, b, h, n)
}

// rowsArg fails, wrapping attn.ErrDType or attn.ErrShape, when x is not a
// [b, rows, h, d] tensor of a dtype the merge kernels take; it returns rows.
func rowsArg(name string, x DeviceTensor, b, h, d int) (int, error) {
	if x.DType != attn.Float32 && x.DType != attn.Float16 && x.DType != attn.BFloat16 {
		return 0, attn.Errorf(attn.ErrDType, "%s: dtype %v", name, x.DType)
	}
	if len(x.Shape) != 4 {
		return 0, attn.Errorf(attn.ErrShape, "%s shape %v, want [B, rows, H, D]", name, x.Shape)
	}
	return x.Shape[1], sameShape(name, x.Shape, b, x.Shape[1], h, d)
}

// sameShape fails with attn.ErrShape when shape is not want.
func sameShape(name string, shape []int, want ...int) error {
	if len(shape) != len(want) {
		return attn.Errorf(attn.ErrShape, "%s shape %v, want %v", name, shape, want)
	}
	for i := range want {
		if shape[i] != want[i] {
			return attn.Errorf(attn.ErrShape, "%s shape %v, want %v", name, shape, want)
		}
	}
	return nil
}

// partial sets the call's partial result x [B, rows, H, D] (and its LSE,
// when lse is not nil) for rows r0 … of the accumulator, validating their
// shapes and dtypes.
func (c *mergeCall) partial(x DeviceTensor, lse *DeviceTensor, r0 int) error {
	rows, err := rowsArg("partial", x, c.bsz, c.h, c.d)
	if err != nil {
		return err
	}
	if r0 < 0 || r0 > c.n-rows {
		return attn.Errorf(attn.ErrShape, "partial rows [%d, %d) outside the accumulator's %d", r0, r0+rows, c.n)
	}
	if lse != nil {
		if err := lseArg("partial LSE", *lse, c.bsz, c.h, rows); err != nil {
			return err
		}
	}
	c.dt, c.src, c.srcLSE, c.r0, c.rows = x.DType, x, lse, r0, rows
	return nil
}

// output sets the call's finished result out [B, n, H, D] and its LSE,
// validating their shapes and dtypes.
func (c *mergeCall) output(out DeviceTensor, lse *DeviceTensor) error {
	rows, err := rowsArg("output", out, c.bsz, c.h, c.d)
	if err == nil && rows != c.n {
		err = attn.Errorf(attn.ErrShape, "output of %d rows for an accumulator of %d", rows, c.n)
	}
	if err == nil && lse != nil {
		err = lseArg("output LSE", *lse, c.bsz, c.h, c.n)
	}
	if err != nil {
		return err
	}
	c.dt, c.dst, c.dstLSE, c.r0, c.rows = out.DType, out, lse, 0, c.n
	return nil
}

// layouts checks that every tensor of the call lies inside its buffer
// with its feature dim contiguous (DeviceTensor.check).
func (c *mergeCall) layouts() error {
	type arg struct {
		name string
		t    *DeviceTensor
		feat bool
	}
	for _, x := range []arg{{"accumulator", &c.acc, true}, {"accumulator LSE", c.accLSE, false}, {"partial", &c.src, true},
		{"partial LSE", c.srcLSE, false}, {"output", &c.dst, true}, {"output LSE", c.dstLSE, false},
		{"partial results", &c.parts, true}, {"partial LSEs", &c.partsLSE, false}} {
		if x.t == nil || x.t.Shape == nil {
			continue
		}
		if err := x.t.check(x.name, x.t.DType, len(x.t.Shape), x.feat); err != nil {
			return err
		}
	}
	return nil
}

// params returns the kernel arguments and the blocks of the call (0:
// nothing to launch).
func (c *mergeCall) params() (kernels.MergeParams, int64) {
	blocks, shift := kernels.MergeLaunch(c.bsz, c.rows, c.h, c.d)
	p := kernels.MergeParams{B: int32(c.bsz), Rows: int32(c.rows), H: int32(c.h), D: int32(c.d), R0: int32(c.r0), Shift: shift,
		Vec: c.d%kernels.MergeChunk == 0}
	if c.parts.Shape != nil { // a combine: the slots of src and srcLSE
		p.Slots, p.SlotStride, p.SlotLSEStride = int32(c.parts.Shape[0]), int64(c.parts.strides()[0]), int64(c.partsLSE.strides()[0])
	}
	// rows of 16-byte aligned starts: every tensor of elements, at its address and by each stride
	vec := func(t DeviceTensor) {
		st := t.strides()
		size := uint64(t.DType.Size())
		p.Vec = p.Vec && t.ptr()%16 == 0
		for _, x := range st[:3] {
			p.Vec = p.Vec && (uint64(x)*size)%16 == 0
		}
	}
	lseStrides := func(t *DeviceTensor) (uint64, [3]int64) {
		if t == nil {
			return 0, [3]int64{}
		}
		st := t.strides()
		return t.ptr(), [3]int64{int64(st[0]), int64(st[1]), int64(st[2])}
	}
	rowStrides := func(t DeviceTensor) [3]int64 {
		st := t.strides()
		return [3]int64{int64(st[0]), int64(st[1]), int64(st[2])}
	}
	if c.acc.Shape != nil {
		p.Acc, p.AccStrides = c.acc.ptr(), rowStrides(c.acc)
		vec(c.acc)
		p.AccLSE, p.AccLSEStrides = lseStrides(c.accLSE)
	}
	if c.src.Shape != nil {
		p.Src, p.SrcStrides = c.src.ptr(), rowStrides(c.src)
		vec(c.src)
		p.Vec = p.Vec && (uint64(p.SlotStride)*uint64(c.src.DType.Size()))%16 == 0
		p.SrcLSE, p.SrcLSEStrides = lseStrides(c.srcLSE)
	}
	if c.dst.Shape != nil {
		p.Dst, p.DstStrides = c.dst.ptr(), rowStrides(c.dst)
		vec(c.dst)
		p.DstLSE, p.DstLSEStrides = lseStrides(c.dstLSE)
	}
	return p, blocks
}

// launchMerge checks the layouts of the call's tensors and enqueues its
// kernel on s, compiling the module of its dtype on first use; what names
// the call in errors.
func (b *Backend) launchMerge(s *cuda.Stream, c *mergeCall, what string) error {
	if err := c.layouts(); err != nil {
		return fmt.Errorf("gpu: %s: %w", what, err)
	}
	p, blocks := c.params()
	if blocks == 0 {
		return nil
	}
	if blocks > math.MaxInt32 {
		return attn.Errorf(attn.ErrShape, "gpu: %s: %d×%d×%d rows need more blocks than a grid holds", c.kernel, c.bsz, c.rows, c.h)
	}
	grid := [3]uint32{uint32(blocks), 1, 1}
	m, err := b.module(mergeModuleSpec(c.dt))
	if err != nil {
		return err
	}
	if err := b.dev.Launch(m.function(c.kernel), grid, [3]uint32{kernels.MergeThreads, 1, 1}, 0, s, p.Pack()); err != nil {
		return fmt.Errorf("gpu: launch %s: %w", c.kernel, err)
	}
	return nil
}
