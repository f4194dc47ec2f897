// The forward kernels' primitives: the block the generator brackets as
// inline-PTX primitives is replaced by this file (see fwd_emu_test.go). It
// relies on the generated constants (LB, DT) and types that precede the
// block, and names the shared emulation (prims.h) as the forward kernels do.
constexpr bool emu_bf16 = DT == 2;
#include "prims.h"

inline u32 smem_addr(const void* p) { return emu_smem_addr(p); }
inline void cp_commit() {}
template <int N> inline void cp_wait() {}
inline void cp_async(u32 dst, const void* src, u32 n) { emu_cp_async(dst, src, n, LB); }
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
inline u32 lds32(u32 a) { return emu_lds32(a); }
inline float ex2(float x) { return exp2f(x); }
inline float tanh_approx(float x) { return emu_tanh_approx(x); }
inline u32 ctaid_x() { return blockIdx.x; }
inline u32 ctaid_y() { return blockIdx.y; }
inline u32 ctaid_z() { return blockIdx.z; }
inline u32 tid_x() { return threadIdx.x; }

inline void ldsm4(u32 (&r)[4], u32 a) { emu_ldsm(r, 4, false, a); }
inline void ldsm4t(u32 (&r)[4], u32 a) { emu_ldsm(r, 4, true, a); }
inline void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) { mma16816(c, a, b0, b1); }
inline void mma_tf32(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) { mma1688(d, a, b0, b1); }
inline void split(u32 x, u32& hi, u32& lo) { tf32_split(__uint_as_float(x), hi, lo); }

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
