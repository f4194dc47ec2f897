package bench

import (
	"fmt"
	"io"
	"math"
	"path"
	"sort"
	"strings"
	"time"
)

// Comparison merges result files: per preset, one row per measured case,
// one cell per series (an implementation, with its backend where one
// implementation ran on several), and the ratio of ours to the best peer.
type Comparison struct {
	// Files are the merged files, in the order given.
	Files []*File
	// Labels are the series, ours first.
	Labels []string
	// Presets are in order of first appearance.
	Presets []ComparePreset
}

// ComparePreset is one preset's rows.
type ComparePreset struct {
	Name string
	Rows []CompareRow
}

// CompareRow is one case as measured by every series.
type CompareRow struct {
	Case Case
	// Cells maps a series label to its record; a series that did not
	// measure the case has none.
	Cells map[string]Record
	// Ours is the best ok record of ours (zero when none is ok), BestPeer
	// the label of the fastest ok peer ("" when none).
	Ours     Record
	BestPeer string
	// Ratio is ours' TFLOP/s over the best peer's; 0 when either is missing.
	Ratio float64
}

// isOurs reports whether a record is flashattn's own.
func isOurs(r Record) bool { return r.Implementation == Ours }

// Compare merges the files. A record that repeats an earlier one (same
// series, preset and case) replaces it.
func Compare(files []*File) *Comparison {
	cmp := &Comparison{Files: files}
	var all []Record
	for _, f := range files {
		all = append(all, f.Records...)
	}
	labels := seriesLabels(all)
	seen := map[string]bool{}
	for _, r := range all {
		l := labelOf(labels, r)
		if !seen[l] {
			seen[l] = true
			cmp.Labels = append(cmp.Labels, l)
		}
	}
	sortLabels(cmp.Labels)
	presetIndex := map[string]int{}
	index := map[string]int{}
	for _, r := range all {
		pn := presetOf(r)
		pi, ok := presetIndex[pn]
		if !ok {
			cmp.Presets = append(cmp.Presets, ComparePreset{Name: pn})
			pi = len(cmp.Presets) - 1
			presetIndex[pn] = pi
		}
		p := &cmp.Presets[pi]
		k := pn + "\x00" + r.Key()
		i, ok := index[k]
		if !ok {
			c := r.Case
			c.Preset = pn
			p.Rows = append(p.Rows, CompareRow{Case: c, Cells: map[string]Record{}})
			i = len(p.Rows) - 1
			index[k] = i
		}
		p.Rows[i].Cells[labelOf(labels, r)] = r
	}
	for pi := range cmp.Presets {
		for ri := range cmp.Presets[pi].Rows {
			row := &cmp.Presets[pi].Rows[ri]
			var best Record
			for l, r := range row.Cells {
				if !r.OK() {
					continue
				}
				if isOurs(r) {
					if !row.Ours.OK() || r.TFLOPs > row.Ours.TFLOPs {
						row.Ours = r
					}
				} else if !best.OK() || r.TFLOPs > best.TFLOPs || (r.TFLOPs == best.TFLOPs && l < row.BestPeer) {
					best, row.BestPeer = r, l
				}
			}
			if row.Ours.OK() && best.OK() && best.TFLOPs > 0 {
				row.Ratio = row.Ours.TFLOPs / best.TFLOPs
			}
		}
	}
	return cmp
}

// Records returns every record of the comparison, preset by preset.
func (c *Comparison) Records() []Record {
	var out []Record
	for _, p := range c.Presets {
		for _, row := range p.Rows {
			for _, l := range c.Labels {
				if r, ok := row.Cells[l]; ok {
					r.Preset = p.Name
					out = append(out, r)
				}
			}
		}
	}
	return out
}

// RatioStats summarises the ratios of a set of rows.
type RatioStats struct {
	// Shapes is the number of rows with a ratio; Leads those above 1.
	Shapes, Leads int
	// GeoMean is the geometric mean of the ratios; Min and Max their range.
	GeoMean, Min, Max float64
	// MinRow and MaxRow are the rows of the extremes.
	MinRow, MaxRow CompareRow
}

// Stats returns the ratio statistics of rows whose pass is pass (every
// pass when empty).
func Stats(rows []CompareRow, pass Pass) RatioStats {
	var s RatioStats
	var logSum float64
	for _, r := range rows {
		if r.Ratio <= 0 || (pass != "" && r.Case.Pass != pass) {
			continue
		}
		if s.Shapes == 0 || r.Ratio < s.Min {
			s.Min, s.MinRow = r.Ratio, r
		}
		if s.Shapes == 0 || r.Ratio > s.Max {
			s.Max, s.MaxRow = r.Ratio, r
		}
		s.Shapes++
		if r.Ratio > 1 {
			s.Leads++
		}
		logSum += math.Log(r.Ratio)
	}
	if s.Shapes > 0 {
		s.GeoMean = math.Exp(logSum / float64(s.Shapes))
	}
	return s
}

// allRows returns every row of every preset.
func (c *Comparison) allRows() []CompareRow {
	var out []CompareRow
	for _, p := range c.Presets {
		out = append(out, p.Rows...)
	}
	return out
}

// Summary returns one or two sentences saying where flashattn leads and
// where it trails the best peer, or why no ratio exists.
func (c *Comparison) Summary() string {
	rows := c.allRows()
	s := Stats(rows, "")
	if s.Shapes == 0 {
		return "No shape was measured both by flashattn and by a peer, so there is no ratio."
	}
	where := func(r CompareRow) string { return r.Case.Preset + " " + r.Case.String() }
	var b strings.Builder
	fmt.Fprintf(&b, "Over %d shapes measured by flashattn and at least one peer, flashattn reaches %s× the best peer's TFLOP/s (geometric mean; from %s× on %s to %s× on %s).",
		s.Shapes, fmtRatio(s.GeoMean), fmtRatio(s.Min), where(s.MinRow), fmtRatio(s.Max), where(s.MaxRow))
	var leads, trails []string
	for _, p := range c.Presets {
		for _, pass := range []Pass{Forward, Backward, ForwardBackward} {
			ps := Stats(p.Rows, pass)
			if ps.Shapes == 0 {
				continue
			}
			name := fmt.Sprintf("%s %s (%s×)", p.Name, pass, fmtRatio(ps.GeoMean))
			if ps.GeoMean >= 1 {
				leads = append(leads, name)
			} else {
				trails = append(trails, name)
			}
		}
	}
	switch {
	case len(leads) == 0:
		fmt.Fprintf(&b, " It trails in every preset: %s.", strings.Join(trails, ", "))
	case len(trails) == 0:
		fmt.Fprintf(&b, " It leads in every preset: %s.", strings.Join(leads, ", "))
	default:
		fmt.Fprintf(&b, " It leads in %s and trails in %s.", strings.Join(leads, ", "), strings.Join(trails, ", "))
	}
	return b.String()
}

// MarkdownOptions shape the Markdown a Comparison writes.
type MarkdownOptions struct {
	// Title heads the section ("" for a default naming devices and date).
	Title string
	// Level is the heading level of the title (2 when 0).
	Level int
	// ImgPrefix is prepended to the plot file names in image links; Plots
	// are the names (as WritePlots returned them, PNGs only are linked).
	ImgPrefix string
	Plots     []string
	// Commands are listed, each in a code block line, under the title.
	Commands []string
}

// WriteMarkdown writes the comparison: title, date, devices, commands, the
// summary, a ratio overview per preset and pass, then per preset its plot
// and its table (TFLOP/s per series, the best peer and the ratio), for the
// contention pair the time ratios, and for cases that differ from another
// case of the preset only by their features the cost of each feature.
func (c *Comparison) WriteMarkdown(w io.Writer, o MarkdownOptions) error {
	if o.Level <= 0 {
		o.Level = 2
	}
	h := strings.Repeat("#", o.Level)
	var b strings.Builder
	recs := c.Records()
	devices := distinct(recs, func(r Record) string { return r.Device })
	var latest time.Time
	for _, f := range c.Files {
		if f.Created.After(latest) {
			latest = f.Created
		}
	}
	title := o.Title
	if title == "" {
		title = "flashattn against its peers"
		if len(devices) > 0 {
			title += " on " + strings.Join(devices, ", ")
		}
	}
	fmt.Fprintf(&b, "%s %s\n\n", h, title)
	if !latest.IsZero() {
		fmt.Fprintf(&b, "Measured %s", latest.Format("2006-01-02"))
	} else {
		b.WriteString("Measured")
	}
	if len(devices) > 0 {
		fmt.Fprintf(&b, " on %s", strings.Join(devices, ", "))
	}
	dtypes := distinct(recs, func(r Record) string { return r.DType })
	if len(dtypes) > 0 {
		fmt.Fprintf(&b, ", %s", strings.Join(dtypes, "/"))
	}
	b.WriteString(". Rates use the conventional count: forward 2·B·H·(DK+DV) per visible query-key pair " +
		"(4·B·H·N·M·D unmasked, about half when causal), backward 2.5× forward; times are medians.\n\n")
	cmds := o.Commands
	if len(cmds) == 0 {
		for _, f := range c.Files {
			if f.Command != "" {
				cmds = append(cmds, f.Command)
			}
		}
	}
	if len(cmds) > 0 {
		b.WriteString("```\n")
		for _, cmd := range cmds {
			b.WriteString(cmd + "\n")
		}
		b.WriteString("```\n\n")
	}
	b.WriteString(c.Summary() + "\n\n")

	if Stats(c.allRows(), "").Shapes > 0 {
		b.WriteString("| preset | pass | shapes | geomean ours ÷ best peer | min | max | ours leads |\n|---|---|--:|--:|--:|--:|--:|\n")
		for _, p := range c.Presets {
			for _, pass := range []Pass{Forward, Backward, ForwardBackward} {
				s := Stats(p.Rows, pass)
				if s.Shapes == 0 {
					continue
				}
				fmt.Fprintf(&b, "| %s | %s | %d | %s | %s | %s | %d |\n", p.Name, pass, s.Shapes, fmtRatio(s.GeoMean), fmtRatio(s.Min), fmtRatio(s.Max), s.Leads)
			}
		}
		b.WriteString("\n")
	}

	unit, scale := RateUnit(recs)
	for _, p := range c.Presets {
		fmt.Fprintf(&b, "%s# %s\n\n", h, p.Name)
		for _, pl := range o.Plots {
			if path.Base(pl) == fileName(p.Name)+".png" {
				fmt.Fprintf(&b, "![%s](%s%s)\n\n", p.Name, o.ImgPrefix, path.Base(pl))
			}
		}
		fmt.Fprintf(&b, "%s; n/a: the implementation refuses the shape; err: it failed; blank: not measured.\n\n", unit)
		b.WriteString("| shape | mask | pass |")
		for _, l := range c.Labels {
			fmt.Fprintf(&b, " %s |", cell(l))
		}
		b.WriteString(" best peer | ours ÷ best |\n|---|---|---|")
		for range c.Labels {
			b.WriteString("--:|")
		}
		b.WriteString("---|--:|\n")
		for _, row := range p.Rows {
			fmt.Fprintf(&b, "| %s | %s | %s |", row.Case.Shape(), row.Case.Mask(), row.Case.Pass)
			for _, l := range c.Labels {
				r, ok := row.Cells[l]
				switch {
				case !ok:
					b.WriteString(" |")
				case r.OK():
					fmt.Fprintf(&b, " %s |", fmtRate(r.TFLOPs/scale))
				case r.Status == StatusUnsupported:
					b.WriteString(" n/a |")
				default:
					b.WriteString(" err |")
				}
			}
			ratio := "—"
			if row.Ratio > 0 {
				ratio = fmtRatio(row.Ratio)
			}
			fmt.Fprintf(&b, " %s | %s |\n", orDash(cell(row.BestPeer)), ratio)
		}
		b.WriteString("\n")
		if p.Name == "gqa-contention" {
			writeContention(&b, c.Labels, p.Rows)
		}
		writeFeatureCost(&b, c.Labels, p.Rows)
	}
	if notes := c.failures(); len(notes) > 0 {
		fmt.Fprintf(&b, "%s# Refusals and failures\n\n", h)
		for _, n := range notes {
			b.WriteString("- " + n + "\n")
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	if err != nil {
		return fmt.Errorf("bench: write comparison: %w", err)
	}
	return nil
}

// failures lists the distinct messages of records that are not ok, per
// series, with how many records carry each.
func (c *Comparison) failures() []string {
	type key struct{ label, status, msg string }
	count := map[key]int{}
	var order []key
	labels := seriesLabels(c.Records())
	for _, r := range c.Records() {
		if r.OK() {
			continue
		}
		k := key{labelOf(labels, r), r.Status, cell(r.Message)}
		if count[k] == 0 {
			order = append(order, k)
		}
		count[k]++
	}
	var out []string
	for _, k := range order {
		out = append(out, fmt.Sprintf("%s, %s ×%d: %s", k.label, k.status, count[k], k.msg))
	}
	return out
}

// writeContention writes, for the contention pair, each series' time with
// Hkv = H/2 over its time with Hkv = H at the same N (the same work and the
// same number of atomic adds, twice the query heads per key head).
func writeContention(b *strings.Builder, labels []string, rows []CompareRow) {
	type key struct {
		n   int
		det bool
	}
	shared := map[key]CompareRow{}
	full := map[key]CompareRow{}
	var keys []key
	for _, r := range rows {
		k := key{r.Case.SeqlenQ, r.Case.Deterministic}
		switch {
		case r.Case.KVHeads == r.Case.Heads:
			full[k] = r
		case 2*r.Case.KVHeads == r.Case.Heads:
			if _, ok := shared[k]; !ok {
				keys = append(keys, k)
			}
			shared[k] = r
		}
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].det != keys[j].det {
			return !keys[i].det
		}
		return keys[i].n < keys[j].n
	})
	if len(keys) == 0 {
		return
	}
	b.WriteString("Contention: time with two query heads per key head over time with one (same work); 1.00 is no contention.\n\n")
	b.WriteString("| N | deterministic |")
	for _, l := range labels {
		fmt.Fprintf(b, " %s |", cell(l))
	}
	b.WriteString("\n|--:|---|")
	for range labels {
		b.WriteString("--:|")
	}
	b.WriteString("\n")
	for _, k := range keys {
		f, ok := full[k]
		if !ok {
			continue
		}
		s := shared[k]
		fmt.Fprintf(b, "| %d | %t |", k.n, k.det)
		for _, l := range labels {
			rs, rf := s.Cells[l], f.Cells[l]
			if rs.OK() && rf.OK() && rf.MedianMs > 0 {
				fmt.Fprintf(b, " %.2f |", rs.MedianMs/rf.MedianMs)
			} else {
				b.WriteString(" — |")
			}
		}
		b.WriteString("\n")
	}
	b.WriteString("\n")
}

// plain returns c without its features: no dropout, softcap, window, bias
// or determinism.
func plain(c Case) Case {
	c.Dropout, c.Softcap, c.Window, c.Bias, c.BiasGrad, c.Deterministic = 0, 0, nil, "", false, false
	return c
}

// writeFeatureCost writes, for each row that is another row of the preset
// plus features (dropout, softcap, window, bias, determinism), each
// series' rate over its rate on that plain row. Rates count visible pairs
// only, so a window's ratio is its rate per visible pair.
func writeFeatureCost(b *strings.Builder, labels []string, rows []CompareRow) {
	plainRows := map[string]CompareRow{}
	plainKeys := make([]string, len(rows)) // of each row's case without its features
	for i, r := range rows {
		plainKeys[i] = plain(r.Case).Key()
		if plainKeys[i] == r.Case.Key() {
			plainRows[plainKeys[i]] = r
		}
	}
	var lines []string
	for i, r := range rows {
		base, ok := plainRows[plainKeys[i]]
		if !ok || base.Case.Key() == r.Case.Key() {
			continue
		}
		line := fmt.Sprintf("| %s | %s |", r.Case.Mask(), r.Case.Pass)
		for _, l := range labels {
			f, p := r.Cells[l], base.Cells[l]
			if f.OK() && p.OK() && p.TFLOPs > 0 {
				line += fmt.Sprintf(" %.2f |", f.TFLOPs/p.TFLOPs)
			} else {
				line += " — |"
			}
		}
		lines = append(lines, line)
	}
	if len(lines) == 0 {
		return
	}
	b.WriteString("Feature cost: each series' rate with the feature over its rate without it (same shape and pass; " +
		"rates per visible pair); 1.00 costs nothing.\n\n| features | pass |")
	for _, l := range labels {
		fmt.Fprintf(b, " %s |", cell(l))
	}
	b.WriteString("\n|---|---|")
	for range labels {
		b.WriteString("--:|")
	}
	b.WriteString("\n" + strings.Join(lines, "\n") + "\n\n")
}

// fmtRatio formats a ratio with two decimals, or two significant digits
// below 0.1.
func fmtRatio(x float64) string {
	if x < 0.1 {
		return fmt.Sprintf("%.2g", x)
	}
	return fmt.Sprintf("%.2f", x)
}

// WritePlots draws one figure per preset with every series, as WritePlots
// does for one file, and returns the paths written.
func (c *Comparison) WritePlots(dir string) ([]string, error) {
	return WritePlots(dir, c.Records())
}
