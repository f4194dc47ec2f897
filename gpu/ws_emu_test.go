package gpu

import (
	"encoding/binary"
	"math"
	"os"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/kernels"
)

// wsEmuSource holds the warp-specialization tests' kernels: ws_pipeline, a
// producer warp feeding two consumer warpgroups as the Hopper kernels of
// issue 24 will, and ws_misuse, one misuse of a primitive per mode. Its
// block of primitives is kernels.WarpSpecializedPrimitives (which the
// emulator replaces by testdata/emu/wstest.h).
var wsEmuSource = `typedef unsigned int u32;
typedef unsigned long long u64;
#define DEV static __device__ __forceinline__
struct __align__(64) TensorMap { unsigned long long w[16]; };
` + kernels.PrimitivesBegin + "\n" + kernels.WarpSpecializedPrimitives() + kernels.PrimitivesEnd + `

struct WsParams {
  TensorMap x;      // [tiles·16 rows][64 columns] bf16, boxes of 16 rows
  float* acc;       // [16·64] fp32: the consumers' bulk reduce-adds, (1 + 2)·x summed over the tiles
  unsigned* order;  // [2·tiles]: the consumer warpgroup (1, 2) of each product turn, then [2·tiles] the overlapping turns
  int tiles;        // tiles of x
  int mode;         // 0: as designed; otherwise one misuse (ws_emu_test.go)
  char pad[40];
};
static_assert(sizeof(WsParams) == 192, "WsParams layout");

// shared memory of ws_pipeline: the stages' tiles, each consumer warpgroup's fp32 tile for the
// reduce-add, the full and empty mbarriers of each stage, the ping-pong check's counters
constexpr u32 STAGES = 2, TILE = 16 * 128, RED = STAGES * TILE, BARS = RED + 2 * 4096, STATE = BARS + 8 * 2 * STAGES;

// ws_pipeline: 384 threads. Warpgroup 0 is the producer: its warps drop to 40 registers and
// thread 0 loads tile it into stage it mod 2 once both consumers have released the stage (its
// empty barrier). Warpgroups 1 and 2 (232 registers) wait for each tile (its full barrier), take
// turns at their "products" (named barriers 1 and 2 of 256 threads: a warpgroup waits on its own
// and arrives on the other's), release the stage, and add wg·tile into acc through their fp32
// tile in shared memory and one bulk reduce-add.
__global__ void __launch_bounds__(384, 1) ws_pipeline(const __grid_constant__ WsParams p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 base = smem_u32(smem_raw), full = base + BARS, empty = base + BARS + 8 * STAGES;
  unsigned* state = (unsigned*)(smem_raw + STATE);  // the warpgroup inside its turn, its threads inside
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (u32 s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, p.mode == 1 ? 3 * 128 : 2 * 128);  // every consumer thread arrives
    }
    state[0] = state[1] = 0;
    mbar_fence_init();
  }
  __syncthreads();
  if (wg == 0) {
    if (p.mode != 3) setmaxnreg_dec<40>();
    if (threadIdx.x == 0)
      for (int it = 0; it < p.tiles; ++it) {
        const u32 s = it % STAGES;
        mbar_wait(empty + 8 * s, ((it / STAGES) & 1) ^ 1);  // released (the first round passes at once)
        mbar_expect_tx(full + 8 * s, TILE);
        tma_load_4d(base + s * TILE, &p.x, full + 8 * s, 0, it * 16, 0, 0);
      }
    return;
  }
  if (p.mode == 2) setmaxnreg_inc<240>();
  else setmaxnreg_inc<232>();
  if (wg == 2 && p.mode != 4) bar_arrive(1, 256);  // warpgroup 1 takes the first turn
  float* red = (float*)(smem_raw + RED + (wg - 1) * 4096);
  for (int it = 0; it < p.tiles; ++it) {
    const u32 s = it % STAGES;
    mbar_wait(full + 8 * s, (it / STAGES) & 1);
    bar_sync(wg, 256);  // this warpgroup's turn
    if (state[1] != 0 && state[0] != (unsigned)wg) atomicAdd(&p.order[2 * p.tiles], 1u);
    state[0] = wg;
    state[1]++;
    if (t == 0) p.order[2 * it + wg - 1] = wg;
    float v[8];
    for (int j = 0; j < 8; ++j) {
      const int e = 8 * t + j, r = e / 64, c = e % 64;  // element (row r, column c) of the swizzled tile
      v[j] = __bfloat162float(*(const __nv_bfloat16*)(smem_raw + s * TILE + r * 128 + (((c / 8) ^ (r % 8)) << 4) + (c % 8) * 2));
      v[j] = __shfl_xor_sync(0xffffffffu, v[j], 0);  // stands for the warp-synchronous products
    }
    state[1]--;
    if (wg == 1 || it + 1 < p.tiles) bar_arrive(3 - wg, 256);  // the other's turn (warpgroup 2 has none to give after its last)
    mbar_arrive(empty + 8 * s);  // stage s read
    for (int j = 0; j < 8; ++j) red[8 * t + j] = wg * v[j];
    fence_proxy_async();         // the stores, before the bulk copy reads them
    bar_sync(2 + wg, 128);       // barriers 3, 4: the warpgroup's own
    if (t == 0) {
      bulk_reduce_add_f32(p.acc, smem_u32(red), 16 * 64 * 4);
      bulk_commit();
      if (p.mode == 5) bulk_wait_read<1>();  // misuse: red is rewritten while the copy may still read it
      else bulk_wait_read<0>();
    }
    bar_sync(2 + wg, 128);  // red free again
  }
  if (t == 0) bulk_wait<0>();
}

// ws_misuse: one misuse (or, mode 15, its correct counterpart) per mode.
__global__ void ws_misuse(const __grid_constant__ WsParams p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 base = smem_u32(smem_raw);
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  switch (p.mode) {
    case 10: bar_sync(1, 48); break;                                   // count not a multiple of 32
    case 11: bar_sync(1, threadIdx.x < 64 ? 128 : 64); break;          // counts differ in one phase
    case 12: bar_sync(16, 128); break;                                 // id out of range
    case 13: if (w < 2) bar_sync(1, 128); break;                       // warps 2, 3 never come
    case 14:                                                           // .aligned with a warp split over phases
    case 15: {                                                         // the same with barrier.sync: fine
      auto sync1 = [&] { if (p.mode == 14) bar_sync(1, 64); else barrier_sync(1, 64); };
      if (w == 1) { sync1(); sync1(); }
      else if (lane < 16) sync1();
      else { barrier_sync(2, 32); sync1(); }
      p.order[threadIdx.x] = 1;
      break;
    }
    case 16: bar_arrive(1, 128); bar_sync(1, 128); break;              // one thread arrives twice in a phase
    case 17: bar_arrive(1, 0); break;                                  // arrive with no count
    case 18: bar_sync(1, 256); break;                                  // more threads than the block
    case 19: if (w == 0) bar_sync(0, 64); else __syncthreads(); break; // barrier 0 with two counts
    case 20: setmaxnreg_dec<20>(); break;                              // below 24
    case 21: setmaxnreg_dec<100>(); break;                             // not a multiple of 8
    case 22: if (lane < 16) setmaxnreg_dec<40>(); else setmaxnreg_dec<48>(); break;  // lanes differ
    case 23: if (w == 0) setmaxnreg_dec<40>(); else setmaxnreg_dec<48>(); break;     // warps differ
    case 24: if (w != 3) setmaxnreg_dec<40>(); break;                  // warp 3 never executes it
    case 25: setmaxnreg_dec<40>(); break;                              // (96 threads) no whole warpgroup
    case 26: setmaxnreg_inc<160>(); break;                             // (384 threads) .inc below the budget of 168
    case 27: setmaxnreg_dec<176>(); break;                             // (384 threads) .dec above it
    case 28:                                                           // a reduce-add never waited for
      if (threadIdx.x == 0) { bulk_reduce_add_f32(p.acc, base, 64); bulk_commit(); }
      break;
    case 29: if (threadIdx.x == 0) bulk_reduce_add_f32(p.acc, base, 8); break;  // 8 bytes
    case 30:                                                           // a consumer arrives on a full barrier
      if (threadIdx.x == 0) mbar_init(base, 1);
      __syncthreads();
      if (threadIdx.x == 0) mbar_expect_tx(base, TILE);                // the producer's arrival, bytes pending
      __syncthreads();
      if (threadIdx.x == 1) mbar_arrive(base);
      break;
  }
}
`

// wsEmuTiles is the number of tiles ws_pipeline streams (three rounds of
// its two stages).
const wsEmuTiles = 6

// wsEmuSkip skips t unless FLASHATTN_EMU or FLASHATTN_BWD_EMU is set (and
// g++ is available).
func wsEmuSkip(t *testing.T) {
	t.Helper()
	env := "FLASHATTN_EMU"
	if os.Getenv(env) == "" && os.Getenv("FLASHATTN_BWD_EMU") != "" {
		env = "FLASHATTN_BWD_EMU"
	}
	emuSkip(t, env, "warp-specialization test")
}

// wsEmuX is element (r, c) of ws_pipeline's input: a small integer, exact
// in bf16 and in every fp32 sum of the test.
func wsEmuX(r, c int) float32 { return float32((r*7+c*3)%17 - 8) }

// wsEmuCall is the arena and parameters of one run: x, a zero acc and a
// zero order, and the addresses of acc and order.
func wsEmuCall(mode int) (ar *emuArena, params []byte, acc, order uint64) {
	ar = &emuArena{}
	rows := wsEmuTiles * 16
	x := make([]byte, rows*64*2)
	for r := 0; r < rows; r++ {
		for c := 0; c < 64; c++ {
			binary.LittleEndian.PutUint16(x[2*(r*64+c):], uint16(math.Float32bits(wsEmuX(r, c))>>16))
		}
	}
	xa := ar.put(x)
	acc = ar.put(make([]byte, 16*64*4))
	order = ar.put(make([]byte, 4*384))
	m := emuTensorMap(kernels.TMATensor{Addr: xa, Cols: 64, Rows: uint64(rows), Heads: 1, B: 1, Strides: [3]uint64{128, 16, 16}, BoxRows: 16})
	params = make([]byte, 192)
	copy(params, m[:])
	binary.LittleEndian.PutUint64(params[128:], acc)
	binary.LittleEndian.PutUint64(params[136:], order)
	binary.LittleEndian.PutUint32(params[144:], wsEmuTiles)
	binary.LittleEndian.PutUint32(params[148:], uint32(mode))
	return ar, params, acc, order
}

// wsEmuBinary compiles the tests' kernels on the emulator.
func wsEmuBinary(t *testing.T) string {
	t.Helper()
	return emuBinary(t, wsEmuSource, "wstest.h", emuDriver("WsParams", []string{"x.w[0]", "acc", "order"}, []string{"ws_pipeline", "ws_misuse"}))
}

// TestWarpSpecializedEmulated runs ws_pipeline as designed on the
// emulator: every tile reaches both consumers through the two stages, the
// consumers take strictly alternating turns that never overlap, and acc
// holds the sum of their bulk reduce-adds, (1 + 2)·x over the tiles.
func TestWarpSpecializedEmulated(t *testing.T) {
	wsEmuSkip(t)
	bin := wsEmuBinary(t)
	ar, params, acc, order := wsEmuCall(0)
	emuExec(t, bin, "ws_pipeline", params, ar, []emuLaunch{{"ws_pipeline", [3]int{2, 1, 1}, 384}}, nil)
	got := ar.at(acc, 16*64*4)
	for e := 0; e < 16*64; e++ {
		var want float32
		for it := 0; it < wsEmuTiles; it++ {
			want += 3 * wsEmuX(16*it+e/64, e%64)
		}
		want *= 2 // two blocks add into acc
		if g := math.Float32frombits(binary.LittleEndian.Uint32(got[4*e:])); g != want {
			t.Fatalf("acc[%d] = %v, want %v", e, g, want)
		}
	}
	turns := ar.at(order, 4*(2*wsEmuTiles+1))
	for i := 0; i < 2*wsEmuTiles; i++ {
		if g := binary.LittleEndian.Uint32(turns[4*i:]); g != uint32(1+i%2) {
			t.Fatalf("turn %d went to warpgroup %d, want %d", i, g, 1+i%2)
		}
	}
	if g := binary.LittleEndian.Uint32(turns[4*2*wsEmuTiles:]); g != 0 {
		t.Fatalf("%d turns overlapped another warpgroup's", g)
	}
}

// TestWarpSpecializedBarrierSplitEmulated runs ws_misuse's mode 15: lanes
// of one warp reach a non-aligned named barrier (barrier.sync) in
// different phases, which is allowed; every thread gets through.
func TestWarpSpecializedBarrierSplitEmulated(t *testing.T) {
	wsEmuSkip(t)
	bin := wsEmuBinary(t)
	ar, params, _, order := wsEmuCall(15)
	emuExec(t, bin, "ws_misuse", params, ar, []emuLaunch{{"ws_misuse", [3]int{1, 1, 1}, 96}}, nil)
	done := ar.at(order, 4*96)
	for i := 0; i < 96; i++ {
		if binary.LittleEndian.Uint32(done[4*i:]) != 1 {
			t.Fatalf("thread %d did not get through", i)
		}
	}
}

// TestWarpSpecializedMisuseEmulated runs each misuse of a primitive and
// checks the emulator fails with its message.
func TestWarpSpecializedMisuseEmulated(t *testing.T) {
	wsEmuSkip(t)
	bin := wsEmuBinary(t)
	cases := []struct {
		name    string
		kernel  string
		threads int
		mode    int
		want    []string
	}{
		{"empty-count-never-reached", "ws_pipeline", 384, 1, []string{"deadlock", "mbarrier.try_wait.parity", "arrivals"}},
		{"registers-over-the-pool", "ws_pipeline", 384, 2, []string{"deadlock", "setmaxnreg.inc 240", "free in the block's pool"}},
		{"producer-keeps-registers", "ws_pipeline", 384, 3, []string{"deadlock", "setmaxnreg.inc 232"}},
		{"ping-pong-without-first-turn", "ws_pipeline", 384, 4, []string{"deadlock", "bar.sync 1, 256", "bar.sync 2, 256"}},
		{"reduce-source-rewritten", "ws_pipeline", 384, 5, []string{"cp.reduce.async.bulk: shared source", "changed before cp.async.bulk.wait_group"}},
		{"count-not-warps", "ws_misuse", 128, 10, []string{"bar.sync 1, 48", "not a multiple of the warp size"}},
		{"counts-differ", "ws_misuse", 128, 11, []string{"bar.sync 1, 64 (thread 64)", "thread counts differ within one phase: it started with 128"}},
		{"id-out-of-range", "ws_misuse", 128, 12, []string{"bar.sync 16, 128", "out of range 0..15"}},
		{"warps-never-come", "ws_misuse", 128, 13, []string{"deadlock", "bar.sync 1, 128", "returned", "named barrier 1: 64 of 128"}},
		{"aligned-warp-split", "ws_misuse", 96, 14, []string{"bar.sync 1, 64", "live lanes of warp 0 not arrived"}},
		{"arrive-twice", "ws_misuse", 128, 16, []string{"arrives twice in one phase"}},
		{"arrive-count-zero", "ws_misuse", 128, 17, []string{"bar.arrive 1, 0", "thread count 0"}},
		{"count-above-block", "ws_misuse", 128, 18, []string{"above the block's 128 threads"}},
		{"barrier0-two-counts", "ws_misuse", 128, 19, []string{"__syncthreads: named barrier 0"}},
		{"setmaxnreg-below-24", "ws_misuse", 128, 20, []string{"setmaxnreg.dec.sync.aligned.u32 20", "multiple of 8 in 24..256"}},
		{"setmaxnreg-not-8", "ws_misuse", 128, 21, []string{"setmaxnreg.dec.sync.aligned.u32 100", "multiple of 8 in 24..256"}},
		{"setmaxnreg-lanes-differ", "ws_misuse", 128, 22, []string{"setmaxnreg.dec.sync.aligned.u32 48", "of the warp executes another one"}},
		{"setmaxnreg-warps-differ", "ws_misuse", 128, 23, []string{"another warp of warpgroup 0 executes setmaxnreg.dec 40 there"}},
		{"setmaxnreg-warp-missing", "ws_misuse", 128, 24, []string{"warp 3 executed it 0 times", "every warp of a warpgroup"}},
		{"setmaxnreg-partial-warpgroup", "ws_misuse", 96, 25, []string{"not whole warpgroups"}},
		{"setmaxnreg-inc-below", "ws_misuse", 384, 26, []string{".inc below the warp's budget of 168"}},
		{"setmaxnreg-dec-above", "ws_misuse", 384, 27, []string{".dec above the warp's budget of 168"}},
		{"reduce-never-waited", "ws_misuse", 128, 28, []string{"thread 0 ends with 0 copies uncommitted and 1 groups not waited for"}},
		{"reduce-size", "ws_misuse", 128, 29, []string{"size not a nonzero multiple of 16 bytes"}},
		{"mbarrier-extra-arrival", "ws_misuse", 128, 30, []string{"mbarrier.arrive: mbarrier 0 gets more arrivals than its count 1 in phase 0 (thread 1)"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ar, params, _, _ := wsEmuCall(c.mode)
			out, err := emuRun(t, bin, params, ar, []emuLaunch{{c.kernel, [3]int{1, 1, 1}, c.threads}}, nil)
			if err == nil {
				t.Fatalf("the emulator ran the misuse without failing")
			}
			for _, w := range c.want {
				if !strings.Contains(string(out), w) {
					t.Errorf("emulator output lacks %q:\n%s", w, out)
				}
			}
		})
	}
}
