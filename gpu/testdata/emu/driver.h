// The emulator's main, included after the kernels. The including source
// defines EMU_PARAMS (the kernels' parameter struct), EMU_RELOC (the RELOC
// list of its device pointers) and EMU_KERNELS (the table of kernels by
// name); it may define EMU_PARAMS2, EMU_RELOC2 and EMU_KERNELS2 for kernels
// that take a second parameter struct, read from the params file's name
// with ".<kernel>" appended. Command line: params file, arena in, arena
// out, then launches as "kernel gx gy gz threads". Pointers in the
// parameters are addresses in an arena that starts at 1<<32; they are moved
// to the arena's host copy.
#include <functional>
#include <type_traits>
#include <string>
static std::function<void()> emu_body;
static void emu_tramp() {
  emu_body();
  emu_cur->done = true;
  emu_progress();
  emu_live_cta--;
  emu_live_warp[emu_cur->tid.x >> 5]--;
  if (!emu_switch()) setcontext(&emu_main);
  emu_fail("finished thread resumed");
}
static void emu_run(std::function<void()> body, emu_dim3 grid, unsigned threads) {
  static std::vector<char*> stacks;
  while (stacks.size() < threads) stacks.push_back((char*)malloc(EMU_STACK));
  emu_body = body;
  gridDim = grid;
  blockDim = emu_dim3{threads, 1, 1};
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = emu_dim3{x, y, z};
        memset(smem, 0xFF, EMU_SMEM);
        memset(emu_or_calls, 0, sizeof emu_or_calls);  // __syncthreads_or: every thread from call 0
        memset(emu_or_acc, 0, sizeof emu_or_acc);
        emu_fibers.assign(threads, EmuFiber{});
        emu_cta_bar = EmuBarrier{0, (int)threads, 0, &emu_live_cta, "__syncthreads"};
        emu_live_cta = threads;
        for (int w = 0; w < 32; ++w) {
          emu_warp_bar[w] = EmuBarrier{0, 32, 0, &emu_live_warp[w], "a warp-synchronous instruction of warp %u"};
          emu_live_warp[w] = 32;
        }
        emu_idle = 0;
        for (unsigned i = 0; i < threads; ++i) {
          EmuFiber& f = emu_fibers[i];
          f.tid = emu_dim3{i, 0, 0};
          f.done = false;
          f.stack = stacks[i];
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack;
          f.ctx.uc_stack.ss_size = EMU_STACK;
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, emu_tramp, 0);
        }
        for (auto start : emu_block_start) start();
        emu_cur_i = 0;
        emu_cur = &emu_fibers[0];
        swapcontext(&emu_main, &emu_fibers[0].ctx);
        for (auto& f : emu_fibers)
          if (!f.done) emu_fail("block ended with unfinished threads");
        for (auto end : emu_block_end) end();
      }
}
static std::vector<char> emu_read(const char* path) {
  FILE* f = fopen(path, "rb");
  if (!f) emu_fail("open input");
  std::vector<char> b;
  char buf[1 << 16];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) b.insert(b.end(), buf, buf + n);
  fclose(f);
  return b;
}
// emu_params reads a parameter struct of type P from path.
template <class P>
static P emu_params(const std::string& path) {
  std::vector<char> pb = emu_read(path.c_str());
  if (pb.size() != sizeof(P)) emu_fail("params size differs from the parameter struct");
  P p;
  memcpy(&p, pb.data(), sizeof p);
  return p;
}
int main(int argc, char** argv) {
  if (argc < 9 || (argc - 4) % 5 != 0) emu_fail("usage: params arena out (kernel gx gy gz threads)...");
  EMU_PARAMS p = emu_params<EMU_PARAMS>(argv[1]);
  std::vector<char> ab = emu_read(argv[2]);
  char* arena = (char*)aligned_alloc(256, (ab.size() + 255) / 256 * 256 + 256);
  memcpy(arena, ab.data(), ab.size());
  const unsigned long long base = 1ull << 32;
  if (const char* r = getenv("EMU_REDUCE_RANGE")) {  // "lo hi [lo hi]": arena addresses of the bytes reduce-adds may target
    unsigned long long lo[2] = {0, 0}, hi[2] = {0, 0};
    const int got = sscanf(r, "%llu %llu %llu %llu", &lo[0], &hi[0], &lo[1], &hi[1]);
    if (got != 2 && got != 4) emu_fail("EMU_REDUCE_RANGE: want one or two pairs of arena addresses");
    emu_reduce_ranges = got / 2;
    for (int k = 0; k < emu_reduce_ranges; ++k) {
      if (lo[k] < base || hi[k] < lo[k]) emu_fail("EMU_REDUCE_RANGE: want arena addresses, lo <= hi");
      emu_reduce_lo[k] = arena + (lo[k] - base);
      emu_reduce_hi[k] = arena + (hi[k] - base);
    }
  }
#define RELOC(f) if (p.f) p.f = (std::remove_reference_t<decltype(p.f)>)(arena + ((unsigned long long)p.f - base));
  EMU_RELOC
  struct { const char* name; void (*fn)(const EMU_PARAMS); } table[] = {EMU_KERNELS};
  for (int i = 4; i + 4 < argc; i += 5) {
    const emu_dim3 grid{(unsigned)atoi(argv[i + 1]), (unsigned)atoi(argv[i + 2]), (unsigned)atoi(argv[i + 3])};
    const unsigned threads = (unsigned)atoi(argv[i + 4]);
    void (*fn)(const EMU_PARAMS) = nullptr;
    for (auto& e : table) if (!strcmp(e.name, argv[i])) fn = e.fn;
    if (fn) {
      emu_run([&] { fn(p); }, grid, threads);
      continue;
    }
#ifdef EMU_PARAMS2
    struct { const char* name; void (*fn)(const EMU_PARAMS2); } table2[] = {EMU_KERNELS2};
    void (*fn2)(const EMU_PARAMS2) = nullptr;
    for (auto& e : table2) if (!strcmp(e.name, argv[i])) fn2 = e.fn;
    if (fn2) {
      EMU_PARAMS2 p2 = emu_params<EMU_PARAMS2>(std::string(argv[1]) + "." + argv[i]);
      {
#define RELOC2(f) if (p2.f) p2.f = (std::remove_reference_t<decltype(p2.f)>)(arena + ((unsigned long long)p2.f - base));
        EMU_RELOC2
      }
      emu_run([&] { fn2(p2); }, grid, threads);
      continue;
    }
#endif
    emu_fail("unknown kernel");
  }
  FILE* f = fopen(argv[3], "wb");
  if (!f) emu_fail("open output");
  fwrite(arena, 1, ab.size(), f);
  fclose(f);
  return 0;
}
