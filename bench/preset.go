package bench

import (
	"sort"
	"strings"

	"github.com/flashattn/flashattn/attn"
)

// Preset is a named list of cases.
type Preset struct {
	// Name is the name given to --preset.
	Name string
	// Description says what the preset sweeps, in one line.
	Description string
	// Parts lists the presets a composite preset runs, in order; nil for a
	// preset with cases of its own.
	Parts []string
	cases func() []Case
}

// Tokens is the number of tokens B·N the seqlen sweep holds fixed, and
// Width the model width H·D it holds fixed (the sweep of the
// FlashAttention papers).
const (
	Tokens = 16384
	Width  = 2048
)

var presets = []Preset{
	{Name: "seqlen", Description: "N = 512…16384 with B·N = 16384 and H·D = 2048, D ∈ {64, 128, 256}, causal and not; fwd and bwd",
		cases: seqlenCases},
	{Name: "headdim", Description: "D = 4…96 (step 4), 104…160 (8), 176…256 (16), 288…384 (32), 448, 512 at B=1, H=16, N=4096; fwd and bwd",
		cases: headdimCases},
	{Name: "gqa-kv", Description: "H = 32 with Hkv ∈ {32, 8, 4, 1}, D = 128, N = 4096, B = 4; fwd and bwd",
		cases: gqaKVCases},
	{Name: "gqa-contention", Description: "fixed work, H = 8 with Hkv ∈ {8, 4}, N = M = 128…4096, B·N = 16384, D = 64; bwd, default and deterministic dQ",
		cases: contentionCases},
	{Name: "gqa", Description: "gqa-kv and gqa-contention", Parts: []string{"gqa-kv", "gqa-contention"}},
	{Name: "flux", Description: "1×24×4608×128, non-causal (a FLUX-style training step); fwd and bwd",
		cases: fluxCases},
	{Name: "features", Description: "B=4 H=16 N=4096 D=128 plain, dropout 0.1, softcap 30, window (256, 0), bias [1, H, N, M] " +
		"(and its gradient; a [B, H, N, M] bias's gradient too), deterministic; fwd and bwd",
		cases: func() []Case { return featureCases(Case{Batch: 4, SeqlenQ: 4096, Heads: 16, HeadDim: 128}, 256) }},
	{Name: "all", Description: "seqlen, flux, gqa, headdim and features", Parts: []string{"seqlen", "flux", "gqa", "headdim", "features"}},
	{Name: "tiny-seqlen", Description: "CPU-sized: N = 32, 64, 128 with B·N = 256, H·D = 64, D ∈ {16, 32}, causal and not; fwd and bwd",
		cases: tinySeqlenCases},
	{Name: "tiny-headdim", Description: "CPU-sized: D ∈ {8, 16, 24, 32, 48, 64} at B=1, H=2, N=64; fwd and bwd",
		cases: tinyHeaddimCases},
	{Name: "tiny-features", Description: "CPU-sized features: B=1 H=2 N=128 D=32 plain, dropout 0.1, softcap 30, " +
		"window (16, 0), bias [1, H, N, M] (and its gradient; a [B, H, N, M] bias's gradient too), deterministic; fwd and bwd",
		cases: func() []Case { return featureCases(Case{Batch: 1, SeqlenQ: 128, Heads: 2, HeadDim: 32}, 16) }},
	{Name: "tiny", Description: "tiny-seqlen and tiny-headdim", Parts: []string{"tiny-seqlen", "tiny-headdim"}},
	{Name: "cp", Description: "context parallelism on virtual ranks: the FLUX step 1×24×4608×128 (ring, a2a), " +
		"1×16×{32768, 98304}×128 causal (zigzag, a2a) over P = 2, 4, 8, and 1×16/2×32768×128 causal over 8 (zigzag, hybrid); fwd and bwd",
		cases: cpCases},
	{Name: "tiny-cp", Description: "CPU-sized context parallelism: 1×4/2×64×16, causal and not, over P = 2, 4, 8 " +
		"(ring or zigzag, hybrid; a2a at P = 2); fwd and bwd",
		cases: tinyCPCases},
}

// Presets returns every preset, sorted by name.
func Presets() []Preset {
	out := append([]Preset(nil), presets...)
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func findPreset(name string) (Preset, bool) {
	for _, p := range presets {
		if p.Name == name {
			return p, true
		}
	}
	return Preset{}, false
}

// PresetCases returns the cases of the named presets (a comma-separated
// list, composites expanded, each preset once) in dtype, normalised. An
// unknown name fails with attn.ErrOption.
func PresetCases(names, dtype string) ([]Case, error) {
	if _, err := attn.ParseDType(dtype); err != nil {
		return nil, err
	}
	var out []Case
	seen := map[string]bool{}
	var add func(name string) error
	add = func(name string) error {
		p, ok := findPreset(name)
		if !ok {
			var all []string
			for _, q := range Presets() {
				all = append(all, q.Name)
			}
			return attn.Errorf(attn.ErrOption, "preset %q is not one of %s", name, strings.Join(all, ", "))
		}
		if seen[name] {
			return nil
		}
		seen[name] = true
		for _, part := range p.Parts {
			if err := add(part); err != nil {
				return err
			}
		}
		if p.cases == nil {
			return nil
		}
		for _, c := range p.cases() {
			c.Preset = name
			c.DType = dtype
			c.Normalize()
			out = append(out, c)
		}
		return nil
	}
	for _, n := range strings.Split(names, ",") {
		if err := add(strings.TrimSpace(n)); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// both returns c as a forward and as a backward case.
func both(c Case) []Case {
	f, b := c, c
	f.Pass, b.Pass = Forward, Backward
	return []Case{f, b}
}

func seqlenCases() []Case {
	var out []Case
	for _, causal := range []bool{false, true} {
		for _, d := range []int{64, 128, 256} {
			for n := 512; n <= 16384; n *= 2 {
				out = append(out, both(Case{Batch: Tokens / n, SeqlenQ: n, Heads: Width / d, HeadDim: d, Causal: causal})...)
			}
		}
	}
	return out
}

// HeaddimSpectrum returns the head dims of the headdim preset.
func HeaddimSpectrum() []int {
	var ds []int
	for d := 4; d <= 96; d += 4 {
		ds = append(ds, d)
	}
	for d := 104; d <= 160; d += 8 {
		ds = append(ds, d)
	}
	for d := 176; d <= 256; d += 16 {
		ds = append(ds, d)
	}
	for d := 288; d <= 384; d += 32 {
		ds = append(ds, d)
	}
	return append(ds, 448, 512)
}

func headdimCases() []Case {
	var out []Case
	for _, d := range HeaddimSpectrum() {
		out = append(out, both(Case{Batch: 1, SeqlenQ: 4096, Heads: 16, HeadDim: d})...)
	}
	return out
}

func gqaKVCases() []Case {
	var out []Case
	for _, hkv := range []int{32, 8, 4, 1} {
		out = append(out, both(Case{Batch: 4, SeqlenQ: 4096, Heads: 32, KVHeads: hkv, HeadDim: 128})...)
	}
	return out
}

func contentionCases() []Case {
	var out []Case
	for _, det := range []bool{false, true} {
		for _, hkv := range []int{8, 4} {
			for n := 128; n <= 4096; n *= 2 {
				out = append(out, Case{Batch: Tokens / n, SeqlenQ: n, Heads: 8, KVHeads: hkv, HeadDim: 64,
					Deterministic: det, Pass: Backward})
			}
		}
	}
	return out
}

// featureCases returns base as it is and with each feature alone —
// dropout 0.1, softcap 30, a window of left keys, a [1, H, N, M] bias,
// deterministic — as forward and backward cases, and the bias with its
// gradient, and a [B, H, N, M] bias with its gradient, as backward cases.
// Each feature's cost is its rate against base's (Comparison.WriteMarkdown's
// feature table).
func featureCases(base Case, left int) []Case {
	variants := []Case{base, base, base, base, base, base}
	variants[1].Dropout = 0.1
	variants[2].Softcap = 30
	variants[3].Window = &Window{Left: left, Right: 0}
	variants[4].Bias = "1hnm"
	variants[5].Deterministic = true
	var out []Case
	for _, c := range variants {
		out = append(out, both(c)...)
	}
	grad := variants[4]
	grad.BiasGrad, grad.Pass = true, Backward
	every := grad // a bias of every batch element and head, whose gradient is dS itself
	every.Bias = "bhnm"
	return append(out, grad, every)
}

func fluxCases() []Case {
	return both(Case{Batch: 1, SeqlenQ: 4608, Heads: 24, HeadDim: 128})
}

func tinySeqlenCases() []Case {
	var out []Case
	for _, causal := range []bool{false, true} {
		for _, d := range []int{16, 32} {
			for n := 32; n <= 128; n *= 2 {
				out = append(out, both(Case{Batch: 256 / n, SeqlenQ: n, Heads: 64 / d, HeadDim: d, Causal: causal})...)
			}
		}
	}
	return out
}

func tinyHeaddimCases() []Case {
	var out []Case
	for _, d := range []int{8, 16, 24, 32, 48, 64} {
		out = append(out, both(Case{Batch: 1, SeqlenQ: 64, Heads: 2, HeadDim: d})...)
	}
	return out
}

// split returns c split over each of ps virtual ranks by each scheme, as a
// forward and as a backward case.
func split(c Case, ps []int, schemes ...string) []Case {
	var out []Case
	for _, p := range ps {
		for _, s := range schemes {
			c.CPRanks, c.CPScheme = p, s
			out = append(out, both(c)...)
		}
	}
	return out
}

func cpCases() []Case {
	ps := []int{2, 4, 8}
	out := split(Case{Batch: 1, SeqlenQ: 4608, Heads: 24, HeadDim: 128}, ps, "ring", "a2a")
	for _, n := range []int{32768, 98304} {
		out = append(out, split(Case{Batch: 1, SeqlenQ: n, Heads: 16, HeadDim: 128, Causal: true}, ps, "zigzag", "a2a")...)
	}
	return append(out, split(Case{Batch: 1, SeqlenQ: 32768, Heads: 16, KVHeads: 2, HeadDim: 128, Causal: true},
		[]int{8}, "zigzag", "hybrid")...)
}

func tinyCPCases() []Case {
	var out []Case
	for _, causal := range []bool{false, true} {
		c := Case{Batch: 1, SeqlenQ: 64, Heads: 4, KVHeads: 2, HeadDim: 16, Causal: causal}
		ring := "ring"
		if causal {
			ring = "zigzag"
		}
		out = append(out, split(c, []int{2, 4, 8}, ring, "hybrid")...)
		out = append(out, split(c, []int{2}, "a2a")...)
	}
	return out
}
