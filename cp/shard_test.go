package cp

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// iota32 returns a tensor of shape whose elements are 0, 1, 2, … in
// row-major order.
func iota32(shape ...int) attn.Tensor {
	t := attn.New(attn.Float32, shape...)
	for i := range t.F32 {
		t.F32[i] = float32(i)
	}
	return t
}

func TestPositions(t *testing.T) {
	for _, tc := range []struct {
		l    Layout
		n, p int
		want [][]int
	}{
		{Contiguous, 6, 3, [][]int{{0, 1}, {2, 3}, {4, 5}}},
		{Zigzag, 8, 2, [][]int{{0, 1, 6, 7}, {2, 3, 4, 5}}},
		{Zigzag, 6, 3, [][]int{{0, 5}, {1, 4}, {2, 3}}},
		{Zigzag, 4, 1, [][]int{{0, 1, 2, 3}}},
	} {
		for r, want := range tc.want {
			got, err := Positions(tc.l, tc.n, tc.p, r)
			if err != nil || !slices.Equal(got, want) {
				t.Errorf("Positions(%v, %d, %d, %d) = %v, %v; want %v", tc.l, tc.n, tc.p, r, got, err, want)
			}
		}
	}
}

func TestShardRoundTrip(t *testing.T) {
	for _, l := range []Layout{Contiguous, Zigzag} {
		for _, p := range []int{1, 2, 3, 4, 8} {
			t.Run(fmt.Sprintf("%v/P=%d", l, p), func(t *testing.T) {
				n := 48
				// A [B, H, N] view of a [B, N, H] buffer: strided input.
				base := iota32(2, n, 3)
				lse := attn.Tensor{DType: attn.Float32, Shape: []int{2, 3, n}, Strides: []int{3 * n, 1, 3}, F32: base.F32}
				for _, x := range []struct {
					t    attn.Tensor
					axis int
				}{{iota32(2, n, 3, 2), 1}, {lse, 2}} {
					shards := make([]attn.Tensor, p)
					for r := range p {
						s, err := Shard(x.t, x.axis, l, p, r)
						if err != nil {
							t.Fatal(err)
						}
						pos, _ := Positions(l, n, p, r)
						for i, g := range pos {
							if got, want := narrow(s, x.axis, i, 1).Float32s(), narrow(x.t, x.axis, g, 1).Float32s(); !slices.Equal(got, want) {
								t.Fatalf("rank %d local %d: %v, want global %d %v", r, i, got, g, want)
							}
						}
						shards[r] = s
					}
					back, err := Unshard(shards, x.axis, l)
					if err != nil {
						t.Fatal(err)
					}
					if !slices.Equal(back.Float32s(), x.t.Float32s()) {
						t.Fatalf("unshard does not give the input back")
					}
				}
			})
		}
	}
}

func TestShardErrors(t *testing.T) {
	x := iota32(1, 12, 2, 2)
	for _, tc := range []struct {
		name string
		err  error
		want error
	}{
		{"contiguous uneven", func() error { _, err := Shard(x, 1, Contiguous, 5, 0); return err }(), attn.ErrShape},
		{"zigzag uneven", func() error { _, err := Shard(x, 1, Zigzag, 4, 0); return err }(), attn.ErrShape},
		{"positions uneven", func() error { _, err := Positions(Zigzag, 10, 3, 0); return err }(), attn.ErrShape},
		{"axis", func() error { _, err := Shard(x, 4, Contiguous, 2, 0); return err }(), attn.ErrShape},
		{"rank", func() error { _, err := Shard(x, 1, Contiguous, 2, 2); return err }(), attn.ErrOption},
		{"layout", func() error { _, err := Positions(Layout(7), 12, 2, 0); return err }(), attn.ErrOption},
		{"unshard none", func() error { _, err := Unshard(nil, 1, Zigzag); return err }(), attn.ErrShape},
		{"unshard shapes", func() error { _, err := Unshard([]attn.Tensor{x, iota32(1, 10, 2, 2)}, 1, Zigzag); return err }(), attn.ErrShape},
		{"unshard odd zigzag", func() error { _, err := Unshard([]attn.Tensor{iota32(1, 3, 2, 2)}, 1, Zigzag); return err }(), attn.ErrShape},
	} {
		if !errors.Is(tc.err, tc.want) {
			t.Errorf("%s: error %v, want one wrapping %v", tc.name, tc.err, tc.want)
		}
	}
}
