package bench

import (
	"bufio"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/flashattn/flashattn/attn"
)

// HostRunner times an attn.Backend that works on host tensors (the CPU
// backend) by the wall clock.
type HostRunner struct {
	b      attn.Backend
	device string
	cache  int64
}

// NewHostRunner returns a runner for b. device names the processor; empty
// means HostDevice(). Inputs are not rotated (one set per case).
func NewHostRunner(b attn.Backend, device string) *HostRunner {
	if device == "" {
		device = HostDevice()
	}
	return &HostRunner{b: b, device: device}
}

// Implementation returns "flashattn".
func (r *HostRunner) Implementation() string { return Ours }

// Backend returns the backend's name.
func (r *HostRunner) Backend() string { return r.b.Name() }

// Device returns the processor's name.
func (r *HostRunner) Device() string { return r.device }

// Close does nothing: host memory is the garbage collector's.
func (r *HostRunner) Close() error { return nil }

// hostSet is one set of host inputs (and, for a backward, the forward's
// outputs and dO).
type hostSet struct {
	q, k, v, o, lse, dO attn.Tensor
}

// Prepare fills random inputs for c and, when the pass times a backward
// alone, runs the forward once to get O and the LSE.
func (r *HostRunner) Prepare(c Case) (Workload, error) {
	c.Normalize()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	dt, _ := c.DTypeValue()
	opt := c.Options()
	rng := rand.New(rand.NewPCG(caseSeed(c), 1))
	if shape := c.BiasShape(); shape != nil {
		// One bias serves every input set: it is larger than the cache
		// whenever q, k and v are.
		opt.Bias = &attn.Bias{Tensor: RandomTensor(rng, dt, shape...), RequiresGrad: c.BiasGrad}
	}
	nsets := RotationSets(c.Bytes(), r.cache)
	w := &hostWork{b: r.b, c: c, opt: opt}
	for i := 0; i < nsets; i++ {
		s := hostSet{
			q: RandomTensor(rng, dt, c.Batch, c.SeqlenQ, c.Heads, c.HeadDim),
			k: RandomTensor(rng, dt, c.Batch, c.SeqlenK, c.KVHeads, c.HeadDim),
			v: RandomTensor(rng, dt, c.Batch, c.SeqlenK, c.KVHeads, c.HeadDimV),
		}
		if c.Pass != Forward {
			s.dO = RandomTensor(rng, dt, c.Batch, c.SeqlenQ, c.Heads, c.HeadDimV)
		}
		if c.Pass == Backward {
			res, err := r.b.Forward(s.q, s.k, s.v, opt)
			if err != nil {
				return nil, fmt.Errorf("bench: forward for the backward's inputs: %w", err)
			}
			s.o, s.lse = res.O, res.LSE
		}
		w.sets = append(w.sets, s)
	}
	return w, nil
}

// hostWork is a prepared host case timed by the wall clock.
type hostWork struct {
	b     attn.Backend
	c     Case
	opt   attn.Options
	sets  []hostSet
	start time.Time
	times []float64
}

func (w *hostWork) Sets() int { return len(w.sets) }

func (w *hostWork) Run(set int) error {
	s := &w.sets[set%len(w.sets)]
	o, lse := s.o, s.lse
	if w.c.Pass != Backward {
		res, err := w.b.Forward(s.q, s.k, s.v, w.opt)
		if err != nil {
			return err
		}
		o, lse = res.O, res.LSE
	}
	if w.c.Pass != Forward {
		if _, err := w.b.Backward(s.q, s.k, s.v, o, lse, s.dO, w.opt); err != nil {
			return err
		}
	}
	return nil
}

func (w *hostWork) Start() error { w.start = time.Now(); return nil }

func (w *hostWork) Stop() error {
	w.times = append(w.times, ms(time.Since(w.start)))
	return nil
}

func (w *hostWork) Sync() error { return nil }

func (w *hostWork) Elapsed() ([]float64, error) {
	t := w.times
	w.times = nil
	return t, nil
}

func (w *hostWork) Variant() (string, string) { return "", "" }

func (w *hostWork) Close() error { w.sets = nil; return nil }

// caseSeed derives the random seed of a case's inputs from its key, so
// every runner fills the same case with the same values.
func caseSeed(c Case) uint64 {
	h := fnv.New64a()
	h.Write([]byte(c.Key()))
	return h.Sum64()
}

// RandomTensor returns a contiguous tensor of the given shape filled with
// standard normal values rounded to dt.
func RandomTensor(rng *rand.Rand, dt attn.DType, shape ...int) attn.Tensor {
	t := attn.New(dt, shape...)
	n := t.NumElements()
	for i := 0; i < n; i++ {
		t.Store(i, float32(rng.NormFloat64()))
	}
	return t
}

// HostDevice names this machine's processor and the threads Go uses, such
// as "Intel(R) Xeon(R) CPU @ 2.20GHz (2 threads)".
func HostDevice() string {
	name := runtime.GOARCH
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			k, v, ok := strings.Cut(sc.Text(), ":")
			if ok && strings.TrimSpace(k) == "model name" {
				name = strings.TrimSpace(v)
				break
			}
		}
	}
	return fmt.Sprintf("%s (%d threads)", name, runtime.GOMAXPROCS(0))
}
