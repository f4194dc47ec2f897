// Host emulation of the device primitives of the backward kernels (the
// block the generator brackets as inline-PTX primitives). T is defined by
// the generated source before this file is included.
#include <type_traits>

inline unsigned smem_u32(const void* p) {
  const long d = (const unsigned char*)p - smem;
  if (d < 0 || d >= (long)EMU_SMEM) emu_fail("shared address out of range");
  return (unsigned)d;
}
inline void cp_async16(void* dst, const void* src, int bytes) {
  const unsigned a = smem_u32(dst);
  if (a % 16 != 0 || a + 16 > EMU_SMEM) emu_fail("cp.async 16: misaligned or out of shared memory");
  if (bytes != 0 && bytes != 16) emu_fail("cp.async 16: bad src size");
  if (bytes != 0 && ((uintptr_t)src) % 16 != 0) emu_fail("cp.async 16: misaligned global source");
  memset(dst, 0, 16);
  if (bytes) memcpy(dst, src, 16);
}
inline void cp_async4(void* dst, const void* src) {
  const unsigned a = smem_u32(dst);
  if (a % 4 != 0 || ((uintptr_t)src) % 4 != 0) emu_fail("cp.async 4: misaligned");
  memcpy(dst, src, 4);
}
inline void cp_async_commit() {}
inline void cp_async_wait0() {}
inline float ex2f(float x) { return exp2f(x); }

inline uint32_t emu_lds32(unsigned a) {
  if (a % 4 != 0 || a + 4 > EMU_SMEM) emu_fail("shared 32-bit read misaligned or out of range");
  uint32_t v;
  memcpy(&v, smem + a, 4);
  return v;
}
inline uint32_t emu_lds16(unsigned a) {
  if (a % 2 != 0 || a + 2 > EMU_SMEM) emu_fail("shared 16-bit read misaligned or out of range");
  uint16_t v;
  memcpy(&v, smem + a, 2);
  return v;
}

// ldmatrix: lanes 8i..8i+7 give the row addresses of matrix i.
inline void emu_ldsm(unsigned* out, int nmat, bool trans, unsigned addr) {
  EmuWarpX& x = emu_wx[emu_warp()];
  const int l = emu_lane();
  x.addr[l] = addr;
  emu_warp_sync();
  for (int r = 0; r < nmat; ++r) {
    for (int q = 0; q < 8; ++q)
      if (x.addr[8 * r + q] % 16 != 0) emu_fail("ldmatrix row address not 16-byte aligned");
    if (!trans) {
      out[r] = emu_lds32(x.addr[8 * r + l / 4] + 4 * (l % 4));
    } else {
      const unsigned r0 = x.addr[8 * r + 2 * (l % 4)], r1 = x.addr[8 * r + 2 * (l % 4) + 1];
      out[r] = emu_lds16(r0 + 2 * (l / 4)) | (emu_lds16(r1 + 2 * (l / 4)) << 16);
    }
  }
  emu_warp_sync();
}
inline void ldsm_x4(unsigned (&r)[4], unsigned a) { emu_ldsm(r, 4, false, a); }
inline void ldsm_x4_t(unsigned (&r)[4], unsigned a) { emu_ldsm(r, 4, true, a); }
inline void ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned a) {
  unsigned r[4];
  emu_ldsm(r, 4, false, a);
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
inline void ldsm_x4_t(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned a) {
  unsigned r[4];
  emu_ldsm(r, 4, true, a);
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
inline void ldsm_x2(unsigned& r0, unsigned& r1, unsigned a) {
  unsigned r[2];
  emu_ldsm(r, 2, false, a);
  r0 = r[0], r1 = r[1];
}
inline void ldsm_x2_t(unsigned& r0, unsigned& r1, unsigned a) {
  unsigned r[2];
  emu_ldsm(r, 2, true, a);
  r0 = r[0], r1 = r[1];
}

inline float emu_elem(uint32_t h) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return emu_bf2f((uint16_t)h);
  else return emu_h2f((uint16_t)h);
}
inline uint32_t emu_pack(float a) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return emu_f2bf(a);
  else return emu_f2h(a);
}
inline unsigned pack2(float a, float b_) { return emu_pack(a) | (emu_pack(b_) << 16); }
inline void unpack2(unsigned x, float& a, float& b_) { a = emu_elem(x & 0xffff); b_ = emu_elem(x >> 16); }

// mma.sync m16n8k16, 16-bit inputs, fp32 accumulators.
inline void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  EmuWarpX& x = emu_wx[emu_warp()];
  const int l = emu_lane();
  for (int i = 0; i < 4; ++i) x.u[l][i] = a[i];
  x.u[l][4] = b0, x.u[l][5] = b1;
  emu_warp_sync();
  float A[16][16], B[16][8];
  for (int L = 0; L < 32; ++L) {
    const int g = L / 4, t = L % 4;
    const unsigned* u = x.u[L];
    A[g][2 * t] = emu_elem(u[0] & 0xffff), A[g][2 * t + 1] = emu_elem(u[0] >> 16);
    A[g + 8][2 * t] = emu_elem(u[1] & 0xffff), A[g + 8][2 * t + 1] = emu_elem(u[1] >> 16);
    A[g][2 * t + 8] = emu_elem(u[2] & 0xffff), A[g][2 * t + 9] = emu_elem(u[2] >> 16);
    A[g + 8][2 * t + 8] = emu_elem(u[3] & 0xffff), A[g + 8][2 * t + 9] = emu_elem(u[3] >> 16);
    B[2 * t][g] = emu_elem(u[4] & 0xffff), B[2 * t + 1][g] = emu_elem(u[4] >> 16);
    B[2 * t + 8][g] = emu_elem(u[5] & 0xffff), B[2 * t + 9][g] = emu_elem(u[5] >> 16);
  }
  const int g = l / 4, t = l % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i / 2) * 8, col = 2 * t + (i % 2);
    float s = c[i];
    for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
    c[i] = s;
  }
  emu_warp_sync();
}

// st_pair writes two adjacent elements of a shared-memory tile.
inline void st_pair(T* s, float a, float b_) {
  if (sizeof(T) == 4) {
    const float v[2] = {a, b_};
    memcpy(s, v, 8);
  } else {
    const unsigned v = pack2(a, b_);
    memcpy(s, &v, 4);
  }
}

// split-tf32 (fp32 variants)
inline unsigned emu_tf32(float x) {
  unsigned u = __float_as_uint(x);
  if ((u & 0x7f800000u) != 0x7f800000u) u += 0x1000u;
  return u & 0xffffe000u;
}
inline void tf32_split(float x, unsigned& hi, unsigned& lo) {
  hi = emu_tf32(x);
  lo = emu_tf32(x - __uint_as_float(hi));
}
inline void mma1688(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  EmuWarpX& x = emu_wx[emu_warp()];
  const int l = emu_lane();
  for (int i = 0; i < 4; ++i) x.u[l][i] = a[i];
  x.u[l][4] = b0, x.u[l][5] = b1;
  emu_warp_sync();
  float A[16][8], B[8][8];
  for (int L = 0; L < 32; ++L) {
    const int g = L / 4, t = L % 4;
    const unsigned* u = x.u[L];
    A[g][t] = __uint_as_float(u[0]), A[g + 8][t] = __uint_as_float(u[1]);
    A[g][t + 4] = __uint_as_float(u[2]), A[g + 8][t + 4] = __uint_as_float(u[3]);
    B[t][g] = __uint_as_float(u[4]), B[t + 4][g] = __uint_as_float(u[5]);
  }
  const int g = l / 4, t = l % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i / 2) * 8, col = 2 * t + (i % 2);
    float s = d[i];
    for (int k = 0; k < 8; ++k) s += A[row][k] * B[k][col];
    d[i] = s;
  }
  emu_warp_sync();
}
inline void mma_tf32x3(float (&d)[4], const unsigned (&ah)[4], const unsigned (&al)[4], unsigned bh0, unsigned bh1, unsigned bl0, unsigned bl1) {
  mma1688(d, al, bh0, bh1);
  mma1688(d, ah, bl0, bl1);
  mma1688(d, ah, bh0, bh1);
}
