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
		names := fwdTMANames
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
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			const bsz, n = 2, 100
			ten := func(h, d int) DeviceTensor {
				x := DeviceTensor{DType: attn.BFloat16, Shape: []int{bsz, n, h, d}, base: 1 << 40}
				if c.headMajor {
					x.Strides = []int{h * n * d, d, n * d, 1}
				}
				return x
			}
			q, k, v := ten(c.h, c.dk), ten(c.hkv, c.dk), ten(c.hkv, c.dv)
			p, err := attn.NewProblem(attn.New(attn.BFloat16, q.Shape...), attn.New(attn.BFloat16, k.Shape...), attn.New(attn.BFloat16, v.Shape...), attn.Options{})
			if err != nil {
				t.Fatal(err)
			}
			o := DeviceTensor{DType: attn.BFloat16, Shape: p.OutputShape(), base: 1 << 41}
			lse := DeviceTensor{DType: attn.Float32, Shape: p.LSEShape(), base: 1 << 42}
			l, err := plan(p, attn.BFloat16, q, k, v, o, lse, nil, 0, 0, nil, false, true, true)
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
