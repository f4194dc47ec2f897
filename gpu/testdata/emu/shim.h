// Host emulation of the CUDA features the generated kernels use, for
// checking their indexing and synchronisation on a machine without a GPU
// (see emu_test.go). Every CUDA thread of a block is a fiber; barriers and
// warp-synchronous instructions switch between fibers. Blocks run one after
// another, so shared memory is one array.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ucontext.h>
#include <algorithm>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__
#define __grid_constant__
#define __restrict__

struct emu_dim3 { unsigned x, y, z; };
struct uint2 { unsigned x, y; };
inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
// __byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of the 8 bytes y:x
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; i++) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
// __popc(x): the number of bits set in x
inline int __popc(unsigned x) { return __builtin_popcount(x); }
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return float2{a, b}; }
struct float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }

// 16-bit types (storage only).
struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };
inline uint16_t emu_f2h(float f) { _Float16 h = (_Float16)f; uint16_t u; memcpy(&u, &h, 2); return u; }
inline float emu_h2f(uint16_t u) { _Float16 h; memcpy(&h, &u, 2); return (float)h; }
inline uint16_t emu_f2bf(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
inline float emu_bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
inline float __half2float(__half h) { return emu_h2f(h.x); }
inline __half __float2half_rn(float f) { return __half{emu_f2h(f)}; }
inline float __bfloat162float(__nv_bfloat16 h) { return emu_bf2f(h.x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{emu_f2bf(f)}; }

inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
// __fmul_rn: a product rounded on its own, never fused into a following add
// (the empty asm keeps the compiler from contracting through it).
inline float __fmul_rn(float a, float b) {
  float r = a * b;
  asm("" : "+x"(r));
  return r;
}
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

[[noreturn]] inline void emu_fail(const char* what) {
  fprintf(stderr, "emulation: %s\n", what);
  exit(3);
}

// __trap: a kernel's own check failed (the device aborts the launch)
[[noreturn]] inline void __trap() { emu_fail("__trap: the kernel's check failed"); }

// ---- fibers and barriers
// EmuWaitOn says what a blocked thread waits for: what, a printf format
// of up to three unsigned operands a, b, c.
struct EmuWaitOn {
  const char* what = nullptr;
  unsigned a = 0, b = 0, c = 0;
};
struct EmuFiber {
  ucontext_t ctx;
  emu_dim3 tid;
  bool done;
  char* stack;
  EmuWaitOn on;  // while blocked
};
constexpr size_t EMU_STACK = 1 << 20;
static std::vector<EmuFiber> emu_fibers;
static int emu_cur_i;
static EmuFiber* emu_cur;
static ucontext_t emu_main;
static emu_dim3 blockIdx, gridDim, blockDim;
#define threadIdx (emu_cur->tid)

static long emu_idle;  // yields without progress since the last progress

// emu_warp_ahead reports whether FLASHATTN_EMU_SCHEDULE=warp asks for the
// warp-ahead schedule: a yielding thread hands over to the next unfinished
// thread of its own warp while the warp's threads have yielded fewer than
// twice each without progress, so that one warp runs as far ahead of the
// others as the kernel's barriers let it. The default round robin lets
// every other thread run at each warp-synchronous step, which hides a
// missing barrier between warps (a warp reading another's shared-memory
// stores before they are ordered).
static bool emu_warp_ahead() {
  static const bool on = [] {
    const char* e = getenv("FLASHATTN_EMU_SCHEDULE");
    if (e == nullptr || *e == 0 || strcmp(e, "round-robin") == 0) return false;
    if (strcmp(e, "warp") != 0) emu_fail("FLASHATTN_EMU_SCHEDULE: want round-robin or warp");
    return true;
  }();
  return on;
}

// emu_switch runs the next unfinished fiber after the current one (of its
// warp first under the warp-ahead schedule); it returns false when the
// current fiber is the only one left.
static bool emu_switch() {
  const int n = (int)emu_fibers.size(), prev = emu_cur_i;
  auto to = [&](int j) {
    emu_cur_i = j;
    emu_cur = &emu_fibers[j];
    swapcontext(&emu_fibers[prev].ctx, &emu_fibers[j].ctx);
    return true;
  };
  if (emu_warp_ahead() && emu_idle <= 64) {
    const int w0 = prev / 32 * 32, wn = std::min(n, w0 + 32);
    for (int i = 1; i < wn - w0; ++i) {
      const int j = w0 + (prev - w0 + i) % (wn - w0);
      if (!emu_fibers[j].done) return to(j);
    }
  }
  for (int i = 1; i < n; ++i) {
    const int j = (prev + i) % n;
    if (!emu_fibers[j].done) return to(j);
  }
  return false;
}

// Threads of the block and of each warp that have not returned yet.
static int emu_live_cta;
static int emu_live_warp[32];

// Functions the emulation's headers run when a block starts and after its
// threads have all returned (resetting and checking their per-block state);
// EmuHook registers one from a static initializer.
static std::vector<void (*)()> emu_block_start, emu_block_end;
struct EmuHook {
  EmuHook(std::vector<void (*)()>& list, void (*f)()) { list.push_back(f); }
};

// ---- waiting. A thread whose condition does not hold yields to the next
// one. Every change of a synchronisation object (an arrival, a completed
// phase, registers released, a thread returning) is progress; when the live
// threads have all yielded twice over since the last progress, none can
// ever proceed: the block is deadlocked, and the emulation fails naming
// what each blocked thread waits for (and what the headers registered in
// emu_deadlock_notes add about their objects).
static std::vector<std::string (*)()> emu_deadlock_notes;
inline void emu_progress() { emu_idle = 0; }
static std::string emu_wait_text(const EmuWaitOn& on) {
  char buf[200];
  snprintf(buf, sizeof buf, on.what ? on.what : "(running)", on.a, on.b, on.c);
  return buf;
}
[[noreturn]] static void emu_deadlock() {
  std::string msg = "deadlock: no thread can proceed; thread " + std::to_string(emu_cur->tid.x) + " waits for " + emu_wait_text(emu_cur->on);
  // blocked threads, runs of consecutive threads that wait for the same
  for (size_t i = 0; i < emu_fibers.size();) {
    const EmuFiber& f = emu_fibers[i];
    size_t j = i + 1;
    const std::string w = emu_wait_text(f.on);
    while (j < emu_fibers.size() && emu_fibers[j].done == f.done && emu_wait_text(emu_fibers[j].on) == w) ++j;
    msg += "\n  threads " + std::to_string(i) + "-" + std::to_string(j - 1) + ": " + (f.done ? "returned" : w);
    i = j;
  }
  for (auto note : emu_deadlock_notes) msg += note();
  emu_fail(msg.c_str());
}
// emu_yield_blocked yields once on behalf of a thread whose condition does
// not hold, failing when the block is deadlocked.
static void emu_yield_blocked(const EmuWaitOn& on) {
  emu_cur->on = on;
  if (++emu_idle > 2 * (long)emu_live_cta + 2 || !emu_switch()) emu_deadlock();
  emu_cur->on = EmuWaitOn{};
}
// emu_block_until blocks the current thread until ready() holds.
template <class F>
inline void emu_block_until(F ready, const EmuWaitOn& on) {
  while (!ready()) emu_yield_blocked(on);
}

struct EmuBarrier {
  int count = 0, expected = 0;
  unsigned gen = 0;
  int* live = nullptr;
  const char* what = "a barrier";  // for deadlock reports (an EmuWaitOn format of the warp)
};
static void emu_wait(EmuBarrier& b) {
  const unsigned g = b.gen;
  emu_progress();
  if (++b.count == b.expected) {
    b.count = 0;
    b.gen++;
    return;
  }
  emu_block_until([&] {
    if (b.gen == g && *b.live < b.expected) emu_fail("barrier can never complete: some threads returned");
    return b.gen != g;
  }, EmuWaitOn{b.what, (unsigned)(threadIdx.x >> 5)});
}
static EmuBarrier emu_cta_bar;
static EmuBarrier emu_warp_bar[32];

// ---- named barriers (bar / barrier): sixteen per block. A phase starts
// with its first arrival, which fixes its thread count; it completes when
// that many arrivals have come, the arriving threads then waiting in .sync
// resume, and the next arrival starts the next phase. Barrier 0 with the
// whole block in bar.sync is __syncthreads' barrier and shares its state.
struct EmuNamedBar {
  int expected = 0, arrived = 0;  // the phase's thread count (0: no phase in progress), its arrivals
  unsigned gen = 0;               // completed phases
  bool aligned = false;           // some arrival of the phase was .aligned (bar.sync, bar.arrive)
  std::vector<bool> in;           // threads that arrived in the phase
};
static EmuNamedBar emu_named[16];
static std::string emu_named_note() {
  std::string s;
  for (int i = 0; i < 16; ++i)
    if (emu_named[i].arrived)
      s += "\n  named barrier " + std::to_string(i) + ": " + std::to_string(emu_named[i].arrived) + " of " +
           std::to_string(emu_named[i].expected) + " threads arrived";
  return s;
}
static EmuHook emu_named_start(emu_block_start, [] {
  for (auto& b : emu_named) b = EmuNamedBar{0, 0, 0, false, std::vector<bool>(blockDim.x)};
});
static const bool emu_named_noted = (emu_deadlock_notes.push_back(emu_named_note), true);
// a phase still in progress when the block ends (arrivals nobody waited for) is a misuse: the
// kernel's arrivals and syncs do not balance
static EmuHook emu_named_end(emu_block_end, [] {
  for (int i = 1; i < 16; ++i)
    if (emu_named[i].arrived) {
      char msg[200];
      snprintf(msg, sizeof msg, "named barrier %d: a phase of %d threads with %d arrived is still in progress at the block's end (arrivals that no sync took)",
               i, emu_named[i].expected, emu_named[i].arrived);
      emu_fail(msg);
    }
});

[[noreturn]] static void emu_named_fail(const char* op, unsigned id, unsigned count, const char* why, unsigned x = 0, unsigned y = 0) {
  char buf[400], rule[300];
  snprintf(rule, sizeof rule, why, x, y);
  snprintf(buf, sizeof buf, "%s %u, %u (thread %u): %s", op, id, count, threadIdx.x, rule);
  emu_fail(buf);
}
// emu_bar is op (bar.sync, bar.arrive, barrier.sync, barrier.arrive) on
// named barrier id with count threads: wait says .sync (arrive, then wait
// for the phase to complete), aligned the .aligned forms (bar.*), whose
// warps take part whole: a warp some of whose live lanes arrive in a phase
// that completes without the others is a failure.
static void emu_bar(unsigned id, unsigned count, bool wait, bool aligned, const char* op) {
  if (id > 15) emu_named_fail(op, id, count, "barrier id out of range 0..15");
  if (count == 0) emu_named_fail(op, id, count, "thread count 0");
  if (count % 32 != 0) emu_named_fail(op, id, count, "thread count not a multiple of the warp size (32)");
  if (count > blockDim.x) emu_named_fail(op, id, count, "thread count above the block's %u threads", blockDim.x);
  if (id == 0 && count == blockDim.x && wait && aligned) {
    if (emu_named[0].arrived) emu_named_fail(op, id, count, "barrier 0 has a phase of %u threads in progress", emu_named[0].expected);
    emu_wait(emu_cta_bar);  // __syncthreads
    return;
  }
  if (id == 0 && emu_cta_bar.count) emu_named_fail(op, id, count, "__syncthreads has a phase of the whole block (%u threads) in progress on barrier 0", blockDim.x);
  EmuNamedBar& b = emu_named[id];
  const unsigned t = threadIdx.x;
  if (b.arrived == 0) {
    b.expected = (int)count;
    b.aligned = false;
  } else if ((int)count != b.expected) {
    emu_named_fail(op, id, count, "thread counts differ within one phase: it started with %u", (unsigned)b.expected);
  }
  if (b.in[t]) emu_named_fail(op, id, count, "the thread arrives twice in one phase (%u of %u arrived)", (unsigned)b.arrived, (unsigned)b.expected);
  b.in[t] = true;
  b.aligned |= aligned;
  b.arrived++;
  emu_progress();
  if (b.arrived == b.expected) {
    if (b.aligned)
      for (unsigned w = 0; w * 32 < blockDim.x; ++w) {
        int in = 0, out = 0;
        for (unsigned l = w * 32; l < w * 32 + 32 && l < blockDim.x; ++l) {
          if (b.in[l]) in++;
          else if (!emu_fibers[l].done) out++;
        }
        if (in && out) emu_named_fail(op, id, count, "the phase completes with %u live lanes of warp %u not arrived (bar is .aligned: the whole warp takes part)", (unsigned)out, w);
      }
    b.gen++;
    b.arrived = b.expected = 0;
    std::fill(b.in.begin(), b.in.end(), false);
    return;
  }
  if (!wait) return;
  const unsigned g = b.gen;
  emu_block_until([&] { return b.gen != g; }, EmuWaitOn{wait && aligned ? "bar.sync %u, %u" : "barrier.sync %u, %u", id, count});
}

inline void __syncthreads() {
  if (emu_named[0].arrived) emu_fail("__syncthreads: named barrier 0 has a phase of another thread count in progress");
  emu_wait(emu_cta_bar);
}
inline int emu_lane() { return (int)(threadIdx.x & 31); }
inline int emu_warp() { return (int)(threadIdx.x >> 5); }
inline void emu_warp_sync() { emu_wait(emu_warp_bar[emu_warp()]); }

// ---- shared memory: one block at a time
constexpr unsigned EMU_SMEM = 232448;
extern "C" {
alignas(16) unsigned char smem[EMU_SMEM];
}

// ---- warp exchange scratch
struct EmuWarpX {
  unsigned addr[32];
  unsigned u[32][6];
  float c[32][4];
  float f[32];
};
static EmuWarpX emu_wx[32];

inline float __shfl_xor_sync(unsigned, float v, int m) {
  EmuWarpX& x = emu_wx[emu_warp()];
  x.f[emu_lane()] = v;
  emu_warp_sync();
  const float r = x.f[emu_lane() ^ m];
  emu_warp_sync();
  return r;
}
// __shfl_sync(mask, v, src): lane src's v in every lane (the whole warp takes part)
inline float __shfl_sync(unsigned, float v, int src) {
  EmuWarpX& x = emu_wx[emu_warp()];
  x.f[emu_lane()] = v;
  emu_warp_sync();
  const float r = x.f[src & 31];
  emu_warp_sync();
  return r;
}
inline int __shfl_sync(unsigned, int v, int src) {
  EmuWarpX& x = emu_wx[emu_warp()];
  x.u[emu_lane()][0] = (unsigned)v;
  emu_warp_sync();
  const int r = (int)x.u[src & 31][0];
  emu_warp_sync();
  return r;
}
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int m) {
  EmuWarpX& x = emu_wx[emu_warp()];
  x.u[emu_lane()][0] = v;
  emu_warp_sync();
  const unsigned r = x.u[emu_lane() ^ m][0];
  emu_warp_sync();
  return r;
}

// __syncthreads_or(pred): a barrier that returns whether pred was set in any thread. Call k of a
// thread uses accumulator k mod 3 and clears the one of call k + 1: every thread has read that one
// (in call k - 2) before it reached call k - 1's barrier, which this thread has passed, and none adds
// to it before call k's barrier completes, which needs this thread.
static int emu_or_acc[3];
static unsigned emu_or_calls[1024];
inline int __syncthreads_or(int pred) {
  const unsigned k = emu_or_calls[threadIdx.x]++;
  emu_or_acc[(k + 1) % 3] = 0;
  if (pred) emu_or_acc[k % 3] = 1;
  emu_wait(emu_cta_bar);
  return emu_or_acc[k % 3];
}
// __ballot_sync(mask, pred): bit i set when lane i's pred is (the whole warp takes part)
inline unsigned __ballot_sync(unsigned, int pred) {
  EmuWarpX& x = emu_wx[emu_warp()];
  x.u[emu_lane()][0] = pred != 0;
  emu_warp_sync();
  unsigned r = 0;
  for (int i = 0; i < 32; i++) r |= x.u[i][0] << i;
  emu_warp_sync();
  return r;
}
// __any_sync(mask, pred): whether any lane's pred is set (the whole warp takes part)
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
// __syncwarp(): the warp's lanes meet (the whole warp takes part)
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_sync(); }
// __ffs(x): the position of the least significant bit set, from 1; 0 for 0
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }

inline float atomicAdd(float* p, float v) {
  const float old = *p;  // fibers are cooperative: no interleaving inside
  *p = old + v;
  return old;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline unsigned atomicOr(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old | v;
  return old;
}
inline void __threadfence() {}  // blocks run one after another: every store is visible

// The bytes bulk reduce-adds may target, when the driver was given them
// (EMU_REDUCE_RANGE: the fp32 accumulators' arena addresses, up to two
// ranges): a reduce-add outside them fails the run (ws.h), where an add of
// zeros past an accumulator would otherwise change nothing a test reads.
static int emu_reduce_ranges = 0;
static char* emu_reduce_lo[2] = {nullptr, nullptr};
static char* emu_reduce_hi[2] = {nullptr, nullptr};
inline bool emu_reduce_inside(const char* dst, unsigned bytes) {
  for (int r = 0; r < emu_reduce_ranges; ++r)
    if (dst >= emu_reduce_lo[r] && dst + bytes <= emu_reduce_hi[r]) return true;
  return emu_reduce_ranges == 0;
}
