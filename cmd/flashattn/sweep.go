package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/flashattn/flashattn/bench"
)

const sweepUsageHead = `Usage: flashattn sweep --preset NAME[,NAME…] [--backend B] [--out DIR] [--emit-shapes FILE] [flags]

Measures every case of the presets on one backend and writes into DIR:
results.json (one record per measurement, rewritten after each, so an
interrupted sweep keeps what it measured), results.md (a table), and per
preset a plot of the rate against N or D as PNG and SVG. A case the backend
cannot run is recorded with status "unsupported" and the reason. A progress
bar goes to standard error when the sweep runs longer than a few seconds.

--emit-shapes writes the cases as a shape list (JSON) for the peer script
bench/peers/sdpa.py; without --out nothing is measured.

Flags:
  --preset NAMES            presets, comma-separated (required; see below)
  --backend cpu|cuda|auto   backend (default auto)
  --dtype fp32|fp16|bf16    element type (default bf16)
  --out DIR                 output folder, created when missing
  --emit-shapes FILE        write the shape list to FILE
  --time-limit DURATION     start no case after this long (default 0: none);
                            the cases left are not recorded
  --warmup DURATION         least warm-up per case (default 50ms CPU, 25ms GPU)
  --budget DURATION         timed repeats per case (default 300ms CPU, 100ms GPU)

Presets:
`

func sweepUsage() string {
	var b strings.Builder
	b.WriteString(sweepUsageHead)
	for _, p := range bench.Presets() {
		fmt.Fprintf(&b, "  %-16s %s\n", p.Name, p.Description)
	}
	return b.String()
}

func init() {
	register(&command{
		name:    "sweep",
		summary: "measure a preset sweep of shapes; results.json, results.md, plots",
		usage:   sweepUsage(),
		run:     runSweep,
	})
}

func runSweep(args []string, stdout io.Writer) error {
	var (
		preset, backend, dtype, out, emit string
		limit                             time.Duration
		timing                            timingFlags
	)
	fs := newFlagSet(commands["sweep"])
	fs.StringVar(&preset, "preset", "", "")
	fs.StringVar(&backend, "backend", "auto", "")
	fs.StringVar(&dtype, "dtype", "bf16", "")
	fs.StringVar(&out, "out", "", "")
	fs.StringVar(&emit, "emit-shapes", "", "")
	fs.DurationVar(&limit, "time-limit", 0, "")
	timing.register(fs, false)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if preset == "" {
		return usageErrorf("missing --preset")
	}
	if out == "" && emit == "" {
		return usageErrorf("missing --out (or --emit-shapes)")
	}
	cases, err := bench.PresetCases(preset, dtype)
	if err != nil {
		return err
	}
	if emit != "" {
		sl := &bench.ShapeList{Schema: bench.ShapesSchema, Created: time.Now().UTC().Truncate(time.Second), Preset: preset, Cases: cases}
		if err := sl.Write(emit); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "wrote %s (%d cases)\n", emit, len(cases))
	}
	if out == "" {
		return nil
	}
	r, pol, err := timing.open(backend)
	if err != nil {
		return err
	}
	defer r.Close()
	if err := os.MkdirAll(out, 0o755); err != nil {
		return fmt.Errorf("--out: %w", err)
	}
	file := bench.NewFile("flashattn sweep " + strings.Join(args, " "))
	resultsPath := filepath.Join(out, bench.ResultsName)
	if err := file.Write(resultsPath); err != nil {
		return err
	}
	cfg := bench.SweepConfig{
		Runner:   r,
		Cases:    cases,
		Timing:   pol,
		Progress: os.Stderr,
		After: func(recs []bench.Record) error {
			file.Records = recs
			return file.Write(resultsPath)
		},
	}
	if limit > 0 {
		cfg.Deadline = time.Now().Add(limit)
	}
	recs, skipped, err := bench.Sweep(cfg)
	file.Records = recs
	if err != nil {
		return err
	}
	paths, err := bench.WriteOutputs(out, file)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s on %s: %s\n", r.Backend(), orDash(r.Device()), countStatus(recs))
	if skipped > 0 {
		fmt.Fprintf(stdout, "time limit %v reached: %d of %d cases not measured\n", limit, skipped, len(cases))
	}
	fmt.Fprintf(stdout, "wrote %s\n", resultsPath)
	for _, p := range paths {
		fmt.Fprintf(stdout, "wrote %s\n", p)
	}
	return nil
}

// countStatus returns "N records: a ok, b unsupported, c error".
func countStatus(recs []bench.Record) string {
	n := map[string]int{}
	for _, r := range recs {
		n[r.Status]++
	}
	keys := make([]string, 0, len(n))
	for k := range n {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%d %s", n[k], k)
	}
	return fmt.Sprintf("%d records: %s", len(recs), strings.Join(parts, ", "))
}
