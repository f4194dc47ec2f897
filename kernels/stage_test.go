package kernels

import (
	"encoding/binary"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// TestStagedDims checks the staging row lengths: whole 32-byte sectors for
// the copies, while the need for a copy is still decided by 16-byte rows.
func TestStagedDims(t *testing.T) {
	tests := []struct {
		dt         attn.DType
		d          int
		fwd, bwd   int
		needsStage bool
	}{
		{attn.BFloat16, 1, 16, 16, true},
		{attn.BFloat16, 59, 64, 64, true},
		{attn.Float16, 127, 128, 128, true},
		{attn.BFloat16, 199, 208, 208, true},
		{attn.BFloat16, 200, 208, 208, false}, // 400-byte rows: 16-byte copies as they are
		{attn.BFloat16, 257, 272, 272, true},
		{attn.BFloat16, 512, 512, 512, false},
		{attn.Float32, 59, 64, 64, true}, // fp32: 32 bytes are 8 elements
		{attn.Float32, 60, 64, 64, false},
		{attn.Float32, 62, 64, 64, true},
	}
	for _, tt := range tests {
		if tt.dt != attn.Float32 {
			if got := StagedDim(tt.d); got != tt.fwd {
				t.Errorf("StagedDim(%d) = %d, want %d", tt.d, got, tt.fwd)
			}
		}
		if got := BwdStagedDim(tt.dt, tt.d); got != tt.bwd {
			t.Errorf("BwdStagedDim(%v, %d) = %d, want %d", tt.dt, tt.d, got, tt.bwd)
		}
		if got := BwdNeedsStaging(tt.dt, tt.d, tt.d); got != tt.needsStage {
			t.Errorf("BwdNeedsStaging(%v, %d) = %v, want %v", tt.dt, tt.d, got, tt.needsStage)
		}
	}
}

// TestCompilePack compiles the forward's pack kernel with NVRTC for sm_90
// and checks that ptxas reports neither stack nor spills.
func TestCompilePack(t *testing.T) {
	c := compilerOrSkip(t)
	out, err := c.Compile(cuda.CompileRequest{Name: PackKernel + ".cu", Source: PackSource, Arch: "sm_90", Verbose: true, NoCache: true})
	if err != nil {
		t.Fatalf("%s: %v", PackKernel, err)
	}
	if len(out.Stats.Resources) == 0 {
		t.Fatalf("%s: no resource report from ptxas", PackKernel)
	}
	for _, r := range out.Stats.Resources {
		t.Logf("%s: %d registers, %d B stack, spills %d/%d", r.Name, r.Registers, r.StackBytes, r.SpillStores, r.SpillLoads)
		if r.StackBytes > 0 || r.SpillStores > 0 {
			t.Errorf("%s: %d B stack, %d B spill stores", r.Name, r.StackBytes, r.SpillStores)
		}
	}
}

// TestPackLaunch checks the one launch that packs q, k and v: the grid
// covers the largest tensor in x and y with one z slice per tensor, and the
// argument holds the three PackParams in order, in the C layout (an empty
// slot all zero).
func TestPackLaunch(t *testing.T) {
	ps := []PackParams{
		{Src: 0x1000, Dst: 0x9000, Lim: 0x1800, BatchStride: 300 * 8 * 59, RowStride: 8 * 59, HeadStride: 59, Rows: 300, Heads: 8, D: 59, DS: 64},
		{Src: 0x2000, Dst: 0xa000, Lim: 0x2800, BatchStride: 200 * 2 * 59, RowStride: 2 * 59, HeadStride: 59, Rows: 200, Heads: 2, D: 59, DS: 64},
		{},
	}
	grids := [][3]uint32{PackGrid(300, 8, 2), PackGrid(200, 2, 2), {}}
	g, args := PackLaunch(ps, grids)
	if want := [3]uint32{(300*8 + PackRowsPerBlock - 1) / PackRowsPerBlock, 2, 3}; g != want {
		t.Errorf("grid %v, want %v", g, want)
	}
	if len(args) != 3*packParamsStruct.Size() {
		t.Fatalf("argument of %d bytes, want %d", len(args), 3*packParamsStruct.Size())
	}
	le := binary.LittleEndian
	for i, p := range ps {
		b := args[i*packParamsStruct.Size() : (i+1)*packParamsStruct.Size()]
		if le.Uint64(b[0:]) != p.Src || le.Uint64(b[8:]) != p.Dst || le.Uint64(b[16:]) != p.Lim ||
			int64(le.Uint64(b[32:])) != p.RowStride || int32(le.Uint32(b[48:])) != p.Rows || int32(le.Uint32(b[60:])) != p.DS {
			t.Errorf("slot %d: % x does not hold %+v", i, b, p)
		}
	}
	if !strings.Contains(PackSource, "struct PackArgs { PackParams t[3]; };") || !strings.Contains(PackSource, "const unsigned char* lim;") {
		t.Errorf("PackSource's argument struct differs from the packing")
	}
}
