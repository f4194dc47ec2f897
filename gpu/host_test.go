package gpu

import (
	"bytes"
	"math"
	"math/rand/v2"
	"runtime/debug"
	"slices"
	"sync"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestHostIntoLayouts checks the host path's outputs in every layout it
// handles — contiguous, a dense permutation (a [B, H, N, D] buffer viewed
// as [B, N, H, D]: copied back as a span) and a sparse view (a slice of a
// larger buffer: scattered) — and inputs whose feature dim is not
// innermost (gathered), against the allocating forms, bit for bit, over
// pool buffers poisoned before every use.
func TestHostIntoLayouts(t *testing.T) {
	b := fwdBackend(t)
	b.pool.poison = true
	defer func() { b.pool.poison = false }()
	rng := rand.New(rand.NewPCG(8, 9))
	const dt = attn.BFloat16
	const B, N, H, D = 2, 150, 4, 64
	q, k, v, dO := randTensor(rng, dt, 1, B, N, H, D), randTensor(rng, dt, 1, B, N, H, D), randTensor(rng, dt, 1, B, N, H, D), randTensor(rng, dt, 1, B, N, H, D)
	opt := attn.Options{Causal: true, Deterministic: true}
	want, wantG := hostStep(t, b, q, k, v, dO, opt)
	layouts := map[string]func(dt attn.DType, shape ...int) attn.Tensor{
		"contiguous": func(dt attn.DType, shape ...int) attn.Tensor { return attn.New(dt, shape...) },
		"dense permuted": func(dt attn.DType, shape ...int) attn.Tensor {
			if len(shape) != 4 {
				return attn.New(dt, shape...)
			}
			x, err := attn.BHSD(attn.New(dt, shape[0], shape[2], shape[1], shape[3]))
			if err != nil {
				t.Fatal(err)
			}
			return x
		},
		"sparse view": func(dt attn.DType, shape ...int) attn.Tensor {
			// every other element of the last dim of a buffer twice as wide, offset by 3
			big := append(append([]int(nil), shape[:len(shape)-1]...), 2*shape[len(shape)-1]+3)
			x := attn.New(dt, big...)
			x.Shape = append([]int(nil), shape...)
			x.Strides = attn.ContiguousStrides(big)
			x.Strides[len(x.Strides)-1] = 2
			x.Offset = 3
			return x
		},
	}
	for name, alloc := range layouts {
		t.Run(name, func(t *testing.T) {
			res := attn.Result{O: alloc(dt, want.O.Shape...), LSE: alloc(attn.Float32, want.LSE.Shape...)}
			res.O.Fill(float32(math.NaN()))
			if err := b.ForwardInto(q, k, v, res, opt); err != nil {
				t.Fatalf("ForwardInto: %v", err)
			}
			g := attn.Gradients{DQ: alloc(dt, q.Shape...), DK: alloc(dt, k.Shape...), DV: alloc(dt, v.Shape...)}
			if err := b.BackwardInto(q, k, v, res.O, res.LSE, dO, g, opt); err != nil {
				t.Fatalf("BackwardInto: %v", err)
			}
			sameStep(t, "the allocating form's", res, g, want, wantG)
		})
	}
	t.Run("feature dim outer inputs", func(t *testing.T) {
		// q held as [B, N, D, H] and viewed as [B, N, H, D]: feature stride H
		qt, err := attn.Permute(attn.New(dt, B, N, D, H), 0, 1, 3, 2)
		if err != nil {
			t.Fatal(err)
		}
		if err := attn.CopyInto(qt, q); err != nil {
			t.Fatal(err)
		}
		got, err := b.Forward(qt, k, v, opt)
		if err != nil {
			t.Fatalf("Forward: %v", err)
		}
		if !bytes.Equal(got.O.Bytes(), want.O.Bytes()) || !bytes.Equal(got.LSE.Bytes(), want.LSE.Bytes()) {
			t.Errorf("forward of a feature-outer q differs from the contiguous one")
		}
		gg, err := b.Backward(qt, k, v, got.O, got.LSE, dO, opt)
		if err != nil {
			t.Fatalf("Backward: %v", err)
		}
		if !bytes.Equal(gg.DQ.Bytes(), wantG.DQ.Bytes()) || !bytes.Equal(gg.DK.Bytes(), wantG.DK.Bytes()) {
			t.Errorf("backward of a feature-outer q differs from the contiguous one")
		}
		if gg.DQ.Strides[3] != qt.Strides[3] {
			t.Errorf("dQ strides %v, want q's memory order %v", gg.DQ.Strides, qt.Strides)
		}
	})
	if b.CachedBytes() == 0 {
		t.Errorf("the host path cached no device memory")
	}
	b.ReleaseCache()
	if b.CachedBytes() != 0 {
		t.Errorf("ReleaseCache left %d bytes cached", b.CachedBytes())
	}
}

// hostStep runs the host-tensor forward of q, k, v and the backward of dO.
func hostStep(t *testing.T, b *Backend, q, k, v, dO attn.Tensor, opt attn.Options) (attn.Result, attn.Gradients) {
	t.Helper()
	res, err := b.Forward(q, k, v, opt)
	if err != nil {
		t.Fatal(err)
	}
	g, err := b.Backward(q, k, v, res.O, res.LSE, dO, opt)
	if err != nil {
		t.Fatal(err)
	}
	return res, g
}

// sameStep reports each of O, LSE, dQ, dK and dV that differs, bit for
// bit, from the one of the step named what.
func sameStep(t *testing.T, what string, res attn.Result, g attn.Gradients, want attn.Result, wantG attn.Gradients) {
	t.Helper()
	for _, x := range []struct {
		name      string
		got, want attn.Tensor
	}{{"O", res.O, want.O}, {"LSE", res.LSE, want.LSE}, {"dQ", g.DQ, wantG.DQ}, {"dK", g.DK, wantG.DK}, {"dV", g.DV, wantG.DV}} {
		if !bytes.Equal(x.got.Bytes(), x.want.Bytes()) {
			t.Errorf("%s differs from %s", x.name, what)
		}
	}
}

// TestAllocLate checks the late outputs: each in its header's dtype, shape
// and memory order, all zero, whatever their size against the pages and
// chunks that prefault touches.
func TestAllocLate(t *testing.T) {
	like := func(dt attn.DType, shape []int, strides []int) attn.Tensor {
		h := header(dt, shape)
		if strides != nil {
			h.Strides = strides
		}
		return h
	}
	hs := []attn.Tensor{
		like(attn.BFloat16, []int{3, 5, 7}, nil),
		like(attn.Float32, []int{1, 2049}, nil),
		like(attn.Float16, []int{2, 4096, 3, 333}, []int{4096 * 3 * 333, 333, 4096 * 333, 1}), // [B, H, N, D] memory order
		like(attn.Float32, []int{prefaultChunk/4 + 3}, nil),
		like(attn.BFloat16, []int{0, 4}, nil),
	}
	ts := allocLate(hs...).wait()
	for i, h := range hs {
		got := ts[i]
		if got.DType != h.DType || !slices.Equal(got.Shape, h.Shape) || !slices.Equal(got.Strides, attn.StridesLike(h)) {
			t.Fatalf("output %d: %v %v strides %v, want %v %v strides %v", i, got.DType, got.Shape, got.Strides, h.DType, h.Shape, attn.StridesLike(h))
		}
		if err := got.CheckLayout("out"); err != nil {
			t.Fatalf("output %d: %v", i, err)
		}
		if slices.ContainsFunc(got.F32, func(x float32) bool { return x != 0 }) || slices.ContainsFunc(got.Bits, func(x uint16) bool { return x != 0 }) {
			t.Errorf("output %d is not all zero", i)
		}
	}
}

// BenchmarkDrainFreshOutput times what the host path does with an output
// once its kernels have run: fill a freshly allocated host tensor (64 MiB
// of bf16, the demo's dQ) from pinned staging, here plain memory, on two
// goroutines. The heap is returned to the system before each allocation,
// so the output's pages are fresh, as after the runtime's scavenger ran;
// the allocation and its page touches run outside the timer, as they run
// beside the uploads and kernels on the host path.
func BenchmarkDrainFreshOutput(b *testing.B) {
	h := header(attn.BFloat16, []int{4, 4096, 16, 128})
	src := make([]uint16, h.NumElements())
	for i := range src {
		src[i] = uint16(i)
	}
	b.SetBytes(int64(2 * len(src)))
	for b.Loop() {
		b.StopTimer()
		debug.FreeOSMemory()
		out := allocLate(h).wait()[0]
		b.StartTimer()
		var wg sync.WaitGroup
		for w := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				lo, hi := w*len(src)/2, (w+1)*len(src)/2
				copy(out.Bits[lo:hi], src[lo:hi])
			}()
		}
		wg.Wait()
	}
}

// TestHostRegister checks the direct host path (Backend.HostRegister: the
// caller's memory page-locked and copied in place, in parts of 64 KiB here)
// against the staged one, bit for bit: tensors of their own, q, k, v and
// dO carved out of one backing array at offsets that share pages between
// them, and a k whose pages the caller locked itself (which the direct
// path must stage, and whose registration outlives the call). No page
// stays locked after a call (the inputs are unlocked while the kernels
// run, the outputs at the end).
func TestHostRegister(t *testing.T) {
	b := fwdBackend(t)
	defer func(on bool, chunk int) { b.HostRegister, b.copier.chunk = on, chunk }(b.HostRegister, b.copier.chunk)
	rng := rand.New(rand.NewPCG(10, 11))
	const dt = attn.BFloat16
	const B, N, H, D = 2, 700, 4, 64 // 700 KiB a tensor: above directMin, in 11 parts
	shape := []int{B, N, H, D}
	q, k, v, dO := randTensor(rng, dt, 1, shape...), randTensor(rng, dt, 1, shape...), randTensor(rng, dt, 1, shape...), randTensor(rng, dt, 1, shape...)
	opt := attn.Options{Causal: true, Deterministic: true}
	b.HostRegister = false
	want, wantG := hostStep(t, b, q, k, v, dO, opt)
	b.HostRegister, b.copier.chunk = true, 64<<10

	// one backing array, the tensors 5 elements apart: neighbours share a page
	packed := packedTensors(q, k, v, dO)
	cases := map[string]func(t *testing.T) (attn.Result, attn.Gradients){
		"own tensors": func(t *testing.T) (attn.Result, attn.Gradients) { return hostStep(t, b, q, k, v, dO, opt) },
		"shared pages": func(t *testing.T) (attn.Result, attn.Gradients) {
			return hostStep(t, b, packed[0], packed[1], packed[2], packed[3], opt)
		},
		"caller-registered k": func(t *testing.T) (attn.Result, attn.Gradients) {
			r, err := b.dev.RegisterHost(hostSpan(k))
			if err != nil {
				t.Fatalf("RegisterHost: %v", err)
			}
			res, g := hostStep(t, b, q, k, v, dO, opt)
			if err := r.Unregister(); err != nil {
				t.Errorf("the caller's registration after the call: %v", err)
			}
			return res, g
		},
	}
	for name, step := range cases {
		t.Run(name, func(t *testing.T) {
			res, g := step(t)
			sameStep(t, "the staged path's", res, g, want, wantG)
			if len(b.copier.registered) != 0 || b.copier.inputsMarked {
				t.Errorf("%d registrations left after the call (inputs marked %v)", len(b.copier.registered), b.copier.inputsMarked)
			}
			if b.copier.refused {
				t.Errorf("the driver refused to lock Go memory")
			}
		})
	}
}

// TestHostPin checks the backend's pins (Backend.Pin): a step through the
// Into forms on pinned inputs and outputs, bit for bit the staged step's,
// copies nothing through the staging slots (HostCall.Staged 0, its bytes
// over the link as before); tensors sharing a backing array and pages pin
// together; memory the caller locked itself is refused with nothing left
// locked; after Unpin the copies stage again, and a second Unpin is nil.
func TestHostPin(t *testing.T) {
	b := fwdBackend(t)
	rng := rand.New(rand.NewPCG(12, 13))
	const dt = attn.BFloat16
	const B, N, H, D = 2, 700, 4, 64
	shape := []int{B, N, H, D}
	q, k, v, dO := randTensor(rng, dt, 1, shape...), randTensor(rng, dt, 1, shape...), randTensor(rng, dt, 1, shape...), randTensor(rng, dt, 1, shape...)
	opt := attn.Options{Causal: true, Deterministic: true}
	want, wantG := hostStep(t, b, q, k, v, dO, opt)

	// q, k, v and dO carved out of one backing array, 5 elements apart, and outputs of their own
	in := packedTensors(q, k, v, dO)
	res := attn.Result{O: attn.New(dt, want.O.Shape...), LSE: attn.New(want.LSE.DType, want.LSE.Shape...)}
	g := attn.Gradients{DQ: attn.New(dt, shape...), DK: attn.New(dt, shape...), DV: attn.New(dt, shape...)}
	step := func(t *testing.T) []HostCall {
		t.Helper()
		tr := &HostTrace{}
		b.SetHostTrace(tr)
		defer b.SetHostTrace(nil)
		if err := b.ForwardInto(in[0], in[1], in[2], res, opt); err != nil {
			t.Fatal(err)
		}
		if err := b.BackwardInto(in[0], in[1], in[2], res.O, res.LSE, in[3], g, opt); err != nil {
			t.Fatal(err)
		}
		sameStep(t, "the staged step's", res, g, want, wantG)
		return tr.Calls()
	}
	pin, err := b.Pin(in[0], in[1], in[2], in[3], res.O, res.LSE, g.DQ, g.DK, g.DV)
	if err != nil {
		t.Fatalf("Pin: %v", err)
	}
	for _, c := range step(t) {
		if c.Staged != 0 || c.ToDevice == 0 || c.FromDevice == 0 {
			t.Errorf("%s, pinned: %d of %d bytes in and %d out staged, want 0", c.Op, c.Staged, c.ToDevice, c.FromDevice)
		}
	}
	if err := pin.Unpin(); err != nil {
		t.Fatalf("Unpin: %v", err)
	}
	if err := pin.Unpin(); err != nil {
		t.Errorf("second Unpin: %v", err)
	}
	if len(b.copier.pins) != 0 {
		t.Errorf("%d pins left after Unpin", len(b.copier.pins))
	}
	for _, c := range step(t) {
		if c.Staged != c.ToDevice+c.FromDevice {
			t.Errorf("%s, unpinned: %d of %d bytes staged, want all", c.Op, c.Staged, c.ToDevice+c.FromDevice)
		}
	}

	// memory the caller locked itself: refused, nothing of the pin left
	r, err := b.dev.RegisterHost(hostSpan(k))
	if err != nil {
		t.Fatalf("RegisterHost: %v", err)
	}
	defer r.Unregister()
	if p, err := b.Pin(q, k); err == nil {
		p.Unpin()
		t.Errorf("Pin of memory the caller locked: no error")
	}
	if len(b.copier.pins) != 0 {
		t.Errorf("%d pins left after a refused Pin", len(b.copier.pins))
	}
}

// packedTensors returns copies of 16-bit contiguous tensors ts carved out
// of one backing array, 5 elements apart (3 before the first), so that
// neighbours share a page.
func packedTensors(ts ...attn.Tensor) []attn.Tensor {
	total := 3
	for _, x := range ts {
		total += x.NumElements() + 5
	}
	backing := make([]uint16, total)
	out := make([]attn.Tensor, len(ts))
	off := 3
	for i, x := range ts {
		copy(backing[off:], x.Bits)
		out[i] = attn.Tensor{DType: x.DType, Shape: slices.Clone(x.Shape), Bits: backing, Offset: off}
		off += x.NumElements() + 5
	}
	return out
}

// TestHostRates checks that the host side's rates come back measured:
// positive and finite each way, and the page-locking of Go memory.
func TestHostRates(t *testing.T) {
	b := fwdBackend(t)
	r, err := b.HostRates()
	if err != nil {
		t.Fatalf("HostRates: %v", err)
	}
	for name, x := range map[string]float64{"to pinned": r.ToPinned, "from pinned": r.FromPinned, "register": r.Register, "unregister": r.Unregister} {
		if !(x > 0) || math.IsInf(x, 0) {
			t.Errorf("%s: %v bytes/s", name, x)
		}
	}
	t.Logf("Go→pinned %.1f GB/s, pinned→Go %.1f GB/s, page-locking %.1f GB/s, unlocking %.1f GB/s", r.ToPinned/1e9, r.FromPinned/1e9, r.Register/1e9, r.Unregister/1e9)
}
