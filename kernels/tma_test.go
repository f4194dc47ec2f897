package kernels

import (
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestPackTMA checks the layout of the TMA kernel's argument: the three
// tensor maps at 0, 128 and 256, then Params, the whole a multiple of 64.
func TestPackTMA(t *testing.T) {
	if TMAParamsSize%64 != 0 || TMAParamsSize < 384+ParamsSize {
		t.Fatalf("TMAParamsSize %d", TMAParamsSize)
	}
	var q, k, v [128]byte
	for i := range q {
		q[i], k[i], v[i] = 1, 2, 3
	}
	p := Params{Q: 0x1111, K: 0x2222, N: 77}
	b := make([]byte, TMAParamsSize)
	for i := range b {
		b[i] = 0xff
	}
	PackTMA(b, q, k, v, &p)
	if b[0] != 1 || b[127] != 1 || b[128] != 2 || b[255] != 2 || b[256] != 3 || b[383] != 3 {
		t.Errorf("tensor maps misplaced: % x", b[:8])
	}
	if got := binary.LittleEndian.Uint64(b[384:]); got != p.Q {
		t.Errorf("params.q at 384 = %#x, want %#x", got, p.Q)
	}
	want := p.Pack()
	if string(b[384:384+ParamsSize]) != string(want) {
		t.Errorf("params bytes differ from Params.Pack")
	}
	for i := 384 + ParamsSize; i < TMAParamsSize; i++ {
		if b[i] != 0 {
			t.Fatalf("padding byte %d = %#x, want 0", i, b[i])
		}
	}
}

// TestTMASource checks what a TMA variant's source holds and which
// variants refuse the flag.
func TestTMASource(t *testing.T) {
	for _, d := range [][2]int{{64, 64}, {208, 208}, {512, 512}} {
		v := hopperVariant(t, attn.BFloat16, d[0], d[1], nil)
		v.TMA = true
		src, err := v.Source()
		if err != nil {
			t.Fatalf("%v: %v", v, err)
		}
		for _, want := range []string{"__grid_constant__ TmaParams tp", "cp.async.bulk.tensor.4d", "mbarrier.try_wait.parity",
			"tma_tile<BN, VATOMS>", "static_assert(sizeof(TmaParams) =="} {
			if !strings.Contains(src, want) {
				t.Errorf("%v: source lacks %q", v, want)
			}
		}
		if strings.Contains(src, "load_sw<BN, KCH>(") {
			t.Errorf("%v: TMA source still copies K with cp.async", v)
		}
		if !strings.HasSuffix(v.Name(), "_tma") {
			t.Errorf("name %s lacks _tma", v.Name())
		}
		v.TMA = false
		if strings.HasSuffix(v.Name(), "_tma") {
			t.Errorf("name %s has _tma", v.Name())
		}
	}
	refused := []struct {
		name string
		edit func(*Variant)
	}{
		{"varlen", func(v *Variant) { v.Varlen = true }},
		{"mma.sync kernel", func(v *Variant) { v.WGMMA = false }},
	}
	for _, c := range refused {
		v := hopperVariant(t, attn.BFloat16, 128, 128, nil)
		v.TMA = true
		c.edit(&v)
		if err := v.Validate(); !errors.Is(err, attn.ErrUnsupported) {
			t.Errorf("%s: Validate = %v, want ErrUnsupported", c.name, err)
		}
	}
}

// TestTMATensors checks the extents and boxes of the three tensor maps:
// q by BlockM rows and every query head, k and v by BlockN rows and the key
// heads, each with its own strides and stored width.
func TestTMATensors(t *testing.T) {
	v := hopperVariant(t, attn.BFloat16, 208, 96, nil)
	p := Params{Q: 0x1000, K: 0x2000, V: 0x3000, B: 3, H: 8, Group: 2, N: 100, M: 90}
	qs, ks, vs := [3]uint64{4096, 512, 409600}, [3]uint64{2048, 512, 184320}, [3]uint64{1024, 256, 92160}
	got := v.TMATensors(&p, 208, 96, qs, ks, vs)
	want := [3]TMATensor{
		{Addr: 0x1000, Cols: 208, Rows: 100, Heads: 8, B: 3, Strides: qs, BoxRows: uint32(v.BlockM)},
		{Addr: 0x2000, Cols: 208, Rows: 90, Heads: 4, B: 3, Strides: ks, BoxRows: uint32(v.BlockN)},
		{Addr: 0x3000, Cols: 96, Rows: 90, Heads: 4, B: 3, Strides: vs, BoxRows: uint32(v.BlockN)},
	}
	for i, name := range []string{"q", "k", "v"} {
		if got[i] != want[i] {
			t.Errorf("%s: got %+v, want %+v", name, got[i], want[i])
		}
	}
}
