package bench

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// plotSpec says how a preset's records are drawn: the x axis and how the
// records split into panels (each panel one line per implementation).
type plotSpec struct {
	x      func(Case) float64
	xLabel string
	logX   bool
	// panel returns a panel's title and its rank; panels are laid out in
	// rank order, one grid row per distinct row value (the pass when row is
	// nil).
	panel func(Case) (string, int)
	row   func(Case) int
	// wide draws each panel twice as wide (many points on the x axis).
	wide bool
}

func passRank(p Pass) int {
	switch p {
	case Forward:
		return 0
	case Backward:
		return 1
	}
	return 2
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

func maskTitle(c Case) string {
	if m := c.Mask(); m != "-" {
		return " " + m
	}
	return ""
}

// specFor returns the plot layout of a preset.
func specFor(preset string) plotSpec {
	switch preset {
	case "seqlen", "tiny-seqlen":
		return plotSpec{
			x: func(c Case) float64 { return float64(c.SeqlenQ) }, xLabel: "sequence length N (B·N fixed)", logX: true,
			panel: func(c Case) (string, int) {
				return fmt.Sprintf("%s D=%d%s", c.Pass, c.HeadDim, maskTitle(c)),
					(passRank(c.Pass)*2+b2i(c.Causal))<<20 | c.HeadDim
			},
			row: func(c Case) int { return passRank(c.Pass)*2 + b2i(c.Causal) },
		}
	case "headdim", "tiny-headdim":
		return plotSpec{
			x: func(c Case) float64 { return float64(c.HeadDim) }, xLabel: "head dim D",
			panel: func(c Case) (string, int) {
				return fmt.Sprintf("%s %s%s", c.Pass, fmt.Sprintf("B=%d H=%d N=%d", c.Batch, c.Heads, c.SeqlenQ), maskTitle(c)),
					passRank(c.Pass)<<20 | b2i(c.Causal)
			},
			wide: true,
		}
	case "gqa-kv":
		return plotSpec{
			x: func(c Case) float64 { return float64(c.KVHeads) }, xLabel: "key/value heads Hkv", logX: true,
			panel: func(c Case) (string, int) {
				return fmt.Sprintf("%s H=%d N=%d D=%d%s", c.Pass, c.Heads, c.SeqlenQ, c.HeadDim, maskTitle(c)),
					passRank(c.Pass) << 20
			},
		}
	case "gqa-contention":
		return plotSpec{
			x: func(c Case) float64 { return float64(c.SeqlenQ) }, xLabel: "sequence length N (B·N fixed)", logX: true,
			panel: func(c Case) (string, int) {
				return fmt.Sprintf("%s H=%d Hkv=%d D=%d%s", c.Pass, c.Heads, c.KVHeads, c.HeadDim, maskTitle(c)),
					passRank(c.Pass)<<20 | b2i(c.Deterministic)<<12 | c.KVHeads
			},
		}
	}
	return plotSpec{
		x: func(c Case) float64 { return float64(c.SeqlenQ) }, xLabel: "sequence length N", logX: true,
		panel: func(c Case) (string, int) {
			return fmt.Sprintf("%s H=%d/%d D=%d%s", c.Pass, c.Heads, c.KVHeads, c.HeadDim, maskTitle(c)),
				passRank(c.Pass) << 20
		},
	}
}

// seriesLabels returns the line label of every record: its implementation,
// followed by its backend when one implementation appears with several
// backends.
func seriesLabels(recs []Record) map[string]string {
	backends := map[string]map[string]bool{}
	for _, r := range recs {
		if backends[r.Implementation] == nil {
			backends[r.Implementation] = map[string]bool{}
		}
		backends[r.Implementation][r.Backend] = true
	}
	out := map[string]string{}
	for _, r := range recs {
		l := r.Implementation
		if len(backends[r.Implementation]) > 1 {
			l += " (" + r.Backend + ")"
		}
		out[r.Implementation+"\x00"+r.Backend] = l
	}
	return out
}

func labelOf(labels map[string]string, r Record) string {
	return labels[r.Implementation+"\x00"+r.Backend]
}

// sortLabels orders series labels with ours first, then by name.
func sortLabels(ls []string) {
	sort.Slice(ls, func(i, j int) bool {
		oi, oj := len(ls[i]) >= len(Ours) && ls[i][:len(Ours)] == Ours, len(ls[j]) >= len(Ours) && ls[j][:len(Ours)] == Ours
		if oi != oj {
			return oi
		}
		return ls[i] < ls[j]
	})
}

type panelData struct {
	title  string
	rank   int
	row    int
	series map[string]plotter.XYs
}

// figure is one preset's grid of panels, ready to draw.
type figure struct {
	plots [][]*plot.Plot
	w, h  vg.Length
}

// buildFigure lays out the ok records of one preset; ok is false when no
// panel has two points on one line (nothing worth a line plot).
func buildFigure(preset string, recs []Record, unit string, scale float64) (figure, bool, error) {
	spec := specFor(preset)
	labels := seriesLabels(recs)
	panels := map[string]*panelData{}
	var allLabels []string
	seenLabel := map[string]bool{}
	worth := false
	for _, r := range recs {
		if !r.OK() || presetOf(r) != preset || r.CP != nil {
			continue // context-parallel records are in the table only
		}
		title, rank := spec.panel(r.Case)
		p := panels[title]
		if p == nil {
			row := passRank(r.Pass)
			if spec.row != nil {
				row = spec.row(r.Case)
			}
			p = &panelData{title: title, rank: rank, row: row, series: map[string]plotter.XYs{}}
			panels[title] = p
		}
		l := labelOf(labels, r)
		if !seenLabel[l] {
			seenLabel[l] = true
			allLabels = append(allLabels, l)
		}
		p.series[l] = append(p.series[l], plotter.XY{X: spec.x(r.Case), Y: r.TFLOPs / scale})
		if len(p.series[l]) > 1 {
			worth = true
		}
	}
	if !worth {
		return figure{}, false, nil
	}
	sortLabels(allLabels)
	var list []*panelData
	for _, p := range panels {
		list = append(list, p)
	}
	sort.Slice(list, func(i, j int) bool {
		if list[i].rank != list[j].rank {
			return list[i].rank < list[j].rank
		}
		return list[i].title < list[j].title
	})
	// One grid row per row value; as many columns as the fullest row.
	var rows [][]*panelData
	for i, p := range list {
		if i == 0 || p.row != list[i-1].row {
			rows = append(rows, nil)
		}
		rows[len(rows)-1] = append(rows[len(rows)-1], p)
	}
	cols := 0
	for _, r := range rows {
		cols = max(cols, len(r))
	}
	fig := figure{plots: make([][]*plot.Plot, len(rows))}
	for j, row := range rows {
		fig.plots[j] = make([]*plot.Plot, cols)
		for i, pd := range row {
			p, err := drawPanel(pd, spec, allLabels, unit, j == 0 && i == 0)
			if err != nil {
				return figure{}, false, err
			}
			fig.plots[j][i] = p
		}
	}
	pw, ph := 4.2*vg.Inch, 3.2*vg.Inch
	if spec.wide {
		pw = 8 * vg.Inch
	}
	fig.w, fig.h = pw*vg.Length(cols), ph*vg.Length(len(rows))
	return fig, true, nil
}

// drawPanel makes the plot of one panel: a line with markers per series,
// colours fixed by the series' place in labels.
func drawPanel(pd *panelData, spec plotSpec, labels []string, unit string, legend bool) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = pd.title
	p.X.Label.Text = spec.xLabel
	p.Y.Label.Text = unit
	p.Y.Min = 0
	p.Add(plotter.NewGrid())
	xs := map[float64]bool{}
	for i, l := range labels {
		pts := pd.series[l]
		if len(pts) == 0 {
			continue
		}
		sort.Slice(pts, func(a, b int) bool { return pts[a].X < pts[b].X })
		line, sc, err := plotter.NewLinePoints(pts)
		if err != nil {
			return nil, fmt.Errorf("bench: plot %s: %w", pd.title, err)
		}
		line.Color = plotutil.Color(i)
		line.Width = vg.Points(1.5)
		sc.Color = plotutil.Color(i)
		sc.Shape = plotutil.Shape(i)
		p.Add(line, sc)
		if legend {
			p.Legend.Add(l, line, sc)
		}
		for _, q := range pts {
			xs[q.X] = true
		}
	}
	if spec.logX {
		p.X.Scale = plot.LogScale{}
		var ticks plot.ConstantTicks
		for x := range xs {
			ticks = append(ticks, plot.Tick{Value: x, Label: strconv.FormatFloat(x, 'g', -1, 64)})
		}
		sort.Slice(ticks, func(a, b int) bool { return ticks[a].Value < ticks[b].Value })
		p.X.Tick.Marker = ticks
	}
	p.Legend.Top = true
	p.Legend.Left = true
	return p, nil
}

// render draws the figure on a canvas.
func (f figure) render(c draw.Canvas) {
	t := draw.Tiles{Rows: len(f.plots), Cols: len(f.plots[0]), PadX: vg.Millimeter * 4, PadY: vg.Millimeter * 4,
		PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 2}
	canvases := plot.Align(f.plots, t, c)
	for j, row := range f.plots {
		for i, p := range row {
			if p != nil {
				p.Draw(canvases[j][i])
			}
		}
	}
}

// PlotDPI is the resolution of the PNG plots (small enough to commit).
const PlotDPI = 96

// WritePlots draws one figure per preset of recs into dir as PRESET.png
// and PRESET.svg, and returns the paths written. Presets with nothing worth
// a line (a single shape) get no figure.
func WritePlots(dir string, recs []Record) ([]string, error) {
	unit, scale := RateUnit(recs)
	var paths []string
	for _, preset := range distinct(recs, presetOf) {
		fig, ok, err := buildFigure(preset, recs, unit, scale)
		if err != nil {
			return paths, err
		}
		if !ok {
			continue
		}
		base := filepath.Join(dir, fileName(preset))
		png := vgimg.NewWith(vgimg.UseWH(fig.w, fig.h), vgimg.UseDPI(PlotDPI))
		fig.render(draw.New(png))
		if err := writeTo(base+".png", vgimg.PngCanvas{Canvas: png}); err != nil {
			return paths, err
		}
		paths = append(paths, base+".png")
		svg := vgsvg.New(fig.w, fig.h)
		fig.render(draw.New(svg))
		if err := writeTo(base+".svg", svg); err != nil {
			return paths, err
		}
		paths = append(paths, base+".svg")
	}
	return paths, nil
}

// fileName makes a preset name safe as a file name.
func fileName(preset string) string {
	b := []byte(preset)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			b[i] = '_'
		}
	}
	if len(b) == 0 {
		return "plot"
	}
	return string(b)
}

func writeTo(path string, w io.WriterTo) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	if _, err := w.WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("bench: write %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("bench: write %s: %w", path, err)
	}
	return nil
}
