// Host emulation of the inline-PTX primitives the generated kernels share,
// with the alignment rules of ldmatrix and cp.async checked. It relies on
// shim.h (fibers, barriers, shared memory) and on emu_bf16, which the
// including per-direction header (fwd.h, bwd.h) defines: whether 16-bit
// elements are bf16 (else fp16).

#include <algorithm>
#include <cfloat>
#include <climits>

inline unsigned emu_smem_addr(const void* p) {
  const long d = (const unsigned char*)p - smem;
  if (d < 0 || d >= (long)EMU_SMEM) emu_fail("shared address out of range");
  return (unsigned)d;
}
inline void emu_smem_check(unsigned a, unsigned n, const char* what) {
  if (a % n != 0 || a + n > EMU_SMEM) emu_fail(what);
}
// the bits of a bf16 or fp16 element as a float (the generators' bitsToF32)
inline float bf16_to_f32(uint16_t h) { return emu_bf2f(h); }
inline float f16_to_f32(uint16_t h) { return emu_h2f(h); }

// prefetch.global.L1 is a hint on the GPU; here the byte it names is read.
inline void prefetch_l1(const void* p) { (void)*(const volatile unsigned char*)p; }

// cp.async of size bytes completes at once here; src-size 0 zero-fills and
// reads nothing.
inline void emu_cp_async(unsigned dst, const void* src, unsigned n, unsigned size) {
  emu_smem_check(dst, size, "cp.async: shared destination misaligned or out of range");
  if (n != 0 && n != size) emu_fail("cp.async: bad source size");
  if (n != 0 && ((uintptr_t)src) % size != 0) emu_fail("cp.async: misaligned global source");
  memset(smem + dst, 0, size);
  if (n) memcpy(smem + dst, src, size);
}
inline uint32_t emu_lds32(unsigned a) {
  emu_smem_check(a, 4, "ld.shared.b32 misaligned or out of range");
  uint32_t v;
  memcpy(&v, smem + a, 4);
  return v;
}
inline uint32_t emu_lds16(unsigned a) {
  emu_smem_check(a, 2, "ld.shared.b16 misaligned or out of range");
  uint16_t v;
  memcpy(&v, smem + a, 2);
  return v;
}

// emu_matrix_rows publishes this lane's row address for an ldmatrix or
// stmatrix of nmat 8x8 matrices (lanes 8i..8i+7 address matrix i), waits
// for the warp and fails (what) unless every row used is 16-byte aligned;
// the caller reads the addresses, then ends with emu_warp_sync.
inline EmuWarpX& emu_matrix_rows(int nmat, unsigned addr, const char* what) {
  EmuWarpX& x = emu_wx[emu_warp()];
  x.addr[emu_lane()] = addr;
  emu_warp_sync();
  for (int q = 0; q < 8 * nmat; ++q)
    if (x.addr[q] % 16 != 0) emu_fail(what);
  return x;
}

// ldmatrix of nmat 8x8 matrices: lanes 8i..8i+7 give the row addresses of
// matrix i.
inline void emu_ldsm(unsigned* out, int nmat, bool trans, unsigned addr) {
  EmuWarpX& x = emu_matrix_rows(nmat, addr, "ldmatrix row address not 16-byte aligned");
  const int l = emu_lane();
  for (int r = 0; r < nmat; ++r) {
    if (!trans) {
      out[r] = emu_lds32(x.addr[8 * r + l / 4] + 4 * (l % 4));
    } else {
      const unsigned r0 = x.addr[8 * r + 2 * (l % 4)], r1 = x.addr[8 * r + 2 * (l % 4) + 1];
      out[r] = emu_lds16(r0 + 2 * (l / 4)) | (emu_lds16(r1 + 2 * (l / 4)) << 16);
    }
  }
  emu_warp_sync();
}

inline void emu_sts16(unsigned a, uint32_t v) {
  emu_smem_check(a, 2, "st.shared.b16 misaligned or out of range");
  const uint16_t h = (uint16_t)v;
  memcpy(smem + a, &h, 2);
}

// stmatrix .trans of nmat 8x8 matrices (the kernels store no other form),
// the inverse of emu_ldsm's transposed load: lanes 8i..8i+7 give the row
// addresses of matrix i; lane l's in[i], its fragment row l/4 at columns
// 2(l%4) and +1, lands as column l/4 of rows 2(l%4) and +1.
inline void emu_stsm_t(const unsigned* in, int nmat, unsigned addr) {
  EmuWarpX& x = emu_matrix_rows(nmat, addr, "stmatrix row address not 16-byte aligned");
  const int l = emu_lane();
  for (int r = 0; r < nmat; ++r) {
    emu_sts16(x.addr[8 * r + 2 * (l % 4)] + 2 * (l / 4), in[r] & 0xffff);
    emu_sts16(x.addr[8 * r + 2 * (l % 4) + 1] + 2 * (l / 4), in[r] >> 16);
  }
  emu_warp_sync();
}

// 16-bit element conversions of the kernel's element type.
inline float emu_elem(uint32_t h) { return emu_bf16 ? emu_bf2f((uint16_t)h) : emu_h2f((uint16_t)h); }
inline uint32_t emu_pack(float a) { return emu_bf16 ? emu_f2bf(a) : emu_f2h(a); }
inline unsigned pack2(float lo, float hi) { return emu_pack(lo) | (emu_pack(hi) << 16); }
inline void unpack2(unsigned x, float& lo, float& hi) { lo = emu_elem(x & 0xffff); hi = emu_elem(x >> 16); }

// emu_frag_a16 unpacks the warp's 16x16 A operand of 16-bit elements from
// the fragments its lanes left in x.u[lane][0..3] (the mma.sync A layout).
inline void emu_frag_a16(float (&A)[16][16], const EmuWarpX& x) {
  for (int L = 0; L < 32; ++L) {
    const int g = L / 4, t = L % 4;
    const unsigned* u = x.u[L];
    A[g][2 * t] = emu_elem(u[0] & 0xffff), A[g][2 * t + 1] = emu_elem(u[0] >> 16);
    A[g + 8][2 * t] = emu_elem(u[1] & 0xffff), A[g + 8][2 * t + 1] = emu_elem(u[1] >> 16);
    A[g][2 * t + 8] = emu_elem(u[2] & 0xffff), A[g][2 * t + 9] = emu_elem(u[2] >> 16);
    A[g + 8][2 * t + 8] = emu_elem(u[3] & 0xffff), A[g + 8][2 * t + 9] = emu_elem(u[3] >> 16);
  }
}

// mma.sync m16n8k16, 16-bit inputs, fp32 accumulators.
inline void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  EmuWarpX& x = emu_wx[emu_warp()];
  const int l = emu_lane();
  for (int i = 0; i < 4; ++i) x.u[l][i] = a[i];
  x.u[l][4] = b0, x.u[l][5] = b1;
  emu_warp_sync();
  float A[16][16], B[16][8];
  emu_frag_a16(A, x);
  for (int L = 0; L < 32; ++L) {
    const int g = L / 4, t = L % 4;
    const unsigned* u = x.u[L];
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

// The tf32 tensor-core model, chosen by FLASHATTN_EMU_TF32 when the
// emulator starts:
//   block (the default): Hopper's block FMA (Khattak and Mikaitis, models of
//     NVIDIA tensor cores, github.com/north-numerical-computing/MATLAB-tensor-core,
//     H100TC/H200TC: tf32 in blocks of 8 products, 2 extra alignment bits,
//     truncation, round toward zero). The 8 exact products and the
//     accumulator are aligned to the largest exponent among them (a product's
//     exponent taken as the sum of its factors' exponents, the accumulator's
//     its own), each truncated toward zero to 24 + 2 bits below it, summed
//     exactly, and the sum truncated toward zero to fp32.
//   block:<bits>[:rn]: the same with <bits> extra alignment bits (0..8), the
//     aligned addends rounded to nearest instead of truncated with :rn.
//   exact: the products and the accumulator summed exactly, the sum truncated
//     toward zero to fp32 (no alignment loss).
struct EmuTF32Model {
  bool exact = false;
  int bits = 2;
  bool rn = false;
};
inline const EmuTF32Model& emu_tf32_model() {
  static const EmuTF32Model m = [] {
    EmuTF32Model m;
    const char* e = getenv("FLASHATTN_EMU_TF32");
    if (e == nullptr || *e == 0 || strcmp(e, "block") == 0) return m;
    if (strcmp(e, "exact") == 0) {
      m.exact = true;
      return m;
    }
    char mode[8] = "";
    if (sscanf(e, "block:%d:%7s", &m.bits, mode) < 1 || m.bits < 0 || m.bits > 8 || (*mode && strcmp(mode, "rn") != 0))
      emu_fail("FLASHATTN_EMU_TF32: want block, block:<bits>[:rn] or exact");
    m.rn = *mode != 0;
    return m;
  }();
  return m;
}

// emu_tf32_dot returns c + sum a[k]·b[k] over 8 tf32 pairs as the model
// emu_tf32_model says.
inline float emu_tf32_dot(float c, const float (&a)[8], const float (&b)[8]) {
  const EmuTF32Model& m = emu_tf32_model();
  double x[9];
  bool any = c != 0.f;
  int emax = c != 0.f ? ilogbf(c) : INT_MIN;
  for (int k = 0; k < 8; ++k) {
    x[k] = (double)a[k] * (double)b[k];  // exact: 11-bit by 11-bit significands
    if (x[k] != 0) {
      any = true;
      emax = std::max(emax, ilogbf(a[k]) + ilogbf(b[k]));
    }
  }
  x[8] = c;
  if (!any) return c + 0.f * a[0];  // zeros (keeps the sign rules of 0 + 0)
  double s = 0;
  if (m.exact) {
    for (double v : x) s += v;
  } else {
    // Every addend is a multiple of 2^-149 times at most 2^256, so the
    // aligned sum of 9 of them fits a double exactly.
    const double q = ldexp(1.0, emax - 23 - m.bits);
    for (double v : x) s += (m.rn ? nearbyint(v / q) : trunc(v / q)) * q;
  }
  float f = (float)s;
  if (fabs((double)f) > fabs(s)) f = nextafterf(f, 0.f);
  return f;
}

// mma.sync m16n8k8 tf32, fp32 accumulators, as emu_tf32_dot models the
// tensor cores (a kernel that chains long sums through the accumulator
// drifts toward zero; one that rounds each step's sum into its own does not).
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
    float bc[8];
    for (int k = 0; k < 8; ++k) bc[k] = B[k][col];
    d[i] = emu_tf32_dot(d[i], A[row], bc);
  }
  emu_warp_sync();
}

// cvt.rna.tf32.f32: round to nearest, ties away from zero, to 10 mantissa bits.
inline unsigned emu_tf32(float x) {
  unsigned u = __float_as_uint(x);
  if ((u & 0x7f800000u) != 0x7f800000u) u += 0x1000u;
  return u & 0xffffe000u;
}
// tf32_split writes x as hi + lo, both tf32 (split-tf32 fp32 products).
inline void tf32_split(float x, unsigned& hi, unsigned& lo) {
  hi = emu_tf32(x);
  lo = emu_tf32(x - __uint_as_float(hi));
}

// tanh.approx.f32, the bf16 kernels' softcap tanh (tanh_approx), modelled
// at the bound the PTX ISA documents for it (PTX ISA 9.1, section 9.7.3.22,
// "Floating Point Instructions: tanh", docs.nvidia.com/cuda/parallel-thread-
// execution/#floating-point-instructions-tanh: "The maximum relative error
// over the entire floating point range is 2^-11"; subnormal inputs passed
// through; ±0 -> ±0, ±Inf -> ±1, NaN -> NaN), not at its measured accuracy
// (a maximum relative error of 1.1e-5, about 2^-16.5, reported on sm_75),
// so that a kernel that passes here keeps its criterion with any tanh
// within that bound. FLASHATTN_EMU_TANH chooses the model when the
// emulator starts:
//   round (the default): the exact tanh rounded to nearest (even) at 11
//     significant bits, an error of up to 2^-11 relative, reached next to
//     powers of two, that varies in sign and size with the argument;
//   toward0: the exact tanh times 1 - 2^-11, every value off by the bound
//     toward zero (a bias that no sum averages out);
//   away: the exact tanh times 1 + 2^-11, off by the bound away from zero
//     (|t| may exceed 1, so that 1 - t² may be slightly negative);
//   exact: the exact tanh rounded to fp32.
enum class EmuTanhModel { round, toward0, away, exact };
inline EmuTanhModel emu_tanh_model() {
  static const EmuTanhModel m = [] {
    const char* e = getenv("FLASHATTN_EMU_TANH");
    if (e == nullptr || *e == 0 || strcmp(e, "round") == 0) return EmuTanhModel::round;
    if (strcmp(e, "toward0") == 0) return EmuTanhModel::toward0;
    if (strcmp(e, "away") == 0) return EmuTanhModel::away;
    if (strcmp(e, "exact") == 0) return EmuTanhModel::exact;
    emu_fail("FLASHATTN_EMU_TANH: want round, toward0, away or exact");
  }();
  return m;
}
constexpr int emu_tanh_bits = 11;  // -log2 of tanh.approx.f32's maximum relative error
inline float emu_tanh_approx(float x) {
  if (x != x) return x;                         // NaN
  if (fabsf(x) < FLT_MIN) return x;             // ±0 and subnormals: passed through
  if (fabsf(x) > FLT_MAX) return x > 0 ? 1.f : -1.f;  // ±Inf: the ISA's corner cases
  const double t = tanh((double)x), u = ldexp(1.0, -emu_tanh_bits);
  switch (emu_tanh_model()) {
  case EmuTanhModel::round: {
    int e;
    frexp(t, &e);  // |t| in [2^(e-1), 2^e): 11 significant bits are multiples of 2^(e-11)
    const double q = ldexp(1.0, e - emu_tanh_bits);
    return (float)(nearbyint(t / q) * q);
  }
  case EmuTanhModel::toward0: {  // fp32 nearest to t·(1 - u) on t's side of it (within the bound)
    const double v = t * (1 - u);
    const float f = (float)v;
    return fabs((double)f) < fabs(v) ? nextafterf(f, t > 0 ? 2.f : -2.f) : f;
  }
  case EmuTanhModel::away: {  // fp32 nearest to t·(1 + u) on t's side of it
    const double v = t * (1 + u);
    const float f = (float)v;
    return fabs((double)f) > fabs(v) ? nextafterf(f, 0.f) : f;
  }
  case EmuTanhModel::exact:
    break;
  }
  return (float)t;
}

// sm_count (the forward's and backward's primitive): a small device, so that cta_order's tail
// section (three waves) covers some pairs of the emulated launches and not others.
inline int sm_count() { return 4; }
