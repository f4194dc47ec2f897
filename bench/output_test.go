package bench

import (
	"bytes"
	"fmt"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
)

// syntheticFile returns a results file for preset (cases from
// PresetCases) measured by impl, with rate(c) TFLOP/s, and status
// unsupported where rate returns 0.
func syntheticFile(t *testing.T, preset, impl, backend string, rate func(Case) float64) *File {
	t.Helper()
	cs, err := PresetCases(preset, "bf16")
	if err != nil {
		t.Fatal(err)
	}
	f := NewFile("synthetic " + impl)
	for _, c := range cs {
		r := Record{Case: c, Implementation: impl, Backend: backend, Device: "NVIDIA H200", FLOPs: c.FLOPs()}
		if x := rate(c); x > 0 {
			r.Status, r.TFLOPs, r.Repeats = StatusOK, x, 10
			r.MedianMs = r.FLOPs / (x * 1e12) * 1e3
			r.MinMs, r.MaxMs = r.MedianMs*0.99, r.MedianMs*1.02
		} else {
			r.Status, r.Message = StatusUnsupported, "head dim above 256"
		}
		f.Records = append(f.Records, r)
	}
	return f
}

func TestWriteTable(t *testing.T) {
	var b bytes.Buffer
	if err := WriteTable(&b, sampleRecords()); err != nil {
		t.Fatal(err)
	}
	md := b.String()
	checkContains(t, "table", md, []string{
		"### seqlen", "### headdim",
		"| implementation | backend | pass | B | N | M | H | Hkv | DK | DV | mask | median ms | min ms | max ms | TFLOP/s | variant | dQ | status |",
		"| flashattn | cuda | bwd | 4 | 4096 | 4096 | 16 | 16 | 128 | 128 | causal | 1.25 | 1.2 | 1.5 | 550 | fwd_d128_m128n64 | atomic | ok |",
		"| torch-flash | sdpa | bwd | 4 | 4096 | 4096 | 16 | 16 | 128 | 128 | causal | — | — | — | — | - | - | unsupported: No available kernel |",
		"| flashattn | cpu | fwd | 1 | 100 | 300 | 8 | 2 | 192 | 128 | win(64,0) cap 30 drop 0.1 det |",
		"error: boom |",
	})
	// Every table row has the header's number of cells.
	for _, line := range strings.Split(md, "\n") {
		if strings.HasPrefix(line, "|") && strings.Count(line, "|")-strings.Count(line, `\|`) != 19 {
			t.Errorf("row with %d bars: %s", strings.Count(line, "|"), line)
		}
	}
}

func TestRateUnit(t *testing.T) {
	if u, s := RateUnit(sampleRecords()); u != "TFLOP/s" || s != 1 {
		t.Errorf("GPU rates: %s %v", u, s)
	}
	slow := []Record{{Status: StatusOK, TFLOPs: 0.004}}
	if u, s := RateUnit(slow); u != "GFLOP/s" || s != 1e-3 {
		t.Errorf("CPU rates: %s %v", u, s)
	}
}

// checkImages fails unless each path is a non-empty PNG or SVG.
func checkImages(t *testing.T, paths []string) {
	t.Helper()
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		switch filepath.Ext(p) {
		case ".png":
			img, err := png.Decode(bytes.NewReader(data))
			if err != nil {
				t.Errorf("%s: %v", p, err)
				continue
			}
			if b := img.Bounds(); b.Dx() < 200 || b.Dy() < 150 {
				t.Errorf("%s is %v", p, b)
			}
		case ".svg":
			if !bytes.Contains(data, []byte("<svg")) || len(data) < 1000 {
				t.Errorf("%s is not a drawn SVG (%d bytes)", p, len(data))
			}
		default:
			t.Errorf("unexpected plot %s", p)
		}
	}
}

func TestWritePlots(t *testing.T) {
	dir := t.TempDir()
	f := syntheticFile(t, "seqlen", Ours, "cuda", func(c Case) float64 { return 100 + float64(c.SeqlenQ)/100 })
	g := syntheticFile(t, "headdim", Ours, "cuda", func(c Case) float64 {
		if c.HeadDim > 256 {
			return 0
		}
		return float64(c.HeadDim)
	})
	h := syntheticFile(t, "flux", Ours, "cuda", func(Case) float64 { return 300 })
	recs := append(append(f.Records, g.Records...), h.Records...)
	paths, err := WritePlots(dir, recs)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"seqlen.png", "seqlen.svg", "headdim.png", "headdim.svg"} // flux: one shape, no line
	if len(paths) != len(want) {
		t.Fatalf("plots %v, want %v", paths, want)
	}
	for i, p := range paths {
		if filepath.Base(p) != want[i] {
			t.Errorf("plot %d is %s, want %s", i, p, want[i])
		}
	}
	checkImages(t, paths)
}

func TestCompare(t *testing.T) {
	ours := syntheticFile(t, "gqa", Ours, "cuda", func(c Case) float64 {
		if c.Pass == Backward {
			return 200
		}
		return 400
	})
	flash := syntheticFile(t, "gqa", "torch-flash", "sdpa", func(c Case) float64 { return 250 })
	cudnn := syntheticFile(t, "gqa", "torch-cudnn", "sdpa", func(c Case) float64 {
		if c.KVHeads == 1 {
			return 0 // refused
		}
		return 500
	})
	cmp := Compare([]*File{ours, flash, cudnn})
	if want := []string{Ours, "torch-cudnn", "torch-flash"}; strings.Join(cmp.Labels, ",") != strings.Join(want, ",") {
		t.Errorf("labels %v, want %v", cmp.Labels, want)
	}
	if len(cmp.Presets) != 2 || cmp.Presets[0].Name != "gqa-kv" || cmp.Presets[1].Name != "gqa-contention" {
		t.Fatalf("presets %+v", cmp.Presets)
	}
	for _, row := range cmp.Presets[0].Rows {
		best, bestRate := "torch-cudnn", 500.0
		if row.Case.KVHeads == 1 {
			best, bestRate = "torch-flash", 250
		}
		oursRate := 400.0
		if row.Case.Pass == Backward {
			oursRate = 200
		}
		if row.BestPeer != best || math.Abs(row.Ratio-oursRate/bestRate) > 1e-12 {
			t.Errorf("%v: best %s ratio %v, want %s %v", row.Case, row.BestPeer, row.Ratio, best, oursRate/bestRate)
		}
	}
	s := Stats(cmp.Presets[0].Rows, Forward)
	if s.Shapes != 4 || s.Leads != 1 || math.Abs(s.Max-1.6) > 1e-12 || math.Abs(s.Min-0.8) > 1e-12 {
		t.Errorf("forward stats %+v", s)
	}

	dir := t.TempDir()
	plots, err := cmp.WritePlots(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(plots) != 4 {
		t.Errorf("plots %v, want PNG and SVG for gqa-kv and gqa-contention", plots)
	}
	checkImages(t, plots)
	var b bytes.Buffer
	if err := cmp.WriteMarkdown(&b, MarkdownOptions{Title: "H200", ImgPrefix: "img/", Plots: plots, Commands: []string{"bash bench/run-h200.sh"}}); err != nil {
		t.Fatal(err)
	}
	md := b.String()
	checkContains(t, "comparison", md, []string{
		"## H200\n", "Measured " + time.Now().UTC().Format("2006-01-02") + " on NVIDIA H200, bf16.",
		"```\nbash bench/run-h200.sh\n```",
		"flashattn reaches",
		"| gqa-kv | fwd | 4 | ",
		"### gqa-kv\n\n![gqa-kv](img/gqa-kv.png)",
		"| shape | mask | pass | flashattn | torch-cudnn | torch-flash | best peer | ours ÷ best |",
		"| B4 N4096 H32/1 D128 | - | fwd | 400 | n/a | 250 | torch-flash | 1.60 |",
		"| B4 N4096 H32/8 D128 | - | bwd | 200 | 500 | 250 | torch-cudnn | 0.40 |",
		"Contention: time with two query heads per key head",
		"| 128 | false | 1.00 | 1.00 | 1.00 |",
		"torch-cudnn, unsupported ×2: head dim above 256",
	})
}

func TestSummaryWithoutPeers(t *testing.T) {
	cmp := Compare([]*File{syntheticFile(t, "flux", Ours, "cuda", func(Case) float64 { return 1 })})
	if s := cmp.Summary(); !strings.Contains(s, "no ratio") {
		t.Errorf("summary %q", s)
	}
}

func TestTinySweepCPU(t *testing.T) {
	cs, err := PresetCases("tiny", "fp32")
	if err != nil {
		t.Fatal(err)
	}
	f := NewFile("test")
	var writes int
	recs, skipped, err := Sweep(SweepConfig{
		Runner: NewHostRunner(cpu.New(), ""),
		Cases:  cs,
		Timing: Timing{MinRepeats: 1, MaxRepeats: 2, Budget: time.Millisecond},
		After:  func([]Record) error { writes++; return nil },
	})
	if err != nil || skipped != 0 {
		t.Fatal(err, skipped)
	}
	if len(recs) != len(cs) || writes != len(cs) {
		t.Fatalf("%d records, %d writes for %d cases", len(recs), writes, len(cs))
	}
	for _, r := range recs {
		if !r.OK() || r.TFLOPs <= 0 || r.MedianMs <= 0 || r.MinMs > r.MedianMs || r.MaxMs < r.MedianMs || r.Backend != "cpu" {
			t.Errorf("record %+v", r)
		}
	}
	f.Records = recs
	dir := t.TempDir()
	paths, err := WriteOutputs(dir, f)
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, p := range paths {
		names[filepath.Base(p)] = true
	}
	for _, n := range []string{"results.md", "tiny-seqlen.png", "tiny-seqlen.svg", "tiny-headdim.png", "tiny-headdim.svg"} {
		if !names[n] {
			t.Errorf("no %s among %v", n, paths)
		}
	}
	checkImages(t, paths[1:])
	md, _ := os.ReadFile(filepath.Join(dir, "results.md"))
	if !strings.Contains(string(md), "GFLOP/s") || strings.Count(string(md), "| flashattn | cpu |") != len(cs) {
		t.Errorf("results.md:\n%s", md)
	}
}

func TestSweepDeadline(t *testing.T) {
	cs, _ := PresetCases("tiny-headdim", "fp32")
	recs, skipped, err := Sweep(SweepConfig{
		Runner:   &fakeRunner{work: &fakeWork{sets: 1, times: []float64{1}}},
		Cases:    cs,
		Timing:   Timing{MinRepeats: 1, MaxRepeats: 1},
		Deadline: time.Now().Add(-time.Second),
	})
	if err != nil || len(recs) != 0 || skipped != len(cs) {
		t.Errorf("past deadline: %d records, %d skipped, %v", len(recs), skipped, err)
	}
}

func TestProgress(t *testing.T) {
	var b bytes.Buffer
	p := NewProgress(&b, 10)
	now := p.start
	p.now = func() time.Time { return now }
	p.Update(1, "early")
	if b.Len() != 0 {
		t.Errorf("drawn before %v: %q", ProgressDelay, b.String())
	}
	now = now.Add(ProgressDelay + time.Second)
	p.Update(5, "half")
	p.Update(6, "too soon")
	now = now.Add(time.Minute)
	p.Update(10, "done")
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], "5/10") || !strings.Contains(lines[0], "half") ||
		!strings.Contains(lines[0], "eta 3s") || !strings.Contains(lines[1], "10/10") {
		t.Errorf("progress lines %q", lines)
	}
}

// checkContains reports each of wants that text (named what) lacks.
func checkContains(t *testing.T, what, text string, wants []string) {
	t.Helper()
	for _, want := range wants {
		if !strings.Contains(text, want) {
			t.Errorf("%s lacks %q:\n%s", what, want, text)
		}
	}
}

// biasCheckingBackend is a backend that fails every call whose bias is not
// the one want describes: its shape, and whether its gradient is asked for
// (and then returned).
type biasCheckingBackend struct {
	attn.Backend
	c Case
}

func (b biasCheckingBackend) check(opt attn.Options) error {
	got := []int(nil)
	if opt.Bias != nil {
		got = opt.Bias.Tensor.Shape
	}
	if !slices.Equal(got, b.c.BiasShape()) || (opt.Bias != nil && opt.Bias.RequiresGrad != b.c.BiasGrad) {
		return fmt.Errorf("case %v: the call's bias is %v (gradient %t)", b.c, got, opt.Bias != nil && opt.Bias.RequiresGrad)
	}
	return nil
}

func (b biasCheckingBackend) Forward(q, k, v attn.Tensor, opt attn.Options) (attn.Result, error) {
	if err := b.check(opt); err != nil {
		return attn.Result{}, err
	}
	return b.Backend.Forward(q, k, v, opt)
}

func (b biasCheckingBackend) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	if err := b.check(opt); err != nil {
		return attn.Gradients{}, err
	}
	g, err := b.Backend.Backward(q, k, v, o, lse, dO, opt)
	if err == nil && b.c.BiasGrad && (g.DBias == nil || !slices.Equal(g.DBias.Shape, b.c.BiasShape())) {
		return g, fmt.Errorf("case %v: no dBias of the bias's shape", b.c)
	}
	return g, err
}

func TestTinyFeaturesSweepCPU(t *testing.T) {
	// The features preset runs on the CPU (each case's bias reaching the
	// backend), and the comparison prints each feature's cost.
	cs, err := PresetCases("tiny-features", "bf16")
	if err != nil {
		t.Fatal(err)
	}
	f := NewFile("test")
	for _, c := range cs {
		r := Run(NewHostRunner(biasCheckingBackend{cpu.New(), c}, ""), c, Timing{MinRepeats: 1, MaxRepeats: 2, Budget: time.Millisecond})
		if !r.OK() || r.TFLOPs <= 0 {
			t.Errorf("%v: %+v", c, r)
		}
		f.Records = append(f.Records, r)
	}
	var b bytes.Buffer
	if err := Compare([]*File{f}).WriteMarkdown(&b, MarkdownOptions{}); err != nil {
		t.Fatal(err)
	}
	checkContains(t, "comparison", b.String(), []string{
		"### tiny-features\n",
		"Feature cost: each series' rate with the feature over its rate without it",
		"| features | pass | flashattn |",
		"| drop 0.1 | fwd | ", "| cap 30 | bwd | ", "| win(16,0) | fwd | ", "| bias 1hnm | fwd | ",
		"| bias 1hnm dbias | bwd | ", "| det | bwd | ",
	})
	if n := strings.Count(b.String(), "\n| drop 0.1 |"); n != 2 {
		t.Errorf("%d dropout rows in the feature table, want 2 (fwd, bwd)", n)
	}
}
