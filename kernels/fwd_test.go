package kernels

import (
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// fwdVariant builds a tuned variant as the GPU backend does.
func fwdVariant(t testing.TB, dt attn.DType, dk, dv, loadBytes int, f func(*Variant)) Variant {
	t.Helper()
	v := Variant{DType: dt, DK: dk, DV: dv, LoadBytes: loadBytes, LSE: true}
	if f != nil {
		f(&v)
	}
	tile, err := TileForVariant(v)
	if err != nil {
		t.Fatalf("TileForVariant(%v): %v", v, err)
	}
	return tile.Apply(v)
}

// fwdFeatures are the feature sets of the source matrix.
var fwdFeatures = []struct {
	name string
	set  func(*Variant)
}{
	{"plain", nil},
	{"causal", func(v *Variant) { v.Mask = MaskWindow }},
	{"softcap+bias", func(v *Variant) { v.Softcap, v.Bias = true, BiasBF16 }},
	{"dropout+varlen+window", func(v *Variant) { v.Dropout, v.Varlen, v.Mask = true, true, MaskWindow }},
	{"prescale+bias32+nolse", func(v *Variant) { v.PreScale, v.Bias, v.LSE = true, BiasF32, false }},
}

// fwdDims are the head-dim pairs of the source matrix.
var fwdDims = [][2]int{{64, 64}, {128, 128}, {256, 256}, {512, 512}, {1, 1}, {59, 59}, {111, 111}, {127, 127}, {199, 199}, {257, 257}, {32, 96}, {16, 512}, {512, 64}}

func TestSourceMatrix(t *testing.T) {
	seen := map[Variant]bool{}
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float16, attn.Float32} {
		for _, d := range fwdDims {
			for _, lb := range []int{16, 4, 2} {
				if lb == 2 && dt == attn.Float32 {
					continue
				}
				for _, f := range fwdFeatures {
					v := fwdVariant(t, dt, d[0], d[1], lb, f.set)
					src, err := v.Source()
					if err != nil {
						t.Errorf("%s: %v", v, err)
						continue
					}
					if !strings.Contains(src, `extern "C" __global__ void __launch_bounds__(NTHREADS, `) ||
						!strings.Contains(src, " "+KernelName+"(const Params p)") {
						t.Errorf("%s: entry point missing", v)
					}
					if strings.Count(src, "{") != strings.Count(src, "}") {
						t.Errorf("%s: unbalanced braces", v)
					}
					if got := strings.Contains(src, "apply_dropout(s,"); got != v.Dropout {
						t.Errorf("%s: dropout code present = %v", v, got)
					}
					if got := strings.Contains(src, softcapTanh(dt)+"(t * p.softcap_in)"); got != v.Softcap {
						t.Errorf("%s: softcap code present = %v", v, got)
					}
					if got := strings.Contains(src, "const int* cq = (const int*)p.cu_q;"); got != v.Varlen {
						t.Errorf("%s: varlen code present = %v", v, got)
					}
					if got := strings.Contains(src, "ldg_tile<"); got != (lb == 2) {
						t.Errorf("%s: register-staged loads present = %v", v, got)
					}
					i, j := strings.Index(src, PrimitivesBegin), strings.Index(src, PrimitivesEnd)
					if i < 0 || j < i || strings.Contains(src[:i], "asm(") || strings.Contains(src[:i], "asm volatile") ||
						strings.Contains(src[j:], "asm(") || strings.Contains(src[j:], "asm volatile") {
						t.Errorf("%s: inline PTX outside the primitives block", v)
					}
					if src2, _ := v.Source(); src2 != src {
						t.Errorf("%s: source is not a pure function of the variant", v)
					}
					seen[v] = true
				}
			}
		}
	}
	names := map[string]bool{}
	for v := range seen {
		if names[v.Name()] {
			t.Errorf("two variants share the name %s", v.Name())
		}
		names[v.Name()] = true
	}
}

// generated is what Variant and BwdVariant both are: a variant that
// validates and generates its source.
type generated interface {
	Validate() error
	Source() (string, error)
}

// checkValidate checks that v validates with an error wrapping want (nil:
// none), and that Source fails alike.
func checkValidate(t *testing.T, v generated, want error) {
	t.Helper()
	err := v.Validate()
	if want == nil {
		if err != nil {
			t.Fatalf("Validate: %v", err)
		}
		return
	}
	if !errors.Is(err, want) {
		t.Fatalf("Validate = %v, want %v", err, want)
	}
	if _, err := v.Source(); !errors.Is(err, want) {
		t.Fatalf("Source error = %v, want %v", err, want)
	}
}

func TestValidate(t *testing.T) {
	ok := Variant{DType: attn.BFloat16, DK: 128, DV: 128, BlockM: 128, BlockN: 64, WarpsM: 4, WarpsN: 1, Stages: 2, LoadBytes: 16, MinBlocks: 1}
	cases := []struct {
		name string
		edit func(*Variant)
		want error
	}{
		{"ok", func(*Variant) {}, nil},
		{"dtype", func(v *Variant) { v.DType = 7 }, attn.ErrOption},
		{"dk 0", func(v *Variant) { v.DK = 0 }, attn.ErrShape},
		{"dv 513", func(v *Variant) { v.DV = 513 }, attn.ErrShape},
		{"warpsN 3", func(v *Variant) { v.WarpsN = 3 }, attn.ErrShape},
		{"blockM 96 with 4 warps", func(v *Variant) { v.BlockM = 96 }, attn.ErrShape},
		{"blockM 320", func(v *Variant) { v.BlockM = 320 }, attn.ErrShape},
		{"blockN 24", func(v *Variant) { v.BlockN = 24 }, attn.ErrShape},
		{"stages 3", func(v *Variant) { v.Stages = 3 }, attn.ErrShape},
		{"load 32", func(v *Variant) { v.LoadBytes = 32 }, attn.ErrShape},
		{"fp32 2-byte loads", func(v *Variant) { v.DType, v.LoadBytes, v.Stages = attn.Float32, 2, 1 }, attn.ErrShape},
		{"2-byte loads 2 stages", func(v *Variant) { v.LoadBytes = 2 }, attn.ErrUnsupported},
		{"mask kind", func(v *Variant) { v.Mask = 9 }, attn.ErrOption},
		{"bias kind", func(v *Variant) { v.Bias = 9 }, attn.ErrOption},
		{"bias varlen", func(v *Variant) { v.Bias, v.Varlen = BiasBF16, true }, attn.ErrUnsupported},
		{"min blocks", func(v *Variant) { v.MinBlocks = 0 }, attn.ErrShape},
		{"shared memory", func(v *Variant) { v.DK, v.DV, v.BlockN, v.Stages = 512, 512, 128, 2 }, attn.ErrUnsupported},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			v := ok
			c.edit(&v)
			checkValidate(t, v, c.want)
		})
	}
}

func TestTuneTable(t *testing.T) {
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float16, attn.Float32} {
		for d := 1; d <= attn.MaxHeadDim; d++ {
			for _, narrow := range []bool{false, true} {
				if narrow && dt == attn.Float32 {
					continue
				}
				tile, err := TileFor(dt, d, d, narrow)
				if err != nil {
					t.Fatalf("TileFor(%v, %d, narrow %v): %v", dt, d, narrow, err)
				}
				lb := 16
				if narrow {
					lb = 2
				}
				v := tile.Apply(Variant{DType: dt, DK: d, DV: d, LoadBytes: lb, MinBlocks: 1})
				if err := v.Validate(); err != nil {
					t.Fatalf("tile of %v d=%d narrow=%v: %v", dt, d, narrow, err)
				}
			}
		}
	}
	if _, err := TileFor(attn.Float32, 64, 64, true); !errors.Is(err, attn.ErrUnsupported) {
		t.Fatalf("fp32 narrow: %v, want ErrUnsupported", err)
	}
}

func TestParamsLayout(t *testing.T) {
	if ParamsSize != 320 {
		t.Fatalf("ParamsSize %d, want 320: 9 pointers, 19 strides, 23 four-byte fields, 4 bytes of tail padding", ParamsSize)
	}
	// Every field lands at its offset with its value.
	p := Params{Q: 0x1122334455667788, CuSeqlensK: 0xabcdef, NFFlag: 0x77, QStrideB: -3, BiasStrideM: 1 << 40, B: 7, DV: 257,
		ScaleLog2: 1.5, WinLeft: -1, DropThreshold: 0xfedcba98, DropOffset: 0x01020304}
	b := p.Pack()
	checks := []layoutCheck{
		{"q", 0, 8, 0x1122334455667788}, {"cu_k", 56, 8, 0xabcdef}, {"nf_flag", 64, 8, 0x77}, {"q_sb", 72, 8, uint64(1<<64 - 3)},
		{"bias_sm", 216, 8, 1 << 40}, {"b", 224, 4, 7}, {"d_v", 248, 4, 257}, {"scale_log2", 252, 4, uint64(math.Float32bits(1.5))},
		{"win_left", 264, 4, 0xffffffff}, {"drop_threshold", 280, 4, 0xfedcba98}, {"drop_offset", 296, 4, 0x01020304}, {"k", 8, 8, 0},
	}
	checkLayout(t, paramsStruct, b, checks)
	decl := cParams()
	for _, c := range checks {
		if !strings.Contains(decl, fmt.Sprintf("offsetof(Params, %s) == %d,", c.name, c.off)) {
			t.Errorf("C struct lacks the offset assertion of %s", c.name)
		}
	}
	var into [512]byte
	p.PackInto(into[:ParamsSize])
	if string(into[:ParamsSize]) != string(b) {
		t.Errorf("PackInto differs from Pack")
	}
}

var (
	nvrtcOnce sync.Once
	nvrtcC    *cuda.Compiler
	nvrtcErr  error
)

// compilerOrSkip returns the process's NVRTC, or skips the test.
func compilerOrSkip(t *testing.T) *cuda.Compiler {
	t.Helper()
	nvrtcOnce.Do(func() { nvrtcC, nvrtcErr = cuda.NewCompiler() })
	if nvrtcErr != nil {
		t.Skipf("no NVRTC here: %v", nvrtcErr)
	}
	return nvrtcC
}

// compileAll compiles variants for arch in parallel and returns ptxas's
// report of each (same order).
func compileAll(t *testing.T, c *cuda.Compiler, arch string, vs []Variant) []cuda.KernelResources {
	t.Helper()
	out, _ := compileAllLogs(t, c, arch, vs)
	return out
}

// compileAllLogs is compileAll that also returns each compile's log.
func compileAllLogs(t *testing.T, c *cuda.Compiler, arch string, vs []Variant) ([]cuda.KernelResources, []string) {
	t.Helper()
	out := make([]cuda.KernelResources, len(vs))
	logs := make([]string, len(vs))
	errs := make([]error, len(vs))
	var wg sync.WaitGroup
	sem := make(chan struct{}, max(1, runtime.NumCPU()))
	for i, v := range vs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			src, err := v.Source()
			if err != nil {
				errs[i] = err
				return
			}
			res, err := c.Compile(cuda.CompileRequest{Name: v.Name() + ".cu", Source: src, Arch: arch, Verbose: true, NoCache: true})
			if err != nil {
				errs[i] = err
				return
			}
			logs[i] = res.Stats.Log
			for _, r := range res.Stats.Resources {
				if r.Name == KernelName {
					out[i] = r
				}
			}
			if out[i].Name == "" {
				errs[i] = fmt.Errorf("no ptxas report for %s in:\n%s", KernelName, res.Stats.Log)
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("%s: %v", vs[i], err)
		}
	}
	return out, logs
}

// mainVariants are the tuned bf16/fp16 kernels of the common head dims.
func mainVariants(t *testing.T) []Variant {
	var vs []Variant
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float16} {
		for _, d := range []int{64, 128, 256} {
			for _, mask := range []MaskKind{MaskNone, MaskWindow} {
				vs = append(vs, fwdVariant(t, dt, d, d, 16, func(v *Variant) { v.Mask = mask }))
			}
		}
	}
	return vs
}

// TestCompileMain compiles the main variants for sm_90 with NVRTC and
// checks ptxas's report. The fastest tiles measured (FlashAttention-2's
// 4-warp, 32-rows-per-warp tiles) sit at the 255-register limit, where ptxas
// keeps a few values in local memory (reloaded once per key block): none
// under NVRTC 11.8, 60 bytes for the D=128 kernel under NVRTC 13.0 (H200,
// same speed). Beyond 64 bytes a register array went to memory.
func TestCompileMain(t *testing.T) {
	c := compilerOrSkip(t)
	vs := mainVariants(t)
	switch {
	case os.Getenv("FLASHATTN_FWD_MATRIX") != "":
		// every main variant
	case testing.Short():
		vs = vs[:1]
	default:
		// bf16, unmasked, one per head dim: compiling is slow on small machines.
		vs = []Variant{vs[0], vs[2], vs[4]}
	}
	res := compileAll(t, c, "sm_90", vs)
	for i, r := range res {
		t.Logf("%s: %d registers, %d B stack, spills %d/%d", vs[i], r.Registers, r.StackBytes, r.SpillStores, r.SpillLoads)
		if r.Name != "" && (r.SpillStores > 64 || r.StackBytes > 64) {
			t.Errorf("%s spills: %d B stack, %d B stores, %d B loads", vs[i], r.StackBytes, r.SpillStores, r.SpillLoads)
		}
	}
}

// TestCompileMatrix compiles every feature, load width and head-dim class
// for sm_80 and sm_90 (where this NVRTC supports them).
func TestCompileMatrix(t *testing.T) {
	if os.Getenv("FLASHATTN_FWD_MATRIX") == "" {
		t.Skip("compiling the forward variant matrix (hundreds of kernels) runs with FLASHATTN_FWD_MATRIX=1")
	}
	c := compilerOrSkip(t)
	var vs []Variant
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float16, attn.Float32} {
		for _, d := range [][2]int{{64, 64}, {59, 59}, {127, 127}, {257, 257}, {512, 512}, {32, 96}} {
			for _, lb := range []int{16, 2} {
				if lb == 2 && dt == attn.Float32 {
					lb = 4
				}
				for _, f := range fwdFeatures {
					vs = append(vs, fwdVariant(t, dt, d[0], d[1], lb, f.set))
				}
			}
		}
	}
	archs := map[int]bool{}
	for _, a := range c.SupportedArchs() {
		archs[a] = true
	}
	for _, arch := range []int{80, 90} {
		if len(archs) > 0 && !archs[arch] {
			t.Logf("NVRTC %s does not support sm_%d", c.VersionString(), arch)
			continue
		}
		res := compileAll(t, c, fmt.Sprintf("sm_%d", arch), vs)
		spills := 0
		for i, r := range res {
			if r.SpillStores != 0 {
				spills++
				t.Logf("sm_%d %s: %d registers, %d B spill stores", arch, vs[i], r.Registers, r.SpillStores)
			}
		}
		t.Logf("sm_%d: %d variants compiled, %d with spills", arch, len(vs), spills)
	}
}

// TestParamsOffsetsNVCC compiles one variant with nvcc, whose front end
// evaluates the generated offset assertions of every Params field (NVRTC's
// does not support __builtin_offsetof, so they are skipped there).
func TestParamsOffsetsNVCC(t *testing.T) {
	nvcc, err := exec.LookPath("nvcc")
	if err != nil {
		t.Skip("no nvcc here: the Params offsets are checked where nvcc exists")
	}
	src, err := fwdVariant(t, attn.BFloat16, 64, 64, 16, nil).Source()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	f := filepath.Join(dir, "fwd.cu")
	if err := os.WriteFile(f, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(nvcc, "-std=c++17", "-arch=sm_80", "-ptx", "-o", filepath.Join(dir, "fwd.ptx"), f).CombinedOutput()
	if err != nil {
		t.Fatalf("nvcc: %v\n%s", err, out)
	}
}

// TestFlatRowsOK checks which layouts can be read over flat rows.
func TestFlatRowsOK(t *testing.T) {
	cases := []struct {
		name             string
		ptr              uint64
		heads, d         int
		head, row, batch int64
		batches          int
		want             bool
	}{
		{"contiguous d199 h16", 256, 16, 199, 199, 16 * 199, 4096 * 16 * 199, 2, true},
		{"packed qkv rows", 256, 8, 199, 199, 3 * 8 * 199, 4096 * 3 * 8 * 199, 2, true},
		{"unaligned start", 258, 16, 199, 199, 16 * 199, 4096 * 16 * 199, 2, false},
		{"head-major", 256, 16, 199, 4096 * 199, 199, 16 * 4096 * 199, 2, false},
		{"row stride padded, heads not a multiple of 8 elements", 256, 10, 199, 199, 2000, 4096 * 2000, 2, false},
		{"odd batch stride, one batch element", 256, 16, 199, 199, 16 * 199, 3, 1, true},
		{"odd batch stride", 256, 16, 199, 199, 16 * 199, 3, 2, false},
	}
	for _, c := range cases {
		if got := FlatRowsOK(c.ptr, c.heads, c.d, c.head, c.row, c.batch, c.batches); got != c.want {
			t.Errorf("%s: FlatRowsOK = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestFlatStagedHeads checks which heads flat rows leave to staging copies
// and where a selected head sits among them.
func TestFlatStagedHeads(t *testing.T) {
	cases := []struct {
		d     int
		mask  uint8 // bit r: heads h ≡ r (mod 8)
		heads int
		count int
	}{
		{199, 0, 16, 0},                        // 9 columns of room: every shift fits
		{257, 0, 16, 0},                        //
		{59, 1<<2 | 1<<5, 16, 4},               // shifts 6 (h ≡ 2) and 7 (h ≡ 5) past 64
		{127, 0b01111110, 8, 6},                // one column of room: shifts 0 (h ≡ 0) and 1 (h ≡ 7) fit
		{62, 1<<1 | 1<<2 | 1<<5 | 1<<6, 12, 6}, // shifts 6, 4, 6, 4
		{60, 0, 8, 0},                          // shifts 0 and 4 only
		{64, 0, 8, 0},                          //
		{1, 0, 8, 0},                           // 15 columns of room
	}
	for _, c := range cases {
		m := FlatStagedHeads(c.d)
		if m != c.mask {
			t.Errorf("d %d: mask %08b, want %08b", c.d, m, c.mask)
		}
		if n := FlatStagedCount(c.heads, m); n != c.count {
			t.Errorf("d %d: %d of %d heads staged, want %d", c.d, n, c.heads, c.count)
		}
		idx := 0
		for h := 0; h < c.heads; h++ {
			if m>>(h%8)&1 == 0 {
				continue
			}
			if got := FlatStagedCount(h, m); got != idx { // head h's place among the staged
				t.Errorf("d %d: head %d at %d among the staged, want %d", c.d, h, got, idx)
			}
			idx++
		}
	}
}

// TestNonFiniteChecks checks where the forward kernels handle non-finite
// values (fwd_mask.go): every variant, of every family, flags its O values in
// the epilogue and votes once after the stores, a positive vote raising the
// non-finite flag; the slow path nf_rows runs in the fix-up kernel only
// (NonFiniteKernel: a flag test first, the flag cleared by its last block;
// over flat rows with nf_lse2 too); nothing of it runs in the main loop, and
// no kernel checks or zeroes tiles any more.
func TestNonFiniteChecks(t *testing.T) {
	causal := func(v *Variant) { v.Mask = MaskWindow }
	tma := func(f func(*Variant), flat, staged bool) func(*Variant) {
		return func(v *Variant) {
			if f != nil {
				f(v)
			}
			v.TMA, v.Flat, v.FlatStaged = true, flat, staged
		}
	}
	hopper := func(dt attn.DType, d int, f func(*Variant)) Variant {
		v := hopperVariant(t, dt, d, d, nil)
		if f != nil {
			f(&v)
		}
		return v
	}
	extras := func(v *Variant) { v.Mask, v.Softcap, v.Bias, v.Dropout = MaskWindow, true, BiasBF16, true }
	cases := []struct {
		name string
		v    Variant
	}{
		{"mma-cp.async-causal", fwdVariant(t, attn.BFloat16, 64, 64, 16, causal)},
		{"mma-8-byte-window-varlen", fwdVariant(t, attn.Float16, 128, 128, 8, func(v *Variant) { v.Mask, v.Varlen = MaskWindow, true })},
		{"mma-registers-causal", fwdVariant(t, attn.BFloat16, 64, 64, 2, causal)},
		{"mma-fp32-causal-split", fwdVariant(t, attn.Float32, 512, 512, 4, causal)},
		{"mma-unmasked", fwdVariant(t, attn.BFloat16, 128, 128, 16, nil)},
		{"mma-extras", fwdVariant(t, attn.BFloat16, 64, 64, 16, extras)},
		{"mma-no-lse", fwdVariant(t, attn.BFloat16, 64, 64, 16, func(v *Variant) { v.Mask, v.LSE = MaskWindow, false })},
		{"hopper-cp.async-causal", hopper(attn.BFloat16, 128, causal)},
		{"hopper-cp.async-unmasked", hopper(attn.Float16, 64, nil)},
		{"hopper-tma-causal", hopper(attn.BFloat16, 128, tma(causal, false, false))},
		{"hopper-tma-causal-d64", hopper(attn.BFloat16, 64, tma(causal, false, false))},
		{"hopper-tma-causal-split", hopper(attn.BFloat16, 512, tma(causal, false, false))},
		{"hopper-tma-unmasked", hopper(attn.BFloat16, 128, tma(nil, false, false))},
		{"hopper-tma-extras", hopper(attn.BFloat16, 128, tma(extras, false, false))},
		{"hopper-flat-unmasked", hopper(attn.BFloat16, 208, tma(nil, true, false))},
		{"hopper-flatstaged-causal", hopper(attn.BFloat16, 64, tma(causal, true, true))},
	}
	for _, c := range cases {
		src, err := c.v.Source()
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		name := c.name + " (" + c.v.Name() + ")"
		has := map[string]bool{
			"DEV void nf_rows(":              true,
			"__syncthreads_or(nf_o != nf_o)": true,
			"nf_rows(p, l2s,":                false,
			"DEV float nf_lse2(":             c.v.Flat || !c.v.LSE,
			"nf_fix(":                        false,
			"nf_add_keys(":                   false,
			"nf_acc(":                        false,
			"vany":                           false,
		}
		for sub, want := range has {
			if got := strings.Contains(src, sub); got != want {
				t.Errorf("%s: source has %q: %v, want %v", name, sub, got, want)
			}
		}
		// the fix-up kernel ahead of the main kernel: a flag test, nf_rows over the CTAs, the flag cleared
		fix := strings.Index(src, " "+NonFiniteKernel+"(")
		mainAt := strings.Index(src, " "+KernelName+"(")
		if fix < 0 || mainAt < fix {
			t.Fatalf("%s: no fix-up kernel %s ahead of %s", name, NonFiniteKernel, KernelName)
		}
		for _, sub := range []string{"if (*(volatile u32*)flag == 0u) return;", "nf_rows(p, b, h, m0, min(BM, n - m0), qs, dlo, dhi, tid);",
			"if (atomicAdd(flag + 1, 1u) == gridDim.x - 1) {", "flag[0] = 0u;"} {
			if !strings.Contains(src[fix:mainAt], sub) {
				t.Errorf("%s: fix-up kernel lacks %q", name, sub)
			}
		}
		if strings.Contains(src[mainAt:], "nf_rows(") {
			t.Errorf("%s: the main kernel calls nf_rows", name)
		}
		// the main loop (to the coordinates' recomputation after it) does no non-finite work
		lo := strings.Index(src, "main loop over key blocks")
		hi := strings.Index(src, "CTA coordinates again")
		if lo < 0 || hi < lo {
			t.Fatalf("%s: main loop not found", name)
		}
		for _, sub := range []string{"nf_", "__syncthreads_or(", "__ballot_sync("} {
			if strings.Contains(src[lo:hi], sub) {
				t.Errorf("%s: main loop has %q", name, sub)
			}
		}
		// one vote, after the last store of O (and its flag), raising the flag
		vote := strings.Index(src, "__syncthreads_or(nf_o != nf_o)")
		if !strings.HasPrefix(src[vote:], "__syncthreads_or(nf_o != nf_o) && tid == 0) atomicOr((u32*)p.nf_flag, 1u);") {
			t.Errorf("%s: the vote does not raise the flag", name)
		}
		if strings.Count(src, "__syncthreads_or(") != 1 {
			t.Errorf("%s: %d votes, want 1", name, strings.Count(src, "__syncthreads_or("))
		}
		for _, store := range []string{"store_pair(orow", "row_out((unsigned char*)(gO", "nf_o = fmaf(a0", "nf_o += nf"} {
			if at := strings.LastIndex(src, store); at > vote {
				t.Errorf("%s: %q after the vote", name, store)
			}
		}
	}
}
