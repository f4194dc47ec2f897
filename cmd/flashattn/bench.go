package main

import (
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/bench"
)

const benchUsage = `Usage: flashattn bench [flags]

Times one attention problem on random inputs and prints the median, minimum
and maximum time of the timed repeats in milliseconds, the rate (TFLOP/s;
GFLOP/s on the CPU) and the wall-clock time of the first run, which on a GPU
includes compiling and loading the kernels. On a GPU the inputs stay on the
device, rotated among enough sets to exceed its L2 cache, and each repeat is
timed with CUDA events.

Operations are counted the usual way: 2·B·H·(DK+DV) per visible query-key
pair for the forward (4·B·H·N·M·D unmasked; causal counts the visible
pairs only), 2.5× that for the backward, 3.5× for both.

Flags:
  --backend cpu|cuda|auto   backend (default auto: the GPU when one works)
  --dtype fp32|fp16|bf16    element type (default bf16)
  --batch B                 batch size (default 1)
  --seqlen-q N              query length (default 1024)
  --seqlen-k M              key length (default: N)
  --heads H                 query heads (default 8)
  --kv-heads Hkv            key/value heads, dividing H (default: H)
  --head-dim DK             query/key head dim (default 64)
  --head-dim-v DV           value head dim (default: DK)
  --pass fwd|bwd|fwdbwd     timed region (default fwd); bwd times the
                            backward alone, given the forward's outputs
  --causal                  causal mask
  --align top-left|bottom-right
                            diagonal alignment when N != M (default bottom-right)
  --window L,R              keep keys from diagonal-L to diagonal+R (negative: unbounded)
  --softcap X               softcap X*tanh(s/X) (default 0: off)
  --dropout P               dropout probability: 0, or 1/512 < P <= 1-1/512 (drawn
                            as the nearest multiple of 1/256; see package philox)
  --bias bhnm|1hnm|b1nm|11nm
                            add a random bias to the scores, of shape [B, H, N, M]
                            with a 1 where it broadcasts (1hnm: [1, H, N, M])
  --bias-grad               the backward computes the bias's gradient too
  --deterministic           demand bit-identical results (deterministic dQ)
  --warmup DURATION         least warm-up after the first run (default 50ms
                            on the CPU, 25ms on a GPU)
  --budget DURATION         time the timed repeats should fill (default
                            300ms on the CPU, 100ms on a GPU)
  --repeats N               exactly N timed repeats (default 0: from --budget)
  --json                    print the result record as JSON instead
  --cp P                    measure the cost of splitting the case over P virtual
                            ranks with context parallelism (cp.Sim on host
                            tensors, the ranks' backend calls one after another
                            on this device) against the single call: per-step
                            time, speedup over one device with communication
                            hidden, the sum of all ranks' per-step calls over the
                            single call, and the bytes each rank sends
  --cp-scheme ring|zigzag|a2a|hybrid[-A]|auto
                            how --cp splits the case (default: zigzag under
                            --causal, ring otherwise); hybrid trades heads within
                            groups of A ranks (A: the largest divisor of the
                            key/value heads dividing P, or given as hybrid-A) and
                            rings across the groups; auto asks the cost model,
                            which measures this machine once and caches it
  --cp-explain              print the cost model's reasoning for --cp
  --cp-split                measure instead the cost of splitting on the GPU with
                            everything on the device: the inputs sharded once,
                            every rank's step calls (ForwardDevice or
                            BackwardDevice on views of its shards) and the
                            kernels merging their partial results into float32
                            accumulators, back to back on one stream, against
                            the single call; prints, per P, the single call,
                            the sum of the step calls, the merge kernels, their
                            total and its ratio to the single call, and the
                            split as the device ring runs it (each rank's calls
                            on its compute stream while its communication
                            stream copies the next K/V block, all ranks at
                            once) with that time over P² (a rank's step)
                            (CUDA graphs timed by events, medians of --repeats
                            replays, default 5). --cp then takes a list
                            (2,4,8); --cp-scheme ring or zigzag
`

func init() {
	register(&command{
		name:    "bench",
		summary: "time one attention problem (median, min, max, TFLOP/s)",
		usage:   benchUsage,
		run:     runBench,
	})
}

// timingFlags are the measuring-policy flags shared by bench and sweep.
type timingFlags struct {
	warmup, budget time.Duration
	repeats        int
}

func (t *timingFlags) register(fs *flag.FlagSet, withRepeats bool) {
	fs.DurationVar(&t.warmup, "warmup", 0, "")
	fs.DurationVar(&t.budget, "budget", 0, "")
	if withRepeats {
		fs.IntVar(&t.repeats, "repeats", 0, "")
	}
}

// open opens the runner of backend and returns it with its timing policy
// (the flags applied).
func (t *timingFlags) open(backend string) (bench.Runner, bench.Timing, error) {
	r, err := bench.OpenRunner(backend)
	if err != nil {
		return nil, bench.Timing{}, usageErrorf("--backend %q is not cpu, cuda or auto", backend)
	}
	pol, err := t.policy(r)
	if err != nil {
		r.Close()
		return nil, bench.Timing{}, err
	}
	return r, pol, nil
}

// policy returns the timing policy of runner r with the flags applied.
func (t *timingFlags) policy(r bench.Runner) (bench.Timing, error) {
	p := bench.HostTiming()
	if r.Backend() == "cuda" {
		p = bench.DeviceTiming()
	}
	if t.warmup < 0 || t.budget < 0 || t.repeats < 0 {
		return p, usageErrorf("--warmup, --budget and --repeats must not be negative")
	}
	if t.warmup > 0 {
		p.Warmup = t.warmup
	}
	if t.budget > 0 {
		p.Budget = t.budget
	}
	if t.repeats > 0 {
		p.MinRepeats, p.MaxRepeats = t.repeats, t.repeats
	}
	return p, nil
}

func runBench(args []string, stdout io.Writer) error {
	var (
		c                          bench.Case
		backend, pass, window      string
		timing                     timingFlags
		asJSON                     bool
		seqlenK, kvHeads, headDimV int
		cpf                        cpFlags
	)
	fs := newFlagSet(commands["bench"])
	fs.StringVar(&backend, "backend", "auto", "")
	fs.StringVar(&c.DType, "dtype", "bf16", "")
	fs.IntVar(&c.Batch, "batch", 1, "")
	fs.IntVar(&c.SeqlenQ, "seqlen-q", 1024, "")
	fs.IntVar(&seqlenK, "seqlen-k", 0, "")
	fs.IntVar(&c.Heads, "heads", 8, "")
	fs.IntVar(&kvHeads, "kv-heads", 0, "")
	fs.IntVar(&c.HeadDim, "head-dim", 64, "")
	fs.IntVar(&headDimV, "head-dim-v", 0, "")
	fs.StringVar(&pass, "pass", "fwd", "")
	fs.BoolVar(&c.Causal, "causal", false, "")
	fs.StringVar(&c.Align, "align", "bottom-right", "")
	fs.StringVar(&window, "window", "", "")
	fs.Float64Var(&c.Softcap, "softcap", 0, "")
	fs.Float64Var(&c.Dropout, "dropout", 0, "")
	fs.StringVar(&c.Bias, "bias", "", "")
	fs.BoolVar(&c.BiasGrad, "bias-grad", false, "")
	fs.BoolVar(&c.Deterministic, "deterministic", false, "")
	fs.BoolVar(&asJSON, "json", false, "")
	timing.register(fs, true)
	fs.Var(&cpf, "cp", "")
	fs.StringVar(&cpf.scheme, "cp-scheme", "", "")
	fs.BoolVar(&cpf.explain, "cp-explain", false, "")
	fs.BoolVar(&cpf.split, "cp-split", false, "")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	cpf.set = isSet(fs, "cp")
	c.SeqlenK, c.KVHeads, c.HeadDimV = seqlenK, kvHeads, headDimV
	p, err := bench.ParsePass(pass)
	if err != nil {
		return usageErrorf("--pass %q is not fwd, bwd or fwdbwd", pass)
	}
	c.Pass = p
	if _, err := bench.ParseAlign(c.Align); err != nil {
		return usageErrorf("--align %q is neither top-left nor bottom-right", c.Align)
	}
	if window != "" {
		w, err := parseInts(window)
		if err != nil || len(w) != 2 {
			return usageErrorf("--window %q is not two integers L,R", window)
		}
		c.Window = &bench.Window{Left: w[0], Right: w[1]}
	}
	c.Normalize()
	if err := c.Validate(); err != nil {
		return err
	}
	if cpf.split {
		return benchCPSplit(stdout, backend, c, &cpf, timing, asJSON)
	}
	if len(cpf.list) > 1 {
		return usageErrorf("--cp %s: a list of ranks needs --cp-split", cpf.String())
	}
	if err := cpf.check("--cp", c.Problem()); err != nil {
		return err
	}
	if cpf.set {
		return benchCP(stdout, backend, c, &cpf, timing, asJSON)
	}
	r, pol, err := timing.open(backend)
	if err != nil {
		return err
	}
	defer r.Close()
	rec := bench.Run(r, c, pol)
	if asJSON {
		if err := writeJSON(stdout, rec); err != nil {
			return err
		}
	} else {
		writeBench(stdout, rec)
	}
	switch rec.Status {
	case bench.StatusOK:
		return nil
	case bench.StatusUnsupported:
		return attn.Errorf(attn.ErrUnsupported, "%s: %s", rec.Backend, strings.TrimSuffix(rec.Message, ": "+attn.ErrUnsupported.Error()))
	}
	return fmt.Errorf("%s: %s", rec.Backend, rec.Message)
}

// writeBench prints a measured record in a few aligned lines.
func writeBench(w io.Writer, r bench.Record) {
	dev := r.Device
	if dev == "" {
		dev = "-"
	}
	fmt.Fprintf(w, "backend  %s · %s\n", r.Backend, dev)
	fmt.Fprintf(w, "case     %s\n", r.Case.String())
	if !r.OK() {
		msg := strings.TrimSuffix(strings.ReplaceAll(r.Message, "flashattn: ", ""), ": "+attn.ErrUnsupported.Error())
		fmt.Fprintf(w, "status   %s: %s\n", r.Status, msg)
		return
	}
	unit, scale := "TFLOP/s", 1.0
	if r.Backend == "cpu" {
		unit, scale = "GFLOP/s", 1e-3
	}
	fmt.Fprintf(w, "time     median %.4g ms   min %.4g ms   max %.4g ms   (%d repeats)\n", r.MedianMs, r.MinMs, r.MaxMs, r.Repeats)
	fmt.Fprintf(w, "rate     %.4g %s   (%.4g GFLOP per run)\n", r.TFLOPs/scale, unit, r.FLOPs/1e9)
	first := "first    %.4g ms (first run, wall clock)\n"
	if r.Backend == "cuda" {
		first = "first    %.4g ms (first use: compile, load and run)\n"
	}
	fmt.Fprintf(w, first, r.FirstMs)
	if r.KernelVariant != "" || r.DQAlgorithm != "" {
		fmt.Fprintf(w, "variant  %s   dQ %s\n", orDash(r.KernelVariant), orDash(r.DQAlgorithm))
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
