// Host emulation of the mbarriers and the tensor memory accelerator's bulk
// tensor copies, included by the Hopper block of a tensor-map variant (see
// backward_emu_test.go). TensorMap is the generated 128-byte struct; the
// test fills it with its own encoding, not the driver's: words 0-8 hold the
// tensor's address, its extents (columns, rows, heads, batch), its byte
// strides (rows, heads, batch) and the box's rows (boxes are 64 columns).
//
// A copy lands at once, when its thread issues it, and completes its bytes
// on its barrier then; a wait that cannot succeed yields to the other
// threads, and fails when it never can (shim.h's deadlock detection, which
// lists the barriers with a phase in progress). Plain arrivals (mbar_arrive,
// ws.h) make the consumer side of a pipeline: consumers arrive on a stage's
// "empty" barrier, the producer waits on its parity before reusing the stage.
#include <map>
#define EMU_TMA_H 1  // (ws.h's bulk tensor store needs TensorMap)

// EmuMbar is one mbarrier: arrivals still pending in the current phase (of
// count per phase), transaction bytes still expected, completed phases.
struct EmuMbar {
  int count = 0, pending = 0;
  long long tx = 0;
  unsigned phase = 0;
};
static std::map<unsigned, EmuMbar> emu_mbars;  // by shared address; mbar_init starts one afresh
inline EmuMbar& emu_mbar(unsigned bar) {
  auto it = emu_mbars.find(bar);
  if (it == emu_mbars.end()) emu_fail("mbarrier used before mbar_init");
  return it->second;
}
inline void emu_mbar_settle(EmuMbar& m) {
  if (m.tx < 0) emu_fail("mbarrier: more bytes completed than announced");
  emu_progress();
  if (m.pending == 0 && m.tx == 0) {
    m.phase++;
    m.pending = m.count;
  }
}
static std::string emu_mbar_note() {
  std::string s;
  for (auto& [a, m] : emu_mbars)
    if (m.pending != m.count || m.tx != 0)
      s += "\n  mbarrier " + std::to_string(a) + ": phase " + std::to_string(m.phase) + ", " + std::to_string(m.pending) + " of " +
           std::to_string(m.count) + " arrivals and " + std::to_string(m.tx) + " bytes pending";
  return s;
}
static const bool emu_mbar_noted = (emu_deadlock_notes.push_back(emu_mbar_note), true);
inline void mbar_init(u32 bar, u32 count) {
  emu_smem_check(bar, 8, "mbarrier misaligned or out of range");
  if (count == 0) emu_fail("mbarrier.init: count 0");
  emu_mbars[bar] = EmuMbar{(int)count, (int)count, 0, 0};
  emu_progress();
}
inline void mbar_fence_init() {}
inline void emu_mbar_arrive(u32 bar, u32 bytes, const char* what) {
  EmuMbar& m = emu_mbar(bar);
  m.tx += bytes;
  if (--m.pending < 0) {
    char msg[200];
    snprintf(msg, sizeof msg, "%s: mbarrier %u gets more arrivals than its count %d in phase %u (thread %u)", what, bar, m.count, m.phase, threadIdx.x);
    emu_fail(msg);
  }
  emu_mbar_settle(m);
}
inline void mbar_expect_tx(u32 bar, u32 bytes) { emu_mbar_arrive(bar, bytes, "mbarrier.arrive.expect_tx"); }
// true once the phase of this parity has completed (the current phase's parity differs)
inline bool emu_mbar_done(u32 bar, u32 parity) { return (emu_mbar(bar).phase & 1u) != parity; }
// a test that fails yields once: a kernel's own loop on it cannot spin forever
inline bool mbar_try_wait(u32 bar, u32 parity) {
  if (emu_mbar_done(bar, parity)) return true;
  emu_yield_blocked(EmuWaitOn{"mbarrier.try_wait.parity %u, parity %u", bar, parity});
  return emu_mbar_done(bar, parity);
}
inline void mbar_wait(u32 bar, u32 parity) {
  emu_block_until([&] { return emu_mbar_done(bar, parity); }, EmuWaitOn{"mbarrier.try_wait.parity %u, parity %u", bar, parity});
}

// tma_load_4d copies the box of 64 columns from c0 and the map's box rows
// from c1 (head c2, batch element c3) into the 128-byte swizzled tile at
// dst (1024-byte aligned): row r at r·128, 16-byte chunk c at c ^ (r mod 8);
// elements outside the tensor read as zero and count as bytes.
inline void tma_load_4d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2, int c3) {
  const unsigned long long* w = map->w;
  const unsigned char* base = (const unsigned char*)w[0];
  const long long cols = (long long)w[1], rows = (long long)w[2], heads = (long long)w[3], batch = (long long)w[4];
  const long long sr = (long long)w[5], sh = (long long)w[6], sb = (long long)w[7];
  const int box = (int)w[8];
  if (dst % 1024 != 0 || dst + (unsigned long long)box * 128 > EMU_SMEM) {
    char msg[160];
    snprintf(msg, sizeof msg, "tma: box of %d rows at shared address %u not 1024-byte aligned or out of shared memory (block %u %u %u, thread %u)",
             box, dst, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
    emu_fail(msg);
  }
  if (c0 % 8 != 0) emu_fail("tma: box start column not 16-byte aligned (the device stops with an illegal instruction)");
  for (int r = 0; r < box; ++r)
    for (int ch = 0; ch < 8; ++ch) {
      unsigned char chunk[16] = {0};
      for (int e = 0; e < 8; ++e) {
        const long long col = c0 + 8 * ch + e, row = c1 + r;
        if (col < cols && row >= 0 && row < rows && c2 >= 0 && c2 < heads && c3 >= 0 && c3 < batch)
          memcpy(chunk + 2 * e, base + row * sr + c2 * sh + c3 * sb + col * 2, 2);
      }
      memcpy(smem + dst + r * 128 + ((ch ^ (r & 7)) << 4), chunk, 16);
    }
  EmuMbar& m = emu_mbar(bar);
  m.tx -= (long long)box * 128;
  emu_mbar_settle(m);
}
template <int ROWS, int ATOMS>
inline void tma_rows(u32 dst, const TensorMap* map, u32 bar, int row0, int head, int batch, int col0 = 0) {
  if ((int)map->w[8] != ROWS) emu_fail("tma: the map's box rows differ from the tile's");
  for (int a = 0; a < ATOMS; ++a) tma_load_4d(dst + a * ROWS * 128, map, bar, col0 + a * 64, row0, head, batch);
}
