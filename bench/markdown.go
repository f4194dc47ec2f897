package bench

import (
	"fmt"
	"io"
	"strings"
)

// RateUnit returns the unit the rates of recs read best in, with its size
// in TFLOP/s: "TFLOP/s" (1) when any measured rate reaches 1 TFLOP/s,
// otherwise "GFLOP/s" (0.001).
func RateUnit(recs []Record) (string, float64) {
	for _, r := range recs {
		if r.OK() && r.TFLOPs >= 1 {
			return "TFLOP/s", 1
		}
	}
	return "GFLOP/s", 1e-3
}

// WriteTable writes recs as Markdown tables, one per preset in order of
// first appearance: implementation, backend, pass, sizes, mask, median, min
// and max time, rate, kernel variant, dQ algorithm and status. A
// context-parallel record's times are its critical path, and its variant
// column holds the scheme, ranks, split cost and speedup.
func WriteTable(w io.Writer, recs []Record) error {
	unit, scale := RateUnit(recs)
	var b strings.Builder
	for _, preset := range distinct(recs, presetOf) {
		fmt.Fprintf(&b, "### %s\n\n", preset)
		fmt.Fprintf(&b, "| implementation | backend | pass | B | N | M | H | Hkv | DK | DV | mask | median ms | min ms | max ms | %s | variant | dQ | status |\n", unit)
		b.WriteString("|---|---|---|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|---|---|---|\n")
		for _, r := range recs {
			if presetOf(r) != preset {
				continue
			}
			med, lo, hi, rate := "—", "—", "—", "—"
			if r.OK() {
				med, lo, hi = fmtMs(r.MedianMs), fmtMs(r.MinMs), fmtMs(r.MaxMs)
				rate = fmtRate(r.TFLOPs / scale)
			}
			variant := orDash(cell(r.KernelVariant))
			if r.CP != nil {
				variant = cell(r.CP.Summary())
			}
			status := r.Status
			if r.Message != "" {
				status += ": " + cell(r.Message)
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %d | %d | %d | %d | %d | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s |\n",
				cell(r.Implementation), cell(r.Backend), r.Pass, r.Batch, r.SeqlenQ, r.SeqlenK, r.Heads, r.KVHeads,
				r.HeadDim, r.HeadDimV, r.Mask(), med, lo, hi, rate, variant, orDash(cell(r.DQAlgorithm)), status)
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	if err != nil {
		return fmt.Errorf("bench: write table: %w", err)
	}
	return nil
}

func presetOf(r Record) string {
	if r.Preset == "" {
		return "bench"
	}
	return r.Preset
}

// fmtMs formats milliseconds with four significant digits.
func fmtMs(x float64) string { return fmt.Sprintf("%.4g", x) }

// fmtRate formats a rate with three significant digits, without exponent
// for ordinary sizes.
func fmtRate(x float64) string {
	switch {
	case x >= 100:
		return fmt.Sprintf("%.0f", x)
	case x >= 10:
		return fmt.Sprintf("%.1f", x)
	default:
		return fmt.Sprintf("%.3g", x)
	}
}

// cell makes s safe inside a Markdown table cell: one line, no bar, at
// most 120 characters.
func cell(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	s = strings.ReplaceAll(s, "|", "\\|")
	if r := []rune(s); len(r) > 120 {
		s = string(r[:117]) + "…"
	}
	return s
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
