package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/bench"
)

// writeResults writes a results file of the seqlen preset's fwd cases at
// rate TFLOP/s by impl into dir, and returns dir.
func writeResults(t *testing.T, dir, impl, backend string, rate float64) string {
	t.Helper()
	cs, err := bench.PresetCases("seqlen", "bf16")
	if err != nil {
		t.Fatal(err)
	}
	f := bench.NewFile("test " + impl)
	for _, c := range cs {
		if c.Pass != bench.Forward {
			continue
		}
		ms := c.FLOPs() / (rate * 1e12) * 1e3
		f.Records = append(f.Records, bench.Record{Case: c, Implementation: impl, Backend: backend, Device: "NVIDIA H200",
			FLOPs: c.FLOPs(), MedianMs: ms, MinMs: ms, MaxMs: ms, Repeats: 10, TFLOPs: rate, Status: bench.StatusOK})
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := f.Write(filepath.Join(dir, bench.ResultsName)); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestCompareCommand(t *testing.T) {
	dir := t.TempDir()
	ours := writeResults(t, filepath.Join(dir, "ours"), bench.Ours, "cuda", 300)
	peers := writeResults(t, filepath.Join(dir, "peers"), "torch-cudnn", "sdpa", 400)
	status, stdout, errOut := execute("compare", ours, filepath.Join(peers, bench.ResultsName))
	if status != 0 {
		t.Fatalf("status %d: %s", status, errOut)
	}
	if !strings.Contains(stdout, "flashattn reaches 0.75×") {
		t.Errorf("stdout:\n%s", stdout)
	}
	// Without --out the first folder receives the outputs.
	md, err := os.ReadFile(filepath.Join(ours, "compare.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(md), "| B32 N512 H32 D64 | - | fwd | 300 | 400 | torch-cudnn | 0.75 |") {
		t.Errorf("compare.md:\n%s", md)
	}
	for _, name := range []string{"seqlen.png", "seqlen.svg"} {
		if st, err := os.Stat(filepath.Join(ours, name)); err != nil || st.Size() == 0 {
			t.Errorf("%s: %v", name, err)
		}
	}

	out := filepath.Join(dir, "section")
	status, stdout, errOut = execute("compare", "--out", out, "--markdown", "--img-prefix", "docs/bench/", "--title", "H200, bf16",
		"--level", "3", "--command", "bash bench/run-h200.sh", ours, peers)
	if status != 0 {
		t.Fatalf("status %d: %s", status, errOut)
	}
	for _, want := range []string{"### H200, bf16\n", "```\nbash bench/run-h200.sh\n```", "![seqlen](docs/bench/seqlen.png)", "#### seqlen"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("markdown lacks %q:\n%s", want, stdout)
		}
	}
	if data, _ := os.ReadFile(filepath.Join(out, "compare.md")); string(data) != stdout {
		t.Errorf("compare.md differs from the printed Markdown")
	}
}

func TestCompareErrors(t *testing.T) {
	for _, tc := range []struct {
		args   []string
		status int
		msg    string
	}{
		{nil, 2, "no results"},
		{[]string{filepath.Join(t.TempDir(), "missing.json")}, 1, "no such file"},
		{[]string{"--level"}, 2, "level"},
	} {
		status, _, errOut := execute(append([]string{"compare"}, tc.args...)...)
		if status != tc.status || !strings.Contains(errOut, tc.msg) {
			t.Errorf("compare %v: status %d, stderr %q; want %d and %q", tc.args, status, errOut, tc.status, tc.msg)
		}
	}
}
