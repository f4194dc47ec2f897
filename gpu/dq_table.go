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
	// deterministic.
	DQAtomic
	// DQSeparate computes dQ in its own kernel that recomputes S, P and dP
	// per query block (seven matrix products in all). Deterministic.
	DQSeparate
)

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
// (wgmma) kernels. FixedLength limits the row to fixed-length batches (the
// Hopper kernels load their tiles by tensor maps there, and by cp.async for
// packed batches).
type dqRule struct {
	MaxDim      int
	Causal      int // -1 any, 0 not causal/windowed, 1 masked
	MinN, MaxN  int
	Hopper      int
	FixedLength bool
	Algo        DQAlgorithm
}

// dqTable is the measured choice of dQ algorithm per shape class, first
// matching row wins. See kernels/NOTES-bwd.md for the measurements.
var dqTable = []dqRule{
	// bf16 on the H200 (2026-12-04, the tensor-map kernels), N = 1K, 4K, 16K
	// with B·N = 16K and H·D = 2048: at D = 64 the atomic dQ is 1–6 % faster
	// everywhere; at D = 128 the separate one is 2–6 % faster without a mask
	// (4K: 3.526 ms against 3.682) and 1–7 % slower with the causal one
	// (4K: 2.349 against 2.269). Dims between 64 and 128 follow 128.
	{MaxDim: 64, Causal: -1, Hopper: 1, Algo: DQAtomic},
	{MaxDim: 128, Causal: 0, Hopper: 1, FixedLength: true, Algo: DQSeparate},
	// bf16 on the H200 (2026-12-03), the Hopper kernels with cp.async loads,
	// N = 4K causal or not and the head-dim spectrum: the atomic dQ is 5–15 %
	// faster up to D = 128; past it, where the dK/dV kernel's warpgroups
	// split columns over 64 keys, its atomics cost more than the separate dQ
	// kernel (D = 256: 4.74 ms separate, 5.61 atomic; with tensor maps 3.699
	// against 5.006 at 4K).
	{MaxDim: 128, Causal: -1, Hopper: 1, Algo: DQAtomic},
	{MaxDim: 256, Causal: -1, Hopper: 1, Algo: DQSeparate},
	// bf16 on the H200 (2026-12-02, second table), the mma.sync kernels, N =
	// 1K…16K causal or not, and the head-dim spectrum 64…512 at N = 4K:
	// since the atomic dQ adds accumulator pairs (8-byte vector atomics) it
	// wins everywhere measured, by 10–23 % up to D=128, 1–11 % beyond.
	// Options.Deterministic still picks DQSeparate.
	{MaxDim: 512, Causal: -1, Hopper: -1, Algo: DQAtomic},
}

// SelectDQAlgorithm returns the dQ algorithm the backward uses for p when
// asked for DQAuto on the mma.sync kernels (SelectDQAlgorithmFor with
// hopper false).
func SelectDQAlgorithm(p *attn.Problem) DQAlgorithm { return SelectDQAlgorithmFor(p, false) }

// SelectDQAlgorithmFor returns the dQ algorithm the backward uses for p when
// asked for DQAuto: DQSeparate when p.Opt.Deterministic is set, otherwise
// the first matching row of the measured table; hopper says that the Hopper
// kernels run p (see kernels.BwdHopperOK).
func SelectDQAlgorithmFor(p *attn.Problem, hopper bool) DQAlgorithm {
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
		if r.Hopper >= 0 && (r.Hopper == 1) != hopper || r.FixedLength && p.Varlen {
			continue
		}
		return r.Algo
	}
	return DQSeparate
}

// bwdHopperRuns reports whether the backward of p in dt with arguments a
// runs the Hopper kernels on a device where they are available (hopper).
// It decides both the kernels planBackward picks and the row of the dQ table
// that applies, so the two cannot disagree.
func bwdHopperRuns(p *attn.Problem, dt attn.DType, a *bwdArgs, hopper bool) bool {
	return hopper && kernels.BwdHopperOK(bwdVariantFor(p, dt, a, DQSeparate))
}

// resolveDQ turns DQAuto into a concrete algorithm (hopper: the Hopper
// kernels run p); Deterministic always wins over an explicit DQAtomic.
func resolveDQ(p *attn.Problem, a DQAlgorithm, hopper bool) DQAlgorithm {
	if a == DQAuto || p.Opt.Deterministic {
		return SelectDQAlgorithmFor(p, hopper)
	}
	return a
}
