package kernels

import (
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestBwdPersistentSource checks the persistent dK/dV kernel's place in
// the backward sources: both loops over the CTA's tiles, the step counter
// carried over them, K and V by the producer's tensor maps against
// barriers of their own, the released last stage, the tiles from the
// counter (zeroed by the preprocess, word 2) in the grid's order or under
// a mask tile_order's; the kernel of one tile a CTA has none of it;
// variants PersistentOK declines fail to validate.
func TestBwdPersistentSource(t *testing.T) {
	base := BwdVariant{DType: attn.BFloat16, DK: 128, DV: 128, Vector: true, WGMMA: true, TMA: true,
		AtomicDQ: true, BulkDQ: true, WarpSpecialized: true, KeyRows: true}
	masked := base
	masked.Features, masked.LightTail = Features{Mask: MaskWindow}, true
	always := []string{"for (int it = gs; it < gs + iters; ++it)", "mbar_init(s0 + ", "// kvempty",
		"tma_load_4d(sK + (a * BN + r) * 128, &tp.c, kvbar", "tma_load_4d(sV + (a * BN + r) * 128, &tp.d, kvbar",
		"mbar_arrive(kvempty);", "if (iters > 0) mbar_arrive(empty + 8 * ((gs + iters - 1) & 1));", "if (it > gs) mbar_arrive(empty",
		"atomicAdd(reinterpret_cast<unsigned*>(p.nf_flag) + 2, 1u)", "*sched = tile;", "const int tile = *sched;", "threadIdx.x < 3) p.nf_flag[threadIdx.x] = 0u;"}
	for _, c := range []struct {
		name          string
		v             BwdVariant
		want, without []string
	}{
		{"unmasked", base, []string{"const int b = (tile / nkb) % p.B, kvh = tile / nkb / p.B, j0 = (tile % nkb) * BN;"}, []string{"tile += gridDim.x", "tile_order("}},
		{"masked", masked, []string{"tile_order(tile, nkb, p.B * p.Hkv, pair_, blk_);"}, []string{"tile += gridDim.x"}},
	} {
		plain, err := c.v.Source()
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		for _, s := range append(append([]string{}, always...), "sched", "ntiles") {
			if strings.Contains(plain, s) {
				t.Errorf("%s: the kernel of one tile a CTA has %q", c.name, s)
			}
		}
		w := c.v
		w.Persistent = true
		src, err := w.Source()
		if err != nil {
			t.Fatalf("%s persistent: %v", c.name, err)
		}
		for _, s := range append(append([]string{}, always...), c.want...) {
			if !strings.Contains(src, s) {
				t.Errorf("%s: persistent source lacks %q", c.name, s)
			}
		}
		for _, s := range c.without {
			if strings.Contains(src, s) {
				t.Errorf("%s: persistent source has %q", c.name, s)
			}
		}
	}
	for _, f := range []func(*BwdVariant){
		func(v *BwdVariant) { v.Bias = BiasBF16 },
		func(v *BwdVariant) { v.Varlen = true },
		func(v *BwdVariant) { v.QueryStep = 80 },
		func(v *BwdVariant) { v.KeyRows = false },
	} {
		v := base
		v.Persistent = true
		f(&v)
		if err := v.Validate(); err == nil || !strings.Contains(err.Error(), "PersistentOK") {
			t.Errorf("%s: persistent: %v, want PersistentOK's refusal", v.Name(), err)
		}
	}
}
