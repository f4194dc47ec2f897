package cp

import (
	"fmt"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestPlanCoversMask checks that the tasks of every rank over every step
// compute each visible pair of the global mask exactly once and nothing
// else (pair by pair, through the chunks' local and global places), and that under a causal mask the zigzag layout gives every rank
// the same work at every step, in one call at each (the first step's own
// block as one causal band).
func TestPlanCoversMask(t *testing.T) {
	for _, tc := range []struct {
		name string
		n, m int
		opt  attn.Options
	}{
		{"causal", 96, 96, attn.Options{Causal: true}},
		{"causal-bottom-right-n<m", 48, 96, attn.Options{Causal: true}},
		{"causal-top-left-n>m", 96, 48, attn.Options{Causal: true, Align: attn.AlignTopLeft}},
		{"window", 96, 96, attn.Options{Window: &attn.Window{Left: 9, Right: 4}}},
		{"full", 48, 96, attn.Options{}},
	} {
		for _, l := range []Layout{Contiguous, Zigzag} {
			for _, p := range []int{1, 2, 3, 4, 8} {
				t.Run(fmt.Sprintf("%s/%v/P=%d", tc.name, l, p), func(t *testing.T) {
					gp := &attn.Problem{N: tc.n, M: tc.m, Opt: tc.opt}
					gp.ResolveMask()
					want := 0
					for i := range tc.n {
						lo, hi := gp.KeyRange(i, tc.n, tc.m)
						want += max(0, min(hi, tc.m)-max(lo, 0))
					}
					c := l.numChunks(p)
					total := 0
					seen := make([]int, tc.n*tc.m) // how many calls compute each global pair
					for s := range p {
						work := make([]int, p)
						for r := range p {
							qs, ks := chunksFor(l, p, r, tc.n/c), chunksFor(l, p, (r-s+p)%p, tc.m/c)
							tasks, err := plan(gp, qs, ks)
							if err != nil {
								t.Fatal(err)
							}
							for _, tk := range tasks {
								work[r] += taskPairs(tk)
								markPairs(seen, tc.m, tk, qs, ks)
							}
							if l == Zigzag && tc.name == "causal" && len(tasks) != 1 {
								t.Errorf("step %d, rank %d: %d calls, want 1", s, r, len(tasks))
							}
						}
						for r := range p {
							total += work[r]
							if l == Zigzag && tc.name == "causal" && work[r] != work[0] {
								t.Errorf("step %d: rank %d computes %d pairs, rank 0 %d", s, r, work[r], work[0])
							}
						}
					}
					if total != want {
						t.Errorf("the tasks compute %d pairs, the mask has %d", total, want)
					}
					for i := range tc.n {
						lo, hi := gp.KeyRange(i, tc.n, tc.m)
						for j := range tc.m {
							if in := j >= lo && j < hi; seen[i*tc.m+j] != map[bool]int{false: 0, true: 1}[in] {
								t.Fatalf("pair (%d, %d), visible %v: computed %d times", i, j, in, seen[i*tc.m+j])
							}
						}
					}
				})
			}
		}
	}
}

// markPairs counts in seen (global pairs, m keys a row) the pairs task tk
// computes: its local rows and keys under its top-left window, placed in
// the global sequence by the chunks qs and ks.
func markPairs(seen []int, m int, tk task, qs, ks []chunk) {
	lp := attn.Problem{N: tk.nq, M: tk.nk, Opt: attn.Options{Align: attn.AlignTopLeft, Window: tk.window}}
	lp.ResolveMask()
	for i := range tk.nq {
		lo, hi := lp.KeyRange(i, tk.nq, tk.nk)
		for j := max(lo, 0); j < min(hi, tk.nk); j++ {
			seen[globalAt(qs, tk.q0+i-qs[0].local)*m+globalAt(ks, tk.k0+j-ks[0].local)]++
		}
	}
}

// TestBand checks the one call of a step whose visible pairs one window
// masks in the local order: zigzag's own block under a causal mask (one
// causal triangle over both chunks), and the steps it declines: two runs
// in a row (a sliding window over chunks apart in the global sequence),
// dropout, and chunks apart in the local buffer.
func TestBand(t *testing.T) {
	causal := attn.Options{Causal: true}
	tests := []struct {
		name   string
		opt    attn.Options
		qs, ks []chunk
		want   *task // nil: declined
	}{
		{"zigzag own block, causal", causal, chunksFor(Zigzag, 2, 0, 24), chunksFor(Zigzag, 2, 0, 24),
			&task{q0: 0, nq: 48, k0: 0, nk: 48, gq0: 0, gk0: 0, window: &attn.Window{Left: -1, Right: 0}}},
		{"zigzag own block of rank 1, causal", causal, chunksFor(Zigzag, 2, 1, 24), chunksFor(Zigzag, 2, 1, 24),
			&task{q0: 0, nq: 48, k0: 0, nk: 48, gq0: 24, gk0: 24, window: &attn.Window{Left: -1, Right: 0}}},
		{"zigzag own block, sliding window", attn.Options{Window: &attn.Window{Left: 9, Right: 4}}, chunksFor(Zigzag, 2, 0, 24), chunksFor(Zigzag, 2, 0, 24), nil},
		{"zigzag own block, dropout", attn.Options{Causal: true, Dropout: 0.1}, chunksFor(Zigzag, 2, 0, 24), chunksFor(Zigzag, 2, 0, 24), nil},
		{"chunks apart locally", causal, []chunk{{0, 0, 24}, {30, 72, 24}}, []chunk{{0, 0, 24}, {30, 72, 24}}, nil},
	}
	for _, tt := range tests {
		gp := &attn.Problem{N: 96, M: 96, Opt: tt.opt}
		gp.ResolveMask()
		got, ok := band(gp, tt.qs, tt.ks)
		if ok != (tt.want != nil) {
			t.Errorf("%s: band %v, want %v (%+v)", tt.name, ok, tt.want != nil, got)
			continue
		}
		if !ok {
			continue
		}
		w := *tt.want
		if got.q0 != w.q0 || got.nq != w.nq || got.k0 != w.k0 || got.nk != w.nk || got.gq0 != w.gq0 || got.gk0 != w.gk0 ||
			(got.window == nil) != (w.window == nil) || got.window != nil && *got.window != *w.window {
			t.Errorf("%s: %+v (window %v), want %+v (window %v)", tt.name, got, got.window, w, w.window)
		}
	}
}
