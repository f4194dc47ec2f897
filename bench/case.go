package bench

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cp"
)

// Pass names the region a measurement times.
type Pass string

// The passes.
const (
	Forward         Pass = "fwd"    // the forward alone
	Backward        Pass = "bwd"    // the backward alone, given the forward's outputs
	ForwardBackward Pass = "fwdbwd" // a forward followed by a backward
)

// ParsePass parses fwd, bwd or fwdbwd. Other text fails with attn.ErrOption.
func ParsePass(s string) (Pass, error) {
	switch p := Pass(s); p {
	case Forward, Backward, ForwardBackward:
		return p, nil
	}
	return "", attn.Errorf(attn.ErrOption, "pass %q is not fwd, bwd or fwdbwd", s)
}

// Factor returns the operation count of the pass in units of the forward's:
// 1 for fwd, 2.5 for bwd, 3.5 for fwdbwd.
func (p Pass) Factor() float64 {
	switch p {
	case Backward:
		return 2.5
	case ForwardBackward:
		return 3.5
	}
	return 1
}

// Window is a sliding window around the diagonal, as attn.Window.
type Window struct {
	Left  int `json:"left"`
	Right int `json:"right"`
}

// Case is one problem and pass to measure. Its JSON form is the shape list
// entry the peer scripts read, and the first half of every Record.
type Case struct {
	// Preset names the sweep the case belongs to ("" for a single bench).
	Preset string `json:"preset,omitempty"`
	// DType is fp32, fp16 or bf16.
	DType string `json:"dtype"`
	// Batch, SeqlenQ (N), SeqlenK (M), Heads (H), KVHeads (Hkv), HeadDim
	// (DK) and HeadDimV (DV) are the sizes.
	Batch    int `json:"batch"`
	SeqlenQ  int `json:"seqlen_q"`
	SeqlenK  int `json:"seqlen_k"`
	Heads    int `json:"heads"`
	KVHeads  int `json:"kv_heads"`
	HeadDim  int `json:"head_dim"`
	HeadDimV int `json:"head_dim_v"`
	// Causal masks keys after the diagonal; Align places the diagonal
	// ("bottom-right", the default, or "top-left").
	Causal bool   `json:"causal"`
	Align  string `json:"align"`
	// Window, when set, keeps only keys within it.
	Window *Window `json:"window,omitempty"`
	// Softcap and Dropout are as in attn.Options.
	Softcap float64 `json:"softcap"`
	Dropout float64 `json:"dropout"`
	// Bias, when set, adds a random bias to the scores, broadcast as it
	// names (BiasShapes: "bhnm" is [B, H, N, M], "1hnm" [1, H, N, M],
	// "b1nm" [B, 1, N, M], "11nm" [1, 1, N, M]); BiasGrad asks the
	// backward for its gradient.
	Bias     string `json:"bias,omitempty"`
	BiasGrad bool   `json:"bias_grad,omitempty"`
	// Deterministic asks for bit-identical results (on the CUDA backend it
	// forces the deterministic dQ algorithm).
	Deterministic bool `json:"deterministic"`
	// Pass is the timed region.
	Pass Pass `json:"pass"`
	// CPRanks, when positive, splits the case over that many virtual
	// ranks with context parallelism (package cp) by CPScheme (ring,
	// zigzag, a2a, hybrid or hybrid-A; the default for the mask when
	// empty), measured with MeasureCP instead of a single call. Records
	// without them are single calls, as before they existed.
	CPRanks  int    `json:"cp_ranks,omitempty"`
	CPScheme string `json:"cp_scheme,omitempty"`
}

// Normalize fills the defaults: SeqlenK = SeqlenQ, KVHeads = Heads,
// HeadDimV = HeadDim when zero, Align "bottom-right" when empty, DType bf16
// when empty and Pass fwd when empty.
func (c *Case) Normalize() {
	if c.SeqlenK == 0 {
		c.SeqlenK = c.SeqlenQ
	}
	if c.KVHeads == 0 {
		c.KVHeads = c.Heads
	}
	if c.HeadDimV == 0 {
		c.HeadDimV = c.HeadDim
	}
	if c.Align == "" {
		c.Align = attn.AlignBottomRight.String()
	}
	if c.DType == "" {
		c.DType = attn.BFloat16.String()
	}
	if c.Pass == "" {
		c.Pass = Forward
	}
	if c.CPRanks > 0 && c.CPScheme == "" {
		c.CPScheme = cp.Default(c.Causal).String()
	}
}

// Validate reports whether the case describes a valid problem, with the
// rules of attn.NewProblem; errors wrap attn's sentinels.
func (c Case) Validate() error {
	if _, err := attn.ParseDType(c.DType); err != nil {
		return err
	}
	if _, err := ParsePass(string(c.Pass)); err != nil {
		return err
	}
	if c.Batch < 1 || c.SeqlenQ < 1 || c.SeqlenK < 1 {
		return attn.Errorf(attn.ErrShape, "batch %d, seqlen_q %d, seqlen_k %d must be positive", c.Batch, c.SeqlenQ, c.SeqlenK)
	}
	if c.Heads < 1 || c.KVHeads < 1 || c.Heads%c.KVHeads != 0 {
		return attn.Errorf(attn.ErrShape, "heads %d must be a positive multiple of kv_heads %d", c.Heads, c.KVHeads)
	}
	for _, d := range []int{c.HeadDim, c.HeadDimV} {
		if d < 1 || d > attn.MaxHeadDim {
			return attn.Errorf(attn.ErrShape, "head dims %d, %d must lie in 1..%d", c.HeadDim, c.HeadDimV, attn.MaxHeadDim)
		}
	}
	if _, err := ParseAlign(c.Align); err != nil {
		return err
	}
	if math.IsNaN(c.Softcap) || math.IsInf(c.Softcap, 0) || c.Softcap < 0 {
		return attn.Errorf(attn.ErrOption, "softcap %v is not finite and ≥ 0", c.Softcap)
	}
	if !(c.Dropout >= 0 && c.Dropout < 1) {
		return attn.Errorf(attn.ErrOption, "dropout %v outside [0, 1)", c.Dropout)
	}
	if err := c.validateBias(); err != nil {
		return err
	}
	return c.validateCP()
}

// BiasShapes are the values of Case.Bias: each letter a dim of the bias,
// b or h where it has the batch's or the heads' size, 1 where it
// broadcasts.
var BiasShapes = []string{"bhnm", "1hnm", "b1nm", "11nm"}

// validateBias checks the bias fields: a known broadcast, a gradient only
// with a bias, no bias with context parallelism (errors wrap
// attn.ErrOption).
func (c Case) validateBias() error {
	switch {
	case c.Bias == "" && c.BiasGrad:
		return attn.Errorf(attn.ErrOption, "bias_grad without a bias")
	case c.Bias == "":
		return nil
	case !slices.Contains(BiasShapes, c.Bias):
		return attn.Errorf(attn.ErrOption, "bias %q is none of %s", c.Bias, strings.Join(BiasShapes, ", "))
	case c.CPRanks > 0:
		return attn.Errorf(attn.ErrOption, "bias with context parallelism")
	}
	return nil
}

// BiasShape returns the shape of the case's bias tensor, nil without one
// (or with a Bias that is none of BiasShapes).
func (c Case) BiasShape() []int {
	if !slices.Contains(BiasShapes, c.Bias) {
		return nil
	}
	b, h := c.Batch, c.Heads
	if c.Bias[0] == '1' {
		b = 1
	}
	if c.Bias[1] == '1' {
		h = 1
	}
	return []int{b, h, c.SeqlenQ, c.SeqlenK}
}

// validateCP checks the context-parallel fields: no ranks without a
// scheme's case, a known scheme (errors wrap attn.ErrOption).
func (c Case) validateCP() error {
	switch {
	case c.CPRanks < 0:
		return attn.Errorf(attn.ErrOption, "cp_ranks %d is negative", c.CPRanks)
	case c.CPRanks == 0 && c.CPScheme != "":
		return attn.Errorf(attn.ErrOption, "cp_scheme %q without cp_ranks", c.CPScheme)
	case c.CPScheme != "":
		if _, err := cp.ParseStrategy(c.CPScheme); err != nil {
			return err
		}
	}
	return nil
}

// ParseAlign parses "bottom-right" (or "br", or empty) and "top-left" ("tl").
func ParseAlign(s string) (attn.Align, error) {
	switch s {
	case "", "bottom-right", "br":
		return attn.AlignBottomRight, nil
	case "top-left", "tl":
		return attn.AlignTopLeft, nil
	}
	return 0, attn.Errorf(attn.ErrOption, "align %q is neither bottom-right nor top-left", s)
}

// DTypeValue returns the parsed dtype; an unparsable one fails with attn.ErrDType.
func (c Case) DTypeValue() (attn.DType, error) { return attn.ParseDType(c.DType) }

// Options returns the attention options of the case (the dropout seed is
// fixed, so every run of a case drops the same elements).
func (c Case) Options() attn.Options {
	al, _ := ParseAlign(c.Align)
	o := attn.Options{
		Softcap:       c.Softcap,
		Causal:        c.Causal,
		Align:         al,
		Dropout:       c.Dropout,
		Seed:          0x5eed,
		Deterministic: c.Deterministic,
	}
	if c.Window != nil {
		o.Window = &attn.Window{Left: c.Window.Left, Right: c.Window.Right}
	}
	return o
}

// Problem returns the attention problem of the case without allocating its
// tensors (Scale resolved, masks resolved). Call Validate first.
func (c Case) Problem() *attn.Problem {
	opt := c.Options()
	p := &attn.Problem{
		B: c.Batch, N: c.SeqlenQ, M: c.SeqlenK, H: c.Heads, Hkv: c.KVHeads,
		DK: c.HeadDim, DV: c.HeadDimV, Scale: 1 / math.Sqrt(float64(c.HeadDim)), Opt: opt,
	}
	p.ResolveMask()
	return p
}

// FLOPs returns the conventional operation count of one run of the case's
// pass: attn.Problem.FLOPs (2·B·H·(DK+DV) per visible query-key pair) times
// Pass.Factor.
func (c Case) FLOPs() float64 { return c.Problem().FLOPs() * c.Pass.Factor() }

// Bytes returns the bytes of one input set: q, k, v and O, plus dO, the
// LSE and the gradients when the pass includes a backward.
func (c Case) Bytes() int64 {
	es := int64(2)
	if dt, err := c.DTypeValue(); err == nil {
		es = int64(dt.Size())
	}
	q := int64(c.Batch) * int64(c.SeqlenQ) * int64(c.Heads) * int64(c.HeadDim)
	k := int64(c.Batch) * int64(c.SeqlenK) * int64(c.KVHeads) * int64(c.HeadDim)
	v := int64(c.Batch) * int64(c.SeqlenK) * int64(c.KVHeads) * int64(c.HeadDimV)
	o := int64(c.Batch) * int64(c.SeqlenQ) * int64(c.Heads) * int64(c.HeadDimV)
	lse := int64(c.Batch) * int64(c.Heads) * int64(c.SeqlenQ) * 4
	n := (q+k+v+o)*es + lse
	if c.Pass != Forward {
		n += (o+q+k+v)*es + lse // dO, dQ, dK, dV and Delta
	}
	if s := c.BiasShape(); s != nil {
		bias := int64(attn.NumElements(s)) * es
		n += bias
		if c.BiasGrad && c.Pass != Forward {
			n += bias
		}
	}
	return n
}

// Mask returns a short description of the mask and options: "-" for none,
// else words such as "causal", "causal tl", "win(128,0)", "cap 30",
// "drop 0.1", "bias 1hnm", "dbias", "det".
func (c Case) Mask() string {
	var w []string
	if c.Causal {
		if c.Align == "top-left" && c.SeqlenQ != c.SeqlenK {
			w = append(w, "causal tl")
		} else {
			w = append(w, "causal")
		}
	}
	if c.Window != nil {
		w = append(w, fmt.Sprintf("win(%d,%d)", c.Window.Left, c.Window.Right))
	}
	if c.Softcap > 0 {
		w = append(w, fmt.Sprintf("cap %g", c.Softcap))
	}
	if c.Dropout > 0 {
		w = append(w, fmt.Sprintf("drop %g", c.Dropout))
	}
	if c.Bias != "" {
		w = append(w, "bias "+c.Bias)
		if c.BiasGrad {
			w = append(w, "dbias")
		}
	}
	if c.Deterministic {
		w = append(w, "det")
	}
	if len(w) == 0 {
		return "-"
	}
	return strings.Join(w, " ")
}

// Shape returns a compact description of the sizes, such as
// "B4 N4096 H32/8 D128" (M, Hkv and DV appear only where they differ).
func (c Case) Shape() string {
	var b strings.Builder
	fmt.Fprintf(&b, "B%d N%d", c.Batch, c.SeqlenQ)
	if c.SeqlenK != c.SeqlenQ {
		fmt.Fprintf(&b, " M%d", c.SeqlenK)
	}
	fmt.Fprintf(&b, " H%d", c.Heads)
	if c.KVHeads != c.Heads {
		fmt.Fprintf(&b, "/%d", c.KVHeads)
	}
	fmt.Fprintf(&b, " D%d", c.HeadDim)
	if c.HeadDimV != c.HeadDim {
		fmt.Fprintf(&b, "/%d", c.HeadDimV)
	}
	return b.String()
}

// String describes the case in one line: dtype, shape, mask and pass.
func (c Case) String() string {
	s := c.DType + " " + c.Shape()
	if m := c.Mask(); m != "-" {
		s += " " + m
	}
	s += " " + string(c.Pass)
	if c.CPRanks > 0 {
		s += fmt.Sprintf(" cp %s×%d", c.CPScheme, c.CPRanks)
	}
	return s
}

// Key identifies the problem and pass, ignoring the preset: two records with
// the same key measured the same thing.
func (c Case) Key() string {
	c.Preset = ""
	c.Normalize()
	w := "-"
	if c.Window != nil {
		w = fmt.Sprintf("%d,%d", c.Window.Left, c.Window.Right)
	}
	k := fmt.Sprintf("%s|%d|%d|%d|%d|%d|%d|%d|%t|%s|%s|%g|%g|%t|%s", c.DType, c.Batch, c.SeqlenQ, c.SeqlenK,
		c.Heads, c.KVHeads, c.HeadDim, c.HeadDimV, c.Causal, c.Align, w, c.Softcap, c.Dropout, c.Deterministic, c.Pass)
	if c.Bias != "" {
		k += fmt.Sprintf("|bias %s|%t", c.Bias, c.BiasGrad)
	}
	if c.CPRanks > 0 {
		k += fmt.Sprintf("|cp%d|%s", c.CPRanks, c.CPScheme)
	}
	return k
}
