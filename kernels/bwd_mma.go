package kernels

import (
	"fmt"
	"strings"
)

// bwdOperand is a shared-memory operand of a block-wide matrix product.
// For the A operand (M×K) Trans=false means the tile is stored [m][k] and
// Trans=true [k][m]; for the B operand (K×N) Trans=false means [n][k] and
// Trans=true [k][n]. Ld is the padded row length in elements.
type bwdOperand struct {
	Ptr   string
	Ld    int
	Trans bool
}

// bwdProduct is C[M×N] += A[M×K]·B[K×N], spread over the block's warps
// on a Wm×Wn grid; each warp owns a (M/Wm)×(N/Wn) tile held in the
// register array Acc[M/Wm/16][N/Wn/8][4] in the m16n8 accumulator layout
// (element r of an atom is row g + 8·(r/2), column 2·t + r%2, with
// g = lane/4 and t = lane%4).
type bwdProduct struct {
	name    string
	M, N, K int
	warps   int
	Acc     string
	A, B    bwdOperand
}

// bwdWarpGrid picks the warp grid Wm×Wn ≤ warps for an M×N output: warp
// tiles must be multiples of 16 rows and 8 columns. Grids using more warps
// win; among those, the one reading the fewest operand elements per k step
// (TM+TN). Warps beyond Wm·Wn sit the product out.
func bwdWarpGrid(m, n, warps int) (wm, wn int, err error) {
	best, used := -1, 0
	for a := 1; a <= warps; a++ {
		for b := 1; a*b <= warps; b++ {
			if m%a != 0 || n%b != 0 || (m/a)%16 != 0 || (n/b)%8 != 0 {
				continue
			}
			c := m/a + n/b
			if a*b > used || (a*b == used && (c < best || (c == best && a > wm))) {
				best, used, wm, wn = c, a*b, a, b
			}
		}
	}
	if best < 0 {
		return 0, 0, fmt.Errorf("%d warps cannot tile a %dx%d output in 16x8 atoms", warps, m, n)
	}
	return wm, wn, nil
}

// bwdWarpTile is the resolved tiling of one product.
type bwdWarpTile struct {
	Wm, Wn, TM, TN, MT, NT int
	Warps                  int // warps of the block
}

func bwdTileOf(m, n, warps int) bwdWarpTile {
	wm, wn, err := bwdWarpGrid(m, n, warps)
	if err != nil {
		panic(err) // Validate rejects such variants before generation
	}
	return bwdWarpTile{Wm: wm, Wn: wn, TM: m / wm, TN: n / wn, MT: m / wm / 16, NT: n / wn / 8, Warps: warps}
}

// guard returns the condition under which this warp takes part ("" when all do).
func (t bwdWarpTile) guard() string {
	if t.Wm*t.Wn < t.Warps {
		return fmt.Sprintf("warp < %d", t.Wm*t.Wn)
	}
	return ""
}

// accDecl declares and zeroes the accumulator of a product.
func (t bwdWarpTile) accDecl(name string) string {
	return fmt.Sprintf("float %s[%d][%d][4];\n#pragma unroll\nfor (int i_ = 0; i_ < %d; ++i_) { (&%s[0][0][0])[i_] = 0.f; }\n",
		name, t.MT, t.NT, t.MT*t.NT*4, name)
}

// bwdEmitProduct writes the code of one product. mma selects the 16-bit
// path (ldmatrix + mma.sync m16n8k16); otherwise fp32 operands go through
// split-tf32 m16n8k8 products (hi·hi + hi·lo + lo·hi), the forward's fp32
// method, in the same accumulator layout.
func bwdEmitProduct(b *strings.Builder, pr bwdProduct, mma bool) {
	t := bwdTileOf(pr.M, pr.N, pr.warps)
	fmt.Fprintf(b, "{ // %s: [%dx%d] += [%dx%d]·[%dx%d], warps %dx%d, warp tile %dx%d\n",
		pr.name, pr.M, pr.N, pr.M, pr.K, pr.K, pr.N, t.Wm, t.Wn, t.TM, t.TN)
	if t.Wm*t.Wn < pr.warps {
		fmt.Fprintf(b, "if (warp < %d) {\n", t.Wm*t.Wn)
	}
	fmt.Fprintf(b, "const int wm_ = warp %% %d, wn_ = warp / %d;\n", t.Wm, t.Wm)
	if mma {
		bwdEmitMMA(b, pr, t)
	} else {
		bwdEmitTF32(b, pr, t)
	}
	if t.Wm*t.Wn < pr.warps {
		b.WriteString("}\n")
	}
	b.WriteString("}\n")
}

func bwdEmitMMA(b *strings.Builder, pr bwdProduct, t bwdWarpTile) {
	la, lb := pr.A.Ld, pr.B.Ld
	// Lane-dependent element offsets (see ldmatrix's per-lane row addresses).
	if !pr.A.Trans {
		fmt.Fprintf(b, "const unsigned a_ = smem_u32(%s) + 2u * (unsigned)((wm_ * %d + (lane & 15)) * %d + (lane >> 4) * 8);\n", pr.A.Ptr, t.TM, la)
	} else {
		fmt.Fprintf(b, "const unsigned a_ = smem_u32(%s) + 2u * (unsigned)(((lane & 7) + (lane >> 4) * 8) * %d + wm_ * %d + ((lane >> 3) & 1) * 8);\n", pr.A.Ptr, la, t.TM)
	}
	if !pr.B.Trans {
		fmt.Fprintf(b, "const unsigned b_ = smem_u32(%s) + 2u * (unsigned)((wn_ * %d + (lane & 7) + (lane >> 4) * 8) * %d + ((lane >> 3) & 1) * 8);\n", pr.B.Ptr, t.TN, lb)
	} else {
		fmt.Fprintf(b, "const unsigned b_ = smem_u32(%s) + 2u * (unsigned)(((lane & 7) + ((lane >> 3) & 1) * 8) * %d + wn_ * %d + (lane >> 4) * 8);\n", pr.B.Ptr, lb, t.TN)
	}
	fmt.Fprintf(b, "#pragma unroll\nfor (int kk = 0; kk < %d; ++kk) {\n", pr.K/16)
	fmt.Fprintf(b, "unsigned af[%d][4], bf[%d][2];\n", t.MT, t.NT)
	// A fragments.
	aStep, aTile := "kk * 16", fmt.Sprintf("mt * %d", 16*la)
	ldA := "ldsm_x4"
	if pr.A.Trans {
		aStep, aTile, ldA = fmt.Sprintf("kk * %d", 16*la), "mt * 16", "ldsm_x4_t"
	}
	fmt.Fprintf(b, "#pragma unroll\nfor (int mt = 0; mt < %d; ++mt) %s(af[mt], a_ + 2u * (unsigned)(%s + %s));\n", t.MT, ldA, aStep, aTile)
	// B fragments, two n8 atoms per ldmatrix.x4.
	bStep, bTile := "kk * 16", fmt.Sprintf("nt * %d", 8*lb)
	ldB4, ldB2 := "ldsm_x4", "ldsm_x2"
	if pr.B.Trans {
		bStep, bTile, ldB4, ldB2 = fmt.Sprintf("kk * %d", 16*lb), "nt * 8", "ldsm_x4_t", "ldsm_x2_t"
	}
	fmt.Fprintf(b, "#pragma unroll\nfor (int nt = 0; nt + 1 < %d; nt += 2) %s(bf[nt][0], bf[nt][1], bf[nt + 1][0], bf[nt + 1][1], b_ + 2u * (unsigned)(%s + %s));\n",
		t.NT, ldB4, bStep, bTile)
	if t.NT%2 == 1 {
		fmt.Fprintf(b, "{ const int nt = %d; %s(bf[nt][0], bf[nt][1], b_ + 2u * (unsigned)(%s + %s)); }\n", t.NT-1, ldB2, bStep, bTile)
	}
	fmt.Fprintf(b, "#pragma unroll\nfor (int mt = 0; mt < %d; ++mt)\n#pragma unroll\nfor (int nt = 0; nt < %d; ++nt) mma16816(%s[mt][nt], af[mt], bf[nt][0], bf[nt][1]);\n",
		t.MT, t.NT, pr.Acc)
	b.WriteString("}\n")
}

func bwdEmitTF32(b *strings.Builder, pr bwdProduct, t bwdWarpTile) {
	la, lb := pr.A.Ld, pr.B.Ld
	// m16n8k8 tf32 fragments: A a0 (row g, k t), a1 (row g+8, k t), a2 (row g, k t+4),
	// a3 (row g+8, k t+4); B b0 (k t, col g), b1 (k t+4, col g). pa_ points at (row wm·TM + g,
	// k t), pb_ at (k t, column wn·TN + g), in each tile's storage order.
	if !pr.A.Trans {
		fmt.Fprintf(b, "const float* pa_ = %s + (wm_ * %d + g) * %d + t4;\n", pr.A.Ptr, t.TM, la)
	} else {
		fmt.Fprintf(b, "const float* pa_ = %s + t4 * %d + wm_ * %d + g;\n", pr.A.Ptr, la, t.TM)
	}
	if !pr.B.Trans {
		fmt.Fprintf(b, "const float* pb_ = %s + (wn_ * %d + g) * %d + t4;\n", pr.B.Ptr, t.TN, lb)
	} else {
		fmt.Fprintf(b, "const float* pb_ = %s + t4 * %d + wn_ * %d + g;\n", pr.B.Ptr, lb, t.TN)
	}
	// element offsets of (row/col step, k step) in each storage order
	aIdx := func(m, k string) string {
		if pr.A.Trans {
			return fmt.Sprintf("(%s) * %d + %s", k, la, m)
		}
		return fmt.Sprintf("(%s) * %d + %s", m, la, k)
	}
	bIdx := func(n, k string) string {
		if pr.B.Trans {
			return fmt.Sprintf("(%s) * %d + %s", k, lb, n)
		}
		return fmt.Sprintf("(%s) * %d + %s", n, lb, k)
	}
	fmt.Fprintf(b, "#pragma unroll 2\nfor (int kk = 0; kk < %d; ++kk) {\n", pr.K/8)
	fmt.Fprintf(b, "unsigned ah[%d][4], al[%d][4], bh[%d][2], bl[%d][2];\n", t.MT, t.MT, t.NT, t.NT)
	fmt.Fprintf(b, `#pragma unroll
for (int mt = 0; mt < %d; ++mt) {
  tf32_split(pa_[%s], ah[mt][0], al[mt][0]);
  tf32_split(pa_[%s], ah[mt][1], al[mt][1]);
  tf32_split(pa_[%s], ah[mt][2], al[mt][2]);
  tf32_split(pa_[%s], ah[mt][3], al[mt][3]);
}
`, t.MT, aIdx("mt * 16", "kk * 8"), aIdx("mt * 16 + 8", "kk * 8"), aIdx("mt * 16", "kk * 8 + 4"), aIdx("mt * 16 + 8", "kk * 8 + 4"))
	fmt.Fprintf(b, `#pragma unroll
for (int nt = 0; nt < %d; ++nt) {
  tf32_split(pb_[%s], bh[nt][0], bl[nt][0]);
  tf32_split(pb_[%s], bh[nt][1], bl[nt][1]);
}
`, t.NT, bIdx("nt * 8", "kk * 8"), bIdx("nt * 8", "kk * 8 + 4"))
	// Each k step's three products go into a fresh accumulator that is then
	// added with a rounded fp32 add: the tensor cores' own accumulation
	// truncates, which over K/8 steps would bias long sums by ~K/8 ulps. The
	// fp32 forward sums its S = Q·Kᵀ the same way, in the same order
	// (qkProduct), so that P recomputed here from its LSE sees the S the
	// forward saw, bit for bit.
	fmt.Fprintf(b, `#pragma unroll
for (int mt = 0; mt < %d; ++mt)
#pragma unroll
for (int nt = 0; nt < %d; ++nt) {
  float t_[4] = {0.f, 0.f, 0.f, 0.f};
  mma_tf32x3(t_, ah[mt], al[mt], bh[nt][0], bh[nt][1], bl[nt][0], bl[nt][1]);
#pragma unroll
  for (int r = 0; r < 4; ++r) %s[mt][nt][r] += t_[r];
}
`, t.MT, t.NT, pr.Acc)
	b.WriteString("}\n")
}
