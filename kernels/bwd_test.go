package kernels

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// bwdMatrix is the variant matrix the generator must handle.
func bwdMatrix() []BwdVariant {
	var out []BwdVariant
	for _, dt := range []attn.DType{attn.Float16, attn.BFloat16, attn.Float32} {
		for _, d := range [][2]int{{64, 64}, {128, 128}, {256, 256}, {512, 512}, {59, 59}, {1, 1}, {111, 127}, {199, 257}, {32, 96}, {16, 512}} {
			for _, feat := range []int{0, 1, 2, 3} {
				v := BwdVariant{DType: dt, DK: d[0], DV: d[1]}
				g := 16 / dt.Size()
				v.Vector = d[0]%g == 0 && d[1]%g == 0
				v.Staged = !v.Vector
				switch feat {
				case 1:
					v.Mask, v.AtomicDQ = MaskWindow, true
				case 2:
					v.Mask, v.Softcap, v.Dropout, v.Varlen = MaskWindow, true, true, true
				case 3:
					v.Bias, v.BiasGrad, v.Softcap, v.AtomicDQ = BiasFor(dt), true, true, true
				}
				out = append(out, v)
			}
		}
	}
	return out
}

// mainBwdVariants are the variants whose kernels must not spill.
func mainBwdVariants() []BwdVariant {
	var out []BwdVariant
	for _, dt := range []attn.DType{attn.Float16, attn.BFloat16} {
		for _, d := range []int{64, 128, 256} {
			for _, atomic := range []bool{false, true} {
				for _, masked := range []bool{false, true} {
					out = append(out, BwdVariant{DType: dt, DK: d, DV: d, Features: Features{Mask: MaskFor(masked)}, Vector: true, AtomicDQ: atomic})
				}
			}
		}
	}
	return out
}

func TestBwdSourceMatrix(t *testing.T) {
	seen := map[string]bool{}
	for _, v := range bwdMatrix() {
		src, err := v.Source()
		if err != nil {
			t.Errorf("%s: %v", v.Name(), err)
			continue
		}
		for _, name := range []string{BwdPreKernel, BwdDKDVKernel, BwdDQKernel, BwdDQConvertKernel, BwdDBiasKernel, BwdNonFiniteKernel} {
			if !strings.Contains(src, "extern \"C\" __global__ void __launch_bounds__") || !strings.Contains(src, " "+name+"(const BwdParams p)") {
				t.Errorf("%s: kernel %s missing", v.Name(), name)
			}
		}
		if strings.Count(src, "{") != strings.Count(src, "}") {
			t.Errorf("%s: unbalanced braces", v.Name())
		}
		if v.Dropout != (strings.Contains(src, "(dkeep, (u32)(i0 + wms * ") && strings.Contains(src, "DEV void drop_bits(")) {
			t.Errorf("%s: dropout code present = %v", v.Name(), !v.Dropout)
		}
		// (the non-finite fix-up's done counter aside)
		if v.AtomicDQ != strings.Contains(strings.Replace(src, "atomicAdd(p.nf_flag + 1, 1u)", "", 1), "atomicAdd(") {
			t.Errorf("%s: atomic code present = %v", v.Name(), !v.AtomicDQ)
		}
		if v.Staged != strings.Contains(src, " "+BwdPackKernel+"(const BwdParams p)") {
			t.Errorf("%s: pack kernel present = %v", v.Name(), !v.Staged)
		}
		if v.Staged && strings.Contains(src, "cp_async16(s + r * LD + col, ok ? (const void*)(g + r * rs + col)") == false {
			t.Errorf("%s: staged variant without 16-byte loads", v.Name())
		}
		if seen[v.Name()] {
			t.Errorf("duplicate key %s", v.Name())
		}
		seen[v.Name()] = true
		src2, _ := v.Source()
		if src2 != src {
			t.Errorf("%s: source is not a pure function of the variant", v.Name())
		}
	}
}

// TestBwdDefaultTilesEveryDim checks that the default tiles give a valid
// variant for every head-dim pair class and dtype, both dQ algorithms.
func TestBwdDefaultTilesEveryDim(t *testing.T) {
	for _, dt := range []attn.DType{attn.Float16, attn.BFloat16, attn.Float32} {
		for d := 1; d <= attn.MaxHeadDim; d++ {
			for _, dv := range []int{d, 1, attn.MaxHeadDim} {
				for _, atomic := range []bool{false, true} {
					v := BwdVariant{DType: dt, DK: d, DV: dv, Features: Features{Mask: MaskWindow}, AtomicDQ: atomic}
					v.Staged = BwdNeedsStaging(dt, d, dv)
					v.Vector = !v.Staged
					if err := v.Validate(); err != nil {
						t.Fatalf("%s: %v", v.Name(), err)
					}
				}
			}
		}
	}
}

func TestBwdValidate(t *testing.T) {
	cases := []struct {
		name string
		v    BwdVariant
		want error
	}{
		{"dtype", BwdVariant{DType: attn.DType(9), DK: 64, DV: 64}, attn.ErrDType},
		{"dk0", BwdVariant{DType: attn.Float16, DK: 0, DV: 64}, attn.ErrShape},
		{"dv513", BwdVariant{DType: attn.Float16, DK: 64, DV: 513}, attn.ErrShape},
		{"dbias without bias", BwdVariant{DType: attn.Float16, DK: 64, DV: 64, BiasGrad: true}, attn.ErrOption},
		{"bias varlen", BwdVariant{DType: attn.Float16, DK: 64, DV: 64, Features: Features{Bias: BiasF16, Varlen: true}}, attn.ErrUnsupported},
		{"vector odd", BwdVariant{DType: attn.Float16, DK: 59, DV: 64, Vector: true}, attn.ErrLayout},
		{"vector and staged", BwdVariant{DType: attn.Float16, DK: 64, DV: 64, Vector: true, Staged: true}, attn.ErrOption},
		{"tile", BwdVariant{DType: attn.Float16, DK: 64, DV: 64, Tiles: BwdTiles{DKDV: BwdTile{24, 64, 8, 2, 1}}}, attn.ErrUnsupported},
		{"smem", BwdVariant{DType: attn.Float16, DK: 512, DV: 512, Tiles: BwdTiles{DKDV: BwdTile{128, 128, 8, 2, 1}}}, attn.ErrUnsupported},
		{"ok", BwdVariant{DType: attn.BFloat16, DK: 128, DV: 128, Vector: true}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { checkValidate(t, c.v, c.want) })
	}
}

func TestBwdParamsLayout(t *testing.T) {
	p := BwdParams{Q: 0x1122334455667788, PDO: 0x99, NFFlag: 0x77, PDOS: BwdStrides{Head: -2}, LSEBatch: 5, DBiasElems: 1 << 33, B: 3, DropOffs: 0xdeadbeef}
	b := p.Pack()
	if len(b) != 656 || bwdParamsStruct.Size() != 656 {
		t.Fatalf("params of %d bytes, want 656: 22 pointers, 48 strides and counts, 23 four-byte fields", len(b))
	}
	checkLayout(t, bwdParamsStruct, b, []layoutCheck{
		{"q", 0, 8, 0x1122334455667788}, {"lse", 40, 8, 0}, {"pdo", 160, 8, 0x99}, {"nf_flag", 168, 8, 0x77}, {"q_sb", 176, 8, 0},
		{"pdo_sh", 480, 8, uint64(1<<64 - 2)}, {"lse_sb", 488, 8, 5}, {"dbias_elems", 552, 8, 1 << 33},
		{"B", 560, 4, 3}, {"drop_offset", 632, 4, 0xdeadbeef},
	})
}

func TestBwdWarpGrid(t *testing.T) {
	cases := []struct{ m, n, w, wm, wn int }{
		{64, 128, 8, 2, 4}, {128, 128, 8, 4, 2}, {32, 32, 8, 2, 4}, {128, 16, 8, 8, 1}, {64, 64, 4, 2, 2},
		{16, 8, 4, 1, 1}, {32, 16, 8, 2, 2},
	}
	for _, c := range cases {
		wm, wn, err := bwdWarpGrid(c.m, c.n, c.w)
		if err != nil || wm != c.wm || wn != c.wn {
			t.Errorf("bwdWarpGrid(%d,%d,%d) = %d,%d,%v want %d,%d", c.m, c.n, c.w, wm, wn, err, c.wm, c.wn)
		}
	}
	if _, _, err := bwdWarpGrid(8, 8, 4); err == nil {
		t.Errorf("bwdWarpGrid(8,8,4) accepted")
	}
}

func bwdCompile(t *testing.T, c *cuda.Compiler, v BwdVariant) []cuda.KernelResources {
	t.Helper()
	src, err := v.Source()
	if err != nil {
		t.Fatalf("%s: %v", v.Name(), err)
	}
	if dir := os.Getenv("FLASHATTN_DUMP_BWD"); dir != "" {
		_ = os.WriteFile(filepath.Join(dir, v.Name()+".cu"), []byte(src), 0o644)
	}
	out, err := c.Compile(cuda.CompileRequest{Name: v.Name() + ".cu", Source: src, Arch: "sm_90", Verbose: true, NoCache: true})
	if err != nil {
		t.Fatalf("%s: %v", v.Name(), err)
	}
	return out.Stats.Resources
}

// TestBwdCompileMain compiles the main variants with NVRTC for sm_90 and
// checks that ptxas reports no spills in the dK/dV and dQ kernels.
func TestBwdCompileMain(t *testing.T) {
	c := compilerOrSkip(t)
	vs := mainBwdVariants()
	switch {
	case os.Getenv("FLASHATTN_BWD_MATRIX") != "":
		// every main variant
	case testing.Short():
		vs = vs[:1]
	default:
		// One dtype, one per head dim, and the masked atomic kernel of D=128:
		// compiling is slow on small machines.
		vs = []BwdVariant{vs[12], vs[16], vs[20], vs[19]}
	}
	for _, v := range vs {
		res := bwdCompile(t, c, v)
		if len(res) < 5 {
			t.Fatalf("%s: ptxas reported %d kernels", v.Name(), len(res))
		}
		for _, r := range res {
			t.Logf("%s %s: %d regs, %d stack, spills %d/%d", v.Name(), r.Name, r.Registers, r.StackBytes, r.SpillStores, r.SpillLoads)
			// NVRTC 13.0 spills 16 bytes in the D=128 separate dQ kernel (none
			// under 11.8; the same speed on the H200); the non-finite fix-up
			// does its work only after a main kernel raised the flag
			if r.Name != BwdNonFiniteKernel && (r.SpillStores > 16 || r.SpillLoads > 16) {
				t.Errorf("%s %s spills: %d bytes stored, %d loaded", v.Name(), r.Name, r.SpillStores, r.SpillLoads)
			}
		}
	}
}

// TestBwdCompileMatrix compiles variants of the matrix with NVRTC: a
// spread seventh with FLASHATTN_BWD_MATRIX=1, all of them with =all (long).
func TestBwdCompileMatrix(t *testing.T) {
	s := os.Getenv("FLASHATTN_BWD_MATRIX")
	if s == "" {
		t.Skip("compiling the backward variant matrix runs with FLASHATTN_BWD_MATRIX=1 (or =all)")
	}
	c := compilerOrSkip(t)
	vs := bwdMatrix()
	if s != "all" {
		// A spread subset keeps the default run under a minute or two.
		var sub []BwdVariant
		for i, v := range vs {
			if i%7 == 0 {
				sub = append(sub, v)
			}
		}
		vs = sub
	}
	for _, v := range vs {
		t.Run(fmt.Sprint(v.Name()), func(t *testing.T) { bwdCompile(t, c, v) })
	}
}

// TestBwdDQAccDim checks the atomic dQ accumulator's row length: at least
// the head dim and the padded width a Flat variant adds into (FlatWidth:
// K's shifted columns), rows that never straddle a 128-byte line.
func TestBwdDQAccDim(t *testing.T) {
	for _, c := range []struct{ dk, want int }{{1, 16}, {4, 16}, {5, 16}, {8, 16}, {9, 16}, {16, 16}, {17, 32}, {32, 32}, {33, 64}, {59, 64}, {64, 64}, {127, 128}, {199, 224}, {257, 288}, {512, 512}} {
		if got := BwdDQAccDim(c.dk); got != c.want {
			t.Errorf("BwdDQAccDim(%d) = %d, want %d", c.dk, got, c.want)
		}
	}
	for dk := 1; dk <= 512; dk++ {
		n := BwdDQAccDim(dk)
		if n < FlatWidth(dk) || (128%(4*n) != 0 && (4*n)%128 != 0) {
			t.Errorf("BwdDQAccDim(%d) = %d: shorter than the flat width %d or straddling 128-byte lines", dk, n, FlatWidth(dk))
		}
	}
}

// TestBwdNonFiniteChecks checks where the backward kernels handle
// non-finite values (bwd_nan.go): in every variant, each main kernel folds
// its accumulators after its last store and votes once, a positive vote
// raising the non-finite flag, its main loop holding none of it (no nf_
// function, vote or ballot), and no main kernel (nor the convert kernel)
// calls nf_keys or nf_query: the fix-up kernel does, behind a flag test,
// and its last block clears the flag, which the preprocess zeroes first;
// nf_pair takes the variant's transforms (softcap, bias, dropout) and
// rewrites the dBias scratch only with BiasGrad.
func TestBwdNonFiniteChecks(t *testing.T) {
	vs := []BwdVariant{
		{DType: attn.BFloat16, DK: 64, DV: 64, Features: Features{Mask: MaskWindow}, Vector: true, AtomicDQ: true},
		{DType: attn.Float32, DK: 59, DV: 59, Features: Features{Mask: MaskWindow, Softcap: true, Dropout: true}, Staged: true},
		{DType: attn.Float16, DK: 59, DV: 37, Features: Features{Bias: BiasF32}, BiasGrad: true},
		{DType: attn.BFloat16, DK: 128, DV: 128, Features: Features{Mask: MaskWindow}, Vector: true, WGMMA: true, TMA: true},
		{DType: attn.BFloat16, DK: 256, DV: 256, Vector: true, WGMMA: true, AtomicDQ: true},
		{DType: attn.BFloat16, DK: 199, DV: 199, Features: Features{Mask: MaskWindow}, Flat: true, WGMMA: true, TMA: true, AtomicDQ: true},
	}
	for _, v := range vs {
		src, err := v.Source()
		if err != nil {
			t.Fatalf("%s: %v", v.Name(), err)
		}
		for sub, want := range map[string]bool{
			"drop_u8((unsigned)i + p.drop_q0, (unsigned)j + p.drop_k0": v.Dropout,
			"(s * p.softcap_in)":            v.Softcap,
			"sv += bt_to_f(p.bias":          v.Biased(),
			"if (use) *(p.dbias_scratch + ": v.BiasGrad,
			"if (p.right >= 0) ilo = max(":  v.Masked(),
		} {
			if got := strings.Contains(src, sub); got != want {
				t.Errorf("%s: source has %q: %v, want %v", v.Name(), sub, got, want)
			}
		}
		kernel := func(name string) string {
			start := strings.Index(src, " "+name+"(")
			if start < 0 {
				t.Fatalf("%s: no kernel %s", v.Name(), name)
			}
			body := src[start:]
			if end := strings.Index(body, "extern \"C\""); end >= 0 {
				body = body[:end] // up to the next kernel
			}
			return body
		}
		fix := kernel(BwdNonFiniteKernel)
		for _, sub := range []string{"if (*(volatile unsigned*)p.nf_flag == 0u) return;",
			"nf_keys(p, b, hd, qr0, kr0, n, m, j0, min(KT, m - j0), warp, NW, lane)", "nf_query(p, b, hd, qr0, kr0, n, m, i0 + r, lane)",
			"if (atomicAdd(p.nf_flag + 1, 1u) == gridDim.x - 1) {", "p.nf_flag[0] = 0u;"} {
			if !strings.Contains(fix, sub) {
				t.Errorf("%s %s: no %q", v.Name(), BwdNonFiniteKernel, sub)
			}
		}
		if !strings.Contains(kernel(BwdPreKernel), "p.nf_flag[threadIdx.x] = 0u;") {
			t.Errorf("%s: the preprocess does not zero the flag", v.Name())
		}
		for _, k := range []struct{ name, vote string }{
			{BwdDKDVKernel, "__syncthreads_or(nfo)"},
			{BwdDQKernel, "__syncthreads_or(nfo)"},
			{BwdDQConvertKernel, "__ballot_sync(0xffffffffu, bad) != 0u"},
		} {
			body := kernel(k.name)
			for _, rare := range []string{"nf_keys(", "nf_query("} {
				if strings.Contains(body, rare) {
					t.Errorf("%s %s: calls %s", v.Name(), k.name, rare)
				}
			}
			if !strings.Contains(body, k.vote+" && threadIdx.x == 0) atomicOr(p.nf_flag, 1u);") &&
				!strings.Contains(body, k.vote+" && lane == 0) atomicOr(p.nf_flag, 1u);") {
				t.Errorf("%s %s: the vote does not raise the flag", v.Name(), k.name)
			}
			if k.name == BwdDQConvertKernel {
				continue
			}
			vote := strings.Index(body, "__syncthreads_or(nfo)")
			loop := strings.Index(body, "for (int it = 0; it <")
			if vote < 0 || loop < 0 || strings.Count(body, "__syncthreads_or(") != 1 {
				t.Errorf("%s %s: want one vote after a main loop", v.Name(), k.name)
				continue
			}
			for _, store := range []string{"store_pair<", "stage_pair<", "row_out("} {
				if last := strings.LastIndex(body, store); last > vote {
					t.Errorf("%s %s: %s after the vote", v.Name(), k.name, store)
				}
			}
			main := body[loop:strings.Index(body, "nf_fold(")]
			for _, sub := range []string{"nf_", "__ballot_sync", "__syncthreads_or"} {
				if strings.Contains(main, sub) {
					t.Errorf("%s %s: the main loop holds %q", v.Name(), k.name, sub)
				}
			}
		}
	}
}

// TestBwdCompileNonFinite compiles the masked variants of the benchmark
// shapes (bf16, D = 64 and 128, both dQ algorithms; the mma.sync kernels,
// the Hopper kernels by cp.async and by tensor maps, and a flat one) with
// NVRTC and checks ptxas's report on their dK/dV and dQ kernels, whose
// epilogues hold the non-finite checks and their slow path: no serialized
// warpgroup products, and no more spills than TestBwdCompileMain and
// TestBwdCompileHopper allow.
func TestBwdCompileNonFinite(t *testing.T) {
	c := compilerOrSkip(t)
	var vs []BwdVariant
	for _, d := range []int{64, 128} {
		for _, atomic := range []bool{true, false} {
			for _, kind := range []struct{ wgmma, tma bool }{{false, false}, {true, false}, {true, true}} {
				vs = append(vs, BwdVariant{DType: attn.BFloat16, DK: d, DV: d, Features: Features{Mask: MaskWindow}, Vector: true, AtomicDQ: atomic, WGMMA: kind.wgmma, TMA: kind.tma})
			}
		}
	}
	vs = append(vs, BwdVariant{DType: attn.BFloat16, DK: 121, DV: 121, Features: Features{Mask: MaskWindow}, Flat: true, AtomicDQ: true, WGMMA: true, TMA: true})
	if major, _ := c.Version(); major < 12 {
		vs = slices.DeleteFunc(vs, func(v BwdVariant) bool { return v.WGMMA })
	}
	var wg sync.WaitGroup
	outs := make([]*cuda.Compiled, len(vs))
	errs := make([]error, len(vs))
	for i, v := range vs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			src, err := v.Source()
			if err != nil {
				errs[i] = err
				return
			}
			arch := "sm_90"
			if v.WGMMA {
				arch = "sm_90a"
			}
			outs[i], errs[i] = c.Compile(cuda.CompileRequest{Name: v.Name() + ".cu", Source: src, Arch: arch, Verbose: true, NoCache: true})
		}()
	}
	wg.Wait()
	for i, v := range vs {
		if errs[i] != nil {
			t.Errorf("%s: %v", v.Name(), errs[i])
			continue
		}
		limit := 16
		if v.WGMMA {
			limit = 32
		}
		for _, r := range outs[i].Stats.Resources {
			if r.Name != BwdDKDVKernel && r.Name != BwdDQKernel {
				continue
			}
			t.Logf("%s %s: %d registers, %d B stack, spills %d/%d", v.Name(), r.Name, r.Registers, r.StackBytes, r.SpillStores, r.SpillLoads)
			if r.SpillStores > limit || r.SpillLoads > limit {
				t.Errorf("%s %s spills: %d bytes stored, %d loaded", v.Name(), r.Name, r.SpillStores, r.SpillLoads)
			}
		}
		if strings.Contains(outs[i].Stats.Log, "wgmma.mma_async instructions are serialized") {
			t.Errorf("%s: ptxas serialized the warpgroup products:\n%s", v.Name(), grepLines(outs[i].Stats.Log, "serialized"))
		}
	}
}

// TestPreGroupedDot checks which variants' preprocess sums a warp's rows at
// once, in groups of how many lanes.
func TestPreGroupedDot(t *testing.T) {
	for _, c := range []struct {
		dt    attn.DType
		dv    int
		flat  bool
		group string // "" where the rows are summed a row a warp
	}{
		{attn.BFloat16, 128, false, "a group of 16 lanes a row\n  // (units a row: 16; rows a pass: 2; passes: 2)"},
		{attn.Float16, 64, false, "a group of 8 lanes a row\n  // (units a row: 8; rows a pass: 4; passes: 1)"},
		{attn.BFloat16, 96, false, "a group of 16 lanes a row\n  // (units a row: 12; rows a pass: 2; passes: 2)"},
		{attn.BFloat16, 256, false, "a group of 32 lanes a row\n  // (units a row: 32; rows a pass: 1; passes: 4)"},
		{attn.BFloat16, 8, false, "a group of 1 lanes a row\n  // (units a row: 1; rows a pass: 4; passes: 1)"},
		{attn.Float32, 128, false, "a group of 32 lanes a row\n  // (units a row: 32; rows a pass: 1; passes: 4)"},
		{attn.BFloat16, 512, false, ""}, // 64 units
		{attn.BFloat16, 59, false, ""},  // not whole units
		{attn.BFloat16, 128, true, ""},  // flat rows
	} {
		v := BwdVariant{DType: c.dt, DK: c.dv, DV: c.dv, Flat: c.flat}
		src := preGroupedDot(v)
		if (src == "") != (c.group == "") || c.group != "" && !strings.Contains(src, c.group) {
			t.Errorf("%v DV=%d flat=%v: grouped source\n%s\nwant %q", c.dt, c.dv, c.flat, src, c.group)
		}
		if c.flat {
			continue // (a Flat variant needs the Hopper kernels' tensor maps)
		}
		full, err := v.Source()
		if err != nil {
			t.Fatalf("%v DV=%d: %v", c.dt, c.dv, err)
		}
		if got := strings.Contains(full, "if (!grouped) {"); got != (c.group != "") {
			t.Errorf("%v DV=%d flat=%v: row-a-warp fallback behind the flag %v, want %v", c.dt, c.dv, c.flat, got, c.group != "")
		}
	}
}
