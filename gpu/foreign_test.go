package gpu

import (
	"runtime"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// rawDriver calls libcuda.so.1 directly through purego, as a program with
// its own CUDA bindings would: nothing in it goes through package cuda.
type rawDriver struct {
	t   *testing.T
	fns map[string]uintptr
}

func loadRawDriver(t *testing.T) *rawDriver {
	t.Helper()
	h, err := purego.Dlopen("libcuda.so.1", purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		t.Skipf("no libcuda.so.1: %v", err)
	}
	d := &rawDriver{t: t, fns: map[string]uintptr{}}
	for _, name := range []string{"cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2", "cuCtxSetCurrent",
		"cuStreamCreate", "cuStreamDestroy_v2", "cuStreamSynchronize", "cuMemAlloc_v2", "cuMemFree_v2",
		"cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemsetD8_v2"} {
		fn, err := purego.Dlsym(h, name)
		if err != nil {
			t.Fatalf("libcuda.so.1 lacks %s: %v", name, err)
		}
		d.fns[name] = fn
	}
	return d
}

// call runs a driver function and fails the test on a non-zero CUresult.
func (d *rawDriver) call(name string, args ...uintptr) {
	d.t.Helper()
	r, _, _ := purego.SyscallN(d.fns[name], args...)
	if int32(r) != 0 {
		d.t.Fatalf("%s: CUresult %d", name, int32(r))
	}
}

// alloc allocates device memory with cuMemAlloc and frees it at the test's end.
func (d *rawDriver) alloc(bytes int) uint64 {
	d.t.Helper()
	var p uint64
	d.call("cuMemAlloc_v2", uintptr(unsafe.Pointer(&p)), uintptr(max(bytes, 1)))
	d.t.Cleanup(func() { d.call("cuMemFree_v2", uintptr(p)) })
	return p
}

// TestForeignMemoryGraph runs a whole training step, forward and backward,
// on memory, a stream and a context that the test created through raw
// driver calls (not flashattn's allocator), with q read through strides
// from a [B, H, N, D] buffer; checks the gradients against the float64
// reference; captures the step in a CUDA graph on the caller's stream and
// replays it over poisoned outputs, bit-identically.
func TestForeignMemoryGraph(t *testing.T) {
	fwdBackend(t) // skips without a GPU
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	raw := loadRawDriver(t)
	var dev int32
	var ctx, stream uintptr
	raw.call("cuDeviceGet", uintptr(unsafe.Pointer(&dev)), 0)
	raw.call("cuDevicePrimaryCtxRetain", uintptr(unsafe.Pointer(&ctx)), uintptr(dev))
	defer raw.call("cuDevicePrimaryCtxRelease_v2", uintptr(dev))
	raw.call("cuCtxSetCurrent", ctx)
	raw.call("cuStreamCreate", uintptr(unsafe.Pointer(&stream)), 1) // CU_STREAM_NON_BLOCKING
	defer raw.call("cuStreamDestroy_v2", stream)

	cdev, err := cuda.OpenContext(ctx)
	if err != nil {
		t.Fatalf("OpenContext: %v", err)
	}
	defer cdev.Close()
	b, err := New(cdev)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	s, err := cdev.BorrowStream(stream)
	if err != nil {
		t.Fatal(err)
	}

	const dt = attn.BFloat16
	c := bwdCase{name: "foreign", b: 2, n: 200, m: 200, h: 4, hkv: 2, dk: 64, dv: 64, causal: true, dropout: 0.1, deterministic: true}
	in := c.inputs(t, dt, 41)
	// q lives as [B, H, N, D] in the caller's memory and is viewed as [B, N, H, D]
	qBHSD, err := attn.ToBHSD(in.q)
	if err != nil {
		t.Fatal(err)
	}
	qImage := qBHSD.Bytes()
	qStrides := []int{c.h * c.n * c.dk, c.dk, c.n * c.dk, 1}
	type foreign struct {
		t   DeviceTensor
		ptr uint64
		n   int // bytes
	}
	place := func(dt attn.DType, shape, strides []int, data []byte) foreign {
		n := attn.NumElements(shape) * dt.Size()
		p := raw.alloc(n)
		if data != nil {
			raw.call("cuMemcpyHtoD_v2", uintptr(p), uintptr(unsafe.Pointer(&data[0])), uintptr(len(data)))
		}
		ft, err := TensorAt(cdev, p, dt, shape, strides)
		if err != nil {
			t.Fatalf("TensorAt: %v", err)
		}
		return foreign{ft, p, n}
	}
	q := place(dt, in.q.Shape, qStrides, qImage)
	k, v, dO := place(dt, in.k.Shape, nil, in.k.Bytes()), place(dt, in.v.Shape, nil, in.v.Bytes()), place(dt, in.dO.Shape, nil, in.dO.Bytes())
	o := place(dt, in.p.OutputShape(), nil, nil)
	lse := place(attn.Float32, in.p.LSEShape(), nil, nil)
	dq := place(dt, in.q.Shape, qStrides, nil) // dQ in q's layout
	dk, dv := place(dt, in.k.Shape, nil, nil), place(dt, in.v.Shape, nil, nil)

	fopt := DeviceOptions{Options: in.opt}
	if need, err := b.PrepareForward(q.t, k.t, v.t, o.t, lse.t, fopt); err != nil || need != 0 {
		t.Fatalf("PrepareForward: %d bytes of staging, %v", need, err)
	}
	bopt := BackwardOptions{DeviceOptions: fopt}
	algo, wsBytes, err := b.PrepareBackward(q.t, k.t, v.t, o.t, lse.t, dO.t, dq.t, dk.t, dv.t, bopt)
	if err != nil {
		t.Fatalf("PrepareBackward: %v", err)
	}
	if bopt.Workspace, err = cdev.BorrowBuffer(raw.alloc(int(wsBytes)), max(wsBytes, 1)); err != nil {
		t.Fatal(err)
	}
	bopt.DQ = algo
	step := func() {
		if err := b.ForwardDevice(s, q.t, k.t, v.t, o.t, lse.t, fopt); err != nil {
			t.Fatalf("ForwardDevice: %v", err)
		}
		if _, err := b.BackwardDevice(s, q.t, k.t, v.t, o.t, lse.t, dO.t, dq.t, dk.t, dv.t, bopt); err != nil {
			t.Fatalf("BackwardDevice: %v", err)
		}
	}
	outs := []foreign{o, lse, dq, dk, dv}
	read := func() [][]byte {
		raw.call("cuStreamSynchronize", stream)
		got := make([][]byte, len(outs))
		for i, x := range outs {
			got[i] = make([]byte, x.n)
			raw.call("cuMemcpyDtoH_v2", uintptr(unsafe.Pointer(&got[i][0])), uintptr(x.ptr), uintptr(x.n))
		}
		return got
	}
	poison := func() {
		for _, x := range outs {
			raw.call("cuMemsetD8_v2", uintptr(x.ptr), bwdPoison, uintptr(x.n))
		}
	}
	poison()
	step()
	eager := read()

	ref, naive := in.oracles(t)
	dqView := tensorFromBytes(dt, eager[2], []int{c.b, c.h, c.n, c.dk})
	dqBSHD, err := attn.BHSD(dqView)
	if err != nil {
		t.Fatal(err)
	}
	checkGrad(t, "dQ", dt, dqBSHD, ref.DQ, naive.DQ)
	checkGrad(t, "dK", dt, tensorFromBytes(dt, eager[3], in.k.Shape), ref.DK, naive.DK)
	checkGrad(t, "dV", dt, tensorFromBytes(dt, eager[4], in.v.Shape), ref.DV, naive.DV)

	graph := captureGraph(t, s, step)
	defer graph.Close()
	checkReplays(t, s, graph, 3, poison, read, eager)
	t.Logf("forward and backward on caller-owned memory and stream, dQ %v, 3 graph replays bit-identical", algo)
}
