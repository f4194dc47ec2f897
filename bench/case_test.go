package bench

import (
	"errors"
	"slices"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

func TestFLOPs(t *testing.T) {
	// 4·B·H·N·M·D for a plain forward; causal counts N(N+1)/2 visible pairs of a square problem.
	for _, tc := range []struct {
		name string
		c    Case
		want float64
	}{
		{"plain fwd", Case{Batch: 2, SeqlenQ: 128, Heads: 4, HeadDim: 64, Pass: Forward}, 4 * 2 * 4 * 128 * 128 * 64},
		{"plain bwd", Case{Batch: 2, SeqlenQ: 128, Heads: 4, HeadDim: 64, Pass: Backward}, 2.5 * 4 * 2 * 4 * 128 * 128 * 64},
		{"plain fwdbwd", Case{Batch: 2, SeqlenQ: 128, Heads: 4, HeadDim: 64, Pass: ForwardBackward}, 3.5 * 4 * 2 * 4 * 128 * 128 * 64},
		{"N != M", Case{Batch: 1, SeqlenQ: 100, SeqlenK: 300, Heads: 2, HeadDim: 32}, 4 * 1 * 2 * 100 * 300 * 32},
		{"DK != DV", Case{Batch: 1, SeqlenQ: 64, Heads: 3, HeadDim: 192, HeadDimV: 128}, 2 * 1 * 3 * 64 * 64 * (192 + 128)},
		{"GQA counts query heads", Case{Batch: 1, SeqlenQ: 64, Heads: 8, KVHeads: 2, HeadDim: 64}, 4 * 1 * 8 * 64 * 64 * 64},
		{"causal square", Case{Batch: 2, SeqlenQ: 1024, Heads: 16, HeadDim: 128, Causal: true}, 4 * 2 * 16 * (1024 * 1025 / 2) * 128},
		{"causal square bwd", Case{Batch: 1, SeqlenQ: 8, Heads: 1, HeadDim: 4, Causal: true, Pass: Backward}, 2.5 * 4 * 36 * 4},
		// N=2 queries over M=4 keys, bottom-right: rows see 3 and 4 keys; top-left: 1 and 2.
		{"causal bottom-right N<M", Case{Batch: 1, SeqlenQ: 2, SeqlenK: 4, Heads: 1, HeadDim: 1, Causal: true}, 4 * 7},
		{"causal top-left N<M", Case{Batch: 1, SeqlenQ: 2, SeqlenK: 4, Heads: 1, HeadDim: 1, Causal: true, Align: "top-left"}, 4 * 3},
		{"causal DK != DV", Case{Batch: 1, SeqlenQ: 4, Heads: 1, HeadDim: 3, HeadDimV: 5, Causal: true}, 2 * 10 * 8},
		// Window (1, 0) on 4×4: rows see 1, 2, 2, 2 keys.
		{"window", Case{Batch: 1, SeqlenQ: 4, Heads: 1, HeadDim: 2, Window: &Window{Left: 1, Right: 0}}, 4 * 7 * 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.c
			c.Normalize()
			if err := c.Validate(); err != nil {
				t.Fatal(err)
			}
			if got := c.FLOPs(); got != tc.want {
				t.Errorf("FLOPs = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestFLOPsMatchesProblem(t *testing.T) {
	// The tensor-free problem must count what attn.NewProblem's does.
	c := Case{Batch: 2, SeqlenQ: 7, SeqlenK: 11, Heads: 4, KVHeads: 2, HeadDim: 3, HeadDimV: 5, Causal: true,
		Window: &Window{Left: 2, Right: -1}}
	c.Normalize()
	q := attn.New(attn.Float32, 2, 7, 4, 3)
	k := attn.New(attn.Float32, 2, 11, 2, 3)
	v := attn.New(attn.Float32, 2, 11, 2, 5)
	p, err := attn.NewProblem(q, k, v, c.Options())
	if err != nil {
		t.Fatal(err)
	}
	if got, want := c.FLOPs(), p.FLOPs(); got != want {
		t.Errorf("FLOPs = %v, attn.Problem says %v", got, want)
	}
}

func TestValidate(t *testing.T) {
	ok := Case{Batch: 1, SeqlenQ: 8, Heads: 4, HeadDim: 16}
	for _, tc := range []struct {
		name string
		edit func(*Case)
		want error
	}{
		{"valid", func(*Case) {}, nil},
		{"dtype", func(c *Case) { c.DType = "fp8" }, attn.ErrDType},
		{"pass", func(c *Case) { c.Pass = "both" }, attn.ErrOption},
		{"batch", func(c *Case) { c.Batch = 0 }, attn.ErrShape},
		{"heads not a multiple", func(c *Case) { c.KVHeads = 3 }, attn.ErrShape},
		{"head dim too big", func(c *Case) { c.HeadDim = 513 }, attn.ErrShape},
		{"head dim v zero", func(c *Case) { c.HeadDimV = -1 }, attn.ErrShape},
		{"align", func(c *Case) { c.Align = "middle" }, attn.ErrOption},
		{"dropout", func(c *Case) { c.Dropout = 1 }, attn.ErrOption},
		{"softcap", func(c *Case) { c.Softcap = -1 }, attn.ErrOption},
		{"bias", func(c *Case) { c.Bias = "1hnm" }, nil},
		{"bias with its gradient", func(c *Case) { c.Bias, c.BiasGrad = "bhnm", true }, nil},
		{"bias shape", func(c *Case) { c.Bias = "bh" }, attn.ErrOption},
		{"bias gradient without a bias", func(c *Case) { c.BiasGrad = true }, attn.ErrOption},
		{"bias with context parallelism", func(c *Case) { c.Bias, c.CPRanks = "11nm", 2 }, attn.ErrOption},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := ok
			c.Normalize()
			tc.edit(&c)
			err := c.Validate()
			if tc.want == nil && err != nil || tc.want != nil && !errors.Is(err, tc.want) {
				t.Errorf("Validate() = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestCaseText(t *testing.T) {
	for _, tc := range []struct {
		c                Case
		shape, mask, str string
	}{
		{Case{Batch: 4, SeqlenQ: 4096, Heads: 32, KVHeads: 8, HeadDim: 128, Pass: Backward}, "B4 N4096 H32/8 D128", "-", "bf16 B4 N4096 H32/8 D128 bwd"},
		{Case{Batch: 1, SeqlenQ: 10, SeqlenK: 20, Heads: 2, HeadDim: 64, HeadDimV: 32, Causal: true, Align: "top-left", Deterministic: true},
			"B1 N10 M20 H2 D64/32", "causal tl det", "bf16 B1 N10 M20 H2 D64/32 causal tl det fwd"},
		{Case{Batch: 1, SeqlenQ: 10, Heads: 2, HeadDim: 8, Window: &Window{Left: 3, Right: 0}, Softcap: 30, Dropout: 0.1},
			"B1 N10 H2 D8", "win(3,0) cap 30 drop 0.1", "bf16 B1 N10 H2 D8 win(3,0) cap 30 drop 0.1 fwd"},
		{Case{Batch: 1, SeqlenQ: 10, Heads: 2, HeadDim: 8, Bias: "b1nm", BiasGrad: true, Pass: Backward},
			"B1 N10 H2 D8", "bias b1nm dbias", "bf16 B1 N10 H2 D8 bias b1nm dbias bwd"},
	} {
		c := tc.c
		c.Normalize()
		if got := c.Shape(); got != tc.shape {
			t.Errorf("Shape() = %q, want %q", got, tc.shape)
		}
		if got := c.Mask(); got != tc.mask {
			t.Errorf("Mask() = %q, want %q", got, tc.mask)
		}
		if got := c.String(); got != tc.str {
			t.Errorf("String() = %q, want %q", got, tc.str)
		}
	}
}

func TestKeyIgnoresPresetAndDefaults(t *testing.T) {
	a := Case{Preset: "seqlen", Batch: 1, SeqlenQ: 8, Heads: 2, HeadDim: 4}
	b := Case{Preset: "other", Batch: 1, SeqlenQ: 8, SeqlenK: 8, Heads: 2, KVHeads: 2, HeadDim: 4, HeadDimV: 4,
		Align: "bottom-right", DType: "bf16", Pass: Forward}
	if a.Key() != b.Key() {
		t.Errorf("keys differ: %q and %q", a.Key(), b.Key())
	}
	b.Causal = true
	if a.Key() == b.Key() {
		t.Errorf("causal and plain share key %q", a.Key())
	}
	keys := map[string]bool{a.Key(): true}
	for _, c := range []Case{{Bias: "1hnm"}, {Bias: "11nm"}, {Bias: "1hnm", BiasGrad: true}} {
		c.Batch, c.SeqlenQ, c.Heads, c.HeadDim = 1, 8, 2, 4
		if keys[c.Key()] {
			t.Errorf("bias %q (gradient %t) shares key %q", c.Bias, c.BiasGrad, c.Key())
		}
		keys[c.Key()] = true
	}
}

func TestBiasShape(t *testing.T) {
	for _, tc := range []struct {
		bias string
		want []int
	}{{"", nil}, {"b", nil}, {"hb1nm", nil}, {"bhnm", []int{3, 4, 5, 6}}, {"1hnm", []int{1, 4, 5, 6}}, {"b1nm", []int{3, 1, 5, 6}}, {"11nm", []int{1, 1, 5, 6}}} {
		c := Case{Batch: 3, Heads: 4, SeqlenQ: 5, SeqlenK: 6, Bias: tc.bias}
		if got := c.BiasShape(); !slices.Equal(got, tc.want) {
			t.Errorf("bias %q: shape %v, want %v", tc.bias, got, tc.want)
		}
	}
}

func TestParsePass(t *testing.T) {
	for _, s := range []string{"fwd", "bwd", "fwdbwd"} {
		if p, err := ParsePass(s); err != nil || string(p) != s {
			t.Errorf("ParsePass(%q) = %q, %v", s, p, err)
		}
	}
	if _, err := ParsePass("forward"); !errors.Is(err, attn.ErrOption) {
		t.Errorf("ParsePass(forward) = %v, want ErrOption", err)
	}
}
