package gpu

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// The forward host emulator compiles a generated forward kernel with g++
// against testdata/bwdemu/shim.h (every CUDA thread a fiber, barriers and
// warp instructions switching fibers, shared memory filled with NaN before
// each block) and testdata/fwdemu/prims.h (C++ versions of the kernel's
// inline-PTX primitives, with the alignment rules of ldmatrix and cp.async
// checked), then runs the launch plan ForwardDevice would enqueue. It checks
// indexing, masking, layouts and barriers without a GPU, not speed. It is
// slow, so it runs only when FLASHATTN_FWD_EMU is set.

const fwdEmuBase = 1 << 32 // fake device address of the arena's first byte
const fwdEmuGuard = 512    // poisoned bytes on each side of an output

// fwdArena lays out the tensors of one emulated call in one buffer.
type fwdArena struct{ b []byte }

func (e *fwdArena) put(data []byte) uint64 {
	off := (len(e.b) + 255) / 256 * 256
	e.b = append(e.b, make([]byte, off-len(e.b))...)
	e.b = append(e.b, data...)
	return fwdEmuBase + uint64(off)
}

// fwdBytes returns the elements of t in row-major logical order as bytes.
func fwdBytes(t attn.Tensor) []byte {
	c := attn.New(t.DType, t.Shape...)
	for i, x := range t.Float32s() {
		c.Store(i, x)
	}
	if t.DType == attn.Float32 {
		return append([]byte(nil), cuda.AsBytes(c.F32)...)
	}
	return append([]byte(nil), cuda.AsBytes(c.Bits)...)
}

var fwdEmuBuild sync.Mutex

// fwdEmuBinary compiles the emulator for src (cached by content).
func fwdEmuBinary(t *testing.T, src string) string {
	t.Helper()
	shim, err := os.ReadFile("testdata/bwdemu/shim.h")
	if err != nil {
		t.Fatal(err)
	}
	prims, err := os.ReadFile("testdata/fwdemu/prims.h")
	if err != nil {
		t.Fatal(err)
	}
	i := strings.Index(src, kernels.PrimitivesBegin)
	j := strings.Index(src, kernels.PrimitivesEnd)
	if i < 0 || j < i {
		t.Fatalf("generated source lacks the primitives markers")
	}
	src = src[:i] + "#include \"prims.h\"\n" + src[j:]
	full := "#include \"shim.h\"\n" + src + fwdEmuDriver
	h := sha256.Sum256([]byte(full + string(shim) + string(prims)))
	dir := filepath.Join(os.TempDir(), "flashattn-fwdemu")
	bin := filepath.Join(dir, hex.EncodeToString(h[:8]))
	fwdEmuBuild.Lock()
	defer fwdEmuBuild.Unlock()
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string][]byte{"shim.h": shim, "prims.h": prims} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cc := bin + ".cc"
	if err := os.WriteFile(cc, []byte(full), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("g++", "-std=c++20", "-O1", "-w", "-I", dir, "-o", bin+".tmp", cc).CombinedOutput()
	if err != nil {
		t.Fatalf("g++: %v\n%s", err, out)
	}
	if err := os.Rename(bin+".tmp", bin); err != nil {
		t.Fatal(err)
	}
	return bin
}

// fwdEmuDriver is the emulator's main: params file, arena in, arena out,
// grid x y z, threads.
const fwdEmuDriver = `
static const Params* emu_params;
static void emu_tramp() {
  flash_fwd(*emu_params);
  emu_cur->done = true;
  emu_live_cta--;
  emu_live_warp[emu_cur->tid.x >> 5]--;
  if (!emu_switch()) setcontext(&emu_main);
  emu_fail("finished thread resumed");
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
int main(int argc, char** argv) {
  if (argc != 8) emu_fail("usage: params arena out gx gy gz threads");
  std::vector<char> pb = emu_read(argv[1]);
  if (pb.size() != sizeof(Params)) emu_fail("params size differs from sizeof(Params)");
  Params p;
  memcpy(&p, pb.data(), sizeof p);
  std::vector<char> ab = emu_read(argv[2]);
  char* arena = (char*)aligned_alloc(256, (ab.size() + 255) / 256 * 256 + 256);
  memcpy(arena, ab.data(), ab.size());
  const unsigned long long base = 1ull << 32;
#define RELOC(f) if (p.f) p.f = (u64)(arena + (p.f - base));
  RELOC(q) RELOC(k) RELOC(v) RELOC(o) RELOC(lse) RELOC(bias) RELOC(cu_q) RELOC(cu_k)
  const emu_dim3 grid{(unsigned)atoi(argv[4]), (unsigned)atoi(argv[5]), (unsigned)atoi(argv[6])};
  const unsigned threads = (unsigned)atoi(argv[7]);
  std::vector<char*> stacks;
  while (stacks.size() < threads) stacks.push_back((char*)malloc(EMU_STACK));
  emu_params = &p;
  gridDim = grid;
  blockDim = emu_dim3{threads, 1, 1};
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = emu_dim3{x, y, z};
        memset(smem, 0xFF, EMU_SMEM);
        emu_fibers.assign(threads, EmuFiber{});
        emu_cta_bar = EmuBarrier{0, (int)threads, 0, &emu_live_cta};
        emu_live_cta = threads;
        for (int w = 0; w < 32; ++w) { emu_warp_bar[w] = EmuBarrier{0, 32, 0, &emu_live_warp[w]}; emu_live_warp[w] = 32; }
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
        emu_cur_i = 0;
        emu_cur = &emu_fibers[0];
        swapcontext(&emu_main, &emu_fibers[0].ctx);
        for (auto& f : emu_fibers)
          if (!f.done) emu_fail("block ended with unfinished threads");
      }
  FILE* f = fopen(argv[3], "wb");
  fwrite(arena, 1, ab.size(), f);
  fclose(f);
  return 0;
}
`

// fwdEmuRun runs one forward call on the host emulator and returns O and
// LSE, checking that the guard bands around them are untouched and that
// every element was written (the outputs start as NaN).
func fwdEmuRun(t *testing.T, q, k, v attn.Tensor, opt attn.Options) (attn.Result, kernels.Variant) {
	t.Helper()
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		t.Fatal(err)
	}
	dt := q.DType
	ar := &fwdArena{}
	dev := func(x attn.Tensor) DeviceTensor {
		return DeviceTensor{DType: x.DType, Shape: x.Shape, Strides: attn.ContiguousStrides(x.Shape), base: ar.put(fwdBytes(x))}
	}
	dq, dk, dv := dev(q), dev(k), dev(v)
	var bias *DeviceTensor
	if opt.Bias != nil {
		b := dev(opt.Bias.Tensor)
		bias = &b
	}
	var cuq, cuk uint64
	if p.Varlen {
		cuq = ar.put(append([]byte(nil), cuda.AsBytes(opt.CuSeqlensQ)...))
		cuk = ar.put(append([]byte(nil), cuda.AsBytes(opt.CuSeqlensK)...))
	}
	type out struct {
		shape []int
		dt    attn.DType
		addr  uint64
		n     int
	}
	guarded := func(shape []int, odt attn.DType) out {
		n := attn.NumElements(shape) * odt.Size()
		return out{shape, odt, ar.put(bytes.Repeat([]byte{0xff}, n+2*fwdEmuGuard)), n}
	}
	oo, lo := guarded(p.OutputShape(), dt), guarded(p.LSEShape(), attn.Float32)
	do := DeviceTensor{DType: dt, Shape: oo.shape, Strides: attn.ContiguousStrides(oo.shape), base: oo.addr + fwdEmuGuard}
	dl := DeviceTensor{DType: attn.Float32, Shape: lo.shape, Strides: attn.ContiguousStrides(lo.shape), base: lo.addr + fwdEmuGuard}
	l, err := plan(p, dt, dq, dk, dv, do, dl, bias, cuq, cuk, nil)
	if err != nil {
		t.Fatalf("plan: %v", err)
	}
	src, err := l.v.Source()
	if err != nil {
		t.Fatal(err)
	}
	bin := fwdEmuBinary(t, src)
	dir := t.TempDir()
	pf, af, of := filepath.Join(dir, "params"), filepath.Join(dir, "arena"), filepath.Join(dir, "out")
	if err := os.WriteFile(pf, l.params.Pack(), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(af, ar.b, 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{pf, af, of, fmt.Sprint(l.grid[0]), fmt.Sprint(l.grid[1]), fmt.Sprint(l.grid[2]), fmt.Sprint(l.v.Threads())}
	if outb, err := exec.Command(bin, args...).CombinedOutput(); err != nil {
		t.Fatalf("emulator (%s): %v\n%s", l.v.Name(), err, outb)
	}
	res, err := os.ReadFile(of)
	if err != nil {
		t.Fatal(err)
	}
	var r attn.Result
	for i, o := range []out{oo, lo} {
		off := int(o.addr - fwdEmuBase)
		host := res[off : off+o.n+2*fwdEmuGuard]
		for _, gb := range [][]byte{host[:fwdEmuGuard], host[fwdEmuGuard+o.n:]} {
			if !bytes.Equal(gb, bytes.Repeat([]byte{0xff}, fwdEmuGuard)) {
				t.Fatalf("output %d: guard band overwritten", i)
			}
		}
		tt := attn.New(o.dt, o.shape...)
		if o.dt == attn.Float32 {
			copy(cuda.AsBytes(tt.F32), host[fwdEmuGuard:])
		} else {
			copy(cuda.AsBytes(tt.Bits), host[fwdEmuGuard:])
		}
		for e := 0; e < tt.NumElements(); e++ {
			if x := tt.Load(e); x != x {
				t.Fatalf("output %d element %d not written (NaN)", i, e)
			}
		}
		if i == 0 {
			r.O = tt
		} else {
			r.LSE = tt
		}
	}
	return r, l.v
}

// TestForwardEmulated runs the generated forward kernels (every load path,
// warp split, mask, feature) on the host emulator against the oracle.
func TestForwardEmulated(t *testing.T) {
	if os.Getenv("FLASHATTN_FWD_EMU") == "" {
		t.Skip("set FLASHATTN_FWD_EMU=1 to run the forward kernels on the host emulator (needs g++)")
	}
	if _, err := exec.LookPath("g++"); err != nil {
		t.Skip("no g++ for the host emulator")
	}
	tl := attn.AlignTopLeft
	cases := []fwdProblem{
		{name: "bf16-d64-causal", dt: attn.BFloat16, b: 1, n: 70, m: 150, h: 2, hkv: 1, dk: 64, dv: 64, opt: attn.Options{Causal: true}},
		{name: "bf16-d128-window-top-left", dt: attn.BFloat16, b: 1, n: 150, m: 90, h: 1, hkv: 1, dk: 128, dv: 128, opt: attn.Options{Window: &attn.Window{Left: 30, Right: 7}, Align: tl}},
		{name: "fp16-d59-narrow-gqa", dt: attn.Float16, b: 1, n: 80, m: 70, h: 2, hkv: 1, dk: 59, dv: 59, opt: attn.Options{Causal: true}},
		{name: "bf16-d199-narrow", dt: attn.BFloat16, b: 1, n: 40, m: 50, h: 1, hkv: 1, dk: 199, dv: 199},
		{name: "bf16-d111-narrow-window", dt: attn.BFloat16, b: 1, n: 60, m: 60, h: 1, hkv: 1, dk: 111, dv: 111, opt: attn.Options{Window: &attn.Window{Left: 5, Right: 3}}},
		{name: "fp32-d64-softcap-bias", dt: attn.Float32, b: 2, n: 40, m: 60, h: 2, hkv: 2, dk: 64, dv: 64, opt: attn.Options{Softcap: 3}, biasB: 1, bias: 2},
		{name: "bf16-d512-dropout", dt: attn.BFloat16, b: 1, n: 30, m: 70, h: 1, hkv: 1, dk: 512, dv: 512, opt: attn.Options{Dropout: 0.2, Seed: 5}},
		{name: "bf16-varlen-causal", dt: attn.BFloat16, h: 2, hkv: 1, dk: 64, dv: 64, segQ: []int{0, 70, 5}, segK: []int{9, 0, 40}, opt: attn.Options{Causal: true}},
		{name: "fp16-d256-stages2", dt: attn.Float16, b: 1, n: 70, m: 130, h: 1, hkv: 1, dk: 256, dv: 256},
		{name: "bf16-d257-narrow-split", dt: attn.BFloat16, b: 1, n: 20, m: 40, h: 1, hkv: 1, dk: 257, dv: 257, opt: attn.Options{Causal: true}},
		{name: "bf16-d128-dropout-softcap", dt: attn.BFloat16, b: 1, n: 70, m: 80, h: 2, hkv: 1, dk: 128, dv: 128, opt: attn.Options{Dropout: 0.3, Seed: 9, Softcap: 5, Causal: true}},
		{name: "fp32-d40-dv72", dt: attn.Float32, b: 1, n: 33, m: 50, h: 1, hkv: 1, dk: 40, dv: 72},
	}
	for i, pr := range cases {
		t.Run(pr.name, func(t *testing.T) {
			t.Parallel()
			q, k, v, opt := pr.inputs(uint64(500 + i))
			res, vr := fwdEmuRun(t, q, k, v, opt)
			t.Logf("%s", vr.Name())
			fwdCheck(t, pr.dt, q, k, v, opt, res)
		})
	}
}
