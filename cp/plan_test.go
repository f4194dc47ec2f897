package cp

import (
	"fmt"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestPlanCoversMask checks that the tasks of every rank over every step
// compute each visible pair of the global mask exactly once and nothing
// else, and that under a causal mask the zigzag layout gives every rank
// the same work at every step, in at most one call after the first step.
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
					for s := range p {
						work := make([]int, p)
						for r := range p {
							tasks, err := plan(gp, chunksFor(l, p, r, tc.n/c), chunksFor(l, p, (r-s+p)%p, tc.m/c))
							if err != nil {
								t.Fatal(err)
							}
							for _, tk := range tasks {
								work[r] += taskPairs(tk)
							}
							if l == Zigzag && tc.name == "causal" && s > 0 && len(tasks) != 1 {
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
				})
			}
		}
	}
}
