package kernels

import (
	"fmt"
	"strings"
)

// The backward's non-finite fix-up (see bwd_nan.go): the main kernels only
// raise a flag; this kernel, launched after them, does the rest.

const (
	// BwdNonFiniteKernel recomputes, when a main kernel raised the
	// non-finite flag, every dK/dV row and dQ row that holds a NaN or an
	// infinity, and rewrites the dBias scratch of those keys' pairs; with
	// the flag clear it returns at once. It runs after the dQ kernel (or the
	// convert kernel) and before BwdDBiasKernel: grid (BwdNonFiniteBlocks,
	// 1, 1), BwdNonFiniteThreads threads.
	BwdNonFiniteKernel = "fa_bwd_nonfinite"
	// BwdNonFiniteThreads is the block size of BwdNonFiniteKernel.
	BwdNonFiniteThreads = 256
	// BwdNonFiniteFlagBytes is the workspace the flag takes: two 32-bit
	// words (the flag, the fix-up's done counter), padded to 16 bytes.
	BwdNonFiniteFlagBytes = 16

	bwdNFKeys = 64 // keys of one fix-up work item
	bwdNFRows = 64 // query rows of one fix-up work item
)

// BwdNonFiniteBlocks returns the fix-up kernel's grid for a call of b
// batch elements (segments) of at most n query and m key rows, h query and
// hkv key heads, on a device of sms multiprocessors: one block per work
// item (a key tile of a key head, a row tile of a query head) up to sms
// blocks, which then stride over the items.
func BwdNonFiniteBlocks(b, n, m, h, hkv, sms int) int {
	items := b * (hkv*((m+bwdNFKeys-1)/bwdNFKeys) + h*((n+bwdNFRows-1)/bwdNFRows))
	return max(1, min(items, sms))
}

// nfRaise returns the statement that raises the non-finite flag when the
// block's vote (cond, evaluated by every thread: it holds the barrier) is
// positive: one thread's atomicOr.
func nfRaise(cond string) string {
	return fmt.Sprintf("    if (%s && threadIdx.x == 0) atomicOr(p.nf_flag, 1u);  // the fix-up kernel recomputes (%s)\n", cond, BwdNonFiniteKernel)
}

// nfZeroFlags writes the preprocess's zeroing of the flag and the done
// counter, and for a persistent dK/dV kernel its tile counter, the slot's
// third word (by its first block: the preprocess runs before every kernel
// that reads or raises them, so a caller's workspace needs no clearing).
func nfZeroFlags(b *strings.Builder, v BwdVariant) {
	words, what := 2, "non-finite flag, done counter"
	if v.Persistent {
		words, what = 3, what+", the dK/dV kernel's tile counter"
	}
	fmt.Fprintf(b, "  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x < %d) p.nf_flag[threadIdx.x] = 0u;  // %s\n", words, what)
}

// nfFixupKernel writes BwdNonFiniteKernel: with the flag clear it returns
// at once; else its blocks stride over the work items, first the key
// tiles (nf_keys: each key whose dK or dV row holds a NaN or an infinity,
// with its pairs' dBias scratch), then the query row tiles (nf_query: each
// row whose dQ holds one), and the last block to finish clears the flag
// and the counter for the next call on the stream.
func (g *bwdGen) nfFixupKernel(b *strings.Builder) {
	seg := ""
	if g.v.Varlen {
		seg = "    qr0 = p.cuq[b]; n = p.cuq[b + 1] - p.cuq[b]; kr0 = p.cuk[b]; m = p.cuk[b + 1] - p.cuk[b];  // the segment\n"
	}
	fmt.Fprintf(b, `// Non-finite fix-up (rare work; see bwd_nan.go): after the dK/dV kernel and the dQ (or convert) kernel, before
// the dBias reduction. Flag clear: return. Flag set: the work items, blocks striding over them: key tiles
// [KT keys of key head kvh, batch element b] (nf_keys), then query row tiles [QT rows of head h] (each row's
// dQ checked, nf_query where it holds a NaN or an infinity); the last block to finish clears the flag.
// grid (at most one block per item), %[1]d threads.
extern "C" __global__ void __launch_bounds__(%[1]d) %[2]s(const BwdParams p) {
  if (*(volatile unsigned*)p.nf_flag == 0u) return;  // no main kernel saw a NaN or an infinity
  constexpr int KT = %[3]d, QT = %[4]d, NW = %[1]d / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kt = (p.M + KT - 1) / KT, qt = (p.N + QT - 1) / QT;  // tiles per (batch element, head)
  const long long nk = (long long)kt * p.Hkv * p.B, nq = (long long)qt * p.H * p.B;
  for (long long t = blockIdx.x; t < nk + nq; t += gridDim.x) {  // (uniform over the block)
    const bool keys = t < nk;
    const long long u = keys ? t : t - nk;
    const int tiles = keys ? kt : qt, heads = keys ? p.Hkv : p.H;
    const int tile = (int)(u %% tiles), hd = (int)((u / tiles) %% heads), b = (int)(u / ((long long)tiles * heads));
    int n = p.N, m = p.M;
    long long qr0 = 0, kr0 = 0;
%[5]s    if (keys) {  // ---- dK, dV of keys j0 .. j0 + KT - 1 (key head hd)
      const int j0 = tile * KT;
      if (j0 < m) nf_keys(p, b, hd, qr0, kr0, n, m, j0, min(KT, m - j0), warp, NW, lane);
      continue;
    }
    // ---- dQ of query rows i0 .. i0 + QT - 1 (head hd): a warp a row
    const int i0 = tile * QT;
    for (int r = warp; r < QT && i0 + r < n; r += NW) {  // (uniform over the warp)
      const T* dq = p.dq + b * p.dq_sb + (qr0 + i0 + r) * p.dq_sr + hd * p.dq_sh;
      bool bad = false;
      for (int d = lane; d < %[6]d; d += 32) bad |= nf_bad(t_to_f(dq[d]));
      if (__ballot_sync(0xffffffffu, bad) != 0u) nf_query(p, b, hd, qr0, kr0, n, m, i0 + r, lane);
    }
  }
  // ---- the last block to finish clears the flag and the counter (the next call on the stream starts from 0)
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(p.nf_flag + 1, 1u) == gridDim.x - 1) {
      p.nf_flag[0] = 0u;
      p.nf_flag[1] = 0u;
      __threadfence();
    }
  }
}

`, BwdNonFiniteThreads, BwdNonFiniteKernel, bwdNFKeys, bwdNFRows, seg, g.v.DK)
}
