// Package cp runs attention with context parallelism: the sequence of one
// attention problem is split across the P ranks of a communication group,
// each rank holding a shard of Q, K and V, and the ranks exchange K/V blocks
// or heads so that together they compute what one device computes, within
// rounding, forward and backward.
//
// # Shards
//
// A Layout cuts a sequence into equal chunks: Contiguous gives rank r chunk
// r of P; Zigzag gives it chunks r and 2P−1−r of 2P, which balances a
// causal mask. Shard, Unshard and Positions cut and reassemble tensors and
// give each local token's global position. A sequence whose length is not
// a multiple of the number of chunks is refused with an error wrapping
// attn.ErrShape: shards are never uneven. Queries and keys are cut alike,
// so N ≠ M works under either causal alignment.
//
// A packed variable-length batch (cu_seqlens) is cut sequence by sequence:
// rank r holds its chunks of every sequence, concatenated in sequence
// order, so each sequence is balanced across the ranks and the local
// offsets, LocalCuSeqlens, are the global ones divided by P. ShardPacked,
// UnshardPacked and PackedPositions cut, reassemble and place packed
// tensors; empty sequences are allowed, and a sequence that does not cut
// into equal chunks is refused with attn.ErrShape.
//
// # Schemes
//
// Attention runs one rank's part of a call on any attn.Backend.
//
// Ring: the queries stay; the K/V blocks travel the ring of ranks, one
// hop per step, the next block in flight while the current one computes.
// For each pair of a local query chunk and a visiting key chunk the step
// plans one backend call from the global mask: a wholly masked pair is
// skipped, a partly masked one is trimmed to the rectangle of its visible
// pairs and run with the top-left window that reproduces the global mask
// there (any causal alignment or window of the global problem is a window
// of such a rectangle), and wholly visible pairs that tile one rectangle
// run as one call; so do pairs whose visible parts one window masks in the
// local order, as zigzag's own block under a causal mask is one causal
// triangle over its two chunks (without dropout, whose mask needs chunks
// consecutive in the global sequence). Under a causal mask with the Zigzag
// layout every rank computes the same number of pairs at every step, in
// one call. The partial outputs
// merge through their LSE in float32 (the LSE in float64) with the
// overflow-safe formula O = Σ exp(LSE_s − LSE)·O_s, LSE = m + log Σ
// exp(LSE_s − m); a block whose rows see no key contributes nothing. O is
// rounded to the input dtype once, at the end. The backward sends K/V
// round again; each block's backward gets the final O and LSE, so it
// recomputes the exact probabilities and Delta = rowsum(dO∘O), and its
// gradients are that block's exact share. dQ accumulates locally; dK and
// dV accumulate in float32 buffers that travel the ring one step behind
// their block, in the same grouped exchange as the next K/V block, so
// that they cross the link while the next step computes (its gradients
// are added once the buffer has arrived, in the order of the step's plan,
// which fixes the order of every float32 sum), and reach the owner one
// hop after the last step.
//
// A packed batch runs the same ring. Each step plans every sequence alone,
// as above; without dropout the calls that share a window and follow one
// another in both queries and keys become one packed backend call, whose
// cu_seqlens give each block a segment and fill the gaps with segments of
// queries without keys (rows that see nothing there) or keys without
// queries, since the backend applies one window to every segment. Under
// dropout each block of each sequence is a call of its own, whose
// cu_seqlens put empty segments before it so that it keeps its
// sequence's batch index, and whose DropoutAt places it at the
// sequence's positions.
//
// AllToAll (Ulysses): one all-to-all per tensor trades each rank's sequence
// shard of every head for the whole sequence of 1/P of the heads; the rank
// runs the global problem on those heads and trades the results back. Its
// degree is capped by the key/value heads: P must divide Hkv (under GQA the
// query heads of a group stay with their key head), otherwise it fails with
// attn.ErrUnsupported; use the ring or hybrid there. For a packed batch each rank
// reorders what it gathers into the global packed order, so that every
// sequence is whole, and runs the global packed call (the global
// cu_seqlens) on its heads.
//
// Hybrid, for P beyond the all-to-all degree: the P = A·R ranks form R
// groups of A consecutive ranks, A dividing Hkv and P (Attention.Groups,
// or by default the largest such, gcd(Hkv, P); HybridDegree). Within a
// group an all-to-all trades the members' sequence shards for the group's
// sequence of 1/A of the heads; across the groups the ring above runs on
// those heads, R steps, K/V (and in the backward dK/dV) travelling a ring
// of R; an all-to-all trades the results back. The sub-groups are split
// from the Transport (SplitGroup) on first use and kept until
// Attention.Close. With the Zigzag layout over P the A shards of group j,
// gathered in order, are exactly chunks j and 2R−1−j of 2R, the zigzag
// shard of a ring of R: the causal balance holds across the ring. A = 1 is
// the ring, A = P the all-to-all.
//
// Each partial result a backend returns is in the input dtype (the
// attn.Backend interface returns O and gradients in q's dtype); everything
// summed across blocks is kept in float32 or wider.
//
// Dropout draws the global problem's mask: each call is placed in it with
// attn.Options.DropoutAt (global query and key positions for a ring block,
// the head offset for all-to-all), so the kept elements are those of
// single-device attention. It needs a backend that implements DropoutAt:
// both do; the CUDA kernels take key origins that are multiples of 16
// (chunks of 16·k keys) and refuse others with attn.ErrUnsupported.
//
// Not supported yet, refused with attn.ErrUnsupported: an additive bias,
// and a packed batch under the Hybrid scheme.
//
// # Transports
//
// A Transport moves bytes between ranks with the operations NCCL offers:
// grouped sends and receives, all-to-all, all-gather and a barrier, called
// by every rank in the same order. NewLocal and Run give an in-process
// group, P ranks as goroutines exchanging host memory. Every operation
// takes a context. Any error aborts the group, so that the other ranks
// fail with an error wrapping ErrAborted instead of waiting: a failing
// rank never leaves the others hanging.
//
// SplitGroup splits a group into sub-groups by color, ordered by key,
// as ncclCommSplit does (GroupSplitter); the in-process transport splits
// in memory and its sub-groups share the parent's abort.
//
// NCCL (loaded at run time through purego from libnccl.so.2; no cgo) is
// the transport across GPUs. It implements Transport, staging host bytes
// through device memory, and DeviceTransport, whose operations take
// device buffers (DeviceSpan over a cuda.Buffer) and enqueue on a
// cuda.Stream, as NCCL does; Wait waits for a stream. NewNCCL joins one
// rank per process (ncclCommInitRankConfig, non-blocking); NewNCCLAll
// makes every rank of a group in one process, one ncclCommInitRankConfig
// per device inside one ncclGroupStart/End, each with its device's
// context current on the thread that issues the group. Sends and
// receives are always issued inside ncclGroupStart/End; an all-to-all is
// a group of sends and receives. Every wait polls ncclCommGetAsyncError
// with a deadline (DefaultNCCLTimeout when the context has none), and an
// error or a passed deadline aborts the communicator (ncclCommAbort), so
// a dead peer ends in an error, never a hang. SplitGroup calls
// ncclCommSplit where the library has it (NCCL 2.18 or newer; it is
// loaded optionally) and otherwise fails with attn.ErrUnsupported, which
// the Hybrid scheme reports. NCCL_NVLS_ENABLE=0 is set
// in the process environment before NCCL loads: NVLink multicast stays
// off. The library is searched in FLASHATTN_NCCL or NCCL_LIBRARY (exact
// paths), NCCL_HOME, the CUDA toolkits, the loader's path, the system
// directories, and the nvidia/nccl/lib and torch/lib directories of
// Python's site-packages (where PyTorch installs it). NCCL errors are
// *NCCLError values wrapping ErrNCCL; a missing library wraps ErrNoNCCL.
//
// # Several processes
//
// FromEnv reads a process's place in a job from the environment that
// flashattn launch, torchrun or Slurm sets (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT; SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID).
// Env.Share is the rendezvous: rank 0 listens on MASTER_ADDR:MASTER_PORT
// and hands a blob (the NCCL unique id) to every other rank over TCP,
// once all have arrived; a rank that disconnects, a rank that never
// comes (by the deadline) or ranks that disagree about the group end it
// with an error wrapping ErrRendezvous that names the ranks at fault.
// OpenNCCL does both steps and creates the communicator.
//
// # Choosing a strategy
//
// A Strategy is a layout and a scheme: "ring", "zigzag", "a2a", "hybrid"
// (zigzag layout, automatic degree) or "hybrid-A";
// Strategy.Check names what keeps one from splitting a problem. A Profile
// holds a machine's measured kernel rates (forward and backward, by block
// shape) and its link's bandwidth and latency; Calibrate measures one,
// and CachedProfile keeps it in a JSON file under the user cache
// directory, keyed by machine. Profile.Estimate models each step of a
// strategy from the exact calls the ring plans (or the all-to-alls and
// the one call per rank; for hybrid both, the ring's calls on 1/A of the
// heads, on the one link the profile measured), Choose picks the least
// modelled time among all four, and
// Explain prints the reasoning. A packed batch is modelled from the calls
// the packed ring plans, each costed segment by segment at the rate of
// its own sequence's block, the all-to-all's call sequence by sequence,
// and the bytes of the packed tokens; Choose picks among ring, zigzag and
// a2a there, hybrid refusing packed batches. MeasureSplit measures the same
// quantities: every rank's backend time per step, run one call at a time
// as on one device, and the bytes each rank sends.
//
// Sim wraps all of this as an attn.Backend that runs each call on P
// in-process ranks, for tests and for measuring the cost of splitting.
//
// # The cost of splitting on one GPU
//
// MeasureDeviceSplit measures it with everything on the device (package
// gpu): the global inputs, contiguous device tensors, are sharded once
// into per-rank tensors (device-to-device copies of each chunk); then,
// step by step and rank by rank, the calls the host ring plans for that
// step (the same planning code) run as ForwardDevice on views of the
// rank's query shard and of the visiting block's owner's K/V shards, each
// writing its partial result into a slot of the rank's own (a slot per
// call), and after the last step one kernel per rank combines its slots
// into its O and LSE (gpu.Backend.CombineForward: the host merge's
// semantics, each partial read once and no float32 accumulator written
// per step). The backward runs BackwardDevice per
// call and adds dQ into the rank's float32 accumulator and dK, dV into
// those of the block's owner (gpu.Backend.AddGradient), each owner's sums
// in the host ring's order. All of it runs on one stream; the single call
// over the whole problem, the split whole, its calls alone and its merge
// kernels alone are each captured in a CUDA graph and timed by events over
// replays (DeviceSplit). The split's total is the compute a real P-GPU run
// spreads over its GPUs, communication aside; the same split as the
// device ring runs it is timed too (DeviceSplit.RingMs). The device
// operations go through one small interface, so that tests run the whole
// algorithm on the host too, against the float64 oracle. It takes ring
// and zigzag (not a2a or hybrid) on padded batches without bias; under
// dropout each call places its mask in the global problem's.
//
// # The ring on one GPU
//
// DeviceRing runs the ring or zigzag split over P virtual ranks on one
// GPU as P GPUs would run it, everything on the device. Every rank has a
// compute stream and a communication stream. At step s the compute stream
// runs the rank's calls of the step (the host ring's plan) on views of its
// shards and of the K/V block it holds, each into its slot (the slots
// combined after the last step; a rank holds one slot per call, P where
// each step is one call, each the size of its O in the attention dtype, where a
// per-step merge needs one slot and a float32 accumulator), while the
// communication stream copies the
// block its predecessor holds, device to device, into the rank's other
// K/V buffer: the block of step s+1 (double buffers; step 0 reads the
// rank's own shards). The backward sends K/V round again; the float32
// dK/dV accumulator of each block travels with it one step behind (copied
// in while the step's first backward call runs, added into once it has
// landed) and hops to its owner after the last step, so every element's
// sums run in the host ring's order; dQ accumulates on the rank's compute
// stream. Events order the streams only where a buffer passes between
// them: a step's calls wait for their block's copy, and their dK/dV adds
// for the accumulator's; a copy waits for its source to have landed (or,
// for an accumulator, its adds to be done), and for the calls and the
// copy that read its destination to have finished; each pass forks every
// stream from the ring's own stream (Stream) and joins them back, so that
// the work enqueued there afterwards sees the results and a pass captures
// into one CUDA graph. A step whose block is wholly masked has no calls
// and waits for no K/V. The tests run the same schedule on a host stand-in
// whose streams are goroutines with random delays, against the float64
// oracle, and check the enqueued schedule itself with vector clocks: no
// two operations on overlapping elements, one writing, are unordered, and
// leaving out any one wait makes such a pair. Sim.OnDevice runs Sim's
// calls through a DeviceRing on the CUDA backend.
package cp
