// Package kernels writes the CUDA C++ source of flashattn's GPU kernels.
//
// A kernel is described by a Variant, a plain comparable struct: element
// type, head-dimension capacities, tile sizes, warps, pipeline depth, global
// load width, mask kind and features (softcap, bias, dropout, packed
// variable-length batches, LSE output). Its source is a pure function of the
// Variant (Variant.Source), so the Variant is also the key of every cache of
// compiled kernels.
//
// The forward kernel follows FlashAttention-2: one CTA owns BlockM query rows
// of one (batch, head); it walks the key blocks from the last to the first,
// computing S = Q·Kᵀ with tensor-core mma.sync instructions, an online
// softmax in base 2 with scale·log2(e) folded in, and O += P·V with P taken
// from registers as the A operand (or from shared memory when the value
// dimension is split across warps). K and V tiles stream through shared
// memory with cp.async (or register-staged narrow loads when rows are only
// 2-byte aligned), in rows padded to an odd number of 16-byte chunks so that
// ldmatrix reads are free of bank conflicts and every shared address is a
// per-lane register plus an immediate (see fwd_load.go and docs/kernels/forward.md).
//
// On Hopper (sm_90a) a Variant with WGMMA set generates the warpgroup
// kernel instead (fwd_sm90.go, wgmma.go): one warpgroup per 64 query rows (two
// past D = 320, splitting each key block and the value columns), both
// products as wgmma.mma_async on shared tiles in the 128-byte swizzled layout
// those instructions read (matrix descriptors), K and V double-buffered, and
// the softmax of the next key block running while P·V of the current one is
// in flight. HopperTile gives its tiles. With TMA set as well, its Q, K and V
// tiles come from the tensor memory accelerator (tma.go): bulk tensor copies
// described by tensor maps the host encodes, completing on
// mbarriers, so the warps' own load path stays idle. The backward's dK/dV and dQ kernels
// have the same counterparts (BwdVariant.WGMMA, bwd_*_sm90.go; with
// BwdVariant.TMA their streamed tiles come by tensor maps, bwd_tma.go). Both reuse the
// element-wise code of the mma.sync kernels: the accumulator layout of a
// warp is the same.
//
// Every inline-PTX primitive sits between PrimitivesBegin and PrimitivesEnd
// in the generated source, so that a host emulator (package gpu's tests) can
// replace them and run the kernels without a GPU.
//
// Every kernel takes one struct parameter whose C declaration and Go
// packing come from one field list (CStruct: Params.Pack, BwdParams.Pack,
// PackParams.Pack), so they cannot drift; the generated source also asserts
// the struct's size (and, under nvcc, every field offset) at compile time.
//
// The forward's Variant and the backward's BwdVariant share one vocabulary:
// both embed Features (mask, softcap, bias, dropout, varlen), both have
// Validate, Source and Name.
//
// Files say pass, stage and architecture: fwd_*.go is the forward
// (fwd_variant, fwd_source, fwd_mainloop, fwd_load, fwd_qk, fwd_softmax,
// fwd_mask, fwd_pv, fwd_epilogue, fwd_dropout, fwd_params; fwd_sm90 the
// Hopper kernel), bwd_*.go the backward (bwd_variant, bwd_source, bwd_mma,
// bwd_stage, bwd_params, bwd_nan; bwd_dkdv_sm90, bwd_dq_sm90 and bwd_sm90
// the Hopper kernels, bwd_sm90_ws their warp-specialized pipeline,
// bwd_sm90_deep those past head dim 256; bwd_tma). Shared by both: features.go, headdim.go
// (every head-dim rounding rule), cstruct.go, tune.go (the tile tables),
// stage.go (the staging copies), flat.go, tma.go, ptx.go, wgmma.go and
// philox.go. cp_merge.go writes context parallelism's merge kernels, which
// fold the partial results of a call split over key blocks into float32
// accumulators.
//
// Element types: bf16 and fp16 use mma.sync m16n8k16 with fp32
// accumulation; fp32 uses split-tf32 (three m16n8k8 tf32 products per step:
// hi·hi + hi·lo + lo·hi, where x = hi + lo exactly up to the tf32 rounding of
// lo), which keeps each product to about 2^-21 relative error, so the fp32
// path meets a 1e-5 relative error bound against a float64 reference.
package kernels
