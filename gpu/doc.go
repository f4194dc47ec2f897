// Package gpu is flashattn's CUDA backend: it glues package kernels (the
// generated CUDA C++ of each kernel variant) to package cuda (driver API and
// NVRTC through purego, no cgo).
//
// Backend implements attn.Backend for host tensors: Forward copies each
// tensor's storage span to the device as is (the kernels read strided memory
// directly, so caller strides are kept; the feature dim must have stride 1),
// launches the forward kernel and copies O and LSE back. For callers that
// keep tensors on the GPU, ForwardDevice enqueues the kernel on a stream
// without synchronizing or allocating, so it can be captured in a CUDA
// graph.
//
// Backward computes dQ, dK, dV (and dBias) the same way; BackwardDevice is
// its enqueue-only form (PrepareBackward compiles its kernels first and
// returns the workspace it needs). The backward has two dQ algorithms: fp32
// atomic adds from the dK/dV kernel (five matrix products), or a separate
// dQ kernel that recomputes the scores (seven products, no atomics,
// bit-for-bit deterministic). SelectDQAlgorithm picks one from a table of
// measurements per shape class; Options.Deterministic forces the separate
// one. dK and dV are accumulated on chip by one block per key block, over
// every query head of its GQA group, so sharing a key head adds no
// contention.
//
// On sm_90 devices, when NVRTC can target sm_90a, the forward and the
// backward's dK/dV and dQ kernels are the Hopper (wgmma) kernels wherever
// they apply (16-bit types, rows read with 16-byte copies or staged, head
// dims up to 512 forward and 256 backward); elsewhere the mma.sync kernels
// run, and so they do with FLASHATTN_NO_WGMMA set when New runs or with
// Backend.WGMMA cleared. The Hopper kernels load their streamed tiles with
// the tensor memory accelerator (tensor maps encoded on the host, the last
// launch's kept) for fixed-length and packed batches whose rows and strides
// are whole 16-byte units (staging copies included): q, k and v in the
// forward, q and dO in the backward's dK/dV kernel, k and v in its dQ
// kernel; unless FLASHATTN_NO_TMA is set when New runs or Backend.TMA is
// cleared. On those kernels the forward and the backward run
// warp-specialized pipelines by default (Backend.Pipeline,
// Backend.BwdPipeline: DefaultPipeline, DefaultBwdPipeline), except for
// the problem classes where the lockstep kernels measured faster;
// FLASHATTN_FWD_PIPELINE and FLASHATTN_BWD_PIPELINE choose others
// ("lockstep"). The forward's persistent CTAs and O stored by tensor maps
// serve calls of at most ShortKeys keys (plain calls up to ShortPlainDim:
// ShortPlainKeys; causal: ShortCausalKeys) and
// windows of at most ShortWindowKeys+1 keys a row by default
// (Backend.ShortPipeline, DefaultShortPipeline) and are opt-in past them.
// New reads the environment once; every knob is a field of Backend.
//
// For context parallelism on the device, the merge kernels fold a partial
// forward result (O and its LSE) into a float32 Accumulator through the
// LSEs, add partial gradients into one, and round the sum to the
// attention dtype once (ResetAccumulator, MergeForward, AddGradient,
// FinishAccumulator), or combine the partial forward results of a whole
// call, held in slots of one tensor, in one kernel (CombineForward);
// Download copies a device tensor back to the host.
//
// Every call is validated once (attn.NewProblem for host tensors, the same
// rules for device tensors) and planned once; the host forms upload their
// tensors and then run the device forms' enqueue path.
//
// Kernels are chosen per problem (element type, head dims, load width,
// mask, features) with the tuning table of package kernels, compiled by
// NVRTC on first use (cached on disk by package cuda and in memory, one
// module cache per Backend for every kernel), and reused. Nothing falls back to the CPU: a problem the kernels cannot
// run returns an error wrapping attn.ErrUnsupported.
package gpu
