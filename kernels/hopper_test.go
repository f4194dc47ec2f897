package kernels

import (
	"errors"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// hopperVariant builds a Hopper variant as the GPU backend does, or fails
// the test when HopperTile refuses it.
func hopperVariant(t testing.TB, dt attn.DType, dk, dv int, f func(*Variant)) Variant {
	t.Helper()
	v := Variant{DType: dt, DK: roundUp(dk, 16), DV: roundUp(dv, 16), LoadBytes: 16, LSE: true}
	if f != nil {
		f(&v)
	}
	tile, ok := HopperTile(v)
	if !ok {
		t.Fatalf("HopperTile(%v) refused", v)
	}
	return tile.Apply(v)
}

// hopperDims are the head-dim pairs the Hopper kernel takes: the main ones,
// staged odd dims (padded rows), DK ≠ DV.
var hopperDims = [][2]int{{64, 64}, {128, 128}, {256, 256}, {32, 32}, {59, 59}, {127, 127}, {199, 199}, {16, 256}, {256, 96}, {8, 8},
	{257, 257}, {320, 320}, {384, 384}, {512, 512}, {512, 64}, {64, 512}}

func TestHopperSource(t *testing.T) {
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float16} {
		for _, d := range hopperDims {
			for _, f := range fwdFeatures {
				v := hopperVariant(t, dt, d[0], d[1], f.set)
				src, err := v.Source()
				if err != nil {
					t.Fatalf("%v: %v", v, err)
				}
				for _, want := range []string{"wgmma.mma_async.sync.aligned.m64n", "extern \"C\" __global__", "fence.proxy.async", "load_sw<BM, KCH>"} {
					if !strings.Contains(src, want) {
						t.Fatalf("%v: source lacks %q", v, want)
					}
				}
				if v.SharedBytes() > MaxSharedBytes || v.Threads() != 32*v.WarpsM*v.WarpsN {
					t.Errorf("%v: %d threads, %d bytes of shared memory", v, v.Threads(), v.SharedBytes())
				}
			}
		}
	}
}

func TestHopperTileRefuses(t *testing.T) {
	tests := []struct {
		name string
		v    Variant
	}{
		{"fp32", Variant{DType: attn.Float32, DK: 64, DV: 64, LoadBytes: 16}},
		{"narrow loads", Variant{DType: attn.BFloat16, DK: 64, DV: 64, LoadBytes: 8}},
		{"register-staged", Variant{DType: attn.Float16, DK: 64, DV: 64, LoadBytes: 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tile, ok := HopperTile(tt.v); ok {
				t.Errorf("HopperTile gave %+v", tile)
			}
		})
	}
}

func TestHopperValidate(t *testing.T) {
	ok := hopperVariant(t, attn.BFloat16, 128, 128, nil)
	tests := []struct {
		name string
		set  func(*Variant)
		want error
	}{
		{"ok", func(*Variant) {}, nil},
		{"fp32", func(v *Variant) { v.DType = attn.Float32 }, attn.ErrUnsupported},
		{"8-byte loads", func(v *Variant) { v.LoadBytes = 8 }, attn.ErrUnsupported},
		{"split keys", func(v *Variant) { v.WarpsN, v.BlockN = 2, 128 }, attn.ErrShape},
		{"six warps", func(v *Variant) { v.WarpsM, v.BlockM = 6, 96 }, attn.ErrShape},
		{"two row groups split", func(v *Variant) { v.WarpsN = 2 }, attn.ErrShape},
		{"one stage", func(v *Variant) { v.Stages = 1 }, attn.ErrShape},
		{"dv 336", func(v *Variant) { v.DV = 336 }, attn.ErrUnsupported},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := ok
			tt.set(&v)
			err := v.Validate()
			if tt.want == nil && err != nil || tt.want != nil && !errors.Is(err, tt.want) {
				t.Errorf("Validate = %v, want %v", err, tt.want)
			}
		})
	}
}

// TestCompileHopper compiles Hopper variants for sm_90a with NVRTC (12.0 or
// later; skipped otherwise) and checks ptxas's report: no spills, and no
// serialization of the asynchronous products (ptxas warning C7514 and
// kin), which would quietly cost the overlap the kernel is built for.
func TestCompileHopper(t *testing.T) {
	c := compilerOrSkip(t)
	if major, _ := c.Version(); major < 12 {
		t.Skipf("NVRTC %s cannot target sm_90a", c.VersionString())
	}
	var vs []Variant
	for _, d := range [][2]int{{64, 64}, {128, 128}, {256, 256}, {320, 320}, {512, 512}} {
		for _, f := range fwdFeatures {
			vs = append(vs, hopperVariant(t, attn.BFloat16, d[0], d[1], f.set))
		}
	}
	if testing.Short() {
		vs = []Variant{vs[0], vs[6], vs[11], vs[16], vs[21]}
	}
	res, logs := compileAllLogs(t, c, "sm_90a", vs)
	for i, v := range vs {
		r := res[i]
		t.Logf("%s: %d registers, %d B stack, spills %d/%d", v, r.Registers, r.StackBytes, r.SpillStores, r.SpillLoads)
		if r.SpillStores > 0 || r.StackBytes > 0 {
			t.Errorf("%s spills: %d B stack, %d B stores", v, r.StackBytes, r.SpillStores)
		}
		if strings.Contains(logs[i], "wgmma.mma_async instructions are serialized") {
			t.Errorf("%s: ptxas serialized the warpgroup products:\n%s", v, grepLines(logs[i], "serialized"))
		}
	}
}

// grepLines returns the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
