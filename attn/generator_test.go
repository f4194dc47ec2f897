package attn

import (
	"math"
	"sync"
	"testing"

	"github.com/flashattn/flashattn/philox"
)

type pair struct {
	seed   uint64
	offset uint32
}

func TestGeneratorSequence(t *testing.T) {
	tests := []struct {
		name  string
		start pair
		want  []pair
	}{
		{"from zero", pair{7, 0}, []pair{{7, 0}, {7, 1}, {7, 2}}},
		{"offset wraps into the seed", pair{7, math.MaxUint32 - 1}, []pair{{7, math.MaxUint32 - 1}, {7, math.MaxUint32}, {8, 0}, {8, 1}}},
		{"seed wraps too", pair{math.MaxUint64, math.MaxUint32}, []pair{{math.MaxUint64, math.MaxUint32}, {0, 0}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			g := NewGenerator(tc.start.seed)
			g.SetState(tc.start.seed, tc.start.offset)
			for i, w := range tc.want {
				if s, o := g.State(); (pair{s, o}) != w {
					t.Fatalf("State before call %d = (%d, %d), want %v", i, s, o, w)
				}
				if s, o := g.Next(); (pair{s, o}) != w {
					t.Fatalf("call %d: Next = (%d, %d), want %v", i, s, o, w)
				}
			}
		})
	}
	var zero Generator
	if s, o := zero.Next(); s != 0 || o != 0 {
		t.Errorf("zero Generator's first pair (%d, %d), want (0, 0)", s, o)
	}
}

func TestGeneratorDraw(t *testing.T) {
	g := NewGenerator(42)
	plain := Options{Causal: true, Seed: 5, Offset: 9}
	if got := g.Draw(plain); got.Seed != 5 || got.Offset != 9 {
		t.Fatalf("Draw without dropout changed the pair to (%d, %d)", got.Seed, got.Offset)
	}
	if s, o := g.State(); s != 42 || o != 0 {
		t.Fatalf("Draw without dropout advanced the generator to (%d, %d)", s, o)
	}
	drop := Options{Causal: true, Dropout: 0.1}
	a, b := g.Draw(drop), g.Draw(drop)
	if a.Seed != 42 || a.Offset != 0 || b.Seed != 42 || b.Offset != 1 {
		t.Fatalf("Draw pairs (%d, %d), (%d, %d); want (42, 0), (42, 1)", a.Seed, a.Offset, b.Seed, b.Offset)
	}
	if !a.Causal || a.Dropout != 0.1 {
		t.Fatal("Draw changed other options")
	}
}

// TestGeneratorMasksDiffer checks that successive pairs select different
// keep masks: the reason the generator exists.
func TestGeneratorMasksDiffer(t *testing.T) {
	g := NewGenerator(1)
	const rows, cols = 16, 64
	masks := make([][]bool, 3)
	for c := range masks {
		s, o := g.Next()
		m := philox.NewMask(s, o, 128, 0, 0, 1) // p = 0.5
		masks[c] = make([]bool, rows*cols)
		for i := range rows {
			m.KeepRow(i, 0, masks[c][i*cols:(i+1)*cols])
		}
	}
	for a := range masks {
		for b := a + 1; b < len(masks); b++ {
			same := 0
			for x := range masks[a] {
				if masks[a][x] == masks[b][x] {
					same++
				}
			}
			// Independent masks at p = 0.5 agree on about half of the elements.
			if frac := float64(same) / float64(len(masks[a])); frac > 0.6 {
				t.Errorf("calls %d and %d: masks agree on %.2f of the elements", a, b, frac)
			}
		}
	}
}

func TestGeneratorConcurrent(t *testing.T) {
	g := NewGenerator(3)
	const workers, per = 8, 500
	got := make([][]pair, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for range per {
				s, o := g.Next()
				got[w] = append(got[w], pair{s, o})
			}
		})
	}
	wg.Wait()
	seen := map[pair]bool{}
	for _, ps := range got {
		for _, p := range ps {
			if seen[p] {
				t.Fatalf("pair %v handed out twice", p)
			}
			seen[p] = true
		}
	}
	if s, o := g.State(); s != 3 || o != workers*per {
		t.Errorf("State after %d calls = (%d, %d)", workers*per, s, o)
	}
}
