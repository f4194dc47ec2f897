package kernels

import (
	"errors"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// fusedDQBase returns a key-rows variant with the tiled dQ accumulator
// that takes FusedDQConvert.
func fusedDQBase(t *testing.T) BwdVariant {
	t.Helper()
	for _, v := range bwdHopperKeyRowsVariants() {
		if FusedDQConvertOK(v) {
			v.FusedDQConvert = true
			if err := v.Validate(); err != nil {
				t.Fatal(err)
			}
			return v
		}
	}
	t.Fatal("no key-rows variant with the tiled dQ accumulator")
	return BwdVariant{}
}

// TestFusedDQConvertSource checks the sources of FusedDQConvert: the
// preprocess zeroes the tickets, the dK/dV kernel takes one after its
// reduce-adds complete and the last CTA converts, and the rest of the
// module is the variant's without it.
func TestFusedDQConvertSource(t *testing.T) {
	v := fusedDQBase(t)
	src, err := v.Source()
	if err != nil {
		t.Fatal(err)
	}
	w := v
	w.FusedDQConvert = false
	plain, err := w.Source()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"p.nf_flag[4 + b * p.Hkv + h] = 0u;",
		"atomicAdd(p.nf_flag + 4 + b * p.Hkv + kvh, 1u)",
		"fence.proxy.async.global",
		"dq_tile_rows<R, true>(", // the group's rows loaded through L2 (__ldcg)
	} {
		if !strings.Contains(src, want) {
			t.Errorf("%s: no %q", v.Name(), want)
		}
		if strings.Contains(plain, want) {
			t.Errorf("%s: %q without FusedDQConvert", w.Name(), want)
		}
	}
	// the tickets are taken after the reduce-adds' last wait
	if i, j := strings.LastIndex(src, "bulk_wait<0>();  // every reduce-add of dQ complete"), strings.Index(src, "atomicAdd(p.nf_flag + 4"); i < 0 || j < i {
		t.Errorf("%s: the ticket (at %d) before the reduce-adds' wait (at %d)", v.Name(), j, i)
	}
}

// TestFusedDQConvertRefused checks what FusedDQConvert declines: the
// row-major dQ accumulator, the persistent dK/dV kernel, a bias gradient
// and the lockstep kernels.
func TestFusedDQConvertRefused(t *testing.T) {
	for _, c := range []struct {
		name string
		set  func(*BwdVariant)
	}{
		{"row-major accumulator", func(v *BwdVariant) { v.BulkDQ = false }},
		{"persistent", func(v *BwdVariant) { v.Persistent = true }},
		{"bias gradient", func(v *BwdVariant) { v.Bias, v.BiasGrad = BiasBF16, true }},
		{"lockstep", func(v *BwdVariant) { v.WarpSpecialized, v.KeyRows = false, false }},
	} {
		v := fusedDQBase(t)
		c.set(&v)
		if err := v.Validate(); !errors.Is(err, attn.ErrUnsupported) || !strings.Contains(err.Error(), "FusedDQConvertOK") {
			t.Errorf("%s: %v, want FusedDQConvertOK's error wrapping attn.ErrUnsupported", c.name, err)
		}
	}
}
