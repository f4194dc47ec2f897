package kernels

import (
	"fmt"
	"strings"
)

// The backward's inputs as the main kernels read them, the staging copy of
// Staged variants (head dims that are not multiples of 16 bytes), and the
// atomic dQ accumulation.

// bwdInput names one input tensor (q, k, v or dO) as the main kernels read
// it: the caller's tensor, or its padded staging copy for Staged variants.
type bwdInput struct {
	ptr, sb, sr, sh string // C expressions: base pointer, batch, row and head strides
	rowBase         string // first row of the batch element's segment: qr0 or kr0
}

// in returns the input t ("q", "k", "v" or "do") as the main kernels read it.
func (g *bwdGen) in(t string) bwdInput { return bwdTensor(t, g.v.Staged) }

// bwdTensor returns the input t: the caller's tensor, or its staging copy
// when staged.
func bwdTensor(t string, staged bool) bwdInput {
	ptr, st := "p."+t, "p."+t
	if t == "do" {
		ptr = "p.dout"
	}
	if staged {
		ptr, st = "p.p"+t, "p.p"+t
	}
	base := "qr0"
	if t == "k" || t == "v" {
		base = "kr0"
	}
	return bwdInput{ptr: ptr, sb: st + "_sb", sr: st + "_sr", sh: st + "_sh", rowBase: base}
}

// at returns the address of row row (relative to the segment) of head head.
func (x bwdInput) at(row, head string) string {
	return fmt.Sprintf("%s + b * %s + (%s + %s) * %s + %s * %s", x.ptr, x.sb, x.rowBase, row, x.sr, head, x.sh)
}

// packKernel writes BwdPackKernel for Staged variants: a block copies
// BwdPreRows rows of q and dO (query heads) and of k and v (key heads) into
// the staging buffers with stage_rows, zero-filling each row beyond DK or DV.
func (g *bwdGen) packKernel(b *strings.Builder) {
	v := g.v
	if !v.Staged {
		return
	}
	dks, dvs := BwdStagedDim(v.DType, v.DK), BwdStagedDim(v.DType, v.DV)
	fmt.Fprintf(b, `// Pack: copies q, dO [rows, H, DK|DV] and k, v [rows, Hkv, DK|DV] into staging buffers whose rows
// hold %d / %d elements (32-byte multiples, zero beyond DK=%d / DV=%d), so that the main kernels move
// 16-byte chunks. grid (ceil(max(N, M)/%d), B, H), %d threads; a block copies %d rows of each tensor, its
// threads taking 16-byte chunks.
extern "C" __global__ void __launch_bounds__(%d) %s(const BwdParams p) {
  const int b = blockIdx.y, h = blockIdx.z, i0 = blockIdx.x * %d;
`, dks, dvs, v.DK, v.DV, BwdPreRows, BwdPreThreads, BwdPreRows, BwdPreThreads, BwdPackKernel, BwdPreRows)
	g.segment(b)
	b.WriteString(`  typedef unsigned char u8;
  const int es = (int)sizeof(T);
`)
	for _, t := range []struct {
		src, rows string // the input and its row count (n: query rows, m: key rows)
		dim, dimS int
	}{{"q", "n", v.DK, dks}, {"do", "n", v.DV, dvs}, {"k", "m", v.DK, dks}, {"v", "m", v.DV, dvs}} {
		dst, src := bwdTensor(t.src, true), bwdTensor(t.src, false)
		guard := "n > i0"
		if t.rows == "m" {
			guard = "h < p.Hkv && m > i0"
		}
		fmt.Fprintf(b, `  if (%s)  // %s
    stage_rows<%d>(reinterpret_cast<u8*>(%s), es * %s, reinterpret_cast<const u8*>(%s), es * %s, min(%d, %s - i0), es * %d, es * %d);
`, guard, t.src, BwdPreThreads, dst.at("i0", "h"), dst.sr, src.at("i0", "h"), src.sr, BwdPreRows, t.rows, t.dim, t.dimS)
	}
	b.WriteString("}\n\n")
}

// redAddPair is the device function adding an accumulator pair to the
// fp32 dQ accumulator.
const redAddPair = `// red_add_pair adds (a, b_) to the 8-byte aligned pair q[0], q[1] of global memory: one vector
// reduction where the compiler has it (sm_90 and CUDA 12.1 or later), two scalar ones otherwise.
__device__ __forceinline__ void red_add_pair(float* q, float a, float b_) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && (__CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ >= 1201)
  atomicAdd(reinterpret_cast<float2*>(q), make_float2(a, b_));
#else
  atomicAdd(q, a);
  atomicAdd(q + 1, b_);
#endif
}
`

// atomicDQ writes the dK/dV kernel's accumulation of its dQ contribution:
// for each column slice of dQ, the product dS·K into accQ and the addition
// of each accumulator pair into the fp32 accumulator rows of head h.
func (g *bwdGen) atomicDQ(b *strings.Builder, slices []bwdProduct) {
	v := g.v
	t := g.tiles.DKDV
	nc := v.DKPad() / g.dqChunks()
	tq := bwdTileOf(t.BlockM, nc, t.Warps)
	for c, pr := range slices {
		b.WriteString("    {\n    " + strings.ReplaceAll(tq.accDecl("accQ"), "\n", "\n    "))
		bwdEmitProduct(b, pr, g.mma)
		if cond := tq.guard(); cond != "" {
			fmt.Fprintf(b, "    if (!(%s)) {} else\n", cond)
		}
		fmt.Fprintf(b, `    {
    // dQacc[i0 + il, h, %d + jl] += accQ: pairs of adjacent columns (the accumulator's rows are padded
    // to a multiple of 4 floats, so a pair past DK lands in the padding).
    const int wms = warp %% %d, wns = warp / %d;
    float* gq = p.dqacc + b * p.dqa_sb + (qr0 + i0) * p.dqa_sr + h * p.dqa_sh + %d;
`, c*nc, tq.Wm, tq.Wm, c*nc)
		bwdPairLoop(b, tq)
		fmt.Fprintf(b, `      (void)kj;
      if (qi < n && jl < %d) red_add_pair(gq + il * p.dqa_sr + jl, accQ[mt][nt][2 * hh], accQ[mt][nt][2 * hh + 1]);
    }
    }
    }
`, v.DK-c*nc)
	}
}
