package kernels

import (
	"fmt"
	"strings"

	"github.com/flashattn/flashattn/attn"
)

// bwdGen writes the source of one backward variant.
type bwdGen struct {
	v     BwdVariant
	tiles BwdTiles
	mma   bool // tensor-core products (fp16/bf16); fp32 uses FMA products
	// tileAt, when set, returns the address of element (il, jl) of the
	// shared P or dS tile named tile (the Hopper kernel's swizzled layout);
	// nil means padded rows of LDS elements.
	tileAt func(tile string) string
	// dsRegs makes dsFromDP leave dS in registers, packed as 16-bit pairs
	// in dsp[mt][nt][hh] (the Hopper dQ kernel's A operand), instead of
	// storing it to shared memory.
	dsRegs bool
	// ws is set while the dK/dV kernel of a warp-specialized variant is
	// written (its compute threads meet on named barriers).
	ws bool
}

// at returns the C address of element (il, jl) of the shared tile named tile.
func (g *bwdGen) at(tile string) string {
	if g.tileAt != nil {
		return g.tileAt(tile)
	}
	return tile + " + il * LDS + jl"
}

func newBwdGen(v BwdVariant) *bwdGen {
	return &bwdGen{v: v, tiles: v.ResolvedTiles(), mma: v.DType != attn.Float32}
}

// products returns every block-wide product of the variant's kernels, for
// validation of the warp tilings.
func (v BwdVariant) products() []bwdProduct {
	g := newBwdGen(v)
	if v.WGMMA {
		return nil // (warpgroup products: no warp tiling to validate)
	}
	return append(g.dkdvProducts(0), g.dqProducts(0)...)
}

// bwdCType returns the C storage type of dt.
func bwdCType(dt attn.DType) string {
	switch dt {
	case attn.Float16:
		return "__half"
	case attn.BFloat16:
		return "__nv_bfloat16"
	}
	return "float"
}

// bwdConvFuncs returns the C conversions to and from float for dt, named
// prefix_to_f and prefix_from_f.
func bwdConvFuncs(prefix string, dt attn.DType) string {
	ct := bwdCType(dt)
	var to, from string
	switch dt {
	case attn.Float16:
		to, from = "__half2float(x)", "__float2half_rn(x)"
	case attn.BFloat16:
		to, from = "__bfloat162float(x)", "__float2bfloat16_rn(x)"
	default:
		to, from = "x", "x"
	}
	return fmt.Sprintf("__device__ __forceinline__ float %s_to_f(%s x) { return %s; }\n"+
		"__device__ __forceinline__ %s %s_from_f(float x) { return %s; }\n", prefix, ct, to, ct, prefix, from)
}

// prelude writes what every kernel of the module uses: types, device
// primitives, tile loads and the non-finite checks.
func (g *bwdGen) prelude(b *strings.Builder) {
	g.preludeTypes(b)
	g.preludePrimitives(b)
	g.preludeLoads(b)
	g.nfFuncs(b)
}

// preludeTypes writes the module's header, element types, conversions and
// the params struct.
func (g *bwdGen) preludeTypes(b *strings.Builder) {
	v := g.v
	fmt.Fprintf(b, "// flashattn backward kernels, variant %s\n", v.Name())
	b.WriteString("// Layouts: q [B,N,H,DK], k [B,M,Hkv,DK], v [B,M,Hkv,DV], o/dO [B,N,H,DV] (packed: the batch\n" +
		"// dimension dropped, rows offset by cu_seqlens); LSE, Delta, LSE2 [B,H,N] (packed [H,totalQ]).\n")
	if v.DType == attn.Float16 || (v.Biased() && v.Bias.DType() == attn.Float16) {
		b.WriteString("#include <cuda_fp16.h>\n")
	}
	if v.DType == attn.BFloat16 || (v.Biased() && v.Bias.DType() == attn.BFloat16) {
		b.WriteString("#include <cuda_bf16.h>\n")
	}
	b.WriteString(cTypes)
	fmt.Fprintf(b, "typedef %s T;\n", bwdCType(v.DType))
	bt := v.DType
	if v.Biased() {
		bt = v.Bias.DType()
	}
	fmt.Fprintf(b, "typedef %s BT;\n", bwdCType(bt))
	b.WriteString(bwdConvFuncs("t", v.DType))
	b.WriteString(bwdConvFuncs("bt", bt))
	b.WriteString(`#define FA_INF __int_as_float(0x7f800000)
#define FA_LOG2E 1.4426950408889634f
`)
	b.WriteString(bwdParamsStruct.Decl())
}

// preludePrimitives writes the PTX wrappers, the matrix products' helpers,
// the atomic adds, Philox, the dropout mask's functions and the mask's
// helpers.
func (g *bwdGen) preludePrimitives(b *strings.Builder) {
	v := g.v
	b.WriteString(PrimitivesBegin + "\n")
	b.WriteString("DEV u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }\n")
	b.WriteString(ptxCpAsync(cpAsync{name: "cp_async16", bytes: 16, generic: true, zfill: true, memory: true}))
	b.WriteString(ptxCpAsync(cpAsync{name: "cp_async4", bytes: 4, generic: true, memory: true}))
	b.WriteString(ptxCpCommit("cp_async_commit", true))
	b.WriteString(ptxCpWait("cp_async_wait0", 0, true))
	b.WriteString(ptxEx2("ex2f"))
	if g.keyRowsBiasPairs() {
		b.WriteString(bitsToF32)
	}
	if v.Softcap && softcapTanh(v.DType) == tanhApprox {
		b.WriteString(ptxTanh())
	}
	if g.mma {
		pack := "__floats2half2_rn(a, b_)"
		unpack := "const __half2 h = *reinterpret_cast<const __half2*>(&x); const float2 f = __half22float2(h); a = f.x; b_ = f.y;"
		if v.DType == attn.BFloat16 {
			pack = "__floats2bfloat162_rn(a, b_)"
			unpack = "a = __uint_as_float(x << 16); b_ = __uint_as_float(x & 0xffff0000u);"
		}
		fmt.Fprintf(b, "DEV u32 pack2(float a, float b_) { auto h = %s; return *reinterpret_cast<u32*>(&h); }\n", pack)
		b.WriteString(ptxLdmatrixDoc)
		b.WriteString(ptxLdmatrix("ldsm_x4", 4, false, false))
		b.WriteString(ptxLdmatrix("ldsm_x4_t", 4, true, false))
		b.WriteString(ptxLdmatrix("ldsm_x4", 4, false, true))
		b.WriteString(ptxLdmatrix("ldsm_x4_t", 4, true, true))
		b.WriteString("// x2: two matrices, addressed by lanes 0..15.\n")
		b.WriteString(ptxLdmatrix("ldsm_x2", 2, false, true))
		b.WriteString(ptxLdmatrix("ldsm_x2_t", 2, true, true))
		b.WriteString(ptxMMA("mma16816", v.DType))
		if v.KeyRows && v.AtomicDQ {
			b.WriteString(ptxStmatrixTrans)
		}
		fmt.Fprintf(b, `// st_pair writes two adjacent elements of a shared-memory tile (column even).
DEV void st_pair(T* s, float a, float b_) { *reinterpret_cast<u32*>(s) = pack2(a, b_); }
// unpack2 is the inverse of pack2 (low half first).
DEV void unpack2(u32 x, float& a, float& b_) { %s }
`, unpack)
	} else {
		b.WriteString("DEV void st_pair(T* s, float a, float b_) { *reinterpret_cast<float2*>(s) = make_float2(a, b_); }\n")
		b.WriteString(ptxMMA("mma1688", v.DType))
		b.WriteString(ptxTF32Split("tf32_split", false))
		b.WriteString(mmaSplitTF32("mma_tf32x3", "mma1688"))
	}
	if v.LightTail {
		b.WriteString(smCountPrimitive)
	}
	b.WriteString(PrimitivesEnd + "\n")
	if v.LightTail {
		b.WriteString(ctaOrderFunc)
	}
	if v.AtomicDQ {
		b.WriteString(redAddPair)
	}
	if v.Dropout {
		b.WriteString(DropoutSource)
		if v.KeyRows {
			b.WriteString(dropBitsKeyRowsFunc)
		}
	}
	if v.Masked() {
		b.WriteString(`// visible reports whether key j (of m) is in the window of query i; off places the diagonal.
__device__ __forceinline__ bool visible(int i, int j, int m, int off, int left, int right) {
  const int d = i + off;
  return j < m && (left < 0 || j >= d - left) && (right < 0 || j <= d + right);
}
`)
	} else {
		b.WriteString("__device__ __forceinline__ bool visible(int i, int j, int m, int off, int left, int right) { return j < m; }\n")
	}
}

// rowKeys returns, under a mask, the statements that narrow [jlo, jhi)
// (declared by the caller as all the keys) to the keys query row i (an
// expression) sees, with off the diagonal's place as visible takes it,
// each line after indent; nothing without a mask.
func (g *bwdGen) rowKeys(indent, i string) string {
	if !g.v.Masked() {
		return ""
	}
	return fmt.Sprintf("%[1]sif (p.left >= 0) jlo = max(jlo, %[2]s + off - p.left);\n%[1]sif (p.right >= 0) jhi = min(jhi, %[2]s + off + p.right + 1);\n", indent, i)
}

// preludeLoads writes the global tile loads and stores and load_stats.
func (g *bwdGen) preludeLoads(b *strings.Builder) {
	v := g.v
	// Global tile loads: 16-byte copies when rows allow them (Vector) or
	// come from the padded staging copies (Staged), element-wise otherwise.
	epc := 16 / v.elem()
	if v.Vector || v.Staged {
		fmt.Fprintf(b, `// load_tile copies rows [0, R) of a head slice (row r at g + r*rs) into s[R][LD]; rows >= rlim and
// columns >= D read as zero. 16-byte asynchronous copies (rows are 16-byte aligned; a chunk that
// straddles D reads the row's zero padding, which only staging copies have).
template <int R, int DP, int LD, int D, int NTH>
__device__ __forceinline__ void load_tile(T* s, const T* g, long long rs, int rlim) {
  constexpr int CH = DP / %d, TOT = R * CH;
#pragma unroll
  for (int it = 0; it < (TOT + NTH - 1) / NTH; ++it) {
    const int c = it * NTH + threadIdx.x;
    if (TOT %% NTH == 0 || c < TOT) {
      const int r = c / CH, col = (c %% CH) * %d;
      const bool ok = r < rlim && col < D;
      cp_async16(s + r * LD + col, ok ? (const void*)(g + r * rs + col) : (const void*)g, ok ? 16 : 0);
    }
  }
}
`, epc, epc)
	} else {
		b.WriteString(`// load_tile copies rows [0, R) of a head slice (row r at g + r*rs) into s[R][LD]; rows >= rlim and
// columns >= D read as zero. Element-wise loads (rows not 16-byte aligned).
template <int R, int DP, int LD, int D, int NTH>
__device__ __forceinline__ void load_tile(T* s, const T* g, long long rs, int rlim) {
  constexpr int TOT = R * DP;
#pragma unroll 4
  for (int it = 0; it < (TOT + NTH - 1) / NTH; ++it) {
    const int c = it * NTH + threadIdx.x;
    if (TOT % NTH == 0 || c < TOT) {
      const int r = c / DP, col = c % DP;
      T x = t_from_f(0.f);
      if (r < rlim && col < D) x = g[r * rs + col];
      s[r * LD + col] = x;
    }
  }
}
`)
	}
	if v.Vector {
		fmt.Fprintf(b, `// store_pair writes elements col and col+1 (< D; col even) of a global row.
template <int D>
__device__ __forceinline__ void store_pair(T* g, int col, float a, float b_) {
  if (col < D) { %s }
}
`, g.vectorPairStore())
	} else {
		// rows of an odd head dim start at alternating alignments: the pairs
		// of every other row go out as one store; a flat row's shifted
		// columns start below 0
		lo := func(c string) string {
			if v.Flat {
				return c
			}
			return ""
		}
		fmt.Fprintf(b, `// store_pair writes elements col and col+1 (those < D) of a global row: one store where both are in
// range and the pair is aligned to its size, one per element otherwise.
template <int D>
__device__ __forceinline__ void store_pair(T* g, int col, float a, float b_) {
  if (%[2]scol + 1 < D && (reinterpret_cast<unsigned long long>(g + col) & (2 * sizeof(T) - 1)) == 0) {
    %[1]s
    return;
  }
  if (%[3]scol < D) g[col] = t_from_f(a);
  if (%[4]scol + 1 < D) g[col + 1] = t_from_f(b_);
}
`, g.vectorPairStore(), lo("col >= 0 && "), lo("col >= 0 && "), lo("col >= -1 && "))
	}
	if v.WGMMA && v.stagedStores() {
		b.WriteString(`// stage_pair writes elements col and col+1 (those in [0, D)) of a row of a shared-memory tile, which
// bwdRowsOut's loop then writes out whole
template <int D>
__device__ __forceinline__ void stage_pair(T* s, int col, float a, float b_) {
  if (col >= 0 && col < D) s[col] = t_from_f(a);
  if (col + 1 >= 0 && col + 1 < D) s[col + 1] = t_from_f(b_);
}
`)
	}
	if v.Staged {
		b.WriteString(stageSource)
	}
	b.WriteString(`// load_stats copies rows [0, R) of LSE2 and Delta; rows >= rlim get +inf and 0 (no probability).
template <int R, int NTH>
__device__ __forceinline__ void load_stats(float* sl, float* sd, const float* gl, const float* gd, int rlim) {
  for (int r = threadIdx.x; r < R; r += NTH) {
    if (r < rlim) { cp_async4(sl + r, gl + r); cp_async4(sd + r, gd + r); }
    else { sl[r] = FA_INF; sd[r] = 0.f; }
  }
}
`)
}

// vectorPairStore is the body storing (a, b_) at g[col], g[col+1].
func (g *bwdGen) vectorPairStore() string {
	if g.mma {
		return "*reinterpret_cast<unsigned*>(g + col) = pack2(a, b_);"
	}
	return "*reinterpret_cast<float2*>(g + col) = make_float2(a, b_);"
}

// source assembles the whole module.
func (g *bwdGen) source() string {
	var b strings.Builder
	g.prelude(&b)
	if g.v.WGMMA {
		g.hopperPrelude(&b)
	}
	g.packKernel(&b)
	g.preKernel(&b)
	g.convertKernel(&b)
	g.dbiasKernel(&b)
	g.nfFixupKernel(&b)
	switch {
	case g.v.WGMMA && g.v.bwdHopperDeep():
		g.dkdvKernelHopperDeep(&b)
		g.dqKernelHopperDeep(&b)
	case g.v.WGMMA:
		g.dkdvKernelHopper(&b)
		g.dqKernelHopper(&b)
	default:
		g.dkdvKernel(&b)
		g.dqKernel(&b)
	}
	return b.String()
}

// segment declares n, m, qr0, kr0 for batch element (segment) b.
func (g *bwdGen) segment(b *strings.Builder) {
	b.WriteString("  int n = p.N, m = p.M; long long qr0 = 0, kr0 = 0;\n")
	if g.v.Varlen {
		b.WriteString("  qr0 = p.cuq[b]; n = p.cuq[b + 1] - p.cuq[b]; kr0 = p.cuk[b]; m = p.cuk[b + 1] - p.cuk[b];\n")
	}
}

func (g *bwdGen) preKernel(b *strings.Builder) {
	v := g.v
	fmt.Fprintf(b, `// Preprocess: Delta = rowsum(dO∘O), LSE2 = LSE·log2(e) (+inf for rows with no key)%s.
// grid (ceil(N/%d), B, H), %d threads; a warp's rows summed at once where they allow it, else one warp per row.
extern "C" __global__ void __launch_bounds__(%d) %s(const BwdParams p) {
  const int b = blockIdx.y, h = blockIdx.z, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
`, preZeroes(v), BwdPreRows, BwdPreThreads, BwdPreThreads, BwdPreKernel)
	nfZeroFlags(b, v)
	g.segment(b)
	rowDot := fmt.Sprintf(`    const T* go = p.o + b * p.o_sb + (qr0 + i) * p.o_sr + h * p.o_sh;
    const T* gd = p.dout + b * p.do_sb + (qr0 + i) * p.do_sr + h * p.do_sh;
    float acc = 0.f;
%s#pragma unroll
    for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (lane == 0) {
      const long long si = b * p.stat_sb + h * p.stat_sh + qr0 + i;
      const float l = p.lse[b * p.lse_sb + h * p.lse_sh + qr0 + i];
      p.delta[si] = acc;
      p.lse2[si] = l == -FA_INF ? FA_INF : l * FA_LOG2E;
    }
`, preRowDot(v))
	if grouped := preGroupedDot(v); grouped != "" {
		b.WriteString(grouped)
		rowDot = "    if (!grouped) {  // a row a warp\n" + indentLines(rowDot, "  ") + "    }\n"
	}
	fmt.Fprintf(b, `  for (int r = warp; r < %d; r += %d) {
    const int i = blockIdx.x * %d + r;
    if (i >= n) break;
%s`, BwdPreRows, BwdPreThreads/32, BwdPreRows, rowDot)
	b.WriteString(g.dbiasZero())
	switch {
	case v.DQAccTiled():
		fmt.Fprintf(b, `    float* ga = p.dqacc + b * p.dqa_sb + h * p.dqa_sh;  // the tiled accumulator (rows past n are added zeros, never read)
    for (int c = lane; 4 * c < %d; c += 32)  // four columns a lane: 16 bytes of an 8-float chunk
      *reinterpret_cast<float4*>(ga + %s) = make_float4(0.f, 0.f, 0.f, 0.f);
`, v.DKPad(), v.dqAccTiledAt("i", "4 * c"))
	case v.AtomicDQ:
		fmt.Fprintf(b, `    float* gq = p.dqacc + b * p.dqa_sb + (qr0 + i) * p.dqa_sr + h * p.dqa_sh;
    for (int d = lane; d < %d; d += 32) gq[d] = 0.f;  // the whole padded row: vector adds touch it
`, BwdDQAccDim(v.DK))
	}
	b.WriteString("  }\n}\n\n")
}

// preZeroes names, for the preprocess's comment, the accumulators it
// zeroes: dQ's (AtomicDQ) and dBias's (DBiasAtomic, DBiasTiles; DBiasDirect, DBiasStore: dBias
// itself, under a mask; DBiasReduce: dBias where the heads share its planes, else its hidden pairs under a
// mask).
func preZeroes(v BwdVariant) string {
	s := ""
	if v.AtomicDQ {
		s = ", zeroes the dQ accumulator"
	}
	switch {
	case v.dbiasAccumulates():
		s += ", zeroes the dBias accumulator"
	case v.dbiasInPlace() && v.Masked():
		s += ", zeroes dBias"
	case v.DBiasPath == DBiasReduce:
		s += ", zeroes dBias (where the heads share its planes) or its hidden pairs"
	}
	return s
}

// preRowDot returns the preprocess's loop that sums go[d]·gd[d] over the
// row's DV elements into acc (lane lane of a warp): element by element,
// or for Flat variants, whose rows of O and dO are flat rows (a position's
// heads back to back, 16-byte aligned, H·DV a multiple of 8), in the
// 16-byte units the head overlaps, one load of each per lane and unit.
func preRowDot(v BwdVariant) string {
	scalar := fmt.Sprintf("for (int d = lane; d < %d; d += 32) acc = fmaf(t_to_f(go[d]), t_to_f(gd[d]), acc);\n", v.DV)
	if unit := 16 / v.elem(); !v.Flat && v.DV%unit == 0 {
		// rows whose two starts are 16-byte aligned (the usual layouts): one 16-byte load of each a lane
		// and unit, else element by element
		return fmt.Sprintf(`    if (((reinterpret_cast<unsigned long long>(go) | reinterpret_cast<unsigned long long>(gd)) & 15ull) == 0) {
      for (int c = lane; %[1]d * c < %[2]d; c += 32) {  // %[1]d elements a unit
        const uint4 xo = reinterpret_cast<const uint4*>(go)[c], xd = reinterpret_cast<const uint4*>(gd)[c];
        const T* eo = reinterpret_cast<const T*>(&xo);
        const T* ed = reinterpret_cast<const T*>(&xd);
#pragma unroll
        for (int j = 0; j < %[1]d; j++) acc = fmaf(t_to_f(eo[j]), t_to_f(ed[j]), acc);
      }
    } else {
      %[3]s    }
`, unit, v.DV, scalar)
	}
	if !v.Flat {
		return "    " + scalar
	}
	return fmt.Sprintf(`    {
      // flat rows: the head starts s elements into its 16-byte unit; the units it overlaps end within
      // the position's row (H·DV is a multiple of 8)
      const int s = (h * %[1]d) & 7;
      const uint4* uo = reinterpret_cast<const uint4*>(go - s);
      const uint4* ud = reinterpret_cast<const uint4*>(gd - s);
      for (int c = lane; 8 * c < s + %[1]d; c += 32) {
        const uint4 xo = uo[c], xd = ud[c];
        const T* eo = reinterpret_cast<const T*>(&xo);
        const T* ed = reinterpret_cast<const T*>(&xd);
#pragma unroll
        for (int j = 0; j < 8; j++) {
          const int e = 8 * c + j - s;  // the head's element
          if (e >= 0 && e < %[1]d) acc = fmaf(t_to_f(eo[j]), t_to_f(ed[j]), acc);
        }
      }
    }
`, v.DV)
}

// preGroupedDot returns, for variants whose rows of O and dO are whole
// 16-byte units (not Flat, DV a multiple of the unit) and at most 32 units
// long, the preprocess's Delta for a warp's rows at once: where O's and
// dO's pointers and strides are 16-byte multiples (the usual layouts; the
// flag grouped), the warp's 32 lanes split into groups of L lanes
// (L, the units of a row rounded up to a power of two), a group a row, and
// every lane issues the loads of all its rows before it sums any; each
// group reduces within itself and its first lane writes the row's Delta
// and LSE2. Otherwise it returns "" and the row loop sums a row a warp.
func preGroupedDot(v BwdVariant) string {
	unit := 16 / v.elem()
	units := v.DV / unit
	if v.Flat || v.DV%unit != 0 || units > 32 {
		return ""
	}
	lanes := 1
	for lanes < units {
		lanes *= 2
	}
	warpRows := BwdPreRows / (BwdPreThreads / 32) // rows a warp
	groups := min(32/lanes, warpRows)             // rows a pass
	passes := warpRows / groups
	return fmt.Sprintf(`  // O's and dO's rows all whole 16-byte units: the warp sums its %[1]d rows at once, a group of %[2]d lanes a row
  // (units a row: %[3]d; rows a pass: %[4]d; passes: %[5]d), with every load issued before the first sum
  const bool grouped = ((reinterpret_cast<unsigned long long>(p.o) | reinterpret_cast<unsigned long long>(p.dout) |
                         (unsigned long long)(p.o_sb | p.o_sr | p.o_sh | p.do_sb | p.do_sr | p.do_sh) * sizeof(T)) & 15ull) == 0;
  if (grouped && blockIdx.x * %[6]d < n) {
    const int grp = lane / %[2]d, c = lane %% %[2]d;  // the lane's row in a pass and its unit of that row
    // the loads unconditional, so that none waits for another's data: a lane with no row or no unit
    // loads its block's last row or its row's last unit and sums nothing
    uint4 xo[%[5]d], xd[%[5]d];
    float lk[%[5]d];  // the rows' LSE
#pragma unroll
    for (int k = 0; k < %[5]d; ++k) {
      const int i = min(blockIdx.x * %[6]d + warp + %[7]d * min(grp + %[4]d * k, %[1]d - 1), n - 1), u = min(c, %[3]d - 1);
      xo[k] = reinterpret_cast<const uint4*>(p.o + b * p.o_sb + (qr0 + i) * p.o_sr + h * p.o_sh)[u];
      xd[k] = reinterpret_cast<const uint4*>(p.dout + b * p.do_sb + (qr0 + i) * p.do_sr + h * p.do_sh)[u];
      lk[k] = p.lse[b * p.lse_sb + h * p.lse_sh + qr0 + i];
    }
#pragma unroll
    for (int k = 0; k < %[5]d; ++k) {
      const int i = blockIdx.x * %[6]d + warp + %[7]d * (grp + %[4]d * k);
      const T* eo = reinterpret_cast<const T*>(&xo[k]);
      const T* ed = reinterpret_cast<const T*>(&xd[k]);
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < %[8]d; j++) acc = fmaf(t_to_f(eo[j]), t_to_f(ed[j]), acc);
      if (c >= %[3]d) acc = 0.f;  // no unit of the row
#pragma unroll
      for (int s = %[2]d / 2; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
      if (grp < %[4]d && c == 0 && i < n) {
        const long long si = b * p.stat_sb + h * p.stat_sh + qr0 + i;
        p.delta[si] = acc;
        p.lse2[si] = lk[k] == -FA_INF ? FA_INF : lk[k] * FA_LOG2E;
      }
    }
  }
`, warpRows, lanes, units, groups, passes, BwdPreRows, BwdPreThreads/32, unit)
}

// flatAccShift returns, for Flat variants, the term added to a dQ column
// to find it in the atomic accumulator, which holds K's shifted columns
// (one query head per key head: the shift of head h, flat_shift).
func flatAccShift(v BwdVariant) string {
	if !v.Flat {
		return ""
	}
	return fmt.Sprintf(" + flat_shift(h, %d, %d)", v.DK, v.DKPad())
}

// convertKernel writes the dQ conversion: one warp a row, dQ = scale ·
// dQacc in T, and the warp's vote on a non-finite element. Of the tiled
// accumulator (DQAccTiled) with DK a multiple of 4 it reads four columns a
// lane (16 bytes, an 8-float chunk's half, whole under the swizzle) and,
// where the row of dQ is 8-byte aligned, stores the four 16-bit elements
// at once (else one by one); otherwise a column a lane.
func (g *bwdGen) convertKernel(b *strings.Builder) {
	v := g.v
	fmt.Fprintf(b, `// dQ = scale · dQacc in T. grid (ceil(N/%d), B, H), %d threads.
extern "C" __global__ void __launch_bounds__(%d) %s(const BwdParams p) {
  const int b = blockIdx.y, h = blockIdx.z, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
`, BwdPreRows, BwdPreThreads, BwdPreThreads, BwdDQConvertKernel)
	g.segment(b)
	b.WriteString("  (void)m; (void)kr0;\n")
	if v.DQAccTiled() && v.DK%4 == 0 {
		b.WriteString(convertTiledBody(v))
		return
	}
	acc := "    const float* gs = p.dqacc + b * p.dqa_sb + (qr0 + i) * p.dqa_sr + h * p.dqa_sh;\n"
	elem := "gs[d" + flatAccShift(v) + "]"
	if v.DQAccTiled() {
		acc = "    const float* gs = p.dqacc + b * p.dqa_sb + h * p.dqa_sh;  // the tiled accumulator\n"
		elem = "gs[" + v.dqAccTiledAt("i", "d") + "]"
	}
	fmt.Fprintf(b, `  for (int r = warp; r < %d; r += %d) {
    const int i = blockIdx.x * %d + r;
    if (i >= n) break;
%s    T* gq = p.dq + b * p.dq_sb + (qr0 + i) * p.dq_sr + h * p.dq_sh;
    bool bad = false;
    for (int d = lane; d < %d; d += 32) {
      const float x = %s * p.scale;
      bad |= nf_bad(x);
      gq[d] = t_from_f(x);
    }
    // a NaN or an infinity (rare: one in the inputs; see bwd_nan.go): the warp's vote raises the flag, the fix-up
    // kernel recomputes the row
    if (__ballot_sync(0xffffffffu, bad) != 0u && lane == 0) atomicOr(p.nf_flag, 1u);
  }
}

`, BwdPreRows, BwdPreThreads/32, BwdPreRows, acc, v.DK, elem)
}

// convertTiledBody returns the dQ conversion's body for the tiled
// accumulator with DK a multiple of 4: each warp loads all of its rows'
// 16-byte units first (R rows, C units a lane and row), so that a warp has
// R·C loads in flight instead of one, then scales, converts and stores
// them row by row, and votes once on a non-finite element.
func convertTiledBody(v BwdVariant) string {
	warps := BwdPreThreads / 32
	return fmt.Sprintf(`  const float* gs = p.dqacc + b * p.dqa_sb + h * p.dqa_sh;  // the tiled accumulator
  constexpr int R = %[1]d, C = %[2]d;  // rows a warp; 16-byte units (four columns) a lane and row
  float4 a[R][C];
#pragma unroll
  for (int k = 0; k < R; ++k) {  // every load first
    const int i = blockIdx.x * %[3]d + warp + %[4]d * k;
#pragma unroll
    for (int e = 0; e < C; ++e) {
      const int c = lane + 32 * e;
      if (i < n && 4 * c < %[5]d) a[k][e] = *reinterpret_cast<const float4*>(gs + %[6]s);
    }
  }
  bool bad = false;
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int i = blockIdx.x * %[3]d + warp + %[4]d * k;
    if (i >= n) break;
    T* gq = p.dq + b * p.dq_sb + (qr0 + i) * p.dq_sr + h * p.dq_sh;
    const bool whole = (reinterpret_cast<unsigned long long>(gq) & 7ull) == 0;  // four elements a store
#pragma unroll
    for (int e = 0; e < C; ++e) {
      const int c = lane + 32 * e;
      if (4 * c >= %[5]d) break;
      const float x[4] = {a[k][e].x * p.scale, a[k][e].y * p.scale, a[k][e].z * p.scale, a[k][e].w * p.scale};
      bad |= nf_bad(x[0]) | nf_bad(x[1]) | nf_bad(x[2]) | nf_bad(x[3]);
      if (whole) {  // one 8-byte integer, which NVRTC stores at once (a uint2 it may split into two 4-byte stores)
        *reinterpret_cast<unsigned long long*>(gq + 4 * c) = (unsigned long long)pack2(x[2], x[3]) << 32 | pack2(x[0], x[1]);
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) gq[4 * c + q] = t_from_f(x[q]);
      }
    }
  }
  // a NaN or an infinity (rare: one in the inputs; see bwd_nan.go): the warp's vote raises the flag, the fix-up
  // kernel recomputes the rows
  if (__ballot_sync(0xffffffffu, bad) != 0u && lane == 0) atomicOr(p.nf_flag, 1u);
}

`, BwdPreRows/warps, (v.DK/4+31)/32, BwdPreRows, warps, v.DK, v.dqAccTiledAt("i", "4 * c"))
}

// kernelConsts declares the tile constants of a main kernel.
func (g *bwdGen) kernelConsts(b *strings.Builder, t BwdTile) {
	v := g.v
	fmt.Fprintf(b, "  constexpr int BM = %d, BN = %d, NTH = %d;\n", t.BlockM, t.BlockN, t.Warps*32)
	fmt.Fprintf(b, "  constexpr int DK = %d, DV = %d, DKP = %d, DVP = %d;\n", v.DK, v.DV, v.DKPad(), v.DVPad())
	fmt.Fprintf(b, "  constexpr int LDK = %d, LDV = %d, LDS = %d; // padded row lengths of the q/k, dO/v and P/dS tiles\n",
		v.padRow(v.DKPad()), v.padRow(v.DVPad()), v.padRow(t.BlockN))
	b.WriteString("  (void)DK; (void)DV; (void)DKP; (void)DVP; (void)LDS;\n")
	b.WriteString("  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;\n")
	b.WriteString("  (void)tid; (void)g; (void)t4;\n")
}

// bwdSmemDecls declares the shared-memory tile pointers of a layout.
func bwdSmemDecls(b *strings.Builder, l bwdSmemLayout) {
	b.WriteString("  extern __shared__ __align__(16) unsigned char smem[];\n")
	for _, name := range l.order {
		ct := "T"
		if name == "sL" || name == "sD" {
			ct = "float"
		}
		fmt.Fprintf(b, "  %s* %s = reinterpret_cast<%s*>(smem + %d);\n", ct, name, ct, l.off[name])
	}
}

// sTile is the warp tiling of the S and dP products of a tile.
func (g *bwdGen) sTile(t BwdTile) bwdWarpTile { return bwdTileOf(t.BlockM, t.BlockN, t.Warps) }

// fullMask writes the computation of `full`: the tile (rows i0.., keys j0..) needs no mask.
func (g *bwdGen) fullMask(b *strings.Builder) {
	b.WriteString("    bool full = j0 + BN <= m;\n")
	if g.v.Masked() {
		b.WriteString(`    {
      const int il = min(i0 + BM, n) - 1;
      if (p.left >= 0 && j0 < il + off - p.left) full = false;
      if (p.right >= 0 && j0 + BN - 1 > i0 + off + p.right) full = false;
    }
`)
	}
}

// probs writes the recomputation of P from the S accumulator accS (rows
// i0 + il of head h, keys j0 + jl), reading LSE2 and Delta rows from sl
// and sd. accS then holds P (negated where dropout drops it); with
// storeP, the dropped and rescaled P is written to sP in T.
func (g *bwdGen) probs(b *strings.Builder, st bwdWarpTile, sl, sd string, storeP bool) {
	v := g.v
	fmt.Fprintf(b, `    const int wms = warp %% %d, wns = warp / %d;
    float lr[%d][2], dr[%d][2];
#pragma unroll
    for (int mt = 0; mt < %d; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) { const int il = wms * %d + mt * 16 + g + hh * 8; lr[mt][hh] = %s[il]; dr[mt][hh] = %s[il]; }
`, st.Wm, st.Wm, st.MT, st.MT, st.MT, st.TM, sl, sd)
	if v.Softcap {
		fmt.Fprintf(b, "    float fc[%d][%d][4];\n", st.MT, st.NT)
	}
	if g.mma {
		fmt.Fprintf(b, "    unsigned pk[%d][%d][2];\n", st.MT, st.NT)
	}
	if v.Dropout {
		// keys start at j0 + wns·TN with j0 a multiple of BlockN (16·k): 16-aligned when TN is
		fmt.Fprintf(b, "    u32 dkeep[%d][%d];  // dropout keep bits of this warp's S tile: bit 4·(nt %% 8) + e keeps element e of (mt, nt)\n    %s\n",
			st.MT, (st.NT+7)/8, dropBitsCall("dkeep", fmt.Sprint(st.MT), fmt.Sprint(st.NT), st.TN%16 == 0,
				fmt.Sprintf("i0 + wms * %d + p.drop_q0", st.TM), fmt.Sprintf("j0 + wns * %d + p.drop_k0", st.TN), "(u32)(b * p.drop_heads + p.drop_h0 + h)", "p"))
	}
	bwdPairLoop(b, st)
	b.WriteString(`      (void)qi;
      float x[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float s = accS[mt][nt][hh * 2 + c];
`)
	b.WriteString(g.logit("        ", "lr[mt][hh]", "fc[mt][nt][hh * 2 + c]", "qi", "kj + c", "", false))
	b.WriteString(`        if (!full && !visible(qi, kj + c, m, off, p.left, p.right)) x[c] = -FA_INF;
      }
      float p0 = ex2f(x[0]), p1 = ex2f(x[1]);
`)
	if v.Dropout {
		b.WriteString(`      const bool k0 = (dkeep[mt][nt >> 3] >> (4 * (nt & 7) + 2 * hh)) & 1u, k1 = (dkeep[mt][nt >> 3] >> (4 * (nt & 7) + 2 * hh + 1)) & 1u;
`)
		if storeP {
			fmt.Fprintf(b, "      st_pair(%s, k0 ? p0 * p.drop_scale : 0.f, k1 ? p1 * p.drop_scale : 0.f);\n", g.at("sP"))
		}
		b.WriteString("      if (!k0) p0 = -p0;\n      if (!k1) p1 = -p1;\n")
	}
	if g.mma {
		// P stays in registers as two packed 16-bit values (the rounding the
		// dV product sees anyway), which frees the fp32 S accumulator.
		b.WriteString("      pk[mt][nt][hh] = pack2(p0, p1);\n")
		if storeP && !v.Dropout {
			fmt.Fprintf(b, "      *reinterpret_cast<unsigned*>(%s) = pk[mt][nt][hh];\n", g.at("sP"))
		}
	} else {
		if storeP && !v.Dropout {
			fmt.Fprintf(b, "      st_pair(%s, p0, p1);\n", g.at("sP"))
		}
		b.WriteString("      accS[mt][nt][hh * 2] = p0; accS[mt][nt][hh * 2 + 1] = p1;\n")
	}
	b.WriteString("    }\n")
}

// logit returns the statements (each line after indent) that set x[c],
// the base-2 logit of the score s of element (query qi, key kj) less its
// row's LSE2 lse: scaled, or through the softcap (keeping 1 − tanh² in
// fc), plus the bias inside the sequence: bias, the element's bias as an
// expression, or where it is empty loaded from global memory (biasLoad).
// zeroPast says that bias is 0 past the queries and keys (read from
// registers that hold zeros there): without a softcap the scaled score
// and the bias are then one multiply-add, with no range test (those
// elements' probabilities are 0 anyway: LSE2 +inf past n, the visibility
// test past m).
func (g *bwdGen) logit(indent, lse, fc, qi, kj, bias string, zeroPast bool) string {
	v := g.v
	if !v.Softcap && !v.Biased() {
		return indent + "x[c] = fmaf(s, p.scale_log2, -" + lse + ");\n"
	}
	var b strings.Builder
	if zeroPast && v.Biased() && !v.Softcap {
		fmt.Fprintf(&b, "%sconst float sv = fmaf(s, p.scale, %s);\n%sx[c] = fmaf(sv, FA_LOG2E, -%s);\n", indent, bias, indent, lse)
		return b.String()
	}
	if v.Softcap {
		fmt.Fprintf(&b, "%sconst float th = %s(s * p.softcap_in);\n", indent, softcapTanh(v.DType))
		fmt.Fprintf(&b, "%s%s = 1.f - th * th;\n%sfloat sv = p.softcap * th;\n", indent, fc, indent)
	} else {
		b.WriteString(indent + "float sv = s * p.scale;\n")
	}
	if v.Biased() {
		if bias == "" {
			bias = biasLoad(qi, kj)
		}
		fmt.Fprintf(&b, "%sif (%s < n && %s < m) sv += %s;\n", indent, qi, kj, bias)
	}
	fmt.Fprintf(&b, "%sx[c] = fmaf(sv, FA_LOG2E, -%s);\n", indent, lse)
	return b.String()
}

// biasLoad returns the bias of element (query qi, key kj) as a float, for
// qi and kj inside the sequence.
func biasLoad(qi, kj string) string {
	return fmt.Sprintf("bt_to_f(p.bias[b * p.bias_sb + h * p.bias_sh + %s * p.bias_si + (%s) * p.bias_sj])", qi, kj)
}

// bwdPairLoop opens the loop over the accumulator pairs of a warp's S
// tile st: row tile mt, column tile nt, half hh (rows g, g+8), with the
// tile positions il, jl and sequence positions qi, kj of the pair.
func bwdPairLoop(b *strings.Builder, st bwdWarpTile) {
	fmt.Fprintf(b, `#pragma unroll
    for (int mt = 0; mt < %d; ++mt)
#pragma unroll
    for (int nt = 0; nt < %d; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int il = wms * %d + mt * 16 + g + hh * 8, jl = wns * %d + nt * 8 + 2 * t4;
      const int qi = i0 + il, kj = j0 + jl;
`, st.MT, st.NT, st.TM, st.TN)
}

// dsFromDP writes dS = P∘(dP − Delta) (with the dropout and softcap chain
// rules) into sdS, and into the dBias scratch when asked; it follows probs
// in the same scope.
func (g *bwdGen) dsFromDP(b *strings.Builder, st bwdWarpTile, writeDBias bool) {
	v := g.v
	bwdPairLoop(b, st)
	b.WriteString(`      (void)qi; (void)kj;
      float ds[2];
`)
	if g.mma {
		b.WriteString("      float pp[2];\n      unpack2(pk[mt][nt][hh], pp[0], pp[1]);\n")
	}
	b.WriteString(`#pragma unroll
      for (int c = 0; c < 2; ++c) {
`)
	if g.mma {
		b.WriteString("        float pr = pp[c], dp = accP[mt][nt][hh * 2 + c];\n")
	} else {
		b.WriteString("        float pr = accS[mt][nt][hh * 2 + c], dp = accP[mt][nt][hh * 2 + c];\n")
	}
	if v.Dropout {
		b.WriteString("        const bool kept = !(__float_as_uint(pr) >> 31);\n        pr = fabsf(pr);\n        dp = kept ? dp * p.drop_scale : 0.f;\n")
	}
	b.WriteString("        float d = pr * (dp - dr[mt][hh]);\n")
	if v.BiasGrad && writeDBias {
		b.WriteString("        if (qi < n && kj + c < m) " + g.dbiasStore("qi", "kj + c", "d") + "\n")
	}
	if v.Softcap {
		b.WriteString("        d *= fc[mt][nt][hh * 2 + c];\n")
	}
	if g.dsRegs {
		b.WriteString("        ds[c] = d;\n      }\n      dsp[mt][nt][hh] = pack2(ds[0], ds[1]);\n    }\n")
		return
	}
	fmt.Fprintf(b, "        ds[c] = d;\n      }\n      st_pair(%s, ds[0], ds[1]);\n    }\n", g.at("sdS"))
}

// dkdvProducts returns the products of the dK/dV kernel for stage st
// (0 for validation).
func (g *bwdGen) dkdvProducts(stage int) []bwdProduct {
	v := g.v
	t := g.tiles.DKDV
	dkp, dvp := v.DKPad(), v.DVPad()
	ldk, ldv, lds := v.padRow(dkp), v.padRow(dvp), v.padRow(t.BlockN)
	sq := fmt.Sprintf("sQ + st * %d", t.BlockM*ldk)
	sdo := fmt.Sprintf("sdO + st * %d", t.BlockM*ldv)
	ps := []bwdProduct{
		{"S = Q·Kᵀ", t.BlockM, t.BlockN, dkp, t.Warps, "accS", bwdOperand{sq, ldk, false}, bwdOperand{"sK", ldk, false}},
		{"dP = dO·Vᵀ", t.BlockM, t.BlockN, dvp, t.Warps, "accP", bwdOperand{sdo, ldv, false}, bwdOperand{"sV", ldv, false}},
		{"dV += Pᵀ·dO", t.BlockN, dvp, t.BlockM, t.Warps, "accdV", bwdOperand{"sP", lds, true}, bwdOperand{sdo, ldv, true}},
		{"dK += dSᵀ·Q", t.BlockN, dkp, t.BlockM, t.Warps, "accdK", bwdOperand{"sdS", lds, true}, bwdOperand{sq, ldk, true}},
	}
	if v.AtomicDQ || stage == 0 {
		ch := g.dqChunks()
		nc := dkp / ch
		for c := 0; c < ch; c++ {
			ps = append(ps, bwdProduct{fmt.Sprintf("dQ[:, %d:%d] = dS·K[:, %d:%d]", c*nc, (c+1)*nc, c*nc, (c+1)*nc),
				t.BlockM, nc, t.BlockN, t.Warps, "accQ", bwdOperand{"sdS", lds, false}, bwdOperand{fmt.Sprintf("sK + %d", c*nc), ldk, true}})
		}
	}
	return ps
}

// dqChunks returns in how many column slices the dK/dV kernel computes its
// dQ contribution, so that the live dQ accumulator stays small next to the
// dK and dV accumulators: 32 registers a thread, or 16 beyond DK=128 or
// beyond 64×128 score tiles (the limits under which ptxas kept the main
// variants free of spills).
func (g *bwdGen) dqChunks() int {
	t := g.tiles.DKDV
	dkp := g.v.DKPad()
	regs := 32
	if dkp > 128 || t.BlockM*t.BlockN > 64*128 {
		regs = 16
	}
	for ch := 1; ch < dkp/16; ch++ {
		if dkp%(16*ch) != 0 {
			continue
		}
		if t.BlockM*dkp/ch <= regs*32*t.Warps {
			if _, _, err := bwdWarpGrid(t.BlockM, dkp/ch, t.Warps); err == nil {
				return ch
			}
		}
	}
	return 1
}

// dqProducts returns the products of the dQ kernel.
func (g *bwdGen) dqProducts(stage int) []bwdProduct {
	v := g.v
	t := g.tiles.DQ
	dkp, dvp := v.DKPad(), v.DVPad()
	ldk, ldv, lds := v.padRow(dkp), v.padRow(dvp), v.padRow(t.BlockN)
	sk := fmt.Sprintf("sK + st * %d", t.BlockN*ldk)
	sv := fmt.Sprintf("sV + st * %d", t.BlockN*ldv)
	return []bwdProduct{
		{"S = Q·Kᵀ", t.BlockM, t.BlockN, dkp, t.Warps, "accS", bwdOperand{"sQ", ldk, false}, bwdOperand{sk, ldk, false}},
		{"dP = dO·Vᵀ", t.BlockM, t.BlockN, dvp, t.Warps, "accP", bwdOperand{"sdO", ldv, false}, bwdOperand{sv, ldv, false}},
		{"dQ += dS·K", t.BlockM, dkp, t.BlockN, t.Warps, "accQ", bwdOperand{"sdS", lds, false}, bwdOperand{sk, ldk, true}},
	}
}

// bwdStoreAcc writes an accumulator (rows r0 + row, columns col) to a global
// head slice: dst row pointer expression, row limit, column limit D, factor.
func bwdStoreAcc(b *strings.Builder, t bwdWarpTile, acc, dst, rowStride, rowLimit, d, factor string, opt ...bwdStoreOpt) {
	if c := t.guard(); c != "" {
		fmt.Fprintf(b, "  if (%s)", c)
	}
	fmt.Fprintf(b, `  {
    const int wm_ = warp %% %d, wn_ = warp / %d;
#pragma unroll
    for (int mt = 0; mt < %d; ++mt)
#pragma unroll
    for (int nt = 0; nt < %d; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = wm_ * %d + mt * 16 + g + hh * 8, c = wn_ * %d + nt * 8 + 2 * t4%s;
      if (r < %s) %s<%s>(%s + r * %s, c, %s[mt][nt][hh * 2] * %s, %s[mt][nt][hh * 2 + 1] * %s);
    }
  }
`, t.Wm, t.Wm, t.MT, t.NT, t.TM, t.TN, colShift(opt), rowLimit, storeFn(opt), d, dst, rowStride, acc, factor, acc, factor)
}

// bwdStoreOpt modifies the stores of an accumulator: Shift names the
// column shift of a flat row (the stored column is the accumulator's
// minus it), Shared sends the pairs to a row-major tile in shared memory
// (stage_pair) for bwdRowsOut to write whole rows.
type bwdStoreOpt struct {
	Shift  string
	Shared bool
	From   int // the first accumulator column stored (a multiple of 8)
}

// colShift returns the term subtracted from an accumulator's column to
// give the stored column: " - s" for a flat row's shift s.
func colShift(opt []bwdStoreOpt) string {
	if len(opt) == 0 || opt[0].Shift == "" {
		return ""
	}
	return " - " + opt[0].Shift
}

// storeFn returns the pair store of opt: store_pair to global rows, or
// stage_pair to shared ones.
func storeFn(opt []bwdStoreOpt) string {
	if len(opt) > 0 && opt[0].Shared {
		return "stage_pair"
	}
	return "store_pair"
}

// bwdRowsOut writes rows [0, min(rows, limit)) of the row-major tile src
// (pitch elements a row, 16-bit) to the global rows of dst (rowStride
// apart, d elements each), one warp a row (row_out).
func bwdRowsOut(b *strings.Builder, src, pitch, dst, rowStride, rows, limit, d string) {
	fmt.Fprintf(b, `  for (int r = warp; r < %[5]s && r < %[6]s; r += NTH / 32)
    row_out(reinterpret_cast<unsigned char*>(%[3]s + r * %[4]s), reinterpret_cast<const unsigned short*>(%[1]s + r * %[2]s), %[7]s, lane);
`, src, pitch, dst, rowStride, rows, limit, d)
}

// bwdStoreWarpgroup writes a warpgroup product's accumulator acc[1][n/8][4]
// (64 rows, one 16-row slice per warp of the warpgroup) to columns col0 ..
// col0+n−1 of dst's rows (from col0+From with opt's From), times factor:
// rows under rowLimit, columns under d.
func bwdStoreWarpgroup(b *strings.Builder, acc string, n int, dst, rowStride, rowLimit, d, factor string, col0 int, opt ...bwdStoreOpt) {
	from := 0
	if len(opt) > 0 {
		from = opt[0].From / 8
	}
	fmt.Fprintf(b, `  {
#pragma unroll
    for (int nt = %[11]d; nt < %[1]d; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = (warp & 3) * 16 + g + hh * 8, c = %[2]d + nt * 8 + 2 * t4%[9]s;
      if (r < %[3]s) %[10]s<%[4]s>(%[5]s + r * %[6]s, c, %[7]s[0][nt][hh * 2] * %[8]s, %[7]s[0][nt][hh * 2 + 1] * %[8]s);
    }
  }
`, n/8, col0, rowLimit, d, dst, rowStride, acc, factor, colShift(opt), storeFn(opt), from)
}

// bwdPipelineStep writes the start of iteration it of a kernel's main
// loop over iters tiles loaded by load(it, stage): the stage st, the line
// pos (the iteration's tile position), the wait for tile it and, with two
// stages, the prefetch of tile it+1.
func bwdPipelineStep(b *strings.Builder, stages int, load, iters, pos string) {
	if stages == 2 {
		b.WriteString("    const int st = it & 1;\n")
	} else {
		fmt.Fprintf(b, "    const int st = 0;\n    if (it > 0) { %s(it, 0); cp_async_commit(); }\n", load)
	}
	b.WriteString(pos)
	b.WriteString(`    cp_async_wait0();
    __syncthreads();
`)
	if stages == 2 {
		fmt.Fprintf(b, "    if (it + 1 < %s) { %s(it + 1, st ^ 1); cp_async_commit(); }\n", iters, load)
	}
}

// scores writes the recomputation both kernels share within a tile pair:
// S = Q·Kᵀ (ps[0]), P, dP = dO·Vᵀ (ps[1]), dS, a barrier and the product
// ps[2]. sl and sd are the tile's LSE2 and Delta rows; the dK/dV kernel
// (dkdv) also stores P and writes dBias.
func (g *bwdGen) scores(b *strings.Builder, st bwdWarpTile, ps []bwdProduct, sl, sd string, dkdv bool) {
	g.fullMask(b)
	b.WriteString("    " + strings.ReplaceAll(st.accDecl("accS"), "\n", "\n    "))
	bwdEmitProduct(b, ps[0], g.mma)
	g.probs(b, st, sl, sd, dkdv)
	b.WriteString("    " + strings.ReplaceAll(st.accDecl("accP"), "\n", "\n    "))
	bwdEmitProduct(b, ps[1], g.mma)
	g.dsFromDP(b, st, dkdv)
	b.WriteString("    __syncthreads();\n")
	bwdEmitProduct(b, ps[2], g.mma)
}

func (g *bwdGen) dkdvKernel(b *strings.Builder) {
	v := g.v
	t := g.tiles.DKDV
	l := v.dkdvLayout(t)
	ps := g.dkdvProducts(1)
	st := g.sTile(t)
	tdv := bwdTileOf(t.BlockN, v.DVPad(), t.Warps)
	tdk := bwdTileOf(t.BlockN, v.DKPad(), t.Warps)
	fmt.Fprintf(b, `// dK/dV: one block per (key block, batch, key head); loops over the query heads of the group and
// the query blocks that see the key block; dK and dV stay on chip and are written once.
// grid (ceil(M/%d), B, Hkv), %d threads, %d bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(%d, %d) %s(const BwdParams p) {
`, t.BlockN, t.Warps*32, l.total, t.Warps*32, t.MinBlocks, BwdDKDVKernel)
	g.kernelConsts(b, t)
	bwdSmemDecls(b, l)
	g.dkdvQueryRange(b)
	fmt.Fprintf(b, `  const T* gk = %s;
  const T* gv = %s;
  // stage s of the query-side tiles for iteration it: q, dO, LSE2, Delta rows
  auto load_q = [&](int it, int s) {
    const int hq = kvh * G + it / nib, iq = (ib0 + it %% nib) * BM;
    load_tile<BM, DKP, LDK, DK, NTH>(sQ + s * %d, %s, %s, n - iq);
    load_tile<BM, DVP, LDV, DV, NTH>(sdO + s * %d, %s, %s, n - iq);
    const long long so = b * p.stat_sb + hq * p.stat_sh + qr0 + iq;
    load_stats<BM, NTH>(sL + s * BM, sD + s * BM, p.lse2 + so, p.delta + so, n - iq);
  };
`, g.in("k").at("j0", "kvh"), g.in("v").at("j0", "kvh"),
		t.BlockM*v.padRow(v.DKPad()), g.in("q").at("iq", "hq"), g.in("q").sr,
		t.BlockM*v.padRow(v.DVPad()), g.in("do").at("iq", "hq"), g.in("do").sr)
	b.WriteString("  " + strings.ReplaceAll(tdk.accDecl("accdK"), "\n", "\n  "))
	b.WriteString(strings.ReplaceAll(tdv.accDecl("accdV"), "\n", "\n  "))
	fmt.Fprintf(b, `if (iters > 0) {
    load_tile<BN, DKP, LDK, DK, NTH>(sK, gk, %s, m - j0);
    load_tile<BN, DVP, LDV, DV, NTH>(sV, gv, %s, m - j0);
    load_q(0, 0);
    cp_async_commit();
  }
  for (int it = 0; it < iters; ++it) {
`, g.in("k").sr, g.in("v").sr)
	bwdPipelineStep(b, t.Stages, "load_q", "iters", "    const int h = kvh * G + it / nib, i0 = (ib0 + it % nib) * BM;\n")
	g.scores(b, st, ps, "(sL + st * BM)", "(sD + st * BM)", true)
	bwdEmitProduct(b, ps[3], g.mma)
	if v.AtomicDQ {
		g.atomicDQ(b, ps[4:])
	}
	if t.Stages == 1 {
		b.WriteString("    __syncthreads();\n")
	}
	b.WriteString("  }\n")
	b.WriteString("  T* gdk = p.dk + b * p.dk_sb + (kr0 + j0) * p.dk_sr + kvh * p.dk_sh;\n")
	b.WriteString("  T* gdv = p.dv + b * p.dv_sb + (kr0 + j0) * p.dv_sr + kvh * p.dv_sh;\n")
	bwdStoreAcc(b, tdk, "accdK", "gdk", "p.dk_sr", "m - j0", "DK", "p.scale")
	bwdStoreAcc(b, tdv, "accdV", "gdv", "p.dv_sr", "m - j0", "DV", "1.f")
	nfKeysCheck(b, false, nfAll("accdK", "accdV")...)
	b.WriteString("}\n\n")
}

func (g *bwdGen) dqKernel(b *strings.Builder) {
	v := g.v
	t := g.tiles.DQ
	l := v.dqLayout(t)
	ps := g.dqProducts(1)
	st := g.sTile(t)
	tq := bwdTileOf(t.BlockM, v.DKPad(), t.Warps)
	fmt.Fprintf(b, `// dQ (separate algorithm): one block per (query block, batch, query head); loops over the visible
// key blocks recomputing S, P and dP; no atomics. grid (ceil(N/%d), B, H), %d threads, %d bytes of
// dynamic shared memory.
extern "C" __global__ void __launch_bounds__(%d, %d) %s(const BwdParams p) {
`, t.BlockM, t.Warps*32, l.total, t.Warps*32, t.MinBlocks, BwdDQKernel)
	g.kernelConsts(b, t)
	bwdSmemDecls(b, l)
	g.dqKeyRange(b)
	fmt.Fprintf(b, `  auto load_kv = [&](int it, int s) {
    const int jk = (jb0 + it) * BN;
    load_tile<BN, DKP, LDK, DK, NTH>(sK + s * %d, %s, %s, m - jk);
    load_tile<BN, DVP, LDV, DV, NTH>(sV + s * %d, %s, %s, m - jk);
  };
`, t.BlockN*v.padRow(v.DKPad()), g.in("k").at("jk", "kvh"), g.in("k").sr,
		t.BlockN*v.padRow(v.DVPad()), g.in("v").at("jk", "kvh"), g.in("v").sr)
	b.WriteString("  " + strings.ReplaceAll(tq.accDecl("accQ"), "\n", "\n  "))
	fmt.Fprintf(b, `if (njb > 0) {
    load_tile<BM, DKP, LDK, DK, NTH>(sQ, %s, %s, n - i0);
    load_tile<BM, DVP, LDV, DV, NTH>(sdO, %s, %s, n - i0);
    const long long so = b * p.stat_sb + h * p.stat_sh + qr0 + i0;
    load_stats<BM, NTH>(sL, sD, p.lse2 + so, p.delta + so, n - i0);
    load_kv(0, 0);
    cp_async_commit();
  }
  for (int it = 0; it < njb; ++it) {
`, g.in("q").at("i0", "h"), g.in("q").sr, g.in("do").at("i0", "h"), g.in("do").sr)
	bwdPipelineStep(b, t.Stages, "load_kv", "njb", "    const int j0 = (jb0 + it) * BN;\n")
	g.scores(b, st, ps, "sL", "sD", false)
	if t.Stages == 1 {
		b.WriteString("    __syncthreads();\n")
	}
	b.WriteString("  }\n")
	b.WriteString("  T* gq = p.dq + b * p.dq_sb + (qr0 + i0) * p.dq_sr + h * p.dq_sh;\n")
	bwdStoreAcc(b, tq, "accQ", "gq", "p.dq_sr", "n - i0", "DK", "p.scale")
	nfQueryCheck(b, false)
	b.WriteString("}\n")
}

// dkdvQueryRange writes the start of a dK/dV kernel after its declarations:
// the block's batch element, key head and first key j0, the segment, the
// early exit of a block past the keys, and the iterations: every query
// head of the group times the query blocks (from ib0, nib of them) that
// see the block's keys.
func (g *bwdGen) dkdvQueryRange(b *strings.Builder) {
	g.dkdvCoords(b)
	g.dkdvRange(b, "return;")
}

// dkdvRange writes the part of dkdvQueryRange after the coordinates: the
// segment, the statement exit for a block past its segment's keys (none
// where exit is empty: a fixed-length batch's blocks all lie before M),
// and the iterations.
func (g *bwdGen) dkdvRange(b *strings.Builder, exit string) {
	g.segment(b)
	if exit != "" {
		b.WriteString("  if (j0 >= m) " + exit + "\n")
	}
	if g.v.DBiasPath == DBiasReduce {
		b.WriteString(`  // dBias (DBiasReduce): where it has a plane a head, the launch over batch element 0 alone stores its dS tiles
  // into dBias, and the launch over the whole batch adds the other elements' into them, its element 0 leaving
  // here; where the heads share a plane, the one launch adds every element's
  const bool dbias_split = p.bias_nh == p.H, dbias_first = dbias_split && gridDim.y == 1;
  if (dbias_split && !dbias_first && b == 0) return;
`)
	}
	b.WriteString(`  const int off = p.bottom_right ? m - n : 0;
  const int jend = min(j0 + BN, m);
  int ilo = 0, ihi = n;
`)
	if g.v.Masked() {
		b.WriteString(`  if (p.right >= 0) ilo = max(ilo, j0 - p.right - off);
  if (p.left >= 0) ihi = min(ihi, jend - 1 + p.left - off + 1);
`)
	}
	b.WriteString(`  (void)jend;
  const int ib0 = ilo / BM;
  const int nib = ihi > ilo ? (ihi + BM - 1) / BM - ib0 : 0;
  const int G = p.H / p.Hkv, iters = nib * G;
`)
}

// dqKeyRange writes the start of a dQ kernel after its declarations: the
// block's batch element, query head and first query i0, the segment, the
// early exit of a block past the queries, and the key blocks (from jb0,
// njb of them) its rows can see.
func (g *bwdGen) dqKeyRange(b *strings.Builder) {
	g.dqCoords(b)
	g.segment(b)
	b.WriteString(`  if (i0 >= n) return;
  const int kvh = h / (p.H / p.Hkv);
  const int off = p.bottom_right ? m - n : 0;
  const int iend = min(i0 + BM, n);
  int jlo = 0, jhi = m;
`)
	if g.v.Masked() {
		b.WriteString(`  if (p.left >= 0) jlo = max(jlo, i0 + off - p.left);
  if (p.right >= 0) jhi = min(jhi, iend - 1 + off + p.right + 1);
`)
	}
	b.WriteString(`  (void)iend;
  const int jb0 = jlo / BN;
  const int njb = jhi > jlo ? (jhi + BN - 1) / BN - jb0 : 0;
`)
}
