package cuda

import (
	"reflect"
	"testing"
)

func TestParseResources(t *testing.T) {
	tests := []struct {
		name string
		log  string
		want []KernelResources
	}{
		{
			name: "one kernel",
			log: "ptxas info    : 0 bytes gmem\n" +
				"ptxas info    : Compiling entry function 'k' for 'sm_80'\n" +
				"ptxas info    : Function properties for k\n" +
				"ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n" +
				"ptxas info    : Used 9 registers, 1024 bytes smem, 376 bytes cmem[0]\n",
			want: []KernelResources{{Name: "k", Arch: "sm_80", Registers: 9, SharedBytes: 1024}},
		},
		{
			name: "two kernels with spills and a device function",
			log: "ptxas info    : Compiling entry function '_Z3fwdv' for 'sm_90a'\n" +
				"ptxas info    : Function properties for _Z3fwdv\n" +
				"    152 bytes stack frame, 148 bytes spill stores, 140 bytes spill loads\n" +
				"ptxas info    : Used 255 registers, 380 bytes cmem[0]\n" +
				"ptxas info    : Function properties for _Z6helperv\n" +
				"    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n" +
				"ptxas info    : Compiling entry function 'bwd' for 'sm_90a'\n" +
				"ptxas info    : Function properties for bwd\n" +
				"    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n" +
				"ptxas info    : Used 128 registers, 49152 bytes smem, 380 bytes cmem[0]",
			want: []KernelResources{
				{Name: "_Z3fwdv", Arch: "sm_90a", Registers: 255, StackBytes: 152, SpillStores: 148, SpillLoads: 140},
				{Name: "bwd", Arch: "sm_90a", Registers: 128, SharedBytes: 49152},
			},
		},
		{name: "no report", log: "warning: something\n", want: nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := ParseResources(tt.log); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("ParseResources = %+v, want %+v", got, tt.want)
			}
		})
	}
}
