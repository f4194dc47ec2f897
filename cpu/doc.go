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
//     accumulation, and goroutines over batch, heads and blocks. Each
//     goroutine works in a few 64×64 tiles. Beyond its outputs a call
//     allocates memory linear in the inputs, never proportional to N·M:
//     float32 copies of 16-bit inputs and of inputs whose last dimension is
//     not contiguous (float32 inputs in any other layout, such as
//     [B, H, N, D], are used in place), and in the backward up to four
//     float32 dQ accumulators. Its results are bit-identical whatever
//     GOMAXPROCS is, because the work is cut into fixed blocks and every
//     output element is produced by one goroutine in a fixed order.
package cpu
