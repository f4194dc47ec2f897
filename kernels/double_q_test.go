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

// TestReleaseQAfterLastS checks where a persistent tile releases its Q
// buffer: each compute thread arrives on the buffer's empty barrier right
// after the wait for the tile's last S (the first block's S when the tile
// has one key block, else the S waited for in the loop's last-but-one
// block), so that the producer loads the next tile's Q during the last
// P·V and the epilogue; no arrival remains after the loop but the one of a
// tile with no key.
func TestReleaseQAfterLastS(t *testing.T) {
	one := doubleQBase()
	one.DoubleQ, one.StoreO, one.DK, one.DV, one.BlockN = false, false, 256, 256, 80
	causal := doubleQBase()
	causal.Mask = MaskWindow
	for _, c := range []struct {
		name  string
		v     Variant
		empty string
	}{
		{"two Q buffers", doubleQBase(), "emptyQ + QEMPTY_STEP * (q_it & 1)"},
		{"one Q buffer, D = 256", one, "emptyQ"},
		{"two Q buffers, causal", causal, "emptyQ + QEMPTY_STEP * (q_it & 1)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if err := c.v.Validate(); err != nil {
				t.Fatal(err)
			}
			src, err := c.v.Source()
			if err != nil {
				t.Fatal(err)
			}
			first := "if (nb_hi - 1 == nb_lo) mbar_arrive(" + c.empty + ");"
			loop := "if (nb - 1 == nb_lo) mbar_arrive(" + c.empty + ");"
			for _, want := range []string{first, loop} {
				if strings.Count(src, want) != 1 {
					t.Errorf("source has %d of %q, want 1", strings.Count(src, want), want)
				}
			}
			if i, j, k := strings.Index(src, "fence_acc(s[0]);"), strings.Index(src, first), strings.Index(src, "// ---- main loop"); i < 0 || j < i || j > k {
				t.Errorf("the first block's release (at %d) is not between its S's wait (at %d) and the loop (at %d)", j, i, k)
			}
			if i, j := strings.Index(src, "wgmma_wait<1>();  // S of the next block is done"), strings.Index(src, loop); i < 0 || j < i {
				t.Errorf("the loop's release (at %d) does not follow the next block's S's wait (at %d)", j, i)
			}
			epi := strings.Index(src, "// ---- epilogue")
			if tail := src[strings.Index(src, "// ---- main loop over key blocks"):epi]; strings.Contains(tail, "tile_done()") {
				t.Errorf("a tile with keys still calls tile_done before its epilogue")
			}
		})
	}
}
