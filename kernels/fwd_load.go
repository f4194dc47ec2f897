package kernels

// loaders writes the shared tiles' addressing (a padded pitch, no swizzle)
// and the global → shared tile loaders.
//
// Shared tiles are rows of CH 16-byte chunks with a pitch of CH+1 chunks. An
// XOR swizzle (chunk c of row r at c ^ (r mod 8)) is also conflict free, but
// its lane-dependent XOR cannot be folded into ldmatrix's immediate offset:
// it needed four live address registers per operand pattern, which pushed the
// D=128 kernel (255 registers) into spills. The odd pitch keeps every
// address a per-lane register plus an immediate.
//
// Two loaders exist. With LoadBytes 16, 8 or 4, cp.async copies LB bytes per
// instruction straight into shared memory, zero-filling out-of-range rows
// and padding columns (src-size 0). With LoadBytes 2 (16-bit rows that are
// only 2-byte aligned, such as odd head dims), each thread loads element
// pairs into registers (ldg_tile) early and stores them (sts_tile) after a
// product has hidden the latency.
func (x *gen) loaders() {
	x.raw(`// ---- shared-memory tiles: rows of CH 16-byte chunks, padded to a pitch of CH+1 chunks.
// CH+1 is odd, so the 8 rows one ldmatrix phase reads (same chunk) sit in 8 distinct 16-byte
// bank groups: bank-conflict free for any padded head dim. Addresses are additive: a per-lane
// offset plus a compile-time immediate.
template <int CH> DEV constexpr u32 toff(int row, int chunk) { return (u32)((row * (CH + 1) + chunk) * 16); }
// lane roles of the two ldmatrix.x4 patterns: A-like (matrices 0-3 = rows 0-7|8-15 x chunk 0|1,
// also used for V with .trans) and B-like (K: rows 0-7 chunk 0|1, rows 8-15 chunk 0|1)
template <int CH> DEV u32 lane_a(int lane) { return toff<CH>(lane & 15, lane >> 4); }
template <int CH> DEV u32 lane_b(int lane) { return toff<CH>(((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1); }

`)
	if x.v.LoadBytes == 2 {
		x.regLoader()
		return
	}
	x.raw(`// ---- global -> shared: a [ROWS x CH·16 bytes] tile by cp.async, LB bytes per copy.
// src points at row 0 of the tile, stride is the row stride in bytes; rows >= valid and
// bytes >= dbytes of a row are zero-filled (the zero padding of the head dims and of the
// sequence end): such copies have src-size 0 and read nothing, whatever their address.
template <int ROWS, int CH>
DEV void load_tile(u32 dst, const char* src, i64 stride, int valid, int dbytes, int tid) {
  constexpr int PER_ROW = CH * 16 / LB;  // copies per row
  if constexpr (NTHREADS % PER_ROW == 0) {
    // each thread copies column bytes [cb, cb + LB) of rows r0, r0 + RSTEP, ...
    constexpr int RSTEP = NTHREADS / PER_ROW;
    constexpr int PASSES = (ROWS + RSTEP - 1) / RSTEP;
    const int r0 = tid / PER_ROW, cb = (tid % PER_ROW) * LB;
    const u32 d0 = dst + toff<CH>(r0, cb >> 4) + (cb & 15);
    const char* s = src + r0 * stride + cb;
    const i64 step = RSTEP * stride;
    if (cb >= dbytes) {  // padding columns only: zero-fill
#pragma unroll
      for (int it = 0; it < PASSES; ++it)
        if (ROWS % RSTEP == 0 || r0 + it * RSTEP < ROWS) cp_async(d0 + toff<CH>(it * RSTEP, 0), src, 0);
    } else if (valid >= ROWS) {  // a full tile: no row predicates
#pragma unroll
      for (int it = 0; it < PASSES; ++it) {
        if (ROWS % RSTEP == 0 || r0 + it * RSTEP < ROWS) cp_async(d0 + toff<CH>(it * RSTEP, 0), s, LB);
        s += step;
      }
    } else {  // the sequence end cuts the tile
#pragma unroll
      for (int it = 0; it < PASSES; ++it) {
        const int r = r0 + it * RSTEP;
        // src-size 0 zero-fills and reads nothing, whatever the address
        if (ROWS % RSTEP == 0 || r < ROWS) cp_async(d0 + toff<CH>(it * RSTEP, 0), s, r < valid ? LB : 0);
        s += step;
      }
    }
  } else {
    // rows do not split evenly over the threads: walk the copies of the tile
    constexpr int TOTAL = ROWS * PER_ROW;
#pragma unroll 8
    for (int it = 0; it < (TOTAL + NTHREADS - 1) / NTHREADS; ++it) {
      const int idx = tid + it * NTHREADS;
      if (TOTAL % NTHREADS == 0 || idx < TOTAL) {
        const int r = idx / PER_ROW, cb = (idx % PER_ROW) * LB;
        const bool ok = r < valid && cb < dbytes;
        cp_async(dst + toff<CH>(r, cb >> 4) + (cb & 15), src + r * stride + cb, ok ? LB : 0);
      }
    }
  }
}

`)
}

// qChunkRows is the number of Q rows the register-staged prologue moves at
// once (so that the staging registers hold no more than one K tile).
func (v Variant) qChunkRows() int {
	if v.BlockM%v.BlockN == 0 {
		return v.BlockN
	}
	return 16
}

// regLoader writes the register-staged loader used for 2-byte aligned rows.
func (x *gen) regLoader() {
	v, g := x.v, x.g
	regs := func(rows, ch int) int {
		pairs := rows * ch * 4
		return 2 * ((pairs + g.threads - 1) / g.threads)
	}
	n := max(regs(v.BlockN, g.kch), regs(v.BlockN, g.vch), regs(v.qChunkRows(), g.kch))
	x.p("// ---- global -> registers -> shared, for rows only 2-byte aligned: element pairs per thread")
	x.p("constexpr int STAGE_REGS = %d;  // 16-bit elements staged per thread (one 32-bit register each)", n)
	x.raw(`// load a [ROWS x CH·8 elements] tile into registers as element pairs; rows >= valid and
// columns >= d read as 0
template <int ROWS, int CH>
DEV void ldg_tile(u32 (&r)[STAGE_REGS], const char* src, i64 stride, int valid, int d, int tid) {
  constexpr int PER_ROW = CH * 4;  // element pairs per row
  constexpr int TOTAL = ROWS * PER_ROW;
  constexpr int N = (TOTAL + NTHREADS - 1) / NTHREADS;
  static_assert(2 * N <= STAGE_REGS, "staging registers");
#pragma unroll
  for (int it = 0; it < N; ++it) {
    const int idx = tid + it * NTHREADS;
    const int row = idx / PER_ROW, col = (idx % PER_ROW) * 2;
    const bool ok = (TOTAL % NTHREADS == 0 || idx < TOTAL) && row < valid;
    const u16* s = (const u16*)(src + row * stride) + col;
    r[2 * it] = ldg16(s, ok && col < d);
    r[2 * it + 1] = ldg16(s + 1, ok && col + 1 < d);
  }
}
// store the staged pairs into the shared tile
template <int ROWS, int CH>
DEV void sts_tile(u32 dst, const u32 (&r)[STAGE_REGS], int tid) {
  constexpr int PER_ROW = CH * 4;
  constexpr int TOTAL = ROWS * PER_ROW;
#pragma unroll
  for (int it = 0; it < (TOTAL + NTHREADS - 1) / NTHREADS; ++it) {
    const int idx = tid + it * NTHREADS;
    if (TOTAL % NTHREADS == 0 || idx < TOTAL) {
      const int row = idx / PER_ROW, cb = (idx % PER_ROW) * 4;
      sts32(dst + toff<CH>(row, cb >> 4) + (cb & 15), r[2 * it] | (r[2 * it + 1] << 16));
    }
  }
}

`)
}
