package kernels

import "fmt"

// kernel writes the entry point: CTA coordinates, the key-block range, the
// prologue loads, the main loop with its pipeline schedule, the epilogue.
//
// Pipeline schedules (one K and one V tile per key block, walked from the
// last block down):
//
//   - cp.async, 1 stage (FlashAttention-2): the V load of block n overlaps
//     S = Q·Kᵀ, the K load of block n−1 overlaps softmax and P·V.
//   - cp.async, 2 stages: K and V of block n−1 go to the other buffer while
//     block n is computed, so each load has a whole iteration to land.
//   - register-staged (2-byte rows): V of block n is loaded into registers
//     before S = Q·Kᵀ and stored after it; K of block n−1 is loaded before
//     softmax and P·V and stored after them.
func (x *gen) kernel() {
	v := x.v
	x.raw(x.biasFuncs())
	x.nfFixupFuncs()

	x.p("extern \"C\" __global__ void __launch_bounds__(NTHREADS, %d) %s(const Params p) {", v.MinBlocks, KernelName)
	x.raw(`  extern __shared__ __align__(128) unsigned char smem[];
  const u32 s_base = smem_addr(smem);
  const u32 sQ = s_base + SQ_OFF;  // [BM][DKP]
  const u32 sK = s_base + SK_OFF;  // [stages][BN][DKP]
  const u32 sV = s_base + SV_OFF;  // [stages][BN][DVP]
`)
	if v.WarpsN > 1 {
		x.raw(`  const u32 sP = s_base + SP_OFF;                  // [BM][BN]
  float* red = (float*)(smem + RED_OFF);           // [WN][BM] row statistics
`)
	}
	x.raw("  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;\n")
	if v.WarpsN == 1 {
		x.raw("  const int wm = warp;     // warp position: row group\n  constexpr int wn = 0;    // (one key/value-column group)\n")
	} else {
		x.raw("  const int wm = warp % WM, wn = warp / WM;  // warp position: row group, key/value-column group\n")
	}
	x.raw(`  const int g = lane >> 2, c = lane & 3;      // mma fragment: row group g, column pair c
  const int wrow0 = wm * MT * 16;             // first block row of this warp
  const int key0 = wn * (BN / WN);            // first tile key of this warp in S
  const int dv0 = wn * (DVP / WN);            // first value column of this warp in O
  (void)wn; (void)key0; (void)dv0;
`)
	x.ctaSetup()
	x.mainLoop()
	x.recomputeCoords()
	x.epilogue()
	x.nfFixup()
	x.raw("}\n")
}

// ctaSetup writes what every forward kernel does before its main loop: the
// CTA's coordinates and sequence bounds, the global base addresses, the
// visible key-block range (with the early exit of a CTA that sees no key),
// the bias rows, the exponent scale, and the zeroed accumulators and row
// statistics.
func (x *gen) ctaSetup() {
	v := x.v
	if v.Persistent {
		x.raw("\n  // ---- tile coordinates: query block, head, batch element\n")
		x.raw(x.tileCoords("  "))
	} else {
		x.raw(`
  // ---- CTA coordinates: query block, head, batch element (segment)
`)
		if v.LightTail {
			x.raw(ctaOrderCall("  ", "the launch ends on its lightest query blocks (kernels/cta_order.go)"))
			x.raw(`  const int mblk = gridDim.x - 1 - blk_;  // heaviest (last) query blocks first
  int h = pair_ % gridDim.y, b = pair_ / gridDim.y;
`)
			x.raw(x.pairOrder("  ", "pair_"))
		} else {
			if v.Mask == MaskWindow {
				x.raw("  const int mblk = gridDim.x - 1 - blockIdx.x;  // heaviest (last) query blocks first\n")
			} else {
				x.raw("  const int mblk = blockIdx.x;\n")
			}
			x.raw("  int h = blockIdx.y, b = blockIdx.z;\n")
			x.raw(x.pairOrder("  ", "blockIdx.y + gridDim.y * blockIdx.z"))
		}
	}
	x.raw(`  const int kvh = h / p.group;  // key/value head of this query head
  int n = p.n, m = p.m;         // query and key counts of the sequence
  i64 qs = 0, ks = 0;           // first packed query/key row of the sequence
`)
	if v.Varlen {
		x.raw(`  {
    const int* cq = (const int*)p.cu_q;
    const int* ck = (const int*)p.cu_k;
    qs = cq[b];
    n = cq[b + 1] - cq[b];
    ks = ck[b];
    m = ck[b + 1] - ck[b];
  }
`)
	}
	x.raw(`  int m0 = mblk * BM;  // first query row of this CTA
  if (m0 >= n) ` + x.tileExit() + `
  int rows = min(BM, n - m0);  // valid query rows

  // ---- global addresses (bytes; 64-bit offsets)
  const i64 q_rs = p.q_sn * ESZ, k_rs = p.k_sn * ESZ, v_rs = p.v_sn * ESZ, o_rs = p.o_sn * ESZ;
  const char* gQ = (const char*)p.q + ((i64)b * p.q_sb + (qs + m0) * p.q_sn + (i64)h * p.q_sh) * ESZ;
  const char* gK = (const char*)p.k + ((i64)b * p.k_sb + ks * p.k_sn + (i64)kvh * p.k_sh) * ESZ;
  const char* gV = (const char*)p.v + ((i64)b * p.v_sb + ks * p.v_sn + (i64)kvh * p.v_sh) * ESZ;
`)
	x.raw("  (void)k_rs; (void)v_rs; (void)o_rs;\n\n")
	x.maskRange()
	x.epilogueEmpty()
	x.biasSetup()
	switch {
	case x.v.naturalScores():
		x.raw("  constexpr float SC = LOG2E;  // scores are prescaled in natural units (scale·s + bias): log2(e) folded into the exponent\n")
	case x.v.prescaled():
		x.raw("  constexpr float SC = 1.f;  // scores are prescaled into base-2 units\n")
	default:
		x.raw("  const float SC = p.scale_log2;  // scale·log2(e), folded into the exponent\n")
	}
	x.raw(`
  // ---- accumulators and row statistics
  float o[MT][NT_O][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.f;
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      row_max[mt][hf] = NEG_INF;
      row_sum[mt][hf] = 0.f;
    }

`)
}

// recomputeCoords re-derives the CTA coordinates after the main loop from
// fresh special-register reads, so that they hold no registers during it.
func (x *gen) recomputeCoords() {
	v := x.v
	x.raw("\n  {  // ---- CTA coordinates again (not kept live through the main loop)\n")
	if v.LightTail {
		x.raw(ctaOrderCall("    ", ""))
		x.raw("    b = pair_ / gridDim.y;\n    h = pair_ % gridDim.y;\n")
		x.raw(x.pairOrder("    ", "pair_"))
		x.raw("    m0 = (gridDim.x - 1 - blk_) * BM;\n")
	} else {
		x.raw("    const u32 cz = ctaid_z(), cy = ctaid_y(), cx = ctaid_x();\n")
		x.raw("    b = (int)cz;\n    h = (int)cy;\n")
		x.raw(x.pairOrder("    ", "cy + gridDim.y * cz"))
		if v.Mask == MaskWindow {
			x.raw("    m0 = (int)(gridDim.x - 1 - cx) * BM;\n")
		} else {
			x.raw("    m0 = (int)cx * BM;\n")
		}
	}
	if v.Varlen {
		x.raw("    qs = ((const int*)p.cu_q)[b];\n    rows = min(BM, ((const int*)p.cu_q)[b + 1] - (int)qs - m0);\n")
	} else {
		x.raw("    rows = min(BM, p.n - m0);\n")
	}
	x.raw("  }\n")
}

// loadK and friends return the statements that move one tile.
func (x *gen) loadK(buf, nb string) string {
	return fmt.Sprintf("load_tile<BN, KCH>(sK + (%s) * K_STAGE, gK + (i64)(%s) * BN * k_rs, k_rs, m - (%s) * BN, p.d_k * ESZ, tid);", buf, nb, nb)
}

func (x *gen) loadV(buf, nb string) string {
	return fmt.Sprintf("load_tile<BN, VCH>(sV + (%s) * V_STAGE, gV + (i64)(%s) * BN * v_rs, v_rs, m - (%s) * BN, p.d_v * ESZ, tid);", buf, nb, nb)
}

// mainLoop writes the prologue and the loop over key blocks.
func (x *gen) mainLoop() {
	v := x.v
	reg := v.LoadBytes == 2
	x.raw(`  // ---- per-lane ldmatrix offsets (Q, K: A- and B-like patterns; V: A-like, transposed, from column dv0)
  const u32 qo = lane_a<KCH>(lane), ko = lane_b<KCH>(lane);
  const u32 vo = lane_a<VCH>(lane) + dv0 * ESZ;
  const u32 qbase = sQ + toff<KCH>(wrow0, 0);  // this warp's first Q row
`)
	if v.WarpsN > 1 {
		x.raw("  const u32 po = lane_a<PCH>(lane);\n")
	}
	x.raw("  // ---- prologue: Q and the first key block\n")
	switch {
	case reg:
		x.p(`  u32 stage[STAGE_REGS];  // one tile in flight through registers
#pragma unroll 1
  for (int r0 = 0; r0 < BM; r0 += %[1]d) {  // Q, %[1]d rows at a time
    ldg_tile<%[1]d, KCH>(stage, gQ + r0 * q_rs, q_rs, rows - r0, p.d_k, tid);
    sts_tile<%[1]d, KCH>(sQ + toff<KCH>(r0, 0), stage, tid);
  }`, v.qChunkRows())
		x.raw(`  ldg_tile<BN, KCH>(stage, gK + (i64)(nb_hi - 1) * BN * k_rs, k_rs, m - (nb_hi - 1) * BN, p.d_k, tid);
  sts_tile<BN, KCH>(sK, stage, tid);
`)
	case v.Stages == 1:
		x.p("  load_tile<BM, KCH>(sQ, gQ, q_rs, rows, p.d_k * ESZ, tid);")
		x.p("  %s", x.loadK("0", "nb_hi - 1"))
		x.p("  cp_commit();")
	default:
		x.p("  load_tile<BM, KCH>(sQ, gQ, q_rs, rows, p.d_k * ESZ, tid);")
		x.p("  %s", x.loadK("0", "nb_hi - 1"))
		x.p("  cp_commit();")
		x.p("  %s", x.loadV("0", "nb_hi - 1"))
		x.p("  cp_commit();")
	}
	if v.QInRegs {
		switch {
		case reg:
			x.raw("  __syncthreads();\n")
		case v.Stages == 1:
			x.raw("  cp_wait<0>();\n  __syncthreads();\n")
		default:
			x.raw("  cp_wait<1>();\n  __syncthreads();\n")
		}
		x.raw(`  u32 qf[MT][KSTEPS][4];  // Q fragments, kept for the whole kernel
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) ldsm4(qf[mt][kk], qbase + qo + toff<KCH>(mt * 16, 2 * kk));
`)
	}
	qarg := ""
	if v.QInRegs {
		qarg = ", qf"
	}
	buf := "0"
	if v.Stages == 2 {
		buf = "buf"
	}

	x.raw("\n  // ---- main loop over key blocks, last to first\n")
	x.raw("  for (int nb = nb_hi - 1, it = 0; nb >= nb_lo; --nb, ++it) {\n")
	x.raw("    const int n0 = nb * BN;  // first key of the block\n")
	if v.Stages == 2 {
		x.raw("    const int buf = it & 1;  // buffer of this block\n")
	} else {
		x.raw("    (void)it;\n")
	}
	// Top of the loop: K of this block ready; start the next transfer.
	switch {
	case reg:
		x.raw(`    __syncthreads();  // K(nb) stored; every warp is done with V of the previous block
    ldg_tile<BN, VCH>(stage, gV + (i64)nb * BN * v_rs, v_rs, m - n0, p.d_v, tid);
`)
	case v.Stages == 1:
		x.raw("    cp_wait<0>();\n    __syncthreads();  // K(nb) landed; every warp is done with V of the previous block\n")
		x.p("    %s", x.loadV("0", "nb"))
		x.raw("    cp_commit();\n")
	default:
		x.raw("    cp_wait<1>();\n    __syncthreads();  // K(nb) landed (V(nb) may be in flight); the other buffers are free\n")
		x.p("    if (nb > nb_lo) %s", x.loadK("buf ^ 1", "nb - 1"))
		x.raw("    cp_commit();\n")
	}
	x.p("    float s[MT][NT_S][4];  // S, then P")
	x.p("    qk(s, qbase, sK + (%s) * K_STAGE + toff<KCH>(key0, 0), qo, ko%s);", buf, qarg)
	x.transform()
	x.maskBoundary()
	x.maskApply()
	if v.WarpsN > 1 {
		x.softmaxPartialMax()
	}
	// Middle: V of this block ready; start the K (or V) transfer of the next block.
	switch {
	case reg:
		x.raw(`    sts_tile<BN, VCH>(sV, stage, tid);
    if (nb > nb_lo) ldg_tile<BN, KCH>(stage, gK + (i64)(nb - 1) * BN * k_rs, k_rs, m - n0 + BN, p.d_k, tid);
    __syncthreads();  // V(nb) stored; every warp is done with K(nb)
`)
	case v.Stages == 1:
		x.raw("    cp_wait<0>();\n    __syncthreads();  // V(nb) landed; every warp is done with K(nb)\n")
		x.p("    if (nb > nb_lo) {\n      %s\n      cp_commit();\n    }", x.loadK("0", "nb - 1"))
	default:
		x.raw("    cp_wait<1>();\n    __syncthreads();  // V(nb) landed (K(nb-1) may be in flight)\n")
		x.p("    if (nb > nb_lo) %s", x.loadV("buf ^ 1", "nb - 1"))
		x.raw("    cp_commit();\n")
	}
	x.softmax()
	if v.Dropout {
		x.raw("    apply_dropout(s, p, m0 + wrow0 + p.drop_q0, n0 + key0 + p.drop_k0, (u32)(b * p.drop_heads + p.drop_h0 + h), lane);  // ---- dropout\n")
	}
	if v.WarpsN > 1 {
		x.storeP()
		x.raw("    __syncthreads();  // P complete\n")
		x.p("    pv(o, sP + toff<PCH>(wrow0, 0), sV + (%s) * V_STAGE, po, vo, dv0, lane);", buf)
	} else {
		x.p("    pv(o, s, sV + (%s) * V_STAGE, vo, dv0, lane);", buf)
	}
	if reg {
		x.raw("    if (nb > nb_lo) sts_tile<BN, KCH>(sK, stage, tid);\n")
	}
	x.raw("  }\n")
}
