package kernels

import (
	"fmt"
	"strconv"
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
// setmaxnreg: the registers the block's threads start with (the 64K over
// its threads, in steps of 8, each) less the producer's, over the compute
// threads, in steps of 8, at most 256. The second result is false
// when the budget the kernel starts with is already that (one compute
// warpgroup: 256), and no setmaxnreg is issued.
func wsComputeRegs(computeThreads int) (int, bool) {
	start := min(256, 65536/(computeThreads+128)/8*8)
	// the CTA's pool holds the registers its threads start with, not the
	// file's remainder beyond them
	regs := min(256, (start*(computeThreads+128)-wsProducerRegs*128)/computeThreads/8*8)
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
	if x.v.DoubleQ {
		x.p("constexpr int QFULL_STEP = %d, QEMPTY_STEP = %d;  // Q buffer b's barriers: barQ + QFULL_STEP·b, emptyQ + QEMPTY_STEP·b", doubleQFullStep, doubleQEmptyStep)
	}
}

// The second Q buffer's barriers (Pipeline.DoubleQ) take places left free
// without a staged bias (which DoubleQ declines): in the full barriers'
// 64 bytes (Q at 0, K at 8 and 16, V at 24 and 32, the bias buffers' at 40
// and 48) the one at 56, and in the empty barriers' 64 (K at 0 and 8, V at
// 16 and 24, Q at 32, the tile index words at 40 and 44, the bias
// buffers' at 48 and 56) the one at 48.
const (
	doubleQFullStep  = 56 // from barQ to Q buffer 1's full barrier
	doubleQEmptyStep = 16 // from emptyQ to Q buffer 1's empty barrier
)

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
`)
	x.wsTileLoads("      ", "0")
	x.keepProducer()
	x.raw(`    }
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
// and V buffer; empty barriers for each K and V buffer and, persistent, Q;
// with BiasStaged full and empty barriers for each bias buffer.
func (x *gen) wsBarriers() {
	keepDecl, keepInit := x.keepBarriers()
	q, qDecl, qInit := "", "          // buffer b: emptyK + 8b, emptyV + 8b", ""
	if x.v.Persistent {
		q, qDecl, qInit = ", and Q", ", emptyQ = emptyK + 32;", "\n    mbar_init(emptyQ, NCOMPUTE);  // every compute thread arrives: they read the tile's index"
		if x.v.DoubleQ {
			q, qDecl = ", and Q buffers 0 and 1", ", emptyQ = emptyK + 32;  // Q buffer b: barQ + QFULL_STEP·b, emptyQ + QEMPTY_STEP·b"
			qInit += "\n    mbar_init(barQ + QFULL_STEP, 1);  // Q buffer 1's"
			qInit += "\n    mbar_init(emptyQ + QEMPTY_STEP, NCOMPUTE);"
		}
		if x.v.ProducerDropout {
			qInit = "\n    mbar_init(emptyQ, NCOMPUTE + KEEP_THREADS);  // every compute and keep thread arrives: they read the tile's index"
		}
	} else {
		qDecl = ";" + qDecl
	}
	x.p(`  // ---- mbarriers: full (the tile's bytes landed) for Q, K buffers 0 and 1, V buffers 0 and 1;
  // empty (every compute warp released the buffer) for K buffers 0 and 1, V buffers 0 and 1%s
  const u32 barQ = s_base + BAR_OFF, barK = barQ + 8, barV = barQ + 24;  // buffer b: barK + 8b, barV + 8b
  const u32 emptyK = s_base + EMPTY_OFF, emptyV = emptyK + 16%[2]s
%[4]s%[6]s  if (tid == 0) {
    mbar_init(barQ, 1);%[3]s
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mbar_init(barK + 8 * i, 1);
      mbar_init(barV + 8 * i, 1);
      mbar_init(emptyK + 8 * i, NCOMPUTE / 32);
      mbar_init(emptyV + 8 * i, NCOMPUTE / 32);
%[5]s%[7]s    }
    mbar_fence_init();
  }
  __syncthreads();  // the last block-wide barrier: the producer warpgroup leaves the compute threads here`, q, qDecl, qInit, x.biasStageBarriers(), x.biasStageBarrierInit(), keepDecl, keepInit)
}

// wsTileLoads writes the producer thread's loads of one tile: Q, then K
// and V of its T key blocks (s = 0 .. T-1 from the last, nb_hi - 1, down)
// in the order the products need them, K(s) before V(s - 1). The tile's
// K and V tiles are number first + s of the CTA's sequence, which gives
// each its buffer (the number mod 2) and the empty-barrier phase to wait
// for before reusing that buffer (number/2 − 1, from number 2 on).
func (x *gen) wsTileLoads(indent, first string) {
	num := func(s string) string {
		if first == "0" {
			return s
		}
		return first + " + " + s
	}
	x.raw(indentLines(fmt.Sprintf(`%[3]s
const int T = nb_hi - nb_lo;  // key blocks, s = 0 .. T-1 from the last (nb_hi - 1) down
for (int s = 0; s <= T; ++s) {
  if (s < T) {  // K of block s: tile %[1]s, once tile %[1]s - 2 released its buffer
    const int g = %[1]s;
    if (g >= 2) mbar_wait(emptyK + 8 * (g & 1), ((g >> 1) - 1) & 1);
    %[4]s
%[6]s  }
  if (s >= 1) {  // V of block s - 1 (needed after S of block s): tile %[2]s
    const int g = %[2]s;
    if (g >= 2) mbar_wait(emptyV + 8 * (g & 1), ((g >> 1) - 1) & 1);
    %[5]s
  }
}
`, num("s"), num("s - 1"), x.tmaTile("BM", "KATOMS", x.qBuffer().buf, "mq_", x.qBuffer().full, "m0"),
		x.tmaTile("BN", "KATOMS", "sK + (g & 1) * K_STAGE", "mk_", "barK + 8 * (g & 1)", "(nb_hi - 1 - s) * BN"),
		x.tmaTile("BN", "VATOMS", "sV + (g & 1) * V_STAGE", "mv_", "barV + 8 * (g & 1)", "(nb_hi - s) * BN"),
		x.biasStageLoad("    ", "(nb_hi - 1 - s) * BN")), indent))
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
//
// With CarryTurns persistent CTAs carry the turns across their tiles:
// warpgroup 1 arrives first once, before the CTA's first tile, and passes
// the turn after its last products of a tile too, so warpgroup 0 may
// issue the next tile's first S while warpgroup 1 still writes the last
// tile's O, instead of waiting for warpgroup 1 to start the next tile. The
// one arrival left when the CTA runs out of tiles is taken by warpgroup
// 0's wait on leaving (pingPongEnd).
type ppStep int

const (
	ppTurn     ppStep = iota // wait for this warpgroup's turn
	ppPass                   // pass the turn to the other warpgroup
	ppPassLast               // pass it after the last products: warpgroup 0 only (both with CarryTurns)
)

// pingPongStart writes warpgroup 1's first arrival where the turns start:
// at each tile (perCTA false) or, with CarryTurns, once a CTA, before its
// tiles (perCTA true). Nothing without PingPong or at the other place.
func (x *gen) pingPongStart(perCTA bool) {
	if !x.v.PingPong || x.v.CarryTurns != perCTA {
		return
	}
	x.raw("  if (wg == 1) bar_arrive(2, 256);  // ---- ping-pong: warpgroup 0 takes the first turn on the tensor cores\n")
}

// pingPongEnd writes, with CarryTurns, for a persistent CTA leaving its
// tile loop, warpgroup 0's wait for the turn warpgroup 1 passed after its
// last products, the one arrival no turn took.
func (x *gen) pingPongEnd() {
	if !x.v.CarryTurns {
		return
	}
	x.raw("  if (wg == 0) bar_sync(2, 256);  // ---- ping-pong: the turn warpgroup 1 passed after its last products, taken\n")
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
		if x.v.CarryTurns {
			x.raw(indent + "bar_arrive(3 - wg, 256);  // the other warpgroup's turn (warpgroup 1 passes it to the next tile's first S)\n")
			return
		}
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
	{"tma-store", func(p *Pipeline) *bool { return &p.StoreO }},
	{"early-dropout", func(p *Pipeline) *bool { return &p.EarlyDropout }},
	{"producer-dropout", func(p *Pipeline) *bool { return &p.ProducerDropout }},
	{"lazy-rescale", func(p *Pipeline) *bool { return &p.LazyRescale }},
	{"head-major", func(p *Pipeline) *bool { return &p.HeadMajor }},
	{"double-q", func(p *Pipeline) *bool { return &p.DoubleQ }},
	{"carry-turns", func(p *Pipeline) *bool { return &p.CarryTurns }},
}

// polyExpWord is the pipeline word of Pipeline.PolyExp, followed by "="
// and the number of key groups in four.
const polyExpWord = "poly-exp"

// ParsePipeline reads a list of pipeline words separated by commas or
// plus signs (the form that survives a comma-separated list of settings):
// "ws" (WarpSpecialized), "pingpong" (PingPong, implies ws),
// "early-rescale" (EarlyRescale), "persistent" (Persistent, implies ws),
// "tma-store" (StoreO), "early-dropout" (EarlyDropout), "producer-dropout"
// (ProducerDropout, implies ws), "lazy-rescale"
// (LazyRescale), "head-major" (HeadMajor), "double-q" (DoubleQ) and
// "carry-turns" (CarryTurns), and "poly-exp=N" (PolyExp = N, 1 to 4);
// "" and "lockstep" are the zero Pipeline.
// Unknown words give an error wrapping attn.ErrOption.
func ParsePipeline(s string) (Pipeline, error) {
	var p Pipeline
	if s == "" || s == "lockstep" {
		return p, nil
	}
next:
	for _, w := range strings.Split(strings.ReplaceAll(s, "+", ","), ",") {
		w = strings.TrimSpace(w)
		if n, ok := strings.CutPrefix(w, polyExpWord+"="); ok {
			q, err := strconv.Atoi(n)
			if err != nil || q < 1 || q > 4 {
				return Pipeline{}, attn.Errorf(attn.ErrOption, "kernels: pipeline word %q (want %s=1 to %s=4)", w, polyExpWord, polyExpWord)
			}
			p.PolyExp = q
			continue
		}
		for _, pw := range pipelineWords {
			if w == pw.word {
				*pw.set(&p) = true
				continue next
			}
		}
		return Pipeline{}, attn.Errorf(attn.ErrOption, "kernels: pipeline word %q (want lockstep, or some of ws, pingpong, early-rescale, persistent, tma-store, early-dropout, producer-dropout, lazy-rescale, head-major, double-q, carry-turns, poly-exp=N)", w)
	}
	if p.PingPong || p.Persistent || p.ProducerDropout {
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
	if p.PolyExp != 0 {
		ws = append(ws, fmt.Sprintf("%s=%d", polyExpWord, p.PolyExp))
	}
	if len(ws) == 0 {
		return "lockstep"
	}
	return strings.Join(ws, ",")
}

// The persistent schedule (Variant.Persistent). The launch's tiles (BM
// query rows of one head and batch element; ntiles = nmb·H·B) are numbered
// in sections of heads whose K and V fit in L2 together (persistentL2Bytes
// over the bytes of one head's K and V): a section's tiles run query block
// by query block, the section's heads fastest, the heaviest (last) query
// blocks first under a window mask. Without a mask every tile costs the
// same, and the CTA takes the tiles blockIdx.x, blockIdx.x + gridDim.x, …
// (static); under a window mask tiles cost more the later their query
// block, and the CTAs take the next tile from a counter in global memory
// as they free up (dynamic: the heaviest first, each CTA's share balanced
// as it goes), the last CTA to finish resetting the counter for the next
// launch (words 2 and 3 of Params.NFFlag's slot). With HeadMajor the
// tiles are numbered pair by pair instead, a (batch element, head) pair's
// query blocks consecutive (under a window mask its heaviest first), so
// that the CTAs reading one pair's K and V run together.
//
// The producer and the compute warpgroups walk the tiles in two loops of
// their own (their register budgets differ, so no code is shared). The
// producer hands each tile to the compute warpgroups through Q's buffer:
// it writes the tile's index into the shared word sched, then issues Q's
// load (or, for a tile whose rows see no key, and for the index ntiles that
// ends the loop, arrives on Q's full barrier with no load); the compute
// warps read the index once Q's barrier completes, and release Q on its
// empty barrier once the tile's last S is done (at once for a tile with no
// key, after writing its zeros), after which the producer writes the next
// index and loads the next Q while they finish the epilogue. q_it counts
// the CTA's tiles on both sides (tile q_it completes phase q_it mod 2 of
// Q's full barrier). K and V tiles are numbered continuously over the
// tiles: kv0 is the index of a tile's first K (and V) tile, so buffers and
// barrier phases carry on from one tile to the next.
//
// With DoubleQ the tiles use two Q buffers in turn, tile q_it buffer qb =
// q_it mod 2, each with its own full barrier (barQ + QFULL_STEP·qb), empty
// barrier (emptyQ + QEMPTY_STEP·qb) and index word (sched[qb]); tile q_it completes phase
// (q_it / 2) mod 2 of its buffer's barriers. The producer waits only for
// tile q_it − 2 to release the buffer, which it did a tile ago, so the next
// tile's Q — and behind it, as the stages free up, its first K and V — is
// loaded while the current tile's last blocks run, instead of after its
// last S.

// persistentL2Bytes is the L2 budget of a section of heads in the
// persistent schedule: about half the L2 of an H100 or H200 (50 MB), the
// rest for Q, O and other work.
const persistentL2Bytes = 24 << 20

// PersistentGrid returns the CTA count of a persistent launch over ntiles
// tiles on a device of sms multiprocessors: one CTA per multiprocessor, at
// most one per tile.
func PersistentGrid(ntiles, sms int) int { return max(1, min(ntiles, sms)) }

// persistentDynamic reports whether a persistent variant takes its tiles
// from the global counter (window masks) rather than statically.
func (v Variant) persistentDynamic() bool { return v.Persistent && v.Mask == MaskWindow }

// tileExit returns the statement that leaves a tile whose rows see no key:
// return, or for a persistent CTA release Q and continue with the next tile.
func (x *gen) tileExit() string {
	if x.v.Persistent {
		return "{ tile_done(); continue; }"
	}
	return "return;"
}

// tileCoords returns the declarations of a persistent tile's coordinates
// (mblk, h, b) from its index tile.
func (x *gen) tileCoords(indent string) string {
	if x.v.HeadMajor {
		mblk := "tile %% nmb"
		if x.v.Mask == MaskWindow {
			mblk = "nmb - 1 - tile %% nmb" // the pair's heaviest (last) query blocks first
		}
		return fmt.Sprintf(`%[1]sconst int mblk = `+mblk+`, hb = tile / nmb;  // head-major: a pair's query blocks together
%[1]sint h = hb %% p.h, b = hb / p.h;
`, indent) + x.pairOrder(indent, "hb")
	}
	mblk := "mq;"
	if x.v.Mask == MaskWindow {
		mblk = "nmb - 1 - mq;  // heaviest (last) query blocks first"
	}
	return fmt.Sprintf(`%[1]sconst int sec = tile / (sec_heads * nmb), hb0 = sec * sec_heads;  // section, its first (batch, head)
%[1]sconst int sh = min(sec_heads, p.b * p.h - hb0);               // heads in this section
%[1]sconst int mq = (tile - sec * sec_heads * nmb) / sh;             // query block rank: the section's heads fastest
%[1]sconst int hb = hb0 + (tile - sec * sec_heads * nmb) %% sh;       // batch element · H + head
%[1]sconst int mblk = %[2]s
%[1]sint h = hb %% p.h, b = hb / p.h;
`, indent, mblk) + x.pairOrder(indent, "hb")
}

// wsPersistentPrologue writes the barriers of a persistent warp-specialized
// kernel, the producer's loop over the CTA's tiles, and the compute
// warpgroups' loop header (the tile's body follows, then the caller closes
// the loop).
func (x *gen) wsPersistentPrologue() {
	_, inc := wsComputeRegs(x.g.threads - 128)
	x.wsBarriers()
	next := "blockIdx.x + q_it * gridDim.x;  // static: every tile costs the same"
	if x.v.persistentDynamic() {
		next = "(int)atomicAdd(sched_next, 1u);  // dynamic: the next tile not taken yet"
	}
	sections := fmt.Sprintf(`  // heads per section: as many as have their K and V in %d MB of L2 together
  const int sec_heads = (int)max(1LL, min((long long)p.b * p.h, %dLL / max(1LL, (long long)p.m * (p.d_k + p.d_v) * ESZ)));
`, persistentL2Bytes>>20, persistentL2Bytes)
	if x.v.HeadMajor {
		sections = "  // (head-major: no sections)\n"
	}
	x.p(`  const int nmb = (p.n + BM - 1) / BM;  // query blocks per (head, batch element)
  const int ntiles = nmb * p.h * p.b;   // the tiles of the launch (PersistentGrid CTAs share them)
%[1]s  volatile int* sched = (volatile int*)(smem + (s_base - smem_addr(smem)) + EMPTY_OFF + 40);  // %[2]s
  if (tid >= NCOMPUTE) {  // ---- producer warpgroup
    setmaxnreg_dec<PRODUCER_REGS>();
    if (tid == NCOMPUTE) {`, sections, x.qBuffer().slotNote)
	if x.v.persistentDynamic() {
		x.raw("      u32* sched_next = (u32*)p.nf_flag + 2;  // the launch's tile counter (word 3: CTAs done)\n")
	}
	x.raw("      int kv0 = 0, q_it = 0;  // K/V tiles loaded so far, tiles handed over so far\n      for (;; ++q_it) {\n")
	if x.v.DoubleQ {
		x.raw(`        const int qb = q_it & 1;  // the tile's Q buffer, its index in sched[qb]
        const u32 sQt = sQ + qb * Q_STAGE, barQt = barQ + QFULL_STEP * qb;
        if (q_it >= 2) mbar_wait(emptyQ + QEMPTY_STEP * qb, ((q_it >> 1) - 1) & 1);  // tile q_it - 2's Q and index released
`)
	} else {
		x.raw("        if (q_it > 0) mbar_wait(emptyQ, (q_it - 1) & 1);  // the last tile's Q and index released\n")
	}
	x.p("        const int tile = %s", next)
	x.p(`        %s = tile;
        if (tile >= ntiles) {  // no tile left: the compute warpgroups leave too
          mbar_arrive(%s);
          break;
        }`, x.qBuffer().slot, x.qBuffer().full)
	x.raw(x.persistentTileRange("        "))
	x.raw("        const int kvh = h / p.group;\n")
	x.raw(indentLines(x.tmaCoords(), "      "))
	x.p(`        if (nb_hi <= nb_lo) {  // no key: nothing to load; the compute warpgroups write zeros
          mbar_arrive(%s);
          continue;
        }`, x.qBuffer().full)
	x.wsTileLoads("        ", "kv0")
	x.raw(`        kv0 += T;
      }
`)
	if x.v.persistentDynamic() {
		x.raw(`      // the last CTA to finish resets the counter for the next launch on this stream (every CTA has
      // taken its last index before it counts itself done)
      __threadfence();
      if (atomicAdd(sched_next + 1, 1u) == gridDim.x - 1) {
        sched_next[0] = 0u;
        sched_next[1] = 0u;
        __threadfence();
      }
`)
	}
	x.keepPersistent()
	x.raw(`    }
    return;
  }
`)
	if inc {
		x.raw("  setmaxnreg_inc<COMPUTE_REGS>();  // ---- compute warpgroups, with the producer's registers\n")
	} else {
		x.raw("  // ---- compute warpgroup (it starts with the largest budget already: no setmaxnreg)\n")
	}
	x.raw(`  int kv0 = 0, q_it = 0;  // K/V tiles consumed so far, tiles taken so far (as the producer counts them)
  // the end of a tile with no key (a tile with keys releases Q after its last S): this thread is done
  // with Q and the tile's index, which it read itself: it arrives on its own (one arrival a warp after
  // __syncwarp would order the other lanes' reads before the producer's next write only through the
  // warp barrier, an order compute-sanitizer's racecheck does not follow)
  auto tile_done = [&] {
    mbar_arrive(` + x.qBuffer().empty + `);
    ++q_it;
  };
`)
	x.pingPongStart(true)
	x.raw("  for (;;) {\n")
	if x.v.DoubleQ {
		x.raw(`    const int qb = q_it & 1;  // the tile's Q buffer, its index in sched[qb]
    const u32 sQt = sQ + qb * Q_STAGE;
    mbar_wait(barQ + QFULL_STEP * qb, (q_it >> 1) & 1);  // the tile's index, and its Q unless it has no key
    const int tile = sched[qb];
    if (tile >= ntiles) break;
`)
		return
	}
	x.raw(`    mbar_wait(barQ, q_it & 1);  // the tile's index, and its Q unless it has no key
    const int tile = *sched;
    if (tile >= ntiles) break;
`)
}

// qNames are the names of a persistent tile's Q buffer, its full and empty
// barriers and its index's shared word, and that word's comment.
type qNames struct{ buf, full, empty, slot, slotNote string }

// qBuffer returns the names of a tile's Q buffer: with DoubleQ those of
// buffer q_it & 1 (sQt, barQt, emptyQ + QEMPTY_STEP·(q_it & 1), sched[qb]; the
// producer and the compute warps each declare sQt and qb for the tile),
// else the one buffer's.
func (x *gen) qBuffer() qNames {
	if x.v.DoubleQ {
		return qNames{"sQt", "barQt", "emptyQ + QEMPTY_STEP * (q_it & 1)", "sched[qb]", "sched[b]: the tile of Q buffer b"}
	}
	return qNames{"sQ", "barQ", "emptyQ", "*sched", "the tile of Q's buffer"}
}

// persistentTileRange returns the statements with which a persistent
// producer starts a tile from its index tile: its coordinates
// (tileCoords), query rows and key blocks (maskRange), each line after
// indent. The loading thread and the keep warps both take them.
func (x *gen) persistentTileRange(indent string) string {
	y := &gen{v: x.v, g: x.g}
	y.maskRange()
	return x.tileCoords(indent) + indentLines(`const int n = p.n, m = p.m;
const int m0 = mblk * BM, rows = min(BM, n - m0);
(void)rows;
`, indent) + indentLines(y.b.String(), indent[2:]) // (maskRange indents for the kernel's body: two spaces)
}

// wsPersistentWaits writes a persistent compute warp's wait for its tile's
// first K (Q's barrier was waited for at the top of the tile).
func (x *gen) wsPersistentWaits() {
	x.raw("  mbar_wait(barK + 8 * (kv0 & 1), (kv0 >> 1) & 1);  // K of its first block\n")
}

// releaseQ writes, in a persistent kernel, the release of the tile's Q
// buffer (and index) once its last S is done (last: the condition that the
// S just waited for was the tile's last): each compute thread arrives on
// the buffer's empty barrier, so the producer loads the next tile's Q while
// this one's last P·V and epilogue run.
func (x *gen) releaseQ(indent, last string) {
	if !x.v.Persistent {
		return
	}
	x.raw(fmt.Sprintf("%sif (%s) mbar_arrive(%s);  // the tile's last S is done: Q's buffer may take the next tile's\n", indent, last, x.qBuffer().empty))
}

// wsTileDone writes the end of a persistent tile's main loop: the counters
// moved on (Q was released after the tile's last S, releaseQ).
func (x *gen) wsTileDone() {
	x.raw(`  kv0 += nb_hi - nb_lo;
  ++q_it;
`)
}
