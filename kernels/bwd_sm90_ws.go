package kernels

import (
	"fmt"
	"strings"
)

// The warp-specialized pipeline of the Hopper backward kernels
// (BwdVariant.WarpSpecialized, sm_90a, tensor-map loads): the dK/dV kernel
// first, the dQ kernel's differences at the end.
//
// The dK/dV kernel's block has a third warpgroup, the producer: threads NCOMPUTE ..
// NCOMPUTE + 127, after the two compute warpgroups, which keep the
// indices, warps and key shares of the lockstep kernel. The producer
// lowers its register budget (setmaxnreg) and the compute warpgroups raise
// theirs with what it gave back. The producer's first warp loads, for every
// step it (query head and query block) into stage it mod 2:
//
//	q and dO    by the tensor memory accelerator (lane 0, which also
//	            announces their bytes on the stage's full barrier)
//	LSE2, Delta by the warp's 32 lanes (plain loads; rows past the
//	            sequence get +inf and 0: no probability)
//
// and every lane then arrives on the stage's full barrier (count 32), so
// that the phase completes once the statistics are stored and the tiles'
// bytes have landed. Before refilling a stage it waits for that stage's
// empty barrier, on which each compute thread arrives once it is done with
// the stage (count: the compute threads, which read LSE2 and Delta
// themselves; the dQ kernel's stages, read only by warpgroup products, are
// released by one lane a warp).
//
// A compute warpgroup's step waits for its stage's full barrier, computes
// S and dP, and after the wait for S — by which point its dV and dK
// products of the step before are complete too — releases the previous
// step's stage. There is no block-wide barrier in the loop.
//
// The P and dS tiles in shared memory are what the warps share within a
// step: a warpgroup's product reads the rows every one of its warps
// stored, and where the warpgroups read each other's tiles (the atomic dQ
// reads dS of all BN keys; past 128 columns both warpgroups' dV and dK
// read P and dS of all BN keys) the other warpgroup's too. One named
// barrier a step orders the stores before the products: 2 + w over
// warpgroup w's 128 threads where it reads only its own keys, 1 over the
// compute threads where not. The tiles have two buffers (step it uses
// buffer it mod 2) where shared memory allows: a warp stores step it + 1's
// tiles once it passed that barrier of step it, and the products of step
// it − 1 that read the same buffer were issued before every warp arrived
// there. With one buffer (the bulk dQ tile at 128 columns leaves no room)
// a second barrier before the stores of P waits until every warp that
// reads the tiles issued the products of the step before.
//
// The epilogue's meetings (the staged stores of odd head dims, the flat
// rows' zeroing) use named barrier 1 too, and the non-finite vote is per
// warp: the producer warpgroup has left.

// bwdWSBuffers returns the number of buffers of the shared P and dS tiles
// of v's Hopper dK/dV kernel: two for a warp-specialized kernel where
// shared memory allows them, else one.
func (v BwdVariant) bwdWSBuffers() int {
	if v.WarpSpecialized && v.bwdHopperLayoutBuffers(2).withSlack() <= MaxSharedBytes {
		return 2
	}
	return 1
}

// bwdWSSharedStep reports whether the compute warpgroups of v's
// warp-specialized dK/dV kernel read each other's P or dS tiles (and meet
// on named barrier 1 every step) rather than only their own.
func (v BwdVariant) bwdWSSharedStep() bool {
	return v.bwdHopperWide() || v.AtomicDQ
}

// wsBwdConstants writes, for a warp-specialized kernel (g.ws), the
// compile-time constants of its pipeline; the dK/dV kernel's (dkdv) also
// the distance between its P and dS buffers.
func (g *bwdGen) wsBwdConstants(b *strings.Builder, dkdv bool) {
	v := g.v
	if !g.ws {
		return
	}
	regs, _ := wsComputeRegs(256)
	fmt.Fprintf(b, `  constexpr int NCOMPUTE = 256;  // compute threads (two warpgroups); the producer warpgroup is threads 256..383
  constexpr int PRODUCER_REGS = %d, COMPUTE_REGS = %d;  // register budgets after setmaxnreg
`, wsProducerRegs, regs)
	if dkdv {
		t := v.bwdHopperTile()
		tile := t.BlockN / 64 * t.BlockM * 128
		fmt.Fprintf(b, "  constexpr int PS_BUF = %d;  // bytes from buffer 0 of the P and dS tiles to buffer 1 (0: one buffer)\n", (v.bwdWSBuffers()-1)*tile)
	}
}

// wsBwdBarriers writes the full and empty mbarriers of the two stages and
// their initialization (in place of tmaBarriers), ending with the kernel's
// only block-wide barrier. The full barriers take fullCount arrivals (what:
// whose, and what lands) and the tiles' bytes, the empty ones emptyCount
// (an expression: every compute thread, where the threads read the stage
// themselves, or one lane a warp, where only warpgroup products read it).
func (g *bwdGen) wsBwdBarriers(b *strings.Builder, l bwdSmemLayout, fullCount int, emptyCount, what string) {
	fmt.Fprintf(b, `  // ---- mbarriers of stage s: full (bar + 8s: %[3]s) and empty (empty + 8s: the compute threads are
  // done with the stage, %[5]s arrivals); the k-th fill of stage s completes phase k of its full barrier,
  // the k-th release phase k of its empty one
  const u32 bar = s0 + %[1]d, empty = s0 + %[2]d;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      mbar_init(bar + 8 * s, %[4]d);
      mbar_init(empty + 8 * s, %[5]s);
    }
%[6]s    mbar_fence_init();
  }
  __syncthreads();  // the only block-wide barrier: the producer warpgroup leaves the compute threads after it
`, l.off["bar"], l.off["empty"], what, fullCount, emptyCount, kvBarriersInit(l))
}

// kvBarriersInit returns the initialization of a persistent dK/dV
// kernel's K and V barriers (a layout with kvbar): full on the producer's
// one arrival and the tiles' bytes, empty on every compute thread's.
func kvBarriersInit(l bwdSmemLayout) string {
	off, ok := l.off["kvbar"]
	if !ok {
		return ""
	}
	return fmt.Sprintf("    mbar_init(s0 + %d, 1);  // kvbar\n    mbar_init(s0 + %d, NCOMPUTE);  // kvempty\n", off, off+8)
}

// wsBwdProducer writes the producer warpgroup's branch: setmaxnreg, and
// its first warp's loads of every step (see above); the compute
// warpgroups go on after it with their register budget raised.
func (g *bwdGen) wsBwdProducer(b *strings.Builder) {
	v := g.v
	fmt.Fprintf(b, `  if (tid >= NCOMPUTE) {  // ---- producer warpgroup
    setmaxnreg_dec<PRODUCER_REGS>();
    if (warp == NCOMPUTE / 32) {  // its first warp loads every step's q, dO, LSE2 and Delta
      constexpr int QA = %[1]d, DA = %[2]d;  // 64-column atoms of q and dO loaded (the rest are never read)
`, swizzleAtoms(v.DKPad()), swizzleAtoms(v.DVPad()))
	steps := fmt.Sprintf(`%[2]s        const int s = it & 1;
        if (it >= 2) mbar_wait(empty + 8 * s, ((it >> 1) - 1) & 1);  // step it - 2 released the stage
        const long long so = b * p.stat_sb + hq * p.stat_sh + qr0 + iq;
        for (int r = lane; r < BM; r += 32) {  // rows past the sequence: no probability
          const bool in = r < n - iq;
          sL[s * BM + r] = in ? p.lse2[so + r] : FA_INF;
          sD[s * BM + r] = in ? p.delta[so + r] : 0.f;
        }
        if (lane == 0) {  // its arrival announces the tiles' bytes; rows past the sequence come as zeros
%[1]s        } else {
          mbar_arrive(bar + 8 * s);  // this lane's LSE2 and Delta rows are stored
        }
      }
`, g.qStageTMA("          "), stepLoop("      ", "hq", "iq", g.firstStep()))
	if v.Persistent {
		steps = g.persistentProducer(steps)
	}
	b.WriteString(steps + g.bwdKeepProducer() + `    }
    return;
  }
  setmaxnreg_inc<COMPUTE_REGS>();  // ---- compute warpgroups, with the producer's registers
`)
}

// computeSync returns the statement with which the dK/dV kernel's compute
// threads meet: the block barrier, or with a producer warpgroup named
// barrier 1 over the compute threads (g.ws: while the dK/dV kernel of a
// warp-specialized variant is written; the dQ kernel has no producer).
func (g *bwdGen) computeSync() string {
	if g.ws {
		return "bar_sync(1, NCOMPUTE);"
	}
	return "__syncthreads();"
}

// wsBwdStepStart writes, for a warp-specialized kernel, the wait for step
// it's stage and this step's P and dS buffers (sPb, sdSb; pso their byte
// offset from buffer 0).
func (g *bwdGen) wsBwdStepStart(b *strings.Builder) {
	b.WriteString(`    mbar_wait(bar + 8 * st, (it >> 1) & 1);  // q, dO, LSE2 and Delta of step it (the producer's)
    const u32 pso = st * PS_BUF;  // this step's P and dS buffers
    T* const sPb = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(sP) + pso);
    T* const sdSb = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(sdS) + pso);
`)
}

// wsBwdRelease writes, for a warp-specialized kernel, each compute
// thread's release of the previous step's stage, once its S wait has also
// retired that step's dV and dK products (the last readers of the stage's q
// and dO; its LSE2 and Delta it read during that step), and with one
// buffer of P and dS the barrier before their stores. Every thread arrives
// (the empty barriers count NCOMPUTE): with one arrival a warp after
// __syncwarp the other lanes' reads of LSE2 and Delta would be ordered
// before the producer's next stores only through the warp barrier, which
// compute-sanitizer's racecheck does not follow (TestMbarrierHandoff).
func (g *bwdGen) wsBwdRelease(b *strings.Builder) {
	if !g.ws {
		return
	}
	fmt.Fprintf(b, "    if (it > %s) mbar_arrive(empty + 8 * (st ^ 1));  // dV and dK of step it - 1 are complete: this thread is done with its stage\n", g.firstStep())
	if g.v.bwdWSBuffers() == 1 {
		b.WriteString(g.keyRowsDBiasStoreWait(1) + "    " + g.wsStepSync("every warp that reads P and dS issued the products of step it - 1 (one buffer)") + "\n")
	}
}

// pdsSync returns the barrier between the stores of P and dS and the
// products that read them: the block barrier, or in a warp-specialized
// kernel the warps' named barrier (wsStepSync).
func (g *bwdGen) pdsSync() string {
	if !g.ws {
		return "__syncthreads();  // P and dS of all BN keys in shared memory"
	}
	return g.wsStepSync("P and dS in shared memory for the products that read them")
}

// wsStepSync returns the named barrier of the warps that share P and dS
// in a warp-specialized kernel (what: the comment): 1 over the compute
// threads where the warpgroups read each other's tiles, else 2 + w over
// warpgroup w.
func (g *bwdGen) wsStepSync(what string) string {
	if g.v.bwdWSSharedStep() {
		return "bar_sync(1, NCOMPUTE);  // " + what
	}
	return "bar_sync(2 + wg, 128);  // " + what
}

// psBuf returns what a descriptor of the P or dS tile adds for this step's
// buffer: nothing with one buffer.
func (g *bwdGen) psBuf() string {
	if !g.ws || g.v.bwdWSBuffers() == 1 {
		return ""
	}
	return " + (u64)(pso >> 4)"
}

// The warp-specialized dQ kernel (the separate algorithm) has the same
// producer warpgroup: its first thread loads every step's k and v (tensor
// maps) into stage it mod 2, announcing their bytes on the stage's full
// barrier (count 1), after waiting for the stage's release. The compute
// warpgroups load q, dO, LSE2 and Delta once, and each then runs on its own
// 64 rows: dS stays in registers, so nothing a warpgroup writes in the loop
// is read by another, and no barrier is left in it. Each compute warp
// releases step it's stage once its dQ product of step it, the last
// reader of k, is complete (the dP wait retired the reads of v).

// wsDQProducer writes the warp-specialized dQ kernel's producer branch:
// setmaxnreg, and its first thread's loads of every step's k and v; the
// compute warpgroups go on after it with their register budget raised.
func (g *bwdGen) wsDQProducer(b *strings.Builder) {
	fmt.Fprintf(b, `  if (tid >= NCOMPUTE) {  // ---- producer warpgroup
    setmaxnreg_dec<PRODUCER_REGS>();
    if (tid == NCOMPUTE) {  // its first thread loads every step's k and v
      for (int it = 0; it < njb; ++it) {
        const int s = it & 1, jk = (jb0 + it) * BN;
        if (it >= 2) mbar_wait(empty + 8 * s, ((it >> 1) - 1) & 1);  // step it - 2 released the stage
        // rows past the sequence come as zeros
%[1]s      }
    }
    return;
  }
  setmaxnreg_inc<COMPUTE_REGS>();  // ---- compute warpgroups, with the producer's registers
`, g.kvStageTMA("        "))
}
