package gpu

import (
	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/kernels"
)

// DQAlgorithm selects how the backward pass computes dQ.
type DQAlgorithm int

const (
	// DQAuto picks by the measured table (SelectDQAlgorithmFor); with
	// Options.Deterministic it is always DQSeparate.
	DQAuto DQAlgorithm = iota
	// DQAtomic accumulates dQ in fp32 with atomic adds from the dK/dV
	// kernel (five matrix products), then converts it. Not bit-for-bit
	// deterministic. The Hopper kernels past head dim 256 have no atomic
	// dQ: they take DQSeparate whatever is asked.
	DQAtomic
	// DQSeparate computes dQ in its own kernel that recomputes S, P and dP
	// per query block (seven matrix products in all). Deterministic.
	DQSeparate
)

// ParseDQAlgorithm reads "auto" (or ""), "atomic" or "separate"; other
// words give an error wrapping attn.ErrOption.
func ParseDQAlgorithm(s string) (DQAlgorithm, error) {
	for _, a := range []DQAlgorithm{DQAuto, DQAtomic, DQSeparate} {
		if s == a.String() {
			return a, nil
		}
	}
	if s == "" {
		return DQAuto, nil
	}
	return DQAuto, attn.Errorf(attn.ErrOption, "gpu: dQ algorithm %q (want auto, atomic or separate)", s)
}

// String returns "auto", "atomic" or "separate".
func (a DQAlgorithm) String() string {
	switch a {
	case DQAtomic:
		return "atomic"
	case DQSeparate:
		return "separate"
	}
	return "auto"
}

// dqRule is one row of the dQ algorithm table: problems whose padded head
// dimension is at most MaxDim and whose query length per head is at least
// MinN (and below MaxN, 0 meaning unbounded) use Algo. Hopper says which
// kernels the row is for: -1 any, 0 the mma.sync kernels, 1 the Hopper
// (wgmma) kernels; WarpSpecialized which pipeline of the Hopper kernels:
// -1 any, 0 lockstep, 1 warp-specialized. FixedLength limits the row to
// fixed-length batches.
type dqRule struct {
	MaxDim          int
	Causal          int // -1 any, 0 not causal/windowed, 1 masked
	MinN, MaxN      int
	Hopper          int
	WarpSpecialized int
	FixedLength     bool
	Algo            DQAlgorithm
}

// DQKernels names the backward kernels that run a problem, as far as the
// dQ table tells them apart.
type DQKernels struct {
	// Hopper: the Hopper (wgmma) kernels run it (kernels.BwdHopperOK).
	Hopper bool
	// WarpSpecialized: on their warp-specialized pipeline
	// (kernels.BwdVariant.WarpSpecialized).
	WarpSpecialized bool
}

// dqTable is the measured choice of dQ algorithm per shape class, first
// matching row wins. The measurements behind each row are in
// docs/kernels/backward.md ("The dQ algorithm table").
var dqTable = []dqRule{
	// the warp-specialized Hopper kernels, fixed-length batches: atomic at D ≤ 96, separate at D ≤ 128,
	// masked or not
	{MaxDim: 96, Causal: -1, Hopper: 1, WarpSpecialized: 1, FixedLength: true, Algo: DQAtomic},
	{MaxDim: 128, Causal: -1, Hopper: 1, WarpSpecialized: 1, FixedLength: true, Algo: DQSeparate},
	// the tensor-map Hopper kernels: atomic at D ≤ 64, separate at D ≤ 128 without a mask
	{MaxDim: 64, Causal: -1, Hopper: 1, WarpSpecialized: -1, Algo: DQAtomic},
	{MaxDim: 128, Causal: 0, Hopper: 1, WarpSpecialized: -1, FixedLength: true, Algo: DQSeparate},
	// the Hopper kernels otherwise: atomic up to D = 128, separate beyond
	{MaxDim: 128, Causal: -1, Hopper: 1, WarpSpecialized: -1, Algo: DQAtomic},
	{MaxDim: 256, Causal: -1, Hopper: 1, WarpSpecialized: -1, Algo: DQSeparate},
	// the Hopper kernels past 256 have no atomic dQ
	{MaxDim: 512, Causal: -1, Hopper: 1, WarpSpecialized: -1, Algo: DQSeparate},
	// the mma.sync kernels: atomic everywhere (Options.Deterministic still picks DQSeparate)
	{MaxDim: 512, Causal: -1, Hopper: -1, WarpSpecialized: -1, Algo: DQAtomic},
}

// SelectDQAlgorithm returns the dQ algorithm the backward uses for p when
// asked for DQAuto on the mma.sync kernels (SelectDQAlgorithmFor with
// hopper false).
func SelectDQAlgorithm(p *attn.Problem) DQAlgorithm { return SelectDQAlgorithmFor(p, DQKernels{}) }

// SelectDQAlgorithmFor returns the dQ algorithm the backward uses for p when
// asked for DQAuto: DQSeparate when p.Opt.Deterministic is set, otherwise
// the first matching row of the measured table for the kernels k that run
// p.
func SelectDQAlgorithmFor(p *attn.Problem, k DQKernels) DQAlgorithm {
	if p.Opt.Deterministic {
		return DQSeparate
	}
	d := max(p.DK, p.DV)
	for _, r := range dqTable {
		if d > r.MaxDim || p.N < r.MinN || (r.MaxN > 0 && p.N >= r.MaxN) {
			continue
		}
		if r.Causal >= 0 && (r.Causal == 1) != p.Masked {
			continue
		}
		if r.Hopper >= 0 && (r.Hopper == 1) != k.Hopper || r.FixedLength && p.Varlen {
			continue
		}
		if r.WarpSpecialized >= 0 && (r.WarpSpecialized == 1) != (k.Hopper && k.WarpSpecialized) {
			continue
		}
		return r.Algo
	}
	return DQSeparate
}

// bwdHopperRuns reports whether the backward of p in dt with arguments a
// runs the Hopper kernels on a device where they are available (hopper),
// those past head dim 256 only where allowed (deep: Backend.BwdDeep). It
// decides both the kernels planBackward picks and the row of the dQ table
// that applies, so the two cannot disagree.
func bwdHopperRuns(p *attn.Problem, dt attn.DType, a *bwdArgs, hopper, deep bool) bool {
	v := bwdVariantFor(p, dt, a, DQSeparate)
	return hopper && kernels.BwdHopperOK(v) && (deep || !kernels.BwdHopperDeep(v))
}

// resolveDQ turns DQAuto into a concrete algorithm for the kernels k that
// run p; Deterministic always wins over an explicit DQAtomic, and so do the
// Hopper kernels past head dim 256, which have no atomic dQ.
func resolveDQ(p *attn.Problem, a DQAlgorithm, k DQKernels) DQAlgorithm {
	if a == DQAuto || p.Opt.Deterministic || k.Hopper && max(p.DK, p.DV) > 256 {
		return SelectDQAlgorithmFor(p, k)
	}
	return a
}
