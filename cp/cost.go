package cp

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"sort"
	"time"

	"github.com/flashattn/flashattn/attn"
)

// Rate is one measured kernel rate: a call on a block of Rows queries and
// Cols keys (every head of the profile's kernel class), unmasked or, when
// Masked, under a causal mask, did FLOPs operations (counted as
// attn.Problem.FLOPs does, the backward 2.5 times the forward) at
// PerSecond operations per second.
type Rate struct {
	Rows      int     `json:"rows"`
	Cols      int     `json:"cols"`
	Masked    bool    `json:"masked,omitempty"`
	FLOPs     float64 `json:"flops"`
	PerSecond float64 `json:"per_second"`
}

// Profile is what the cost model knows of one machine, backend and kernel
// class: the rates of the forward and backward kernels as a function of the
// size of a call, and the bandwidth and latency of the link between ranks.
// Calibrate fills one by measuring; LoadProfile and SaveProfile keep it in
// a cache file.
type Profile struct {
	// Machine names the host and device the profile was measured on.
	Machine string `json:"machine"`
	// Backend is the backend's name; Kernel the class of calls measured
	// (see KernelClass).
	Backend string `json:"backend"`
	Kernel  string `json:"kernel"`
	// Forward and Backward are the kernel rates measured on a grid of
	// unmasked block shapes and on causal square blocks. A call's rate is
	// interpolated between them in the logarithms of its rows and columns
	// (bilinearly on the grid; along the diagonal by the geometric mean
	// of rows and columns for a masked call) and held at the edges of the
	// grid; its time is its visible operations at that rate.
	Forward  []Rate `json:"forward"`
	Backward []Rate `json:"backward"`
	// Bandwidth is the bytes per second one rank sends to another, and
	// Latency the seconds of one exchange beyond its bytes.
	Bandwidth float64 `json:"bandwidth"`
	Latency   float64 `json:"latency"`
	// Measured is when the profile was measured.
	Measured time.Time `json:"measured"`
}

// KernelClass names the class of calls a profile's rates hold for: the
// element type, heads and head dims, such as "bf16 H24/24 D128/128".
func KernelClass(dt attn.DType, h, hkv, dk, dv int) string {
	return fmt.Sprintf("%v H%d/%d D%d/%d", dt, h, hkv, dk, dv)
}

// Key returns the key of the profile inside a cache file: backend and
// kernel class.
func (pr *Profile) Key() string { return pr.Backend + " " + pr.Kernel }

// check reports whether the profile can be used.
func (pr *Profile) check() error {
	if len(pr.Forward) == 0 || len(pr.Backward) == 0 || !(pr.Bandwidth > 0) || !(pr.Latency >= 0) {
		return attn.Errorf(attn.ErrOption, "cp: profile %q has no kernel rates or no link bandwidth", pr.Key())
	}
	for _, rs := range [][]Rate{pr.Forward, pr.Backward} {
		for _, r := range rs {
			if r.Rows < 1 || r.Cols < 1 || !(r.PerSecond > 0) {
				return attn.Errorf(attn.ErrOption, "cp: profile %q: a rate of %d×%d at %v per second", pr.Key(), r.Rows, r.Cols, r.PerSecond)
			}
		}
	}
	return nil
}

// callTime returns the modelled seconds of one call on a block of rows ×
// cols (masked or not) doing flops operations.
func callTime(rs []Rate, rows, cols int, masked bool, flops float64) float64 {
	if flops <= 0 {
		return 0
	}
	return flops / rateAt(rs, rows, cols, masked)
}

// rateAt interpolates the rate of a rows × cols block (see Profile).
func rateAt(rs []Rate, rows, cols int, masked bool) float64 {
	var diag []Rate
	grid := map[[2]int]float64{}
	var rowsAt, colsAt []int
	for _, r := range rs {
		if r.Masked {
			diag = append(diag, r)
			continue
		}
		if _, ok := grid[[2]int{r.Rows, r.Cols}]; !ok {
			rowsAt, colsAt = append(rowsAt, r.Rows), append(colsAt, r.Cols)
		}
		grid[[2]int{r.Rows, r.Cols}] = r.PerSecond
	}
	if masked && len(diag) > 0 || len(grid) == 0 {
		if len(diag) == 0 {
			diag = rs
		}
		slices.SortFunc(diag, func(a, b Rate) int { return cmp.Compare(a.Rows*a.Cols, b.Rows*b.Cols) })
		xs, ys := make([]float64, len(diag)), make([]float64, len(diag))
		for i, r := range diag {
			xs[i], ys[i] = 0.5*math.Log(float64(r.Rows)*float64(r.Cols)), math.Log(r.PerSecond)
		}
		return math.Exp(interp(xs, ys, 0.5*math.Log(float64(rows)*float64(cols))))
	}
	slices.Sort(rowsAt)
	slices.Sort(colsAt)
	rowsAt, colsAt = slices.Compact(rowsAt), slices.Compact(colsAt)
	i0, i1, fi := bracket(rowsAt, rows)
	j0, j1, fj := bracket(colsAt, cols)
	at := func(i, j int) float64 {
		if v, ok := grid[[2]int{rowsAt[i], colsAt[j]}]; ok {
			return math.Log(v)
		}
		// A grid with a hole: the nearest measured shape along the rows,
		// a tie going to the smaller shape (the map's order is random).
		best, bd, bk := 0.0, math.Inf(1), [2]int{}
		for k, v := range grid {
			d := math.Abs(math.Log(float64(k[0])/float64(rowsAt[i]))) + math.Abs(math.Log(float64(k[1])/float64(colsAt[j])))
			if d < bd || d == bd && (k[0] < bk[0] || k[0] == bk[0] && k[1] < bk[1]) {
				best, bd, bk = math.Log(v), d, k
			}
		}
		return best
	}
	top := at(i0, j0)*(1-fj) + at(i0, j1)*fj
	bottom := at(i1, j0)*(1-fj) + at(i1, j1)*fj
	return math.Exp(top*(1-fi) + bottom*fi)
}

// bracket returns the indices of the sorted values xs around x and the
// fraction of the way from the first to the second in log x, held at the
// ends.
func bracket(xs []int, x int) (i0, i1 int, f float64) {
	lx := make([]float64, len(xs))
	for i, v := range xs {
		lx[i] = math.Log(float64(v))
	}
	l := math.Log(float64(max(x, 1)))
	switch i := sort.SearchFloat64s(lx, l); {
	case i == 0:
		return 0, 0, 0
	case i == len(lx):
		return i - 1, i - 1, 0
	default:
		return i - 1, i, (l - lx[i-1]) / (lx[i] - lx[i-1])
	}
}

// interp interpolates ys over the increasing xs at x, held at the ends.
func interp(xs, ys []float64, x float64) float64 {
	i := sort.SearchFloat64s(xs, x)
	switch {
	case i == 0:
		return ys[0]
	case i == len(xs):
		return ys[len(ys)-1]
	case xs[i] == xs[i-1]:
		return ys[i]
	}
	f := (x - xs[i-1]) / (xs[i] - xs[i-1])
	return ys[i-1] + f*(ys[i]-ys[i-1])
}

// linkTime returns the modelled seconds of one exchange in which a rank
// sends bytes.
func (pr *Profile) linkTime(bytes int64) float64 {
	if bytes <= 0 {
		return 0
	}
	return pr.Latency + float64(bytes)/pr.Bandwidth
}

// Estimate is the cost model's account of one strategy for one call.
type Estimate struct {
	// Strategy, P and Backward say what was estimated.
	Strategy Strategy
	P        int
	Backward bool
	// Err says why the strategy cannot split this problem (then the
	// other fields are zero).
	Err error
	// Steps is the number of steps: P for a ring, 1 for all-to-all, R =
	// P/A for hybrid.
	Steps int
	// Time is the modelled seconds of the call on P devices: per step,
	// the slowest rank's compute or the exchange it overlaps, whichever is
	// longer, plus what cannot overlap (the ring backward's last dK/dV
	// hop, the all-to-alls; hybrid pays both kinds).
	Time float64
	// Compute is the part of Time spent computing (the slowest rank's, per
	// step), Exposed the communication not hidden behind it.
	Compute, Exposed float64
	// Work is the backend seconds of all ranks together: what one device
	// running the ranks one after another spends in kernels.
	Work float64
	// Calls is the number of backend calls over all ranks.
	Calls int
	// Sent is the bytes each rank sends.
	Sent int64
	// Single is the modelled seconds of the whole call on one device.
	Single float64
}

// StepTime returns the modelled seconds of one step.
func (e Estimate) StepTime() float64 {
	if e.Steps == 0 {
		return 0
	}
	return e.Time / float64(e.Steps)
}

// Speedup returns Single / Time: how much faster P devices are than one.
func (e Estimate) Speedup() float64 {
	if e.Time <= 0 {
		return 0
	}
	return e.Single / e.Time
}

// SplitCost returns Work / Single: the compute the split adds over one
// call (1 when splitting costs nothing).
func (e Estimate) SplitCost() float64 {
	if e.Single <= 0 {
		return 0
	}
	return e.Work / e.Single
}

// Estimate models strategy s splitting the global problem gp, whose
// elements are dt, over p ranks: the forward, or the backward when
// backward is set. gp needs its sizes and options; its mask is resolved
// here. A strategy that cannot split the problem gives an Estimate whose
// Err says why (wrapping attn.ErrShape, attn.ErrOption or
// attn.ErrUnsupported); a profile without rates gives an error.
func (pr *Profile) Estimate(gp *attn.Problem, dt attn.DType, p int, s Strategy, backward bool) (Estimate, error) {
	if err := pr.check(); err != nil {
		return Estimate{}, err
	}
	g := *gp
	e := Estimate{Strategy: s, P: p, Backward: backward}
	if packed(g.Opt) {
		e.Err = s.CheckPacked(g.Opt.CuSeqlensQ, g.Opt.CuSeqlensK, g.Hkv, p)
		if e.Err == nil && !g.Varlen {
			// A problem built by hand: its sizes from the offsets.
			cq, ck := g.Opt.CuSeqlensQ, g.Opt.CuSeqlensK
			g.Varlen, g.B = true, len(cq)-1
			g.TotalQ, g.TotalK = int(cq[len(cq)-1]), int(ck[len(ck)-1])
			g.N, g.M = longest(cq), longest(ck)
		}
	} else {
		e.Err = s.Check(g.N, g.M, g.Hkv, p)
	}
	g.ResolveMask()
	rates, factor := pr.Forward, 1.0
	if backward {
		rates, factor = pr.Backward, 2.5
	}
	if g.Varlen || !packed(g.Opt) {
		e.Single = wholeTime(rates, &g, g.FLOPs()*factor)
	}
	if e.Err == nil {
		e.Err = unsupported(g.Opt)
	}
	if e.Err == nil && g.Varlen && s.Scheme == Hybrid {
		e.Err = attn.Errorf(attn.ErrUnsupported, "cp: hybrid does not split packed variable-length batches")
	}
	if e.Err != nil {
		return e, nil
	}
	elem := int64(dt.Size())
	switch s.Scheme {
	case AllToAll:
		pr.estimateHeads(&e, &g, elem, rates, factor)
		return e, nil
	case Hybrid:
		return e, pr.estimateHybrid(&e, &g, elem, rates, factor)
	}
	return e, pr.estimateRing(&e, &g, elem, rates, factor)
}

// estimateRing fills e for a ring: at each step every rank runs its planned
// calls while one exchange sends the K/V block one hop on and, in the
// backward, the previous step's dK/dV block with it; the last dK/dV hop,
// after the last step, has nothing to overlap.
func (pr *Profile) estimateRing(e *Estimate, g *attn.Problem, elem int64, rates []Rate, factor float64) error {
	p := e.P
	e.Steps = p
	_, keys := tokens(g)
	kv := keys / int64(p) * int64(g.Hkv) * int64(g.DK+g.DV)
	var grad int64
	if e.Backward && p > 1 {
		grad = kv * 4
	}
	rings := make([]*ring, p)
	for r := range p {
		rings[r] = layoutRing(e.Strategy.Layout, g, p, r)
	}
	for s := range p {
		var slowest float64
		for _, rg := range rings {
			tasks, err := rg.tasks(s)
			if err != nil {
				return err
			}
			var t float64
			for _, tk := range tasks {
				t += taskTime(rates, g, tk, factor)
			}
			e.Work += t
			e.Calls += len(tasks)
			slowest = max(slowest, t)
		}
		var sent int64
		if s < p-1 {
			sent += kv * elem
		}
		if s > 0 {
			sent += grad
		}
		comm := pr.linkTime(sent)
		e.Sent += sent
		e.Compute += slowest
		e.Exposed += max(comm-slowest, 0)
		e.Time += max(slowest, comm)
	}
	last := pr.linkTime(grad)
	e.Sent += grad
	e.Exposed += last
	e.Time += last
	return nil
}

// layoutRing returns the ring of rank r of p under layout l for gp, for
// planning only (it has no transport or backend).
func layoutRing(l Layout, gp *attn.Problem, p, r int) *ring {
	c := l.numChunks(p)
	return &ring{a: &Attention{Layout: l}, gp: gp, p: p, r: r, qs: chunksFor(l, p, r, gp.N/c), kchunk: gp.M / c}
}

// estimateHeads fills e for all-to-all: the inputs trade sequence shards
// for head shards, each rank runs the whole sequence of its heads in one
// call, and the outputs trade back; nothing overlaps.
func (pr *Profile) estimateHeads(e *Estimate, g *attn.Problem, elem int64, rates []Rate, factor float64) {
	p := int64(e.P)
	e.Steps = 1
	pr.headsTraffic(e, g, elem, e.P)
	e.Compute = wholeTime(rates, g, g.FLOPs()*factor/float64(p))
	e.Work = e.Compute * float64(p)
	e.Calls = int(p)
	e.Time = e.Compute + e.Exposed
}

// tokens returns the queries and keys of gp over its whole batch: B·N and
// B·M, or a packed batch's totals.
func tokens(gp *attn.Problem) (queries, keys int64) {
	if gp.Varlen {
		return int64(gp.TotalQ), int64(gp.TotalK)
	}
	return int64(gp.B) * int64(gp.N), int64(gp.B) * int64(gp.M)
}

// wholeTime returns the modelled seconds of one call of the whole problem
// gp (its mask resolved) doing flops operations: a padded batch at the
// rate of its N × M blocks; a packed one sequence by sequence, each at
// the rate of its own lengths with its share of the operations.
func wholeTime(rates []Rate, gp *attn.Problem, flops float64) float64 {
	if !gp.Varlen {
		return callTime(rates, gp.N, gp.M, gp.Masked, flops)
	}
	all := gp.FLOPs()
	if all <= 0 {
		return 0
	}
	var t float64
	for b := range gp.B {
		seq := *gp
		_, seq.N, _, seq.M = gp.Segment(b)
		seq.B, seq.Varlen, seq.TotalQ, seq.TotalK = 1, false, 0, 0
		seq.Opt.CuSeqlensQ, seq.Opt.CuSeqlensK = nil, nil
		seq.ResolveMask()
		t += callTime(rates, seq.N, seq.M, seq.Masked, flops*seq.FLOPs()/all)
	}
	return t
}

// taskTime returns the modelled seconds of one planned call of gp: at the
// rate of its block, or for a packed call (one with cu_seqlens) segment
// by segment, each at the rate of its own block (the segments of queries
// without keys and of keys without queries cost nothing).
func taskTime(rates []Rate, gp *attn.Problem, t task, factor float64) float64 {
	if t.cuQ == nil {
		return callTime(rates, t.nq, t.nk, t.window != nil, taskFLOPs(gp, t)*factor)
	}
	var sum float64
	for i := range len(t.cuQ) - 1 {
		seg := task{nq: int(t.cuQ[i+1] - t.cuQ[i]), nk: int(t.cuK[i+1] - t.cuK[i]), window: t.window}
		sum += callTime(rates, seg.nq, seg.nk, seg.window != nil, taskFLOPs(gp, seg)*factor)
	}
	return sum
}

// taskFLOPs returns the forward operations of one planned block of gp
// without cu_seqlens: 2·B·H·(DK+DV) per visible pair of the task, B
// being 1 in a packed batch, whose tasks address packed tokens.
func taskFLOPs(gp *attn.Problem, t task) float64 {
	b := gp.B
	if gp.Varlen {
		b = 1
	}
	return 2 * float64(b) * float64(gp.H) * float64(gp.DK+gp.DV) * float64(taskPairs(t))
}

// taskPairs counts the (query, key) pairs a task computes.
func taskPairs(t task) int {
	if t.window == nil {
		return t.nq * t.nk
	}
	lp := attn.Problem{N: t.nq, M: t.nk, Opt: attn.Options{Align: attn.AlignTopLeft, Window: t.window}}
	lp.ResolveMask()
	n := 0
	for i := range t.nq {
		lo, hi := lp.KeyRange(i, t.nq, t.nk)
		n += max(0, min(hi, t.nk)-max(lo, 0))
	}
	return n
}

// ErrNoStrategy reports a problem that no strategy can split over the
// given number of ranks; the error wraps each strategy's reason.
var ErrNoStrategy = errors.New("cp: no strategy can split the problem")

// Choose estimates every strategy (Strategies) for the call and returns
// the fastest that can run with every estimate, in the order of
// Strategies. A near tie (within 2%) goes to the earlier strategy. When
// none can run the error wraps ErrNoStrategy and every reason.
func (pr *Profile) Choose(gp *attn.Problem, dt attn.DType, p int, backward bool) (Strategy, []Estimate, error) {
	var (
		all  []Estimate
		best = -1
		errs []error
	)
	for _, s := range Strategies() {
		e, err := pr.Estimate(gp, dt, p, s, backward)
		if err != nil {
			return Strategy{}, nil, err
		}
		all = append(all, e)
		if e.Err != nil {
			errs = append(errs, fmt.Errorf("%v: %w", s, e.Err))
			continue
		}
		if best < 0 || e.Time < all[best].Time*0.98 {
			best = len(all) - 1
		}
	}
	if best < 0 {
		return Strategy{}, all, fmt.Errorf("%w over %d ranks: %w", ErrNoStrategy, p, errors.Join(errs...))
	}
	return all[best].Strategy, all, nil
}

// Explain writes the cost model's reasoning for the estimates of one call
// (Choose's) and the strategy chosen: per strategy its time per step,
// compute and exposed communication, work over one device and bytes sent,
// or why it cannot run.
func Explain(w io.Writer, ests []Estimate, chosen Strategy) error {
	if len(ests) == 0 {
		return nil
	}
	pass := "forward"
	if ests[0].Backward {
		pass = "backward"
	}
	_, err := fmt.Fprintf(w, "cp cost model, %s on %d ranks (one device: %s):\n", pass, ests[0].P, seconds(ests[0].Single))
	for _, e := range ests {
		if err != nil {
			return err
		}
		mark := " "
		if e.Strategy == chosen && e.Err == nil {
			mark = "*"
		}
		if e.Err != nil {
			_, err = fmt.Fprintf(w, " %s %-6v cannot run: %v\n", mark, e.Strategy, e.Err)
			continue
		}
		_, err = fmt.Fprintf(w, " %s %-6v %d step(s) of %s: compute %s + exposed communication %s = %s, speedup %.2f×; kernels %.2f× one call in %d calls; %s sent per rank\n",
			mark, e.Strategy, e.Steps, seconds(e.StepTime()), seconds(e.Compute), seconds(e.Exposed), seconds(e.Time),
			e.Speedup(), e.SplitCost(), e.Calls, byteSize(e.Sent))
	}
	if err == nil {
		_, err = fmt.Fprintf(w, "  chosen: %v (the least modelled time)\n", chosen)
	}
	return err
}

// seconds formats a duration in seconds with a suitable unit.
func seconds(s float64) string {
	return time.Duration(s * float64(time.Second)).Round(time.Microsecond / 10).String()
}

// byteSize formats a byte count in B, KiB, MiB or GiB.
func byteSize(n int64) string {
	f, units := float64(n), []string{"B", "KiB", "MiB", "GiB"}
	i := 0
	for f >= 1024 && i < len(units)-1 {
		f /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.1f %s", f, units[i])
}
