// Host emulation of the forward kernels' device primitives: the block the
// generator brackets as inline-PTX primitives is replaced by this file (see
// fwd_emu_test.go). It relies on shim.h (fibers, barriers, shared memory)
// and on the generated constants (LB, DT) that precede the block.

inline u32 smem_addr(const void* p) {
  const long d = (const unsigned char*)p - smem;
  if (d < 0 || d >= (long)EMU_SMEM) emu_fail("shared address out of range");
  return (u32)d;
}
inline void emu_smem_check(u32 a, u32 n, const char* what) {
  if (a % n != 0 || a + n > EMU_SMEM) emu_fail(what);
}
inline void cp_commit() {}
template <int N> inline void cp_wait() {}
// cp.async completes at once here; src-size 0 zero-fills and reads nothing.
inline void cp_async(u32 dst, const void* src, u32 n) {
  emu_smem_check(dst, LB, "cp.async: shared destination misaligned or out of range");
  if (n != 0 && n != (u32)LB) emu_fail("cp.async: bad source size");
  if (n != 0 && ((uintptr_t)src) % LB != 0) emu_fail("cp.async: misaligned global source");
  memset(smem + dst, 0, LB);
  if (n) memcpy(smem + dst, src, LB);
}
inline u32 ldg16(const void* p, bool ok) {
  if (!ok) return 0;
  if (((uintptr_t)p) % 2 != 0) emu_fail("16-bit global load misaligned");
  u16 v;
  memcpy(&v, p, 2);
  return v;
}
inline void sts32(u32 a, u32 v) {
  emu_smem_check(a, 4, "st.shared.b32 misaligned or out of range");
  memcpy(smem + a, &v, 4);
}
inline void sts64(u32 a, float x, float y) {
  emu_smem_check(a, 8, "st.shared.v2.f32 misaligned or out of range");
  const float v[2] = {x, y};
  memcpy(smem + a, v, 8);
}
inline u32 lds32(u32 a) {
  emu_smem_check(a, 4, "ld.shared.b32 misaligned or out of range");
  u32 v;
  memcpy(&v, smem + a, 4);
  return v;
}
inline u32 emu_lds16(u32 a) {
  emu_smem_check(a, 2, "ld.shared.b16 misaligned or out of range");
  u16 v;
  memcpy(&v, smem + a, 2);
  return v;
}
inline float ex2(float x) { return exp2f(x); }
inline u32 ctaid_x() { return blockIdx.x; }
inline u32 ctaid_y() { return blockIdx.y; }
inline u32 ctaid_z() { return blockIdx.z; }
inline u32 tid_x() { return threadIdx.x; }
inline float bf16_to_f32(u16 h) { return emu_bf2f(h); }
inline float f16_to_f32(u16 h) { return emu_h2f(h); }

inline u32 __shfl_xor_sync(unsigned, u32 v, int m) {
  EmuWarpX& x = emu_wx[emu_warp()];
  x.u[emu_lane()][0] = v;
  emu_warp_sync();
  const u32 r = x.u[emu_lane() ^ m][0];
  emu_warp_sync();
  return r;
}

// ldmatrix: lanes 8i..8i+7 give the row addresses of matrix i.
inline void emu_ldsm(u32* out, bool trans, u32 addr) {
  EmuWarpX& x = emu_wx[emu_warp()];
  const int l = emu_lane();
  x.addr[l] = addr;
  emu_warp_sync();
  for (int r = 0; r < 4; ++r) {
    for (int q = 0; q < 8; ++q)
      if (x.addr[8 * r + q] % 16 != 0) emu_fail("ldmatrix row address not 16-byte aligned");
    if (!trans) {
      out[r] = lds32(x.addr[8 * r + l / 4] + 4 * (l % 4));
    } else {
      const u32 r0 = x.addr[8 * r + 2 * (l % 4)], r1 = x.addr[8 * r + 2 * (l % 4) + 1];
      out[r] = emu_lds16(r0 + 2 * (l / 4)) | (emu_lds16(r1 + 2 * (l / 4)) << 16);
    }
  }
  emu_warp_sync();
}
inline void ldsm4(u32 (&r)[4], u32 a) { emu_ldsm(r, false, a); }
inline void ldsm4t(u32 (&r)[4], u32 a) { emu_ldsm(r, true, a); }

// 16-bit element conversions of the variant's type (DT: 1 fp16, 2 bf16)
inline float emu_elem(u32 h) { return DT == 2 ? emu_bf2f((uint16_t)h) : emu_h2f((uint16_t)h); }
inline u32 emu_pack(float a) { return DT == 2 ? emu_f2bf(a) : emu_f2h(a); }
inline u32 pack2(float lo, float hi) { return emu_pack(lo) | (emu_pack(hi) << 16); }

// mma.sync m16n8k16, 16-bit inputs, fp32 accumulators
inline void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
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

// mma.sync m16n8k8 tf32
inline void mma_tf32(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
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
// cvt.rna.tf32.f32: round to nearest, ties away from zero, to 10 mantissa bits
inline u32 emu_tf32(float x) {
  u32 u = __float_as_uint(x);
  if ((u & 0x7f800000u) != 0x7f800000u) u += 0x1000u;
  return u & 0xffffe000u;
}
inline void split(u32 x, u32& hi, u32& lo) {
  hi = emu_tf32(__uint_as_float(x));
  lo = emu_tf32(__uint_as_float(x) - __uint_as_float(hi));
}

inline void store_elem(char* p, float f) {
  if (DT == 0) {
    memcpy(p, &f, 4);
  } else {
    const u16 h = (u16)emu_pack(f);
    memcpy(p, &h, 2);
  }
}
inline void store_pair(char* p, float a, float b) {
  if (DT == 0) {
    if (((uintptr_t)p) % 8 != 0) emu_fail("paired fp32 store misaligned");
    const float v[2] = {a, b};
    memcpy(p, v, 8);
  } else {
    if (((uintptr_t)p) % 4 != 0) emu_fail("paired 16-bit store misaligned");
    const u32 v = pack2(a, b);
    memcpy(p, &v, 4);
  }
}
