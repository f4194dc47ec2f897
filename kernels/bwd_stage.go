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
func (g *bwdGen) in(t string) bwdInput {
	ptr, st := "p."+t, "p."+t
	if t == "do" {
		ptr = "p.dout"
	}
	if g.v.Staged {
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

// packKernel writes BwdPackKernel for Staged variants: one warp copies one
// row of q and dO (query heads) and of k and v (key heads) into the
// staging buffers, zero-filling each row beyond DK or DV.
func (g *bwdGen) packKernel(b *strings.Builder) {
	v := g.v
	if !v.Staged {
		return
	}
	dks, dvs := BwdStagedDim(v.DType, v.DK), BwdStagedDim(v.DType, v.DV)
	fmt.Fprintf(b, `// Pack: copies q, dO [rows, H, DK|DV] and k, v [rows, Hkv, DK|DV] into staging buffers whose rows
// hold %d / %d elements (16-byte multiples, zero beyond DK=%d / DV=%d), so that the main kernels move
// 16-byte chunks. grid (ceil(max(N, M)/%d), B, H), %d threads; one warp per row.
extern "C" __global__ void __launch_bounds__(%d) %s(const BwdParams p) {
  const int b = blockIdx.y, h = blockIdx.z, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
`, dks, dvs, v.DK, v.DV, BwdPreRows, BwdPreThreads, BwdPreThreads, BwdPackKernel)
	g.segment(b)
	fmt.Fprintf(b, `  for (int r = warp; r < %d; r += %d) {
    const int i = blockIdx.x * %d + r;
    if (i < n) {
      copy_row<%d, %d>(p.pq + b * p.pq_sb + (qr0 + i) * p.pq_sr + h * p.pq_sh, p.q + b * p.q_sb + (qr0 + i) * p.q_sr + h * p.q_sh, lane);
      copy_row<%d, %d>(p.pdo + b * p.pdo_sb + (qr0 + i) * p.pdo_sr + h * p.pdo_sh, p.dout + b * p.do_sb + (qr0 + i) * p.do_sr + h * p.do_sh, lane);
    }
    if (h < p.Hkv && i < m) {
      copy_row<%d, %d>(p.pk + b * p.pk_sb + (kr0 + i) * p.pk_sr + h * p.pk_sh, p.k + b * p.k_sb + (kr0 + i) * p.k_sr + h * p.k_sh, lane);
      copy_row<%d, %d>(p.pv + b * p.pv_sb + (kr0 + i) * p.pv_sr + h * p.pv_sh, p.v + b * p.v_sb + (kr0 + i) * p.v_sr + h * p.v_sh, lane);
    }
  }
}

`, BwdPreRows, BwdPreThreads/32, BwdPreRows, v.DK, dks, v.DV, dvs, v.DK, dks, v.DV, dvs)
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
