package bench

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

// ProgressDelay is how long a run goes before its progress bar appears:
// short runs print none.
const ProgressDelay = 2 * time.Second

// Progress draws a progress bar for a run of a known number of steps. On a
// terminal it redraws one line; elsewhere (a log file) it prints a line at
// most every 10 seconds. Nothing is drawn before ProgressDelay has passed.
type Progress struct {
	w        io.Writer
	total    int
	start    time.Time
	tty      bool
	last     time.Time
	drawn    bool
	interval time.Duration
	now      func() time.Time
}

// NewProgress returns a progress bar for total steps writing to w.
func NewProgress(w io.Writer, total int) *Progress {
	p := &Progress{w: w, total: total, start: time.Now(), interval: 10 * time.Second, now: time.Now}
	if f, ok := w.(*os.File); ok {
		if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
			p.tty = true
			p.interval = 100 * time.Millisecond
		}
	}
	return p
}

// Update reports that done steps are finished and the next is label.
func (p *Progress) Update(done int, label string) {
	now := p.now()
	el := now.Sub(p.start)
	if el < ProgressDelay || (p.drawn && now.Sub(p.last) < p.interval && done < p.total) {
		return
	}
	p.last, p.drawn = now, true
	const width = 30
	fill := 0
	if p.total > 0 {
		fill = width * done / p.total
	}
	bar := strings.Repeat("=", fill) + strings.Repeat(" ", width-fill)
	eta := ""
	if done > 0 && done < p.total {
		left := time.Duration(float64(el) / float64(done) * float64(p.total-done))
		eta = " eta " + left.Round(time.Second).String()
	}
	line := fmt.Sprintf("[%s] %d/%d %s%s %s", bar, done, p.total, el.Round(time.Second), eta, label)
	if p.tty {
		if len(line) > 120 {
			line = line[:120]
		}
		fmt.Fprintf(p.w, "\r\033[K%s", line)
	} else {
		fmt.Fprintln(p.w, line)
	}
}

// Finish ends the bar's line on a terminal.
func (p *Progress) Finish() {
	if p.tty && p.drawn {
		fmt.Fprintln(p.w)
	}
}
