package gpu

import (
	"encoding/binary"
	"testing"

	"github.com/flashattn/flashattn/cuda"
)

// mbarrierHandoffSource is the handoff the warp-specialized kernels build
// on, alone: warp 0 writes a stage of shared memory with plain stores and
// each lane arrives on the stage's full mbarrier; warp 1 waits for the
// phase, reads what another lane wrote and arrives on the stage's empty
// mbarrier, which warp 0 waits for before it writes the stage again. Two
// stages, rounds steps. out[lane] is warp 1's sum.
const mbarrierHandoffSource = `typedef unsigned int u32;
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count)); }
__device__ __forceinline__ void mbar_arrive(u32 bar) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory"); }
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// mode 0: every lane of warp 0 arrives plainly; 1: lane 0 arrives with expect_tx and a bulk copy of
// 16 bytes completes the phase (the kernels' producer warp); 2: as 1, lane 0 arriving plainly too;
// 3: warp 1 releases a stage as the kernels' compute warps do, lane 0 arriving once the warp met
// (__syncwarp) after every lane's read
struct HandoffArgs { int* out; const int* src; int rounds, mode; };
extern "C" __global__ void mbar_handoff(const HandoffArgs a) {
  int* const out = a.out;
  const int rounds = a.rounds, mode = a.mode;
  __shared__ alignas(16) int landed[2][4];
  __shared__ alignas(8) unsigned long long bars[4];  // full[2], empty[2]
  __shared__ int buf[2][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const u32 full = (u32)__cvta_generic_to_shared(&bars[0]), empty = full + 16;
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) { mbar_init(full + 8 * s, mode == 2 ? 33 : 32); mbar_init(empty + 8 * s, mode == 3 ? 1 : 32); }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (warp == 0) {
    for (int it = 0; it < rounds; ++it) {
      const int s = it & 1;
      if (it >= 2) mbar_wait(empty + 8 * s, ((it >> 1) - 1) & 1);
      buf[s][lane] = it * 32 + lane;
      if (mode == 0 || mode == 3 || lane > 0) {
        mbar_arrive(full + 8 * s);
      } else {
        if (mode == 2) mbar_arrive(full + 8 * s);
        mbar_expect_tx(full + 8 * s, 16);
        bulk_load((u32)__cvta_generic_to_shared(&landed[s][0]), a.src, 16, full + 8 * s);
      }
    }
  } else {
    int sum = 0;
    for (int it = 0; it < rounds; ++it) {
      const int s = it & 1;
      mbar_wait(full + 8 * s, (it >> 1) & 1);
      sum += buf[s][(lane + 1) % 32] + (mode == 1 || mode == 2 ? landed[s][lane % 4] : 0);
      if (mode == 3) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + 8 * s);
      } else {
        mbar_arrive(empty + 8 * s);
      }
    }
    out[lane] = sum;
  }
}
`

// TestMbarrierHandoff runs the mbarrier handoffs of the warp-specialized
// kernels alone (mbarrierHandoffSource), one subtest a mode, and checks
// every value arrived. Run under compute-sanitizer's racecheck, a subtest
// tells whether the tool follows that handoff's order: every mode is
// ordered by the PTX memory model (an arrive releases, the wait acquires,
// __syncwarp orders a warp's lanes), and racecheck reports hazards only
// for release-by-lane-0, where the other lanes' reads reach the arrival
// through the warp barrier. The kernels therefore have every thread that
// reads a stage arrive on its empty barrier itself. Skips without a GPU.
func TestMbarrierHandoff(t *testing.T) {
	dev, s := bwdTestDevice(t)
	if !hopperCapable(dev) {
		t.Skip("mbarrier try_wait needs sm_90")
	}
	mod, err := dev.Compile(cuda.CompileRequest{Name: "mbar_handoff.cu", Source: mbarrierHandoffSource})
	if err != nil {
		t.Fatal(err)
	}
	fn, err := mod.Function("mbar_handoff")
	if err != nil {
		t.Fatal(err)
	}
	out, err := dev.Alloc(32 * 4)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Free()
	src, err := dev.Alloc(16)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Free()
	words := []byte{1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0}
	if err := dev.CopyToDevice(src, 0, words); err != nil {
		t.Fatal(err)
	}
	for _, mode := range []struct {
		name string
		id   uint32
	}{{"plain-arrivals", 0}, {"expect-tx-bulk-copy", 1}, {"expect-tx-bulk-copy-and-arrival", 2}, {"release-by-lane-0", 3}} {
		t.Run(mode.name, func(t *testing.T) {
			const rounds = 64
			args := make([]byte, 24) // HandoffArgs: out, src (8 bytes each), rounds, mode (4 each)
			binary.LittleEndian.PutUint64(args, out.Ptr())
			binary.LittleEndian.PutUint64(args[8:], src.Ptr())
			binary.LittleEndian.PutUint32(args[16:], rounds)
			binary.LittleEndian.PutUint32(args[20:], mode.id)
			if err := dev.Launch(fn, [3]uint32{1, 1, 1}, [3]uint32{64, 1, 1}, 0, s, args); err != nil {
				t.Fatal(err)
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, 32*4)
			if err := dev.CopyFromDevice(got, out, 0); err != nil {
				t.Fatal(err)
			}
			for lane := range 32 {
				want := int32(32*rounds*(rounds-1)/2 + rounds*((lane+1)%32))
				if mode.id == 1 || mode.id == 2 {
					want += int32(rounds * (lane%4 + 1))
				}
				if g := int32(binary.LittleEndian.Uint32(got[4*lane:])); g != want {
					t.Errorf("lane %d: sum %d, want %d", lane, g, want)
				}
			}
		})
	}
}
