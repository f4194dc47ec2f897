package bench

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const peerScript = "peers/sdpa.py"

// python returns the python3 command, or skips the test.
func python(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	return p
}

// runPython runs python3 with args (no bytecode written) and returns its output.
func runPython(t *testing.T, env []string, stdin string, args ...string) string {
	t.Helper()
	cmd := exec.Command(python(t), args...)
	cmd.Env = append(append(os.Environ(), "PYTHONDONTWRITEBYTECODE=1"), env...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("python3 %v: %v\n%s", args, err, out)
	}
	return string(out)
}

func TestPeerScriptCompiles(t *testing.T) {
	runPython(t, nil, "", "-c", "import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True)",
		peerScript, filepath.Join(t.TempDir(), "sdpa.pyc"))
}

func TestPeerScriptFLOPs(t *testing.T) {
	// The peer script counts operations as Case.FLOPs does.
	var cs []Case
	for _, c := range []Case{
		{Batch: 2, SeqlenQ: 64, Heads: 4, HeadDim: 32, Pass: Backward},
		{Batch: 1, SeqlenQ: 33, SeqlenK: 70, Heads: 2, HeadDim: 24, HeadDimV: 40, Causal: true},
		{Batch: 1, SeqlenQ: 70, SeqlenK: 33, Heads: 2, HeadDim: 8, Causal: true, Align: "top-left", Pass: ForwardBackward},
		{Batch: 3, SeqlenQ: 50, Heads: 1, HeadDim: 8, Window: &Window{Left: 5, Right: 2}},
		{Batch: 1, SeqlenQ: 40, SeqlenK: 60, Heads: 1, HeadDim: 8, Causal: true, Window: &Window{Left: 7, Right: -1}},
	} {
		c.Normalize()
		cs = append(cs, c)
	}
	in, err := json.Marshal(cs)
	if err != nil {
		t.Fatal(err)
	}
	out := runPython(t, []string{"PYTHONPATH=peers"}, string(in), "-c",
		"import json, sys, sdpa; print(json.dumps([sdpa.flops(c) for c in json.load(sys.stdin)]))")
	var got []float64
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	for i, c := range cs {
		if got[i] != c.FLOPs() {
			t.Errorf("%v: script counts %v, Go %v", c, got[i], c.FLOPs())
		}
	}
}

func TestPeerScriptFakeTorch(t *testing.T) {
	// With a stand-in torch (testdata/faketorch) the script runs every case
	// and backend and writes a results file this package reads.
	dir := t.TempDir()
	cs, err := PresetCases("tiny-headdim", "bf16")
	if err != nil {
		t.Fatal(err)
	}
	cs = cs[:2]
	extra := []Case{
		{Batch: 1, SeqlenQ: 64, Heads: 4, KVHeads: 1, HeadDim: 32, Pass: Backward},         // GQA: cuDNN refuses enable_gqa
		{Batch: 1, SeqlenQ: 64, Heads: 2, HeadDim: 320},                                    // flash refuses D > 256
		{Batch: 1, SeqlenQ: 64, Heads: 2, HeadDim: 32, Window: &Window{Left: 8, Right: 0}}, // no window in SDPA
		{Batch: 1, SeqlenQ: 64, Heads: 2, HeadDim: 32, Deterministic: true, Pass: Backward},
		{Batch: 1, SeqlenQ: 32, SeqlenK: 64, Heads: 2, HeadDim: 32, Causal: true},
		{Batch: 1, SeqlenQ: 64, Heads: 2, HeadDim: 32, Bias: "1hnm", BiasGrad: true, Pass: Backward},
		{Batch: 2, SeqlenQ: 32, SeqlenK: 64, Heads: 2, HeadDim: 32, Causal: true, Bias: "b1nm"},
	}
	for _, c := range extra {
		c.Preset = "extra"
		c.Normalize()
		cs = append(cs, c)
	}
	shapes := filepath.Join(dir, "shapes.json")
	if err := (&ShapeList{Schema: ShapesSchema, Created: time.Now(), Preset: "test", Cases: cs}).Write(shapes); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "peers.json")
	runPython(t, []string{"PYTHONPATH=peers/testdata/faketorch"}, "", peerScript, "--shapes", shapes, "--out", out,
		"--warmup-ms", "1", "--rep-ms", "1")
	f, err := ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if len(f.Records) != 4*len(cs) {
		t.Fatalf("%d records for %d cases × 4 backends", len(f.Records), len(cs))
	}
	status := map[string]Record{}
	for _, r := range f.Records {
		if r.Backend != "sdpa" || r.Device != "Fake GPU" || r.FLOPs != r.Case.FLOPs() {
			t.Errorf("record %+v", r)
		}
		status[r.Implementation+" "+r.Case.String()] = r
	}
	for _, tc := range []struct {
		key, status, variant, msg string
	}{
		{"torch-flash bf16 B1 N64 H2 D8 fwd", StatusOK, "", ""},
		{"torch-math bf16 B1 N64 H2 D8 bwd", StatusOK, "", ""},
		{"torch-flash bf16 B1 N64 H4/1 D32 bwd", StatusOK, "", ""},
		{"torch-cudnn bf16 B1 N64 H4/1 D32 bwd", StatusOK, "kv expanded to all heads (enable_gqa refused)", ""},
		{"torch-flash bf16 B1 N64 H2 D320 fwd", StatusUnsupported, "", "No available kernel"},
		{"torch-mem_eff bf16 B1 N64 H2 D320 fwd", StatusOK, "", ""},
		{"torch-flash bf16 B1 N64 H2 D32 win(8,0) fwd", StatusUnsupported, "", "no sliding window"},
		{"torch-flash bf16 B1 N64 H2 D32 det bwd", StatusUnsupported, "", "deterministic"},
		{"torch-math bf16 B1 N64 H2 D32 det bwd", StatusOK, "", ""},
		{"torch-flash bf16 B1 N32 M64 H2 D32 causal fwd", StatusOK, "", ""},
		{"torch-flash bf16 B1 N64 H2 D32 bias 1hnm dbias bwd", StatusUnsupported, "", "No available kernel"},
		{"torch-mem_eff bf16 B1 N64 H2 D32 bias 1hnm dbias bwd", StatusOK, "", ""},
		{"torch-cudnn bf16 B2 N32 M64 H2 D32 causal bias b1nm fwd", StatusOK, "", ""},
	} {
		r, ok := status[tc.key]
		if !ok {
			t.Errorf("no record %q", tc.key)
			continue
		}
		if r.Status != tc.status || r.KernelVariant != tc.variant || !strings.Contains(r.Message, tc.msg) {
			t.Errorf("%s: status %q variant %q message %q; want %q %q %q", tc.key, r.Status, r.KernelVariant, r.Message, tc.status, tc.variant, tc.msg)
		}
		if r.OK() && (r.Repeats < 10 || r.MedianMs < 0 || r.MinMs > r.MedianMs || r.MaxMs < r.MedianMs) {
			t.Errorf("%s: times %+v", tc.key, r)
		}
	}
}
