package bench

import (
	"errors"
	"reflect"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

func TestPresetCounts(t *testing.T) {
	for _, tc := range []struct {
		name string
		want int
	}{
		{"seqlen", 6 * 3 * 2 * 2},
		{"headdim", 44 * 2},
		{"gqa-kv", 4 * 2},
		{"gqa-contention", 6 * 2 * 2},
		{"gqa", 8 + 24},
		{"flux", 2},
		{"all", 72 + 2 + 32 + 88 + 14},
		{"tiny-seqlen", 3 * 2 * 2 * 2},
		{"tiny-headdim", 6 * 2},
		{"tiny", 24 + 12},
		{"tiny,tiny-seqlen", 36},
		{"flux, seqlen", 74},
		{"cp", 3*2*2 + 2*3*2*2 + 2*2},
		{"tiny-cp", 2 * (3*2*2 + 2)},
		{"features", 6*2 + 2},
		{"tiny-features", 6*2 + 2},
	} {
		cs, err := PresetCases(tc.name, "bf16")
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if len(cs) != tc.want {
			t.Errorf("%s: %d cases, want %d", tc.name, len(cs), tc.want)
		}
		for _, c := range cs {
			if err := c.Validate(); err != nil {
				t.Errorf("%s: %v: %v", tc.name, c, err)
			}
		}
	}
}

func TestPresetShapes(t *testing.T) {
	cs, err := PresetCases("seqlen", "bf16")
	if err != nil {
		t.Fatal(err)
	}
	ns := map[int]bool{}
	for _, c := range cs {
		if c.Batch*c.SeqlenQ != Tokens || c.Heads*c.HeadDim != Width || c.SeqlenK != c.SeqlenQ || c.Preset != "seqlen" {
			t.Errorf("seqlen case %v breaks B·N = %d, H·D = %d", c, Tokens, Width)
		}
		ns[c.SeqlenQ] = true
	}
	if !reflect.DeepEqual(ns, map[int]bool{512: true, 1024: true, 2048: true, 4096: true, 8192: true, 16384: true}) {
		t.Errorf("seqlen Ns = %v", ns)
	}
	want := []int{4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 96,
		104, 112, 120, 128, 136, 144, 152, 160, 176, 192, 208, 224, 240, 256, 288, 320, 352, 384, 448, 512}
	if got := HeaddimSpectrum(); !reflect.DeepEqual(got, want) {
		t.Errorf("HeaddimSpectrum() = %v, want %v", got, want)
	}
	flux, _ := PresetCases("flux", "fp16")
	if c := flux[0]; c.Batch != 1 || c.Heads != 24 || c.SeqlenQ != 4608 || c.HeadDim != 128 || c.Causal || c.DType != "fp16" {
		t.Errorf("flux case %v", c)
	}
	cont, _ := PresetCases("gqa-contention", "bf16")
	for _, c := range cont {
		if c.Heads != 8 || (c.KVHeads != 8 && c.KVHeads != 4) || c.HeadDim != 64 || c.Pass != Backward || c.Batch*c.SeqlenQ != Tokens {
			t.Errorf("contention case %v", c)
		}
	}
}

func TestPresetErrors(t *testing.T) {
	if _, err := PresetCases("nope", "bf16"); !errors.Is(err, attn.ErrOption) {
		t.Errorf("unknown preset: %v, want ErrOption", err)
	}
	if _, err := PresetCases("tiny", "fp64"); !errors.Is(err, attn.ErrDType) {
		t.Errorf("bad dtype: %v, want ErrDType", err)
	}
}
