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
	"github.com/flashattn/flashattn/cpu"
	"github.com/flashattn/flashattn/kernels"
)

// The host emulator compiles the generated backward kernels with g++
// against testdata/bwdemu (every CUDA thread a fiber, warp instructions
// exchanged through memory, ldmatrix/cp.async alignment checked, shared
// memory filled with NaN before each block) and runs the same launch plan
// enqueueBackward would enqueue. It checks indexing, masking, layouts and
// barriers without a GPU; it says nothing about speed. It is slow, so it
// runs only when FLASHATTN_BWD_EMU is set.

const emuBase = 1 << 32 // fake device address of the arena's first byte

// emuArena lays out the tensors of one emulated call in one buffer.
type emuArena struct{ b []byte }

func (e *emuArena) put(data []byte) uint64 {
	off := int(align256(int64(len(e.b))))
	e.b = append(e.b, make([]byte, off-len(e.b))...)
	e.b = append(e.b, data...)
	return emuBase + uint64(off)
}

func (e *emuArena) poisoned(n int) uint64 {
	return e.put(bytes.Repeat([]byte{bwdPoison}, n))
}

func (e *emuArena) at(addr uint64, n int) []byte {
	off := int(addr - emuBase)
	return e.b[off : off+n]
}

var emuBuild sync.Mutex

// emuBinary compiles the emulator for src (cached by content).
func emuBinary(t *testing.T, src string) string {
	t.Helper()
	shim, err := os.ReadFile("testdata/bwdemu/shim.h")
	if err != nil {
		t.Fatal(err)
	}
	prims, err := os.ReadFile("testdata/bwdemu/prims.h")
	if err != nil {
		t.Fatal(err)
	}
	i := strings.Index(src, kernels.PrimitivesBegin)
	j := strings.Index(src, kernels.PrimitivesEnd)
	if i < 0 || j < i {
		t.Fatalf("generated source lacks the primitives markers")
	}
	src = src[:i] + "#include \"prims.h\"\n" + src[j:]
	var lines []string
	for _, l := range strings.Split(src, "\n") {
		if !strings.HasPrefix(l, "#include <cuda_") {
			lines = append(lines, l)
		}
	}
	full := "#include \"shim.h\"\n" + strings.Join(lines, "\n") + emuDriver
	h := sha256.Sum256([]byte(full + string(shim) + string(prims)))
	dir := filepath.Join(os.TempDir(), "flashattn-bwdemu")
	bin := filepath.Join(dir, hex.EncodeToString(h[:8]))
	emuBuild.Lock()
	defer emuBuild.Unlock()
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

// emuDriver is the emulator's main: params file, arena in, arena out, then
// launches as "kernel gx gy gz threads".
const emuDriver = `
static void (*emu_kernel)(const BwdParams);
static const BwdParams* emu_params;
static void emu_tramp() {
  emu_kernel(*emu_params);
  emu_cur->done = true;
  emu_live_cta--;
  emu_live_warp[emu_cur->tid.x >> 5]--;
  if (!emu_switch()) setcontext(&emu_main);
  emu_fail("finished thread resumed");
}
static void emu_run(void (*k)(const BwdParams), const BwdParams& p, emu_dim3 grid, unsigned threads) {
  static std::vector<char*> stacks;
  while (stacks.size() < threads) stacks.push_back((char*)malloc(EMU_STACK));
  emu_kernel = k;
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
  std::vector<char> pb = emu_read(argv[1]);
  if (pb.size() != sizeof(BwdParams)) emu_fail("params size differs from sizeof(BwdParams)");
  BwdParams p;
  memcpy(&p, pb.data(), sizeof p);
  std::vector<char> ab = emu_read(argv[2]);
  char* arena = (char*)aligned_alloc(256, (ab.size() + 255) / 256 * 256 + 256);
  memcpy(arena, ab.data(), ab.size());
  const unsigned long long base = 1ull << 32;
#define RELOC(f) if (p.f) p.f = (decltype(p.f))(arena + ((unsigned long long)p.f - base));
  RELOC(q) RELOC(k) RELOC(v) RELOC(o) RELOC(dout) RELOC(lse) RELOC(dq) RELOC(dk) RELOC(dv) RELOC(dqacc)
  RELOC(delta) RELOC(lse2) RELOC(bias) RELOC(dbias_scratch) RELOC(dbias) RELOC(cuq) RELOC(cuk)
  struct { const char* name; void (*fn)(const BwdParams); } table[] = {
    {"fa_bwd_pre", fa_bwd_pre}, {"fa_bwd_dkdv", fa_bwd_dkdv}, {"fa_bwd_dq", fa_bwd_dq},
    {"fa_bwd_dq_convert", fa_bwd_dq_convert}, {"fa_bwd_dbias", fa_bwd_dbias}};
  for (int i = 4; i + 4 < argc; i += 5) {
    void (*fn)(const BwdParams) = nullptr;
    for (auto& e : table) if (!strcmp(e.name, argv[i])) fn = e.fn;
    if (!fn) emu_fail("unknown kernel");
    emu_run(fn, p, emu_dim3{(unsigned)atoi(argv[i + 1]), (unsigned)atoi(argv[i + 2]), (unsigned)atoi(argv[i + 3])}, (unsigned)atoi(argv[i + 4]));
  }
  FILE* f = fopen(argv[3], "wb");
  fwrite(arena, 1, ab.size(), f);
  fclose(f);
  return 0;
}
`

// emuRun runs one backward call on the host emulator and returns the
// gradients (with guard bands and NaN poisoning checked like bwdRun).
func emuRun(t *testing.T, in bwdInputs, algo DQAlgorithm) attn.Gradients {
	t.Helper()
	dt := in.q.DType
	ar := &emuArena{}
	var a bwdArgs
	for _, x := range []struct {
		t   attn.Tensor
		dst *bwdView
	}{{in.q, &a.Q}, {in.k, &a.K}, {in.v, &a.V}, {in.o, &a.O}, {in.dO, &a.DO}} {
		*x.dst = seqView(ar.put(hostBytes(x.t)), dt, x.t.Shape)
	}
	a.LSE = lseView(ar.put(hostBytes(in.lse)), in.lse.Shape)
	type out struct {
		shape []int
		dt    attn.DType
		addr  uint64
		n     int
	}
	guarded := func(shape []int, odt attn.DType) out {
		n := attn.NumElements(shape) * odt.Size()
		return out{shape, odt, ar.poisoned(n + 2*bwdGuard), n}
	}
	outs := []out{guarded(in.q.Shape, dt), guarded(in.k.Shape, dt), guarded(in.v.Shape, dt)}
	a.DQ = seqView(outs[0].addr+bwdGuard, dt, in.q.Shape)
	a.DK = seqView(outs[1].addr+bwdGuard, dt, in.k.Shape)
	a.DV = seqView(outs[2].addr+bwdGuard, dt, in.v.Shape)
	if in.opt.Bias != nil {
		bt := in.opt.Bias.Tensor
		a.Bias = biasView(ar.put(hostBytes(bt)), bt.DType, bt.Shape)
		if in.opt.Bias.RequiresGrad {
			o := guarded(bt.Shape, bt.DType)
			outs = append(outs, o)
			a.DBias = biasView(o.addr+bwdGuard, bt.DType, bt.Shape)
		}
	}
	if in.p.Varlen {
		a.CuSeqlensQ = ar.put(int32Bytes(in.opt.CuSeqlensQ))
		a.CuSeqlensK = ar.put(int32Bytes(in.opt.CuSeqlensK))
	}
	a.Workspace = ar.poisoned(int(BackwardWorkspaceBytes(in.p, algo, in.opt.Bias != nil && in.opt.Bias.RequiresGrad)))
	pl, err := planBackward(in.p, dt, &a, algo, 4)
	if err != nil {
		t.Fatalf("plan: %v", err)
	}
	src, err := kernels.BwdSource(pl.v)
	if err != nil {
		t.Fatal(err)
	}
	bin := emuBinary(t, src)
	dir := t.TempDir()
	pf, af, of := filepath.Join(dir, "params"), filepath.Join(dir, "arena"), filepath.Join(dir, "out")
	if err := os.WriteFile(pf, pl.params.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(af, ar.b, 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{pf, af, of}
	for _, l := range pl.launches {
		args = append(args, l.kernel, fmt.Sprint(l.grid[0]), fmt.Sprint(l.grid[1]), fmt.Sprint(l.grid[2]), fmt.Sprint(l.threads))
	}
	if out, err := exec.Command(bin, args...).CombinedOutput(); err != nil {
		t.Fatalf("emulator (%s): %v\n%s", pl.v.Key(), err, out)
	}
	res, err := os.ReadFile(of)
	if err != nil {
		t.Fatal(err)
	}
	ar.b = res
	var g attn.Gradients
	for i, o := range outs {
		host := ar.at(o.addr, o.n+2*bwdGuard)
		for _, gb := range [][]byte{host[:bwdGuard], host[bwdGuard+o.n:]} {
			if !bytes.Equal(gb, bytes.Repeat([]byte{bwdPoison}, bwdGuard)) {
				t.Fatalf("output %d: guard band overwritten", i)
			}
		}
		tt := tensorFromBytes(o.dt, host[bwdGuard:bwdGuard+o.n], o.shape)
		switch i {
		case 0:
			g.DQ = tt
		case 1:
			g.DK = tt
		case 2:
			g.DV = tt
		case 3:
			g.DBias = &tt
		}
	}
	return g
}

func emuCases() []bwdCase {
	bf := []attn.DType{attn.BFloat16}
	return []bwdCase{
		{name: "plain", b: 1, n: 70, m: 150, h: 2, hkv: 1, dk: 64, dv: 64, dtypes: []attn.DType{attn.BFloat16, attn.Float16, attn.Float32}},
		{name: "causal-br-masked-rows", b: 1, n: 150, m: 70, h: 1, hkv: 1, dk: 32, dv: 48, causal: true, dtypes: bf},
		{name: "causal-tl-window", b: 1, n: 90, m: 140, h: 2, hkv: 2, dk: 64, dv: 64, causal: true, align: attn.AlignTopLeft, window: &attn.Window{Left: 20, Right: 5}, dtypes: bf},
		{name: "d59-scalar", b: 1, n: 40, m: 45, h: 1, hkv: 1, dk: 59, dv: 59, dtypes: []attn.DType{attn.BFloat16, attn.Float32}},
		{name: "d199-257", b: 1, n: 20, m: 33, h: 1, hkv: 1, dk: 199, dv: 257, dtypes: bf},
		{name: "d16-512", b: 1, n: 20, m: 40, h: 1, hkv: 1, dk: 16, dv: 512, dtypes: bf},
		{name: "softcap-bias-dropout", b: 2, n: 33, m: 70, h: 2, hkv: 1, dk: 64, dv: 64, softcap: 4, bias: []int{1, 2}, biasGrad: true, dropout: 0.2, causal: true, dtypes: []attn.DType{attn.BFloat16, attn.Float32}},
		{name: "varlen", h: 2, hkv: 1, dk: 64, dv: 64, cuQ: []int32{0, 5, 5, 70}, cuK: []int32{0, 7, 20, 20}, causal: true, dtypes: bf},
		{name: "gqa-d128", b: 1, n: 65, m: 130, h: 4, hkv: 2, dk: 128, dv: 128, dtypes: bf},
		{name: "d256", b: 1, n: 65, m: 70, h: 1, hkv: 1, dk: 256, dv: 256, dropout: 0.1, dtypes: bf},
	}
}

// TestBackwardEmulated checks the generated kernels on the host emulator
// against the float64 reference (FLASHATTN_BWD_EMU=1; needs g++).
func TestBackwardEmulated(t *testing.T) {
	if os.Getenv("FLASHATTN_BWD_EMU") == "" {
		t.Skip("host emulation of the backward kernels runs with FLASHATTN_BWD_EMU=1")
	}
	if _, err := exec.LookPath("g++"); err != nil {
		t.Skip("host emulation needs g++")
	}
	only := os.Getenv("FLASHATTN_BWD_EMU_CASE")
	for ci, c := range emuCases() {
		if only != "" && !strings.Contains(c.name, only) {
			continue
		}
		for _, dt := range c.dtypes {
			in := c.inputs(t, dt, uint64(ci+100))
			ref, err := cpu.ReferenceBackward(in.q, in.k, in.v, in.dO, in.opt)
			if err != nil {
				t.Fatal(err)
			}
			naive, err := cpu.NaiveBackward(dt, in.q, in.k, in.v, in.dO, in.opt)
			if err != nil {
				t.Fatal(err)
			}
			for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
				t.Run(fmt.Sprintf("%s/%v/%v", c.name, dt, algo), func(t *testing.T) {
					g := emuRun(t, in, algo)
					checkGrad(t, "dQ", dt, g.DQ, ref.DQ, naive.DQ)
					checkGrad(t, "dK", dt, g.DK, ref.DK, naive.DK)
					checkGrad(t, "dV", dt, g.DV, ref.DV, naive.DV)
					if c.biasGrad {
						checkGrad(t, "dBias", dt, *g.DBias, ref.DBias, naive.DBias)
					}
					checkMaskedRowsZero(t, in, g.DQ)
				})
			}
		}
	}
}
