package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/bench"
)

func TestSweepTinyCPU(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	shapes := filepath.Join(dir, "shapes.json")
	status, stdout, errOut := execute("sweep", "--preset", "tiny", "--backend", "cpu", "--dtype", "fp32", "--out", out,
		"--emit-shapes", shapes, "--budget", "1ms", "--warmup", "1ms")
	if status != 0 {
		t.Fatalf("status %d: %s", status, errOut)
	}
	if !strings.Contains(stdout, "36 records: 36 ok") {
		t.Errorf("stdout:\n%s", stdout)
	}
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if len(f.Records) != 36 || !strings.HasPrefix(f.Command, "flashattn sweep --preset tiny") {
		t.Errorf("%d records, command %q", len(f.Records), f.Command)
	}
	sl, err := bench.ReadShapes(shapes)
	if err != nil {
		t.Fatal(err)
	}
	if len(sl.Cases) != 36 || sl.Cases[0].Key() != f.Records[0].Key() {
		t.Errorf("shape list of %d cases, first %v; first record %v", len(sl.Cases), sl.Cases[0], f.Records[0].Case)
	}
	for _, name := range []string{"results.md", "tiny-seqlen.png", "tiny-seqlen.svg", "tiny-headdim.png", "tiny-headdim.svg"} {
		st, err := os.Stat(filepath.Join(out, name))
		if err != nil || st.Size() == 0 {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestSweepTinyCP(t *testing.T) {
	out := t.TempDir()
	status, stdout, errOut := execute("sweep", "--preset", "tiny-cp", "--backend", "cpu", "--dtype", "fp32", "--out", out,
		"--budget", "1ms", "--warmup", "1ms")
	if status != 0 || !strings.Contains(stdout, "28 records: 28 ok") {
		t.Fatalf("status %d: %s%s", status, stdout, errOut)
	}
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range f.Records {
		if r.CP == nil || r.CP.Ranks != r.CPRanks || r.CP.Scheme != r.CPScheme || !(r.CP.SplitCost > 0) || !(r.CP.Speedup > 0) {
			t.Errorf("record %v: %+v", r.Case, r.CP)
		}
	}
	md, err := os.ReadFile(filepath.Join(out, "results.md"))
	if err != nil || !strings.Contains(string(md), "hybrid×8: split") {
		t.Errorf("results.md (%v):\n%s", err, md)
	}
}

func TestSweepEmitOnly(t *testing.T) {
	shapes := filepath.Join(t.TempDir(), "shapes.json")
	status, stdout, errOut := execute("sweep", "--preset", "all", "--emit-shapes", shapes)
	if status != 0 {
		t.Fatalf("status %d: %s", status, errOut)
	}
	sl, err := bench.ReadShapes(shapes)
	if err != nil {
		t.Fatal(err)
	}
	if len(sl.Cases) != 208 || sl.Preset != "all" || !strings.Contains(stdout, "208 cases") {
		t.Errorf("%d cases, preset %q, stdout %q", len(sl.Cases), sl.Preset, stdout)
	}
}

func TestSweepUnavailableBackend(t *testing.T) {
	// A backend that cannot open still yields a results file, every record unsupported with the reason.
	skipIfCUDAWorks(t)
	out := t.TempDir()
	status, stdout, errOut := execute("sweep", "--preset", "flux", "--backend", "cuda", "--out", out)
	if status != 0 {
		t.Fatalf("status %d: %s", status, errOut)
	}
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if len(f.Records) != 2 || !strings.Contains(stdout, "2 unsupported") {
		t.Fatalf("stdout %s; records %+v", stdout, f.Records)
	}
	for _, r := range f.Records {
		if r.Status != bench.StatusUnsupported || r.Message == "" || r.Backend != "cuda" {
			t.Errorf("record %+v", r)
		}
	}
}

func TestSweepErrors(t *testing.T) {
	for _, tc := range []struct {
		args   []string
		status int
		msg    string
	}{
		{[]string{"--out", "x"}, 2, "--preset"},
		{[]string{"--preset", "tiny"}, 2, "--out"},
		{[]string{"--preset", "huge", "--out", "x"}, 1, "huge"},
		{[]string{"--preset", "tiny", "--out", "x", "--backend", "tpu"}, 2, "--backend"},
	} {
		status, _, errOut := execute(append([]string{"sweep"}, tc.args...)...)
		if status != tc.status || !strings.Contains(errOut, tc.msg) {
			t.Errorf("sweep %v: status %d, stderr %q; want %d and %q", tc.args, status, errOut, tc.status, tc.msg)
		}
	}
}
