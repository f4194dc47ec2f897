package kernels

import (
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
