// The warp-specialized kernels' primitives (kernels.WarpSpecializedPrimitives,
// under the same names): named barriers, plain mbarrier arrivals, setmaxnreg
// and the bulk reduce-add with its groups. It relies on shim.h (named
// barriers, waiting, deadlock detection) and tma.h (mbarriers).
#include <functional>

// ---- named barriers: bar.* are the .aligned forms (whole warps), barrier.*
// let a warp's lanes arrive apart
inline void bar_sync(u32 id, u32 count) { emu_bar(id, count, true, true, "bar.sync"); }
inline void bar_arrive(u32 id, u32 count) { emu_bar(id, count, false, true, "bar.arrive"); }
inline void barrier_sync(u32 id, u32 count) { emu_bar(id, count, true, false, "barrier.sync"); }
inline void barrier_arrive(u32 id, u32 count) { emu_bar(id, count, false, false, "barrier.arrive"); }

// ---- one arrival on an mbarrier (a consumer releasing a stage)
inline void mbar_arrive(u32 bar) { emu_mbar_arrive(bar, 0, "mbarrier.arrive"); }

// ---- setmaxnreg. The block starts with every thread at the register
// budget the kernel is compiled for when its launch bounds give one block
// per multiprocessor (the 64K registers over the block's threads, in steps
// of 8, at most 256), and the block's pool holds those registers. Each of a
// warpgroup's four warps executes the same setmaxnreg, all its lanes with
// the same count (24..256, a multiple of 8); .dec lowers the warp's budget
// (returning registers to the pool), .inc raises it, blocking until the
// pool has them: a request the pool can never meet is a deadlock.
struct EmuRegs {
  unsigned cap = 0;            // the initial per-thread budget
  long pool = 0;               // registers not held by any warp
  unsigned warp[32] = {};      // per-thread budget of each warp
  std::vector<unsigned> seq[8];  // per warpgroup: its warps' k-th setmaxnreg (the count, plus 1000 for .inc)
  unsigned calls[32] = {};     // setmaxnreg executed by each warp
};
static EmuRegs emu_regs;
static EmuHook emu_regs_start(emu_block_start, [] {
  emu_regs = EmuRegs{};
  emu_regs.cap = std::min(256u, 65536u / blockDim.x / 8 * 8);
  for (unsigned w = 0; w * 32 < blockDim.x; ++w) emu_regs.warp[w] = emu_regs.cap;
});
static EmuHook emu_regs_end(emu_block_end, [] {
  for (unsigned g = 0; g * 128 < blockDim.x; ++g)
    for (unsigned w = 4 * g + 1; w < 4 * g + 4; ++w)
      if (emu_regs.calls[w] != emu_regs.calls[4 * g]) {
        char msg[200];
        snprintf(msg, sizeof msg, "setmaxnreg: warp %u executed it %u times, warp %u of its warpgroup %u %u times (every warp of a warpgroup executes each one)",
                 w, emu_regs.calls[w], 4 * g, g, emu_regs.calls[4 * g]);
        emu_fail(msg);
      }
});
static std::string emu_regs_note() {
  if (std::all_of(emu_regs.seq, emu_regs.seq + 8, [](const std::vector<unsigned>& q) { return q.empty(); })) return "";
  std::string s = "\n  registers: " + std::to_string(emu_regs.pool) + " free in the block's pool; per-thread budget by warp:";
  for (unsigned w = 0; w * 32 < blockDim.x; ++w) s += " " + std::to_string(emu_regs.warp[w]);
  return s;
}
static const bool emu_regs_noted = (emu_deadlock_notes.push_back(emu_regs_note), true);

[[noreturn]] inline void emu_setmaxnreg_fail(bool inc, unsigned n, const char* why, unsigned x = 0, unsigned y = 0) {
  char rule[200], msg[300];
  snprintf(rule, sizeof rule, why, x, y);
  snprintf(msg, sizeof msg, "setmaxnreg.%s.sync.aligned.u32 %u (thread %u, warp %u): %s", inc ? "inc" : "dec", n, threadIdx.x, threadIdx.x / 32, rule);
  emu_fail(msg);
}
inline void emu_setmaxnreg(bool inc, unsigned n) {
  if (n < 24 || n > 256 || n % 8 != 0) emu_setmaxnreg_fail(inc, n, "count not a multiple of 8 in 24..256");
  if (blockDim.x % 128 != 0) emu_setmaxnreg_fail(inc, n, "the block's %u threads are not whole warpgroups", blockDim.x);
  const unsigned w = threadIdx.x / 32, g = w / 4, code = n + (inc ? 1000 : 0);
  EmuWarpX& x = emu_wx[w];
  x.u[emu_lane()][0] = code;
  emu_warp_sync();
  for (int l = 0; l < 32; ++l)
    if (x.u[l][0] != code) emu_setmaxnreg_fail(inc, n, "lane %u of the warp executes another one (.aligned: the whole warp, one count)", (unsigned)l);
  emu_warp_sync();
  if (emu_lane() == 0) {
    const unsigned k = emu_regs.calls[w]++;
    std::vector<unsigned>& seq = emu_regs.seq[g];
    if (k == seq.size()) seq.push_back(code);
    else if (seq[k] != code)
      emu_setmaxnreg_fail(inc, n, seq[k] >= 1000 ? "another warp of warpgroup %u executes setmaxnreg.inc %u there (the warps of a warpgroup execute the same one)"
                                                 : "another warp of warpgroup %u executes setmaxnreg.dec %u there (the warps of a warpgroup execute the same one)",
                          g, seq[k] % 1000);
    unsigned& cur = emu_regs.warp[w];
    if (inc && n < cur) emu_setmaxnreg_fail(inc, n, ".inc below the warp's budget of %u", cur);
    if (!inc && n > cur) emu_setmaxnreg_fail(inc, n, ".dec above the warp's budget of %u", cur);
    const long need = 32l * ((long)n - (long)cur);
    if (inc) emu_block_until([&] { return emu_regs.pool >= need; }, EmuWaitOn{"setmaxnreg.inc %u (%u more registers for the warp)", n, (unsigned)need});
    emu_regs.pool -= need;
    cur = n;
    emu_progress();
  }
  emu_warp_sync();
}
template <unsigned N> inline void setmaxnreg_inc() { emu_setmaxnreg(true, N); }
template <unsigned N> inline void setmaxnreg_dec() { emu_setmaxnreg(false, N); }

// ---- bulk reduce-add (cp.reduce.async.bulk .add.f32), bulk tensor store
// (cp.async.bulk.tensor ... bulk_group) and bulk groups. A copy reads its
// shared source and writes global memory when a wait_group retires its group
// (the latest the hardware may), after checking that the source still holds
// what it held at the issue: a source changed before the wait is a failure,
// and so is a copy still pending (uncommitted or unwaited) when the block
// ends.
struct EmuBulkOp {
  const char* what;
  u32 src, bytes;
  std::vector<unsigned char> held;                     // the source at the issue
  std::function<void(const unsigned char*)> apply;   // the global writes, from the held source
};
struct EmuBulk {
  std::vector<EmuBulkOp> open;                 // issued, not committed
  std::vector<std::vector<EmuBulkOp>> groups;  // committed, oldest first
};
static std::vector<EmuBulk> emu_bulk;  // by thread
static EmuHook emu_bulk_start(emu_block_start, [] { emu_bulk.assign(blockDim.x, EmuBulk{}); });
static EmuHook emu_bulk_end(emu_block_end, [] {
  for (unsigned t = 0; t < emu_bulk.size(); ++t)
    if (!emu_bulk[t].open.empty() || !emu_bulk[t].groups.empty()) {
      char msg[200];
      snprintf(msg, sizeof msg, "bulk copies: thread %u ends with %zu copies uncommitted and %zu groups not waited for (cp.async.bulk.commit_group, cp.async.bulk.wait_group)",
               t, emu_bulk[t].open.size(), emu_bulk[t].groups.size());
      emu_fail(msg);
    }
});
// dst[i] += source element i (fp32) for bytes/4 elements: dst and src
// 16-byte aligned, bytes a nonzero multiple of 16.
inline void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
  if (bytes == 0 || bytes % 16 != 0) emu_fail("cp.reduce.async.bulk: size not a nonzero multiple of 16 bytes");
  if ((uintptr_t)dst % 16 != 0) emu_fail("cp.reduce.async.bulk: global destination not 16-byte aligned");
  if (src % 16 != 0 || src + (unsigned long long)bytes > EMU_SMEM) emu_fail("cp.reduce.async.bulk: shared source not 16-byte aligned or out of range");
  if (!emu_reduce_inside((const char*)dst, bytes)) emu_fail("cp.reduce.async.bulk: destination outside the accumulators");
  emu_bulk[threadIdx.x].open.push_back(EmuBulkOp{"cp.reduce.async.bulk", src, bytes, std::vector<unsigned char>(smem + src, smem + src + bytes),
                                                 [dst, bytes](const unsigned char* held) {
                                                   for (u32 i = 0; i < bytes / 4; ++i) {
                                                     float v;
                                                     memcpy(&v, held + 4 * i, 4);
                                                     dst[i] += v;
                                                   }
                                                 }});
}
#ifdef EMU_TMA_H
// emu_tma_box issues, as `what`, a bulk tensor copy of the box (c0.., c1.., c2, c3) of 64 columns and the map's
// box rows from the 128-byte swizzled tile at src (1024-byte aligned): row r at r·128, 16-byte chunk c at
// c ^ (r mod 8); elem(dst, from) writes one 2-byte element of the tensor from its bytes in the tile when the
// copy applies; elements outside the tensor are not written (the encoding is tma.h's)
template <typename F>
inline void emu_tma_box(const char* what, const TensorMap* map, u32 src, int c0, int c1, int c2, int c3, F elem) {
  const unsigned long long* w = map->w;
  unsigned char* base = (unsigned char*)w[0];
  const long long cols = (long long)w[1], rows = (long long)w[2], heads = (long long)w[3], batch = (long long)w[4];
  const long long sr = (long long)w[5], sh = (long long)w[6], sb = (long long)w[7];
  const int box = (int)w[8];
  char msg[160];
  if (src % 1024 != 0 || src + (unsigned long long)box * 128 > EMU_SMEM) {
    snprintf(msg, sizeof msg, "%s: shared source not 1024-byte aligned or out of range", what);
    emu_fail(msg);
  }
  if (c0 % 8 != 0) {
    snprintf(msg, sizeof msg, "%s: box start column not 16-byte aligned", what);
    emu_fail(msg);
  }
  emu_bulk[threadIdx.x].open.push_back(EmuBulkOp{what, src, (u32)box * 128, std::vector<unsigned char>(smem + src, smem + src + box * 128),
                                                 [=](const unsigned char* held) {
                                                   for (int r = 0; r < box; ++r)
                                                     for (int ch = 0; ch < 8; ++ch)
                                                       for (int e = 0; e < 8; ++e) {
                                                         const long long col = c0 + 8 * ch + e, row = c1 + r;
                                                         if (col < cols && row >= 0 && row < rows && c2 >= 0 && c2 < heads && c3 >= 0 && c3 < batch)
                                                           elem(base + row * sr + c2 * sh + c3 * sb + col * 2, held + r * 128 + ((ch ^ (r & 7)) << 4) + 2 * e);
                                                       }
                                                 }});
}
// tma_store_4d: the box copied into the tensor as it is
inline void tma_store_4d(const TensorMap* map, u32 src, int c0, int c1, int c2, int c3) {
  emu_tma_box("cp.async.bulk.tensor (store)", map, src, c0, c1, c2, c3, [](unsigned char* d, const unsigned char* x) { memcpy(d, x, 2); });
}
// tma_reduce_add_4d: the box added into the tensor element by element in E (the map's element type: the sum of
// the two numbers rounded to E, to nearest even), each element's add atomic
inline float emu_elem_f(__nv_bfloat16 x) { return __bfloat162float(x); }
inline float emu_elem_f(__half x) { return __half2float(x); }
inline void emu_elem_set(__nv_bfloat16* x, float f) { *x = __float2bfloat16_rn(f); }
inline void emu_elem_set(__half* x, float f) { *x = __float2half_rn(f); }
template <typename E>
inline void tma_reduce_add_4d(const TensorMap* map, u32 src, int c0, int c1, int c2, int c3) {
  emu_tma_box("cp.reduce.async.bulk.tensor (add)", map, src, c0, c1, c2, c3, [](unsigned char* d, const unsigned char* x) {
    E a, v;
    memcpy(&a, d, 2);
    memcpy(&v, x, 2);
    emu_elem_set(&a, emu_elem_f(a) + emu_elem_f(v));
    memcpy(d, &a, 2);
  });
}
#endif
inline void bulk_commit() {
  EmuBulk& b = emu_bulk[threadIdx.x];
  b.groups.push_back(std::move(b.open));
  b.open.clear();
}
// emu_bulk_wait retires the thread's oldest committed groups until at most n remain.
inline void emu_bulk_wait(int n) {
  EmuBulk& b = emu_bulk[threadIdx.x];
  while ((int)b.groups.size() > n) {
    for (const EmuBulkOp& op : b.groups.front()) {
      if (memcmp(smem + op.src, op.held.data(), op.bytes) != 0) {
        char msg[240];
        snprintf(msg, sizeof msg, "%s: shared source [%u, %u) changed before cp.async.bulk.wait_group retired its group (thread %u)",
                 op.what, op.src, op.src + op.bytes, threadIdx.x);
        emu_fail(msg);
      }
      op.apply(op.held.data());
    }
    b.groups.erase(b.groups.begin());
  }
}
template <int N> inline void bulk_wait() { emu_bulk_wait(N); }
template <int N> inline void bulk_wait_read() { emu_bulk_wait(N); }
