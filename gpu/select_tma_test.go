package gpu

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// TestTMAStrides checks which q/k/v layouts the tensor memory accelerator
// takes and the byte strides (position, head, batch) their maps get.
func TestTMAStrides(t *testing.T) {
	cases := []struct {
		name    string
		shape   []int
		strides []int
		want    [3]uint64
		ok      bool
	}{
		{"contiguous", []int{2, 100, 8, 64}, nil, [3]uint64{8 * 64 * 2, 64 * 2, 100 * 8 * 64 * 2}, true},
		{"batch of one", []int{1, 100, 8, 64}, []int{0, 512, 64, 1}, [3]uint64{1024, 128, 16}, true},
		{"head-major", []int{2, 100, 8, 64}, []int{8 * 100 * 64, 64, 100 * 64, 1}, [3]uint64{128, 100 * 128, 8 * 100 * 128}, true},
		{"rows of 4-byte multiples", []int{2, 100, 8, 60}, nil, [3]uint64{}, false},
		{"padded rows", []int{2, 100, 8, 60}, []int{100 * 8 * 64, 8 * 64, 64, 1}, [3]uint64{1024, 128, 100 * 1024}, true},
		{"zero stride of a long dim", []int{2, 100, 8, 64}, []int{0, 512, 64, 1}, [3]uint64{}, false},
	}
	for _, c := range cases {
		tn := DeviceTensor{DType: attn.BFloat16, Shape: c.shape, Strides: c.strides}
		got, ok := tmaStrides(tn)
		if ok != c.ok || ok && got != c.want {
			t.Errorf("%s: tmaStrides = %v, %v; want %v, %v", c.name, got, ok, c.want, c.ok)
		}
	}
}

// TestTensorMapCache checks that the maps of the last launch are reused
// only for the same tensors (three for a forward, four for a backward), and
// that a failed encode is reported (naming the tensor) and replaces
// nothing.
func TestTensorMapCache(t *testing.T) {
	calls := 0
	encode := func(x kernels.TMATensor) (cuda.TensorMap, error) {
		calls++
		if x.Addr == 0 {
			return cuda.TensorMap{}, cuda.ErrArgument
		}
		var m cuda.TensorMap
		m[0], m[1] = byte(x.Addr), byte(x.Rows)
		return m, nil
	}
	key := []kernels.TMATensor{{Addr: 1, Rows: 10}, {Addr: 2, Rows: 20}, {Addr: 3, Rows: 20}}
	var c tensorMapCache
	steps := []struct {
		name  string
		key   []kernels.TMATensor
		calls int // encodes so far
		err   bool
	}{
		{"first launch", key, 3, false},
		{"same tensors", key, 3, false},
		{"other k", []kernels.TMATensor{key[0], {Addr: 4, Rows: 20}, key[2]}, 6, false},
		{"back to the first", key, 9, false},
		{"bad v", []kernels.TMATensor{key[0], key[1], {Rows: 20}}, 12, true},
		{"after the failure: the last good maps stay", key, 12, false},
		{"four tensors (a backward)", append(slices.Clone(key), kernels.TMATensor{Addr: 5, Rows: 30}), 16, false},
		{"back to three", key, 19, false},
	}
	for _, s := range steps {
		names := fwdTMANames(kernels.Variant{})
		if len(s.key) == 4 {
			names = bwdTMANames
		}
		maps, err := c.get(s.key, names, encode)
		if s.err {
			if !errors.Is(err, cuda.ErrArgument) || !strings.Contains(err.Error(), "tensor map of v") {
				t.Errorf("%s: err %v, want ErrArgument naming v", s.name, err)
			}
		} else if err != nil {
			t.Errorf("%s: %v", s.name, err)
		}
		if calls != s.calls {
			t.Errorf("%s: %d encodes so far, want %d", s.name, calls, s.calls)
		}
		if !s.err {
			for i, x := range s.key {
				if maps[i][0] != byte(x.Addr) || maps[i][1] != byte(x.Rows) {
					t.Errorf("%s: map %d is % x, want the map of %+v", s.name, i, maps[i][:2], x)
				}
			}
		}
	}
}

// TestPlanFlatRows checks when the forward planner reads odd head dims in
// place over flat rows (kernels.Variant.Flat) instead of leaving them to
// the staging copies, and the tensor maps it describes for them.
func TestPlanFlatRows(t *testing.T) {
	cases := []struct {
		name           string
		h, hkv, dk, dv int
		headMajor      bool
		flat           bool
	}{
		{"d199 eight heads", 8, 8, 199, 199, false, true},
		{"d201 dv185", 16, 16, 201, 185, false, true},
		{"d257", 8, 8, 257, 257, false, true},
		{"grouped heads", 8, 4, 199, 199, false, false},
		{"heads not a multiple of 8", 10, 10, 199, 199, false, false},
		{"no room for the shift (d59)", 8, 8, 59, 59, false, false},
		{"head-major layout", 8, 8, 199, 199, true, false},
		{"even rows need no flat maps", 8, 8, 200, 200, false, false},
		{"d60: its shifts 0 and 4 fit", 8, 8, 60, 60, false, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			const bsz, n = 2, 100
			p, q, k, v, o, lse := planTestTensors(t, bsz, n, c.h, c.hkv, c.dk, c.dv, c.headMajor)
			l, err := plan(fwdRequest{p: p, dt: attn.BFloat16, q: q, k: k, v: v, o: o, lse: lse, hopper: true, tma: true})
			if err != nil {
				t.Fatalf("plan: %v", err)
			}
			if l.v.Flat != c.flat {
				t.Fatalf("plan %s: Flat = %v, want %v", l.v.Name(), l.v.Flat, c.flat)
			}
			if !c.flat {
				return
			}
			if !l.v.TMA || l.v.LoadBytes != 16 {
				t.Errorf("flat plan %s without tensor maps or 16-byte rows", l.v.Name())
			}
			for i, x := range l.tma {
				d, h := c.dk, c.h
				if i == 2 {
					d, h = c.dv, c.hkv
				}
				want := [3]uint64{uint64(h * d * 2), 16, uint64(n * h * d * 2)}
				if x.Cols != uint64(h*d) || x.Heads != 1 || x.Strides != want {
					t.Errorf("map %d: cols %d heads %d strides %v; want %d, 1, %v", i, x.Cols, x.Heads, x.Strides, h*d, want)
				}
				if err := tensorMapSpec(x).Check(); err != nil {
					t.Errorf("map %d: %v", i, err)
				}
			}
		})
	}
}

// TestPlanFlatStaged checks the forward's staging plan where flat rows fit
// only some heads (kernels.Variant.FlatStaged): copies of exactly the
// heads kernels.FlatStagedHeads selects, their tensor maps after the
// in-place ones, and every head copied where flat rows cannot be read.
func TestPlanFlatStaged(t *testing.T) {
	cases := []struct {
		name           string
		h, hkv, dk, dv int
		staged         bool
		kept           [3]int // heads each copy holds
	}{
		{"d59 sixteen heads", 16, 16, 59, 59, true, [3]int{4, 4, 4}},
		{"d123 dv64", 8, 8, 123, 64, true, [3]int{2, 2, 0}},
		{"d187 dv59", 24, 24, 187, 59, true, [3]int{6, 6, 6}},
		{"d127: six heads in eight past the width, every head staged", 8, 8, 127, 127, false, [3]int{8, 8, 8}},
		{"d62: half the heads past the width, every head staged", 12, 12, 62, 62, false, [3]int{12, 12, 12}},
		{"grouped heads: every head staged", 16, 8, 59, 59, false, [3]int{16, 8, 8}},
	}
	b := &Backend{WGMMA: true, TMA: true}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			const bsz, n = 2, 100
			p, q, k, v, o, lse := planTestTensors(t, bsz, n, c.h, c.hkv, c.dk, c.dv, false)
			l, st, err := b.planStagingFor(p, q, k, v, o, lse, DeviceOptions{})
			if err != nil {
				t.Fatalf("planStaging: %v", err)
			}
			if l.v.FlatStaged != c.staged || l.v.Flat != c.staged {
				t.Fatalf("plan %s: Flat %v FlatStaged %v, want %v", l.v.Name(), l.v.Flat, l.v.FlatStaged, c.staged)
			}
			var bytes int64
			for i, view := range st.views {
				d := view.Shape[3]
				kept := view.Shape[2]
				if kept != c.kept[i] {
					t.Errorf("copy %d holds %d heads, want %d", i, kept, c.kept[i])
				}
				bytes += align256(int64(bsz * n * kept * kernels.StagedDim(d) * 2))
				pp := st.params[i]
				if kept == 0 {
					if pp.Rows != 0 {
						t.Errorf("copy %d: no heads, but %d rows to pack", i, pp.Rows)
					}
					continue
				}
				if c.staged && (pp.HeadMask == 0 || kernels.FlatStagedCount(int(pp.Heads), pp.HeadMask) != kept) {
					t.Errorf("copy %d: head mask %08b of %d heads, want %d of them", i, pp.HeadMask, pp.Heads, kept)
				}
				if !c.staged && pp.HeadMask != 0 {
					t.Errorf("copy %d: head mask %08b in a whole staging", i, pp.HeadMask)
				}
			}
			if st.bytes != bytes {
				t.Errorf("staging bytes %d, want %d", st.bytes, bytes)
			}
			if !c.staged {
				return
			}
			if len(l.tma) != 6 {
				t.Fatalf("%d tensor maps, want 6", len(l.tma))
			}
			for i, x := range l.tma[3:] {
				if c.kept[i] == 0 {
					if x != l.tma[i] {
						t.Errorf("map %d: a copy of no heads, want the in-place map in its place", 3+i)
					}
					continue
				}
				if x.Addr != st.views[i].ptr() || x.Heads != uint64(c.kept[i]) {
					t.Errorf("map %d: address %#x heads %d, want %#x, %d", 3+i, x.Addr, x.Heads, st.views[i].ptr(), c.kept[i])
				}
				if err := tensorMapSpec(x).Check(); err != nil {
					t.Errorf("map %d: %v", 3+i, err)
				}
			}
		})
	}
}

// planTestTensors returns a bf16 problem of bsz × n positions and device
// tensors that stand for its q, k, v (heads contiguous, or head-major),
// o and lse at fake addresses, for planner tests.
func planTestTensors(t *testing.T, bsz, n, h, hkv, dk, dv int, headMajor bool) (p *attn.Problem, q, k, v, o, lse DeviceTensor) {
	t.Helper()
	ten := func(h, d int) DeviceTensor {
		x := DeviceTensor{DType: attn.BFloat16, Shape: []int{bsz, n, h, d}, base: 1 << 40}
		if headMajor {
			x.Strides = []int{h * n * d, d, n * d, 1}
		}
		return x
	}
	q, k, v = ten(h, dk), ten(hkv, dk), ten(hkv, dv)
	p, err := attn.NewProblem(attn.New(attn.BFloat16, q.Shape...), attn.New(attn.BFloat16, k.Shape...), attn.New(attn.BFloat16, v.Shape...), attn.Options{})
	if err != nil {
		t.Fatal(err)
	}
	o = DeviceTensor{DType: attn.BFloat16, Shape: p.OutputShape(), base: 1 << 41}
	lse = DeviceTensor{DType: attn.Float32, Shape: p.LSEShape(), base: 1 << 42}
	return p, q, k, v, o, lse
}

// planStagingFor is planStaging of a call with the backend's knobs, the
// copies at stagingPlanBase.
func (b *Backend) planStagingFor(p *attn.Problem, q, k, v, o, lse DeviceTensor, opt DeviceOptions) (launch, fwdStaging, error) {
	c := &fwdCall{p: p, dt: q.DType, q: q, k: k, v: v, o: o, lse: lse, opt: opt}
	return planStaging(b.request(c), nil, stagingPlanBase)
}

// TestPipelineFor checks that the planner keeps each part of the backend's
// pipeline only where the variant takes it.
func TestPipelineFor(t *testing.T) {
	all := kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true, Persistent: true}
	hopper := func(d int, tma bool) kernels.Variant {
		v := kernels.Variant{DType: attn.BFloat16, DK: d, DV: d, LoadBytes: 16, LSE: true}
		tl, _ := kernels.HopperTile(v)
		v = tl.Apply(v)
		v.TMA = tma
		return v
	}
	cases := []struct {
		name string
		v    kernels.Variant
		want kernels.Pipeline
	}{
		{"d128-tma", hopper(128, true), all},
		{"d128-cp.async", hopper(128, false), kernels.Pipeline{EarlyRescale: true}},
		{"d320-tma", hopper(320, true), kernels.Pipeline{WarpSpecialized: true, PingPong: true, Persistent: true}},
		{"d512-tma", hopper(512, true), kernels.Pipeline{}},
		{"d128-flat", func() kernels.Variant { v := hopper(128, true); v.Flat = true; return v }(), kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}},
	}
	for _, c := range cases {
		if got := pipelineFor(c.v, all); got != c.want {
			t.Errorf("%s: pipelineFor = %v, want %v", c.name, got, c.want)
		}
		if got := pipelineFor(c.v, kernels.Pipeline{}); got != (kernels.Pipeline{}) {
			t.Errorf("%s: pipelineFor(lockstep) = %v", c.name, got)
		}
	}
}

// TestPlansRefuseDropoutOrigin checks that both planners, which host-tensor
// and device calls share, refuse a dropout origin the kernels cannot draw
// (a key origin not a multiple of 16) and take an aligned one.
func TestPlansRefuseDropoutOrigin(t *testing.T) {
	q := attn.New(attn.BFloat16, 1, 32, 2, 64)
	for _, c := range []struct {
		at   attn.DropoutOrigin
		want error
	}{
		{attn.DropoutOrigin{Key: 8}, attn.ErrUnsupported},
		{attn.DropoutOrigin{Query: 3, Key: 1 << 31}, attn.ErrUnsupported},
		{attn.DropoutOrigin{Query: 3, Key: 32, Head: 1, Heads: 4}, nil},
	} {
		p, err := attn.NewProblem(q, q, q, attn.Options{Dropout: 0.1, DropoutAt: &c.at})
		if err != nil {
			t.Fatal(err)
		}
		if err := checkDropoutAt(p); !errors.Is(err, c.want) && !(c.want == nil && err == nil) {
			t.Errorf("origin %+v: %v, want %v", c.at, err, c.want)
		}
		if c.want == nil {
			continue
		}
		if _, err := plan(fwdRequest{p: p}); !errors.Is(err, c.want) {
			t.Errorf("forward plan, origin %+v: %v, want %v", c.at, err, c.want)
		}
		if _, err := planBackward(bwdRequest{p: p, dt: attn.BFloat16}); !errors.Is(err, c.want) {
			t.Errorf("backward plan, origin %+v: %v, want %v", c.at, err, c.want)
		}
	}
}
