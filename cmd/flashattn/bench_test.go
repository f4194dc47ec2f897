package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/bench"
)

func TestBenchCPU(t *testing.T) {
	status, out, errOut := execute("bench", "--backend", "cpu", "--dtype", "fp32", "--seqlen-q", "64", "--seqlen-k", "96",
		"--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--head-dim-v", "16", "--causal", "--pass", "fwdbwd",
		"--repeats", "2", "--warmup", "1ms")
	if status != 0 {
		t.Fatalf("status %d: %s", status, errOut)
	}
	for _, want := range []string{"backend  cpu · ", "case     fp32 B1 N64 M96 H4/2 D32/16 causal fwdbwd",
		"time     median ", "(2 repeats)", " GFLOP/s", "first    "} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

func TestBenchJSON(t *testing.T) {
	status, out, errOut := execute("bench", "--backend", "cpu", "--seqlen-q", "32", "--heads", "2", "--head-dim", "16",
		"--pass", "bwd", "--window", "4,0", "--softcap", "20", "--dropout", "0.1", "--repeats", "1", "--json")
	if status != 0 {
		t.Fatalf("status %d: %s", status, errOut)
	}
	var r bench.Record
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("%v:\n%s", err, out)
	}
	want := bench.Case{DType: "bf16", Batch: 1, SeqlenQ: 32, SeqlenK: 32, Heads: 2, KVHeads: 2, HeadDim: 16, HeadDimV: 16,
		Align: "bottom-right", Window: &bench.Window{Left: 4, Right: 0}, Softcap: 20, Dropout: 0.1, Pass: bench.Backward}
	if r.Key() != want.Key() || !r.OK() || r.Repeats != 1 || r.FLOPs != want.FLOPs() || r.TFLOPs <= 0 {
		t.Errorf("record %+v", r)
	}
}

func TestBenchErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		args   []string
		status int
		msg    string
	}{
		{"bad pass", []string{"--pass", "all"}, 2, "--pass"},
		{"bad align", []string{"--align", "x"}, 2, "--align"},
		{"bad window", []string{"--window", "3"}, 2, "--window"},
		{"bad backend", []string{"--backend", "tpu"}, 2, "--backend"},
		{"bad heads", []string{"--backend", "cpu", "--heads", "6", "--kv-heads", "4"}, 1, "kv_heads"},
		{"bad dtype", []string{"--backend", "cpu", "--dtype", "fp8"}, 1, "fp8"},
		{"negative budget", []string{"--backend", "cpu", "--budget", "-1s"}, 2, "negative"},
		{"unknown flag", []string{"--nope"}, 2, "nope"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, _, errOut := execute(append([]string{"bench"}, tc.args...)...)
			if status != tc.status || !strings.Contains(errOut, tc.msg) || strings.Count(errOut, "\n") != 1 {
				t.Errorf("status %d, stderr %q; want %d and %q on one line", status, errOut, tc.status, tc.msg)
			}
		})
	}
}

func TestBenchCUDAUnavailable(t *testing.T) {
	// Where no GPU works, a cuda bench says so (status 1), without a crash.
	skipIfCUDAWorks(t)
	status, out, errOut := execute("bench", "--backend", "cuda", "--seqlen-q", "64")
	if status != 1 || !strings.Contains(out, "status   unsupported") || !strings.Contains(errOut, "unsupported") {
		t.Errorf("status %d\nstdout %s\nstderr %s", status, out, errOut)
	}
}

// skipIfCUDAWorks skips the test where a CUDA device works: it checks what
// the commands do without one.
func skipIfCUDAWorks(t *testing.T) {
	t.Helper()
	r, err := bench.OpenRunner("cuda")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Device() != "" {
		t.Skip("a CUDA device works here")
	}
}
