package gpu

import (
	"crypto/sha256"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// The plan record: for a corpus of forward and backward problems on fake
// device addresses, the kernels the planners choose and a digest of
// everything they would launch (grids, blocks, shared memory, kernel
// arguments, tensor maps, staging copies). testdata/plans.txt holds the
// record; FLASHATTN_PLAN_UPDATE=1 rewrites it. A change to it is a change
// of what the backend launches.

// planRecordFile is the stored record.
var planRecordFile = filepath.Join("testdata", "plans.txt")

// digest returns a short hash of the printed values (tensor maps'
// tensors printed by recordTMA).
func digest(xs ...any) string {
	for i, x := range xs {
		if ts, ok := x.([]kernels.TMATensor); ok {
			xs[i] = recordTMA(ts)
		}
	}
	h := sha256.Sum256([]byte(fmt.Sprintf("%+v", xs)))
	return fmt.Sprintf("%x", h[:8])
}

// recordTMA prints tensor maps' tensors as the record has them: the
// fields of a map that copies, and a reduce-add's element type only on
// maps that add.
func recordTMA(ts []kernels.TMATensor) string {
	var b strings.Builder
	b.WriteString("[")
	for i, t := range ts {
		if i > 0 {
			b.WriteString(" ")
		}
		fmt.Fprintf(&b, "{Addr:%d Cols:%d Rows:%d Heads:%d B:%d Strides:%v BoxRows:%d}", t.Addr, t.Cols, t.Rows, t.Heads, t.B, t.Strides, t.BoxRows)
		if t.AddsIn {
			fmt.Fprintf(&b, "+%v", t.DType)
		}
	}
	b.WriteString("]")
	return b.String()
}

// fwdRecordCase is one forward problem of the record.
type fwdRecordCase struct {
	name       string
	dt         attn.DType
	b, n, m    int
	h, hkv     int
	dk, dv     int
	opt        attn.Options
	headMajor  bool
	misalign   int // elements q, k, v start past a 256-byte boundary
	bias       []int
	cuQ, cuK   []int32
	staging    bool
	wgmma, tma bool
}

// fwdRecordCases is the forward corpus: dtypes, head dims (aligned, odd,
// flat-row and FlatStaged ones), layouts, masks, bias, packed batches, with
// and without staging, on the three kernel families.
func fwdRecordCases() []fwdRecordCase {
	var cs []fwdRecordCase
	dims := [][2]int{{64, 64}, {128, 128}, {59, 59}, {60, 60}, {123, 64}, {199, 199}, {256, 256}, {40, 72}, {512, 512}}
	fams := [][2]bool{{false, false}, {true, false}, {true, true}}
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float16, attn.Float32} {
		for _, d := range dims {
			for _, f := range fams {
				for _, staging := range []bool{false, true} {
					base := fwdRecordCase{dt: dt, b: 2, n: 100, m: 130, h: 16, hkv: 16, dk: d[0], dv: d[1], staging: staging, wgmma: f[0], tma: f[1]}
					vs := []fwdRecordCase{base}
					c := base
					c.opt.Causal, c.h, c.hkv = true, 8, 2
					vs = append(vs, c)
					c = base
					c.headMajor = true
					vs = append(vs, c)
					c = base
					c.misalign = 1
					vs = append(vs, c)
					c = base
					c.bias, c.opt.Softcap, c.opt.Dropout, c.opt.Seed = []int{1, 16}, 5, 0.1, 77
					vs = append(vs, c)
					c = base
					c.cuQ, c.cuK, c.h, c.hkv = []int32{0, 5, 100, 170}, []int32{0, 30, 30, 200}, 4, 2
					c.opt.Window = &attn.Window{Left: 20, Right: 3}
					vs = append(vs, c)
					for i, x := range vs {
						x.name = fmt.Sprintf("fwd %v d%d-%d wgmma=%v tma=%v staging=%v #%d", dt, d[0], d[1], f[0], f[1], staging, i)
						cs = append(cs, x)
					}
				}
			}
		}
	}
	return cs
}

// tensors returns the problem and fake device tensors of c.
func (c fwdRecordCase) tensors(t *testing.T) (*attn.Problem, [5]DeviceTensor, *DeviceTensor, DeviceOptions) {
	t.Helper()
	opt := c.opt
	opt.CuSeqlensQ, opt.CuSeqlensK = c.cuQ, c.cuK
	shape := func(seq, h, d int) []int {
		if c.cuQ != nil {
			return []int{seq, h, d}
		}
		return []int{c.b, seq, h, d}
	}
	n, m := c.n, c.m
	if c.cuQ != nil {
		n, m = int(c.cuQ[len(c.cuQ)-1]), int(c.cuK[len(c.cuK)-1])
	}
	if c.bias != nil {
		opt.Bias = &attn.Bias{Tensor: attn.New(c.dt, c.bias[0], c.bias[1], n, m)}
	}
	sq, sk, sv := shape(n, c.h, c.dk), shape(m, c.hkv, c.dk), shape(m, c.hkv, c.dv)
	p, err := attn.NewProblem(attn.New(c.dt, sq...), attn.New(c.dt, sk...), attn.New(c.dt, sv...), opt)
	if err != nil {
		t.Fatalf("%s: %v", c.name, err)
	}
	ten := func(i int, s []int) DeviceTensor {
		x := DeviceTensor{DType: c.dt, Shape: s, base: uint64(1+i)<<36 + uint64(c.misalign*c.dt.Size())}
		if c.headMajor && len(s) == 4 {
			x.Strides = []int{s[2] * s[1] * s[3], s[3], s[1] * s[3], 1}
		}
		return x
	}
	ts := [5]DeviceTensor{ten(0, sq), ten(1, sk), ten(2, sv),
		{DType: c.dt, Shape: p.OutputShape(), base: 4 << 36}, {DType: attn.Float32, Shape: p.LSEShape(), base: 5 << 36}}
	var bias *DeviceTensor
	if c.bias != nil {
		bias = &DeviceTensor{DType: c.dt, Shape: opt.Bias.Tensor.Shape, base: 6 << 36}
	}
	dopt := DeviceOptions{Options: opt, Bias: bias}
	dopt.Options.Bias = nil
	return p, ts, bias, dopt
}

// fwdRecordLine plans c as ForwardDevice would (with staging: as
// PrepareForward and the host path do, the copies at stagingPlanBase) and
// describes the launch.
func fwdRecordLine(t *testing.T, c fwdRecordCase) string {
	t.Helper()
	return fwdRecordLineOn(t, c, kernels.Pipeline{})
}

// fwdRecordLineOn is fwdRecordLine with the backend's forward pipeline
// pipe.
func fwdRecordLineOn(t *testing.T, c fwdRecordCase, pipe kernels.Pipeline) string {
	t.Helper()
	p, ts, _, dopt := c.tensors(t)
	b := &Backend{WGMMA: c.wgmma, TMA: c.tma, Pipeline: pipe}
	if p.Varlen {
		dopt.CuSeqlensQ, dopt.CuSeqlensK = &cuda.Buffer{}, &cuda.Buffer{} // at address 0
	}
	call := &fwdCall{p: p, dt: c.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4], opt: dopt}
	pl, err := b.planForward(call, nil, c.staging)
	if err != nil {
		return c.name + ": error " + err.Error()
	}
	l, st := pl.launch, pl.st
	return fmt.Sprintf("%s: %s grid %v block %d smem %d params %d %s", c.name, l.v.Name(), l.grid, l.v.Threads(), l.v.SharedBytes(),
		l.v.TMAParamsSize(), digest(l.params, l.tma, stagingDesc(st)))
}

// bwdRecordLines plans every dtype of c with each dQ algorithm, on the
// mma.sync kernels and on the Hopper kernels with and without tensor maps.
func bwdRecordLines(t *testing.T, c bwdCase) []string {
	t.Helper()
	var out []string
	for _, dt := range c.dtypes {
		in := bwdRecordInputs(t, c, dt)
		for _, fam := range [][2]bool{{false, false}, {true, false}, {true, true}} {
			t.Setenv(EnvNoTMA, map[bool]string{false: "1", true: ""}[fam[1]])
			for _, algo := range []DQAlgorithm{DQAuto, DQAtomic, DQSeparate} {
				name := fmt.Sprintf("bwd %s %v hopper=%v tma=%v %v", c.name, dt, fam[0], fam[1], algo)
				pl, err := in.tryPlan(algo, fam[0])
				if err != nil {
					out = append(out, name+": error "+err.Error())
					continue
				}
				out = append(out, bwdRecordLine(name, pl))
			}
		}
		// the default pipeline and the key-rows step where it measured faster, the dQ algorithm
		// left to the table; past 256 also with the deep
		// Hopper kernels allowed
		for _, deep := range []bool{false, true} {
			if deep && max(c.dk, c.dv) <= 256 {
				continue
			}
			r := in.request(DQAuto)
			r.ws, r.deep, r.keyRowsAuto = DefaultBwdPipeline.WarpSpecialized, deep, true // as New sets them
			name := fmt.Sprintf("bwd %s %v default pipeline %v", c.name, dt, DQAuto)
			if deep {
				name += " deep"
			}
			if pl, err := planBackward(r); err != nil {
				out = append(out, name+": error "+err.Error())
			} else {
				out = append(out, bwdRecordLine(name, pl))
			}
		}
	}
	return out
}

// bwdRecordLine describes backward plan pl, named name.
func bwdRecordLine(name string, pl *bwdPlan) string {
	var ls []string
	for _, l := range pl.launches {
		ls = append(ls, fmt.Sprintf("%s%v/%d/%d", l.kernel, l.grid, l.threads, l.smem))
	}
	return fmt.Sprintf("%s: %s %v ws %d %s params %s", name, pl.v.Name(), pl.algo, pl.w.total,
		strings.Join(ls, " "), digest(pl.params.Pack(), pl.tma, pl.w))
}

// bwdRecordInputs is bwdCase.inputs without data: shapes and options only.
func bwdRecordInputs(t *testing.T, c bwdCase, dt attn.DType) bwdInputs {
	t.Helper()
	var in bwdInputs
	in.opt = attn.Options{Scale: c.scale, Softcap: c.softcap, Causal: c.causal, Align: c.align, Window: c.window, Dropout: c.dropout,
		Seed: 0x1234, Offset: 3, CuSeqlensQ: c.cuQ, CuSeqlensK: c.cuK, Deterministic: c.deterministic}
	if c.cuQ != nil {
		tq, tk := int(c.cuQ[len(c.cuQ)-1]), int(c.cuK[len(c.cuK)-1])
		in.q, in.k, in.v = attn.New(dt, tq, c.h, c.dk), attn.New(dt, tk, c.hkv, c.dk), attn.New(dt, tk, c.hkv, c.dv)
	} else {
		in.q, in.k, in.v = attn.New(dt, c.b, c.n, c.h, c.dk), attn.New(dt, c.b, c.m, c.hkv, c.dk), attn.New(dt, c.b, c.m, c.hkv, c.dv)
	}
	if c.bias != nil {
		bdt := dt
		if c.biasF32 {
			bdt = attn.Float32
		}
		in.opt.Bias = &attn.Bias{Tensor: attn.New(bdt, c.bias[0], c.bias[1], c.n, c.m), RequiresGrad: c.biasGrad}
	}
	p, err := attn.NewProblem(in.q, in.k, in.v, in.opt)
	if err != nil {
		t.Fatalf("%s: %v", c.name, err)
	}
	in.p = p
	in.lse = attn.Tensor{DType: attn.Float32, Shape: p.LSEShape()}
	return in
}

// tryPlan is plan returning the error.
func (in bwdInputs) tryPlan(algo DQAlgorithm, hopper bool) (*bwdPlan, error) {
	return in.tryPlanAt(algo, hopper, 0)
}

// tryPlanAt is tryPlan with the workspace at address ws.
func (in bwdInputs) tryPlanAt(algo DQAlgorithm, hopper bool, ws uint64) (*bwdPlan, error) {
	r := in.request(algo)
	r.hopper, r.tma, r.a.Workspace = hopper, !envSet(os.Getenv(EnvNoTMA)), ws
	return planBackward(r)
}

// request returns the planner's request for a backward of in with dQ
// algorithm algo on fake device views, the workspace at address 0, the
// Hopper kernels allowed with tensor maps (and none of the opt-in paths).
func (in bwdInputs) request(algo DQAlgorithm) bwdRequest {
	dt := in.q.DType
	const fake = 1 << 30
	var a bwdArgs
	a.Q, a.K, a.V = seqView(fake, dt, in.q.Shape), seqView(fake, dt, in.k.Shape), seqView(fake, dt, in.v.Shape)
	a.O, a.DO = seqView(fake, dt, in.p.OutputShape()), seqView(fake, dt, in.p.OutputShape())
	a.DQ, a.DK, a.DV = a.Q, a.K, a.V
	a.LSE = lseView(fake, in.lse.Shape)
	if in.opt.Bias != nil {
		bt := in.opt.Bias.Tensor
		a.Bias = biasView(fake, bt.DType, bt.Shape)
		if in.opt.Bias.RequiresGrad {
			a.DBias = biasView(fake, bt.DType, bt.Shape)
		}
	}
	return bwdRequest{p: in.p, dt: dt, a: a, algo: algo, sms: 132, hopper: true, tma: true}
}

// TestPlanRecord compares the plans of the forward and backward corpora
// with the stored record.
func TestPlanRecord(t *testing.T) {
	var lines []string
	for _, c := range fwdRecordCases() {
		lines = append(lines, fwdRecordLine(t, c))
	}
	for _, c := range fwdRecordCases() { // the default pipeline where the Hopper kernels run
		if c.wgmma && c.tma {
			c.name = "default pipeline " + c.name
			lines = append(lines, fwdRecordLineOn(t, c, DefaultPipeline))
		}
	}
	both := func(int, int) []attn.DType { return []attn.DType{attn.BFloat16, attn.Float16} }
	// and a problem of the key-rows step's class (Backend.BwdKeyRowsAuto), on the default pipeline
	keyRows := bwdCase{name: "keyrows-d128-n1024", b: 1, n: 1024, m: 1024, h: 2, hkv: 1, dk: 128, dv: 128, dtypes: both(0, 0)}
	for _, c := range append(append(bwdCases(), bwdCrossCases(113, 300, both)...), keyRows) {
		lines = append(lines, bwdRecordLines(t, c)...)
	}
	got := strings.Join(lines, "\n") + "\n"
	if os.Getenv("FLASHATTN_PLAN_UPDATE") != "" {
		if err := os.WriteFile(planRecordFile, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(planRecordFile)
	if err != nil {
		t.Fatalf("%v (FLASHATTN_PLAN_UPDATE=1 writes it)", err)
	}
	wl := strings.Split(string(want), "\n")
	gl := strings.Split(got, "\n")
	if len(wl) != len(gl) {
		t.Errorf("%d plans recorded, %d now", len(wl), len(gl))
	}
	bad := 0
	for i := range min(len(wl), len(gl)) {
		if wl[i] != gl[i] && bad < 20 {
			bad++
			t.Errorf("plan %d:\n got %s\nwant %s", i, gl[i], wl[i])
		}
	}
}

// stagingDesc describes a staging plan by value (nil: none).
func stagingDesc(st *fwdStaging) string {
	if st == nil {
		return "none"
	}
	return fmt.Sprintf("%+v", *st)
}

// TestForwardRelocate checks that a forward plan made with its staging
// copies at stagingPlanBase and moved to another address is the plan made
// with the copies there: the host path plans before it allocates the
// workspace. With O stored by a tensor map too, whose map (the output's)
// does not move.
func TestForwardRelocate(t *testing.T) {
	const at = 3<<40 + 256
	moved, storeO := 0, 0
	for _, c := range fwdRecordCases() {
		if !c.staging {
			continue
		}
		for _, pipe := range []kernels.Pipeline{{}, {StoreO: true}} {
			moved += relocateCase(t, c, pipe, at, &storeO)
		}
	}
	if moved == 0 || storeO == 0 {
		t.Fatalf("%d plans with staging copies, %d of them with O by a tensor map", moved, storeO)
	}
}

// relocateCase is one case of TestForwardRelocate: it returns 1 when the
// plan has staging copies (and counts the plans that store O by a tensor
// map in storeO).
func relocateCase(t *testing.T, c fwdRecordCase, pipe kernels.Pipeline, at uint64, storeO *int) int {
	t.Helper()
	p, ts, _, dopt := c.tensors(t)
	if p.Varlen {
		dopt.CuSeqlensQ, dopt.CuSeqlensK = &cuda.Buffer{}, &cuda.Buffer{}
	}
	b := &Backend{WGMMA: c.wgmma, TMA: c.tma, Pipeline: pipe}
	call := &fwdCall{p: p, dt: c.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4], opt: dopt}
	pl, err := b.planForward(call, nil, true)
	if err != nil || pl.st == nil {
		return 0
	}
	pl.moveStaging(nil, at)
	l, st, err := planStaging(b.request(call), nil, at)
	if err != nil {
		t.Fatalf("%s: %v", c.name, err)
	}
	if got, want := digest(pl.launch, *pl.st), digest(l, st); got != want {
		t.Errorf("%s %v: moved plan %s %+v\nwant %s %+v", c.name, pipe, pl.v.Name(), pl.tma, l.v.Name(), l.tma)
	}
	if pl.v.StoreO {
		*storeO++
		if o := pl.tma[3]; o.Addr != ts[3].ptr() || o.Cols != uint64(p.DV) {
			t.Errorf("%s: o's map %+v moved or not the output's %d columns", c.name, o, p.DV)
		}
	}
	return 1
}

// TestBackwardBind checks that a backward plan made on a workspace at
// address 0 and bound to another is the plan made on a workspace there:
// the host path plans before it allocates the workspace. Over the backward
// corpus and problems of the key-rows step's class, under the planner's
// knobs: none, the defaults New sets (the warp-specialized pipeline, the
// key-rows step where it measured faster, the staged bias under a mask),
// and the opt-in ones (bulk dQ; key rows, bulk dQ and staged bias
// everywhere). A plan with the tiled dQ accumulator keeps its strides (a
// bound plan that took the row layout's once added every head's dQ into
// head 0's tiles).
func TestBackwardBind(t *testing.T) {
	const at = 5<<40 + 256
	both := []attn.DType{attn.BFloat16, attn.Float16}
	cases := append(bwdCases(),
		bwdCase{name: "keyrows-d128-n1024", b: 2, n: 1024, m: 1024, h: 3, hkv: 3, dk: 128, dv: 128, dtypes: both},
		bwdCase{name: "keyrows-d128-causal-bias-gqa-n1040", b: 2, n: 1040, m: 1040, h: 4, hkv: 2, dk: 128, dv: 128, causal: true, bias: []int{1, 4}, biasGrad: true, dtypes: both[:1]},
		bwdCase{name: "bulk-d64-n300", b: 2, n: 300, m: 260, h: 3, hkv: 3, dk: 64, dv: 64, dtypes: both[:1]})
	knobs := []struct {
		name string
		set  func(r *bwdRequest)
	}{
		{"none", func(*bwdRequest) {}},
		{"defaults", func(r *bwdRequest) {
			r.ws, r.keyRowsAuto = DefaultBwdPipeline.WarpSpecialized, true
			r.biasStaged = (&Backend{BiasStagedAuto: true}).biasStaged()
		}},
		{"bulk dQ", func(r *bwdRequest) { r.ws, r.bulkDQ = true, true }},
		{"key rows, bulk dQ, staged bias", func(r *bwdRequest) { r.ws, r.keyRows, r.bulkDQ, r.biasStaged = true, true, true, true }},
	}
	tiled := 0
	for _, c := range cases {
		for _, dt := range c.dtypes {
			in := bwdRecordInputs(t, c, dt)
			for _, k := range knobs {
				for _, algo := range []DQAlgorithm{DQAuto, DQAtomic, DQSeparate} {
					r := in.request(algo)
					k.set(&r)
					pl, err := planBackward(r)
					if err != nil {
						t.Fatalf("%s %v %s %v: %v", c.name, dt, k.name, algo, err)
					}
					r.a.Workspace = at
					want, err := planBackward(r)
					if err != nil {
						t.Fatalf("%s %v %s %v: %v", c.name, dt, k.name, algo, err)
					}
					pl.bind(at)
					if got, w := digest(pl.v, pl.params.Pack(), pl.tma, pl.launches), digest(want.v, want.params.Pack(), want.tma, want.launches); got != w {
						t.Errorf("%s %v %s %v: bound plan %s differs from %s", c.name, dt, k.name, algo, pl.v.Name(), want.v.Name())
					}
					if pl.v.DQAccTiled() {
						tiled++
						sb, sh := kernels.BwdDQAccTiledStrides(in.p.N, in.p.H, kernels.BwdDQAccTiledCols(in.p.DK))
						if w := (kernels.BwdStrides{Batch: sb, Head: sh}); pl.params.DQAccS != w {
							t.Errorf("%s %v %s %v: bound %s's dQ accumulator strides %+v, want the tiled layout's %+v", c.name, dt, k.name, algo, pl.v.Name(), pl.params.DQAccS, w)
						}
					}
				}
			}
		}
	}
	if tiled == 0 {
		t.Errorf("no plan took the tiled dQ accumulator")
	}
}
