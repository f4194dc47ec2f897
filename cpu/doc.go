// Package cpu is the pure-Go backend of flashattn.
//
// It holds two implementations of the attention problem defined in package
// attn:
//
//   - Reference and ReferenceBackward, a float64 oracle that follows the
//     definitions literally, and NaiveForward / NaiveBackward, the same math
//     with every intermediate rounded to a storage precision: the baseline of
//     the accuracy criterion (a backend's error against the oracle may be at
//     most a small multiple of the naive error).
//   - Backend (New), a fast FlashAttention-style implementation: tiled
//     online-softmax forward and FlashAttention-2 backward with float32
//     accumulation, on the SIMD tile kernels of internal/vec (AVX-512,
//     AVX2+FMA or portable Go, chosen at start-up from the CPU).
//
// # The fast path
//
// Each call first packs K and V once, as float32 in blocks of 64 keys of
// one (sequence, key head), K transposed, so that the tile products read
// contiguous, cache-friendly panels whatever the layout and dtype of the
// inputs; the backward also packs Q and dO per row. The forward then works
// on units of 64 queries of one head: the query tile is converted once, and
// for every block of 64 keys S = Q·Kᵀ, the online-softmax update (scale,
// maximum, exp and sum in one kernel) and O += P·V follow in 64×64 tiles.
// The backward accumulates dK and dV per key block over the query blocks,
// recomputing P from the LSE, with dQ accumulated per key chunk. Tiles that
// need nothing beyond scale·q·k (no softcap, no bias, every key visible)
// skip the per-element Go code of the general path.
//
// With bfloat16 inputs on a CPU with AVX512_BF16, the products with Kᵀ and
// Vᵀ (S = Q·Kᵀ, and dP = dO·Vᵀ in the backward) multiply the bfloat16 values
// directly (VDPBF16PS: exact products, float32 sums), and the forward also
// rounds P to bfloat16 for O += P·V, as GPU implementations do; the results
// stay well within the accuracy criterion for bfloat16. The other products
// of the backward, and float16 inputs, use float32 products on values
// converted exactly while packing.
//
// # Work split and determinism
//
// Goroutines (up to GOMAXPROCS) take fixed work units from a counter: query
// blocks in the forward, key heads in the backward. When a problem has
// fewer than 16 such units, its keys are split into a fixed number of
// chunks whose partial results are merged in chunk order, so that small
// batches keep every core busy too. The units and chunks depend only on the
// problem and every output element is produced by one goroutine in a fixed
// order, so the results are bit-identical whatever GOMAXPROCS is (for a
// given implementation of the tile kernels; the implementations may differ
// from one another by rounding).
//
// # Memory
//
// Beyond its outputs a call uses memory linear in the inputs, never
// proportional to N·M: the packed copies of K and V (and in the backward of
// Q and dO, with the LSE and Delta per row), partial results of the key
// chunks (at most 8 float32 copies of O or dQ), and a few 64×64 tiles per
// goroutine. The packed buffers are reused from call to call: one buffer
// of up to 64 MiB per element type stays allocated between calls, larger
// or concurrent ones go to a sync.Pool, which the garbage collector
// empties.
package cpu
