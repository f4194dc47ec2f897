package kernels

import (
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestPackTMA checks the layout of the TMA kernel's argument: the tensor
// maps at 0, 128, 256 (and with FlatStaged's copies 384, 512, 640), then
// Params, the whole a multiple of 64.
func TestPackTMA(t *testing.T) {
	for _, v := range []Variant{{}, {Flat: true, FlatStaged: true}} {
		n, size := v.TMAMaps(), v.TMAParamsSize()
		if size%64 != 0 || size < 128*n+ParamsSize {
			t.Fatalf("%d maps: TMAParamsSize %d", n, size)
		}
		maps := make([][128]byte, n)
		for i := range maps {
			for j := range maps[i] {
				maps[i][j] = byte(i + 1)
			}
		}
		p := Params{Q: 0x1111, K: 0x2222, N: 77}
		b := make([]byte, size)
		for i := range b {
			b[i] = 0xff
		}
		v.PackTMA(b, &p, maps...)
		for i := 0; i < n; i++ {
			if b[128*i] != byte(i+1) || b[128*i+127] != byte(i+1) {
				t.Errorf("%d maps: map %d misplaced: % x", n, i, b[128*i:128*i+8])
			}
		}
		at := 128 * n
		if got := binary.LittleEndian.Uint64(b[at:]); got != p.Q {
			t.Errorf("%d maps: params.q at %d = %#x, want %#x", n, at, got, p.Q)
		}
		if string(b[at:at+ParamsSize]) != string(p.Pack()) {
			t.Errorf("%d maps: params bytes differ from Params.Pack", n)
		}
		for i := at + ParamsSize; i < size; i++ {
			if b[i] != 0 {
				t.Fatalf("%d maps: padding byte %d = %#x, want 0", n, i, b[i])
			}
		}
	}
	if want := 3*128 + roundUp(ParamsSize, 64); (Variant{}).TMAParamsSize() != want {
		t.Errorf("a three-map variant's argument: %d bytes, want %d", (Variant{}).TMAParamsSize(), want)
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
	// a packed batch: boxes from the sequence's first row (qs, ks) of batch element 0
	v := hopperVariant(t, attn.BFloat16, 128, 128, func(v *Variant) { v.Varlen = true })
	v.TMA = true
	src, err := v.Source()
	if err != nil {
		t.Fatalf("varlen: %v", err)
	}
	for _, want := range []string{"const int qrow_ = (int)qs, krow_ = (int)ks;", "(sQ, mq_, barQ, qrow_ + m0, hq_, 0, cq_);", "mk_, barK, krow_ + (nb_hi - 1) * BN, hk_, 0, ck_);"} {
		if !strings.Contains(src, want) {
			t.Errorf("varlen: source lacks %q", want)
		}
	}
	refused := []struct {
		name string
		edit func(*Variant)
	}{
		{"mma.sync kernel", func(v *Variant) { v.WGMMA = false }},
		{"persistent packed batch", func(v *Variant) { v.Varlen, v.WarpSpecialized, v.Persistent = true, true, true }},
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
