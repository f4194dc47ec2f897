package cp

import (
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/gpu"
)

// gpuHarness is the device split's harness on a GPU: gpuOps on a stream
// of its own, global tensors uploaded and downloaded through the backend.
type gpuHarness struct {
	*gpuOps
	t *testing.T
}

// openGPU opens the GPU backend, skipping t without a GPU.
func openGPU(t *testing.T) *gpu.Backend {
	t.Helper()
	b, err := gpu.Open()
	if err != nil {
		if cuda.Unavailable(err) {
			t.Skipf("no GPU: %v", err)
		}
		t.Fatalf("gpu.Open: %v", err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// newGPUHarness returns a harness on b whose buffers are freed when t ends.
func newGPUHarness(t *testing.T, b *gpu.Backend) *gpuHarness {
	s, err := b.Device().NewStreamNonBlocking()
	if err != nil {
		t.Fatal(err)
	}
	h := &gpuHarness{gpuOps: &gpuOps{b: b, s: s}, t: t}
	t.Cleanup(func() {
		if err := s.Synchronize(); err != nil {
			t.Error(err)
		}
		h.free()
		s.Close()
	})
	return h
}

func (h *gpuHarness) upload(x attn.Tensor) gpu.DeviceTensor {
	h.t.Helper()
	d, err := h.b.Upload(x)
	if err != nil {
		h.t.Fatal(err)
	}
	h.owned = append(h.owned, d)
	return d
}

// settle waits for the harness's stream and reports its error.
func (h *gpuHarness) settle(t *testing.T) {
	t.Helper()
	if err := h.s.Synchronize(); err != nil {
		t.Error(err)
	}
}

func (h *gpuHarness) download(d gpu.DeviceTensor) attn.Tensor {
	h.t.Helper()
	x, err := h.b.Download(h.s, d)
	if err != nil {
		h.t.Fatal(err)
	}
	return x
}

// TestDeviceSplitOnCUDA runs the device split on the GPU (ForwardDevice
// and BackwardDevice on views of the ranks' shards, the merge kernels) for
// the cases of TestDeviceSplitOnHost in bf16 and fp32 on P = 1 … 4, on one
// stream and as the device ring runs it (every rank's calls and merge
// kernels on its compute stream, the K/V blocks and dK/dV accumulators
// copied device to device on its communication stream, events between
// them), and checks its outputs and gradients, and the single calls', with
// the accuracy criterion against the float64 oracle. Skips without a GPU.
func TestDeviceSplitOnCUDA(t *testing.T) {
	b := openGPU(t)
	for _, c := range []struct {
		name string
		newH func(t *testing.T) devHarness
		mk   splitMaker
	}{
		{"one-stream", func(t *testing.T) devHarness { return newGPUHarness(t, b) }, oneStream},
		{"ring", func(t *testing.T) devHarness { return newGPURingHarness(t, b) }, ringStreams},
	} {
		t.Run(c.name, func(t *testing.T) {
			checkDevSplits(t, c.newH, c.mk, []attn.DType{attn.BFloat16, attn.Float32}, []int{1, 2, 3, 4})
		})
	}
}

// TestMeasureDeviceSplit measures a small causal problem split by zigzag
// over 2 and 4 ranks, forward and backward, and checks the report: every
// time positive (the device ring's, captured across its streams, too),
// the counts those of the plan. Skips without a GPU.
func TestMeasureDeviceSplit(t *testing.T) {
	b := openGPU(t)
	r := rand.New(rand.NewPCG(29, 30))
	h := newGPUHarness(t, b)
	q := h.upload(normal(r, attn.BFloat16, 1, 512, 4, 64))
	k := h.upload(normal(r, attn.BFloat16, 1, 512, 2, 64))
	v := h.upload(normal(r, attn.BFloat16, 1, 512, 2, 64))
	dO := h.upload(normal(r, attn.BFloat16, 1, 512, 4, 64))
	opt := attn.Options{Causal: true}
	for _, p := range []int{2, 4} {
		for _, backward := range []bool{false, true} {
			d, err := MeasureDeviceSplit(b, ZigzagStrategy, p, backward, q, k, v, dO, opt, 3)
			if err != nil {
				t.Fatalf("P=%d backward=%v: %v", p, backward, err)
			}
			t.Logf("P=%d backward=%v: single %.4g ms, attention %.4g ms, merges %.4g ms, total %.4g ms (%.3f×), ring %.4g ms (%.4g ms a rank's step), %d calls, %d merge kernels",
				p, backward, d.SingleMs, d.AttentionMs, d.MergeMs, d.TotalMs, d.Ratio(), d.RingMs, d.RingStepMs(), d.Calls, d.Merges)
			gp := &attn.Problem{B: 1, N: 512, M: 512, H: 4, Hkv: 2, DK: 64, DV: 64, Opt: opt}
			gp.ResolveMask()
			plan, err := devPlan(gp, Zigzag, p)
			if err != nil {
				t.Fatal(err)
			}
			tasks := 0
			for _, steps := range plan {
				for _, s := range steps {
					tasks += len(s.tasks)
				}
			}
			merges := p // the forward: a combine per rank
			if backward {
				merges = 6*p + 3*tasks
			}
			if d.Calls != tasks || d.Merges != merges || d.P != p || d.Backward != backward || d.Repeats != 3 {
				t.Errorf("P=%d backward=%v: report %+v; want %d calls, %d merge kernels", p, backward, d, tasks, merges)
			}
			if !(d.SingleMs > 0 && d.AttentionMs > 0 && d.MergeMs > 0 && d.TotalMs > 0 && d.RingMs > 0) {
				t.Errorf("P=%d backward=%v: times %+v", p, backward, d)
			}
		}
	}
}
