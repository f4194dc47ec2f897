package gpu

import (
	"errors"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/kernels"
)

// TestParseBwdPipeline checks the backward's pipeline words: lockstep and
// ws are taken, the forward's other parts refused with ErrOption.
func TestParseBwdPipeline(t *testing.T) {
	for _, c := range []struct {
		in   string
		want kernels.Pipeline
		err  bool
	}{
		{"", DefaultBwdPipeline, false},
		{"lockstep", kernels.Pipeline{}, false},
		{"ws", kernels.Pipeline{WarpSpecialized: true}, false},
		{"pingpong", kernels.Pipeline{}, true},
		{"ws,persistent", kernels.Pipeline{}, true},
		{"tma-store", kernels.Pipeline{}, true},
		{"warp", kernels.Pipeline{}, true},
	} {
		got, err := parseBwdPipeline(c.in)
		if c.err {
			if !errors.Is(err, attn.ErrOption) {
				t.Errorf("parseBwdPipeline(%q) = %+v, %v; want ErrOption", c.in, got, err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("parseBwdPipeline(%q) = %+v, %v; want %+v", c.in, got, err, c.want)
		}
	}
}

// parseCase is one input of an integer setting's parser: the value it
// gives, or an error wrapping attn.ErrOption.
type parseCase struct {
	in   string
	want int
	err  bool
}

// checkParse runs parse over cases.
func checkParse(t *testing.T, name string, parse func(string) (int, error), cases []parseCase) {
	t.Helper()
	for _, c := range cases {
		got, err := parse(c.in)
		if c.err {
			if !errors.Is(err, attn.ErrOption) {
				t.Errorf("%s(%q) = %d, %v; want ErrOption", name, c.in, got, err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("%s(%q) = %d, %v; want %d", name, c.in, got, err, c.want)
		}
	}
}

// TestParseQueryStep checks the values EnvBwdQueryStep takes.
func TestParseQueryStep(t *testing.T) {
	checkParse(t, "parseQueryStep", parseQueryStep, []parseCase{
		{"", 0, false}, {"64", 0, false}, {" 80 ", 80, false}, {"128", 128, false}, {"96", 0, true}, {"0", 0, true}, {"eighty", 0, true},
	})
}

// TestParsePolyExp checks the values EnvFwdPolyExp takes, and that the
// planner keeps the polynomial exponentials on the WGMMA kernels of 16-bit
// types only.
func TestParsePolyExp(t *testing.T) {
	checkParse(t, "parsePolyExp", parsePolyExp, []parseCase{
		{"", 0, false}, {"0", 0, false}, {" 1 ", 1, false}, {"4", 4, false}, {"5", 0, true}, {"-1", 0, true}, {"half", 0, true},
	})
	for _, c := range []struct {
		dt    attn.DType
		wgmma bool
		want  int
	}{
		{attn.BFloat16, true, 2}, {attn.Float16, true, 2}, {attn.BFloat16, false, 0}, {attn.Float32, false, 0},
	} {
		v := kernels.Variant{DType: c.dt, DK: 64, DV: 64, LoadBytes: 16, LSE: true}
		tile, ok := kernels.HopperTile(v)
		if !c.wgmma {
			var err error
			tile, err = kernels.TileFor(c.dt, 64, 64, false)
			ok = err == nil
		}
		if !ok {
			t.Fatalf("no tile for %v (WGMMA %v)", c.dt, c.wgmma)
		}
		v = tile.Apply(v)
		if got := pipelineFor(v, kernels.Pipeline{PolyExp: 2}).PolyExp; got != c.want {
			t.Errorf("pipelineFor(%v, WGMMA %v) PolyExp = %d, want %d", c.dt, c.wgmma, got, c.want)
		}
	}
}

// TestForwardPlanStoreO checks where the forward planner stores O by a
// tensor map when asked (Pipeline.StoreO): fixed-length batches whose tiles
// leave room for the staging tiles, with o's map (DV columns, N rows, boxes
// of 64 rows) after those of q, k and v; not packed batches, rows read in
// place, head dims whose tiles fill shared memory, or misaligned tensors.
func TestForwardPlanStoreO(t *testing.T) {
	base := fwdRecordCase{dt: attn.BFloat16, b: 2, n: 300, m: 200, h: 4, hkv: 2, dk: 128, dv: 128, wgmma: true, tma: true}
	cases := []struct {
		name string
		edit func(*fwdRecordCase)
		want bool
	}{
		{"d128", nil, true},
		{"d64 causal", func(c *fwdRecordCase) { c.dk, c.dv, c.opt.Causal = 64, 64, true }, true},
		{"d256: no room", func(c *fwdRecordCase) { c.dk, c.dv = 256, 256 }, false},
		{"packed", func(c *fwdRecordCase) { c.cuQ, c.cuK = []int32{0, 50, 170}, []int32{0, 30, 200} }, false},
		{"flat d59", func(c *fwdRecordCase) { c.dk, c.dv, c.h, c.hkv = 59, 59, 8, 8 }, false},
		{"misaligned", func(c *fwdRecordCase) { c.misalign = 1 }, false},
		{"mma.sync", func(c *fwdRecordCase) { c.wgmma, c.tma = false, false }, false},
	}
	for _, pipe := range []kernels.Pipeline{{StoreO: true}, {WarpSpecialized: true, PingPong: true, Persistent: true, StoreO: true}} {
		for _, tc := range cases {
			c := base
			if tc.edit != nil {
				tc.edit(&c)
			}
			c.name = tc.name
			p, ts, _, _ := c.tensors(t)
			pl, err := plan(fwdRequest{p: p, dt: c.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4],
				hopper: c.wgmma, tma: c.tma, pipeline: pipe, sms: 132})
			if err != nil {
				t.Fatalf("%s %v: %v", tc.name, pipe, err)
			}
			v := pl.v
			if v.StoreO != tc.want {
				t.Errorf("%s %v: %s, StoreO %v, want %v", tc.name, pipe, v.Name(), v.StoreO, tc.want)
				continue
			}
			if !tc.want {
				if len(pl.tma) > 3 && !v.FlatStaged {
					t.Errorf("%s %v: %d tensor maps without StoreO", tc.name, pipe, len(pl.tma))
				}
				continue
			}
			if len(pl.tma) != 4 || v.TMAMaps() != 4 {
				t.Fatalf("%s %v: %d tensor maps (%d declared), want 4", tc.name, pipe, len(pl.tma), v.TMAMaps())
			}
			o := pl.tma[3]
			if o.Addr != ts[3].ptr() || o.Cols != uint64(p.DV) || o.Rows != uint64(p.N) || o.Heads != uint64(p.H) || o.B != uint64(p.B) || o.BoxRows != 64 {
				t.Errorf("%s %v: o's map %+v", tc.name, pipe, o)
			}
			if tensorMapSpec(o).Check() != nil {
				t.Errorf("%s %v: o's map %+v refused by the encoder's checks", tc.name, pipe, o)
			}
		}
	}
}

// TestBackwardPlanWS checks where the backward planner takes the
// warp-specialized kernels when asked (bwdRequest.ws): where the tiles come
// by tensor maps, both dQ algorithms, with 384 threads in the dK/dV kernel
// and, for the separate dQ, in the dQ kernel; not on cp.async tiles or fp32.
func TestBackwardPlanWS(t *testing.T) {
	cases := []struct {
		name string
		c    bwdCase
		dt   attn.DType
		tma  bool
		want bool
	}{
		{"bf16 d128", bwdCase{b: 1, n: 300, m: 200, h: 4, hkv: 2, dk: 128, dv: 128}, attn.BFloat16, true, true},
		{"fp16 d256 causal", bwdCase{b: 1, n: 100, m: 90, h: 2, hkv: 2, dk: 256, dv: 256, causal: true}, attn.Float16, true, true},
		{"bf16 d64 packed", bwdCase{h: 2, hkv: 1, dk: 64, dv: 64, cuQ: []int32{0, 50, 120}, cuK: []int32{0, 40, 100}}, attn.BFloat16, true, true},
		{"bf16 d128 cp.async", bwdCase{b: 1, n: 300, m: 200, h: 4, hkv: 2, dk: 128, dv: 128}, attn.BFloat16, false, false},
		{"fp32 d64", bwdCase{b: 1, n: 100, m: 90, h: 2, hkv: 2, dk: 64, dv: 64}, attn.Float32, true, false},
	}
	for i, tc := range cases {
		in := tc.c.inputs(t, tc.dt, uint64(60+i))
		for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
			for _, bulk := range []bool{false, true} {
				r := in.request(algo)
				r.tma, r.ws, r.bulkDQ = tc.tma, true, bulk
				pl, err := planBackward(r)
				if err != nil {
					t.Fatalf("%s %v: %v", tc.name, algo, err)
				}
				if pl.v.WarpSpecialized != tc.want {
					t.Errorf("%s %v bulk=%v: %s, WarpSpecialized %v, want %v", tc.name, algo, bulk, pl.v.Name(), pl.v.WarpSpecialized, tc.want)
					continue
				}
				if !pl.v.WGMMA {
					continue // (the mma.sync kernels' blocks come from their tiles)
				}
				want := map[bool]int{false: 256, true: 384}[tc.want] // the Hopper kernels, with the producer warpgroup or without
				for _, l := range pl.launches {
					if (l.kernel == kernels.BwdDKDVKernel || l.kernel == kernels.BwdDQKernel) && l.threads != want {
						t.Errorf("%s %v bulk=%v: %s launches %d threads, want %d", tc.name, algo, bulk, l.kernel, l.threads, want)
					}
				}
			}
		}
	}
}

// TestBackwardPlanKeyRows checks where the backward planner takes the
// key-rows step when asked (bwdRequest.keyRows): the warp-specialized
// kernels at head dims up to 128, with the separate dQ and at padded dK
// 128 with the atomic one, dropout included; not wider head dims or the
// lockstep kernels, nor anything unasked.
func TestBackwardPlanKeyRows(t *testing.T) {
	d128 := bwdCase{b: 1, n: 300, m: 200, h: 4, hkv: 2, dk: 128, dv: 128}
	cases := []struct {
		name    string
		c       bwdCase
		algo    DQAlgorithm
		ws, ask bool
		want    bool
	}{
		{"d128 separate", d128, DQSeparate, true, true, true},
		{"d128 separate unasked", d128, DQSeparate, true, false, false},
		{"d128 atomic", d128, DQAtomic, true, true, true},
		{"d64 atomic: one warpgroup's dQ", bwdCase{b: 1, n: 100, m: 90, h: 2, hkv: 2, dk: 64, dv: 64}, DQAtomic, true, true, false},
		{"d128 lockstep", d128, DQSeparate, false, true, false},
		{"d64-96 causal softcap", bwdCase{b: 1, n: 100, m: 90, h: 2, hkv: 2, dk: 64, dv: 96, causal: true, softcap: 4}, DQSeparate, true, true, true},
		{"d128 dropout", bwdCase{b: 1, n: 100, m: 90, h: 2, hkv: 2, dk: 128, dv: 128, dropout: 0.1}, DQSeparate, true, true, true},
		{"d128 dropout atomic", bwdCase{b: 1, n: 100, m: 90, h: 2, hkv: 2, dk: 128, dv: 128, dropout: 0.1}, DQAtomic, true, true, true},
		{"d128 dropout unasked", bwdCase{b: 1, n: 100, m: 90, h: 2, hkv: 2, dk: 128, dv: 128, dropout: 0.1}, DQSeparate, true, false, false},
		{"d192", bwdCase{b: 1, n: 100, m: 90, h: 2, hkv: 2, dk: 192, dv: 192}, DQSeparate, true, true, false},
	}
	for i, tc := range cases {
		pl, _ := hopperPlan(t, tc.name, tc.c, uint64(90+i), tc.algo, func(r *bwdRequest) { r.ws, r.keyRows = tc.ws, tc.ask })
		if pl.v.KeyRows != tc.want {
			t.Errorf("%s: %s, KeyRows %v, want %v", tc.name, pl.v.Name(), pl.v.KeyRows, tc.want)
		}
	}
}

// TestBackwardPlanQueryStep checks where the planner takes steps of 80
// queries when asked (bwdRequest.queryStep): the key-rows step with the
// separate dQ or the atomic one by bulk reduce-adds (computed transposed),
// q's and dO's tensor maps then 80 rows a box; the atomic dQ by vector
// atomics, the other step and an unasked plan keep 64.
func TestBackwardPlanQueryStep(t *testing.T) {
	d128 := bwdCase{b: 1, n: 300, m: 200, h: 4, hkv: 2, dk: 128, dv: 128}
	for i, tc := range []struct {
		name          string
		c             bwdCase
		algo          DQAlgorithm
		keyRows, bulk bool
		ask, want     int
	}{
		{"separate", d128, DQSeparate, true, false, 80, 80},
		{"separate causal", bwdCase{b: 2, n: 170, m: 190, h: 2, hkv: 2, dk: 128, dv: 96, causal: true}, DQSeparate, true, false, 80, 80},
		{"separate unasked", d128, DQSeparate, true, false, 0, 64},
		{"atomic by vector atomics", d128, DQAtomic, true, false, 80, 64},
		{"atomic by bulk reduce-adds", d128, DQAtomic, true, true, 80, 80},
		{"atomic by bulk reduce-adds unasked", d128, DQAtomic, true, true, 0, 64},
		{"not key rows", d128, DQSeparate, false, false, 80, 64},
		{"128 at d128: declined", d128, DQSeparate, true, false, 128, 64},
		{"128 separate d64", bwdCase{b: 1, n: 300, m: 260, h: 4, hkv: 2, dk: 64, dv: 64, causal: true}, DQSeparate, true, false, 128, 128},
		{"128 atomic d64 (the rows split)", bwdCase{b: 1, n: 300, m: 260, h: 4, hkv: 2, dk: 64, dv: 64}, DQAtomic, true, true, 128, 128},
		{"128 atomic d64 by vector atomics", bwdCase{b: 1, n: 300, m: 260, h: 4, hkv: 2, dk: 64, dv: 64, causal: true}, DQAtomic, true, false, 128, 128},
		{"128 atomic d64 unasked: not key rows", bwdCase{b: 1, n: 300, m: 260, h: 4, hkv: 2, dk: 64, dv: 64}, DQAtomic, true, true, 0, 64},
	} {
		pl, _ := hopperPlan(t, tc.name, tc.c, uint64(120+i), tc.algo, func(r *bwdRequest) {
			r.ws, r.keyRows, r.bulkDQ, r.queryStep = true, tc.keyRows, tc.bulk, tc.ask
		})
		got := pl.v.ResolvedTiles().DKDV.BlockM
		if got != tc.want {
			t.Errorf("%s: %s, %d queries a step, want %d", tc.name, pl.v.Name(), got, tc.want)
		}
		if !pl.v.TMA || len(pl.tma) != 4 {
			t.Fatalf("%s: %s without its four tensor maps", tc.name, pl.v.Name())
		}
		for _, m := range pl.tma[:2] {
			if int(m.BoxRows) != got {
				t.Errorf("%s: q or dO map of %d rows a box, the step takes %d", tc.name, m.BoxRows, got)
			}
		}
	}
}

// hopperPlan plans the backward of case c in bf16 (inputs drawn with seed)
// with dQ algorithm algo on a Hopper device with tensor maps, the request
// edited by set first, failing t (naming the case name) on an error; it
// returns the plan and the request.
func hopperPlan(t *testing.T, name string, c bwdCase, seed uint64, algo DQAlgorithm, set func(*bwdRequest)) (*bwdPlan, bwdRequest) {
	t.Helper()
	r := c.inputs(t, attn.BFloat16, seed).request(algo)
	r.hopper, r.tma = true, true
	set(&r)
	pl, err := planBackward(r)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return pl, r
}

// TestBackwardPlanKeyRowsAuto checks where the planner takes the key-rows
// step with the atomic dQ by bulk reduce-adds on its own (keyRowsFaster):
// D = 65–128 on the variant's query step and D = 49–64 on steps of 128
// queries (under dropout without a softcap or bias), at least 512 queries
// without a mask and 1024 with one, fixed length, the dQ algorithm left to
// it or atomic, not deterministic,
// warp-specialized tensor-map kernels; elsewhere the table's choice stands. Planned again
// with the algorithm the plan returned, as BackwardDevice plans after
// PrepareBackward, every call keeps its kernels.
func TestBackwardPlanKeyRowsAuto(t *testing.T) {
	d128 := bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 128, dv: 128}
	det := d128
	det.deterministic = true
	causal := d128
	causal.causal = true
	short := d128
	short.n, short.m = 512, 512
	shorter := d128
	shorter.n, shorter.m = 256, 256
	shortCausal := causal
	shortCausal.n, shortCausal.m = 512, 512
	cases := []struct {
		name     string
		c        bwdCase
		algo     DQAlgorithm
		ws, auto bool
		want     bool
		wantAlgo DQAlgorithm
	}{
		{"d128", d128, DQAuto, true, true, true, DQAtomic},
		{"d128 off", d128, DQAuto, true, false, false, DQSeparate},
		{"d128 lockstep", d128, DQAuto, false, true, false, DQSeparate},
		{"d128 separate asked", d128, DQSeparate, true, true, false, DQSeparate},
		{"d128 atomic asked", d128, DQAtomic, true, true, true, DQAtomic},
		{"d128 deterministic", det, DQAuto, true, true, false, DQSeparate},
		{"d128 causal", causal, DQAuto, true, true, true, DQAtomic},
		{"d128 causal N = 512", shortCausal, DQAuto, true, true, false, DQSeparate},
		{"d128 N = 512", short, DQAuto, true, true, true, DQAtomic},
		{"d128 N = 256", shorter, DQAuto, true, true, false, DQSeparate},
		{"d128-96 gqa", bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 1, dk: 128, dv: 96}, DQAuto, true, true, true, DQAtomic},
		{"d96-128: dQ of one warpgroup declined", bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 1, dk: 96, dv: 128}, DQAuto, true, true, false, DQSeparate},
		{"d64", bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 64, dv: 64}, DQAuto, true, true, true, DQAtomic},
		{"d64 causal", bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 64, dv: 64, causal: true}, DQAuto, true, true, true, DQAtomic},
		{"d56-64 gqa", bwdCase{b: 1, n: 512, m: 512, h: 4, hkv: 2, dk: 56, dv: 64}, DQAuto, true, true, true, DQAtomic},
		{"d64 N = 256", bwdCase{b: 1, n: 256, m: 256, h: 2, hkv: 2, dk: 64, dv: 64}, DQAuto, true, true, false, DQAtomic},
		{"d64 off", bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 64, dv: 64}, DQAuto, true, false, false, DQAtomic},
		{"d48", bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 48, dv: 48}, DQAuto, true, true, false, DQAtomic},
		{"d64 separate asked", bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 64, dv: 64}, DQSeparate, true, true, false, DQSeparate},
		{"d128 dropout", bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 128, dv: 128, dropout: 0.1}, DQAuto, true, true, true, DQAtomic},
		{"d128 dropout bias gradient", bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 128, dv: 128, dropout: 0.1, causal: true, bias: []int{1, 2}, biasGrad: true}, DQAuto, true, true, true, DQAtomic},
		{"d64 dropout", bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 64, dv: 64, dropout: 0.1}, DQAuto, true, true, true, DQAtomic},
		{"d64 dropout softcap: spills", bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 64, dv: 64, dropout: 0.1, softcap: 30}, DQAuto, true, true, false, DQAtomic},
		{"d64 dropout bias: spills", bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 64, dv: 64, dropout: 0.1, bias: []int{1, 2}}, DQAuto, true, true, false, DQAtomic},
	}
	for i, tc := range cases {
		pl, r := hopperPlan(t, tc.name, tc.c, uint64(120+i), tc.algo, func(r *bwdRequest) { r.ws, r.keyRowsAuto = tc.ws, tc.auto })
		if pl.v.KeyRows != tc.want || pl.v.BulkDQ != tc.want || pl.algo != tc.wantAlgo {
			t.Errorf("%s: %s (%v), want key rows and bulk dQ %v, %v", tc.name, pl.v.Name(), pl.algo, tc.want, tc.wantAlgo)
		}
		if wantStep := 0; tc.want {
			if max(tc.c.dk, tc.c.dv) <= 64 {
				wantStep = 128
			}
			if pl.v.QueryStep != wantStep {
				t.Errorf("%s: %s takes a step of %d queries, want %d", tc.name, pl.v.Name(), pl.v.QueryStep, wantStep)
			}
		}
		r.algo = pl.algo
		again, err := planBackward(r)
		if err != nil || again.v.Name() != pl.v.Name() {
			t.Errorf("%s: planned again with %v: %s, %v; want %s", tc.name, pl.algo, again.v.Name(), err, pl.v.Name())
		}
	}
}

// TestBiasStagedPlans checks where the planners stage a 16-bit bias
// through shared memory under the backend's two knobs: by default
// (BiasStagedAuto) the forward wherever the staged tiles fit beside the
// pipeline's (not the short causal pipeline's, whose store of O by a
// tensor map keeps its room) and the key-rows backward wherever it can;
// with BiasStaged everywhere the variants allow, the short pipeline then
// storing O from registers.
func TestBiasStagedPlans(t *testing.T) {
	long := kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}
	short := long
	short.Persistent, short.StoreO = true, true
	cases := []struct {
		name      string
		causal    bool
		pipe      kernels.Pipeline
		auto, all bool
		fwd, bwd  bool
		fwdStoreO bool
	}{
		{"plain, default", false, long, true, false, true, true, false},
		{"causal, default", true, long, true, false, true, true, false},
		{"causal short pipeline, default", true, short, true, false, false, true, true},
		{"plain, everywhere", false, long, true, true, true, true, false},
		{"causal short pipeline, everywhere", true, short, true, true, true, true, false},
		{"plain, nowhere", false, long, false, false, false, false, false},
		{"causal, nowhere", true, short, false, false, false, false, true},
	}
	for i, tc := range cases {
		be := &Backend{BiasStaged: tc.all, BiasStagedAuto: tc.auto}
		rc := fwdRecordCase{dt: attn.BFloat16, b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 128, dv: 128, wgmma: true, tma: true, bias: []int{1, 1}}
		rc.opt.Causal = tc.causal
		p, ts, bias, _ := rc.tensors(t)
		r := fwdRequest{p: p, dt: rc.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4], bias: bias, hopper: true, tma: true, pipeline: tc.pipe, sms: 132}
		be.setBiasStaging(&r)
		pl, err := plan(r)
		if err != nil {
			t.Fatalf("%s: forward: %v", tc.name, err)
		}
		if pl.v.BiasStaged != tc.fwd || pl.v.StoreO != tc.fwdStoreO {
			t.Errorf("%s: forward %s: staged %v, StoreO %v; want %v, %v", tc.name, pl.v.Name(), pl.v.BiasStaged, pl.v.StoreO, tc.fwd, tc.fwdStoreO)
		}
		c := bwdCase{b: 1, n: 1024, m: 1024, h: 2, hkv: 2, dk: 128, dv: 128, causal: tc.causal, bias: []int{1, 1}}
		bp, _ := hopperPlan(t, tc.name, c, uint64(160+i), DQAuto, func(r *bwdRequest) {
			r.ws, r.keyRowsAuto, r.biasStaged = true, true, be.biasStaged()
		})
		if !bp.v.KeyRows || bp.v.BiasStaged != tc.bwd {
			t.Errorf("%s: backward %s: key rows %v, staged %v; want key rows, staged %v", tc.name, bp.v.Name(), bp.v.KeyRows, bp.v.BiasStaged, tc.bwd)
		}
	}
}

// TestBiasStagedMap checks the bias's tensor map of a staged forward
// (kernels.Variant.BiasTMATensor): last among the launch's maps, keys as columns, a
// broadcast head or batch dim of extent 1, boxes of 64 rows; and that a
// bias broadcast over the rows, which no box of rows can read, is not
// staged.
func TestBiasStagedMap(t *testing.T) {
	cases := []struct {
		name         string
		shape        []int // bias dims (batch, head, row) before the keys
		staged       bool
		heads, batch uint64
		rowB, headB  uint64 // byte strides of the map's rows and heads
		batchB       uint64
	}{
		{"shared by batch and heads", []int{1, 1, 1000}, true, 1, 1, 2 * 1000, 16, 16},
		{"a head's", []int{1, 2, 1000}, true, 2, 1, 2 * 1000, 2 * 1000 * 1000, 16},
		{"every batch element's and head's", []int{2, 2, 1000}, true, 2, 2, 2 * 1000, 2 * 1000 * 1000, 4 * 1000 * 1000},
		{"one row for every query", []int{2, 2, 1}, false, 0, 0, 0, 0, 0},
	}
	for _, tc := range cases {
		be := &Backend{BiasStagedAuto: true}
		rc := fwdRecordCase{dt: attn.BFloat16, b: 2, n: 1000, m: 1000, h: 2, hkv: 2, dk: 128, dv: 128, wgmma: true, tma: true, bias: tc.shape[:2]}
		p, ts, _, _ := rc.tensors(t)
		bt := attn.New(attn.BFloat16, tc.shape[0], tc.shape[1], tc.shape[2], 1000)
		p.Opt.Bias = &attn.Bias{Tensor: bt}
		bias := &DeviceTensor{DType: attn.BFloat16, Shape: bt.Shape, base: 6 << 36}
		r := fwdRequest{p: p, dt: rc.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4], bias: bias, hopper: true, tma: true,
			pipeline: kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}, sms: 132}
		be.setBiasStaging(&r)
		pl, err := plan(r)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if pl.v.BiasStaged != tc.staged {
			t.Fatalf("%s: %s staged %v, want %v", tc.name, pl.v.Name(), pl.v.BiasStaged, tc.staged)
		}
		if names := fwdTMANames(pl.v); len(names) != len(pl.tma) || (names[len(names)-1] == "bias") != tc.staged {
			t.Errorf("%s: maps %v for %d tensors", tc.name, names, len(pl.tma))
		}
		if !tc.staged {
			continue
		}
		m := pl.tma[len(pl.tma)-1]
		want := kernels.TMATensor{Addr: 6 << 36, Cols: 1000, Rows: 1000, Heads: tc.heads, B: tc.batch, Strides: [3]uint64{tc.rowB, tc.headB, tc.batchB}, BoxRows: 64}
		if m != want {
			t.Errorf("%s: bias map %+v, want %+v", tc.name, m, want)
		}
		if err := tensorMapSpec(m).Check(); err != nil {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

// TestBackwardPlanWSAuto checks the warp-specialized backward's choices
// left to the planner: the dQ algorithm from the table's rows for the
// kernels that run the call (separate at D = 128 causal on the
// warp-specialized kernels, atomic on the lockstep ones when tensor maps
// are off), and the lockstep kernels where the warp-specialized ones
// measured slower (head dims up to 32 without a mask).
func TestBackwardPlanWSAuto(t *testing.T) {
	cases := []struct {
		name string
		c    bwdCase
		tma  bool
		ws   bool
		algo DQAlgorithm
	}{
		{"d128 causal", bwdCase{b: 1, n: 300, m: 300, h: 4, hkv: 2, dk: 128, dv: 128, causal: true}, true, true, DQSeparate},
		{"d128 causal cp.async", bwdCase{b: 1, n: 300, m: 300, h: 4, hkv: 2, dk: 128, dv: 128, causal: true}, false, false, DQAtomic},
		{"d96", bwdCase{b: 1, n: 300, m: 300, h: 2, hkv: 2, dk: 96, dv: 96}, true, true, DQAtomic},
		{"d32", bwdCase{b: 1, n: 300, m: 300, h: 2, hkv: 2, dk: 32, dv: 32}, true, false, DQAtomic},
		{"d32 causal", bwdCase{b: 1, n: 300, m: 300, h: 2, hkv: 2, dk: 32, dv: 32, causal: true}, true, true, DQAtomic},
	}
	for i, tc := range cases {
		pl, _ := hopperPlan(t, tc.name, tc.c, uint64(80+i), DQAuto, func(r *bwdRequest) { r.tma, r.ws = tc.tma, true })
		if pl.v.WarpSpecialized != tc.ws || pl.algo != tc.algo {
			t.Errorf("%s: %s, WarpSpecialized %v, dQ %v; want %v, %v", tc.name, pl.v.Name(), pl.v.WarpSpecialized, pl.algo, tc.ws, tc.algo)
		}
	}
}

// TestForwardPlanWSTiles checks the warp-specialized forward's tiles
// (kernels.HopperWSTable): its own tile where the table has one, with 128
// keys rather than 160 at D = 128 for calls of at most 1024 keys, the
// lockstep kernels where they measured faster (D = 64 with a mask, which
// keeps the early rescale), the extras tile at D = 64 and 128,
// HopperTable's tile for head dims past the table, and the caller's tiles
// when given.
func TestForwardPlanWSTiles(t *testing.T) {
	full := kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}
	cases := []struct {
		name     string
		edit     func(*fwdRecordCase)
		pipe     kernels.Pipeline
		bm, bn   int
		ws, pp   bool
		rescaled bool
	}{
		{"d64", func(c *fwdRecordCase) { c.dk, c.dv = 64, 64 }, full, 192, 128, true, false, true},
		{"d64 causal: lockstep", func(c *fwdRecordCase) { c.dk, c.dv, c.opt.Causal = 64, 64, true }, full, 128, 64, false, false, true},
		{"d128 M = 200: 128 keys", nil, full, 128, 128, true, true, true},
		{"d128 causal M = 200: 128 keys", func(c *fwdRecordCase) { c.opt.Causal = true }, full, 128, 128, true, true, true},
		{"d128 M = 1024: 128 keys", func(c *fwdRecordCase) { c.m = 1024 }, full, 128, 128, true, true, true},
		{"d128 M = 1025", func(c *fwdRecordCase) { c.m = 1025 }, full, 128, 160, true, true, true},
		{"d128 causal M = 2048", func(c *fwdRecordCase) { c.n, c.m, c.opt.Causal = 2048, 2048, true }, full, 128, 160, true, true, true},
		{"d128 dropout: the extras tile", func(c *fwdRecordCase) { c.opt.Dropout = 0.1 }, full, 128, 128, true, true, true},
		{"d128 causal softcap: the extras tile", func(c *fwdRecordCase) { c.opt.Causal, c.opt.Softcap = true, 30 }, full, 128, 128, true, true, true},
		{"d64 dropout: the extras tile", func(c *fwdRecordCase) { c.dk, c.dv, c.opt.Dropout = 64, 64, 0.1 }, full, 128, 128, true, true, true},
		{"d256: HopperTable's tile", func(c *fwdRecordCase) { c.dk, c.dv = 256, 256 }, full, 128, 80, true, true, true},
		{"d128 lockstep asked", nil, kernels.Pipeline{}, 128, 96, false, false, false},
	}
	for _, tc := range cases {
		c := fwdRecordCase{dt: attn.BFloat16, b: 2, n: 300, m: 200, h: 4, hkv: 2, dk: 128, dv: 128, wgmma: true, tma: true}
		if tc.edit != nil {
			tc.edit(&c)
		}
		c.name = tc.name
		p, ts, _, _ := c.tensors(t)
		pl, err := plan(fwdRequest{p: p, dt: c.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4], hopper: true, tma: true, pipeline: tc.pipe, sms: 132})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		v := pl.v
		if v.BlockM != tc.bm || v.BlockN != tc.bn || v.WarpSpecialized != tc.ws || v.PingPong != tc.pp || v.EarlyRescale != tc.rescaled {
			t.Errorf("%s: %s; want %dx%d, ws %v, pingpong %v, early rescale %v", tc.name, v.Name(), tc.bm, tc.bn, tc.ws, tc.pp, tc.rescaled)
		}
		if pl.grid[0] != uint32((p.N+v.BlockM-1)/v.BlockM) {
			t.Errorf("%s: grid %v for %d rows a block", tc.name, pl.grid, v.BlockM)
		}
	}
	// the caller's tiles win over the table
	c := fwdRecordCase{dt: attn.BFloat16, b: 1, n: 300, m: 200, h: 2, hkv: 2, dk: 64, dv: 64, wgmma: true, tma: true}
	p, ts, _, _ := c.tensors(t)
	mine := func(attn.DType, int, int, bool) (kernels.Tile, error) {
		return kernels.Tile{BlockM: 128, BlockN: 48, WarpsM: 8, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true}, nil
	}
	pl, err := plan(fwdRequest{p: p, dt: c.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4], hopper: true, tma: true, pipeline: full, tiles: mine})
	if err != nil || pl.v.BlockN != 48 || !pl.v.WarpSpecialized {
		t.Errorf("caller's tile: %s, %v", pl.v.Name(), err)
	}
}

// TestForwardPlanNarrowDoubleQ checks the narrower key blocks that make
// room for two Q buffers (fwdRequest.narrowDoubleQ): at D = 256 on
// persistent CTAs 48-key blocks with two Q buffers in place of 80 with one
// and O's staging tile; at D = 128, where two Q buffers fit beside the
// short pipeline's 128-key blocks, and on one tile a CTA, no change.
func TestForwardPlanNarrowDoubleQ(t *testing.T) {
	short := DefaultShortPipeline
	short.DoubleQ = true
	long := DefaultPipeline
	long.DoubleQ = true
	cases := []struct {
		name   string
		dk     int
		pipe   kernels.Pipeline
		narrow bool
		bn     int
		q2     bool
	}{
		{"d256 persistent", 256, short, true, NarrowDoubleQKeys, true},
		{"d256 persistent, not asked", 256, short, false, 80, false},
		{"d128 persistent: two Q buffers fit", 128, short, true, 128, true},
		{"d256 one tile a CTA", 256, long, true, 80, false},
	}
	for _, tc := range cases {
		c := fwdRecordCase{name: tc.name, dt: attn.BFloat16, b: 2, n: 512, m: 512, h: 4, hkv: 4, dk: tc.dk, dv: tc.dk, wgmma: true, tma: true}
		p, ts, _, _ := c.tensors(t)
		pl, err := plan(fwdRequest{p: p, dt: c.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4], hopper: true, tma: true, pipeline: tc.pipe, sms: 132, narrowDoubleQ: tc.narrow})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if v := pl.v; v.BlockN != tc.bn || v.DoubleQ != tc.q2 || tc.bn == NarrowDoubleQKeys && (v.StoreO || !v.Persistent) {
			t.Errorf("%s: %s; want %d-key blocks, two Q buffers %v", tc.name, v.Name(), tc.bn, tc.q2)
		}
	}
}

// TestParsePipelineDefault checks that an empty forward pipeline variable
// means DefaultPipeline and "lockstep" the lockstep kernels.
func TestParsePipelineDefault(t *testing.T) {
	for in, want := range map[string]kernels.Pipeline{"": DefaultPipeline, "lockstep": {}, "ws": {WarpSpecialized: true},
		"ws,pingpong,early-rescale,persistent,tma-store,lazy-rescale+head-major": {WarpSpecialized: true, PingPong: true, EarlyRescale: true,
			Persistent: true, StoreO: true, LazyRescale: true, HeadMajor: true},
		"persistent,double-q": {WarpSpecialized: true, Persistent: true, DoubleQ: true}} {
		got, err := parsePipeline(in)
		if err != nil || got != want {
			t.Errorf("parsePipeline(%q) = %+v, %v; want %+v", in, got, err, want)
		}
		if back, err := parsePipeline(got.String()); in != "" && (err != nil || back != got) {
			t.Errorf("parsePipeline(%q.String() = %q) = %+v, %v; want %+v", in, got.String(), back, err, got)
		}
	}
	if _, err := parsePipeline("fast"); !errors.Is(err, attn.ErrOption) {
		t.Errorf("parsePipeline(\"fast\"): %v, want ErrOption", err)
	}
}

// TestForwardShortPipeline checks the forward pipeline a backend asks for
// by key length: ShortPipeline up to ShortKeys keys (plain calls at head
// dims up to ShortPlainDim: ShortPlainKeys; causal: ShortCausalKeys) and
// for windows of at most ShortWindowKeys+1 keys a row, Pipeline past them
// and wherever ShortPipeline is nil; and that plain forwards of 512 to
// 2048 keys plan persistent CTAs with O stored by a tensor map under it,
// with two Q buffers where the key tile leaves room for them.
func TestForwardShortPipeline(t *testing.T) {
	short := DefaultShortPipeline
	b := &Backend{Pipeline: DefaultPipeline, ShortPipeline: &short}
	for _, c := range []struct {
		name string
		m, d int
		opt  attn.Options
		want kernels.Pipeline
	}{
		{"one key", 1, 128, attn.Options{}, short},
		{"plain, ShortKeys", ShortKeys, 256, attn.Options{}, short},
		{"plain D 256, ShortKeys+1", ShortKeys + 1, 256, attn.Options{}, DefaultPipeline},
		{"plain D 128, ShortPlainKeys", ShortPlainKeys, ShortPlainDim, attn.Options{}, short},
		{"plain D 64, ShortPlainKeys", ShortPlainKeys, 64, attn.Options{}, short},
		{"plain D 128, ShortPlainKeys+1", ShortPlainKeys + 1, 128, attn.Options{}, DefaultPipeline},
		{"softcap D 128, ShortKeys+1", ShortKeys + 1, 128, attn.Options{Softcap: 30}, DefaultPipeline},
		{"dropout D 128, ShortKeys+1", ShortKeys + 1, 128, attn.Options{Dropout: 0.1}, DefaultPipeline},
		{"dropout D 128, ShortKeys", ShortKeys, 128, attn.Options{Dropout: 0.1}, short},
		{"plain D 128, 4096", 4096, 128, attn.Options{}, DefaultPipeline},
		{"causal D 256, ShortCausalKeys", ShortCausalKeys, 256, attn.Options{Causal: true}, short},
		{"causal D 128, ShortCausalKeys+1", ShortCausalKeys + 1, 128, attn.Options{Causal: true}, DefaultPipeline},
	} {
		p := &attn.Problem{N: c.m, M: c.m, DK: c.d, DV: c.d, Opt: c.opt}
		p.ResolveMask()
		if got := b.forwardPipeline(p, false); got != c.want {
			t.Errorf("%s: pipeline %+v, want %+v", c.name, got, c.want)
		}
	}
	for _, c := range []struct {
		w    attn.Window
		want kernels.Pipeline
	}{{attn.Window{Left: 256, Right: 0}, short}, {attn.Window{Left: 128, Right: 128}, short},
		{attn.Window{Left: ShortWindowKeys, Right: 0}, short}, {attn.Window{Left: ShortWindowKeys, Right: 1}, DefaultPipeline},
		{attn.Window{Left: 256, Right: -1}, DefaultPipeline}, {attn.Window{Left: -1, Right: 256}, DefaultPipeline}} {
		w := c.w
		p := &attn.Problem{N: 8192, M: 8192, Opt: attn.Options{Window: &w}}
		p.ResolveMask()
		if got := b.forwardPipeline(p, false); got != c.want {
			t.Errorf("window %+v over 8192 keys: pipeline %+v, want %+v", c.w, got, c.want)
		}
	}
	if got := (&Backend{Pipeline: DefaultPipeline}).forwardPipeline(&attn.Problem{M: ShortKeys}, false); got != DefaultPipeline {
		t.Errorf("without ShortPipeline: %+v, want %+v", got, DefaultPipeline)
	}
	// the launches planned: persistent CTAs with O by tensor maps, and two Q buffers where the
	// key tile leaves room for them (128 keys up to 1024, 160 past)
	q2 := &Backend{Pipeline: DefaultPipeline, ShortPipeline: &short, FwdDoubleQ: true}
	for _, c := range []struct {
		keys, d int
		doubleQ bool
	}{{ShortKeys, 128, true}, {1024, 128, true}, {ShortPlainKeys, 128, false}, {ShortPlainKeys, 64, true}} {
		if v := backendPlanned(t, q2, hopperCase("short", 2, c.keys, 2, c.d)); !v.WarpSpecialized || !v.Persistent || !v.StoreO || v.DoubleQ != c.doubleQ {
			t.Errorf("%d keys, D %d: %s: want warp-specialized, persistent, O by tensor map, two Q buffers %v", c.keys, c.d, v.Name(), c.doubleQ)
		}
	}
}

// TestBiasStageable checks which bias layouts the staged bias takes
// (16-byte copies: contiguous keys, start and strides 16-byte aligned,
// broadcast dims as stride 0, rows less than 2 GiB apart).
func TestBiasStageable(t *testing.T) {
	ok := kernels.Params{Bias: 0x10000, BiasStrideB: 0, BiasStrideH: 4096 * 4096, BiasStrideN: 4096, BiasStrideM: 1}
	for _, tc := range []struct {
		name string
		edit func(*kernels.Params)
		want bool
	}{
		{"contiguous, batch broadcast", func(*kernels.Params) {}, true},
		{"rows of 4100 keys", func(p *kernels.Params) { p.BiasStrideN, p.BiasStrideH = 4100, 4100*4096 }, false},
		{"rows of 4104 keys", func(p *kernels.Params) { p.BiasStrideN, p.BiasStrideH = 4104, 4104*4096 }, true},
		{"keys two apart", func(p *kernels.Params) { p.BiasStrideM = 2 }, false},
		{"start 2 bytes off", func(p *kernels.Params) { p.Bias += 2 }, false},
		{"head stride of 4 elements", func(p *kernels.Params) { p.BiasStrideH = 4 }, false},
		{"no bias", func(p *kernels.Params) { p.Bias = 0 }, false},
	} {
		p := ok
		tc.edit(&p)
		if got := biasStageable(p.Bias, p.BiasStrideM, p.BiasStrideN, p.BiasStrideH, p.BiasStrideB); got != tc.want {
			t.Errorf("%s: biasStageable = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestBackwardPlanLightTail checks where the planner orders a backward
// launch's CTAs to end on its lightest blocks (bwdRequest.lightTail,
// kernels.BwdVariant.LightTail): masked calls (causal, windows) on every
// kernel family, not unmasked ones, and nowhere without the knob.
func TestBackwardPlanLightTail(t *testing.T) {
	causal := bwdCase{b: 2, n: 1024, m: 1024, h: 2, hkv: 2, dk: 128, dv: 128, causal: true}
	window := bwdCase{b: 2, n: 1024, m: 1024, h: 2, hkv: 2, dk: 128, dv: 128, window: &attn.Window{Left: 200, Right: 0}}
	plain := bwdCase{b: 2, n: 1024, m: 1024, h: 2, hkv: 2, dk: 128, dv: 128}
	d64 := bwdCase{b: 2, n: 1024, m: 1024, h: 2, hkv: 2, dk: 64, dv: 64, causal: true}
	cases := []struct {
		name       string
		c          bwdCase
		algo       DQAlgorithm
		ws, on     bool
		want       bool
		wantFamily string
	}{
		{"causal key rows", causal, DQAuto, true, true, true, "_keyrows"},
		{"causal separate", causal, DQSeparate, true, true, true, "_ws"},
		{"causal lockstep", causal, DQSeparate, false, true, true, "_sm90a"},
		{"causal d64 128-query step", d64, DQAuto, true, true, true, "_keyrows"},
		{"window", window, DQAuto, true, true, true, "_mask"},
		{"unmasked", plain, DQAuto, true, true, false, "_keyrows"},
		{"causal, knob off", causal, DQAuto, true, false, false, "_keyrows"},
	}
	for i, tc := range cases {
		pl, _ := hopperPlan(t, tc.name, tc.c, uint64(160+i), tc.algo, func(r *bwdRequest) {
			r.ws, r.keyRowsAuto, r.lightTail = tc.ws, true, tc.on
		})
		if pl.v.LightTail != tc.want || !strings.Contains(pl.v.Name(), tc.wantFamily) {
			t.Errorf("%s: %s, light tail %v; want %v on a %s variant", tc.name, pl.v.Name(), pl.v.LightTail, tc.want, tc.wantFamily)
		}
	}
}

// TestForwardPlanLightTail checks where the forward's planner orders a
// launch's CTAs to end on its lightest query blocks (fwdRequest.lightTail,
// kernels.Variant.LightTail): masked launches of one tile a CTA, not
// persistent ones (their tiles come longest first already) nor unmasked
// ones, and nowhere without the knob.
func TestForwardPlanLightTail(t *testing.T) {
	full := kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}
	short := full
	short.Persistent, short.StoreO = true, true
	for _, c := range []struct {
		name   string
		causal bool
		pipe   kernels.Pipeline
		on     bool
		want   bool
	}{
		{"causal", true, full, true, true},
		{"causal lockstep", true, kernels.Pipeline{}, true, true},
		{"causal persistent", true, short, true, false},
		{"unmasked", false, full, true, false},
		{"causal, knob off", true, full, false, false},
	} {
		rc := hopperCase(c.name, 1, 2048, 2, 128)
		rc.opt.Causal = c.causal
		p, ts, _, _ := rc.tensors(t)
		pl, err := plan(fwdRequest{p: p, dt: rc.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4], hopper: true, tma: true, pipeline: c.pipe, sms: 132, lightTail: c.on})
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if pl.v.LightTail != c.want {
			t.Errorf("%s: %s, light tail %v, want %v", c.name, pl.v.Name(), pl.v.LightTail, c.want)
		}
	}
}

// TestForwardEarlyDropout checks where a backend adds the early dropout
// bits to its pipeline on its own (EarlyDropoutAuto, earlyDropoutFaster):
// under dropout at head dims 96–128 on Pipeline, not at other head dims,
// without dropout, on the short pipeline, or when the pipeline is named;
// and that the plan's kernel draws them.
func TestForwardEarlyDropout(t *testing.T) {
	short := DefaultShortPipeline
	auto := &Backend{Pipeline: DefaultPipeline, ShortPipeline: &short, EarlyDropoutAuto: true}
	named := &Backend{Pipeline: DefaultPipeline}
	for _, c := range []struct {
		name    string
		b       *Backend
		dk, dv  int
		m       int
		dropout float64
		want    bool
	}{
		{"d128", auto, 128, 128, 8192, 0.1, true},
		{"d96", auto, 96, 96, 8192, 0.1, true},
		{"d64-128", auto, 64, 128, 8192, 0.1, true},
		{"d80", auto, 80, 80, 8192, 0.1, false},
		{"d64", auto, 64, 64, 8192, 0.1, false},
		{"d192", auto, 192, 192, 8192, 0.1, false},
		{"d128 no dropout", auto, 128, 128, 8192, 0, false},
		{"d128 short", auto, 128, 128, ShortKeys, 0.1, false},
		{"d128 named pipeline", named, 128, 128, 8192, 0.1, false},
	} {
		p := &attn.Problem{N: c.m, M: c.m, DK: c.dk, DV: c.dv, Opt: attn.Options{Dropout: c.dropout}}
		if got := c.b.forwardPipeline(p, false).EarlyDropout; got != c.want {
			t.Errorf("%s: early dropout %v, want %v", c.name, got, c.want)
		}
	}
	c := hopperCase("early dropout", 1, 1024, 2, 128)
	c.opt.Dropout = 0.1
	p, ts, _, _ := c.tensors(t)
	pl, err := plan(fwdRequest{p: p, dt: c.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4],
		hopper: true, tma: true, pipeline: auto.forwardPipeline(p, false), sms: 132})
	if err != nil {
		t.Fatal(err)
	}
	if v := pl.v; !v.WarpSpecialized || !v.EarlyDropout {
		t.Errorf("%s: want warp-specialized with the early dropout bits", v.Name())
	}
}

// TestForwardProducerDropout checks where a backend with FwdProducerDropout
// plans the producer's dropout keep bits: under dropout on the launches of
// one tile a CTA and on the persistent short pipeline, in place of the
// early bits (D = 128) and of the bits drawn after the softmax (D = 64);
// not without dropout.
func TestForwardProducerDropout(t *testing.T) {
	short := DefaultShortPipeline
	b := &Backend{Pipeline: DefaultPipeline, ShortPipeline: &short, EarlyDropoutAuto: true, FwdProducerDropout: true}
	for _, c := range []struct {
		name    string
		d, n    int
		dropout float64
		want    bool
	}{
		{"d128", 128, 2048, 0.1, true},
		{"d64", 64, 2048, 0.1, true},
		{"d128 no dropout", 128, 2048, 0, false},
		{"d128 short (persistent)", 128, 512, 0.1, true},
	} {
		fc := hopperCase(c.name, 1, c.n, 2, c.d)
		fc.opt.Dropout = c.dropout
		v := backendPlanned(t, b, fc)
		if v.ProducerDropout != c.want || v.EarlyDropout {
			t.Errorf("%s: %s: producer dropout %v, early %v; want %v, false", c.name, v.Name(), v.ProducerDropout, v.EarlyDropout, c.want)
		}
		if c.want && (!v.WarpSpecialized || v.Persistent != (c.n <= ShortKeys)) {
			t.Errorf("%s: %s: want warp-specialized, persistent %v", c.name, v.Name(), c.n <= ShortKeys)
		}
	}
}

// backendPlanned returns the forward variant b plans for fc on a device
// of 132 multiprocessors (its pipeline as Backend.forwardPipeline picks it).
func backendPlanned(t *testing.T, b *Backend, fc fwdRecordCase) kernels.Variant {
	t.Helper()
	p, ts, _, _ := fc.tensors(t)
	pl, err := plan(fwdRequest{p: p, dt: fc.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4],
		hopper: true, tma: true, pipeline: b.forwardPipeline(p, false), sms: 132})
	if err != nil {
		t.Fatalf("%s: %v", fc.name, err)
	}
	return pl.v
}

// TestForwardLazyRescale checks where the forward takes the lazy rescale
// (kernels.Pipeline.LazyRescale): with Backend.LazyRescale on the long and
// the short pipeline and on the lockstep kernels' parts, in every planned
// variant that validates with it (the 16-bit Hopper kernels with one
// warpgroup per row group), nowhere without it.
func TestForwardLazyRescale(t *testing.T) {
	short := DefaultShortPipeline
	for _, c := range []struct {
		name         string
		dk, n        int
		causal, lazy bool
		want, pipeWS bool
	}{
		{"d128 4K", 128, 4096, false, true, true, true},
		{"d128 4K off", 128, 4096, false, false, false, true},
		{"d128 512 (short pipeline)", 128, 512, false, true, true, true},
		{"d64 causal (lockstep)", 64, 2048, true, true, true, false},
		{"d384 (two warpgroups a row group)", 384, 1024, false, true, false, false},
		{"d320", 320, 1024, false, true, true, true},
	} {
		b := &Backend{Pipeline: DefaultPipeline, ShortPipeline: &short, LazyRescale: c.lazy}
		fc := hopperCase(c.name, 1, c.n, 2, c.dk)
		fc.opt.Causal = c.causal
		if v := backendPlanned(t, b, fc); v.LazyRescale != c.want || v.WarpSpecialized != c.pipeWS {
			t.Errorf("%s: %s, lazy rescale %v, warp-specialized %v; want %v, %v", c.name, v.Name(), v.LazyRescale, v.WarpSpecialized, c.want, c.pipeWS)
		}
	}
}

// TestForwardPipelineParts checks where the planner takes a pipeline part
// the backend asks for, and nowhere unasked:
//   - the head-major tile order (kernels.Pipeline.HeadMajor,
//     Backend.FwdHeadMajor): the persistent launches (the short pipeline's
//     calls, causal ones too), not the long pipeline (no persistent CTAs);
//   - two Q buffers (DoubleQ, FwdDoubleQ): the persistent launches whose
//     shared memory holds them (D = 64, D = 128 at 128 keys, causal ones
//     too), not D = 256 (the second buffer does not fit), not the long
//     pipeline;
//   - ping-pong's turns carried across tiles (CarryTurns, FwdCarryTurns):
//     the persistent launches with ping-pong, not three compute warpgroups
//     (no ping-pong), not the long pipeline.
func TestForwardPipelineParts(t *testing.T) {
	type partCase struct {
		name       string
		n, d       int
		causal, on bool
		want       bool
	}
	for _, part := range []struct {
		name  string
		ask   func(b *Backend, on bool)
		taken func(v kernels.Variant) (on, consistent bool)
		cases []partCase
	}{
		{"head-major",
			func(b *Backend, on bool) { b.FwdHeadMajor = on },
			func(v kernels.Variant) (bool, bool) { return v.HeadMajor, !v.HeadMajor || v.Persistent },
			[]partCase{
				{"512", 512, 128, false, true, true},
				{"512 off", 512, 128, false, false, false},
				{"512 causal (dynamic schedule)", 512, 128, true, true, true},
				{"4K", 4096, 128, false, true, false},
			}},
		{"double-q",
			func(b *Backend, on bool) { b.FwdDoubleQ = on },
			func(v kernels.Variant) (bool, bool) { return v.DoubleQ, !v.DoubleQ || v.Persistent },
			[]partCase{
				{"512", 512, 128, false, true, true},
				{"512 d64", 512, 64, false, true, true},
				{"512 off", 512, 128, false, false, false},
				{"1024 causal (dynamic schedule)", 1024, 128, true, true, true},
				{"4096 causal (128 keys on the short pipeline)", 4096, 128, true, true, true},
				{"8192 causal (the long pipeline)", 8192, 128, true, true, false},
				{"512 d256 (too large)", 512, 256, false, true, false},
				{"4K (the long pipeline)", 4096, 128, false, true, false},
			}},
		{"carry-turns",
			func(b *Backend, on bool) { b.FwdDoubleQ, b.FwdCarryTurns = true, on },
			func(v kernels.Variant) (bool, bool) { return v.CarryTurns, !v.CarryTurns || v.Persistent && v.PingPong },
			[]partCase{
				{"512", 512, 128, false, true, true},
				{"1024 causal", 1024, 128, true, true, true},
				{"512 d64 (three warpgroups, no ping-pong)", 512, 64, false, true, false},
				{"8K (the long pipeline)", 8192, 128, false, true, false},
				{"512 off", 512, 128, false, false, false},
			}},
	} {
		t.Run(part.name, func(t *testing.T) {
			short := DefaultShortPipeline
			for _, c := range part.cases {
				b := &Backend{Pipeline: DefaultPipeline, ShortPipeline: &short, LazyRescale: true}
				part.ask(b, c.on)
				fc := hopperCase(c.name, 2, c.n, 4, c.d)
				fc.opt.Causal = c.causal
				v := backendPlanned(t, b, fc)
				if on, consistent := part.taken(v); on != c.want || !consistent {
					t.Errorf("%s: %s, %s %v, want %v", c.name, v.Name(), part.name, on, c.want)
				}
			}
		})
	}
}

// hopperCase returns a bf16 forward case for the Hopper planner: b batch
// elements of n queries and keys, h heads (as many key heads), head dims d,
// tensor maps.
func hopperCase(name string, b, n, h, d int) fwdRecordCase {
	return fwdRecordCase{name: name, dt: attn.BFloat16, b: b, n: n, m: n, h: h, hkv: h, dk: d, dv: d, wgmma: true, tma: true}
}

// TestCausalKeyTile checks the forward's key tile at D = 128 by the
// call: 128 keys for causal calls on the short pipeline at every length it
// takes (up to ShortCausalKeys) and for calls of at most 1024 keys, 160
// for longer unmasked calls and for causal calls on the long pipeline.
func TestCausalKeyTile(t *testing.T) {
	short := DefaultShortPipeline
	b := &Backend{Pipeline: DefaultPipeline, ShortPipeline: &short, LazyRescale: true, FwdDoubleQ: true}
	for _, c := range []struct {
		n      int
		causal bool
		want   int
	}{{1024, false, 128}, {2048, false, 160}, {1024, true, 128}, {2048, true, 128}, {ShortCausalKeys, true, 128}, {2 * ShortCausalKeys, true, 160}} {
		fc := hopperCase("tile", 1, c.n, 4, 128)
		fc.opt.Causal = c.causal
		if v := backendPlanned(t, b, fc); v.BlockN != c.want {
			t.Errorf("N = %d causal %v: %s, %d keys a tile, want %d", c.n, c.causal, v.Name(), v.BlockN, c.want)
		}
	}
}

// TestBackwardPlanDBiasPath checks how the planner has dS reach dBias
// (bwdRequest.dbiasPath, kernels.DBiasPath): by atomic adds for a bias
// broadcast over a batch of more than one element, not deterministic,
// where asked everywhere or, by default, at head dims above 64; directly
// for a bias of every batch element and head (deterministic calls and
// batches of one included); through the scratch and its fixed-order
// reduction otherwise.
func TestBackwardPlanDBiasPath(t *testing.T) {
	c := func(b, d int, bias []int, grad, det bool) bwdCase {
		return bwdCase{b: b, n: 256, m: 256, h: 2, hkv: 2, dk: d, dv: d, bias: bias, biasGrad: grad, deterministic: det}
	}
	scratch, atomic, direct := kernels.DBiasScratch, kernels.DBiasAtomic, kernels.DBiasDirect
	type knobs struct{ atomic, auto, direct bool }
	all, byDefault, none := knobs{true, true, true}, knobs{false, true, true}, knobs{}
	cases := []struct {
		name string
		c    bwdCase
		k    knobs
		want kernels.DBiasPath
	}{
		{"broadcast over the batch, D = 128", c(2, 128, []int{1, 2}, true, false), byDefault, atomic},
		{"broadcast over the batch, D = 64", c(2, 64, []int{1, 2}, true, false), byDefault, scratch},
		{"broadcast over the batch, D = 64, everywhere", c(2, 64, []int{1, 2}, true, false), all, atomic},
		{"broadcast over batch and heads", c(3, 96, []int{1, 1}, true, false), byDefault, atomic},
		{"broadcast over the batch, knobs off", c(2, 128, []int{1, 2}, true, false), none, scratch},
		{"broadcast over the batch, deterministic", c(2, 128, []int{1, 2}, true, true), all, scratch},
		{"broadcast over the heads", c(2, 128, []int{2, 1}, true, false), all, scratch},
		{"a bias per batch element and head", c(2, 64, []int{2, 2}, true, false), byDefault, direct},
		{"a bias per batch element and head, deterministic", c(2, 128, []int{2, 2}, true, true), byDefault, direct},
		{"a batch of one", c(1, 128, []int{1, 2}, true, false), byDefault, direct},
		{"a bias per batch element and head, knobs off", c(2, 128, []int{2, 2}, true, false), none, scratch},
		{"no dBias", c(2, 128, []int{1, 2}, false, false), all, scratch},
	}
	for i, tc := range cases {
		for _, ws := range []bool{false, true} {
			pl, _ := hopperPlan(t, tc.name, tc.c, uint64(200+i), DQAuto, func(r *bwdRequest) {
				r.ws, r.dbiasAtomic, r.dbiasAtomicAuto, r.dbiasDirect = ws, tc.k.atomic, tc.k.auto, tc.k.direct
			})
			if pl.v.DBiasPath != tc.want {
				t.Errorf("%s (warp-specialized %v): %s, dBias %v, want %v", tc.name, ws, pl.v.Name(), pl.v.DBiasPath, tc.want)
			}
			dbiasLaunched := false
			for _, l := range pl.launches {
				dbiasLaunched = dbiasLaunched || l.kernel == kernels.BwdDBiasKernel
			}
			if want := tc.c.biasGrad && tc.want != direct; dbiasLaunched != want {
				t.Errorf("%s (warp-specialized %v): dBias kernel launched %v, want %v", tc.name, ws, dbiasLaunched, want)
			}
		}
	}
}

// TestBackwardPlanDBiasReduce checks where the planner adds a
// batch-broadcast bias's gradient by tensor-map reduce-adds
// (kernels.DBiasReduce) with the backends' defaults for the key-rows step
// and the bias's staging: on the key-rows step at D = 128 (where the tiles
// would add it) and at D = 64 (where the scratch would take it: the atomic
// adds are asked there only for the reduce-adds), not where dBias's rows
// are not whole 16-byte units, under a softcap, for deterministic calls or
// off the key-rows step, which keep the tiles at D = 128 and the scratch at
// D = 64; the dBias kernel is launched only where an accumulator or the
// scratch needs converting; the dK/dV kernel twice, over batch element 0
// and then over the batch, where dBias has a plane per head, and once
// where the heads share one.
func TestBackwardPlanDBiasReduce(t *testing.T) {
	c := func(d, m int) bwdCase {
		return bwdCase{b: 4, n: 1024, m: m, h: 2, hkv: 2, dk: d, dv: d, bias: []int{1, 2}, biasGrad: true}
	}
	capped, det, short, shared, wide, wide64 := c(128, 1024), c(64, 1024), c(64, 256), c(128, 1024), c(128, 1024), c(64, 1024)
	capped.softcap, det.deterministic, short.n, shared.bias = 30, true, 256, []int{1, 1}
	wide.b, wide64.b = kernels.DBiasReduceMaxBatch+1, kernels.DBiasReduceMaxBatch+1
	reduce, tiles, scratch := kernels.DBiasReduce, kernels.DBiasTiles, kernels.DBiasScratch
	cases := []struct {
		name   string
		c      bwdCase
		reduce bool
		want   kernels.DBiasPath
	}{
		{"d128", c(128, 1024), true, reduce},
		{"d128, heads sharing dBias's plane", shared, true, reduce},
		{"d128, a batch past DBiasReduceMaxBatch", wide, true, tiles},
		{"d64, a batch past DBiasReduceMaxBatch", wide64, true, scratch},
		{"d128 off", c(128, 1024), false, tiles},
		{"d128 m = 1100 (rows of 2200 bytes)", c(128, 1100), true, tiles},
		{"d128 softcap", capped, true, tiles},
		{"d64", c(64, 1024), true, reduce},
		{"d64 off", c(64, 1024), false, scratch},
		{"d64 m = 1100", c(64, 1100), true, scratch},
		{"d64 deterministic", det, true, scratch},
		{"d64 N = 256 (no key rows)", short, true, scratch},
	}
	for i, tc := range cases {
		pl, _ := hopperPlan(t, tc.name, tc.c, uint64(300+i), DQAuto, func(r *bwdRequest) {
			r.ws, r.keyRowsAuto, r.biasStaged = true, true, true
			r.dbiasAtomicAuto, r.dbiasDirect, r.dbiasTiles, r.dbiasStore, r.dbiasReduce = true, true, true, true, tc.reduce
		})
		if pl.v.DBiasPath != tc.want {
			t.Errorf("%s: %s, dBias %v, want %v", tc.name, pl.v.Name(), pl.v.DBiasPath, tc.want)
		}
		converts := false
		var batches []int // of the dK/dV launches
		for _, l := range pl.launches {
			converts = converts || l.kernel == kernels.BwdDBiasKernel
			if l.kernel == kernels.BwdDKDVKernel {
				batches = append(batches, l.grid[1])
			}
		}
		if want := tc.want != reduce; converts != want {
			t.Errorf("%s: %s: dBias kernel launched %v, want %v", tc.name, pl.v.Name(), converts, want)
		}
		want := []int{tc.c.b}
		if tc.want == reduce && tc.c.bias[1] == tc.c.h {
			want = []int{1, tc.c.b}
		}
		if !slices.Equal(batches, want) {
			t.Errorf("%s: %s: dK/dV launches over %v batch elements, want %v", tc.name, pl.v.Name(), batches, want)
		}
		if tc.want == reduce {
			if ts := pl.tma; len(ts) == 0 || !ts[len(ts)-1].AddsIn || ts[len(ts)-1].DType != attn.BFloat16 {
				t.Errorf("%s: %s: dBias's map not the last one, adding in bf16: %+v", tc.name, pl.v.Name(), ts)
			}
		}
	}
}

// TestBackwardPlanProducerDropout checks where the backward planner takes
// the producer's dropout keep bits when asked (Backend.BwdProducerDropout):
// the warp-specialized key-rows dK/dV kernel under dropout, either dQ
// algorithm; not without dropout, not on the lockstep kernels, not
// persistent, and not unasked.
func TestBackwardPlanProducerDropout(t *testing.T) {
	drop := bwdCase{b: 2, n: 1024, m: 1024, h: 4, hkv: 2, dk: 128, dv: 128, dropout: 0.1}
	plain := drop
	plain.dropout = 0
	for i, tc := range []struct {
		name                   string
		c                      bwdCase
		algo                   DQAlgorithm
		ws, ask, persist, want bool
	}{
		{"atomic", drop, DQAtomic, true, true, false, true},
		{"separate", drop, DQSeparate, true, true, false, true},
		{"no dropout", plain, DQAtomic, true, true, false, false},
		{"lockstep", drop, DQAtomic, false, true, false, false},
		{"persistent", drop, DQAtomic, true, true, true, false},
		{"unasked", drop, DQAtomic, true, false, false, false},
	} {
		pl, _ := hopperPlan(t, tc.name, tc.c, uint64(400+i), tc.algo, func(r *bwdRequest) {
			r.ws, r.keyRows, r.bulkDQ, r.persistent, r.producerDropout, r.sms = tc.ws, true, true, tc.persist, tc.ask, 132
		})
		if pl.v.ProducerDropout != tc.want {
			t.Errorf("%s: %s, ProducerDropout %v, want %v", tc.name, pl.v.Name(), pl.v.ProducerDropout, tc.want)
		}
	}
}

// TestBackwardPlanPersistent checks where the planner launches the
// key-rows dK/dV kernel persistent when asked (bwdRequest.persistent): with
// either dQ algorithm, under a mask and dropout, as one CTA per
// multiprocessor at most (a one-dimensional grid of PersistentGrid CTAs)
// with the dQ kernel's maps of k and v in its argument; not with a bias, a
// packed batch, the lockstep kernels or past the key-rows step's head
// dims, nor unasked.
func TestBackwardPlanPersistent(t *testing.T) {
	d128 := bwdCase{b: 2, n: 1024, m: 1024, h: 4, hkv: 2, dk: 128, dv: 128}
	causalDrop := d128
	causalDrop.causal, causalDrop.dropout = true, 0.1
	biased := d128
	biased.bias = []int{1, 4}
	varlen := bwdCase{b: 2, h: 4, hkv: 2, dk: 128, dv: 128, cuQ: []int32{0, 500, 1024}, cuK: []int32{0, 600, 1024}}
	d192 := d128
	d192.dk, d192.dv = 192, 192
	for i, tc := range []struct {
		name     string
		c        bwdCase
		algo     DQAlgorithm
		ws, ask  bool
		sms      int
		want     bool
		ctaCount int
	}{
		{"d128 atomic", d128, DQAtomic, true, true, 132, true, 32},
		{"d128 atomic, fewer multiprocessors than tiles", d128, DQAtomic, true, true, 20, true, 20},
		{"d128 separate", d128, DQSeparate, true, true, 132, true, 32},
		{"causal dropout", causalDrop, DQAtomic, true, true, 132, true, 32},
		{"unasked", d128, DQAtomic, true, false, 132, false, 0},
		{"lockstep", d128, DQAtomic, false, true, 132, false, 0},
		{"bias", biased, DQAtomic, true, true, 132, false, 0},
		{"packed batch", varlen, DQSeparate, true, true, 132, false, 0},
		{"d192", d192, DQSeparate, true, true, 132, false, 0},
	} {
		pl, _ := hopperPlan(t, tc.name, tc.c, uint64(300+i), tc.algo, func(r *bwdRequest) {
			r.ws, r.keyRows, r.bulkDQ, r.persistent, r.sms = tc.ws, true, true, tc.ask, tc.sms
		})
		if pl.v.Persistent != tc.want {
			t.Errorf("%s: %s, Persistent %v, want %v", tc.name, pl.v.Name(), pl.v.Persistent, tc.want)
			continue
		}
		if !tc.want {
			continue
		}
		for _, l := range pl.launches {
			if l.kernel == kernels.BwdDKDVKernel && l.grid != [3]int{tc.ctaCount, 1, 1} {
				t.Errorf("%s: dK/dV grid %v, want [%d 1 1]", tc.name, l.grid, tc.ctaCount)
			}
		}
		maps := make([][128]byte, len(pl.tma))
		for j := range maps {
			maps[j][0] = byte(j + 1) // each map told apart by its first byte
		}
		arg := pl.kernelArgs(maps)(kernels.BwdDKDVKernel)
		for j := range 4 {
			if arg[128*j] != byte(j+1) {
				t.Errorf("%s: the dK/dV kernel's map %d is the plan's map %d, want %d", tc.name, j, arg[128*j]-1, j)
			}
		}
	}
}

// TestForwardPipelineDefaults checks the knobs New sets by default on
// Hopper as forwardPipeline applies them: the lazy rescale on every
// pipeline, the short one too; the head-major order up to
// HeadMajorQueries queries (FwdHeadMajorAuto) and at any length where asked
// (FwdHeadMajor); neither where their knobs are off.
func TestForwardPipelineDefaults(t *testing.T) {
	short := DefaultShortPipeline
	on := &Backend{Pipeline: DefaultPipeline, ShortPipeline: &short, LazyRescale: true, FwdHeadMajorAuto: true}
	forced := &Backend{Pipeline: DefaultPipeline, ShortPipeline: &short, FwdHeadMajor: true}
	off := &Backend{Pipeline: DefaultPipeline, ShortPipeline: &short}
	for _, c := range []struct {
		name            string
		b               *Backend
		n, m            int
		lazy, headMajor bool
	}{
		{"default, 512 queries (short pipeline)", on, 512, 512, true, true},
		{"default, 512 queries of 8192 keys", on, HeadMajorQueries, 8192, true, true},
		{"default, 513 queries", on, HeadMajorQueries + 1, 8192, true, false},
		{"default, 4096", on, 4096, 4096, true, false},
		{"asked, 4096", forced, 4096, 4096, false, true},
		{"off, 512", off, 512, 512, false, false},
	} {
		got := c.b.forwardPipeline(&attn.Problem{N: c.n, M: c.m}, false)
		if got.LazyRescale != c.lazy || got.HeadMajor != c.headMajor {
			t.Errorf("%s: lazy rescale %v, head-major %v; want %v, %v", c.name, got.LazyRescale, got.HeadMajor, c.lazy, c.headMajor)
		}
	}
}

// TestWindowKeyTile checks the key tile of windowed forwards: the 128-key
// blocks where they compute at least 3 % fewer pairs than the table's 160
// (windows bounded on the left, fixed-length), the table's tile for causal
// masks, unmasked calls and packed batches; and windowPairs against a
// count of the pairs the blocks cover, per visible pair, at (256, 0).
func TestWindowKeyTile(t *testing.T) {
	long := kernels.Tile{BlockM: 128, BlockN: 160, WarpsM: 8, WarpsN: 1, Stages: 2, MinBlocks: 1, WGMMA: true}
	short := long
	short.BlockN = 128
	problem := func(n, left, right int, causal, varlen bool) *attn.Problem {
		opt := attn.Options{Causal: causal}
		if left >= 0 || right >= 0 {
			opt.Window = &attn.Window{Left: left, Right: right}
		}
		p := &attn.Problem{B: 1, N: n, M: n, H: 1, Hkv: 1, DK: 128, DV: 128, Opt: opt, Varlen: varlen}
		p.ResolveMask()
		return p
	}
	for _, c := range []struct {
		name string
		p    *attn.Problem
		want int
	}{
		{"window (256, 0)", problem(4096, 256, 0, false, false), 128},
		{"window (128, 128)", problem(4096, 128, 128, false, false), 128},
		{"window (2048, 0)", problem(16384, 2048, 0, false, false), 128},
		{"causal", problem(4096, -1, -1, true, false), 160},
		{"unmasked", problem(4096, -1, -1, false, false), 160},
		{"packed window", problem(4096, 256, 0, false, true), 160},
	} {
		if got := windowKeyTile(c.p, long, short).BlockN; got != c.want {
			t.Errorf("%s: %d keys a block, want %d", c.name, got, c.want)
		}
	}
	p := problem(4096, 256, 0, false, false)
	visible := int64(0)
	for i := 0; i < p.N; i++ {
		lo, hi := p.KeyRange(i, p.N, p.M)
		visible += int64(hi - lo)
	}
	for _, c := range []struct {
		bn   int
		want float64
	}{{160, 1.988}, {128, 1.494}} {
		if got := float64(windowPairs(p, 128, c.bn)) / float64(visible); math.Abs(got-c.want) > 0.001 {
			t.Errorf("%d keys a block: %.3f pairs computed a visible pair, want %.3f", c.bn, got, c.want)
		}
	}
}
