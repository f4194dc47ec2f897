package kernels

import (
	"errors"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// TestMergeLaunch checks the merge kernels' geometry: the least power of
// two of threads covering a row's chunks, the rows a block holds, and the
// blocks covering every row.
func TestMergeLaunch(t *testing.T) {
	tests := []struct {
		batch, rows, heads, d int
		blocks                int64
		shift                 int32
	}{
		{1, 100352, 16, 128, 100352 * 16 / 16, 4}, // 16 chunks: 16 threads a row, 16 rows a block
		{2, 37, 3, 59, (2*37*3 + 31) / 32, 3},     // 8 chunks, the last of 3 elements
		{1, 5, 1, 8, 1, 0},                        // one chunk: 256 rows a block
		{1, 5, 1, 3, 1, 0},
		{1, 9, 2, 512, (9*2 + 3) / 4, 6}, // 64 chunks: 4 rows a block
		{1, 0, 8, 128, 0, 4},             // nothing to launch
		{3, 10, 4, MergeMaxD, 120, 8},    // one row a block
	}
	for _, tt := range tests {
		blocks, shift := MergeLaunch(tt.batch, tt.rows, tt.heads, tt.d)
		if blocks != tt.blocks || shift != tt.shift {
			t.Errorf("MergeLaunch(%d, %d, %d, %d) = %d blocks, shift %d; want %d, %d", tt.batch, tt.rows, tt.heads, tt.d, blocks, shift, tt.blocks, tt.shift)
		}
	}
}

// TestMergeSource checks that each element type's module holds the five
// kernels and its parameter struct of the Go packing's size, and that
// other types are refused with attn.ErrDType.
func TestMergeSource(t *testing.T) {
	for _, dt := range []attn.DType{attn.Float32, attn.Float16, attn.BFloat16} {
		src, err := MergeSource(dt)
		if err != nil {
			t.Fatalf("%v: %v", dt, err)
		}
		for _, want := range append(MergeKernels, mergeParamsStruct.SizeAssert(), "typedef "+bwdCType(dt)+" T;", PrimitivesBegin) {
			if !strings.Contains(src, want) {
				t.Errorf("%v: source lacks %q", dt, want)
			}
		}
	}
	if _, err := MergeSource(attn.DType(17)); !errors.Is(err, attn.ErrDType) {
		t.Errorf("dtype 17: %v, want ErrDType", err)
	}
	if n := len(MergeParams{}.Pack()); n != mergeParamsStruct.Size() || n != 240 {
		t.Errorf("MergeParams packs into %d bytes, want %d (240)", n, mergeParamsStruct.Size())
	}
}

// TestCompileMerge compiles the merge modules with NVRTC for sm_90 and
// checks that ptxas reports neither stack nor spills.
func TestCompileMerge(t *testing.T) {
	c := compilerOrSkip(t)
	for _, dt := range []attn.DType{attn.Float32, attn.Float16, attn.BFloat16} {
		src, err := MergeSource(dt)
		if err != nil {
			t.Fatal(err)
		}
		out, err := c.Compile(cuda.CompileRequest{Name: "fa_cp_merge.cu", Source: src, Arch: "sm_90", Verbose: true, NoCache: true})
		if err != nil {
			t.Fatalf("%v: %v", dt, err)
		}
		if len(out.Stats.Resources) != len(MergeKernels) {
			t.Errorf("%v: ptxas reported %d kernels, want %d", dt, len(out.Stats.Resources), len(MergeKernels))
		}
		for _, r := range out.Stats.Resources {
			t.Logf("%v %s: %d registers, %d B stack, spills %d/%d", dt, r.Name, r.Registers, r.StackBytes, r.SpillStores, r.SpillLoads)
			if r.StackBytes > 0 || r.SpillStores > 0 {
				t.Errorf("%v %s: %d B stack, %d B spill stores", dt, r.Name, r.StackBytes, r.SpillStores)
			}
		}
	}
}
