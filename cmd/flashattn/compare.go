package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/flashattn/flashattn/bench"
)

const compareUsage = `Usage: flashattn compare [flags] DIR|FILE...

Merges results files (a folder means its results.json; the peer script's
JSON output is read the same way) into one comparison: per preset a table of
the rate of every implementation, the best peer and the ratio ours ÷ best
peer, and a plot with one line per implementation. Writes OUT/compare.md and
OUT/PRESET.png and .svg.

With --markdown the same Markdown also goes to standard output, ready to
paste as a section of BENCHMARKS.md, e.g.

  flashattn compare --out docs/bench --img-prefix docs/bench/ --markdown \
      ours.json peers.json > section.md

Flags:
  --out DIR          output folder (default: the first argument when it is a
                     folder, otherwise the current folder)
  --markdown         also print the Markdown to standard output
  --img-prefix P     prefix of the image links in the Markdown (default "")
  --title T          section title (default names the devices)
  --level N          heading level of the title (default 2)
  --command C        a command to list under the title (repeatable; default
                     the commands recorded in the files)
`

func init() {
	register(&command{
		name:    "compare",
		summary: "merge results with the peers': ratio table and plots",
		usage:   compareUsage,
		run:     runCompare,
	})
}

// listFlag collects a repeatable string flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, "; ") }
func (l *listFlag) Set(s string) error { *l = append(*l, s); return nil }

func runCompare(args []string, stdout io.Writer) error {
	var (
		out, prefix, title string
		markdown           bool
		level              int
		cmds               listFlag
	)
	fs := newFlagSet(commands["compare"])
	fs.StringVar(&out, "out", "", "")
	fs.BoolVar(&markdown, "markdown", false, "")
	fs.StringVar(&prefix, "img-prefix", "", "")
	fs.StringVar(&title, "title", "", "")
	fs.IntVar(&level, "level", 2, "")
	fs.Var(&cmds, "command", "")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageErrorf("%v", err)
	}
	inputs := fs.Args()
	if len(inputs) == 0 {
		return usageErrorf("no results given")
	}
	var files []*bench.File
	for _, in := range inputs {
		f, err := bench.ReadFile(in)
		if err != nil {
			return err
		}
		files = append(files, f)
	}
	if out == "" {
		out = "."
		if st, err := os.Stat(inputs[0]); err == nil && st.IsDir() {
			out = inputs[0]
		}
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return fmt.Errorf("--out: %w", err)
	}
	cmp := bench.Compare(files)
	plots, err := cmp.WritePlots(out)
	if err != nil {
		return err
	}
	var md strings.Builder
	if err := cmp.WriteMarkdown(&md, bench.MarkdownOptions{Title: title, Level: level, ImgPrefix: prefix, Plots: plots, Commands: cmds}); err != nil {
		return err
	}
	mdPath := filepath.Join(out, "compare.md")
	if err := os.WriteFile(mdPath, []byte(md.String()), 0o644); err != nil {
		return fmt.Errorf("write %s: %w", mdPath, err)
	}
	if markdown {
		_, err := io.WriteString(stdout, md.String())
		return err
	}
	fmt.Fprintf(stdout, "%s\n", cmp.Summary())
	fmt.Fprintf(stdout, "wrote %s\n", mdPath)
	for _, p := range plots {
		fmt.Fprintf(stdout, "wrote %s\n", p)
	}
	return nil
}
