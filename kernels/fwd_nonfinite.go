package kernels

// The forward's non-finite fix-up (see fwd_mask.go): the main kernel only
// raises a flag; this kernel, launched after it, does the rest.

// NonFiniteKernel is the entry point of the forward's non-finite fix-up in
// every variant's module: launched after KernelName with the same argument
// and block size (Variant.Threads) and no dynamic shared memory, on
// NonFiniteBlocks blocks, it returns at once unless a CTA of the main
// kernel raised the flag at Params.NFFlag; then it recomputes every O row
// that holds a NaN or an infinity (nf_rows), and its last block clears the
// flag and the done counter beside it.
const NonFiniteKernel = "fa_fwd_nonfinite"

// NonFiniteBlocks returns the fix-up kernel's block count for a main
// kernel of grid blocks on a device of sms multiprocessors: one block per
// CTA of the main kernel up to sms, the blocks then striding over the CTAs'
// rows.
func NonFiniteBlocks(grid [3]uint32, sms int) uint32 {
	n := uint64(grid[0]) * uint64(grid[1]) * uint64(grid[2])
	return uint32(max(1, min(n, uint64(max(sms, 1)))))
}

// nfFixupKernel writes NonFiniteKernel. It uses nf_rows, so it comes
// after it (and before the main kernel, whose argument type it shares).
func (x *gen) nfFixupKernel() {
	v := x.v
	x.raw(`// Non-finite fix-up (rare work; see fwd_mask.go), launched after the main kernel with its argument. Flag clear:
// return. Flag set: the blocks stride over the main kernel's CTAs [BM query rows of head h, batch element
// (segment) b] and recompute each row whose O holds a NaN or an infinity (nf_rows); the last block to finish
// clears the flag and the counter, so that the next call on the stream starts from 0.
`)
	if v.TMA {
		x.p("extern \"C\" __global__ void __launch_bounds__(NTHREADS) %s(const __grid_constant__ TmaParams tp) {", NonFiniteKernel)
		x.raw("  const Params& p = tp.p;\n")
	} else {
		x.p("extern \"C\" __global__ void __launch_bounds__(NTHREADS) %s(const Params p) {", NonFiniteKernel)
	}
	x.raw(`  u32* flag = (u32*)p.nf_flag;  // [0] raised by the main kernel, [1] blocks done
  if (*(volatile u32*)flag == 0u) return;  // no CTA saw a NaN or an infinity
  const int tid = threadIdx.x;
  const int mblks = (p.n + BM - 1) / BM;  // query blocks per (batch element, head): the main kernel's grid.x
  const long long ctas = (long long)mblks * p.h * p.b;
  for (long long t = blockIdx.x; t < ctas; t += gridDim.x) {  // (uniform over the block)
    const int m0 = (int)(t % mblks) * BM, h = (int)((t / mblks) % p.h), b = (int)(t / ((long long)mblks * p.h));
    int n = p.n;  // query rows of the sequence
    i64 qs = 0;   // first packed query row of the sequence
`)
	if v.Varlen {
		x.raw("    qs = ((const int*)p.cu_q)[b];\n    n = ((const int*)p.cu_q)[b + 1] - (int)qs;\n")
	}
	x.raw("    if (m0 >= n) continue;\n")
	if v.Mask == MaskNone {
		x.raw("    const int dlo = (int)0x80000000, dhi = 0x7fffffff;  // every key of the sequence\n")
	} else {
		if v.Varlen {
			x.raw("    const int m = ((const int*)p.cu_k)[b + 1] - ((const int*)p.cu_k)[b];\n")
		} else {
			x.raw("    const int m = p.m;\n")
		}
		x.raw(`    // visible keys of row i: dlo <= j - i < dhi (the main kernel's bounds)
    const int diag = p.align_br ? m - n : 0;
    const int dlo = p.win_left < 0 ? (int)0x80000000 : diag - p.win_left;
    const int dhi = p.win_right < 0 ? 0x7fffffff : diag + p.win_right + 1;
`)
	}
	x.raw(`    nf_rows(p, b, h, m0, min(BM, n - m0), qs, dlo, dhi, tid);
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(flag + 1, 1u) == gridDim.x - 1) {  // the last block: every other one is done with the flag
      flag[0] = 0u;
      flag[1] = 0u;
      __threadfence();
    }
  }
}

`)
}
