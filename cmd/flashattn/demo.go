package main

import (
	"errors"
	"fmt"
	"github.com/flashattn/flashattn/bench"
	"io"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"time"

	"github.com/flashattn/flashattn"
	"github.com/flashattn/flashattn/gpu"
)

const demoUsage = `Usage: flashattn demo [flags]

Runs one training-shaped attention step, forward and backward, on the best
backend present, times it, and checks it against the float64 reference on a
slice of the problem: batch 0, the query heads of the first one or two
key/value heads, the last --check-rows query rows (O, LSE, dQ) and the keys
that only those rows see (dK, dV). Prints PASS or FAIL; FAIL exits non-zero.

Defaults: on the CPU B=1 H=8 N=M=2048 D=64 fp32; on a GPU B=4 H=16
N=M=4096 D=128 bf16; causal in both.

Flags:
  --backend cpu|cuda|auto   backend (default auto: the GPU when one works, otherwise the CPU)
  --batch B, --heads H, --kv-heads HKV, --seq N, --dim D
                            problem size (0: the backend's default; HKV 0: H)
  --dtype fp32|fp16|bf16    storage precision (default: the backend's)
  --causal                  causal mask (default true; --causal=false for none)
  --iters N                 timed repetitions, the median is reported (default 3 on the CPU, 5 on a GPU)
  --check-rows R            query rows checked against the reference (default 256)
  --seed N                  seed of the random inputs (default 1)
  --breakdown               on a GPU, time the host-tensor step again with tracing on and print
                            where the median call's time went: host phases (planning, allocation,
                            copies into and out of pinned staging, enqueueing, waits), stream work
                            (DMA each way and kernels, CUDA events) and the stream's idle time,
                            next to the floor with the difference split into its terms
`

func init() {
	register(&command{
		name:    "demo",
		summary: "time a training-shaped forward+backward and check it against the reference",
		usage:   demoUsage,
		run:     runDemo,
	})
}

// demoConfig is the demo's problem; zero fields take the backend's default.
type demoConfig struct {
	backend                       string
	batch, heads, kvHeads, seq, d int
	dtype                         string
	causal                        bool
	iters, checkRows              int
	seed                          uint64
	breakdown                     bool
}

func runDemo(args []string, stdout io.Writer) error {
	var c demoConfig
	fs := newFlagSet(commands["demo"])
	fs.StringVar(&c.backend, "backend", "auto", "")
	fs.IntVar(&c.batch, "batch", 0, "")
	fs.IntVar(&c.heads, "heads", 0, "")
	fs.IntVar(&c.kvHeads, "kv-heads", 0, "")
	fs.IntVar(&c.seq, "seq", 0, "")
	fs.IntVar(&c.d, "dim", 0, "")
	fs.StringVar(&c.dtype, "dtype", "", "")
	fs.BoolVar(&c.causal, "causal", true, "")
	fs.IntVar(&c.iters, "iters", 0, "")
	fs.IntVar(&c.checkRows, "check-rows", 256, "")
	fs.Uint64Var(&c.seed, "seed", 1, "")
	fs.BoolVar(&c.breakdown, "breakdown", false, "")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	for _, x := range []struct {
		name string
		v    int
	}{{"batch", c.batch}, {"heads", c.heads}, {"kv-heads", c.kvHeads}, {"seq", c.seq}, {"dim", c.d}, {"iters", c.iters}} {
		if x.v < 0 {
			return fmt.Errorf("--%s %d is negative", x.name, x.v)
		}
	}
	if c.checkRows < 1 {
		return fmt.Errorf("--check-rows %d: want at least 1", c.checkRows)
	}
	if c.dtype != "" {
		if _, err := flashattn.ParseDType(c.dtype); err != nil {
			return fmt.Errorf("--dtype %q is not fp32, fp16 or bf16", c.dtype)
		}
	}
	switch c.backend {
	case "cpu", "cuda":
		return demoWith(c.backend, c, stdout)
	case "auto":
		b, err := flashattn.Open("cuda")
		if err != nil {
			fmt.Fprintf(stdout, "note      no GPU backend (%s); using the CPU\n", oneLine(err))
			return demoWith("cpu", c, stdout)
		}
		err = demo(b, c, stdout)
		closeBackend(b)
		if !errors.Is(err, flashattn.ErrUnsupported) {
			return err
		}
		fmt.Fprintf(stdout, "note      the GPU backend cannot run this step (%s); using the CPU\n", oneLine(err))
		return demoWith("cpu", c, stdout)
	}
	return fmt.Errorf("--backend %q is not cpu, cuda or auto", c.backend)
}

// demoWith opens the backend called name and runs the demo on it.
func demoWith(name string, c demoConfig, stdout io.Writer) error {
	b, err := flashattn.Open(name)
	if err != nil {
		return err
	}
	err = demo(b, c, stdout)
	closeBackend(b)
	return err
}

// deviceSpeed times the demo's step again with the tensors resident on the
// GPU (no host copies), through the benchmark's CUDA-event timing, prints
// one line and returns the forward and backward medians in ms (ok false
// when it could not time them: it then prints a note instead; the demo's
// verdict rests on the check, not on this line).
func deviceSpeed(c demoConfig, stdout io.Writer) (fwdMs, bwdMs float64, fwdRate, bwdRate float64, ok bool) {
	r, err := bench.OpenRunner("cuda")
	if err != nil {
		fmt.Fprintf(stdout, "note      no device-resident timing: %s\n", oneLine(err))
		return 0, 0, 0, 0, false
	}
	defer r.Close()
	c, dt := c.resolve(true)
	line := "device   "
	for _, pass := range []bench.Pass{bench.Forward, bench.Backward} {
		bc := bench.Case{DType: dt.String(), Batch: c.batch, SeqlenQ: c.seq, Heads: c.heads, KVHeads: c.kvHeads,
			HeadDim: c.d, Causal: c.causal, Pass: pass}
		bc.Normalize()
		rec := bench.Run(r, bc, bench.DeviceTiming())
		if !rec.OK() {
			fmt.Fprintf(stdout, "note      no device-resident timing of %s: %s\n", pass, oneLine(errors.New(rec.Message)))
			return 0, 0, 0, 0, false
		}
		line += fmt.Sprintf(" %s %.3f ms %.1f TFLOP/s", pass, rec.MedianMs, rec.TFLOPs)
		if rec.DQAlgorithm != "" {
			line += fmt.Sprintf(" (dQ %s)", rec.DQAlgorithm)
		}
		line += ";"
		if pass == bench.Forward {
			fwdMs, fwdRate = rec.MedianMs, rec.TFLOPs
		} else {
			bwdMs, bwdRate = rec.MedianMs, rec.TFLOPs
		}
	}
	fmt.Fprintf(stdout, "%s device-resident tensors, CUDA events, median\n", line)
	return fwdMs, bwdMs, fwdRate, bwdRate, true
}

// intoBackend is a backend that writes into caller-allocated outputs.
type intoBackend interface {
	ForwardInto(q, k, v flashattn.Tensor, res flashattn.Result, opt flashattn.Options) error
	BackwardInto(q, k, v, o, lse, dO flashattn.Tensor, g flashattn.Gradients, opt flashattn.Options) error
}

// pinner is a backend that can keep host tensors page-locked for its
// host-tensor calls.
type pinner interface {
	Pin(ts ...flashattn.Tensor) (*gpu.HostPin, error)
}

var _ pinner = (*gpu.Backend)(nil)

// timeInto times the step again through the Into forms, writing into
// outputs allocated once, and prints one line; then, on a backend that
// pins host memory, once more with the inputs and those outputs pinned
// (one more line), and returns those times (zero where it could not pin:
// the line says why).
func timeInto(b intoBackend, q, k, v, dO flashattn.Tensor, res flashattn.Result, grads flashattn.Gradients, opt flashattn.Options, iters int, flops float64, stdout io.Writer) (pfwd, pbwd time.Duration, err error) {
	r := flashattn.Result{O: flashattn.New(res.O.DType, res.O.Shape...), LSE: flashattn.New(res.LSE.DType, res.LSE.Shape...)}
	g := flashattn.Gradients{DQ: flashattn.New(grads.DQ.DType, grads.DQ.Shape...), DK: flashattn.New(grads.DK.DType, grads.DK.Shape...),
		DV: flashattn.New(grads.DV.DType, grads.DV.Shape...)}
	steps := func() (fwd, bwd time.Duration, err error) {
		var tf, tb []time.Duration
		for range iters {
			t0 := time.Now()
			if err := b.ForwardInto(q, k, v, r, opt); err != nil {
				return 0, 0, fmt.Errorf("forward into: %w", err)
			}
			tf = append(tf, time.Since(t0))
			t0 = time.Now()
			if err := b.BackwardInto(q, k, v, r.O, r.LSE, dO, g, opt); err != nil {
				return 0, 0, fmt.Errorf("backward into: %w", err)
			}
			tb = append(tb, time.Since(t0))
		}
		return median(tf), median(tb), nil
	}
	fwd, bwd, err := steps()
	if err != nil {
		return 0, 0, err
	}
	fmt.Fprintf(stdout, "host into forward %.4f s %s, backward %.4f s %s: into outputs allocated once, median\n",
		fwd.Seconds(), rate(flops, fwd), bwd.Seconds(), rate(2.5*flops, bwd))
	pb, ok := b.(pinner)
	if !ok {
		return 0, 0, nil
	}
	pin, err := pb.Pin(q, k, v, dO, r.O, r.LSE, g.DQ, g.DK, g.DV)
	if err != nil {
		fmt.Fprintf(stdout, "note      no pinned timing: %s\n", oneLine(err))
		return 0, 0, nil
	}
	fwd, bwd, err = steps()
	if uerr := pin.Unpin(); err == nil && uerr != nil {
		err = fmt.Errorf("unpin: %w", uerr)
	}
	if err != nil {
		return 0, 0, err
	}
	fmt.Fprintf(stdout, "host pinned forward %.4f s %s, backward %.4f s %s: into outputs allocated once, inputs and outputs pinned once (Backend.Pin), median\n",
		fwd.Seconds(), rate(flops, fwd), bwd.Seconds(), rate(2.5*flops, bwd))
	return fwd, bwd, nil
}

// linkMeter is a backend that can measure its host↔device link.
type linkMeter interface {
	LinkBandwidth() (toDevice, fromDevice float64, err error)
}

// hostFloor prints how the host-tensor times compare with their floor: the
// device-resident kernel time plus the bytes each call moves over the
// measured host↔device link. It returns the link's rates in bytes per
// second (0 when not measured).
func hostFloor(b flashattn.Backend, fwd, bwd time.Duration, fwdMs, bwdMs float64, in, out [2]float64, stdout io.Writer) (h2d, d2h float64) {
	lm, ok := b.(linkMeter)
	if !ok {
		return 0, 0
	}
	h2d, d2h, err := lm.LinkBandwidth()
	if err != nil {
		fmt.Fprintf(stdout, "note      no link measurement: %s\n", oneLine(err))
		return 0, 0
	}
	ff, fb := passFloor{fwdMs, h2d, d2h}.ms(in[0], out[0]), passFloor{bwdMs, h2d, d2h}.ms(in[1], out[1])
	fmt.Fprintf(stdout, "link      to device %.1f GB/s, from device %.1f GB/s (pinned, CUDA events); host-tensor forward %.2fx its floor of %.2f ms (kernel + %.0f MB in, %.0f MB out), backward %.2fx its floor of %.2f ms (kernel + %.0f MB in, %.0f MB out)\n",
		h2d/1e9, d2h/1e9, fwd.Seconds()*1e3/ff, ff, in[0]/1e6, out[0]/1e6, bwd.Seconds()*1e3/fb, fb, in[1]/1e6, out[1]/1e6)
	if hr, ok := b.(hostRater); ok {
		r, err := hr.HostRates()
		fmt.Fprintln(stdout, hostRatesLine(r, err))
	}
	return h2d, d2h
}

// hostRater is a backend that can measure the host side of its host path.
type hostRater interface {
	HostRates() (gpu.HostRates, error)
}

// hostRatesLine reports the host's own rates on the host path (err: what
// could not be measured).
func hostRatesLine(r gpu.HostRates, err error) string {
	line := fmt.Sprintf("host side Go→pinned %.1f GB/s, pinned→Go %.1f GB/s (staging, up to 16 goroutines)", r.ToPinned/1e9, r.FromPinned/1e9)
	if err != nil {
		return line + "; page-locking not measured: " + oneLine(err)
	}
	return line + fmt.Sprintf(", page-locking Go memory %.1f GB/s, unlocking %.1f GB/s (FLASHATTN_HOST_REGISTER=1's costs)", r.Register/1e9, r.Unregister/1e9)
}

// closeBackend releases b's resources when it holds any.
func closeBackend(b flashattn.Backend) {
	if c, ok := b.(io.Closer); ok {
		c.Close()
	}
}

// resolve fills c's zero fields with the defaults for the GPU backend (gpu)
// or the CPU backend.
func (c demoConfig) resolve(gpu bool) (demoConfig, flashattn.DType) {
	def := demoConfig{batch: 1, heads: 8, seq: 2048, d: 64, dtype: "fp32", iters: 3}
	if gpu {
		def = demoConfig{batch: 4, heads: 16, seq: 4096, d: 128, dtype: "bf16", iters: 5}
	}
	pick := func(v, d int) int {
		if v == 0 {
			return d
		}
		return v
	}
	c.batch, c.heads, c.seq, c.d, c.iters = pick(c.batch, def.batch), pick(c.heads, def.heads),
		pick(c.seq, def.seq), pick(c.d, def.d), pick(c.iters, def.iters)
	c.kvHeads = pick(c.kvHeads, c.heads)
	if c.dtype == "" {
		c.dtype = def.dtype
	}
	dt, _ := flashattn.ParseDType(c.dtype) // checked by runDemo
	return c, dt
}

// randomTensor returns a contiguous tensor of standard normal values rounded to dt.
func randomTensor(rng *rand.Rand, dt flashattn.DType, shape ...int) flashattn.Tensor {
	data := make([]float32, numElements(shape))
	for i := range data {
		data[i] = float32(rng.NormFloat64())
	}
	return flashattn.FromFloat32(dt, data, shape...)
}

func numElements(shape []int) int {
	n := 1
	for _, s := range shape {
		n *= s
	}
	return n
}

// median returns the median of ds (the upper one for an even count).
func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// rate formats flops per duration as GFLOP/s or TFLOP/s.
func rate(flops float64, d time.Duration) string {
	r := flops / d.Seconds()
	if r >= 1e12 {
		return fmt.Sprintf("%.1f TFLOP/s", r/1e12)
	}
	return fmt.Sprintf("%.2f GFLOP/s", r/1e9)
}

// demo runs the timed and checked step on b.
func demo(b flashattn.Backend, c demoConfig, stdout io.Writer) error {
	gpu := b.Name() != "cpu"
	c, dt := c.resolve(gpu)
	rng := rand.New(rand.NewPCG(c.seed, 0x5eed))
	q := randomTensor(rng, dt, c.batch, c.seq, c.heads, c.d)
	k := randomTensor(rng, dt, c.batch, c.seq, c.kvHeads, c.d)
	v := randomTensor(rng, dt, c.batch, c.seq, c.kvHeads, c.d)
	dO := randomTensor(rng, dt, c.batch, c.seq, c.heads, c.d)
	opt := flashattn.Options{Causal: c.causal}
	p, err := flashattn.NewProblem(q, k, v, opt)
	if err != nil {
		return err
	}
	mask := "no mask"
	if c.causal {
		mask = "causal (bottom-right)"
	}
	name := b.Name()
	if !gpu {
		name += fmt.Sprintf(" (GOMAXPROCS %d)", runtime.GOMAXPROCS(0))
	}
	fmt.Fprintf(stdout, "backend   %s\n", name)
	fmt.Fprintf(stdout, "problem   B=%d H=%d Hkv=%d N=M=%d D=%d %v, %s\n", p.B, p.H, p.Hkv, p.N, p.DK, dt, mask)

	if gpu {
		// One untimed step first: it compiles and loads the kernels.
		res, err := b.Forward(q, k, v, opt)
		if err != nil {
			return fmt.Errorf("forward: %w", err)
		}
		if _, err := b.Backward(q, k, v, res.O, res.LSE, dO, opt); err != nil {
			return fmt.Errorf("backward: %w", err)
		}
	}
	var res flashattn.Result
	var grads flashattn.Gradients
	var tf, tb []time.Duration
	for range c.iters {
		t0 := time.Now()
		if res, err = b.Forward(q, k, v, opt); err != nil {
			return fmt.Errorf("forward: %w", err)
		}
		tf = append(tf, time.Since(t0))
	}
	for range c.iters {
		t0 := time.Now()
		if grads, err = b.Backward(q, k, v, res.O, res.LSE, dO, opt); err != nil {
			return fmt.Errorf("backward: %w", err)
		}
		tb = append(tb, time.Since(t0))
	}
	fwd, bwd := median(tf), median(tb)
	flops := p.FLOPs()
	fwdRate, bwdRate := rate(flops, fwd), rate(2.5*flops, bwd)
	if gpu {
		fmt.Fprintf(stdout, "host      forward %.4f s %s, backward %.4f s %s: host tensors, copies to and from the device included, median\n",
			fwd.Seconds(), fwdRate, bwd.Seconds(), bwdRate)
		var pfwd, pbwd time.Duration // the pinned Into forms' (zero: not timed)
		if ib, ok := b.(intoBackend); ok {
			if pfwd, pbwd, err = timeInto(ib, q, k, v, dO, res, grads, opt, c.iters, flops, stdout); err != nil {
				return err
			}
		}
		var floors [2]passFloor
		if fms, bms, fr, br, ok := deviceSpeed(c, stdout); ok {
			bytes := func(ts ...flashattn.Tensor) float64 {
				n := 0
				for _, t := range ts {
					n += t.NumElements() * t.DType.Size()
				}
				return float64(n)
			}
			in := [2]float64{bytes(q, k, v), bytes(q, k, v, res.O, res.LSE, dO)}
			out := [2]float64{bytes(res.O, res.LSE), bytes(grads.DQ, grads.DK, grads.DV)}
			h2d, d2h := hostFloor(b, fwd, bwd, fms, bms, in, out, stdout)
			floors = [2]passFloor{{fms, h2d, d2h}, {bms, h2d, d2h}}
			if pfwd > 0 && floors[0].known() {
				ff, fb := floors[0].ms(in[0], out[0]), floors[1].ms(in[1], out[1])
				fmt.Fprintf(stdout, "pinned    host-tensor forward %.2fx its floor of %.2f ms, backward %.2fx its floor of %.2f ms\n",
					pfwd.Seconds()*1e3/ff, ff, pbwd.Seconds()*1e3/fb, fb)
			}
			fwdRate, bwdRate = fmt.Sprintf("%.1f TFLOP/s (device-resident)", fr), fmt.Sprintf("%.1f TFLOP/s (device-resident)", br)
		}
		if c.breakdown {
			if err := breakdown(b, q, k, v, dO, opt, c.iters, floors, stdout); err != nil {
				return err
			}
		}
	} else {
		fmt.Fprintf(stdout, "forward   %8.4f s  %s\n", fwd.Seconds(), fwdRate)
		fmt.Fprintf(stdout, "backward  %8.4f s  %s\n", bwd.Seconds(), bwdRate)
		if c.breakdown {
			fmt.Fprintf(stdout, "note      --breakdown: the %s backend has no host-to-device path to break down\n", b.Name())
		}
	}

	for _, x := range []namedTensor{{"O", res.O}, {"LSE", res.LSE}, {"dQ", grads.DQ}, {"dK", grads.DK}, {"dV", grads.DV}} {
		if !x.t.IsFinite() {
			fmt.Fprintf(stdout, "FAIL      %s has non-finite values\n", x.name)
			return fmt.Errorf("check failed: %s has non-finite values", x.name)
		}
	}
	sl, err := newSlice(p, q, k, v, dO, opt, c.checkRows)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "check     %s\n", sl.describe())
	results, err := sl.check(dt, res, grads)
	if err != nil {
		return err
	}
	worst, failed := 0.0, ""
	line := "error    "
	for _, r := range results {
		line += fmt.Sprintf(" %s %.1e (limit %.1e)", r.name, r.err, r.limit)
		if !(r.err <= r.limit) && failed == "" {
			failed = r.name
		}
		if r.err > worst || math.IsNaN(r.err) {
			worst = r.err
		}
	}
	fmt.Fprintln(stdout, line)
	verdict := "PASS"
	if failed != "" {
		verdict = "FAIL"
	}
	fmt.Fprintf(stdout, "%s      %s %v B=%d H=%d N=M=%d D=%d %s: forward %s, backward %s, max error %.1e\n",
		verdict, b.Name(), dt, p.B, p.H, p.N, p.DK, mask, fwdRate, bwdRate, worst)
	if failed != "" {
		return fmt.Errorf("check failed: %s error above its limit", failed)
	}
	return nil
}
