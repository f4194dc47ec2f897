package bench

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestNCUSourceSummary runs bench/ncu_source.py on a two-kernel source page
// and a details page in ncu's CSV form: every kernel summarized, the stall
// reasons' shares, the instructions by samples with a polling branch
// followed by the wait it polls, the opcodes, the details' headline.
func TestNCUSourceSummary(t *testing.T) {
	out := runPython(t, nil, "", "ncu_source.py", "--top", "3", "--details", filepath.Join("testdata", "ncu-details.csv"), filepath.Join("testdata", "ncu-source.csv"))
	for _, want := range []string{
		"kernel flash_fwd: Duration 1.76 ms, Issue Slots Busy 31.67 %",
		"kernel flash_fwd: 4 instructions, 100 warp samples, 8192 warp instructions executed",
		"stall reasons: long_sb 65.0 %, barrier 25.0 %, wait 10.0 %",
		"60.0 %  0x7f0000000020  @!P0  BRA 0x7f0000000010",
		"after SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R20+UR24+0x29080], R11",
		"BRA           60.0 %   25.0 %",
		"kernel fa_bwd_dkdv: 2 instructions, 4 warp samples",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("summary lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "DRAM Frequency") {
		t.Errorf("summary prints a metric outside the headline:\n%s", out)
	}
}

// TestNCUSourceScript checks bench/ncu-source.sh's syntax (bash -n).
func TestNCUSourceScript(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("bash not installed")
	}
	if out, err := exec.Command(bash, "-n", "ncu-source.sh").CombinedOutput(); err != nil {
		t.Fatalf("bash -n ncu-source.sh: %v\n%s", err, out)
	}
}
