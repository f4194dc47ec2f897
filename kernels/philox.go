package kernels

// philoxFunc is the device function philox4, Philox4x32-10 as package
// philox defines it: counter (c0, c1, c2, c3), key (k0, k1), ten rounds,
// the four output words in x, y, z, w. Both generators draw the dropout
// keep mask from it: key = (lo32(seed), hi32(seed)), counter =
// (j >> 2, i, b·H + h, offset), and key j of query row i is kept when word
// j & 3 of the block is below the threshold. It needs cTypes.
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
