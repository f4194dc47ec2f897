package kernels

import (
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestBatchInnerSource checks that a forward variant with a bias on the
// batch-inner grid (Variant.BatchInner) reads its batch element from the
// grid's y and its head from z at every place that derives them — the
// setup, the coordinates recomputed after the main loop, the light-tail
// order and a persistent tile's index — that its name says so, and that
// Validate declines it without a bias.
func TestBatchInnerSource(t *testing.T) {
	full := Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}
	persistent := full
	persistent.Persistent = true
	for _, c := range []struct {
		name string
		v    Variant
		want []string // in the source with BatchInner
		not  []string // in the source without it only
	}{
		{"mma.sync", fwdVariant(t, attn.BFloat16, 64, 64, 16, func(v *Variant) { v.Bias = BiasBF16 }),
			[]string{"int h = blockIdx.z, b = blockIdx.y;", "b = (int)cy;\n    h = (int)cz;"},
			[]string{"int h = blockIdx.y, b = blockIdx.z;", "b = (int)cz;\n    h = (int)cy;"}},
		{"warp-specialized", hopperPipelineVariant(t, full, func(v *Variant) { v.Bias = BiasBF16 }),
			[]string{"int h = blockIdx.z, b = blockIdx.y;", "b = (int)cy;\n    h = (int)cz;"},
			[]string{"int h = blockIdx.y, b = blockIdx.z;"}},
		{"light tail", hopperPipelineVariant(t, full, func(v *Variant) { v.Bias, v.Mask, v.LightTail = BiasBF16, MaskWindow, true }),
			[]string{"int h = pair_ / gridDim.y, b = pair_ % gridDim.y;", "b = pair_ % gridDim.y;\n    h = pair_ / gridDim.y;"},
			[]string{"int h = pair_ % gridDim.y, b = pair_ / gridDim.y;", "b = pair_ / gridDim.y;\n    h = pair_ % gridDim.y;"}},
		{"persistent", hopperPipelineVariant(t, persistent, func(v *Variant) { v.Bias = BiasBF16 }),
			[]string{"int b = hb % p.b, h = hb / p.b;"},
			[]string{"int h = hb % p.h, b = hb / p.h;"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			on := c.v
			on.BatchInner = true
			if err := on.Validate(); err != nil {
				t.Fatalf("%s: %v", on.Name(), err)
			}
			if !strings.HasSuffix(on.Name(), "_bi") || strings.HasSuffix(c.v.Name(), "_bi") {
				t.Errorf("names %s / %s: the batch-inner one should end in _bi, the other not", on.Name(), c.v.Name())
			}
			src, err := on.Source()
			if err != nil {
				t.Fatal(err)
			}
			off, err := c.v.Source()
			if err != nil {
				t.Fatal(err)
			}
			for _, w := range c.want {
				if !strings.Contains(src, w) {
					t.Errorf("%s: no %q", on.Name(), w)
				}
			}
			for _, w := range c.not {
				if strings.Contains(src, w) {
					t.Errorf("%s: still %q", on.Name(), w)
				}
				if !strings.Contains(off, w) {
					t.Errorf("%s: no %q", c.v.Name(), w)
				}
			}
		})
	}
	plain := fwdVariant(t, attn.BFloat16, 64, 64, 16, nil)
	plain.BatchInner = true
	checkValidate(t, plain, attn.ErrUnsupported)
}

// hopperPipelineVariant returns the D = 128 bf16 Hopper forward variant
// with tensor-map loads on pipeline p, edited by edit.
func hopperPipelineVariant(t *testing.T, p Pipeline, edit func(*Variant)) Variant {
	t.Helper()
	v := hopperVariant(t, attn.BFloat16, 128, 128, edit)
	v.TMA, v.Pipeline = true, p
	if err := v.Validate(); err != nil {
		t.Fatalf("%s: %v", v.Name(), err)
	}
	return v
}
