package cp

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/gpu"
)

// gpuRingHarness is the device ring's harness on a GPU: gpuStreams over
// a gpuHarness's operations, its streams closed when the test ends.
type gpuRingHarness struct {
	*gpuStreams
	h *gpuHarness
}

func newGPURingHarness(t *testing.T, b *gpu.Backend) *gpuRingHarness {
	h := newGPUHarness(t, b)
	so := newGPUStreams(h.gpuOps)
	t.Cleanup(func() { // before the harness's own cleanup, which frees the buffers
		if err := so.close(); err != nil {
			t.Error(err)
		}
	})
	return &gpuRingHarness{so, h}
}

func (g *gpuRingHarness) upload(x attn.Tensor) gpu.DeviceTensor   { return g.h.upload(x) }
func (g *gpuRingHarness) download(d gpu.DeviceTensor) attn.Tensor { return g.h.download(d) }
func (g *gpuRingHarness) settle(t *testing.T)                     { g.h.settle(t) }

// TestDeviceRingAPI runs DeviceRing's Forward and Backward against the
// single ForwardDevice and BackwardDevice calls on the same inputs, twice
// each (the second call reuses the ring's buffers and events), and checks
// both against the float64 oracle with the accuracy criterion: zigzag on a
// causal GQA problem with DK ≠ DV and ring on a full one, bf16, P = 2 and
// 4. Skips without a GPU.
func TestDeviceRingAPI(t *testing.T) {
	b := openGPU(t)
	r := rand.New(rand.NewPCG(37, 38))
	dt := attn.BFloat16
	for _, c := range []struct {
		st  Strategy
		tc  accCase
		opt attn.Options
	}{
		{ZigzagStrategy, accCase{"causal-gqa-dk!=dv", 2, 256, 256, 8, 2, 64, 128, attn.Options{}}, attn.Options{Causal: true}},
		{RingStrategy, accCase{"full", 1, 192, 384, 4, 4, 128, 64, attn.Options{}}, attn.Options{}},
	} {
		tc := c.tc
		for _, p := range []int{2, 4} {
			t.Run(fmt.Sprintf("%s/%v/P=%d", tc.name, c.st, p), func(t *testing.T) {
				q := normal(r, dt, tc.b, tc.n, tc.h, tc.dk)
				k := normal(r, dt, tc.b, tc.m, tc.hkv, tc.dk)
				v := normal(r, dt, tc.b, tc.m, tc.hkv, tc.dv)
				dO := normal(r, dt, tc.b, tc.n, tc.h, tc.dv)
				or := newOracle(t, dt, q, k, v, dO, c.opt)
				h := newGPUHarness(t, b)
				dq, dk, dv, ddO := h.upload(q), h.upload(k), h.upload(v), h.upload(dO)
				outs := func() []gpu.DeviceTensor {
					var out []gpu.DeviceTensor
					for _, s := range []outSpec{{dt, []int{tc.b, tc.n, tc.h, tc.dv}}, {attn.Float32, []int{tc.b, tc.h, tc.n}},
						{dt, q.Shape}, {dt, k.Shape}, {dt, v.Shape}} {
						x, err := h.alloc(s.dt, s.shape...)
						if err != nil {
							t.Fatal(err)
						}
						out = append(out, x)
					}
					return out
				}
				check := func(what string, o []gpu.DeviceTensor) {
					t.Helper()
					or.check(t, what, dt, attn.Result{O: h.download(o[0]), LSE: h.download(o[1])},
						attn.Gradients{DQ: h.download(o[2]), DK: h.download(o[3]), DV: h.download(o[4])})
				}
				single := outs()
				if err := errors.Join(h.forward(dq, dk, dv, single[0], single[1], c.opt),
					h.backward(dq, dk, dv, single[0], single[1], ddO, single[2], single[3], single[4], c.opt)); err != nil {
					t.Fatal(err)
				}
				check("single", single)
				d, err := NewDeviceRing(b, c.st, p, dq, dk, dv, c.opt)
				if err != nil {
					t.Fatal(err)
				}
				defer d.Close()
				for rep := range 2 {
					o := outs()
					if err := errors.Join(d.Forward(dq, dk, dv, o[0], o[1]), d.Backward(dq, dk, dv, o[0], o[1], ddO, o[2], o[3], o[4])); err != nil {
						t.Fatal(err)
					}
					if err := d.Stream().Synchronize(); err != nil {
						t.Fatal(err)
					}
					check(fmt.Sprintf("ring call %d", rep+1), o)
				}
				if err := d.Forward(dq, dk, dv, single[2], single[1]); !errors.Is(err, attn.ErrShape) {
					t.Errorf("O of dQ's shape: %v, want ErrShape", err)
				}
			})
		}
	}
}

// TestSimOnDevice runs Sim with OnDevice on the CUDA backend (each call a
// DeviceRing over host tensors) for the device split's cases in bf16, ring
// and zigzag on P = 1 … 4, and checks outputs and gradients against the
// float64 oracle with the accuracy criterion. Skips without a GPU.
func TestSimOnDevice(t *testing.T) {
	b := openGPU(t)
	r := rand.New(rand.NewPCG(39, 40))
	dt := attn.BFloat16
	for _, tc := range devCases() {
		t.Run(tc.name, func(t *testing.T) {
			q := normal(r, dt, tc.b, tc.n, tc.h, tc.dk)
			k := normal(r, dt, tc.b, tc.m, tc.hkv, tc.dk)
			v := normal(r, dt, tc.b, tc.m, tc.hkv, tc.dv)
			dO := normal(r, dt, tc.b, tc.n, tc.h, tc.dv)
			checkSplitsOn(t, b, []variant{{Ring, Contiguous, true}, {Ring, Zigzag, true}}, dt, q, k, v, dO, tc.opt, []int{1, 2, 3, 4})
		})
	}
}
