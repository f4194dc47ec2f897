package main

import (
	"bytes"
	"errors"
	"io/fs"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/flashattn/flashattn"
	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
	"github.com/flashattn/flashattn/npy"
)

// execute runs the command line in-process and returns the exit status and
// what it wrote.
func execute(args ...string) (status int, stdout, stderr string) {
	var o, e bytes.Buffer
	status = dispatch(args, &o, &e)
	return status, o.String(), e.String()
}

// writeNPY writes t to dir/name and returns the path.
func writeNPY(t *testing.T, dir, name string, x flashattn.Tensor) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := npy.WriteFile(path, x); err != nil {
		t.Fatal(err)
	}
	return path
}

// readOut reads dir/name.npy and checks its dtype and shape.
func readOut(t *testing.T, dir, name string, shape []int) []float64 {
	t.Helper()
	x, err := npy.ReadFile(filepath.Join(dir, name+".npy"))
	if err != nil {
		t.Fatal(err)
	}
	if x.DType != flashattn.Float32 {
		t.Errorf("%s.npy has dtype %v, want fp32", name, x.DType)
	}
	if !slices.Equal(x.Shape, shape) {
		t.Fatalf("%s.npy has shape %v, want %v", name, x.Shape, shape)
	}
	return x.Float64s()
}

// near fails unless got matches want within tol relative to want's largest
// magnitude, NaN where want is NaN.
func near(t *testing.T, name string, got, want []float64, tol float64) {
	t.Helper()
	scale := 1.0
	for _, w := range want {
		if !math.IsInf(w, 0) && !math.IsNaN(w) {
			scale = math.Max(scale, math.Abs(w))
		}
	}
	for i := range want {
		if got[i] == want[i] || (math.IsNaN(got[i]) && math.IsNaN(want[i])) {
			continue
		}
		if d := math.Abs(got[i] - want[i]); !(d <= tol*scale) {
			t.Fatalf("%s[%d] = %v, want %v", name, i, got[i], want[i])
		}
	}
}

func TestRun(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	tests := []struct {
		name    string
		q, k, v []int // shapes of the input files
		fileDT  flashattn.DType
		dt      flashattn.DType // compute dtype (--dtype)
		grad    bool            // pass --do
		bias    []int           // bias shape, nil for none
		flags   []string
		opt     flashattn.Options // the options the flags mean
		nanV    int               // 1 + the row of v to fill with NaN (0: none)
	}{
		{name: "forward only", q: []int{2, 5, 2, 8}, k: []int{2, 7, 2, 8}, v: []int{2, 7, 2, 8},
			fileDT: flashattn.Float32, dt: flashattn.Float32, flags: []string{"--backend", "cpu"}},
		{name: "backward gqa causal", q: []int{1, 6, 4, 8}, k: []int{1, 9, 2, 8}, v: []int{1, 9, 2, 5},
			fileDT: flashattn.Float32, dt: flashattn.Float32, grad: true, flags: []string{"--causal"},
			opt: flashattn.Options{Causal: true}},
		{name: "window top-left softcap scale", q: []int{1, 8, 1, 4}, k: []int{1, 8, 1, 4}, v: []int{1, 8, 1, 4},
			fileDT: flashattn.Float32, dt: flashattn.Float32, grad: true,
			flags: []string{"--align", "top-left", "--window", "2,-1", "--softcap", "2.5", "--scale", "0.7", "--deterministic"},
			opt:   flashattn.Options{Align: flashattn.AlignTopLeft, Window: &flashattn.Window{Left: 2, Right: -1}, Softcap: 2.5, Scale: 0.7, Deterministic: true}},
		{name: "bias with grad", q: []int{2, 4, 2, 8}, k: []int{2, 6, 2, 8}, v: []int{2, 6, 2, 8},
			fileDT: flashattn.Float32, dt: flashattn.Float32, grad: true, bias: []int{1, 2, 4, 6}},
		{name: "bias forward only", q: []int{1, 4, 2, 8}, k: []int{1, 6, 2, 8}, v: []int{1, 6, 2, 8},
			fileDT: flashattn.Float32, dt: flashattn.Float32, bias: []int{1, 1, 4, 6}},
		{name: "dropout", q: []int{1, 16, 2, 8}, k: []int{1, 16, 2, 8}, v: []int{1, 16, 2, 8},
			fileDT: flashattn.Float32, dt: flashattn.Float32, grad: true,
			flags: []string{"--dropout", "0.25", "--seed", "99", "--offset", "3"},
			opt:   flashattn.Options{Dropout: 0.25, Seed: 99, Offset: 3}},
		{name: "varlen with an empty segment", q: []int{40, 2, 8}, k: []int{9, 1, 8}, v: []int{9, 1, 8},
			fileDT: flashattn.Float32, dt: flashattn.Float32, grad: true,
			flags: []string{"--cu-seqlens-q", "0,5,5,40", "--cu-seqlens-k", "0,7,9,9", "--causal"},
			opt:   flashattn.Options{CuSeqlensQ: []int32{0, 5, 5, 40}, CuSeqlensK: []int32{0, 7, 9, 9}, Causal: true}},
		{name: "fp16 files computed in fp32", q: []int{1, 5, 1, 8}, k: []int{1, 5, 1, 8}, v: []int{1, 5, 1, 8},
			fileDT: flashattn.Float16, dt: flashattn.Float32, grad: true},
		{name: "fp32 files computed in bf16", q: []int{1, 5, 2, 8}, k: []int{1, 5, 2, 8}, v: []int{1, 5, 2, 8},
			fileDT: flashattn.Float32, dt: flashattn.BFloat16, grad: true, flags: []string{"--dtype", "bf16"}},
		{name: "fp32 files computed in fp16", q: []int{1, 5, 2, 8}, k: []int{1, 5, 2, 8}, v: []int{1, 5, 2, 8},
			fileDT: flashattn.Float32, dt: flashattn.Float16, flags: []string{"--dtype", "fp16", "--backend", "auto"}},
		{name: "window MaxInt both sides is unmasked", q: []int{1, 9, 2, 8}, k: []int{1, 12, 1, 8}, v: []int{1, 12, 1, 8},
			fileDT: flashattn.Float32, dt: flashattn.Float32, grad: true,
			flags: []string{"--backend", "cpu", "--window", "9223372036854775807,9223372036854775807"}},
		{name: "window 0,MaxInt", q: []int{1, 12, 2, 8}, k: []int{1, 9, 1, 8}, v: []int{1, 9, 1, 8},
			fileDT: flashattn.Float32, dt: flashattn.Float32, grad: true,
			flags: []string{"--backend", "cpu", "--window", "0,9223372036854775807", "--align", "top-left"},
			opt:   flashattn.Options{Window: &flashattn.Window{Left: 0, Right: -1}, Align: flashattn.AlignTopLeft}},
		{name: "causal with window MaxInt,MaxInt", q: []int{1, 10, 1, 8}, k: []int{1, 10, 1, 8}, v: []int{1, 10, 1, 8},
			fileDT: flashattn.Float32, dt: flashattn.Float32, grad: true,
			flags: []string{"--backend", "cpu", "--causal", "--window", "9223372036854775807,9223372036854775807"},
			opt:   flashattn.Options{Causal: true}},
		{name: "NaN value row under causal", q: []int{1, 16, 2, 8}, k: []int{1, 16, 1, 8}, v: []int{1, 16, 1, 8},
			fileDT: flashattn.Float32, dt: flashattn.Float32, grad: true, flags: []string{"--backend", "cpu", "--causal"},
			opt: flashattn.Options{Causal: true}, nanV: 1 + 12},
		{name: "NaN value row under causal in bf16", q: []int{1, 16, 2, 8}, k: []int{1, 16, 1, 8}, v: []int{1, 16, 1, 8},
			fileDT: flashattn.Float32, dt: flashattn.BFloat16, flags: []string{"--backend", "cpu", "--causal", "--dtype", "bf16"},
			opt: flashattn.Options{Causal: true}, nanV: 1 + 3},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			out := filepath.Join(dir, "out", "nested")
			q := randomTensor(rng, tc.fileDT, tc.q...)
			k := randomTensor(rng, tc.fileDT, tc.k...)
			v := randomTensor(rng, tc.fileDT, tc.v...)
			if tc.nanV > 0 {
				for kh := 0; kh < tc.v[2]; kh++ {
					for d := 0; d < tc.v[3]; d++ {
						v.Set(float32(math.NaN()), 0, tc.nanV-1, kh, d)
					}
				}
			}
			args := []string{"run", "--q", writeNPY(t, dir, "q.npy", q), "--k", writeNPY(t, dir, "k.npy", k),
				"--v", writeNPY(t, dir, "v.npy", v), "--out", out}
			args = append(args, tc.flags...)
			// The reference sees the inputs rounded to the compute dtype.
			round := func(x flashattn.Tensor) flashattn.Tensor {
				return flashattn.FromFloat32(tc.dt, x.Float32s(), x.Shape...)
			}
			opt := tc.opt
			if tc.bias != nil {
				b := randomTensor(rng, flashattn.Float32, tc.bias...)
				args = append(args, "--bias", writeNPY(t, dir, "bias.npy", b))
				opt.Bias = &flashattn.Bias{Tensor: round(b), RequiresGrad: tc.grad}
			}
			var dO flashattn.Tensor
			if tc.grad {
				shape := append([]int(nil), tc.q...)
				shape[len(shape)-1] = tc.v[len(tc.v)-1]
				dO = randomTensor(rng, tc.fileDT, shape...)
				args = append(args, "--do", writeNPY(t, dir, "do.npy", dO))
			}
			status, stdout, stderr := execute(args...)
			if status != 0 || stderr != "" || stdout != "" {
				t.Fatalf("status %d, stdout %q, stderr %q", status, stdout, stderr)
			}
			rq, rk, rv := round(q), round(k), round(v)
			ref, err := cpu.Reference(rq, rk, rv, opt)
			if err != nil {
				t.Fatal(err)
			}
			// Outputs are stored in the compute dtype before being widened.
			tol := 1e-5
			if tc.dt != flashattn.Float32 {
				tol = 1e-2
			}
			o := readOut(t, out, "o", ref.Problem.OutputShape())
			near(t, "o", o, ref.O, tol)
			if tc.nanV > 0 {
				// Causal, N = M: the rows before the poisoned value cannot see it.
				rowLen := len(o) / tc.q[1]
				for i, x := range o {
					if math.IsNaN(x) != (i/rowLen >= tc.nanV-1) {
						t.Fatalf("o row %d holds %v: only rows %d and later see the NaN", i/rowLen, x, tc.nanV-1)
					}
				}
			}
			near(t, "lse", readOut(t, out, "lse", ref.Problem.LSEShape()), ref.LSE, 1e-5)
			for _, name := range []string{"dq", "dk", "dv", "dbias"} {
				_, err := os.Stat(filepath.Join(out, name+".npy"))
				want := tc.grad && (name != "dbias" || tc.bias != nil)
				if want != (err == nil) {
					t.Errorf("%s.npy exists: %v, want %v", name, err == nil, want)
				}
			}
			if !tc.grad {
				return
			}
			refG, err := cpu.ReferenceBackward(rq, rk, rv, round(dO), opt)
			if err != nil {
				t.Fatal(err)
			}
			near(t, "dq", readOut(t, out, "dq", rq.Shape), refG.DQ, tol)
			near(t, "dk", readOut(t, out, "dk", rk.Shape), refG.DK, tol)
			near(t, "dv", readOut(t, out, "dv", rv.Shape), refG.DV, tol)
			if tc.bias != nil {
				near(t, "dbias", readOut(t, out, "dbias", tc.bias), refG.DBias, tol)
			}
		})
	}
}

func TestRunBadInput(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(5, 6))
	q := writeNPY(t, dir, "q.npy", randomTensor(rng, flashattn.Float32, 1, 4, 2, 8))
	k := writeNPY(t, dir, "k.npy", randomTensor(rng, flashattn.Float32, 1, 6, 2, 8))
	v := writeNPY(t, dir, "v.npy", randomTensor(rng, flashattn.Float32, 1, 6, 2, 8))
	k3 := writeNPY(t, dir, "k3.npy", randomTensor(rng, flashattn.Float32, 1, 6, 3, 8))
	packed := writeNPY(t, dir, "packed.npy", randomTensor(rng, flashattn.Float32, 10, 2, 8))
	badDO := writeNPY(t, dir, "do.npy", randomTensor(rng, flashattn.Float32, 1, 4, 2, 7))
	badBias := writeNPY(t, dir, "bias.npy", randomTensor(rng, flashattn.Float32, 1, 2, 4, 5))
	garbage := filepath.Join(dir, "garbage.npy")
	if err := os.WriteFile(garbage, []byte("not a numpy file"), 0o644); err != nil {
		t.Fatal(err)
	}
	full, err := os.ReadFile(q)
	if err != nil {
		t.Fatal(err)
	}
	truncated := filepath.Join(dir, "truncated.npy")
	if err := os.WriteFile(truncated, full[:len(full)-3], 0o644); err != nil {
		t.Fatal(err)
	}
	fortran := filepath.Join(dir, "fortran.npy")
	if err := os.WriteFile(fortran, bytes.Replace(full, []byte("False"), []byte("True "), 1), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "out")
	base := []string{"run", "--q", q, "--k", k, "--v", v, "--out", out}
	with := func(extra ...string) []string { return append(append([]string(nil), base...), extra...) }
	tests := []struct {
		name   string
		args   []string
		status int
		msg    string // a fragment the error line must contain
	}{
		{"unknown command", []string{"frobnicate"}, 2, `unknown command "frobnicate"`},
		{"missing q", []string{"run", "--k", k, "--v", v, "--out", out}, 2, "missing --q"},
		{"missing out", []string{"run", "--q", q, "--k", k, "--v", v}, 2, "missing --out"},
		{"unknown flag", with("--frob"), 2, "flag provided but not defined: -frob"},
		{"positional argument", with("extra"), 2, `unexpected argument "extra"`},
		{"softcap not a number", with("--softcap", "abc"), 2, "-softcap"},
		{"missing q file", []string{"run", "--q", filepath.Join(dir, "absent.npy"), "--k", k, "--v", v, "--out", out}, 1, "absent.npy"},
		{"garbage file", []string{"run", "--q", garbage, "--k", k, "--v", v, "--out", out}, 1, "magic"},
		{"truncated file", []string{"run", "--q", truncated, "--k", k, "--v", v, "--out", out}, 1, "truncated"},
		{"fortran order", []string{"run", "--q", fortran, "--k", k, "--v", v, "--out", out}, 1, "fortran_order"},
		{"bad backend", with("--backend", "tpu"), 1, `--backend "tpu"`},
		{"bad dtype", with("--dtype", "fp8"), 1, `--dtype "fp8"`},
		{"bad align", with("--align", "middle"), 1, `--align "middle"`},
		{"window with one number", with("--window", "3"), 1, "--window"},
		{"window not numbers", with("--window", "a,b"), 1, "--window"},
		{"window side overflows", with("--window", "9223372036854775808,0"), 1, "--window"},
		{"q is a directory", []string{"run", "--q", dir, "--k", k, "--v", v, "--out", out}, 1, "--q " + dir + " is a directory"},
		{"k is a directory", []string{"run", "--q", q, "--k", dir, "--v", v, "--out", out}, 1, "--k " + dir + " is a directory"},
		{"out under a file", []string{"run", "--q", q, "--k", k, "--v", v, "--out", filepath.Join(garbage, "sub")}, 1, "--out"},
		{"dropout out of range", with("--dropout", "1.5"), 1, "dropout 1.5 outside [0, 1)"},
		{"scale not finite", with("--scale", "NaN"), 1, "scale NaN is not finite"},
		{"softcap negative", with("--softcap", "-1"), 1, "softcap -1"},
		{"offset too large", with("--offset", "4294967296"), 1, "--offset"},
		{"heads not a multiple", []string{"run", "--q", q, "--k", k3, "--v", k3, "--out", out}, 1, "H=2 not a multiple of key/value heads Hkv=3"},
		{"do shape", with("--do", badDO), 1, "--do has shape [1 4 2 7]"},
		{"bias does not broadcast", with("--bias", badBias), 1, "bias shape [1 2 4 5] does not broadcast"},
		{"cu-seqlens q only", with("--cu-seqlens-q", "0,4"), 1, "go together"},
		{"cu-seqlens not integers", with("--cu-seqlens-q", "0,x", "--cu-seqlens-k", "0,6"), 1, "--cu-seqlens-q"},
		{"cu-seqlens with padded tensors", with("--cu-seqlens-q", "0,4", "--cu-seqlens-k", "0,6"), 1, "want rank 3"},
		{"cu-seqlens decreasing", []string{"run", "--q", packed, "--k", packed, "--v", packed, "--out", out,
			"--cu-seqlens-q", "0,6,4,10", "--cu-seqlens-k", "0,4,6,10"}, 1, "not non-decreasing"},
		{"cu-seqlens total mismatch", []string{"run", "--q", packed, "--k", packed, "--v", packed, "--out", out,
			"--cu-seqlens-q", "0,4,9", "--cu-seqlens-k", "0,4,10"}, 1, "ends at 9 but the packed tensor has 10"},
		{"out is a file", []string{"run", "--q", q, "--k", k, "--v", v, "--out", garbage}, 1, "garbage.npy"},
		{"demo bad check rows", []string{"demo", "--check-rows", "0"}, 1, "--check-rows 0"},
		{"demo bad backend", []string{"demo", "--backend", "tpu"}, 1, `--backend "tpu"`},
		{"demo bad dtype", []string{"demo", "--dtype", "fp8"}, 1, `--dtype "fp8"`},
		{"demo negative size", []string{"demo", "--seq", "-4"}, 1, "--seq -4 is negative"},
		{"demo invalid problem", []string{"demo", "--backend", "cpu", "--heads", "3", "--kv-heads", "2"}, 1, "not a multiple"},
		{"demo breakdown not a boolean", []string{"demo", "--breakdown=maybe"}, 2, "breakdown"},
		{"help unknown command", []string{"help", "frobnicate"}, 2, `unknown command "frobnicate"`},
		{"version argument", []string{"version", "extra"}, 2, `unexpected argument "extra"`},
	}
	if _, err := flashattn.Open("cuda"); err != nil {
		tests = append(tests, struct {
			name   string
			args   []string
			status int
			msg    string
		}{"cuda without a GPU", with("--backend", "cuda"), 1, "cuda"})
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			status, stdout, stderr := execute(tc.args...)
			if status != tc.status {
				t.Errorf("status %d, want %d", status, tc.status)
			}
			if stdout != "" {
				t.Errorf("stdout %q, want nothing", stdout)
			}
			if strings.Count(stderr, "\n") != 1 || !strings.HasSuffix(stderr, "\n") {
				t.Errorf("stderr %q is not one line", stderr)
			}
			if !strings.Contains(stderr, tc.msg) {
				t.Errorf("stderr %q does not contain %q", stderr, tc.msg)
			}
			if !strings.HasPrefix(stderr, "flashattn") {
				t.Errorf("stderr %q does not start with the program name", stderr)
			}
			if _, err := os.Stat(filepath.Join(out, "o.npy")); err == nil {
				t.Errorf("o.npy written despite the error")
			}
			if _, err := os.Stat(out); err == nil {
				t.Errorf("--out %s created by a run that failed", out)
			}
		})
	}
}

func TestUsage(t *testing.T) {
	tests := []struct {
		name       string
		args       []string
		status     int
		stdoutHas  string
		stderrHas  string
		stderrNone bool
	}{
		{"no arguments", nil, 2, "", "Commands:", false},
		{"top-level -h", []string{"-h"}, 0, "Commands:", "", true},
		{"help", []string{"help"}, 0, "demo", "", true},
		{"help run", []string{"help", "run"}, 0, "--cu-seqlens-q", "", true},
		{"help run: no fallback", []string{"help", "run"}, 0, "never falls back to\n                            another backend", "", true},
		{"help run: outputs moved into place", []string{"help", "run"}, 0, "moved into place only when all of them\nwere written", "", true},
		{"run -h", []string{"run", "-h"}, 0, "--window L,R", "", true},
		{"demo --help", []string{"demo", "--help"}, 0, "--check-rows", "", true},
		{"help -h", []string{"help", "-h"}, 0, "Usage: flashattn help", "", true},
		{"version", []string{"version"}, 0, "flashattn " + flashattn.Version, "", true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			status, stdout, stderr := execute(tc.args...)
			if status != tc.status {
				t.Errorf("status %d, want %d", status, tc.status)
			}
			if !strings.Contains(stdout, tc.stdoutHas) {
				t.Errorf("stdout %q does not contain %q", stdout, tc.stdoutHas)
			}
			if !strings.Contains(stderr, tc.stderrHas) {
				t.Errorf("stderr %q does not contain %q", stderr, tc.stderrHas)
			}
			if tc.stderrNone && stderr != "" {
				t.Errorf("stderr %q, want nothing", stderr)
			}
		})
	}
	// README and the library say that nothing falls back to another backend.
	if _, stdout, _ := execute("help", "run"); strings.Contains(stdout, "run on the CPU") {
		t.Errorf("help run still says that problems run on the CPU:\n%s", stdout)
	}
	for _, name := range []string{"run", "demo", "version", "help"} {
		if c := commands[name]; c == nil || c.summary == "" || !strings.Contains(c.usage, "Usage: flashattn "+name) {
			t.Errorf("command %q missing or without summary and usage", name)
		}
	}
}

func TestDemo(t *testing.T) {
	tests := []struct {
		name string
		args []string
		has  []string
	}{
		{"causal fp32", []string{"--seq", "96", "--heads", "3", "--dim", "16", "--check-rows", "32"},
			[]string{"query rows 64-95", "keys 64-95 (dK, dV)", "PASS"}},
		{"no mask checks every row", []string{"--seq", "40", "--heads", "2", "--dim", "8", "--check-rows", "8", "--causal=false"},
			[]string{"query rows 0-39", "keys 0-39", "PASS"}},
		{"gqa bf16", []string{"--seq", "64", "--heads", "4", "--kv-heads", "2", "--dim", "32", "--dtype", "bf16", "--iters", "2"},
			[]string{"Hkv=2", "bf16", "query heads 0-3", "PASS"}},
		{"breakdown on the cpu", []string{"--seq", "32", "--heads", "2", "--dim", "8", "--check-rows", "8", "--breakdown"},
			[]string{"--breakdown: the cpu backend has no host-to-device path", "PASS"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			status, stdout, stderr := execute(append([]string{"demo", "--backend", "cpu"}, tc.args...)...)
			if status != 0 || stderr != "" {
				t.Fatalf("status %d, stderr %q, stdout:\n%s", status, stderr, stdout)
			}
			for _, h := range tc.has {
				if !strings.Contains(stdout, h) {
					t.Errorf("output does not contain %q:\n%s", h, stdout)
				}
			}
		})
	}
}

// TestSliceCheckCatchesErrors perturbs outputs the check covers and one it
// must ignore, and checks the verdicts.
func TestSliceCheckCatchesErrors(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	q := randomTensor(rng, flashattn.Float32, 1, 32, 2, 8)
	k := randomTensor(rng, flashattn.Float32, 1, 32, 2, 8)
	v := randomTensor(rng, flashattn.Float32, 1, 32, 2, 8)
	dO := randomTensor(rng, flashattn.Float32, 1, 32, 2, 8)
	opt := flashattn.Options{Causal: true}
	b, err := flashattn.Open("cpu")
	if err != nil {
		t.Fatal(err)
	}
	p, err := flashattn.NewProblem(q, k, v, opt)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		perturb func(r flashattn.Result, g flashattn.Gradients)
		failing string // the quantity that must fail, "" for none
	}{
		{"untouched", func(flashattn.Result, flashattn.Gradients) {}, ""},
		{"O in a checked row", func(r flashattn.Result, _ flashattn.Gradients) { r.O.Set(r.O.At(0, 31, 1, 3)+1e-3, 0, 31, 1, 3) }, "O"},
		{"LSE NaN", func(r flashattn.Result, _ flashattn.Gradients) { r.LSE.Set(float32(math.NaN()), 0, 0, 30) }, "LSE"},
		{"dQ", func(_ flashattn.Result, g flashattn.Gradients) { g.DQ.Set(g.DQ.At(0, 24, 0, 0)*1.01, 0, 24, 0, 0) }, "dQ"},
		{"dK of an own key", func(_ flashattn.Result, g flashattn.Gradients) { g.DK.Set(g.DK.At(0, 30, 1, 2)+1e-2, 0, 30, 1, 2) }, "dK"},
		{"dV of an own key", func(_ flashattn.Result, g flashattn.Gradients) { g.DV.Set(g.DV.At(0, 28, 0, 7)-1e-2, 0, 28, 0, 7) }, "dV"},
		{"O outside the slice is not checked", func(r flashattn.Result, _ flashattn.Gradients) { r.O.Set(100, 0, 3, 0, 0) }, ""},
		{"dK of a shared key is not checked", func(_ flashattn.Result, g flashattn.Gradients) { g.DK.Set(100, 0, 5, 0, 0) }, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fw, err := flashattn.ForwardOn(b, q, k, v, opt) // Forward, and Backward with its outputs
			if err != nil {
				t.Fatal(err)
			}
			res := fw.Result
			g, err := fw.Backward(dO)
			if err != nil {
				t.Fatal(err)
			}
			tc.perturb(res, g)
			sl, err := newSlice(p, q, k, v, dO, opt, 8)
			if err != nil {
				t.Fatal(err)
			}
			results, err := sl.check(flashattn.Float32, res, g)
			if err != nil {
				t.Fatal(err)
			}
			if len(results) != 5 {
				t.Fatalf("%d results, want 5", len(results))
			}
			for _, r := range results {
				if fails := !(r.err <= r.limit); fails != (r.name == tc.failing) {
					t.Errorf("%s: error %v limit %v, failing %v", r.name, r.err, r.limit, fails)
				}
			}
		})
	}
}

func TestSliceRejectsUncomparableProblems(t *testing.T) {
	q := flashattn.New(flashattn.Float32, 1, 4, 1, 4)
	tests := []struct {
		name string
		opt  flashattn.Options
	}{
		{"top-left", flashattn.Options{Align: flashattn.AlignTopLeft, Causal: true}},
		{"dropout", flashattn.Options{Dropout: 0.1}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := flashattn.NewProblem(q, q, q, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := newSlice(p, q, q, q, q, tc.opt, 2); err == nil {
				t.Fatal("no error")
			}
		})
	}
}

func TestOneLine(t *testing.T) {
	err := attn.Errorf(attn.ErrShape, "q has\nshape [2]")
	if got, want := oneLine(err), "q has shape [2]: bad shape"; got != want {
		t.Errorf("oneLine = %q, want %q", got, want)
	}
	if !errors.Is(err, attn.ErrShape) {
		t.Error("sentinel lost")
	}
}

// TestRunOutDir checks that run touches its output directory only when
// every output was computed and written: a destination that cannot take an
// output is refused before anything is computed, a failed write or move
// leaves the directory as it was, and a run that succeeds leaves exactly
// its own outputs (no stale gradients of an earlier run) and no temporary
// directory.
func TestRunOutDir(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	in := t.TempDir()
	q := writeNPY(t, in, "q.npy", randomTensor(rng, flashattn.Float32, 1, 6, 2, 8))
	k := writeNPY(t, in, "k.npy", randomTensor(rng, flashattn.Float32, 1, 7, 1, 8))
	v := writeNPY(t, in, "v.npy", randomTensor(rng, flashattn.Float32, 1, 7, 1, 8))
	do := writeNPY(t, in, "do.npy", randomTensor(rng, flashattn.Float32, 1, 6, 2, 8))
	args := func(out string, extra ...string) []string {
		return append([]string{"run", "--backend", "cpu", "--q", q, "--k", k, "--v", v, "--out", out}, extra...)
	}
	grads := []string{"o", "lse", "dq", "dk", "dv"}
	tests := []struct {
		name  string
		setup func(t *testing.T, out string) // prepares the destination (a first run, a directory in the way)
		args  func(out string) []string
		hook  func() (restore func())
		msg   string   // the error line must contain it; "" for success
		want  []string // the outputs afterwards; nil: exactly as after setup
	}{
		{name: "lse.npy is a directory, checked before the backend opens",
			setup: func(t *testing.T, out string) {
				mustRun(t, args(out)...)
				if err := os.Remove(filepath.Join(out, "lse.npy")); err != nil {
					t.Fatal(err)
				}
				mkdir(t, filepath.Join(out, "lse.npy"))
			},
			args: func(out string) []string { return append(args(out, "--causal"), "--backend", "cuda") },
			msg:  "lse.npy is a directory"},
		{name: "dq.npy is a directory",
			setup: func(t *testing.T, out string) { mkdir(t, filepath.Join(out, "dq.npy")) },
			args:  func(out string) []string { return args(out, "--do", do) },
			msg:   "dq.npy is a directory"},
		{name: "a write fails",
			setup: func(t *testing.T, out string) { mustRun(t, args(out, "--do", do)...) },
			args:  func(out string) []string { return args(out, "--do", do, "--causal") },
			hook: func() func() {
				prev := writeOutput
				writeOutput = func(path string, shape []int, data []float32) error {
					if filepath.Base(path) == "dv.npy" {
						return errors.New("disk full")
					}
					return prev(path, shape, data)
				}
				return func() { writeOutput = prev }
			},
			msg: "disk full"},
		{name: "a move fails and the others are undone",
			setup: func(t *testing.T, out string) { mustRun(t, args(out, "--do", do)...) },
			args:  func(out string) []string { return args(out, "--causal") },
			hook: func() func() {
				prev := rename
				rename = func(from, to string) error {
					if filepath.Base(to) == "lse.npy" {
						return errors.New("rename refused")
					}
					return prev(from, to)
				}
				return func() { rename = prev }
			},
			msg: "rename refused"},
		{name: "stale gradients are removed",
			setup: func(t *testing.T, out string) { mustRun(t, args(out, "--do", do)...) },
			args:  func(out string) []string { return args(out, "--causal") },
			want:  []string{"lse", "o"}},
		{name: "gradients replace the earlier ones",
			setup: func(t *testing.T, out string) { mustRun(t, args(out, "--do", do)...) },
			args:  func(out string) []string { return args(out, "--do", do, "--causal") },
			want:  grads},
		{name: "a failed run removes the destination it created",
			setup: func(t *testing.T, out string) { os.RemoveAll(out) },
			args:  func(out string) []string { return args(filepath.Join(out, "a", "b")) },
			hook: func() func() {
				prev := writeOutput
				writeOutput = func(string, []int, []float32) error { return errors.New("disk full") }
				return func() { writeOutput = prev }
			},
			msg: "disk full"},
		{name: "missing destination is created",
			setup: func(t *testing.T, out string) { os.RemoveAll(out) },
			args:  func(out string) []string { return args(filepath.Join(out, "a", "b")) },
			want:  nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			parent := t.TempDir()
			out := filepath.Join(parent, "out")
			mkdir(t, out)
			tc.setup(t, out)
			before := snapshotDir(t, parent)
			if tc.hook != nil {
				defer tc.hook()()
			}
			status, stdout, stderr := execute(tc.args(out)...)
			if tc.msg != "" {
				if status != 1 || stdout != "" || !strings.Contains(stderr, tc.msg) {
					t.Fatalf("status %d, stdout %q, stderr %q; want 1 and an error containing %q", status, stdout, stderr, tc.msg)
				}
				if after := snapshotDir(t, parent); !maps.Equal(before, after) {
					t.Fatalf("the destination changed:\nbefore %v\nafter  %v", keys(before), keys(after))
				}
				return
			}
			if status != 0 || stdout != "" || stderr != "" {
				t.Fatalf("status %d, stdout %q, stderr %q", status, stdout, stderr)
			}
			after := snapshotDir(t, parent)
			if tc.want == nil {
				if _, ok := after["out/a/b/o.npy"]; !ok {
					t.Fatalf("outputs %v, want out/a/b/o.npy among them", keys(after))
				}
				for p := range after {
					if strings.Contains(p, ".flashattn") {
						t.Fatalf("temporary file left: %s", p)
					}
				}
				return
			}
			var want []string
			for _, n := range tc.want {
				want = append(want, "out/"+n+".npy")
				if after["out/"+n+".npy"] == before["out/"+n+".npy"] {
					t.Errorf("%s.npy was not replaced", n)
				}
			}
			slices.Sort(want)
			if got := keys(after); !slices.Equal(got, want) {
				t.Fatalf("files %v, want %v (no stale outputs, no temporary files)", got, want)
			}
		})
	}
}

// mustRun runs a command line that must succeed.
func mustRun(t *testing.T, args ...string) {
	t.Helper()
	if status, _, stderr := execute(args...); status != 0 {
		t.Fatalf("%v: status %d: %s", args, status, stderr)
	}
}

func mkdir(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
}

// snapshotDir returns every file and directory under root (hidden ones
// included), by path relative to root, with the contents of the files.
func snapshotDir(t *testing.T, root string) map[string]string {
	t.Helper()
	m := map[string]string{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || path == root {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			m[rel+"/"] = ""
			return nil
		}
		b, err := os.ReadFile(path)
		m[rel] = string(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// keys returns the files of a snapshot (not the directories), sorted.
func keys(m map[string]string) []string {
	var ks []string
	for k := range m {
		if !strings.HasSuffix(k, "/") {
			ks = append(ks, k)
		}
	}
	slices.Sort(ks)
	return ks
}
