package kernels

import (
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestBwdLightTailSource checks the light-tail CTA order's place in the
// backward sources: with LightTail the dK/dV kernel takes its key block
// and the dQ kernel its query block (reversed) from cta_order,
// which reads the SM count inside the primitives block, on the mma.sync,
// Hopper and warp-specialized key-rows kernels alike; without it the grid
// gives them; an unmasked variant refuses it.
func TestBwdLightTailSource(t *testing.T) {
	causal := Features{Mask: MaskWindow} // (a causal mask is a window at run time)
	cases := []struct {
		name string
		v    BwdVariant
	}{
		{"mma.sync separate", BwdVariant{DType: attn.BFloat16, DK: 64, DV: 64, Features: causal, Vector: true}},
		{"mma.sync fp32 atomic", BwdVariant{DType: attn.Float32, DK: 40, DV: 40, Features: causal, Vector: true, AtomicDQ: true}},
		{"hopper separate", BwdVariant{DType: attn.Float16, DK: 128, DV: 128, Features: causal, Vector: true, WGMMA: true}},
		{"key rows bulk", BwdVariant{DType: attn.BFloat16, DK: 128, DV: 128, Features: causal, Vector: true, WGMMA: true, TMA: true,
			AtomicDQ: true, BulkDQ: true, WarpSpecialized: true, KeyRows: true}},
		{"deep", BwdVariant{DType: attn.BFloat16, DK: 320, DV: 320, Features: causal, Vector: true, WGMMA: true}},
	}
	for _, c := range cases {
		if err := c.v.Validate(); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		plain, err := c.v.Source()
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if strings.Contains(plain, "cta_order") || strings.Contains(plain, "%nsmid") {
			t.Errorf("%s: the grid order's source names cta_order or %%nsmid", c.name)
		}
		w := c.v
		w.LightTail = true
		if err := w.Validate(); err != nil {
			t.Fatalf("%s light tail: %v", c.name, err)
		}
		src, err := w.Source()
		if err != nil {
			t.Fatalf("%s light tail: %v", c.name, err)
		}
		i, j := strings.Index(src, PrimitivesBegin), strings.Index(src, PrimitivesEnd)
		if k := strings.Index(src, "%%nsmid"); k < i || k > j || i < 0 {
			t.Errorf("%s: %%nsmid outside the primitives block", c.name)
		}
		for _, want := range []string{"DEV void cta_order(int& pair, int& blk)", "cta_order(pair_, blk_);", "kvh = pair_ / gridDim.y, j0 = blk_ * BN;"} {
			if !strings.Contains(src, want) {
				t.Errorf("%s: source lacks %q", c.name, want)
			}
		}
		if !strings.Contains(src, "i0 = (gridDim.x - 1 - blk_) * BM;") {
			t.Errorf("%s: the dQ kernel does not take its query block, reversed, from cta_order", c.name)
		}
		if strings.Contains(src, "blockIdx.x * BN") || strings.Contains(src, "blockIdx.x * BM") {
			t.Errorf("%s: a kernel still takes its block from the grid", c.name)
		}
		if !strings.Contains(w.Name(), "_lt") {
			t.Errorf("%s: name %s lacks _lt", c.name, w.Name())
		}
	}
	wantUnsupported(t, map[string]BwdVariant{"unmasked light tail": {DType: attn.BFloat16, DK: 64, DV: 64, Vector: true, LightTail: true}})
}

// TestFwdLightTailSource checks the light-tail order in the forward
// sources: with LightTail the CTA's query block, head and batch element
// come from cta_order (the query blocks last first) where the kernel
// starts, where it derives them again after the main loop and where the
// mask finds its rows, on the mma.sync, Hopper lockstep and
// warp-specialized kernels; without it the grid gives them; a variant
// without a mask or with persistent CTAs refuses it.
func TestFwdLightTailSource(t *testing.T) {
	causal := func(v *Variant) { v.Mask = MaskWindow }
	ws := hopperVariant(t, attn.BFloat16, 128, 128, causal)
	ws.TMA, ws.Pipeline = true, Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}
	for name, v := range map[string]Variant{
		"mma.sync":         fwdVariant(t, attn.Float16, 64, 64, 16, causal),
		"mma.sync fp32":    fwdVariant(t, attn.Float32, 40, 40, 16, func(v *Variant) { v.Mask, v.Dropout = MaskWindow, true }),
		"hopper lockstep":  hopperVariant(t, attn.BFloat16, 256, 256, causal),
		"warp-specialized": ws,
		"hopper varlen":    hopperVariant(t, attn.BFloat16, 64, 64, func(v *Variant) { v.Mask, v.Varlen = MaskWindow, true }),
	} {
		plain, err := v.Source()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		// the grid's coordinates, read where the kernel starts and afresh after the main loop and in the mask
		grid := []string{"mblk = gridDim.x - 1 - blockIdx.x", "cx = ctaid_x()"}
		for _, g := range grid {
			if !strings.Contains(plain, g) {
				t.Errorf("%s: the grid order's source lacks %q", name, g)
			}
		}
		if strings.Contains(plain, "cta_order") {
			t.Errorf("%s: the grid order's source names cta_order", name)
		}
		v.LightTail = true
		if err := v.Validate(); err != nil {
			t.Fatalf("%s light tail: %v", name, err)
		}
		src, err := v.Source()
		if err != nil {
			t.Fatalf("%s light tail: %v", name, err)
		}
		if n := strings.Count(src, "cta_order(pair_, blk_);"); n < 3 {
			t.Errorf("%s: cta_order called %d times, want at least 3 (setup, coordinates again, mask rows)", name, n)
		}
		for _, want := range []string{"DEV void cta_order(int& pair, int& blk)", "const int mblk = gridDim.x - 1 - blk_;", "m0 = (gridDim.x - 1 - blk_) * BM;", "const int irow = (int)(gridDim.x - 1 - blk_) * BM"} {
			if !strings.Contains(src, want) {
				t.Errorf("%s: source lacks %q", name, want)
			}
		}
		for _, g := range grid {
			if strings.Contains(src, g) {
				t.Errorf("%s: the kernel still derives its coordinates from the grid (%q)", name, g)
			}
		}
		if !strings.HasSuffix(v.Name(), "_lt") {
			t.Errorf("%s: name %s lacks _lt", name, v.Name())
		}
	}
	pt := ws
	pt.Persistent, pt.LightTail = true, true
	plain := hopperVariant(t, attn.BFloat16, 128, 128, nil)
	plain.LightTail = true
	wantUnsupported(t, map[string]Variant{"persistent": pt, "unmasked": plain})
}
