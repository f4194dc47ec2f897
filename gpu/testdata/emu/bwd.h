// The backward kernels' primitives: the block the generator brackets as
// inline-PTX primitives is replaced by this file (see backward_emu_test.go).
// T, the element type, is defined by the generated source before it; the
// shared emulation (prims.h) is named here as the backward kernels do.
#include <type_traits>
constexpr bool emu_bf16 = std::is_same_v<T, __nv_bfloat16>;
#include "prims.h"

inline unsigned smem_u32(const void* p) { return emu_smem_addr(p); }
inline void cp_async16(void* dst, const void* src, int bytes) { emu_cp_async(emu_smem_addr(dst), src, bytes, 16); }
inline void cp_async4(void* dst, const void* src) { emu_cp_async(emu_smem_addr(dst), src, 4, 4); }
inline void cp_async_commit() {}
inline void cp_async_wait0() {}
inline float ex2f(float x) { return exp2f(x); }
inline float tanh_approx(float x) { return emu_tanh_approx(x); }

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

inline void stsm_x4_t(unsigned a, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  const unsigned r[4] = {r0, r1, r2, r3};
  emu_stsm_t(r, 4, a);
}

// st_pair writes two adjacent elements of a shared-memory tile.
inline void st_pair(T* s, float a, float b) {
  if (sizeof(T) == 4) {
    const float v[2] = {a, b};
    memcpy(s, v, 8);
  } else {
    const unsigned v = pack2(a, b);
    memcpy(s, &v, 4);
  }
}

// split-tf32 product: three tf32 MMAs for fp32 accuracy.
inline void mma_tf32x3(float (&d)[4], const unsigned (&ah)[4], const unsigned (&al)[4], unsigned bh0, unsigned bh1, unsigned bl0, unsigned bl1) {
  mma1688(d, al, bh0, bh1);
  mma1688(d, ah, bl0, bl1);
  mma1688(d, ah, bh0, bh1);
}
