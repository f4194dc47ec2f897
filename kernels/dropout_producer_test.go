package kernels

import (
	"errors"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestProducerDropoutSource checks the keep warps' place in the generated
// sources: the forward (one tile a CTA and persistent) and the backward's
// key-rows dK/dV kernel draw the keep bits in the producer's branch, the
// compute warps read them and call no Philox-drawing function, the barriers
// count the keep threads; the sources without the option have none of it.
func TestProducerDropoutSource(t *testing.T) {
	fwd := func(persistent bool, mask MaskKind) Variant {
		v := Variant{DType: attn.BFloat16, DK: 128, DV: 128, BlockM: 128, BlockN: 128, WarpsM: 8, WarpsN: 1, Stages: 2, LoadBytes: 16,
			WGMMA: true, TMA: true, MinBlocks: 1, LSE: true, Features: Features{Dropout: true, Mask: mask},
			Pipeline: Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: persistent, StoreO: persistent}}
		return v
	}
	bwd := BwdVariant{DType: attn.BFloat16, DK: 128, DV: 128, Vector: true, WGMMA: true, TMA: true,
		AtomicDQ: true, BulkDQ: true, WarpSpecialized: true, KeyRows: true}
	bwd.Dropout = true
	fwdKeep := []string{"} else if (tid >= NCOMPUTE + 32) {", "sts32(dst + 4 * e, drop_keep32(wa, wb, p.drop_threshold));",
		"mbar_init(keepFull + 8 * i, KEEP_THREADS);", "mbar_init(keepEmpty + 8 * i, NCOMPUTE);",
		"mbar_wait(keepFull + 8 * (kg & 1), (kg >> 1) & 1);", "mbar_arrive(keepEmpty + 8 * (kg & 1));", "apply_keep_words(s, dkeep);"}
	for _, c := range []struct {
		name          string
		src           func(keep bool) (string, error)
		want, without []string
	}{
		{"forward", func(keep bool) (string, error) {
			v := fwd(false, MaskNone)
			v.ProducerDropout = keep
			return v.Source()
		}, fwdKeep, []string{"drop_bits<MT, NT_S", "drop_bits_any<MT, NT_S", "apply_dropout("}},
		{"forward persistent, window", func(keep bool) (string, error) {
			v := fwd(true, MaskWindow)
			v.ProducerDropout = keep
			return v.Source()
		}, append([]string{"mbar_init(emptyQ, NCOMPUTE + KEEP_THREADS);", "mbar_arrive(emptyQ);  // read", "const int kg = (kv0 + s);"}, fwdKeep...),
			[]string{"drop_bits<MT, NT_S", "drop_bits_any<MT, NT_S", "apply_dropout("}},
		{"backward", func(keep bool) (string, error) {
			v := bwd
			v.ProducerDropout = keep
			return v.Source()
		}, []string{"} else {  // ---- the keep warps", "mbar_init(bar + 8 * s, 128);", "__ballot_sync(0xffffffffu, ((wd >> (8 * (k & 3))) & 0xffu) < p.drop_threshold)",
			"sKeep[s * KEEP_STAGE + (u * 16 + lane) * KR + r] = mine;", "const u32* kw = sKeep + st * KEEP_STAGE + (warp * 16 + g) * KR;"},
			[]string{"drop_bits_kr<BM / 8>(dkeep"}},
	} {
		plain, err := c.src(false)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		for _, s := range c.want {
			if strings.Contains(plain, s) {
				t.Errorf("%s: the source without the keep warps has %q", c.name, s)
			}
		}
		src, err := c.src(true)
		if err != nil {
			t.Fatalf("%s with the keep warps: %v", c.name, err)
		}
		for _, s := range c.want {
			if !strings.Contains(src, s) {
				t.Errorf("%s: source lacks %q", c.name, s)
			}
		}
		for _, s := range c.without {
			if strings.Contains(src, s) {
				t.Errorf("%s: source has %q", c.name, s)
			}
		}
	}
}

// TestProducerDropoutRefused checks the variants the keep warps cannot
// serve: errors wrapping attn.ErrUnsupported.
func TestProducerDropoutRefused(t *testing.T) {
	base := Variant{DType: attn.BFloat16, DK: 128, DV: 128, BlockM: 128, BlockN: 128, WarpsM: 8, WarpsN: 1, Stages: 2, LoadBytes: 16,
		WGMMA: true, TMA: true, MinBlocks: 1, LSE: true, Features: Features{Dropout: true},
		Pipeline: Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, ProducerDropout: true}}
	if err := base.Validate(); err != nil {
		t.Fatalf("base: %v", err)
	}
	bwd := BwdVariant{DType: attn.BFloat16, DK: 128, DV: 128, Vector: true, WGMMA: true, TMA: true,
		AtomicDQ: true, BulkDQ: true, WarpSpecialized: true, KeyRows: true, ProducerDropout: true}
	bwd.Dropout = true
	if err := bwd.Validate(); err != nil {
		t.Fatalf("backward base: %v", err)
	}
	for _, c := range []struct {
		name string
		err  error
	}{
		{"no dropout", func() error { v := base; v.Dropout = false; return v.Validate() }()},
		{"lockstep", func() error { v := base; v.Pipeline = Pipeline{ProducerDropout: true}; return v.Validate() }()},
		{"with the early bits", func() error { v := base; v.EarlyDropout = true; return v.Validate() }()},
		{"80 keys", func() error { v := base; v.BlockN = 80; return v.Validate() }()},
		{"backward without dropout", func() error { v := bwd; v.Dropout = false; return v.Validate() }()},
		{"backward persistent", func() error { v := bwd; v.Persistent = true; return v.Validate() }()},
		{"backward lockstep", func() error { v := bwd; v.WarpSpecialized = false; return v.Validate() }()},
	} {
		if !errors.Is(c.err, attn.ErrUnsupported) {
			t.Errorf("%s: %v, want an error wrapping attn.ErrUnsupported", c.name, c.err)
		}
	}
}
