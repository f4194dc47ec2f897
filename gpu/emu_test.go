package gpu

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
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

// The host emulators compile generated kernels with g++ against
// testdata/emu: shim.h (every CUDA thread a fiber, barriers and warp
// instructions switching fibers, shared memory filled with NaN before each
// block), prims.h (C++ versions of the inline-PTX primitives, with the
// alignment rules of ldmatrix and cp.async checked), a per-direction header
// naming those primitives as the direction's kernels do (fwd.h, bwd.h) and
// driver.h (the main that runs a launch plan on an arena of device
// memory). Hopper kernels add hopper.h (warpgroup products), tma.h
// (mbarriers, bulk tensor copies) and, warp-specialized, ws.h (named
// barriers, setmaxnreg, bulk reduce-add); a block none of whose threads can
// proceed fails as a deadlock naming what each thread waits for. They check
// indexing, masking, layouts and synchronisation without a GPU, not speed.
// Fibers take turns round robin; FLASHATTN_EMU_SCHEDULE=warp lets one warp
// run ahead of the others as far as the kernel's barriers allow, which a
// missing barrier between warps fails (NaN read from shared memory not yet
// stored) where the round robin, stopping every warp at each
// warp-synchronous step, hides it.
// Each family runs when its variable is set: FLASHATTN_FWD_EMU (the forward
// and its pack kernel), FLASHATTN_BWD_EMU (the backward), FLASHATTN_CP_EMU
// (context parallelism's merge kernels).

const emuBase = 1 << 32 // fake device address of the arena's first byte

// emuArena lays out the tensors of one emulated call in one buffer.
// emuArena is the emulator's memory: its bytes from address emuBase, and,
// when set, the address ranges [lo, hi) that bulk reduce-adds may target
// (at most two; the driver fails one outside them).
type emuArena struct {
	b      []byte
	reduce [][2]uint64
}

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

// emuOut is an output tensor of an emulated call, poisoned and with
// bwdGuard poisoned bytes on each side.
type emuOut struct {
	shape []int
	dt    attn.DType
	addr  uint64 // the first guard byte
	n     int
	shift int // bytes of poison between the leading guard band and the first element
}

// output reserves a guarded output of the given shape and type.
func (e *emuArena) output(shape []int, dt attn.DType) emuOut {
	return e.outputShifted(shape, dt, 0)
}

// outputShifted is output with the first element shift bytes past the
// leading guard band (an odd element offset for 16-bit types at shift 2).
func (e *emuArena) outputShifted(shape []int, dt attn.DType, shift int) emuOut {
	n := attn.NumElements(shape) * dt.Size()
	return emuOut{shape, dt, e.poisoned(n + 2*bwdGuard + shift), n, shift}
}

// ptr is the device address of the output's first element.
func (o emuOut) ptr() uint64 { return o.addr + uint64(bwdGuard+o.shift) }

// read returns output i after a run, failing t when a guard band was
// overwritten.
func (e *emuArena) read(t *testing.T, i int, o emuOut) attn.Tensor {
	t.Helper()
	lead := bwdGuard + o.shift
	host := e.at(o.addr, o.n+2*bwdGuard+o.shift)
	for _, gb := range [][]byte{host[:lead], host[lead+o.n:]} {
		if !bytes.Equal(gb, bytes.Repeat([]byte{bwdPoison}, len(gb))) {
			t.Fatalf("output %d: guard band overwritten", i)
		}
	}
	return tensorFromBytes(o.dt, host[lead:lead+o.n], o.shape)
}

// emuLaunch is one kernel launch of an emulated call.
type emuLaunch struct {
	kernel  string
	grid    [3]int
	threads int
}

// emuDriver is the source appended to the kernels: the parameter struct,
// the device pointers in it and the kernels by name, then driver.h.
func emuDriver(params string, pointers, kernelNames []string) string {
	return emuDriver2(emuParamSet{params, pointers, kernelNames}, emuParamSet{})
}

// emuParamSet is a parameter struct of the emulator's driver: its C type,
// the device pointers in it and the kernels that take it.
type emuParamSet struct {
	ctype    string
	pointers []string
	kernels  []string
}

// emuDriver2 is emuDriver with a second parameter struct (none when its
// kernels are empty).
func emuDriver2(first, second emuParamSet) string {
	var b strings.Builder
	for i, set := range []emuParamSet{first, second} {
		if i == 1 && len(set.kernels) == 0 {
			break
		}
		suffix := map[int]string{0: "", 1: "2"}[i]
		fmt.Fprintf(&b, "\n#define EMU_PARAMS%s %s\n#define EMU_RELOC%s", suffix, set.ctype, suffix)
		for _, p := range set.pointers {
			fmt.Fprintf(&b, " RELOC%s(%s)", suffix, p)
		}
		fmt.Fprintf(&b, "\n#define EMU_KERNELS%s", suffix)
		for j, k := range set.kernels {
			if j > 0 {
				b.WriteString(",")
			}
			fmt.Fprintf(&b, " {%q, %s}", k, k)
		}
	}
	b.WriteString("\n#include \"driver.h\"\n")
	return b.String()
}

var emuBuild sync.Mutex

// emuBinary compiles the emulator for src (cached by content): the first
// block of inline-PTX primitives is replaced by testdata/emu/header, each
// further block by the next text of more (a module with more blocks than
// replacements fails), the CUDA headers are left out (shim.h stands for
// them) and driver is appended.
func emuBinary(t *testing.T, src, header, driver string, more ...string) string {
	t.Helper()
	files, err := filepath.Glob("testdata/emu/*.h")
	if err != nil || len(files) == 0 {
		t.Fatalf("emulator headers: %v", err)
	}
	h := sha256.New()
	fmt.Fprintf(h, "%q\n", emuCXXFlags)
	headers := map[string][]byte{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		headers[filepath.Base(f)] = data
		fmt.Fprintf(h, "%s %d\n", filepath.Base(f), len(data))
		h.Write(data)
	}
	for n, repl := range append([]string{"#include \"" + header + "\"\n"}, more...) {
		i := strings.Index(src, kernels.PrimitivesBegin)
		j := strings.Index(src, kernels.PrimitivesEnd)
		if i < 0 || j < i {
			t.Fatalf("generated source lacks primitives block %d", n+1)
		}
		src = src[:i] + repl + src[j+len(kernels.PrimitivesEnd):]
	}
	if strings.Contains(src, kernels.PrimitivesBegin) {
		t.Fatalf("generated source has more primitives blocks than the emulator replaces")
	}
	var lines []string
	for _, l := range strings.Split(src, "\n") {
		if !strings.HasPrefix(l, "#include <cuda_") {
			lines = append(lines, l)
		}
	}
	full := "#include \"shim.h\"\n" + strings.Join(lines, "\n") + driver
	h.Write([]byte(full))
	dir := filepath.Join(os.TempDir(), "flashattn-emu")
	bin := filepath.Join(dir, hex.EncodeToString(h.Sum(nil)[:8]))
	emuBuild.Lock()
	defer emuBuild.Unlock()
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	// The headers go in a directory of their own per binary so that
	// concurrent test binaries never compile against half-written ones.
	inc := bin + ".h"
	if err := os.MkdirAll(inc, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, data := range headers {
		if err := os.WriteFile(filepath.Join(inc, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cc := bin + ".cc"
	if err := os.WriteFile(cc, []byte(full), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append(append([]string{}, emuCXXFlags...), "-I", inc, "-o", bin+".tmp", cc)
	out, err := exec.Command("g++", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("g++: %v\n%s", err, out)
	}
	if err := os.Rename(bin+".tmp", bin); err != nil {
		t.Fatal(err)
	}
	return bin
}

// emuCXXFlags are g++'s flags for the emulator binaries. The device
// compiler contracts a·b + c into one fused multiply-add wherever the source
// allows (nvcc and NVRTC default to --fmad=true); -mfma -ffp-contract=fast
// (with -fexpensive-optimizations, which runs the pass that fuses at -O1)
// make g++ do the same, so that an expression whose value depends on the
// contraction (a·b − c with c = a·b rounded is 0 unfused, the product's
// rounding error fused) computes on the host as on the GPU. The host needs
// FMA instructions (x86-64 since Haswell).
var emuCXXFlags = []string{"-std=c++20", "-O1", "-fexpensive-optimizations", "-w", "-mfma", "-ffp-contract=fast"}

// emuExec runs launches of the emulator binary bin with params on the
// arena's contents and replaces them with the arena after the run; name
// identifies the kernel in failures. params2 holds the parameters of the
// kernels that take the driver's second parameter struct, by kernel.
func emuExec(t *testing.T, bin, name string, params []byte, ar *emuArena, launches []emuLaunch, params2 map[string][]byte) {
	t.Helper()
	if out, err := emuRun(t, bin, params, ar, launches, params2); err != nil {
		t.Fatalf("emulator (%s): %v\n%s", name, err, out)
	}
}

// emuRun is emuExec returning the emulator's failure (its error and
// output) instead of failing t; the arena is replaced only after a run
// that succeeds.
func emuRun(t *testing.T, bin string, params []byte, ar *emuArena, launches []emuLaunch, params2 map[string][]byte) ([]byte, error) {
	t.Helper()
	dir := t.TempDir()
	pf, af, of := filepath.Join(dir, "params"), filepath.Join(dir, "arena"), filepath.Join(dir, "out")
	if err := os.WriteFile(pf, params, 0o644); err != nil {
		t.Fatal(err)
	}
	for k, b := range params2 {
		if err := os.WriteFile(pf+"."+k, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(af, ar.b, 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{pf, af, of}
	for _, l := range launches {
		args = append(args, l.kernel, fmt.Sprint(l.grid[0]), fmt.Sprint(l.grid[1]), fmt.Sprint(l.grid[2]), fmt.Sprint(l.threads))
	}
	cmd := exec.Command(bin, args...)
	if len(ar.reduce) > 0 {
		var r []string
		for _, x := range ar.reduce {
			r = append(r, fmt.Sprint(x[0]), fmt.Sprint(x[1]))
		}
		cmd.Env = append(os.Environ(), "EMU_REDUCE_RANGE="+strings.Join(r, " "))
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return out, err
	}
	res, err := os.ReadFile(of)
	if err != nil {
		t.Fatal(err)
	}
	ar.b = res
	return nil, nil
}

// emuSkip skips t unless the environment variable env is set and g++ is
// available.
func emuSkip(t *testing.T, env, what string) {
	t.Helper()
	if os.Getenv(env) == "" {
		t.Skipf("set %s=1 to run the %s kernels on the host emulator (needs g++)", env, what)
	}
	if _, err := exec.LookPath("g++"); err != nil {
		t.Skip("no g++ for the host emulator")
	}
}

// emuTensorMap encodes a tensor map the way gpu/testdata/emu/tma.h reads
// it (not the driver's encoding): address, extents, byte strides, box rows.
func emuTensorMap(x kernels.TMATensor) cuda.TensorMap {
	var m cuda.TensorMap
	for i, w := range []uint64{x.Addr, x.Cols, x.Rows, x.Heads, x.B, x.Strides[0], x.Strides[1], x.Strides[2], uint64(x.BoxRows)} {
		binary.LittleEndian.PutUint64(m[8*i:], w)
	}
	return m
}

// emuKernels says which kernels an emulated call runs.
type emuKernels int

const (
	emuMMA                       emuKernels = iota // the mma.sync kernels
	emuHopper                                      // the Hopper kernels, tiles by cp.async
	emuHopperTMA                                   // the Hopper kernels, streamed tiles by tensor maps
	emuHopperWS                                    // the Hopper forward, tensor maps, warp-specialized
	emuHopperPP                                    // ... with ping-pong and the early rescale of O
	emuHopperPT                                    // ... and persistent CTAs
	emuHopperBulk                                  // the Hopper backward, tensor maps, the atomic dQ by bulk reduce-adds
	emuHopperBwdWS                                 // the Hopper backward, tensor maps, the dK/dV kernel warp-specialized
	emuHopperBwdWSBulk                             // ... and the atomic dQ by bulk reduce-adds
	emuHopperBwdWSKeyRows                          // the Hopper backward, tensor maps, warp-specialized, S and dP with keys as rows
	emuHopperBwdWSKeyRowsBulk                      // ... and the atomic dQ by bulk reduce-adds
	emuHopperBwdWSKeyRows80                        // the key-rows step over 80 queries (the separate dQ; the atomic one by vector atomics keeps 64)
	emuHopperBwdWSKeyRows80Bulk                    // ... and the atomic dQ by bulk reduce-adds, transposed
	emuHopperBwdWSKeyRows128                       // the key-rows step over 128 queries at padded head dims up to 64 (the atomic dQ's rows split over the warpgroups)
	emuHopperBwdWSKeyRows128Bulk                   // ... and the atomic dQ by bulk reduce-adds
	emuHopperSO                                    // the Hopper forward, tensor maps, O stored by tensor maps
	emuHopperPTSO                                  // ... on the full pipeline (ws, ping-pong, early rescale, persistent)
	emuHopperLR                                    // the Hopper forward, ws, ping-pong, early rescale, the lazy rescale
	emuHopperHM                                    // the short pipeline (persistent, O by tensor maps) with the head-major tile order
	emuHopperPD                                    // the Hopper forward, ws, ping-pong, early rescale, the dropout keep bits drawn by the producer's warps
	emuHopperPDPT                                  // ... on the short pipeline (persistent, O by tensor maps)
	emuHopperQ2                                    // the short pipeline (persistent, O by tensor maps) with two Q buffers
	emuHopperCT                                    // ... and ping-pong's turns carried across tiles
	emuHopperPE                                    // the Hopper forward, ws, ping-pong, early and lazy rescale, two of every four key groups' exponentials by the polynomial
	emuDefault                                     // whatever the planner picks for a new backend (the forward pipeline its knobs choose for the call, the backward pipeline and bulk dQ from the environment, as New reads them; no check of the plan)
)

// emuDefaultKnobs returns the knobs of emuDefault: those New sets for a
// Hopper device under the environment of the moment (envKnobs).
func emuDefaultKnobs() *Backend {
	b, err := envKnobs(true)
	if err != nil {
		panic(err)
	}
	return b
}

// emuBiasKnobs returns the bias knobs of an emulated kind's plans: for the
// default kind New's (emuDefaultKnobs), for the others the staging the
// environment asks for (EnvBiasStaged) and the dBias paths' knobs as New
// sets them (EnvDBiasAtomic, EnvDBiasDirect).
func emuBiasKnobs(kind emuKernels) *Backend {
	if kind == emuDefault {
		return emuDefaultKnobs()
	}
	b := &Backend{BiasStaged: envSet(os.Getenv(EnvBiasStaged))}
	b.readDBiasEnv()
	return b
}

// emuBwdLightTail reports whether the emulated backward takes the light-tail
// CTA order: as a backend does (on Hopper unless EnvBwdLightTail is "0"),
// and on the other families too when the variable is set.
func emuBwdLightTail(hopper bool) bool {
	v := os.Getenv(EnvBwdLightTail)
	return envSet(v) || (hopper && v != "0")
}

// emuBwdTMA reports whether an emulated backward kind loads its streamed
// tiles by tensor maps (and so takes fixed-length batches only).
func emuBwdTMA(kind emuKernels) bool {
	switch kind {
	case emuHopperTMA, emuHopperBulk, emuHopperBwdWS, emuHopperBwdWSBulk, emuHopperBwdWSKeyRows, emuHopperBwdWSKeyRowsBulk, emuHopperBwdWSKeyRows80, emuHopperBwdWSKeyRows80Bulk, emuHopperBwdWSKeyRows128, emuHopperBwdWSKeyRows128Bulk:
		return true
	}
	return false
}

// emuPipeline returns the forward pipeline of an emulated kind.
func emuPipeline(kind emuKernels) kernels.Pipeline {
	switch kind {
	case emuDefault:
		return emuDefaultKnobs().Pipeline
	case emuHopperWS:
		return kernels.Pipeline{WarpSpecialized: true}
	case emuHopperPP:
		return kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}
	case emuHopperPT:
		// (the dropout cases draw their keep bits before the wait for S here, the other families after it)
		return kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true, EarlyDropout: true}
	case emuHopperSO:
		return kernels.Pipeline{StoreO: true}
	case emuHopperPTSO:
		return kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true, StoreO: true}
	case emuHopperLR:
		return kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, LazyRescale: true}
	case emuHopperHM:
		return kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true, StoreO: true, HeadMajor: true}
	case emuHopperPD:
		return kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, ProducerDropout: true}
	case emuHopperPDPT:
		return kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true, StoreO: true, ProducerDropout: true}
	case emuHopperQ2:
		return kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true, StoreO: true, DoubleQ: true}
	case emuHopperCT:
		return kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true, StoreO: true, DoubleQ: true, CarryTurns: true}
	case emuHopperPE:
		return kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, LazyRescale: true, PolyExp: 2}
	}
	return kernels.Pipeline{}
}

// hopperEmuBlock returns the emulator's replacement for the Hopper block
// of a module's primitives: hopper.h (and tma.h with tensor maps, ws.h
// warp-specialized) and the product wrappers ps, each calling the emulated
// product of its shape.
func hopperEmuBlock(ps []kernels.WGMMAProduct, tma, ws bool) string {
	var b strings.Builder
	b.WriteString("#include \"hopper.h\"\n")
	if tma {
		b.WriteString("#include \"tma.h\"\n")
	}
	if ws {
		b.WriteString("#include \"ws.h\"\n")
	}
	for _, p := range ps {
		if p.RegA {
			fmt.Fprintf(&b, "inline void %s(float (&d)[%d][4], const u32 (&a)[4], u64 db) { emu_wgmma_rs<%d, %v>(&d[0][0], a, db); }\n",
				p.Name, p.N/8, p.N, p.TB)
			continue
		}
		fmt.Fprintf(&b, "inline void %s(float (&d)[%d][4], u64 da, u64 db, int acc) { emu_wgmma_ss<%d, %v, %v>(&d[0][0], da, db, acc); }\n",
			p.Name, p.N/8, p.N, p.TA, p.TB)
	}
	return b.String()
}

// emuRandomCall is a call drawn by drawEmuCalls.
type emuRandomCall struct {
	dt              attn.DType
	b, n, m, h, hkv int
	dk, dv          int
	opt             attn.Options // Causal, Window, Align, Softcap, Dropout, Seed
}

// drawEmuCalls draws short calls, all with FLASHATTN_EMU_RANDOM=all, from
// the random stream seq, in the layouts the Hopper kernels read by tensor
// maps (bf16 or fp16, head dims a multiple of 8, DK ≠ DV in a quarter of
// the calls, up to maxLen queries and keys, GQA) with a mask in half of
// them (causal, or a window; either alignment), softcap and dropout each
// in a quarter.
func drawEmuCalls(seq uint64, short, all, maxLen int) []emuRandomCall {
	count := short
	if os.Getenv("FLASHATTN_EMU_RANDOM") == "all" {
		count = all
	}
	r := rand.New(rand.NewPCG(2026, seq))
	pick := func(xs ...int) int { return xs[r.IntN(len(xs))] }
	calls := make([]emuRandomCall, count)
	for i := range calls {
		c := emuRandomCall{dt: []attn.DType{attn.BFloat16, attn.Float16}[r.IntN(2)], b: pick(1, 2), hkv: pick(1, 2)}
		c.h = c.hkv * pick(1, 2, 3)
		c.dk = pick(64, 128, 256, 96, 40)
		c.dv = c.dk
		if r.IntN(4) == 0 {
			c.dv = pick(64, 128, 72)
		}
		c.n, c.m = 1+r.IntN(maxLen), 1+r.IntN(maxLen)
		if r.IntN(3) == 0 {
			c.m = c.n
		}
		switch r.IntN(4) {
		case 0:
			c.opt.Causal = true
		case 1:
			c.opt.Window = &attn.Window{Left: r.IntN(maxLen / 3), Right: r.IntN(maxLen / 15)}
		}
		if r.IntN(2) == 0 {
			c.opt.Align = attn.AlignTopLeft
		}
		if r.IntN(4) == 0 {
			c.opt.Softcap = float64(pick(5, 30))
		}
		if r.IntN(4) == 0 {
			c.opt.Dropout = 0.25
		}
		c.opt.Seed = uint64(r.IntN(1000))
		calls[i] = c
	}
	return calls
}

// name names call i for a subtest.
func (c emuRandomCall) name(i int) string {
	return fmt.Sprintf("%02d-%s-b%d-n%d-m%d-h%d/%d-dk%d-dv%d-causal%v-win%v-cap%v-drop%v", i, c.dt, c.b, c.n, c.m, c.h, c.hkv, c.dk, c.dv,
		c.opt.Causal, c.opt.Window != nil, c.opt.Softcap, c.opt.Dropout)
}
