package gpu

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestFillArgs checks the fill kernel's argument against the layout of its
// C struct written out by hand.
func TestFillArgs(t *testing.T) {
	a := fillArgs{p: 0x1122334455667788, n: 1 << 40, seed: 7, dtype: attn.BFloat16}
	want := make([]byte, 32)
	binary.LittleEndian.PutUint64(want[0:], a.p)
	binary.LittleEndian.PutUint64(want[8:], a.n)
	binary.LittleEndian.PutUint64(want[16:], a.seed)
	binary.LittleEndian.PutUint32(want[24:], uint32(attn.BFloat16))
	if got := fillArgsStruct.Pack(&a); !bytes.Equal(got, want) {
		t.Errorf("argument % x, want % x", got, want)
	}
	if decl := "struct FillArgs { u64 p; u64 n; u64 seed; int dtype; int pad; };"; !strings.Contains(fillSource, decl) {
		t.Errorf("fill source lacks %q", decl)
	}
}
