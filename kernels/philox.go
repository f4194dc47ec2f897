package kernels

import "fmt"

// philoxFunc is the device function philox4, Philox4x32-10 as package
// philox defines it: counter (c0, c1, c2, c3), key (k0, k1), ten rounds,
// the four output words in x, y, z, w. It needs cTypes.
const philoxFunc = `// Philox4x32-10 (Salmon et al., SC 2011; package philox): counter (c0..c3), key (k0, k1).
DEV uint4 philox4(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}
`

// DropoutSource is the device code of the dropout keep mask: philox4 and
// dropMaskFuncs. It needs the types u32 and uint4 and the macro DEV.
const DropoutSource = philoxFunc + dropMaskFuncs

// dropMaskFuncs holds the device functions that draw the dropout keep mask
// of package philox (whose doc comment is the mapping's definition): for
// element (b, h, i, j) the 8-bit number u is byte j & 15, little-endian, of
// philox4(j >> 4, i, b·H + h, offset; seed_lo, seed_hi), and the element is
// kept when u < T (drop_threshold, round(256·(1 − p)), 1 … 255), a kept
// probability scaled by 256/T (drop_scale). Both generators write it (in
// DropoutSource) under dropout; the forward's apply_dropout
// (fwd_dropout.go) and the backward's probs (bwd_source.go) take a warp's
// keep bits from drop_bits, the non-finite fix-ups one element's u from
// drop_u8.
//
// drop_bits serves the mma C layout that every kernel's S fragment has
// (but the key-rows backward step's, transposed: dropBitsKeyRowsFunc):
// lane (g, c) = (lane / 4, lane % 4) holds rows g and g + 8 of each 16-row
// tile and keys 2c, 2c + 1 of each 8-key tile. One Philox call yields the
// sixteen numbers of one row and one 16-key block, of which a lane holds
// four (keys 2c, 2c + 1 of both 8-key halves); the four lanes of quad g
// hold all sixteen of rows g and g + 8. A unit, one row tile by one
// 16-key block, takes 16 calls, and a lane holds 8 of its elements. The
// arrangements considered:
//
//   - each lane drawing the calls of its own rows: 2 calls per unit for 8
//     elements, a call per 4 elements, as many calls as the old mapping of
//     a 32-bit word per key (no gain);
//   - one call per row and block, drawn once and shared through the quad:
//     16 calls per unit, half a call per lane, 16 elements per call, every
//     number drawn used once, the fewest possible.
//
// drop_bits does the second with every lane busy: it takes the units two
// at a time, and lane (g, c) draws row g + 8·(c & 1) of unit 2q + (c >> 1)
// — the quad draws exactly the four calls its own lanes need — and three
// xor-shuffles inside the quad hand each lane the four bytes it holds of
// the other three (the sender packs them with one byte_perm). That is one
// call per lane per 16 of its elements: a quarter of the forward's calls
// before (one per lane per 8-key tile) and an eighth of the backward's
// (one per lane, row and 8-key tile). A last unit without a partner is
// drawn by both halves of the quad (half of that step's calls wasted). The
// warp's first key j0 is a multiple of 8; A = j0 mod 16 (0 or 8) is a
// template argument, known where the tiling keeps every warp's keys
// 16-aligned (drop_bits_any branches on it otherwise, warp-uniformly).
//
// drop_keep4 compares four numbers with T at once in two 16-bit lanes:
// u + (256 − T) carries into bit 8 of its lane exactly when u ≥ T.
const dropMaskFuncs = `// ---- dropout keep mask (package philox; kernels/philox.go): u = byte j & 15 of philox4(j >> 4, i, b·H + h,
// offset; seed), kept when u < T (drop_threshold), kept probabilities scaled by 256/T (drop_scale)
// drop_u8: u of key j of query row i (bh = b·H + h); one call per element, for the scalar fix-ups.
DEV u32 drop_u8(u32 i, u32 j, u32 bh, u32 off, u32 k0, u32 k1) {
  const uint4 w = philox4(j >> 4, i, bh, off, k0, k1);
  const u32 x = (j & 8) ? ((j & 4) ? w.w : w.z) : ((j & 4) ? w.y : w.x);  // word (j >> 2) & 3
  return (x >> (8 * (j & 3))) & 0xffu;                                     // byte j & 3
}
// drop_keep4: the keep bits (u < t) of the four numbers in the bytes of v, byte 0, 1 at bits 0, 1 and
// byte 2, 3 at bits 4, 5; t in 0..256. Bytes 0, 2 and bytes 1, 3 in 16-bit lanes: u + 256 - t reaches
// bit 8 of its lane exactly when u >= t.
DEV u32 drop_keep4(u32 v, u32 t) {
  const u32 add = (256u - t) * 0x00010001u;
  const u32 even = (v & 0x00ff00ffu) + add;         // bytes 0, 2: dropped at bits 8, 24
  const u32 odd = ((v >> 8) & 0x00ff00ffu) + add;   // bytes 1, 3: dropped at bits 8, 24
  const u32 keep = ~(((even >> 8) & 0x00010001u) | ((odd >> 7) & 0x00020002u)) & 0x00030003u;  // bits 0, 1, 16, 17
  return (keep | (keep >> 12)) & 0x33u;
}
// drop_bits: the keep bits of one warp's fragment of S in the mma C layout, MT row tiles of 16 rows
// (rows i0 + 16·mt + g, + 8) by NT key tiles of 8 (keys j0 + 8·nt + 2c, + 1), j0 = A mod 16 (A = 0, 8);
// bh = b·H + h. Bit 4·(nt % 8) + e of bits[mt][nt / 8] keeps element e of tile (mt, nt) of this lane
// (e = 0, 1: row g, keys 2c, 2c + 1; e = 2, 3: row g + 8). Units (row tile mt, 16-key block kb) in
// order u = mt·NB + kb, two per step: lane (g, c) draws row g + 8·(c & 1) of unit 2q + (c >> 1), the
// quad's four calls, and in round k sends lane d = c ^ k the four bytes d holds of its call (keys
// 2d, 2d + 1 of the block's two 8-key halves), receiving those of lane c ^ k's call. All lanes of
// the warp take part.
template <int MT, int NT, int A>
DEV void drop_bits(u32 (&bits)[MT][(NT + 7) / 8], u32 i0, u32 j0, u32 bh, u32 off, u32 k0, u32 k1, u32 t, int lane) {
  constexpr int NB = (A + 8 * NT + 15) / 16;  // 16-key blocks the warp's keys touch
  constexpr int U = MT * NB;                  // units
  const int g = lane >> 2, c = lane & 3;
  const u32 kb0 = (j0 - A) >> 4;              // the first block
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int x = 0; x < (NT + 7) / 8; ++x) bits[mt][x] = 0u;
#pragma unroll
  for (int q = 0; q < (U + 1) / 2; ++q) {
    const int ua = 2 * q, ub = 2 * q + 1 < U ? 2 * q + 1 : 2 * q;  // the step's units (a lone last one twice)
    const int kb = (c >> 1) ? ub % NB : ua % NB, mt = (c >> 1) ? ub / NB : ua / NB;  // this lane's: unit 2q + (c >> 1)
    const uint4 w = philox4(kb0 + (u32)kb, i0 + (u32)(16 * mt + g + 8 * (c & 1)), bh, off, k0, k1);
    u32 pair = 0u;  // keep bits of units 2q (bits 0..7) and 2q + 1 (8..15): bit 8·unit + 4·half + 2·(row g + 8) + key
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int d = c ^ k;  // the lane this one sends to in round k, and the one it receives from
      const u32 lo = (d & 2) ? w.y : w.x, hi = (d & 2) ? w.w : w.z;         // words of keys 2d, 2d + 1 and 8 + 2d, 9 + 2d
      const u32 mine = __byte_perm(lo, hi, (d & 1) ? 0x7632u : 0x5410u);   // those four bytes, lane d's
      const u32 got = k == 0 ? mine : __shfl_xor_sync(0xffffffffu, mine, k);  // lane d's call, this lane's bytes
      pair |= drop_keep4(got, t) << (8 * (d >> 1) + 2 * (d & 1));          // unit 2q + (d >> 1), row g + 8·(d & 1)
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int us = 2 * q + s;
      if (us < U) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int nt = 2 * (us % NB) + half - A / 8;  // the key tile of this half of the block
          if (nt >= 0 && nt < NT) bits[us / NB][nt >> 3] |= ((pair >> (8 * s + 4 * half)) & 0xfu) << (4 * (nt & 7));
        }
      }
    }
  }
}
// drop_bits_any: drop_bits for a first key j0 that is 16-aligned in some warps and not in others.
template <int MT, int NT>
DEV void drop_bits_any(u32 (&bits)[MT][(NT + 7) / 8], u32 i0, u32 j0, u32 bh, u32 off, u32 k0, u32 k1, u32 t, int lane) {
  if (j0 & 8)
    drop_bits<MT, NT, 8>(bits, i0, j0, bh, off, k0, k1, t, lane);
  else
    drop_bits<MT, NT, 0>(bits, i0, j0, bh, off, k0, k1, t, lane);
}
`

// dropBitsKeyRowsFunc is the device function drop_bits_kr: the keep bits
// of a warp's fragment in the key-rows backward step (BwdVariant.KeyRows),
// whose S is transposed — lane (g, c) holds keys g and g + 8 of the warp's
// 16 (one Philox block) and queries 2c, 2c + 1 of each 8-query tile. One
// call still yields the sixteen numbers of one query and one 16-key block,
// but a lane now holds two of them (keys g and g + 8), and the eight lanes
// that share them sit in eight quads. So the warp draws each query's call
// once, lane L drawing query 32r + L of round r, and hands the keep bits
// out by votes: for each of the sixteen keys one __ballot_sync gives every
// lane that key's bits of the round's 32 queries, of which lane (g, c)
// keeps the words of keys g and g + 8. One call per lane per 16 of its
// elements, as drop_bits, and 16 votes per call instead of its shuffles.
const dropBitsKeyRowsFunc = `// drop_bits_kr: the keep bits of one warp's fragment in the key-rows step (keys as rows): keys 16·kb + g and
// + 8 (kb: the warp's 16-key block), queries q0 + 8·nt + 2c + e (e = 0, 1) for NT query tiles of 8; bh = b·H + h.
// Word bits[r][hh] holds the bits of key 16·kb + g + 8·hh for queries q0 + 32r .. q0 + 32r + 31, bit i for query
// q0 + 32r + i. In round r lane L draws query q0 + 32r + L's call, and one vote a key hands every lane that key's
// bits of the round's queries. All lanes of the warp take part.
template <int NT>
DEV void drop_bits_kr(u32 (&bits)[(NT + 3) / 4][2], u32 q0, u32 kb, u32 bh, u32 off, u32 k0, u32 k1, u32 t, int lane) {
  const int g = lane >> 2;
#pragma unroll
  for (int r = 0; r < (NT + 3) / 4; ++r) {
    const uint4 w = philox4(kb, q0 + 32u * (u32)r + (u32)lane, bh, off, k0, k1);
    u32 lo = 0u, hi = 0u;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const u32 wl = (j & 4) ? w.y : w.x, wh = (j & 4) ? w.w : w.z;  // the words of keys j and j + 8
      const u32 vl = __ballot_sync(0xffffffffu, ((wl >> (8 * (j & 3))) & 0xffu) < t);
      const u32 vh = __ballot_sync(0xffffffffu, ((wh >> (8 * (j & 3))) & 0xffu) < t);
      lo = g == j ? vl : lo;
      hi = g == j ? vh : hi;
    }
    bits[r][0] = lo;
    bits[r][1] = hi;
  }
}
`

// dropBitsCall returns the statement that fills the keep bits bits (an
// array u32 [mt][(nt + 7) / 8]) of a warp whose first row is i0 and first
// key j0: drop_bits with A = 0 when aligned (the tiling keeps every warp's
// first key 16-aligned), drop_bits_any otherwise. mt, nt, i0, j0, bh (the
// u32 b·H + h) and params (the kernel's parameters) are C++ expressions;
// the caller's scope has lane.
func dropBitsCall(bits, mt, nt string, aligned bool, i0, j0, bh, params string) string {
	fn := fmt.Sprintf("drop_bits_any<%s, %s>", mt, nt)
	if aligned {
		fn = fmt.Sprintf("drop_bits<%s, %s, 0>", mt, nt)
	}
	return fmt.Sprintf("%s(%s, (u32)(%s), (u32)(%s), %s, %[6]s.drop_offset, %[6]s.seed_lo, %[6]s.seed_hi, %[6]s.drop_threshold, lane);",
		fn, bits, i0, j0, bh, params)
}
