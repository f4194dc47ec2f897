package kernels

import (
	"errors"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestWarpSpecializedPrimitives checks that each wrapper the emulator
// stands in for by name issues its PTX instruction.
func TestWarpSpecializedPrimitives(t *testing.T) {
	src := WarpSpecializedPrimitives()
	for _, c := range []struct{ decl, ptx string }{
		{"void bar_sync(u32 id, u32 count)", `"bar.sync %0, %1;`},
		{"void bar_arrive(u32 id, u32 count)", `"bar.arrive %0, %1;`},
		{"void barrier_sync(u32 id, u32 count)", `"barrier.sync %0, %1;`},
		{"void barrier_arrive(u32 id, u32 count)", `"barrier.arrive %0, %1;`},
		{"void mbar_arrive(u32 bar)", `"mbarrier.arrive.shared::cta.b64 _, [%0];`},
		{"void setmaxnreg_inc()", `"setmaxnreg.inc.sync.aligned.u32 %0;`},
		{"void setmaxnreg_dec()", `"setmaxnreg.dec.sync.aligned.u32 %0;`},
		{"void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes)", `"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;`},
		{"void bulk_commit()", `"cp.async.bulk.commit_group;`},
		{"void bulk_wait()", `"cp.async.bulk.wait_group %0;`},
		{"void bulk_wait_read()", `"cp.async.bulk.wait_group.read %0;`},
	} {
		i := strings.Index(src, c.decl+" {")
		if i < 0 {
			t.Errorf("no wrapper %q", c.decl)
			continue
		}
		body := strings.SplitN(src[i:], "\nDEV", 2)[0] // up to the next wrapper
		if !strings.Contains(body, c.ptx) {
			t.Errorf("%s: want %s in\n%s", c.decl, c.ptx, body)
		}
	}
}

// TestParsePipeline reads pipeline words back and refuses unknown ones.
func TestParsePipeline(t *testing.T) {
	cases := []struct {
		in   string
		want Pipeline
		str  string
	}{
		{"", Pipeline{}, "lockstep"},
		{"lockstep", Pipeline{}, "lockstep"},
		{"ws", Pipeline{WarpSpecialized: true}, "ws"},
		{"pingpong", Pipeline{WarpSpecialized: true, PingPong: true}, "ws,pingpong"},
		{"ws, pingpong,early-rescale", Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}, "ws,pingpong,early-rescale"},
		{"early-rescale", Pipeline{EarlyRescale: true}, "early-rescale"},
		{"persistent", Pipeline{WarpSpecialized: true, Persistent: true}, "ws,persistent"},
		{"tma-store", Pipeline{StoreO: true}, "tma-store"},
		{"persistent,tma-store", Pipeline{WarpSpecialized: true, Persistent: true, StoreO: true}, "ws,persistent,tma-store"},
		{"ws+pingpong+early-rescale", Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}, "ws,pingpong,early-rescale"},
		{"producer-dropout", Pipeline{WarpSpecialized: true, ProducerDropout: true}, "ws,producer-dropout"},
	}
	for _, c := range cases {
		got, err := ParsePipeline(c.in)
		if err != nil || got != c.want || got.String() != c.str {
			t.Errorf("ParsePipeline(%q) = %+v (%q), %v; want %+v (%q)", c.in, got, got.String(), err, c.want, c.str)
		}
		if back, err := ParsePipeline(got.String()); err != nil || back != got {
			t.Errorf("ParsePipeline(%q) = %+v, %v; want %+v", got.String(), back, err, got)
		}
	}
	for _, bad := range []string{"warp", "ws,,pingpong", "ws++pingpong", "lockstep,ws"} {
		if _, err := ParsePipeline(bad); !errors.Is(err, attn.ErrOption) {
			t.Errorf("ParsePipeline(%q): %v, want ErrOption", bad, err)
		}
	}
}

// TestPipelineValidate checks which variants take each part of a pipeline.
func TestPipelineValidate(t *testing.T) {
	base := func(d int, set func(*Variant)) Variant {
		v := Variant{DType: attn.BFloat16, DK: d, DV: d, LoadBytes: 16, LSE: true}
		tl, _ := HopperTile(v)
		v = tl.Apply(v)
		v.TMA = true
		set(&v)
		return v
	}
	cases := []struct {
		name string
		v    Variant
		ok   bool
	}{
		{"ws-d128", base(128, func(v *Variant) { v.WarpSpecialized = true }), true},
		{"ws-pingpong-early-d128", base(128, func(v *Variant) { v.Pipeline = Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true} }), true},
		{"ws-without-tma", base(128, func(v *Variant) { v.TMA, v.WarpSpecialized = false, true }), false},
		{"ws-two-warpgroups-per-row-group", base(512, func(v *Variant) { v.WarpSpecialized = true }), false},
		{"pingpong-without-ws", base(128, func(v *Variant) { v.PingPong = true }), false},
		{"early-rescale-lockstep", base(64, func(v *Variant) { v.EarlyRescale = true }), true},
		{"early-rescale-two-products", base(320, func(v *Variant) { v.EarlyRescale = true }), false},
		{"persistent", base(128, func(v *Variant) { v.WarpSpecialized, v.Persistent = true, true }), true},
		{"persistent-without-ws", base(128, func(v *Variant) { v.Persistent = true }), false},
		{"persistent-flat", base(128, func(v *Variant) { v.WarpSpecialized, v.Persistent, v.Flat = true, true, true }), false},
	}
	for _, c := range cases {
		err := c.v.Validate()
		if (err == nil) != c.ok || err != nil && !errors.Is(err, attn.ErrUnsupported) {
			t.Errorf("%s: Validate() = %v, want ok %v (or ErrUnsupported)", c.name, err, c.ok)
		}
	}
}
