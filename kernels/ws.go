package kernels

// The synchronisation primitives of warp-specialized Hopper kernels: a
// producer warp issuing the loads, consumer warpgroups releasing each stage
// through an "empty" mbarrier, named barriers ordering the consumers'
// products (ping-pong), setmaxnreg moving registers from the producer to the
// consumers, and the bulk reduce-add of a shared fp32 tile into global
// memory. The host emulator (package gpu's testdata/emu/ws.h) gives each
// wrapper under the same name.

// WarpSpecializedPrimitives returns the inline-PTX wrappers of warp
// specialization, for a kernel's block of primitives (between
// PrimitivesBegin and PrimitivesEnd), next to the mbarrier and bulk tensor
// copy wrappers of a tensor-map kernel and wgmma's fence_proxy_async (the
// fence a thread issues between its shared-memory stores and a bulk copy
// that reads them). They need cTypes.
func WarpSpecializedPrimitives() string {
	return `// ---- warp specialization: named barriers, stage release, register budgets, bulk reduce-add
// named barrier id (0..15) of count threads (a multiple of 32): bar.* take whole warps (.aligned),
// barrier.* let a warp's lanes arrive apart; arrive marks the arrival and does not wait
DEV void bar_sync(u32 id, u32 count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
DEV void bar_arrive(u32 id, u32 count) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
DEV void barrier_sync(u32 id, u32 count) { asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
DEV void barrier_arrive(u32 id, u32 count) { asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
// one arrival on the mbarrier at shared address bar (a consumer releasing a stage)
DEV void mbar_arrive(u32 bar) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory"); }
// the executing warpgroup's per-thread register budget raised (inc) or lowered (dec) to N
// (24..256, a multiple of 8); every warp of the warpgroup executes the same one
template <u32 N> DEV void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <u32 N> DEV void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
// dst[i] += the fp32 at shared address src + 4i, for bytes/4 elements (both 16-byte aligned, bytes a
// multiple of 16), in the thread's open bulk group
DEV void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
// closes the thread's open bulk group
DEV void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// waits until at most N of the thread's bulk groups are pending: complete, or (read) done reading their sources
template <int N> DEV void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }
template <int N> DEV void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
`
}
