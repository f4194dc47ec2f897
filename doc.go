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
// # Layouts
//
// The native order is flash_attn's [B, N, H, D]. A tensor held in PyTorch's
// scaled_dot_product_attention order [B, H, N, D] must be passed through
// BHSD, which returns a strided [B, N, H, D] view of it without copying;
// passed as it is, it would be read with heads and positions swapped.
// ToBHSD views O or a gradient back in that order. BSHD and THD (packed
// [total, H, D]) check the rank of tensors already in the native orders.
// The CPU backend returns each gradient laid out in memory like its input
// (NewLike), so the gradients of a BHSD view are again a BHSD view.
//
// # Reading results
//
// Result, Gradients and Tensor are the types of package attn, re-exported;
// go doc lists their fields and methods there. res.O.Shape gives the
// sizes, res.O.At(b, i, h, d) one element, res.O.Float32s() every element
// in row-major order of the shape (whatever the strides).
//
// # Forward and backward
//
// ForwardOn runs the forward on a backend and returns a Forwarded, which
// keeps what the backward needs (inputs, O, LSE and the options, dropout
// seed and offset included): its Backward takes only dO and cannot be
// given options other than the forward's. The explicit Backward (and
// Backend.Backward) takes q, k, v, O, LSE and the options again; they must
// be the forward's options, unchanged — other options are not detected and
// give wrong gradients.
//
// Dropout masks depend only on (Seed, Offset) and the position, so calls
// with the same options draw the same mask. A Generator hands out a fresh
// pair per call, as PyTorch's generator does:
//
//	gen := flashattn.NewGenerator(seed)
//	fw, err := flashattn.ForwardOn(b, q, k, v, gen.Draw(opt))
//	…
//	g, err := fw.Backward(dO) // the forward's mask
//
// # Errors
//
// Bad input returns an error naming the field and the value; it wraps one of
// ErrShape, ErrDType, ErrLayout, ErrOption or ErrUnsupported, which callers
// test with errors.Is.
package flashattn
