package cuda

import (
	"regexp"
	"strconv"
)

// KernelResources is ptxas's resource report for one kernel, parsed from a
// compile log produced with CompileRequest.Verbose.
type KernelResources struct {
	Name        string // the (mangled) kernel name
	Arch        string // the architecture ptxas compiled for, such as "sm_90a"
	Registers   int    // registers per thread
	SharedBytes int    // static shared memory per block
	StackBytes  int    // stack frame per thread
	SpillStores int    // bytes of spill stores per thread
	SpillLoads  int    // bytes of spill loads per thread
}

var (
	reEntry = regexp.MustCompile(`Compiling entry function '([^']+)' for '([^']+)'`)
	reProps = regexp.MustCompile(`Function properties for (\S+)`)
	reFrame = regexp.MustCompile(`(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads`)
	reUsed  = regexp.MustCompile(`Used (\d+) registers`)
	reSmem  = regexp.MustCompile(`(\d+) bytes smem`)
)

// ParseResources extracts ptxas's per-kernel resource report from an NVRTC
// log compiled with --ptxas-options=-v. It returns nil when the log holds
// no report.
func ParseResources(log string) []KernelResources {
	var out []KernelResources
	index := map[string]int{}
	cur := -1 // the kernel the next "Used" line belongs to
	props := -1
	for _, line := range splitLines(log) {
		if m := reEntry.FindStringSubmatch(line); m != nil {
			out = append(out, KernelResources{Name: m[1], Arch: m[2]})
			cur = len(out) - 1
			index[m[1]] = cur
			continue
		}
		if m := reProps.FindStringSubmatch(line); m != nil {
			props = -1
			if i, ok := index[m[1]]; ok {
				props = i
			}
			continue
		}
		if m := reFrame.FindStringSubmatch(line); m != nil && props >= 0 {
			out[props].StackBytes = atoi(m[1])
			out[props].SpillStores = atoi(m[2])
			out[props].SpillLoads = atoi(m[3])
			props = -1
			continue
		}
		if m := reUsed.FindStringSubmatch(line); m != nil && cur >= 0 {
			out[cur].Registers = atoi(m[1])
			if s := reSmem.FindStringSubmatch(line); s != nil {
				out[cur].SharedBytes = atoi(s[1])
			}
			cur = -1
		}
	}
	return out
}

// splitLines splits s at newlines.
func splitLines(s string) []string {
	var lines []string
	start := 0
	for i := 0; i < len(s); i++ {
		if s[i] == '\n' {
			lines = append(lines, s[start:i])
			start = i + 1
		}
	}
	if start < len(s) {
		lines = append(lines, s[start:])
	}
	return lines
}

// atoi parses a decimal that the regular expressions already matched.
func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}
