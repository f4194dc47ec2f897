// Package attn defines the attention problem every flashattn backend solves:
// tensors and their element types, the options with their exact semantics,
// validation with typed errors, the masks, and the Backend interface.
//
// # Layout
//
// Queries q are [B, N, H, DK], keys k [B, M, Hkv, DK] and values v
// [B, M, Hkv, DV], indexed (batch, position, head, feature). Strides are in
// elements, so a [B, H, N, D] buffer is passed as shape [B, N, H, D] with
// strides [H·N·D, D, N·D, 1] and no copy. A packed variable-length batch drops
// the batch dimension: q is [totalQ, H, DK] and Options.CuSeqlensQ /
// CuSeqlensK hold the B+1 cumulative offsets of each segment.
//
// # Semantics
//
// For query i and key j of one batch element and query head h (key head
// h / (H/Hkv), so H must be a multiple of Hkv):
//
//	s_ij = Scale · q_i·k_j                        Scale 0 means 1/sqrt(DK)
//	s_ij = Softcap · tanh(s_ij / Softcap)        only when Softcap > 0
//	s_ij = s_ij + bias[b, h, i, j]                when Bias is set (broadcast over size-1 dims)
//	s_ij = -inf                                   when key j is masked for query i
//	LSE_i = log Σ_j exp(s_ij)                     natural log, float32; -inf for a row that sees no key
//	P_ij = exp(s_ij - LSE_i)
//	O_i  = Σ_j drop(P_ij) · v_j                   drop(x) = x/(1-p) if kept, else 0
//
// Masks. Query i of a sequence of N queries over M keys has its diagonal at key
// i + off, with off = 0 when aligned top-left and off = M − N when aligned
// bottom-right (the default, AlignBottomRight). A window (Left, Right) keeps
// keys from diagonal − Left to diagonal + Right inclusive; a negative side is
// unbounded. Causal is the window (unbounded, 0), and combines with a window
// by intersection. The visible keys of a row are always one contiguous range.
//
// A row that sees no key has O = 0, LSE = −inf and zero gradients; it never
// produces NaN.
//
// A NaN in q, k, v, dO or the bias reaches exactly the outputs that a
// visible (query, key) pair connects it to, as the formulas above say with
// the sums taken over the visible keys only: a masked key contributes
// nothing (not 0·NaN), forward and backward, and a query row holding a NaN
// has O = LSE = NaN, not the answer of a row that sees no key. Dropout does
// not hide a key: the NaN value of a dropped key still reaches the row, as
// in dropout(P)·V.
//
// Dropout with probability p in [0, 1) acts on P after the LSE is taken; its
// keep mask is the Philox4x32-10 mapping defined in package philox, a pure
// function of (Seed, Offset, b, h, i, j), which the backward regenerates. The
// mask resolves p in steps of 1/256: it keeps T = round(256·(1 − p)) of the
// 256 values of an element's 8-bit number and scales a kept probability by
// 256/T, so that the expectation is unchanged for the p it draws,
// 1 − T/256. A p in (0, 1) with T = 0 or 256 (p ≤ 1/512, p > 1 − 1/512) is
// refused with ErrOption.
// Options.DropoutAt shifts h, i and j to a place in a larger problem, so
// that a call over one block of it draws that block's part of its mask.
//
// The backward returns dQ, dK, dV (summed over the query heads that share a
// key head) and, when the bias has RequiresGrad set, dBias in the bias's own
// broadcast shape, summed over the dimensions it broadcasts.
//
// # Errors
//
// Every bad input returns an error that names the field and the value and
// wraps one of the sentinels ErrShape, ErrDType, ErrLayout, ErrOption or
// ErrUnsupported; test for them with errors.Is.
package attn
