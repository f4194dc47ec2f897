package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/flashattn/flashattn"
	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/bench"
	"github.com/flashattn/flashattn/cp"
)

// cpFlags are the context-parallelism flags of run and bench.
type cpFlags struct {
	ranks   int    // virtual ranks; 0: off
	list    []int  // bench --cp: every number of ranks given (--cp-split takes several)
	scheme  string // ring, zigzag, a2a, hybrid[-A], auto or "" (the default for the mask)
	explain bool   // print the cost model's reasoning
	split   bool   // bench --cp-split: the device-resident cost of splitting
	set     bool   // the ranks flag was given
}

// String returns the numbers of ranks, comma-separated (flag.Value).
func (f *cpFlags) String() string {
	if f == nil {
		return ""
	}
	parts := make([]string, len(f.list))
	for i, p := range f.list {
		parts[i] = strconv.Itoa(p)
	}
	return strings.Join(parts, ",")
}

// Set parses bench's --cp: one number of ranks or a comma-separated list
// (flag.Value); ranks is the first.
func (f *cpFlags) Set(s string) error {
	l, err := parseInts(s)
	if err != nil {
		return err
	}
	f.list, f.ranks = l, l[0]
	return nil
}

// cpMaxCalibration is the longest block side the cost model's calibration
// times, so that choosing a strategy for a long sequence stays quick; the
// model holds the rates of longer blocks at that size's.
const cpMaxCalibration = 4096

// check validates the flags against the global problem gp (its sizes and
// cu_seqlens); rankFlag names the ranks flag in messages.
func (f *cpFlags) check(rankFlag string, gp *attn.Problem) error {
	if !f.set {
		if f.scheme != "" || f.explain {
			return usageErrorf("--cp-scheme and --cp-explain need %s", rankFlag)
		}
		return nil
	}
	if f.ranks < 1 {
		return usageErrorf("%s %d: the number of virtual ranks must be at least 1", rankFlag, f.ranks)
	}
	switch f.scheme {
	case "", "auto":
		return nil
	}
	s, err := cp.ParseStrategy(f.scheme)
	if err != nil {
		return usageErrorf("--cp-scheme %q is not ring, zigzag, a2a, hybrid, hybrid-A or auto", f.scheme)
	}
	if err := checkStrategy(s, gp, f.ranks); err != nil {
		return fmt.Errorf("%s %d: %w", rankFlag, f.ranks, err)
	}
	return nil
}

// checkStrategy reports whether s can split gp over p ranks: every
// sequence of a packed batch, or the padded one, must cut evenly.
func checkStrategy(s cp.Strategy, gp *attn.Problem, p int) error {
	if o := gp.Opt; o.CuSeqlensQ != nil || o.CuSeqlensK != nil {
		return s.CheckPacked(o.CuSeqlensQ, o.CuSeqlensK, gp.Hkv, p)
	}
	return s.Check(gp.N, gp.M, gp.Hkv, p)
}

// strategy returns the strategy of the flags for the global problem gp of
// dtype dt on backend b: the one given, the default for the mask, or with
// "auto" the cost model's choice (for the backward when backward is set),
// whose reasoning goes to w when asked for. The default and a given
// strategy are checked against the problem.
func (f *cpFlags) strategy(w io.Writer, b attn.Backend, gp *attn.Problem, dt attn.DType, backward bool) (cp.Strategy, error) {
	var s cp.Strategy
	switch f.scheme {
	case "":
		s = cp.Default(gp.Masked && gp.Opt.Causal)
	case "auto":
		pr, err := cpProfile(b, gp, dt)
		if err != nil {
			return s, err
		}
		chosen, all, err := pr.Choose(gp, dt, f.ranks, backward)
		if f.explain {
			if err := cp.Explain(w, all, chosen); err != nil {
				return s, fmt.Errorf("write: %w", err)
			}
		}
		return chosen, err
	default:
		var err error
		if s, err = cp.ParseStrategy(f.scheme); err != nil {
			return s, err
		}
	}
	if err := checkStrategy(s, gp, f.ranks); err != nil {
		return s, err
	}
	if f.explain {
		if pr, err := cpProfile(b, gp, dt); err == nil {
			if _, all, err := pr.Choose(gp, dt, f.ranks, backward); err == nil {
				return s, cp.Explain(w, all, s)
			}
		}
	}
	return s, nil
}

// cpProfile returns the cost model's profile of backend b for the kernel
// class of gp in dt, from the cache file of this machine, measuring it (on
// blocks up to the problem's length, at most cpMaxCalibration, and the
// in-process transport) when the cache has none.
func cpProfile(b attn.Backend, gp *attn.Problem, dt attn.DType) (*cp.Profile, error) {
	host, _ := os.Hostname()
	machine := host + " " + bench.HostDevice()
	path, err := cp.ProfilePath(machine)
	if err != nil {
		return nil, err
	}
	c := cp.Calibration{Machine: machine, DType: dt, H: gp.H, Hkv: gp.Hkv, DK: gp.DK, DV: gp.DV,
		MaxLen: min(max(gp.N, gp.M), cpMaxCalibration)}
	key := b.Name() + " " + cp.KernelClass(dt, gp.H, gp.Hkv, gp.DK, gp.DV)
	pr, err := cp.CachedProfile(path, key, func() (*cp.Profile, error) {
		return cp.Calibrate(context.Background(), b, c, cp.MeasureLocalLink)
	})
	if pr != nil && err != nil {
		// Measured but not stored: the profile is usable.
		fmt.Fprintf(os.Stderr, "flashattn: cp profile not cached: %v\n", oneLine(err))
		return pr, nil
	}
	return pr, err
}

// benchCP measures case c split over the flags' virtual ranks on backend
// (host tensors) and prints the result.
func benchCP(w io.Writer, backend string, c bench.Case, f *cpFlags, timing timingFlags, asJSON bool) error {
	b, err := flashattn.Open(backend)
	if err != nil {
		return err
	}
	if cl, ok := b.(io.Closer); ok {
		defer cl.Close()
	}
	pol := bench.HostTiming()
	if timing.warmup < 0 || timing.budget < 0 || timing.repeats < 0 {
		return usageErrorf("--warmup, --budget and --repeats must not be negative")
	}
	if timing.budget > 0 {
		pol.Budget = timing.budget
	}
	if timing.repeats > 0 {
		pol.MinRepeats, pol.MaxRepeats = timing.repeats, timing.repeats
	}
	dt, _ := c.DTypeValue()
	explain := w
	if asJSON {
		explain = io.Discard
	}
	s, err := f.strategy(explain, b, c.Problem(), dt, c.Pass != bench.Forward)
	if err != nil {
		return fmt.Errorf("--cp %d: %w", f.ranks, err)
	}
	r, err := bench.MeasureCP(b, c, s, f.ranks, pol)
	if err != nil {
		return fmt.Errorf("--cp %d: %w", f.ranks, err)
	}
	if asJSON {
		return writeJSON(w, struct {
			bench.Case
			Backend string         `json:"backend"`
			Device  string         `json:"device"`
			CP      bench.CPResult `json:"cp"`
		}{c, b.Name(), bench.HostDevice(), r})
	}
	fmt.Fprintf(w, "backend  %s · host tensors\n", b.Name())
	fmt.Fprintf(w, "case     %s\n", c.String())
	fmt.Fprintf(w, "cp       %s on %d virtual ranks, their calls one after another (medians of %d repeats)\n", r.Scheme, r.Ranks, r.Repeats)
	fmt.Fprintf(w, "single   %.4g ms (one call)\n", r.SingleMs)
	fmt.Fprintf(w, "step     %.4g ms per step × %d steps = %.4g ms (the slowest rank at each step); speedup %.2f× over one device, communication hidden\n",
		r.StepMs, r.Steps, r.CriticalMs, r.Speedup)
	fmt.Fprintf(w, "kernels  %d calls over all steps and ranks: %.4g ms = %.3f× the single call (the cost of splitting)\n", r.Calls, r.WorkMs, r.SplitCost)
	fmt.Fprintf(w, "wall     %.4g ms for the simulated call (kernels, merges, copies, in-process exchanges)\n", r.WallMs)
	fmt.Fprintf(w, "comm     %s sent per rank at most, in %d messages\n", mib(r.SentBytes), r.Messages)
	return nil
}

// mib formats a byte count in MiB.
func mib(n int64) string { return fmt.Sprintf("%.3f MiB", float64(n)/(1<<20)) }

// benchCPSplit measures case c split over each of the flags' numbers of
// virtual ranks on the GPU, device-resident (bench.MeasureCPSplit), and
// prints the results: a line per P and pass, or JSON.
func benchCPSplit(w io.Writer, backend string, c bench.Case, f *cpFlags, timing timingFlags, asJSON bool) error {
	if !f.set {
		return usageErrorf("--cp-split needs --cp P (or a list: --cp 2,4,8)")
	}
	if backend != "cuda" && backend != "auto" {
		return usageErrorf("--cp-split runs on the GPU: --backend cuda (or auto), not %q", backend)
	}
	if f.explain || f.scheme == "auto" {
		return usageErrorf("--cp-split measures ring or zigzag as given (--cp-scheme ring|zigzag); the cost model's choice does not apply")
	}
	if timing.repeats < 0 {
		return usageErrorf("--repeats must not be negative")
	}
	s, err := bench.SplitStrategy(f.scheme, c.Causal)
	if err != nil {
		return fmt.Errorf("--cp-scheme %q: %w", f.scheme, err)
	}
	gp := c.Problem()
	for _, p := range f.list {
		f.ranks = p
		if err := f.check("--cp", gp); err != nil {
			return err
		}
	}
	rs, err := bench.MeasureCPSplit(c, s, f.list, timing.repeats)
	if err != nil {
		return fmt.Errorf("--cp-split: %w", err)
	}
	if asJSON {
		return writeJSON(w, struct {
			bench.Case
			Backend string                `json:"backend"`
			Device  string                `json:"device"`
			Split   []bench.CPSplitResult `json:"cp_split"`
		}{c, "cuda", bench.HostDevice(), rs})
	}
	printCPSplit(w, c, s, rs)
	return nil
}

// printCPSplit prints the device-resident split results rs of case c by
// strategy s: a line per P and pass.
func printCPSplit(w io.Writer, c bench.Case, s cp.Strategy, rs []bench.CPSplitResult) {
	fmt.Fprintf(w, "backend  cuda · device-resident split\n")
	fmt.Fprintf(w, "case     %s\n", c.String())
	fmt.Fprintf(w, "cp       %v: every rank's step calls and merge kernels back to back on one stream, against the single call;\n", s)
	fmt.Fprintf(w, "         ring: the same as the device ring runs it, each rank's calls on its compute stream while its\n")
	fmt.Fprintf(w, "         communication stream copies the next block, all ranks at once; step: ring / P², a rank's step;\n")
	fmt.Fprintf(w, "         ratio: total / single; parts: (steps + merges) / single, the two timed apart\n")
	if len(rs) > 0 {
		fmt.Fprintf(w, "         (CUDA graphs timed by events, medians of %d replays; ms)\n", rs[0].Repeats)
	}
	fmt.Fprintf(w, "%4s %-4s %10s %10s %10s %10s %8s %8s %10s %10s %6s %7s\n", "P", "pass", "single", "steps", "merges", "total", "ratio", "parts", "ring", "step", "calls", "kernels")
	for _, r := range rs {
		fmt.Fprintf(w, "%4d %-4s %10.4g %10.4g %10.4g %10.4g %7.3f× %7.3f× %10.4g %10.4g %6d %7d\n", r.Ranks, r.Pass, r.SingleMs, r.AttentionMs, r.MergeMs, r.TotalMs, r.Ratio,
			r.PartsRatio, r.RingMs, r.RingStepMs, r.Calls, r.Merges)
	}
}

// writeJSON writes v to w as indented JSON.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	return nil
}
