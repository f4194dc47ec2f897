package kernels

import (
	"errors"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// doubleQBase is a short-pipeline variant with two Q buffers: D = 128,
// 128 × 128 tiles, persistent CTAs storing O by tensor maps.
func doubleQBase() Variant {
	return Variant{DType: attn.BFloat16, DK: 128, DV: 128, BlockM: 128, BlockN: 128, WarpsM: 8, WarpsN: 1, Stages: 2, LoadBytes: 16,
		WGMMA: true, TMA: true, MinBlocks: 1, LSE: true,
		Pipeline: Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true, StoreO: true, DoubleQ: true}}
}

// TestDoubleQSource checks the two Q buffers in the generated source: a
// second buffer in shared memory, each buffer's full and empty barrier
// initialized, the producer waiting for tile q_it − 2's release (not the
// last tile's) before writing sched[qb] and loading into sQt, and the
// compute warps waiting on their tile's buffer with the phase q_it / 2,
// reading Q from sQt and releasing the buffer they used.
func TestDoubleQSource(t *testing.T) {
	v := doubleQBase()
	if err := v.Validate(); err != nil {
		t.Fatal(err)
	}
	one := v
	one.DoubleQ = false
	if v.SharedBytes()-one.SharedBytes() != 128*128*2 {
		t.Errorf("shared memory %d, one buffer %d: want 32 KB more", v.SharedBytes(), one.SharedBytes())
	}
	src, err := v.Source()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"constexpr int Q_STAGE = 32768;",
		"constexpr int QFULL_STEP = 56, QEMPTY_STEP = 16;",
		"mbar_init(barQ + QFULL_STEP, 1);",
		"mbar_init(emptyQ + QEMPTY_STEP, NCOMPUTE);",
		"if (q_it >= 2) mbar_wait(emptyQ + QEMPTY_STEP * qb, ((q_it >> 1) - 1) & 1);",
		"sched[qb] = tile;",
		"tma_tile<BM, KATOMS>(sQt, mq_, barQt, m0, hq_, b, cq_);",
		"mbar_wait(barQ + QFULL_STEP * qb, (q_it >> 1) & 1);",
		"const int tile = sched[qb];",
		"sw128_desc(sQt + wg * 64 * 128, 16, 1024)",
		"mbar_arrive(emptyQ + QEMPTY_STEP * (q_it & 1));",
	} {
		if !strings.Contains(src, want) {
			t.Errorf("source lacks %q", want)
		}
	}
	for _, gone := range []string{"mbar_wait(emptyQ, (q_it - 1) & 1)", "*sched = tile", "mbar_wait(barQ, q_it & 1)"} {
		if strings.Contains(src, gone) {
			t.Errorf("source still has the one buffer's %q", gone)
		}
	}
}

// TestDoubleQRefused checks what two Q buffers decline: CTAs of one tile,
// a staged bias and the producer's dropout keep bits (whose barriers take
// the second buffer's places), and shared memory past the limit.
func TestDoubleQRefused(t *testing.T) {
	for _, c := range []struct {
		name string
		set  func(*Variant)
	}{
		{"one tile a CTA", func(v *Variant) { v.Persistent, v.StoreO = false, false }},
		{"staged bias", func(v *Variant) { v.Bias, v.BiasStaged = BiasBF16, true }},
		{"producer dropout", func(v *Variant) { v.Dropout, v.ProducerDropout = true, true }},
		{"160 keys at D = 128", func(v *Variant) { v.BlockN = 160 }},
	} {
		v := doubleQBase()
		c.set(&v)
		if err := v.Validate(); !errors.Is(err, attn.ErrUnsupported) {
			t.Errorf("%s: %v, want an error wrapping attn.ErrUnsupported", c.name, err)
		}
	}
}
