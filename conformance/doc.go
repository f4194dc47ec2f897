// Package conformance is the test suite every flashattn backend runs, the
// same cases against every implementation of attn.Backend:
//
//	func TestConformance(t *testing.T) {
//		conformance.Run(t, mybackend.New(), conformance.Config{Short: testing.Short()})
//	}
//
// # Accuracy criterion
//
// Every result is compared with the float64 oracle cpu.Reference /
// cpu.ReferenceBackward evaluated on the same (already rounded) inputs, using
// FlashAttention's criterion. Let err(X) be the largest absolute difference
// between a backend's X and the oracle's, and naive(X) the same for
// cpu.NaiveForward / cpu.NaiveBackward, which do the math naively with every
// intermediate stored in the dtype under test. Let s(X) = max(1, max|oracle X|):
// the inputs are standard normal, so 1 is the scale of the terms every output
// is summed from, and an output whose exact value is 0 by cancellation (the
// gradients of a row with a single visible key) is held to the rounding of
// such terms. Then, with eps(X) = u·s(X) and u the unit roundoff of the dtype
// (2⁻¹¹ for fp16, 2⁻⁸ for bf16: one rounding at the scale of the output, so
// that a result exact but for its final rounding always passes):
//
//	fp16, bf16:  err(O) ≤ 2·naive(O) + eps(O)
//	             err(G) ≤ 3·naive(G) + eps(G)    for G in dQ, dK, dV, dBias
//	fp32:        err(X) ≤ 1e-5·s(X)              for every output X
//
// The LSE, which every backend stores in float32, must be within
// 1e-5·max(1, max|oracle LSE|) for every dtype (for fp16 and bf16, or within
// 2·naive(LSE) when that is larger). Rows that see no key must have exactly
// O = 0, LSE = −Inf and dQ = 0. Every output must be finite and have the
// dtype and shape the contract of package attn gives.
//
// # Cases
//
// Odd sequence lengths (1, 3, 113/203, 1023/1024), head dimensions 1 to 512
// (59, 111, 127, 199, 257, 512), DK ≠ DV, GQA and MQA (6:1, 6:2, 8:1), N > M
// and N < M under both causal alignments, sliding windows (sides up to
// MaxInt, which mean unbounded), rows that see no key, softcap, bias with
// every broadcast and its gradient, dropout (the kept fraction, and forward
// and backward against the oracle's Philox mask), packed variable-length
// batches with zero-length segments, strided inputs (the [B, H, N, D]
// layout, gaps, offsets and non-unit element strides, with NaN in every
// gap), bit-identical repeats, and every class of bad input (layouts whose
// arithmetic overflows included) checked with errors.Is against the
// sentinels of package attn. Then 48 cases drawn at random (a fixed seed;
// fp16, bf16, and fp32 up to head dims of 128) from the cross product of all of these — head dims, GQA,
// packed or padded batches, layouts, masks, windows, softcap, scale,
// dropout and biases together — each named by what it holds, such as
// "random-07-q[5 0 17]-k[7 3 0]-h6/2-d65/100-gapped-causal-cap2-drop0.1".
//
// # NaN and infinities
//
// A row of q, k, v or dO filled with NaN (or an infinity) under causal
// masks and windows, on the diagonal and window-edge tiles and away from
// them: the outputs a visible (query, key) pair connects it to must be NaN
// (for a NaN; an infinity may give either) and every other element must
// equal the backend's result on the clean inputs, within rounding. A masked key contributes nothing (not 0·NaN),
// forward and backward; a NaN query row gives O = LSE = NaN; a NaN query
// row that sees no key stays O = 0, LSE = −Inf, dQ = 0.
package conformance
