package main

import (
	"encoding/json"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"

	"github.com/flashattn/flashattn"
	"github.com/flashattn/flashattn/bench"
	"github.com/flashattn/flashattn/cp"
)

// TestRunRingSim checks that run --ring-sim P writes the outputs and
// gradients of the plain run, within FlashAttention's criterion (the
// difference of two computations in the compute dtype, relative to the
// largest output: 1e-5 for fp32, a few units of bf16 roundoff), for each
// scheme, causal and not, GQA, DK ≠ DV, N ≠ M and packed variable-length
// batches with an empty segment (auto too).
func TestRunRingSim(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir()) // where --cp-scheme auto caches its profile
	rng := rand.New(rand.NewPCG(9, 10))
	for _, tc := range []struct {
		name    string
		q, k, v []int
		flags   []string
		tol     float64
		explain string // text stdout must hold
	}{
		{"default zigzag causal gqa", []int{1, 16, 4, 8}, []int{1, 16, 2, 8}, []int{1, 16, 2, 8},
			[]string{"--ring-sim", "4", "--causal"}, 1e-5, ""},
		{"ring full n<m dk!=dv", []int{2, 8, 2, 8}, []int{2, 16, 2, 8}, []int{2, 16, 2, 4},
			[]string{"--ring-sim", "2", "--cp-scheme", "ring"}, 1e-5, ""},
		{"a2a causal top-left", []int{1, 12, 4, 8}, []int{1, 12, 4, 8}, []int{1, 12, 4, 8},
			[]string{"--ring-sim", "4", "--cp-scheme", "a2a", "--causal", "--align", "top-left"}, 1e-5, ""},
		{"zigzag bf16 causal bottom-right n>m", []int{1, 24, 2, 16}, []int{1, 12, 1, 16}, []int{1, 12, 1, 16},
			[]string{"--ring-sim", "3", "--cp-scheme", "zigzag", "--causal", "--dtype", "bf16"}, 2e-2, ""},
		{"hybrid causal gqa dk!=dv", []int{1, 16, 4, 8}, []int{1, 16, 2, 8}, []int{1, 16, 2, 4},
			[]string{"--ring-sim", "4", "--cp-scheme", "hybrid", "--causal"}, 1e-5, ""},
		{"one rank", []int{1, 5, 1, 8}, []int{1, 7, 1, 8}, []int{1, 7, 1, 8}, []string{"--ring-sim", "1"}, 1e-5, ""},
		{"auto explained", []int{1, 16, 2, 8}, []int{1, 16, 2, 8}, []int{1, 16, 2, 8},
			[]string{"--ring-sim", "2", "--cp-scheme", "auto", "--cp-explain", "--causal"}, 1e-5, "chosen: "},
		{"default zigzag packed causal gqa", []int{72, 4, 8}, []int{72, 2, 8}, []int{72, 2, 8},
			[]string{"--ring-sim", "3", "--causal", "--cu-seqlens-q", "0,24,24,72", "--cu-seqlens-k", "0,24,24,72"}, 1e-5, ""},
		{"a2a packed causal top-left n!=m", []int{48, 4, 8}, []int{24, 2, 8}, []int{24, 2, 8},
			[]string{"--ring-sim", "2", "--cp-scheme", "a2a", "--causal", "--align", "top-left",
				"--cu-seqlens-q", "0,16,16,48", "--cu-seqlens-k", "0,8,16,24"}, 1e-5, ""},
		{"ring packed full", []int{32, 2, 8}, []int{40, 2, 8}, []int{40, 2, 4},
			[]string{"--ring-sim", "4", "--cp-scheme", "ring", "--cu-seqlens-q", "0,0,12,32", "--cu-seqlens-k", "0,8,8,40"}, 1e-5, ""},
		{"auto packed causal explained", []int{48, 4, 8}, []int{48, 2, 8}, []int{48, 2, 8},
			[]string{"--ring-sim", "2", "--cp-scheme", "auto", "--cp-explain", "--causal",
				"--cu-seqlens-q", "0,16,16,48", "--cu-seqlens-k", "0,16,16,48"}, 1e-5, "chosen: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			q := writeNPY(t, dir, "q.npy", randomTensor(rng, flashattn.Float32, tc.q...))
			k := writeNPY(t, dir, "k.npy", randomTensor(rng, flashattn.Float32, tc.k...))
			v := writeNPY(t, dir, "v.npy", randomTensor(rng, flashattn.Float32, tc.v...))
			last := len(tc.q) - 1
			oShape := append(append([]int{}, tc.q[:last]...), tc.v[last])
			lseShape := []int{tc.q[0], tc.q[2], tc.q[1]}
			if last == 2 { // packed: [H, totalQ]
				lseShape = []int{tc.q[1], tc.q[0]}
			}
			do := writeNPY(t, dir, "do.npy", randomTensor(rng, flashattn.Float32, oShape...))
			base := []string{"run", "--backend", "cpu", "--q", q, "--k", k, "--v", v, "--do", do}
			// The plain run takes the same flags without those of --ring-sim.
			var plain []string
			for i := 0; i < len(tc.flags); i++ {
				switch tc.flags[i] {
				case "--ring-sim", "--cp-scheme":
					i++
				case "--cp-explain":
				default:
					plain = append(plain, tc.flags[i])
				}
			}
			mustRun(t, append(append(base, "--out", filepath.Join(dir, "plain")), plain...)...)
			status, stdout, stderr := execute(append(append(base, "--out", filepath.Join(dir, "sim")), tc.flags...)...)
			if status != 0 {
				t.Fatalf("status %d: %s", status, stderr)
			}
			if !strings.Contains(stdout, tc.explain) {
				t.Errorf("stdout lacks %q:\n%s", tc.explain, stdout)
			}
			shapes := map[string][]int{"o": oShape, "lse": lseShape, "dq": tc.q, "dk": tc.k, "dv": tc.v}
			for name, shape := range shapes {
				near(t, name, readOut(t, filepath.Join(dir, "sim"), name, shape), readOut(t, filepath.Join(dir, "plain"), name, shape), tc.tol)
			}
		})
	}
}

func TestRunRingSimErrors(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(11, 12))
	q := writeNPY(t, dir, "q.npy", randomTensor(rng, flashattn.Float32, []int{1, 12, 4, 8}...))
	k := writeNPY(t, dir, "k.npy", randomTensor(rng, flashattn.Float32, []int{1, 12, 2, 8}...))
	v := writeNPY(t, dir, "v.npy", randomTensor(rng, flashattn.Float32, []int{1, 12, 2, 8}...))
	bias := writeNPY(t, dir, "b.npy", randomTensor(rng, flashattn.Float32, []int{1, 4, 12, 12}...))
	for _, tc := range []struct {
		name   string
		flags  []string
		status int
		msg    string
	}{
		{"no ranks", []string{"--ring-sim", "0"}, 2, "--ring-sim 0: the number of virtual ranks must be at least 1"},
		{"negative", []string{"--ring-sim", "-2"}, 2, "at least 1"},
		{"uneven zigzag", []string{"--ring-sim", "4", "--causal"}, 1, "zigzag over 4 ranks cuts each sequence into 8 equal chunks, but N = 12 and M = 12 is not a multiple of 8: uneven shards"},
		{"uneven ring", []string{"--ring-sim", "5", "--cp-scheme", "ring"}, 1, "not a multiple of 5"},
		{"a2a heads", []string{"--ring-sim", "4", "--cp-scheme", "a2a"}, 1, "a2a over 4 ranks needs the 2 key/value heads to split evenly"},
		{"bad scheme", []string{"--ring-sim", "2", "--cp-scheme", "ulysses"}, 2, "--cp-scheme \"ulysses\" is not ring, zigzag, a2a, hybrid, hybrid-A or auto"},
		{"scheme alone", []string{"--cp-scheme", "ring"}, 2, "need --ring-sim"},
		{"bias", []string{"--ring-sim", "2", "--bias", bias}, 2, "--ring-sim does not run --bias"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"run", "--backend", "cpu", "--q", q, "--k", k, "--v", v, "--out", filepath.Join(dir, "out")}, tc.flags...)
			status, _, stderr := execute(args...)
			if status != tc.status || !strings.Contains(stderr, tc.msg) {
				t.Errorf("status %d, stderr %q; want %d and %q", status, stderr, tc.status, tc.msg)
			}
		})
	}
}

// TestRunRingSimPackedErrors checks what run --ring-sim refuses of a
// packed batch.
func TestRunRingSimPackedErrors(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(13, 14))
	x := writeNPY(t, dir, "x.npy", randomTensor(rng, flashattn.Float32, 24, 2, 8))
	for _, tc := range []struct {
		name  string
		flags []string
		msg   string
	}{
		{"uneven sequence", []string{"--ring-sim", "2", "--causal", "--cu-seqlens-q", "0,6,24", "--cu-seqlens-k", "0,6,24"},
			"cu_seqlens_q: sequence 0 of length 6 cannot be cut into 4 equal chunks (zigzag layout, 2 ranks): uneven shards"},
		{"hybrid", []string{"--ring-sim", "2", "--cp-scheme", "hybrid", "--cu-seqlens-q", "0,8,24", "--cu-seqlens-k", "0,8,24"},
			"with the hybrid scheme"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"run", "--backend", "cpu", "--q", x, "--k", x, "--v", x, "--out", filepath.Join(dir, "out")}, tc.flags...)
			status, _, stderr := execute(args...)
			if status != 1 || !strings.Contains(stderr, tc.msg) {
				t.Errorf("status %d, stderr %q; want 1 and %q", status, stderr, tc.msg)
			}
		})
	}
}

// TestBenchCP checks that bench --cp measures a split case on the CPU
// backend and reports what it planned: the steps of each scheme, the calls
// and the bytes a rank sends.
func TestBenchCP(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	for _, tc := range []struct {
		name         string
		flags        []string
		scheme       string
		steps, calls int
		sent         int64
	}{
		// K/V of 16 keys × 2 heads × (16+16) fp32 per hop, 3 hops.
		{"ring fwd", []string{"--cp", "4", "--cp-scheme", "ring"}, "ring", 4, 16, 3 * 16 * 2 * 32 * 4},
		{"zigzag causal fwdbwd", []string{"--cp", "2", "--causal", "--pass", "fwdbwd"}, "zigzag", 4, 0, 0},
		{"a2a bwd", []string{"--cp", "2", "--cp-scheme", "a2a", "--pass", "bwd"}, "a2a", 1, 2, 0},
		{"auto", []string{"--cp", "2", "--cp-scheme", "auto", "--causal"}, "", 0, 0, 0},
		// Groups of 2 ranks trade heads, a ring of 2 groups.
		{"hybrid bwd", []string{"--cp", "4", "--cp-scheme", "hybrid", "--heads", "4", "--kv-heads", "2", "--causal", "--pass", "bwd"},
			"hybrid", 2, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"bench", "--backend", "cpu", "--dtype", "fp32", "--seqlen-q", "64", "--heads", "2",
				"--head-dim", "16", "--repeats", "2", "--json"}, tc.flags...)
			status, out, errOut := execute(args...)
			if status != 0 {
				t.Fatalf("status %d: %s", status, errOut)
			}
			var r struct {
				CP bench.CPResult `json:"cp"`
			}
			if err := json.Unmarshal([]byte(out), &r); err != nil {
				t.Fatalf("%v:\n%s", err, out)
			}
			c := r.CP
			if tc.scheme != "" && c.Scheme != tc.scheme || tc.steps > 0 && c.Steps != tc.steps || tc.calls > 0 && c.Calls != tc.calls ||
				tc.sent > 0 && c.SentBytes != tc.sent {
				t.Errorf("got %+v, want scheme %q, %d steps, %d calls, %d bytes", c, tc.scheme, tc.steps, tc.calls, tc.sent)
			}
			if c.Repeats != 2 || !(c.SingleMs > 0 && c.CriticalMs > 0 && c.WorkMs >= c.CriticalMs && c.Speedup > 0 && c.SplitCost > 0) {
				t.Errorf("implausible measurement %+v", c)
			}
		})
	}
	status, out, errOut := execute("bench", "--backend", "cpu", "--seqlen-q", "32", "--heads", "2", "--head-dim", "16",
		"--causal", "--repeats", "1", "--cp", "2", "--cp-explain")
	for _, want := range []string{"cp cost model, forward on 2 ranks", "* zigzag", "cp       zigzag on 2 virtual ranks",
		"speedup ", "× the single call", "sent per rank"} {
		if status != 0 || !strings.Contains(out, want) {
			t.Errorf("status %d, output lacks %q:\n%s%s", status, want, out, errOut)
		}
	}
	for _, bad := range []struct {
		flags []string
		msg   string
	}{
		{[]string{"--cp", "0"}, "--cp 0: the number of virtual ranks must be at least 1"},
		{[]string{"--cp", "3", "--seqlen-q", "32"}, "uneven shards"},
		{[]string{"--cp", "4", "--cp-scheme", "a2a", "--heads", "2"}, "needs the 2 key/value heads to split evenly"},
		{[]string{"--cp-explain"}, "need --cp"},
	} {
		status, _, errOut := execute(append([]string{"bench", "--backend", "cpu", "--repeats", "1"}, bad.flags...)...)
		if status == 0 || !strings.Contains(errOut, bad.msg) {
			t.Errorf("%v: status %d, %q; want %q", bad.flags, status, errOut, bad.msg)
		}
	}
}

// TestBenchCPSplitErrors checks what bench --cp-split refuses before it
// looks for a GPU, and that a list of ranks needs it.
func TestBenchCPSplitErrors(t *testing.T) {
	for _, bad := range []struct {
		flags []string
		msg   string
	}{
		{[]string{"--cp", "2,4"}, "--cp 2,4: a list of ranks needs --cp-split"},
		{[]string{"--cp-split"}, "--cp-split needs --cp P"},
		{[]string{"--cp-split", "--cp", "2", "--backend", "cpu"}, "--cp-split runs on the GPU"},
		{[]string{"--cp-split", "--cp", "2", "--cp-scheme", "a2a"}, "the device split runs ring and zigzag"},
		{[]string{"--cp-split", "--cp", "2", "--cp-scheme", "auto"}, "--cp-split measures ring or zigzag as given"},
		{[]string{"--cp-split", "--cp", "2,3", "--seqlen-q", "32", "--causal"}, "uneven shards"},
		{[]string{"--cp-split", "--cp", "2,0"}, "--cp 0: the number of virtual ranks must be at least 1"},
		{[]string{"--cp", "2,x"}, "is not an integer"},
	} {
		status, _, errOut := execute(append([]string{"bench", "--repeats", "1"}, bad.flags...)...)
		if status == 0 || !strings.Contains(errOut, bad.msg) {
			t.Errorf("%v: status %d, %q; want %q", bad.flags, status, errOut, bad.msg)
		}
	}
}

// TestPrintCPSplit checks the table of bench --cp-split: its header, and a
// line per P and pass with the one-stream times, the ring's time and a
// rank's step.
func TestPrintCPSplit(t *testing.T) {
	var b strings.Builder
	rs := []bench.CPSplitResult{
		{Scheme: "zigzag", Ranks: 2, Pass: bench.Forward, SingleMs: 1, AttentionMs: 1.05, MergeMs: 0.02, TotalMs: 1.07, Ratio: 1.07, PartsRatio: 1.07, RingMs: 1.2, RingStepMs: 0.3, Calls: 8, Merges: 12, Repeats: 5},
		{Scheme: "zigzag", Ranks: 4, Pass: bench.Backward, SingleMs: 2, AttentionMs: 2.2, MergeMs: 0.1, TotalMs: 2.3, Ratio: 1.15, PartsRatio: 1.15, RingMs: 2.4, RingStepMs: 0.15, Calls: 32, Merges: 120, Repeats: 5},
	}
	printCPSplit(&b, bench.Case{Batch: 1, SeqlenQ: 4608, SeqlenK: 4608, Heads: 24, KVHeads: 24, HeadDim: 128, HeadDimV: 128, Causal: true}, cp.ZigzagStrategy, rs)
	out := b.String()
	for _, want := range []string{
		"medians of 5 replays",
		"   P pass     single      steps     merges      total    ratio    parts       ring       step  calls kernels",
		"   2 fwd           1       1.05       0.02       1.07   1.070×   1.070×        1.2        0.3      8      12",
		"   4 bwd           2        2.2        0.1        2.3   1.150×   1.150×        2.4       0.15     32     120",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
}
