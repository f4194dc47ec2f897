package main

import (
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

Inputs are float32 or float16 .npy (float64 is read and rounded to float32),
q [B, N, H, DK], k [B, M, Hkv, DK], v [B, M, Hkv, DV], do like o, bias
[B or 1, H or 1, N, M]. With --cu-seqlens-q/-k the batch is packed:
q [totalQ, H, DK], k and v [totalK, Hkv, D], lse [H, totalQ].

Flags:
  --backend cpu|cuda|auto   backend (default auto: the GPU when one works,
                            otherwise the CPU; problems the GPU backend does
                            not support run on the CPU)
  --dtype fp32|fp16|bf16    compute precision; inputs are rounded to it (default fp32)
  --q, --k, --v FILE        query, key and value .npy files (required)
  --do FILE                 output gradient: also run the backward
  --bias FILE               additive score bias
  --causal                  causal mask
  --align top-left|bottom-right
                            diagonal alignment when N != M (default bottom-right)
  --window L,R              keep keys from diagonal-L to diagonal+R (negative: unbounded)
  --softcap X               softcap X*tanh(s/X) (default 0: off)
  --scale S                 score scale (default 0: 1/sqrt(DK))
  --dropout P               dropout probability in [0, 1)
  --seed N                  dropout seed
  --offset N                dropout counter offset
  --cu-seqlens-q LIST       cumulative query offsets, e.g. 0,5,5,40
  --cu-seqlens-k LIST       cumulative key offsets, e.g. 0,7,9,9
  --deterministic           demand bit-identical results on repeat
  --out DIR                 output directory, created when missing (required)
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
	if err := parseFlags(fs, args); err != nil {
		return err
	}
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

	forward, backward := flashattn.Forward, flashattn.Backward
	if f.backend != "auto" {
		b, err := flashattn.Open(f.backend)
		if err != nil {
			return err
		}
		if c, ok := b.(io.Closer); ok {
			defer c.Close()
		}
		forward, backward = b.Forward, b.Backward
	}
	res, err := forward(q, k, v, opt)
	if err != nil {
		return fmt.Errorf("forward: %w", err)
	}
	if err := os.MkdirAll(f.out, 0o755); err != nil {
		return err
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
		if err := npy.WriteFloat32File(filepath.Join(f.out, o.name+".npy"), o.t.Shape, o.t.Float32s()); err != nil {
			return err
		}
	}
	return nil
}

// namedTensor is an output and the base name of its file.
type namedTensor struct {
	name string
	t    flashattn.Tensor
}
