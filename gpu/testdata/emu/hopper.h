// The Hopper backward kernels' own primitives: the generator's second block
// of inline-PTX primitives (the one marked "(Hopper)") is replaced by this
// file and the product wrappers the test writes after it from
// kernels.BwdVariant.HopperProducts (see backward_emu_test.go). It relies on
// bwd.h (prims.h, emu_elem) included for the first block.
//
// A warpgroup product runs at once, when its thread issues it: each of the
// warpgroup's 128 threads computes its own accumulator elements from shared
// memory (and, for A from registers, from its warp's fragments). Commits,
// waits and fences are no-ops, so the emulator checks the products' operand
// addressing (descriptors, swizzle, fragment layouts), not their ordering.

// the kernels' dynamic shared memory under the name they declare it by
extern "C" unsigned char smem_raw[EMU_SMEM] __attribute__((alias("smem")));

inline void cp_async_sw(u32 dst, const void* src, u32 n) { emu_cp_async(dst, src, n, 16); }

inline u64 sw128_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3ffffu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}
inline void wgmma_fence() {}
inline void wgmma_commit() {}
template <int N> inline void wgmma_wait() {}
inline void fence_proxy_async() {}
inline void opaque(u64&) {}
template <int NT> inline void fence_acc(float (&)[NT][4]) {}

// A shared-memory matrix descriptor: start address, leading and stride byte
// offsets; only the 128-byte swizzle is emulated.
struct EmuDesc {
  unsigned start, lbo, sbo;
};
inline EmuDesc emu_desc(u64 d) {
  if (((d >> 62) & 3) != 1) emu_fail("wgmma: descriptor without the 128-byte swizzle");
  return {(unsigned)(d & 0x3fff) << 4, (unsigned)((d >> 16) & 0x3fff) << 4, (unsigned)((d >> 32) & 0x3fff) << 4};
}

// emu_operand returns element (mn, k) of an operand through its descriptor:
// K-major, rows of 128 bytes (k contiguous), 8-row groups sbo apart;
// MN-major, 8-row (k) groups sbo apart of 64-element atoms (mn contiguous)
// lbo apart. The 128-byte swizzle moves 16-byte chunk c of the 128-byte
// row at address bits 7-9 to chunk c ^ row.
inline float emu_operand(const EmuDesc& d, bool mnMajor, int mn, int k) {
  unsigned a = mnMajor ? d.start + (unsigned)(mn / 64) * d.lbo + (unsigned)(k / 8) * d.sbo + (k % 8) * 128u + (mn % 64) * 2u
                       : d.start + (unsigned)(mn / 8) * d.sbo + (mn % 8) * 128u + k * 2u;
  a ^= ((a >> 7) & 7u) << 4;
  return emu_elem(emu_lds16(a));
}

// emu_wg_elem gives accumulator element e of 8-column block j of this
// thread: row m of the warpgroup's 64, column n.
inline void emu_wg_elem(int j, int e, int& m, int& n) {
  const int t = (int)(threadIdx.x % 128), l = t % 32;
  m = 16 * (t / 32) + l / 4 + 8 * (e / 2);
  n = 8 * j + 2 * (l % 4) + (e % 2);
}

// D[64xN] (+)= A[64x16]·B[16xN], both operands through descriptors (TA: A
// M-major, TB: B N-major); acc = 0 overwrites D.
template <int N, bool TA, bool TB>
inline void emu_wgmma_ss(float* d, u64 da, u64 db, int acc) {
  const EmuDesc A = emu_desc(da), B = emu_desc(db);
  for (int j = 0; j < N / 8; ++j)
    for (int e = 0; e < 4; ++e) {
      int m, n;
      emu_wg_elem(j, e, m, n);
      float s = acc ? d[4 * j + e] : 0.f;
      for (int k = 0; k < 16; ++k) s += emu_operand(A, TA, m, k) * emu_operand(B, TB, n, k);
      d[4 * j + e] = s;
    }
}

// D[64xN] += A[64x16]·B[16xN], A from registers (each warp's 16 rows in
// the mma.sync A layout), B through a descriptor (TB: N-major).
template <int N, bool TB>
inline void emu_wgmma_rs(float* d, const u32 (&a)[4], u64 db) {
  EmuWarpX& x = emu_wx[emu_warp()];
  const int l = emu_lane();
  for (int i = 0; i < 4; ++i) x.u[l][i] = a[i];
  emu_warp_sync();
  float A[16][16];
  emu_frag_a16(A, x);
  emu_warp_sync();
  const EmuDesc B = emu_desc(db);
  for (int j = 0; j < N / 8; ++j)
    for (int e = 0; e < 4; ++e) {
      int m, n;
      emu_wg_elem(j, e, m, n);
      float s = d[4 * j + e];
      for (int k = 0; k < 16; ++k) s += A[m % 16][k] * emu_operand(B, TB, n, k);
      d[4 * j + e] = s;
    }
}
