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
// Kernels are chosen per problem (element type, head dims, load width,
// mask, features) with the tuning table of package kernels, compiled by
// NVRTC on first use (cached on disk by package cuda and in memory here),
// and reused. Nothing falls back to the CPU: a problem the kernels cannot
// run returns an error wrapping attn.ErrUnsupported.
package gpu
