package bench

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cp"
	"github.com/flashattn/flashattn/cpu"
)

// TestCPPresetsSplit checks that every case of the context-parallel
// presets names its ranks and a scheme that can split it.
func TestCPPresetsSplit(t *testing.T) {
	for _, name := range []string{"cp", "tiny-cp"} {
		cs, err := PresetCases(name, "bf16")
		if err != nil {
			t.Fatal(err)
		}
		schemes := map[string]bool{}
		for _, c := range cs {
			s, err := cp.ParseStrategy(c.CPScheme)
			if err != nil || c.CPRanks < 2 {
				t.Fatalf("%s: %v: ranks %d, scheme %v", name, c, c.CPRanks, err)
			}
			if err := s.Check(c.SeqlenQ, c.SeqlenK, c.KVHeads, c.CPRanks); err != nil {
				t.Errorf("%s: %v: %v", name, c, err)
			}
			schemes[c.CPScheme] = true
		}
		if !schemes["hybrid"] || !schemes["a2a"] {
			t.Errorf("%s: schemes %v lack hybrid or a2a", name, schemes)
		}
	}
}

// TestCPCaseFields checks the context-parallel fields of a case: their
// validation, their place in the key and the description, and that
// results files written before they existed still load.
func TestCPCaseFields(t *testing.T) {
	base := Case{Batch: 1, SeqlenQ: 64, Heads: 4, HeadDim: 16, Causal: true}
	split := base
	split.CPRanks = 4
	split.Normalize()
	base.Normalize()
	if split.CPScheme != "zigzag" || base.CPScheme != "" {
		t.Errorf("default schemes %q, %q", split.CPScheme, base.CPScheme)
	}
	if split.Key() == base.Key() || !strings.HasPrefix(split.Key(), base.Key()) {
		t.Errorf("keys %q and %q", split.Key(), base.Key())
	}
	if !strings.HasSuffix(split.String(), "cp zigzag×4") {
		t.Errorf("String() = %q", split.String())
	}
	for _, bad := range []Case{{CPRanks: -1}, {CPScheme: "ring"}, {CPRanks: 2, CPScheme: "auto"}} {
		c := base
		c.CPRanks, c.CPScheme = bad.CPRanks, bad.CPScheme
		if err := c.Validate(); !errors.Is(err, attn.ErrOption) {
			t.Errorf("ranks %d scheme %q: %v, want ErrOption", c.CPRanks, c.CPScheme, err)
		}
	}
	old := `{"schema": "flashattn-bench/1", "created": "2025-01-02T03:04:05Z", "records": [{"dtype": "bf16", "batch": 1,
		"seqlen_q": 64, "seqlen_k": 64, "heads": 4, "kv_heads": 4, "head_dim": 16, "head_dim_v": 16, "causal": false,
		"align": "bottom-right", "softcap": 0, "dropout": 0, "deterministic": false, "pass": "fwd", "implementation": "flashattn",
		"backend": "cpu", "device": "x", "flops": 1, "median_ms": 1, "min_ms": 1, "max_ms": 1, "repeats": 3, "tflops": 1, "status": "ok"}]}`
	path := filepath.Join(t.TempDir(), ResultsName)
	if err := os.WriteFile(path, []byte(old), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := ReadFile(path)
	if err != nil || len(f.Records) != 1 || f.Records[0].CPRanks != 0 || f.Records[0].CPScheme != "" || f.Records[0].CP != nil {
		t.Fatalf("old results file: %+v, %v", f, err)
	}
	data, err := json.Marshal(f.Records[0])
	if err != nil || strings.Contains(string(data), `"cp_`) || strings.Contains(string(data), `"cp"`) {
		t.Errorf("a single-call record writes %s (%v)", data, err)
	}
}

// TestTinyCPSweep sweeps the tiny-cp preset on the CPU backend and checks
// that every case is measured and recorded with its split, that the
// records survive a results file, and that a runner without a backend
// records the cases as unsupported.
func TestTinyCPSweep(t *testing.T) {
	cs, err := PresetCases("tiny-cp", "fp32")
	if err != nil {
		t.Fatal(err)
	}
	tm := Timing{MinRepeats: 1, MaxRepeats: 1}
	recs, _, err := Sweep(SweepConfig{Runner: NewHostRunner(cpu.New(), "test"), Cases: cs, Timing: tm})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if !r.OK() || r.CP == nil {
			t.Fatalf("%v: %s %s", r.Case, r.Status, r.Message)
		}
		steps := r.CPRanks
		if r.CPScheme == "a2a" {
			steps = 1
		} else if r.CPScheme == "hybrid" {
			steps = r.CPRanks / 2 // A = 2 key heads
		}
		if r.Pass == Backward && (r.CP.Steps != steps || r.CP.Ranks != r.CPRanks || r.CP.Scheme != r.CPScheme) {
			t.Errorf("%v: %d steps, want %d; %+v", r.Case, r.CP.Steps, steps, r.CP)
		}
		if !(r.CP.SplitCost > 0) || !(r.CP.Speedup > 0) || r.MedianMs != r.CP.CriticalMs || r.TFLOPs <= 0 {
			t.Errorf("%v: %+v, median %v", r.Case, r.CP, r.MedianMs)
		}
	}
	f := NewFile("test")
	f.Records = recs
	path := filepath.Join(t.TempDir(), ResultsName)
	if err := f.Write(path); err != nil {
		t.Fatal(err)
	}
	g, err := ReadFile(path)
	if err != nil || len(g.Records) != len(recs) || g.Records[0].CP == nil || g.Records[0].CP.Calls != recs[0].CP.Calls {
		t.Fatalf("read back: %v", err)
	}
	var md strings.Builder
	if err := WriteTable(&md, recs); err != nil || !strings.Contains(md.String(), "hybrid×4: split") {
		t.Errorf("table: %v\n%s", err, md.String())
	}
	r := Run(Unavailable("cuda", errors.New("no GPU")), cs[0], tm)
	if r.Status != StatusUnsupported || !strings.Contains(r.Message, "no GPU") {
		t.Errorf("unavailable runner: %s %s", r.Status, r.Message)
	}
}
