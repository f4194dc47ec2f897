package bench

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/flashattn/flashattn/attn"
)

// sampleRecords returns records of every status and of every kind of option.
func sampleRecords() []Record {
	c1 := Case{Preset: "seqlen", Batch: 4, SeqlenQ: 4096, Heads: 16, HeadDim: 128, Causal: true, Pass: Backward}
	c2 := Case{Preset: "headdim", Batch: 1, SeqlenQ: 100, SeqlenK: 300, Heads: 8, KVHeads: 2, HeadDim: 192, HeadDimV: 128,
		Align: "top-left", Window: &Window{Left: 64, Right: 0}, Softcap: 30, Dropout: 0.1, Deterministic: true, DType: "fp16"}
	c1.Normalize()
	c2.Normalize()
	return []Record{
		{Case: c1, Implementation: Ours, Backend: "cuda", Device: "NVIDIA H200", FLOPs: c1.FLOPs(), MedianMs: 1.25,
			MinMs: 1.2, MaxMs: 1.5, Repeats: 80, FirstMs: 900, TFLOPs: c1.FLOPs() / 1.25e-3 / 1e12,
			KernelVariant: "fwd_d128_m128n64", DQAlgorithm: "atomic", Status: StatusOK},
		{Case: c1, Implementation: "torch-flash", Backend: "sdpa", Device: "NVIDIA H200", FLOPs: c1.FLOPs(),
			Status: StatusUnsupported, Message: "No available kernel"},
		{Case: c2, Implementation: Ours, Backend: "cpu", Device: "x86", FLOPs: c2.FLOPs(), Status: StatusError, Message: "boom"},
	}
}

func TestResultsRoundTrip(t *testing.T) {
	dir := t.TempDir()
	f := NewFile("flashattn sweep --preset x")
	f.Records = sampleRecords()
	path := filepath.Join(dir, ResultsName)
	if err := f.Write(path); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{path, dir} { // a folder reads as its results.json
		g, err := ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if !g.Created.Equal(f.Created) {
			t.Errorf("created %v, want %v", g.Created, f.Created)
		}
		g.Created = f.Created
		if !reflect.DeepEqual(g, f) {
			t.Errorf("round trip of %s:\n got %+v\nwant %+v", p, g, f)
		}
	}
}

func TestResultsFieldNames(t *testing.T) {
	// The peer script writes these names: the schema is a contract.
	data, err := json.Marshal(sampleRecords()[1])
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"preset", "dtype", "batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "head_dim",
		"head_dim_v", "causal", "align", "softcap", "dropout", "deterministic", "pass", "implementation", "backend",
		"device", "flops", "median_ms", "min_ms", "max_ms", "repeats", "tflops", "status", "message"} {
		if _, ok := m[k]; !ok {
			t.Errorf("record JSON lacks %q: %s", k, data)
		}
	}
	if _, ok := m["window"]; ok {
		t.Errorf("record without window has a window field: %s", data)
	}
}

func TestReadFileErrors(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name, content string
		want          error
	}{
		{"garbage.json", "not json", attn.ErrOption},
		{"schema.json", `{"schema":"other/1","records":[]}`, attn.ErrOption},
	} {
		p := filepath.Join(dir, tc.name)
		if err := os.WriteFile(p, []byte(tc.content), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := ReadFile(p); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	if _, err := ReadFile(filepath.Join(dir, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v, want ErrNotExist", err)
	}
}

func TestShapeListRoundTrip(t *testing.T) {
	cs, err := PresetCases("tiny", "bf16")
	if err != nil {
		t.Fatal(err)
	}
	s := &ShapeList{Schema: ShapesSchema, Created: time.Now().UTC().Truncate(time.Second), Preset: "tiny", Cases: cs}
	p := filepath.Join(t.TempDir(), "shapes.json")
	if err := s.Write(p); err != nil {
		t.Fatal(err)
	}
	got, err := ReadShapes(p)
	if err != nil {
		t.Fatal(err)
	}
	got.Created = s.Created
	if !reflect.DeepEqual(got, s) {
		t.Errorf("shape list round trip differs")
	}
}
