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

// segStart returns the address of the first row of batch element b's
// segment, head 0.
func (x bwdInput) segStart() string {
	return fmt.Sprintf("%s + b * %s + %s * %s", x.ptr, x.sb, x.rowBase, x.sr)
}

// at returns the address of row row (relative to the segment) of head head.
func (x bwdInput) at(row, head string) string {
	return fmt.Sprintf("%s + b * %s + (%s + %s) * %s + %s * %s", x.ptr, x.sb, x.rowBase, row, x.sr, head, x.sh)
}

// packKernel writes BwdPackKernel for Staged variants: one launch copies q,
// dO, k and v (blockIdx.z) into the staging buffers, a block taking
// PackRowsPerBlock consecutive (row, head) pairs of one batch element's
// segment, as the forward's pack kernel does: for the usual contiguous
// layout both sides stream whole cache lines (a block per 16 rows of one
// head, as before, read each row's few hundred bytes out of lines shared
// with the other heads' blocks).
func (g *bwdGen) packKernel(b *strings.Builder) {
	v := g.v
	if !v.Staged {
		return
	}
	dks, dvs := BwdStagedDim(v.DType, v.DK), BwdStagedDim(v.DType, v.DV)
	fmt.Fprintf(b, `// Pack: copies q, dO [rows, H, DK|DV] and k, v [rows, Hkv, DK|DV] (blockIdx.z: 0 q, 1 dO, 2 k, 3 v) into
// staging buffers [rows, heads, %[1]d|%[2]d] (32-byte multiples, zero beyond DK=%[3]d / DV=%[4]d), so that the
// main kernels move 16-byte chunks. grid (ceil(max(N·H, M·Hkv) / %[5]d), B, 4), %[6]d threads, %[7]d bytes of
// dynamic shared memory; a block copies %[5]d consecutive (row, head) pairs f = row·heads + head of batch
// element b's segment, its threads taking 16-byte chunks.
extern "C" __global__ void __launch_bounds__(%[6]d) %[8]s(const BwdParams p) {
  typedef unsigned char u8;
  const int b = blockIdx.y, z = blockIdx.z;
`, dks, dvs, v.DK, v.DV, PackRowsPerBlock, PackThreads, PackSharedBytes, BwdPackKernel)
	g.segment(b)
	b.WriteString(`  // this block's tensor: source and staging rows from the segment's first row, rows, heads, dims
  const T* src;
  T* dst;
  long long ssr, ssh;
  int rows, heads, d, ds;
`)
	for i, t := range []struct {
		name, rows, heads string
		dim, dimS         int
	}{{"q", "n", "p.H", v.DK, dks}, {"do", "n", "p.H", v.DV, dvs}, {"k", "m", "p.Hkv", v.DK, dks}, {"v", "m", "p.Hkv", v.DV, dvs}} {
		dst, src := bwdTensor(t.name, true), bwdTensor(t.name, false)
		open := fmt.Sprintf("  } else if (z == %d) {", i)
		switch i {
		case 0:
			open = "  if (z == 0) {"
		case 3:
			open = "  } else {"
		}
		fmt.Fprintf(b, `%s  // %s
    src = %s; dst = %s;
    ssr = %s; ssh = %s; rows = %s; heads = %s; d = %d; ds = %d;
`, open, t.name, src.segStart(), dst.segStart(), src.sr, src.sh, t.rows, t.heads, t.dim, t.dimS)
	}
	b.WriteString("  }\n")
	fmt.Fprintf(b, `  const long long f0 = (long long)blockIdx.x * %[1]d, nf = (long long)rows * heads;
  if (f0 >= nf) return;  // past this tensor's pairs
  // staging pair f at dst + f·ds (the workspace's buffers are [rows, heads, ds], contiguous); no tensor
  // end is known here, so whole 16-byte loads stay within the block's pairs (a null lim)
  extern __shared__ __align__(16) unsigned char smem[];  // the pairs' source addresses (PackSharedBytes)
  stage_pairs<%[2]d>(reinterpret_cast<u8*>(dst + f0 * ds), reinterpret_cast<const u8*>(src), ssr, ssh, heads, 0u, d, ds, (int)sizeof(T),
                     f0, (int)min((long long)%[1]d, nf - f0), nf, nullptr, reinterpret_cast<const u8**>(smem));
}

`, PackRowsPerBlock, PackThreads)
}

// BwdPackGrid returns the grid of BwdPackKernel for a batch of b elements
// (segments) of at most n query and m key rows, h query and hkv key heads.
func BwdPackGrid(b, n, m, h, hkv int) [3]int {
	f := max(int64(n)*int64(h), int64(m)*int64(hkv))
	return [3]int{int((f + PackRowsPerBlock - 1) / PackRowsPerBlock), b, 4}
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
