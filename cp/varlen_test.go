package cp

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
)

// packedCase is one packed global problem of the varlen accuracy table.
type packedCase struct {
	name     string
	cuQ, cuK []int32
	h, hkv   int
	dk, dv   int
	opt      attn.Options
	bf16     bool // run in bfloat16 as well as float32
}

// Sequence lengths are multiples of 24, so that every P ≤ 4 and its 2P
// zigzag chunks divide them; each table has an empty segment.
var packedCases = []packedCase{
	{"full-gqa", []int32{0, 24, 24, 72, 120}, []int32{0, 24, 24, 72, 120}, 4, 2, 8, 8, attn.Options{}, true},
	{"causal-top-left", []int32{0, 48, 48, 72}, []int32{0, 48, 48, 72}, 2, 2, 8, 8,
		attn.Options{Causal: true, Align: attn.AlignTopLeft}, false},
	{"causal-bottom-right", []int32{0, 24, 24, 96}, []int32{0, 24, 24, 96}, 4, 4, 8, 8, attn.Options{Causal: true}, true},
	// Queries and keys of different lengths: sequence 1 has keys and no
	// queries, sequence 2 queries and no keys.
	{"causal-bottom-right-n!=m-gqa-dk!=dv", []int32{0, 24, 24, 48, 120}, []int32{0, 48, 72, 72, 96}, 4, 2, 8, 16,
		attn.Options{Causal: true}, true},
	{"causal-top-left-n!=m-mqa", []int32{0, 24, 24, 48, 120}, []int32{0, 48, 72, 72, 96}, 4, 1, 8, 8,
		attn.Options{Causal: true, Align: attn.AlignTopLeft}, false},
	{"window-softcap", []int32{0, 48, 48, 96}, []int32{0, 24, 24, 96}, 2, 2, 8, 8,
		attn.Options{Window: &attn.Window{Left: 5, Right: 3}, Softcap: 4}, false},
	{"dropout-causal-placed", []int32{0, 24, 24, 72}, []int32{0, 48, 48, 72}, 4, 2, 8, 8,
		attn.Options{Causal: true, Dropout: 0.2, Seed: 5, Offset: 1, DropoutAt: &attn.DropoutOrigin{Query: 3, Key: 2, Head: 1, Heads: 6}}, false},
	{"dropout-full", []int32{0, 48, 48, 96}, []int32{0, 24, 24, 48}, 2, 2, 8, 8, attn.Options{Dropout: 0.3, Seed: 9}, false},
}

// TestPackedMatchesSingleDevice checks that every scheme and layout on
// P = 1 … 4 in-process ranks splits packed variable-length batches with
// outputs and gradients equal to the single-device packed call's oracle
// within the accuracy criterion.
func TestPackedMatchesSingleDevice(t *testing.T) {
	r := rand.New(rand.NewPCG(21, 22))
	for _, tc := range packedCases {
		t.Run(tc.name, func(t *testing.T) {
			dts := []attn.DType{attn.Float32}
			if tc.bf16 {
				dts = append(dts, attn.BFloat16)
			}
			for _, dt := range dts {
				t.Run(dt.String(), func(t *testing.T) {
					tq, tk := int(tc.cuQ[len(tc.cuQ)-1]), int(tc.cuK[len(tc.cuK)-1])
					opt := tc.opt
					opt.CuSeqlensQ, opt.CuSeqlensK = tc.cuQ, tc.cuK
					q, k, v := normal(r, dt, tq, tc.h, tc.dk), normal(r, dt, tk, tc.hkv, tc.dk), normal(r, dt, tk, tc.hkv, tc.dv)
					checkSplits(t, dt, q, k, v, normal(r, dt, tq, tc.h, tc.dv), opt, []int{1, 2, 3, 4})
				})
			}
		})
	}
}

func TestPackedShards(t *testing.T) {
	cu := []int32{0, 4, 4, 12}
	for _, tc := range []struct {
		l      Layout
		p      int
		local  []int32
		pos    [][]int // per rank
		packed [][]int // per rank: packed indices of the local tokens
	}{
		{Contiguous, 2, []int32{0, 2, 2, 6}, [][]int{{0, 1, 0, 1, 2, 3}, {2, 3, 4, 5, 6, 7}},
			[][]int{{0, 1, 4, 5, 6, 7}, {2, 3, 8, 9, 10, 11}}},
		{Zigzag, 2, []int32{0, 2, 2, 6}, [][]int{{0, 3, 0, 1, 6, 7}, {1, 2, 2, 3, 4, 5}},
			[][]int{{0, 3, 4, 5, 10, 11}, {1, 2, 6, 7, 8, 9}}},
		{Contiguous, 1, cu, [][]int{{0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7}}, [][]int{{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}}},
	} {
		local, err := LocalCuSeqlens(cu, tc.l, tc.p)
		if err != nil || !slices.Equal(local, tc.local) {
			t.Errorf("LocalCuSeqlens(%v, %v, %d) = %v, %v; want %v", cu, tc.l, tc.p, local, err, tc.local)
		}
		// Tokens numbered by packed index, two heads, along axis 0; the
		// same numbers along axis 1 for an LSE-like [H, total].
		x := iota32(12, 2)
		lse := attn.New(attn.Float32, 2, 12)
		for i := range lse.F32 {
			lse.F32[i] = float32(i % 12)
		}
		var shards, lseShards []attn.Tensor
		for r := range tc.p {
			pos, err := PackedPositions(tc.l, cu, tc.p, r)
			if err != nil || !slices.Equal(pos, tc.pos[r]) {
				t.Errorf("PackedPositions(%v, %v, %d, %d) = %v, %v; want %v", tc.l, cu, tc.p, r, pos, err, tc.pos[r])
			}
			s, err := ShardPacked(x, 0, cu, tc.l, tc.p, r)
			if err != nil {
				t.Fatal(err)
			}
			ls, err := ShardPacked(lse, 1, cu, tc.l, tc.p, r)
			if err != nil {
				t.Fatal(err)
			}
			var got, gotL []int
			for i := 0; i < len(s.F32); i += 2 {
				got = append(got, int(s.F32[i])/2)
			}
			for _, f := range ls.F32[:len(ls.F32)/2] {
				gotL = append(gotL, int(f))
			}
			if !slices.Equal(got, tc.packed[r]) || !slices.Equal(gotL, tc.packed[r]) {
				t.Errorf("%v P=%d rank %d: shard holds tokens %v (LSE %v), want %v", tc.l, tc.p, r, got, gotL, tc.packed[r])
			}
			shards, lseShards = append(shards, s), append(lseShards, ls)
		}
		back, err := UnshardPacked(shards, 0, cu, tc.l)
		if err != nil || !slices.Equal(back.F32, x.F32) {
			t.Errorf("%v P=%d: UnshardPacked = %v, %v; want %v", tc.l, tc.p, back.F32, err, x.F32)
		}
		backL, err := UnshardPacked(lseShards, 1, cu, tc.l)
		if err != nil || !slices.Equal(backL.F32, lse.F32) {
			t.Errorf("%v P=%d: UnshardPacked (LSE) = %v, %v; want %v", tc.l, tc.p, backL.F32, err, lse.F32)
		}
	}
}

func TestPackedShardErrors(t *testing.T) {
	x := iota32(12, 2)
	for _, tc := range []struct {
		name string
		cu   []int32
		l    Layout
		p, r int
		want error
	}{
		{"uneven contiguous", []int32{0, 3, 12}, Contiguous, 2, 0, attn.ErrShape},
		{"uneven zigzag", []int32{0, 6, 12}, Zigzag, 2, 1, attn.ErrShape},
		{"total differs", []int32{0, 4, 8}, Contiguous, 2, 0, attn.ErrShape},
		{"decreasing", []int32{0, 8, 4, 12}, Contiguous, 2, 0, attn.ErrOption},
		{"not from zero", []int32{2, 12}, Contiguous, 2, 0, attn.ErrOption},
		{"too short", []int32{0}, Contiguous, 2, 0, attn.ErrOption},
		{"bad rank", []int32{0, 12}, Contiguous, 2, 2, attn.ErrOption},
		{"bad layout", []int32{0, 12}, 7, 2, 0, attn.ErrOption},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := ShardPacked(x, 0, tc.cu, tc.l, tc.p, tc.r); !errors.Is(err, tc.want) {
				t.Errorf("ShardPacked: %v, want an error wrapping %v", err, tc.want)
			}
			if tc.name == "total differs" || tc.name == "bad rank" {
				return
			}
			if _, err := LocalCuSeqlens(tc.cu, tc.l, tc.p); !errors.Is(err, tc.want) {
				t.Errorf("LocalCuSeqlens: %v, want an error wrapping %v", err, tc.want)
			}
			if _, err := PackedPositions(tc.l, tc.cu, tc.p, tc.r); !errors.Is(err, tc.want) {
				t.Errorf("PackedPositions: %v, want an error wrapping %v", err, tc.want)
			}
		})
	}
	shards := []attn.Tensor{iota32(6, 2), iota32(6, 2)}
	for _, tc := range []struct {
		name   string
		shards []attn.Tensor
		cu     []int32
		want   error
	}{
		{"no shards", nil, []int32{0, 12}, attn.ErrShape},
		{"shapes differ", []attn.Tensor{iota32(6, 2), iota32(5, 2)}, []int32{0, 12}, attn.ErrShape},
		{"total differs", shards, []int32{0, 16}, attn.ErrShape},
		{"uneven", shards, []int32{0, 5, 12}, attn.ErrShape},
		{"decreasing", shards, []int32{0, 8, 6, 12}, attn.ErrOption},
	} {
		t.Run("unshard "+tc.name, func(t *testing.T) {
			if _, err := UnshardPacked(tc.shards, 0, tc.cu, Contiguous); !errors.Is(err, tc.want) {
				t.Errorf("UnshardPacked: %v, want an error wrapping %v", err, tc.want)
			}
		})
	}
}

// TestPackedRefused checks the packed batches context parallelism refuses,
// through Sim and through one rank's Attention, and Strategy.CheckPacked.
func TestPackedRefused(t *testing.T) {
	r := rand.New(rand.NewPCG(23, 24))
	x := normal(r, attn.Float32, 48, 2, 8)
	cu := []int32{0, 24, 24, 48}
	uneven := []int32{0, 20, 48}
	for _, tc := range []struct {
		name string
		sim  Sim
		opt  attn.Options
		want error
	}{
		{"uneven ring", Sim{P: 3}, attn.Options{CuSeqlensQ: uneven, CuSeqlensK: uneven}, attn.ErrShape},
		{"uneven zigzag keys", Sim{P: 2, Layout: Zigzag}, attn.Options{CuSeqlensQ: cu, CuSeqlensK: []int32{0, 22, 22, 48}}, attn.ErrShape},
		{"uneven a2a", Sim{P: 3, Scheme: AllToAll}, attn.Options{CuSeqlensQ: uneven, CuSeqlensK: uneven}, attn.ErrShape},
		{"a2a beyond the key heads", Sim{P: 4, Scheme: AllToAll}, attn.Options{CuSeqlensQ: cu, CuSeqlensK: cu}, attn.ErrUnsupported},
		{"only q offsets", Sim{P: 2}, attn.Options{CuSeqlensQ: cu}, attn.ErrOption},
		{"offsets past the tokens", Sim{P: 2}, attn.Options{CuSeqlensQ: []int32{0, 24, 96}, CuSeqlensK: cu}, attn.ErrOption},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.sim.Backend, tc.sim.Timeout = cpu.New(), testTimeout
			if _, err := tc.sim.Forward(x, x, x, tc.opt); !errors.Is(err, tc.want) {
				t.Errorf("Forward: error %v, want one wrapping %v", err, tc.want)
			}
			lse := normal(r, attn.Float32, 2, 48)
			if _, err := tc.sim.Backward(x, x, x, x, lse, x, tc.opt); !errors.Is(err, tc.want) {
				t.Errorf("Backward: error %v, want one wrapping %v", err, tc.want)
			}
		})
	}
	// One rank given shards that do not hold 1/P of the offsets.
	err := Run(context.Background(), 2, func(ctx context.Context, tr Transport) error {
		a := &Attention{Backend: cpu.New(), Transport: tr}
		_, err := a.Forward(ctx, x, x, x, attn.Options{CuSeqlensQ: cu, CuSeqlensK: cu})
		return err
	})
	if !errors.Is(err, attn.ErrOption) {
		t.Errorf("shards of the global size: %v, want an error wrapping attn.ErrOption", err)
	}
	for _, tc := range []struct {
		s        Strategy
		cuQ, cuK []int32
		hkv, p   int
		want     error
	}{
		{ZigzagStrategy, cu, cu, 2, 5, attn.ErrShape},
		{RingStrategy, cu, uneven, 2, 3, attn.ErrShape},
		{AllToAllStrategy, cu, cu, 2, 4, attn.ErrUnsupported},
		{RingStrategy, cu, cu, 2, 0, attn.ErrOption},
	} {
		if err := tc.s.CheckPacked(tc.cuQ, tc.cuK, tc.hkv, tc.p); !errors.Is(err, tc.want) {
			t.Errorf("%v.CheckPacked(%v, %v, %d, %d) = %v, want an error wrapping %v", tc.s, tc.cuQ, tc.cuK, tc.hkv, tc.p, err, tc.want)
		}
	}
	for _, s := range Strategies() {
		if err := s.CheckPacked(cu, cu, 2, 2); err != nil {
			t.Errorf("%v.CheckPacked(%v, 2 heads, 2 ranks): %v", s, cu, err)
		}
	}
}

// TestPackedCalls checks the ring's packing of the calls of a step: one
// call per window without dropout (zigzag's own block one causal band), one per
// block and sequence with it.
func TestPackedCalls(t *testing.T) {
	cu := []int32{0, 8, 8, 24}
	for _, tc := range []struct {
		name  string
		opt   attn.Options
		l     Layout
		owner int
		calls int
	}{
		{"full", attn.Options{}, Contiguous, 1, 1},
		{"causal own block", attn.Options{Causal: true}, Contiguous, 0, 1},
		{"causal zigzag own block: one causal band", attn.Options{Causal: true}, Zigzag, 0, 1},
		{"causal zigzag own block under dropout: three blocks a sequence", attn.Options{Causal: true, Dropout: 0.1}, Zigzag, 0, 6},
		{"causal zigzag later block", attn.Options{Causal: true}, Zigzag, 1, 1},
		{"dropout full", attn.Options{Dropout: 0.1}, Contiguous, 1, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opt := tc.opt
			opt.CuSeqlensQ, opt.CuSeqlensK = cu, cu
			gp := &attn.Problem{Varlen: true, N: 16, M: 16, Opt: opt}
			gp.ResolveMask()
			tasks, err := packedTasks(gp, tc.l, 2, 0, tc.owner)
			if err != nil {
				t.Fatal(err)
			}
			if len(tasks) != tc.calls {
				t.Errorf("%d calls, want %d: %+v", len(tasks), tc.calls, tasks)
			}
			for _, tk := range tasks {
				if int(tk.cuQ[len(tk.cuQ)-1]) != tk.nq || int(tk.cuK[len(tk.cuK)-1]) != tk.nk || len(tk.cuQ) != len(tk.cuK) {
					t.Errorf("task %+v: cu_seqlens do not cover its %d queries and %d keys", tk, tk.nq, tk.nk)
				}
			}
		})
	}
}
