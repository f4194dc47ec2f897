package main

import (
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/flashattn/flashattn"
	"github.com/flashattn/flashattn/npy"
)

const runUsage = `Usage: flashattn run --q q.npy --k k.npy --v v.npy --out DIR [flags]

Computes one attention call from NumPy files and writes the results as
float32 .npy files: DIR/o.npy [B, N, H, DV] and DIR/lse.npy [B, H, N]; with
--do also DIR/dq.npy, DIR/dk.npy, DIR/dv.npy, and DIR/dbias.npy when --bias is
given (the bias then takes part in the backward).

DIR is checked before anything is computed. The outputs are written to a
temporary directory beside DIR and moved into place only when all of them
were written: a run that fails leaves DIR as it was, and one that succeeds
leaves exactly its own outputs there (an earlier run's dq.npy, dk.npy,
dv.npy or dbias.npy that this run does not produce is removed).

Inputs are float32 or float16 .npy (float64 is read and rounded to float32),
q [B, N, H, DK], k [B, M, Hkv, DK], v [B, M, Hkv, DV], do like o, bias
[B or 1, H or 1, N, M]. With --cu-seqlens-q/-k the batch is packed:
q [totalQ, H, DK], k and v [totalK, Hkv, D], lse [H, totalQ].

Flags:
  --backend cpu|cuda|auto   backend (default auto: the GPU when one works,
                            otherwise the CPU); a problem the chosen backend
                            does not support fails, it never falls back to
                            another backend
  --dtype fp32|fp16|bf16    compute precision; inputs are rounded to it (default fp32)
  --q, --k, --v FILE        query, key and value .npy files (required)
  --do FILE                 output gradient: also run the backward
  --bias FILE               additive score bias
  --causal                  causal mask
  --align top-left|bottom-right
                            diagonal alignment when N != M (default bottom-right)
  --window L,R              keep keys from diagonal-L to diagonal+R (a side that is
                            negative or wider than the sequences is unbounded)
  --softcap X               softcap X*tanh(s/X) (default 0: off)
  --scale S                 score scale (default 0: 1/sqrt(DK))
  --dropout P               dropout probability: 0, or 1/512 < P <= 1-1/512 (drawn
                            as the nearest multiple of 1/256; see package philox)
  --seed N                  dropout seed
  --offset N                dropout counter offset
  --cu-seqlens-q LIST       cumulative query offsets, e.g. 0,5,5,40
  --cu-seqlens-k LIST       cumulative key offsets, e.g. 0,7,9,9
  --deterministic           demand bit-identical results on repeat
  --out DIR                 output directory, created when missing (required)
  --ring-sim P              run the call with context parallelism on P in-process
                            virtual ranks over the backend (cp.Sim): the sequence
                            is sharded, the ranks exchange K/V blocks or heads, and
                            the outputs are reassembled; they equal the plain run's
                            within rounding. N and M (with --cu-seqlens-q/-k every
                            sequence) must cut into equal shards (P chunks, 2P
                            for zigzag); not with --bias
  --cp-scheme ring|zigzag|a2a|hybrid[-A]|auto
                            how --ring-sim splits the call (default: zigzag under
                            --causal, ring otherwise); a2a needs P to divide the
                            key/value heads; hybrid trades heads within groups of
                            A ranks (A divides P and the key/value heads: the
                            largest such, or given as hybrid-A) and rings across
                            the groups; auto asks the cost model, which measures
                            this machine once and caches the result (hybrid not
                            for packed batches; auto picks among the others)
  --cp-explain              print the cost model's reasoning for --ring-sim
`

func init() {
	register(&command{
		name:    "run",
		summary: "compute one forward (and backward) call from .npy files",
		usage:   runUsage,
		run:     runRun,
	})
}

// runFlags are the parsed flags of the run command.
type runFlags struct {
	backend, dtype          string
	q, k, v, do, bias, out  string
	causal, deterministic   bool
	align, window           string
	softcap, scale, dropout float64
	seed                    uint64
	offset                  uint
	cuSeqlensQ, cuSeqlensK  string
	cp                      cpFlags
	stdout                  io.Writer
}

func runRun(args []string, stdout io.Writer) error {
	var f runFlags
	fs := newFlagSet(commands["run"])
	fs.StringVar(&f.backend, "backend", "auto", "")
	fs.StringVar(&f.dtype, "dtype", "fp32", "")
	fs.StringVar(&f.q, "q", "", "")
	fs.StringVar(&f.k, "k", "", "")
	fs.StringVar(&f.v, "v", "", "")
	fs.StringVar(&f.do, "do", "", "")
	fs.StringVar(&f.bias, "bias", "", "")
	fs.StringVar(&f.out, "out", "", "")
	fs.BoolVar(&f.causal, "causal", false, "")
	fs.BoolVar(&f.deterministic, "deterministic", false, "")
	fs.StringVar(&f.align, "align", "bottom-right", "")
	fs.StringVar(&f.window, "window", "", "")
	fs.Float64Var(&f.softcap, "softcap", 0, "")
	fs.Float64Var(&f.scale, "scale", 0, "")
	fs.Float64Var(&f.dropout, "dropout", 0, "")
	fs.Uint64Var(&f.seed, "seed", 0, "")
	fs.UintVar(&f.offset, "offset", 0, "")
	fs.StringVar(&f.cuSeqlensQ, "cu-seqlens-q", "", "")
	fs.StringVar(&f.cuSeqlensK, "cu-seqlens-k", "", "")
	fs.IntVar(&f.cp.ranks, "ring-sim", 0, "")
	fs.StringVar(&f.cp.scheme, "cp-scheme", "", "")
	fs.BoolVar(&f.cp.explain, "cp-explain", false, "")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	f.cp.set = isSet(fs, "ring-sim")
	f.stdout = stdout
	for _, req := range []struct{ name, val string }{{"q", f.q}, {"k", f.k}, {"v", f.v}, {"out", f.out}} {
		if req.val == "" {
			return usageErrorf("missing --%s", req.name)
		}
	}
	return f.execute()
}

// options turns the flags into attention options (without the bias).
func (f *runFlags) options() (flashattn.Options, error) {
	opt := flashattn.Options{
		Scale: f.scale, Softcap: f.softcap, Causal: f.causal, Dropout: f.dropout,
		Seed: f.seed, Deterministic: f.deterministic,
	}
	if f.offset > math.MaxUint32 {
		return opt, fmt.Errorf("--offset %d does not fit 32 bits", f.offset)
	}
	opt.Offset = uint32(f.offset)
	switch f.align {
	case "bottom-right":
		opt.Align = flashattn.AlignBottomRight
	case "top-left":
		opt.Align = flashattn.AlignTopLeft
	default:
		return opt, fmt.Errorf("--align %q is neither top-left nor bottom-right", f.align)
	}
	if f.window != "" {
		w, err := parseInts(f.window)
		if err != nil || len(w) != 2 {
			return opt, fmt.Errorf("--window %q is not two integers L,R", f.window)
		}
		opt.Window = &flashattn.Window{Left: w[0], Right: w[1]}
	}
	for _, cu := range []struct {
		name, val string
		dst       *[]int32
	}{{"cu-seqlens-q", f.cuSeqlensQ, &opt.CuSeqlensQ}, {"cu-seqlens-k", f.cuSeqlensK, &opt.CuSeqlensK}} {
		if cu.val == "" {
			continue
		}
		xs, err := parseInts(cu.val)
		if err != nil {
			return opt, fmt.Errorf("--%s %q: %v", cu.name, cu.val, err)
		}
		*cu.dst = make([]int32, len(xs))
		for i, x := range xs {
			if x < math.MinInt32 || x > math.MaxInt32 {
				return opt, fmt.Errorf("--%s %q: %d does not fit 32 bits", cu.name, cu.val, x)
			}
			(*cu.dst)[i] = int32(x)
		}
	}
	if (opt.CuSeqlensQ == nil) != (opt.CuSeqlensK == nil) {
		return opt, fmt.Errorf("--cu-seqlens-q and --cu-seqlens-k go together")
	}
	return opt, nil
}

// isSet reports whether the flag called name was given.
func isSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// parseInts parses a comma-separated list of integers.
func parseInts(s string) ([]int, error) {
	parts := strings.Split(s, ",")
	out := make([]int, len(parts))
	for i, p := range parts {
		x, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil {
			return nil, fmt.Errorf("%q is not an integer", p)
		}
		out[i] = x
	}
	return out, nil
}

// readInput reads the .npy file named by flag and rounds it to dt.
func readInput(flag, path string, dt flashattn.DType) (flashattn.Tensor, error) {
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return flashattn.Tensor{}, fmt.Errorf("--%s %s is a directory, not a .npy file", flag, path)
	}
	t, err := npy.ReadFile(path)
	if err != nil {
		return t, fmt.Errorf("--%s: %w", flag, err)
	}
	if t.DType == dt {
		return t, nil
	}
	return flashattn.FromFloat32(dt, t.Float32s(), t.Shape...), nil
}

func (f *runFlags) execute() error {
	switch f.backend {
	case "cpu", "cuda", "auto":
	default:
		return fmt.Errorf("--backend %q is not cpu, cuda or auto", f.backend)
	}
	dt, err := flashattn.ParseDType(f.dtype)
	if err != nil {
		return fmt.Errorf("--dtype %q is not fp32, fp16 or bf16", f.dtype)
	}
	opt, err := f.options()
	if err != nil {
		return err
	}
	var in [3]flashattn.Tensor
	for i, x := range []struct{ flag, path string }{{"q", f.q}, {"k", f.k}, {"v", f.v}} {
		if in[i], err = readInput(x.flag, x.path, dt); err != nil {
			return err
		}
	}
	q, k, v := in[0], in[1], in[2]
	if f.bias != "" {
		b, err := readInput("bias", f.bias, dt)
		if err != nil {
			return err
		}
		opt.Bias = &flashattn.Bias{Tensor: b, RequiresGrad: f.do != ""}
	}
	var dO flashattn.Tensor
	if f.do != "" {
		if dO, err = readInput("do", f.do, dt); err != nil {
			return err
		}
	}
	// Validate before opening a backend, so bad input is reported the same
	// way whichever backend would have run it.
	p, err := flashattn.NewProblem(q, k, v, opt)
	if err != nil {
		return err
	}
	if f.do != "" && !slices.Equal(dO.Shape, p.OutputShape()) {
		return fmt.Errorf("--do has shape %v, want the output's %v", dO.Shape, p.OutputShape())
	}
	if f.cp.set && opt.Bias != nil {
		return usageErrorf("--ring-sim does not run --bias yet")
	}
	if err := f.cp.check("--ring-sim", p); err != nil {
		return err
	}
	names := []string{"o", "lse"}
	if f.do != "" {
		names = append(names, "dq", "dk", "dv")
		if opt.Bias != nil {
			names = append(names, "dbias")
		}
	}
	out, err := openOutDir(f.out, names)
	if err != nil {
		return err
	}
	defer out.discard()

	forward, backward := flashattn.Forward, flashattn.Backward
	if f.backend != "auto" || f.cp.set {
		b, err := flashattn.Open(f.backend)
		if err != nil {
			return err
		}
		if c, ok := b.(io.Closer); ok {
			defer c.Close()
		}
		if f.cp.set {
			s, err := f.cp.strategy(f.stdout, b, p, dt, f.do != "")
			if err != nil {
				return fmt.Errorf("--ring-sim %d: %w", f.cp.ranks, err)
			}
			b = s.Sim(b, f.cp.ranks)
		}
		forward, backward = b.Forward, b.Backward
	}
	res, err := forward(q, k, v, opt)
	if err != nil {
		return fmt.Errorf("forward: %w", err)
	}
	outputs := []namedTensor{{"o", res.O}, {"lse", res.LSE}}
	if f.do != "" {
		g, err := backward(q, k, v, res.O, res.LSE, dO, opt)
		if err != nil {
			return fmt.Errorf("backward: %w", err)
		}
		outputs = append(outputs, namedTensor{"dq", g.DQ}, namedTensor{"dk", g.DK}, namedTensor{"dv", g.DV})
		if opt.Bias != nil {
			if g.DBias == nil {
				return fmt.Errorf("backward: the %s backend returned no bias gradient", f.backend)
			}
			outputs = append(outputs, namedTensor{"dbias", *g.DBias})
		}
	}
	for _, o := range outputs {
		if err := out.write(o.name, o.t); err != nil {
			return err
		}
	}
	return out.commit()
}

// runOutputs lists every output run may write, by base name.
var runOutputs = []string{"o", "lse", "dq", "dk", "dv", "dbias"}

// writeOutput writes one output file and rename moves one; tests replace
// them to make a write or a move fail.
var (
	writeOutput = npy.WriteFloat32File
	rename      = os.Rename
)

// outDir is the destination of run's outputs and the temporary directory
// beside it that they are written to first.
type outDir struct {
	dir, tmp  string
	names     []string // the outputs of this run
	created   []string // the directories openOutDir created, deepest first
	committed bool
}

// openOutDir checks the destination dir before anything is computed: it
// must be a directory (created when missing, and removed again if the run
// fails) in which files can be created, and none of the output names of this run may be a directory or
// another non-regular file there. It then creates the temporary directory,
// beside dir where its parent allows, else inside it (hidden), so that
// moving the outputs into place is a rename on one file system.
func openOutDir(dir string, names []string) (*outDir, error) {
	if fi, err := os.Stat(dir); err == nil && !fi.IsDir() {
		return nil, fmt.Errorf("--out %s is not a directory", dir)
	}
	var created []string
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); err == nil || filepath.Dir(d) == d {
			break
		}
		created = append(created, d)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("--out: %w", err)
	}
	o := &outDir{dir: dir, names: names, created: created}
	for _, n := range names {
		path := filepath.Join(dir, n+".npy")
		if fi, err := os.Lstat(path); err == nil && !fi.Mode().IsRegular() {
			what := "not a regular file"
			if fi.IsDir() {
				what = "a directory"
			}
			o.discard()
			return nil, fmt.Errorf("--out: %s is %s, so the output cannot be written there", path, what)
		}
	}
	probe, err := os.CreateTemp(dir, ".flashattn-probe-*")
	if err != nil {
		o.discard()
		return nil, fmt.Errorf("--out: %w", err)
	}
	probe.Close()
	os.Remove(probe.Name())
	pattern := "." + filepath.Base(filepath.Clean(dir)) + ".flashattn-run-*"
	o.tmp, err = os.MkdirTemp(filepath.Dir(filepath.Clean(dir)), pattern)
	if err != nil {
		if o.tmp, err = os.MkdirTemp(dir, ".flashattn-run-*"); err != nil {
			o.discard()
			return nil, fmt.Errorf("--out: %w", err)
		}
	}
	return o, nil
}

// write writes output name (one of o.names) to the temporary directory.
func (o *outDir) write(name string, t flashattn.Tensor) error {
	return writeOutput(filepath.Join(o.tmp, name+".npy"), t.Shape, t.Float32s())
}

// commit moves the written outputs into the destination, replacing the
// files there, and removes the outputs of an earlier run that this one did
// not produce. The files it replaces or removes are first set aside in the
// temporary directory: if a move fails, every move is undone and the
// destination is left as it was.
func (o *outDir) commit() error {
	type move struct{ from, to string }
	var done []move
	mv := func(from, to string) error {
		if err := rename(from, to); err != nil {
			for i := len(done) - 1; i >= 0; i-- {
				os.Rename(done[i].to, done[i].from)
			}
			return fmt.Errorf("--out: %w", err)
		}
		done = append(done, move{from, to})
		return nil
	}
	for _, n := range runOutputs {
		path := filepath.Join(o.dir, n+".npy")
		if fi, err := os.Lstat(path); err != nil || !fi.Mode().IsRegular() {
			continue // absent, or not an output (openOutDir refused those of this run)
		}
		if err := mv(path, filepath.Join(o.tmp, n+".npy.old")); err != nil {
			return err
		}
	}
	for _, n := range o.names {
		if err := mv(filepath.Join(o.tmp, n+".npy"), filepath.Join(o.dir, n+".npy")); err != nil {
			return err
		}
	}
	o.committed = true
	return nil
}

// discard removes the temporary directory and what is left in it (the
// outputs of a run that failed, or the files a commit replaced) and, unless
// the outputs were committed, the directories openOutDir created (those
// still empty).
func (o *outDir) discard() {
	if o.tmp != "" {
		os.RemoveAll(o.tmp)
	}
	if o.committed {
		return
	}
	for _, d := range o.created {
		if os.Remove(d) != nil {
			return
		}
	}
}

// namedTensor is an output and the base name of its file.
type namedTensor struct {
	name string
	t    flashattn.Tensor
}
