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
		{"poly-exp=2", Pipeline{PolyExp: 2}, "poly-exp=2"},
		{"ws,pingpong,poly-exp=1", Pipeline{WarpSpecialized: true, PingPong: true, PolyExp: 1}, "ws,pingpong,poly-exp=1"},
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
	for _, bad := range []string{"warp", "ws,,pingpong", "ws++pingpong", "lockstep,ws", "poly-exp", "poly-exp=0", "poly-exp=5", "poly-exp=x"} {
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

// TestPingPongTurnsSource checks where ping-pong's turns start and end:
// without CarryTurns (one tile a CTA, or persistent) each tile gives
// warpgroup 0 the first turn and warpgroup 1 keeps its last; with it a
// persistent CTA gives the first turn once, before its tile loop, both
// warpgroups pass the turn after a tile's last products, and warpgroup 0
// takes the one turn left when it leaves the loop, before the O stores'
// final wait.
func TestPingPongTurnsSource(t *testing.T) {
	const (
		first      = "if (wg == 1) bar_arrive(2, 256);"
		keepLast   = "if (wg == 0) bar_arrive(3, 256);  // warpgroup 1's last turn"
		passLast   = "bar_arrive(3 - wg, 256);  // the other warpgroup's turn (warpgroup 1 passes it to the next tile's first S)"
		takeOnExit = "if (wg == 0) bar_sync(2, 256);"
		tileLoop   = "  for (;;) {\n"
	)
	for _, c := range []struct{ persistent, carry bool }{{false, false}, {true, false}, {true, true}} {
		v := doubleQBase()
		v.Persistent, v.StoreO, v.DoubleQ, v.CarryTurns = c.persistent, c.persistent, c.persistent, c.carry
		if err := v.Validate(); err != nil {
			t.Fatal(err)
		}
		src, err := v.Source()
		if err != nil {
			t.Fatal(err)
		}
		if n := strings.Count(src, first); n != 1 {
			t.Errorf("%s: warpgroup 1's first arrival %d times, want once", v.Name(), n)
		}
		if !c.carry {
			if !strings.Contains(src, keepLast) || strings.Contains(src, passLast) || strings.Contains(src, takeOnExit) {
				t.Errorf("%s: want warpgroup 1 to keep its last turn, and no turn taken on leaving", v.Name())
			}
			if c.persistent && strings.Index(src, first) < strings.LastIndex(src, tileLoop) {
				t.Errorf("%s: warpgroup 1's first arrival is before the tile loop", v.Name())
			}
			continue
		}
		compute := src[strings.LastIndex(src, "setmaxnreg_inc"):]
		loop := strings.Index(compute, tileLoop)
		if i := strings.Index(compute, first); loop < 0 || i < 0 || i > loop {
			t.Fatalf("%s: warpgroup 1's first arrival is not before the tile loop", v.Name())
		}
		exit := strings.Index(compute, takeOnExit)
		if strings.Contains(src, keepLast) || !strings.Contains(compute, passLast) || exit < strings.Index(compute, passLast) {
			t.Errorf("%s: want both warpgroups to pass the turn after a tile's last products, and warpgroup 0 to take the last one after the loop", v.Name())
		}
		if !strings.Contains(compute[exit:], "bulk_wait<0>()") {
			t.Errorf("%s: the turn left is not taken before the O stores' final wait", v.Name())
		}
	}
}

// TestCarryTurnsRefused checks that CarryTurns needs persistent CTAs with
// ping-pong.
func TestCarryTurnsRefused(t *testing.T) {
	for _, p := range []Pipeline{
		{WarpSpecialized: true, PingPong: true, EarlyRescale: true, CarryTurns: true},
		{WarpSpecialized: true, Persistent: true, StoreO: true, CarryTurns: true},
	} {
		v := doubleQBase()
		v.Pipeline = p
		if err := v.Validate(); !errors.Is(err, attn.ErrUnsupported) {
			t.Errorf("%+v: Validate = %v, want attn.ErrUnsupported", p, err)
		}
	}
}
