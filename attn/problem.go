package attn

import (
	"math"
	"slices"

	"github.com/flashattn/flashattn/philox"
)

// MaxHeadDim is the largest head dimension (DK or DV) flashattn accepts.
const MaxHeadDim = 512

// Problem is a validated attention problem: the sizes, the resolved options
// and the masks, shared by every backend.
type Problem struct {
	// B is the batch size (the number of segments when Varlen).
	B int
	// N and M are the query and key lengths; for a packed batch, the longest segment's.
	N, M int
	// H and Hkv are the query and key/value head counts; H is a multiple of Hkv.
	H, Hkv int
	// DK is the query/key head dimension, DV the value head dimension.
	DK, DV int
	// Varlen is set for packed variable-length batches.
	Varlen bool
	// TotalQ and TotalK are the packed token counts (Varlen only).
	TotalQ, TotalK int
	// Scale is the resolved scale (never 0).
	Scale float64
	// DropThreshold and DropScale are the resolved dropout (package
	// philox): an element is kept when its 8-bit number is below
	// DropThreshold, T = round(256·(1 − p)), and a kept probability is
	// multiplied by DropScale = 256/T. Both are 0 without dropout.
	DropThreshold uint32
	DropScale     float64
	// Left and Right are the effective window (negative: unbounded; see
	// ResolveMask); Masked reports whether any mask applies.
	Left, Right int
	Masked      bool
	// Opt are the options as given.
	Opt Options
}

// Group returns the number of query heads sharing one key/value head.
func (p *Problem) Group() int { return p.H / p.Hkv }

// Segment returns the query start, query length, key start and key length of
// batch element b. For a padded (non-varlen) batch the starts are 0.
func (p *Problem) Segment(b int) (q0, n, k0, m int) {
	if !p.Varlen {
		return 0, p.N, 0, p.M
	}
	cq, ck := p.Opt.CuSeqlensQ, p.Opt.CuSeqlensK
	return int(cq[b]), int(cq[b+1] - cq[b]), int(ck[b]), int(ck[b+1] - ck[b])
}

// KeyRange returns the visible keys [lo, hi) of query i in a sequence of n
// queries over m keys; lo ≥ hi means the row sees no key. Its arithmetic
// saturates instead of wrapping, so it is right for any values of i, n, m
// and the window sides.
func (p *Problem) KeyRange(i, n, m int) (lo, hi int) {
	if !p.Masked {
		return 0, m
	}
	diag := i
	if p.Opt.Align == AlignBottomRight {
		diag = satAdd(i, satSub(m, n))
	}
	lo, hi = 0, m
	if p.Left >= 0 {
		lo = max(lo, satSub(diag, p.Left))
	}
	if p.Right >= 0 {
		hi = min(hi, satAdd(satAdd(diag, p.Right), 1))
	}
	return lo, hi
}

// satAdd returns a+b clamped to [math.MinInt, math.MaxInt].
func satAdd(a, b int) int {
	s := a + b
	switch {
	case b > 0 && s < a:
		return math.MaxInt
	case b < 0 && s > a:
		return math.MinInt
	}
	return s
}

// satSub returns a−b clamped to [math.MinInt, math.MaxInt].
func satSub(a, b int) int {
	s := a - b
	switch {
	case b < 0 && s < a:
		return math.MaxInt
	case b > 0 && s > a:
		return math.MinInt
	}
	return s
}

// ResolveMask sets Left, Right and Masked from Opt (Causal and Window) and
// the sequence lengths N and M (the longest segments of a packed batch),
// which must be set. A window side of at least W = max(N, M) reaches past
// every key of every segment under either alignment, so it becomes
// unbounded (−1): query i of n over m keys has its diagonal d at i or
// i + m − n, so d − W < 0 and d + W ≥ m. A window whose sides are both
// unbounded masks nothing. The sides that remain are below W, which keeps
// the diagonal arithmetic of every backend and kernel far from overflow.
// NewProblem calls it; so must any code that builds a Problem itself.
func (p *Problem) ResolveMask() {
	p.Left, p.Right, p.Masked = p.Opt.MaskBounds()
	wide := max(p.N, p.M)
	if p.Left >= wide {
		p.Left = -1
	}
	if p.Right >= wide {
		p.Right = -1
	}
	p.Masked = p.Left >= 0 || p.Right >= 0
}

// Visible reports whether key j is visible to query i (n queries, m keys).
func (p *Problem) Visible(i, j, n, m int) bool {
	lo, hi := p.KeyRange(i, n, m)
	return j >= lo && j < hi
}

// OutputShape returns the shape of O.
func (p *Problem) OutputShape() []int {
	if p.Varlen {
		return []int{p.TotalQ, p.H, p.DV}
	}
	return []int{p.B, p.N, p.H, p.DV}
}

// LSEShape returns the shape of the log-sum-exp: [B, H, N], or [H, totalQ] packed.
func (p *Problem) LSEShape() []int {
	if p.Varlen {
		return []int{p.H, p.TotalQ}
	}
	return []int{p.B, p.H, p.N}
}

// FLOPs returns the conventional forward operation count, 2·B·H·N·M·(DK+DV)
// counted per visible score (so halved, roughly, when causal). For a padded
// batch with DK = DV = D and no mask it is 4·B·H·N·M·D. The backward is
// counted as 2.5 times this.
func (p *Problem) FLOPs() float64 {
	var pairs float64
	for b := 0; b < p.B; b++ {
		_, n, _, m := p.Segment(b)
		if !p.Masked {
			pairs += float64(n) * float64(m)
			continue
		}
		for i := 0; i < n; i++ {
			lo, hi := p.KeyRange(i, n, m)
			if hi > lo {
				pairs += float64(hi - lo)
			}
		}
	}
	return 2 * float64(p.H) * pairs * float64(p.DK+p.DV)
}

// NewProblem validates q, k, v and opt and returns the problem they describe.
func NewProblem(q, k, v Tensor, opt Options) (*Problem, error) {
	for _, x := range []struct {
		name string
		t    Tensor
	}{{"q", q}, {"k", k}, {"v", v}} {
		if err := x.t.CheckLayout(x.name); err != nil {
			return nil, err
		}
	}
	if k.DType != q.DType || v.DType != q.DType {
		return nil, Errorf(ErrDType, "q, k, v dtypes %v, %v, %v differ", q.DType, k.DType, v.DType)
	}
	p := &Problem{Opt: opt}
	varlen := opt.CuSeqlensQ != nil || opt.CuSeqlensK != nil
	p.Varlen = varlen
	want := 4
	if varlen {
		want = 3
	}
	for _, x := range []struct {
		name string
		t    Tensor
	}{{"q", q}, {"k", k}, {"v", v}} {
		if x.t.Rank() != want {
			layout := "[B, seq, heads, dim]"
			if varlen {
				layout = "[total, heads, dim] (packed: cu_seqlens given)"
			}
			return nil, Errorf(ErrShape, "%s has shape %v, want rank %d %s", x.name, x.t.Shape, want, layout)
		}
	}
	if varlen {
		p.TotalQ, p.H, p.DK = q.Shape[0], q.Shape[1], q.Shape[2]
		p.TotalK, p.Hkv = k.Shape[0], k.Shape[1]
		if v.Shape[0] != p.TotalK || v.Shape[1] != p.Hkv || k.Shape[2] != p.DK {
			return nil, Errorf(ErrShape, "q %v, k %v, v %v do not fit [totalQ, H, DK], [totalK, Hkv, DK], [totalK, Hkv, DV]",
				q.Shape, k.Shape, v.Shape)
		}
		p.DV = v.Shape[2]
		if err := p.checkCuSeqlens(); err != nil {
			return nil, err
		}
	} else {
		p.B, p.N, p.H, p.DK = q.Shape[0], q.Shape[1], q.Shape[2], q.Shape[3]
		p.M, p.Hkv = k.Shape[1], k.Shape[2]
		if k.Shape[0] != p.B || v.Shape[0] != p.B {
			return nil, Errorf(ErrShape, "batch sizes of q %v, k %v, v %v differ", q.Shape, k.Shape, v.Shape)
		}
		if k.Shape[3] != p.DK {
			return nil, Errorf(ErrShape, "k head dim %d differs from q head dim %d", k.Shape[3], p.DK)
		}
		if v.Shape[1] != p.M || v.Shape[2] != p.Hkv {
			return nil, Errorf(ErrShape, "v shape %v does not match k shape %v in seq and heads", v.Shape, k.Shape)
		}
		p.DV = v.Shape[3]
	}
	// The inputs' element counts fit an int; the outputs' may not (DV > DK,
	// or sizes whose product is zero in q but not in O or the LSE).
	for _, x := range []struct {
		name  string
		shape []int
	}{{"o", p.OutputShape()}, {"lse", p.LSEShape()}} {
		if _, err := CheckShape(x.name, x.shape); err != nil {
			return nil, err
		}
	}
	if err := p.Resolve(); err != nil {
		return nil, err
	}
	if opt.Bias != nil {
		if err := p.checkBias(opt.Bias.Tensor); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// Resolve validates the heads, head dims and options of a problem whose
// sizes and Opt are set, and resolves what follows from them: Scale, the
// dropout's DropThreshold and DropScale, and the masks (ResolveMask).
// NewProblem calls it; a backend that builds a Problem from tensors of its
// own (device memory) calls it too, so that every path resolves the
// options alike. The bias is checked by the caller, against its tensor.
func (p *Problem) Resolve() error {
	if p.H <= 0 || p.Hkv <= 0 {
		return Errorf(ErrShape, "heads H=%d, Hkv=%d must be positive", p.H, p.Hkv)
	}
	if p.H%p.Hkv != 0 {
		return Errorf(ErrShape, "query heads H=%d not a multiple of key/value heads Hkv=%d", p.H, p.Hkv)
	}
	if p.DK < 1 || p.DK > MaxHeadDim {
		return Errorf(ErrShape, "head dim DK=%d outside 1..%d", p.DK, MaxHeadDim)
	}
	if p.DV < 1 || p.DV > MaxHeadDim {
		return Errorf(ErrShape, "head dim DV=%d outside 1..%d", p.DV, MaxHeadDim)
	}
	if math.IsNaN(p.Opt.Scale) || math.IsInf(p.Opt.Scale, 0) {
		return Errorf(ErrOption, "scale %v is not finite", p.Opt.Scale)
	}
	p.Scale = p.Opt.Scale
	if p.Scale == 0 {
		p.Scale = 1 / math.Sqrt(float64(p.DK))
	}
	if math.IsNaN(p.Opt.Softcap) || math.IsInf(p.Opt.Softcap, 0) || p.Opt.Softcap < 0 {
		return Errorf(ErrOption, "softcap %v is not finite and ≥ 0", p.Opt.Softcap)
	}
	if !(p.Opt.Dropout >= 0 && p.Opt.Dropout < 1) {
		return Errorf(ErrOption, "dropout %v outside [0, 1)", p.Opt.Dropout)
	}
	if p.Opt.Dropout > 0 {
		t, err := philox.Threshold(p.Opt.Dropout)
		if err != nil {
			return Errorf(ErrOption, "%v", err)
		}
		p.DropThreshold, p.DropScale = t, philox.Scale(t)
	}
	if p.Opt.Align != AlignBottomRight && p.Opt.Align != AlignTopLeft {
		return Errorf(ErrOption, "align %d is neither bottom-right nor top-left", int(p.Opt.Align))
	}
	if err := p.CheckDropoutAt(); err != nil {
		return err
	}
	p.ResolveMask()
	return nil
}

// CheckDropoutAt validates Opt.DropoutAt: offsets ≥ 0, and the call's
// heads inside the larger problem's. NewProblem calls it; backends that
// build a Problem of their own call it too.
func (p *Problem) CheckDropoutAt() error {
	d := p.Opt.DropoutAt
	if d == nil {
		return nil
	}
	if d.Query < 0 || d.Key < 0 || d.Head < 0 || d.Heads < 0 {
		return Errorf(ErrOption, "dropout origin %+v has a negative field", *d)
	}
	if d.Heads != 0 && d.Head > d.Heads-p.H {
		return Errorf(ErrOption, "dropout origin: heads %d..%d outside the %d heads of the larger problem", d.Head, d.Head+p.H-1, d.Heads)
	}
	if d.Heads == 0 && d.Head != 0 {
		return Errorf(ErrOption, "dropout origin: head offset %d needs the larger problem's head count", d.Head)
	}
	return nil
}

// DropoutPlace returns where query head h of this call draws its dropout
// mask: the head index and head count to key the mask with and the
// offsets to add to query and key positions (Opt.DropoutAt applied; h,
// H, 0, 0 without it).
func (p *Problem) DropoutPlace(h int) (head, heads, qoff, koff int) {
	d := p.Opt.DropoutAt
	if d == nil {
		return h, p.H, 0, 0
	}
	heads = d.Heads
	if heads == 0 {
		heads = p.H
	}
	return d.Head + h, heads, d.Query, d.Key
}

func (p *Problem) checkCuSeqlens() error {
	cq, ck := p.Opt.CuSeqlensQ, p.Opt.CuSeqlensK
	if cq == nil || ck == nil {
		return Errorf(ErrOption, "cu_seqlens: both q and k offsets are needed (got %d and %d)", len(cq), len(ck))
	}
	if len(cq) != len(ck) {
		return Errorf(ErrOption, "cu_seqlens_q has %d entries, cu_seqlens_k %d: both must be B+1", len(cq), len(ck))
	}
	if len(cq) < 2 {
		return Errorf(ErrOption, "cu_seqlens need at least 2 entries (B+1), got %d", len(cq))
	}
	for _, x := range []struct {
		name  string
		cu    []int32
		total int
		max   *int
	}{{"cu_seqlens_q", cq, p.TotalQ, &p.N}, {"cu_seqlens_k", ck, p.TotalK, &p.M}} {
		if x.cu[0] != 0 {
			return Errorf(ErrOption, "%s[0] = %d, want 0", x.name, x.cu[0])
		}
		for i := 1; i < len(x.cu); i++ {
			if x.cu[i] < x.cu[i-1] {
				return Errorf(ErrOption, "%s not non-decreasing: [%d] = %d < [%d] = %d", x.name, i, x.cu[i], i-1, x.cu[i-1])
			}
			if l := int(x.cu[i] - x.cu[i-1]); l > *x.max {
				*x.max = l
			}
		}
		if last := int(x.cu[len(x.cu)-1]); last != x.total {
			return Errorf(ErrOption, "%s ends at %d but the packed tensor has %d tokens", x.name, last, x.total)
		}
	}
	p.B = len(cq) - 1
	return nil
}

func (p *Problem) checkBias(b Tensor) error {
	if p.Varlen {
		return Errorf(ErrUnsupported, "bias with a packed variable-length batch")
	}
	if err := b.CheckLayout("bias"); err != nil {
		return err
	}
	s := b.Shape
	if len(s) != 4 || (s[0] != 1 && s[0] != p.B) || (s[1] != 1 && s[1] != p.H) || s[2] != p.N || s[3] != p.M {
		return Errorf(ErrShape, "bias shape %v does not broadcast to [B=%d, H=%d, N=%d, M=%d]", s, p.B, p.H, p.N, p.M)
	}
	return nil
}

// CheckBackward validates the extra backward inputs o, lse and dO against p.
func (p *Problem) CheckBackward(q, o, lse, dO Tensor) error {
	for _, x := range []struct {
		name string
		t    Tensor
	}{{"o", o}, {"lse", lse}, {"dO", dO}} {
		if err := x.t.CheckLayout(x.name); err != nil {
			return err
		}
	}
	if o.DType != q.DType || dO.DType != q.DType {
		return Errorf(ErrDType, "o %v and dO %v must have q's dtype %v", o.DType, dO.DType, q.DType)
	}
	if lse.DType != Float32 {
		return Errorf(ErrDType, "lse dtype %v, want fp32", lse.DType)
	}
	for _, x := range []struct {
		name string
		t    Tensor
		want []int
	}{{"o", o, p.OutputShape()}, {"dO", dO, p.OutputShape()}, {"lse", lse, p.LSEShape()}} {
		if !slices.Equal(x.t.Shape, x.want) {
			return Errorf(ErrShape, "%s shape %v, want %v", x.name, x.t.Shape, x.want)
		}
	}
	return nil
}
