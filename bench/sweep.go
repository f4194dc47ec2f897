package bench

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// SweepConfig says what Sweep measures and where it reports.
type SweepConfig struct {
	// Runner runs the cases.
	Runner Runner
	// Cases are measured in order.
	Cases []Case
	// Timing is the measuring policy.
	Timing Timing
	// Progress, when set, receives a progress bar (see Progress).
	Progress io.Writer
	// Deadline, when not zero, stops the sweep before a case that would start
	// after it; the cases left are not recorded.
	Deadline time.Time
	// After, when set, is called with the records so far after each case
	// (to write them as they come); an error stops the sweep.
	After func(recs []Record) error
}

// Sweep measures every case and returns the records, one per case measured,
// and the number of cases left out by the deadline.
func Sweep(cfg SweepConfig) (recs []Record, skipped int, err error) {
	var bar *Progress
	if cfg.Progress != nil {
		bar = NewProgress(cfg.Progress, len(cfg.Cases))
		defer bar.Finish()
	}
	for i, c := range cfg.Cases {
		if !cfg.Deadline.IsZero() && time.Now().After(cfg.Deadline) {
			return recs, len(cfg.Cases) - i, nil
		}
		if bar != nil {
			bar.Update(i, c.Preset+" "+c.String())
		}
		recs = append(recs, Run(cfg.Runner, c, cfg.Timing))
		if cfg.After != nil {
			if err := cfg.After(recs); err != nil {
				return recs, 0, err
			}
		}
	}
	if bar != nil {
		bar.Update(len(cfg.Cases), "done")
	}
	return recs, 0, nil
}

// WriteOutputs writes f's records into dir as results.md and one PNG and one
// SVG plot per preset that has something to draw, and returns the paths
// written. results.json is the caller's (File.Write).
func WriteOutputs(dir string, f *File) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	var md strings.Builder
	fmt.Fprintf(&md, "# flashattn results\n\n%s\n\n", describeFile(f))
	if err := WriteTable(&md, f.Records); err != nil {
		return nil, err
	}
	mdPath := filepath.Join(dir, "results.md")
	if err := os.WriteFile(mdPath, []byte(md.String()), 0o644); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	paths := []string{mdPath}
	plots, err := WritePlots(dir, f.Records)
	paths = append(paths, plots...)
	return paths, err
}

// describeFile returns a one-paragraph description of a results file: date,
// devices and command.
func describeFile(f *File) string {
	var s strings.Builder
	fmt.Fprintf(&s, "Measured %s", f.Created.Format("2006-01-02 15:04 MST"))
	if devs := distinct(f.Records, func(r Record) string { return r.Device }); len(devs) > 0 {
		fmt.Fprintf(&s, " on %s", strings.Join(devs, ", "))
	}
	if f.Host != "" {
		fmt.Fprintf(&s, " (host %s)", f.Host)
	}
	s.WriteString(".")
	if f.Command != "" {
		fmt.Fprintf(&s, " Command: `%s`.", f.Command)
	}
	return s.String()
}

// distinct returns the distinct non-empty values of key over recs, in order
// of first appearance.
func distinct(recs []Record, key func(Record) string) []string {
	var out []string
	seen := map[string]bool{}
	for _, r := range recs {
		k := key(r)
		if k != "" && !seen[k] {
			seen[k] = true
			out = append(out, k)
		}
	}
	return out
}
