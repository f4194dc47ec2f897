// Package flashattn computes exact scaled dot-product attention, forward and
// backward, the way FlashAttention does: tiled, with an online softmax, never
// materialising the N×M score matrix, and with the log-sum-exp kept so the
// backward can recompute the probabilities.
//
// Two backends implement the same problem: a pure-Go CPU backend that runs
// anywhere (package cpu, which also holds the float64 reference every backend
// is tested against) and a CUDA backend whose kernels are generated as CUDA
// C++ and compiled at run time with NVRTC (package gpu). Open picks one by
// name; "auto" takes the GPU when one works and the CPU otherwise. Forward
// and Backward run on that automatic choice.
//
// # Problem
//
// Queries are [B, N, H, DK], keys [B, M, Hkv, DK] and values [B, M, Hkv, DV]
// (batch, position, head, feature), in float32, float16 or bfloat16, with
// arbitrary strides, or packed as [total, heads, dim] with cumulative
// sequence offsets for variable-length batches. H must be a multiple of Hkv
// (grouped- and multi-query attention); head dims run from 1 to 512.
//
// The options follow one definition on every backend:
//
//	s = Scale·q·kᵀ                    Scale 0 means 1/sqrt(DK)
//	s = Softcap·tanh(s/Softcap)       when Softcap > 0
//	s = s + bias                      bias [B or 1, H or 1, N, M]
//	s = −inf where masked             causal / sliding window around the diagonal
//	LSE = log Σ exp(s), P = exp(s − LSE), O = dropout(P)·V
//
// The diagonal of query i sits at key i + M − N (aligned bottom-right, the
// default) or at key i (top-left). A row that sees no key gives O = 0,
// LSE = −inf and zero gradients, never NaN. Dropout uses the Philox4x32-10
// keep mask documented in package philox, identical on every backend. The
// full semantics are in the documentation of package attn, whose types this
// package re-exports.
//
// # Errors
//
// Bad input returns an error naming the field and the value; it wraps one of
// ErrShape, ErrDType, ErrLayout, ErrOption or ErrUnsupported, which callers
// test with errors.Is.
package flashattn
