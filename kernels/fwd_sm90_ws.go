package kernels

import (
	"fmt"
	"strings"

	"github.com/flashattn/flashattn/attn"
)

// The warp-specialized pipeline of the Hopper forward (Variant.WarpSpecialized,
// sm_90a, tensor-map loads).
//
// The CTA has one warpgroup more than its compute warpgroups: the producer,
// the last one (threads NCOMPUTE .. NTHREADS − 1), so that the compute
// threads keep the indices, warps and row groups of the kernel without it.
// The producer lowers its register budget to PRODUCER_REGS (setmaxnreg) and
// the compute warpgroups raise theirs to COMPUTE_REGS out of what it gave
// back. One producer thread issues every tile load; the other producer
// threads exit.
//
// Each K and V buffer has two mbarriers: "full", on which its tile's bytes
// land (the tensor memory accelerator completes it), and "empty", on which
// each compute warp arrives once it no longer reads the buffer (count: the
// compute warps). Key blocks are numbered s = 0, 1, … from the last one
// (nb_hi − 1) down; K(s) and V(s) go to buffer s mod 2 and complete phase
// s / 2 of that buffer's full barrier. The producer issues
//
//	Q, K(0), K(1), V(0), K(2), V(1), …, K(T−1), V(T−2), V(T−1)
//
// (the order in which the compute warpgroups need them: S of block s + 1
// is computed before P·V of block s), waiting before K(s) and V(s), s ≥ 2,
// for the release of K(s − 2) and V(s − 2): phase s/2 − 1 of the buffer's
// empty barrier. The compute warps release K(s) as soon as S of block s is
// complete (wgmma wait) and V(s) once P·V of block s is, so the loads of
// the next blocks start while the current one computes, and no block-wide
// barrier remains in the main loop: the warpgroups no longer run in
// lockstep. Where the compute warpgroups must meet (flat rows' Q zeroing,
// O staged through shared memory), they use named barrier 1 over
// NCOMPUTE threads; the non-finite vote is per warp.

// wsProducerRegs is the producer warpgroup's register budget after
// setmaxnreg: its one issuing thread needs only addresses and counters.
const wsProducerRegs = 24

// wsComputeRegs returns the compute threads' register budget after
// setmaxnreg: the block's 64K registers less the producer's, over the
// compute threads, in steps of 8, at most 256. The second result is false
// when the budget the kernel starts with is already that (one compute
// warpgroup: 256), and no setmaxnreg is issued.
func wsComputeRegs(computeThreads int) (int, bool) {
	start := min(256, 65536/(computeThreads+128)/8*8)
	regs := min(256, (65536-wsProducerRegs*128)/computeThreads/8*8)
	return regs, regs > start
}

// wsConstants writes the compile-time constants of the pipeline.
func (x *gen) wsConstants() {
	g := x.g
	compute := g.threads - 128
	regs, _ := wsComputeRegs(compute)
	x.p("constexpr int NCOMPUTE = %d;  // compute threads (%d warpgroups); the producer warpgroup is threads NCOMPUTE..NTHREADS-1", compute, compute/128)
	x.p("constexpr int PRODUCER_REGS = %d;  // the producer warpgroup's register budget (setmaxnreg.dec)", wsProducerRegs)
	x.p("constexpr int COMPUTE_REGS = %d;  // the compute warpgroups' register budget (setmaxnreg.inc)", regs)
	x.p("constexpr int EMPTY_OFF = BAR_OFF + %d;  // mbarriers on which the compute warps release K buffers 0 and 1, V buffers 0 and 1", tmaBarrierBytes)
}

// computeThreads returns the name of the number of threads that compute
// (every thread of a kernel without a producer warpgroup).
func (x *gen) computeThreads() string {
	if x.v.WarpSpecialized {
		return "NCOMPUTE"
	}
	return "NTHREADS"
}

// computeSync returns the statement with which the compute threads meet:
// the block barrier, or with a producer warpgroup named barrier 1 over the
// compute threads.
func (x *gen) computeSync() string {
	if x.v.WarpSpecialized {
		return "bar_sync(1, NCOMPUTE);"
	}
	return "__syncthreads();"
}

// wsPrologue writes, for a warp-specialized kernel, the barriers' set-up,
// the role split and the producer's loop; the compute threads go on after
// it, waiting for Q and the first K.
func (x *gen) wsPrologue() {
	_, inc := wsComputeRegs(x.g.threads - 128)
	x.wsBarriers()
	x.raw(x.tmaCoords())
	x.raw(`  if (tid >= NCOMPUTE) {  // ---- producer warpgroup
    setmaxnreg_dec<PRODUCER_REGS>();
    if (tid == NCOMPUTE) {
      tma_tile<BM, KATOMS>(sQ, mq_, barQ, m0, hq_, b, cq_);
      const int T = nb_hi - nb_lo;  // key blocks, s = 0 .. T-1 from the last (nb_hi - 1) down
      for (int s = 0; s <= T; ++s) {
        if (s < T) {  // K(s) into buffer s & 1, once K(s - 2) is released there
          if (s >= 2) mbar_wait(emptyK + 8 * (s & 1), ((s >> 1) - 1) & 1);
          tma_tile<BN, KATOMS>(sK + (s & 1) * K_STAGE, mk_, barK + 8 * (s & 1), (nb_hi - 1 - s) * BN, hk_, b, ck_);
        }
        if (s >= 1) {  // V(s - 1): needed after S of block s
          const int t = s - 1;
          if (t >= 2) mbar_wait(emptyV + 8 * (t & 1), ((t >> 1) - 1) & 1);
          tma_tile<BN, VATOMS>(sV + (t & 1) * V_STAGE, mv_, barV + 8 * (t & 1), (nb_hi - 1 - t) * BN, hv_, b, cv_);
        }
      }
    }
    return;
  }
`)
	if inc {
		x.raw("  setmaxnreg_inc<COMPUTE_REGS>();  // ---- compute warpgroups, with the producer's registers\n")
	} else {
		x.raw("  // ---- compute warpgroup (it starts with the largest budget already: no setmaxnreg)\n")
	}
	x.raw(`  mbar_wait(barQ, 0);  // Q
  mbar_wait(barK, 0);  // K of the first block
`)
}

// wsBarriers writes the pipeline's mbarriers and their initialization,
// ending with the last block-wide barrier: full barriers for Q and each K
// and V buffer; empty barriers for each K and V buffer and, persistent, Q.
func (x *gen) wsBarriers() {
	q, qDecl, qInit := "", "          // buffer b: emptyK + 8b, emptyV + 8b", ""
	if x.v.Persistent {
		q, qDecl, qInit = ", and Q", ", emptyQ = emptyK + 32;", "\n    mbar_init(emptyQ, NCOMPUTE / 32);"
	} else {
		qDecl = ";" + qDecl
	}
	x.p(`  // ---- mbarriers: full (the tile's bytes landed) for Q, K buffers 0 and 1, V buffers 0 and 1;
  // empty (every compute warp released the buffer) for K buffers 0 and 1, V buffers 0 and 1%s
  const u32 barQ = s_base + BAR_OFF, barK = barQ + 8, barV = barQ + 24;  // buffer b: barK + 8b, barV + 8b
  const u32 emptyK = s_base + EMPTY_OFF, emptyV = emptyK + 16%s
  if (tid == 0) {
    mbar_init(barQ, 1);%s
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mbar_init(barK + 8 * i, 1);
      mbar_init(barV + 8 * i, 1);
      mbar_init(emptyK + 8 * i, NCOMPUTE / 32);
      mbar_init(emptyV + 8 * i, NCOMPUTE / 32);
    }
    mbar_fence_init();
  }
  __syncthreads();  // the last block-wide barrier: the producer warpgroup leaves the compute threads here`, q, qDecl, qInit)
}

// wsRelease writes, for a warp-specialized kernel, a compute warp's release
// of buffer buf of K or V (t): one arrival per warp once its lanes are done
// with the buffer. Nothing for other kernels.
func (x *gen) wsRelease(indent, t, buf string) {
	if !x.v.WarpSpecialized {
		return
	}
	bar := map[string]string{"K": "emptyK", "V": "emptyV"}[t]
	x.raw(fmt.Sprintf("%s__syncwarp();\n%sif (lane == 0) mbar_arrive(%s + 8 * (%s));  // this warp is done with %s buffer %s\n", indent, indent, bar, buf, t, buf))
}

// wsVote writes the non-finite vote of a warp-specialized kernel: per warp
// (the producer warpgroup has left), one atomic per warp that saw one.
func (x *gen) wsVote() {
	x.p(`
  // ---- non-finite O (rare; see fwd_mask.go): one vote per compute warp; the fix-up kernel recomputes
  if (__any_sync(FULL_MASK, nf_o != nf_o) && lane == 0) atomicOr((u32*)p.nf_flag, 1u);`)
}

// The turns of ping-pong (Variant.PingPong): compute warpgroup w may issue
// its products once named barrier 2 + w completes, which takes its own 128
// threads (bar.sync) and the other warpgroup's 128 (bar.arrive, after that
// one issued its products). Warpgroup 1 arrives once first, so warpgroup 0
// takes the first turn. Each warpgroup has the same number of turns R (one
// per product issue: the first S, then one per key block); warpgroup 0
// passes the turn after each (R arrivals, which warpgroup 1's R turns
// take), warpgroup 1 after each but its last (1 + R − 1 arrivals for
// warpgroup 0's R turns), so no barrier is left with arrivals at exit. A
// warpgroup cannot arrive twice on a barrier before the other has synced on
// it: its next arrival comes after its next turn, which needs the other's
// pass, which follows the other's sync.
type ppStep int

const (
	ppTurn     ppStep = iota // wait for this warpgroup's turn
	ppPass                   // pass the turn to the other warpgroup
	ppPassLast               // pass it after the last products: warpgroup 0 only
)

// pingPongStart writes warpgroup 1's first arrival.
func (x *gen) pingPongStart() {
	if !x.v.PingPong {
		return
	}
	x.raw("  if (wg == 1) bar_arrive(2, 256);  // ---- ping-pong: warpgroup 0 takes the first turn on the tensor cores\n")
}

// pingPong writes one step of the turns. Nothing without PingPong.
func (x *gen) pingPong(indent string, step ppStep) {
	if !x.v.PingPong {
		return
	}
	switch step {
	case ppTurn:
		x.raw(indent + "bar_sync(2 + wg, 256);  // this warpgroup's turn to issue products\n")
	case ppPass:
		x.raw(indent + "bar_arrive(3 - wg, 256);  // the other warpgroup's turn\n")
	case ppPassLast:
		x.raw(indent + "if (wg == 0) bar_arrive(3, 256);  // warpgroup 1's last turn (it has no further turn to give back)\n")
	}
}

// pipelineWords are the words of a Pipeline in ParsePipeline and String.
var pipelineWords = []struct {
	word string
	set  func(*Pipeline) *bool
}{
	{"ws", func(p *Pipeline) *bool { return &p.WarpSpecialized }},
	{"pingpong", func(p *Pipeline) *bool { return &p.PingPong }},
	{"early-rescale", func(p *Pipeline) *bool { return &p.EarlyRescale }},
	{"persistent", func(p *Pipeline) *bool { return &p.Persistent }},
}

// ParsePipeline reads a comma-separated list of pipeline words: "ws"
// (WarpSpecialized), "pingpong" (PingPong, implies ws), "early-rescale"
// (EarlyRescale) and "persistent" (Persistent, implies ws); "" and
// "lockstep" are the zero Pipeline. Unknown words give an error wrapping
// attn.ErrOption.
func ParsePipeline(s string) (Pipeline, error) {
	var p Pipeline
	if s == "" || s == "lockstep" {
		return p, nil
	}
next:
	for _, w := range strings.Split(s, ",") {
		w = strings.TrimSpace(w)
		for _, pw := range pipelineWords {
			if w == pw.word {
				*pw.set(&p) = true
				continue next
			}
		}
		return Pipeline{}, attn.Errorf(attn.ErrOption, "kernels: pipeline word %q (want lockstep, or some of ws, pingpong, early-rescale, persistent)", w)
	}
	if p.PingPong || p.Persistent {
		p.WarpSpecialized = true
	}
	return p, nil
}

// String returns the words ParsePipeline reads back: "lockstep" for the
// zero Pipeline.
func (p Pipeline) String() string {
	var ws []string
	for _, pw := range pipelineWords {
		if *pw.set(&p) {
			ws = append(ws, pw.word)
		}
	}
	if len(ws) == 0 {
		return "lockstep"
	}
	return strings.Join(ws, ",")
}

// The persistent schedule (Variant.Persistent). The CTA's tiles are t =
// blockIdx.x, blockIdx.x + gridDim.x, … < ntiles = nmb·H·B, numbered as the
// non-persistent grid numbers its CTAs: query block fastest (so that the
// CTAs running at once share a head's K and V in L2), last first under a
// window mask (the heaviest first), then head, then batch element. The
// producer and the compute warpgroups walk the same tiles in two loops of
// their own (their register budgets differ, so no code is shared). A tile
// whose rows see no key loads nothing and counts for nothing: the compute
// warpgroups write its zeros. Over the others the CTA numbers its K and V
// tiles continuously: kv0 is the index of a tile's first K (and V) tile, so
// buffers and barrier phases carry on from one tile to the next; q_it
// counts the tiles with keys: Q of tile q_it completes phase q_it mod 2 of
// Q's full barrier, and the compute warps release Q on its empty barrier
// once the tile's last S is done, after which the producer loads the next
// Q while they finish the epilogue.

// PersistentGrid returns the CTA count of a persistent launch over ntiles
// tiles on a device of sms multiprocessors: one CTA per multiprocessor, at
// most one per tile.
func PersistentGrid(ntiles, sms int) int { return max(1, min(ntiles, sms)) }

// tileExit returns the statement that leaves a tile whose rows see no key:
// return, or continue with the next tile of a persistent CTA.
func (x *gen) tileExit() string {
	if x.v.Persistent {
		return "continue"
	}
	return "return"
}

// tileCoords returns the declarations of a persistent CTA's tile's
// coordinates (mblk, h, b) from the tile index tile.
func (x *gen) tileCoords(indent string) string {
	mblk := "mq;"
	if x.v.Mask == MaskWindow {
		mblk = "nmb - 1 - mq;  // heaviest (last) query blocks first"
	}
	return fmt.Sprintf(`%[1]sconst int mq = tile %% nmb;  // query blocks fastest: the CTAs at work share a head's K and V
%[1]sconst int mblk = %[2]s
%[1]sint h = (tile / nmb) %% p.h, b = tile / (nmb * p.h);
`, indent, mblk)
}

// wsPersistentPrologue writes the barriers of a persistent warp-specialized
// kernel, the producer's loop over the CTA's tiles, and the compute
// warpgroups' loop header (the tile's body follows, then the caller closes
// the loop).
func (x *gen) wsPersistentPrologue() {
	_, inc := wsComputeRegs(x.g.threads - 128)
	x.wsBarriers()
	x.raw(`  const int nmb = (p.n + BM - 1) / BM;  // query blocks per (head, batch element)
  const int ntiles = nmb * p.h * p.b;   // the tiles of the launch (PersistentGrid CTAs share them)
  if (tid >= NCOMPUTE) {  // ---- producer warpgroup
    setmaxnreg_dec<PRODUCER_REGS>();
    if (tid == NCOMPUTE) {
      int kv0 = 0, q_it = 0;  // K/V tiles loaded so far, tiles with keys so far
      for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
`)
	x.raw(x.tileCoords("        "))
	x.raw(`        const int kvh = h / p.group;
        const int n = p.n, m = p.m;
        const int m0 = mblk * BM, rows = min(BM, n - m0);
        (void)rows;
`)
	y := &gen{v: x.v, g: x.g}
	y.maskRange()
	y.raw(x.tmaCoords())
	x.raw(indentLines(y.b.String(), "      "))
	x.raw(`        if (nb_hi <= nb_lo) continue;  // no key: the compute warpgroups write zeros
        if (q_it > 0) mbar_wait(emptyQ, (q_it - 1) & 1);  // the last tile's Q released
        tma_tile<BM, KATOMS>(sQ, mq_, barQ, m0, hq_, b, cq_);
        const int T = nb_hi - nb_lo;  // key blocks, s = 0 .. T-1 from the last (nb_hi - 1) down: K and V tiles kv0 + s
        for (int s = 0; s <= T; ++s) {
          if (s < T) {  // K tile kv0 + s into buffer (kv0 + s) & 1, once tile kv0 + s - 2 is released there
            const int g = kv0 + s;
            if (g >= 2) mbar_wait(emptyK + 8 * (g & 1), ((g >> 1) - 1) & 1);
            tma_tile<BN, KATOMS>(sK + (g & 1) * K_STAGE, mk_, barK + 8 * (g & 1), (nb_hi - 1 - s) * BN, hk_, b, ck_);
          }
          if (s >= 1) {  // V of block s - 1: needed after S of block s
            const int g = kv0 + s - 1;
            if (g >= 2) mbar_wait(emptyV + 8 * (g & 1), ((g >> 1) - 1) & 1);
            tma_tile<BN, VATOMS>(sV + (g & 1) * V_STAGE, mv_, barV + 8 * (g & 1), (nb_hi - s) * BN, hv_, b, cv_);
          }
        }
        kv0 += T;
        ++q_it;
      }
    }
    return;
  }
`)
	if inc {
		x.raw("  setmaxnreg_inc<COMPUTE_REGS>();  // ---- compute warpgroups, with the producer's registers\n")
	} else {
		x.raw("  // ---- compute warpgroup (it starts with the largest budget already: no setmaxnreg)\n")
	}
	x.raw(`  int kv0 = 0, q_it = 0;  // K/V tiles consumed so far, tiles with keys so far (as the producer counts them)
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
`)
}

// wsPersistentWaits writes a persistent compute warp's waits for its
// tile's Q and first K.
func (x *gen) wsPersistentWaits() {
	x.raw(`  mbar_wait(barQ, q_it & 1);                        // Q of this tile
  mbar_wait(barK + 8 * (kv0 & 1), (kv0 >> 1) & 1);  // K of its first block
`)
}

// wsTileDone writes the end of a persistent tile's main loop: Q released
// (every S of the tile is done), the counters moved on.
func (x *gen) wsTileDone() {
	x.raw(`  __syncwarp();
  if (lane == 0) mbar_arrive(emptyQ);  // this warp is done with Q: the producer may load the next tile's
  kv0 += nb_hi - nb_lo;
  ++q_it;
`)
}
