package gpu

import (
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// TestTMAStrides checks which q/k/v layouts the tensor memory accelerator
// takes and the byte strides (position, head, batch) their maps get.
func TestTMAStrides(t *testing.T) {
	cases := []struct {
		name    string
		shape   []int
		strides []int
		want    [3]uint64
		ok      bool
	}{
		{"contiguous", []int{2, 100, 8, 64}, nil, [3]uint64{8 * 64 * 2, 64 * 2, 100 * 8 * 64 * 2}, true},
		{"batch of one", []int{1, 100, 8, 64}, []int{0, 512, 64, 1}, [3]uint64{1024, 128, 16}, true},
		{"head-major", []int{2, 100, 8, 64}, []int{8 * 100 * 64, 64, 100 * 64, 1}, [3]uint64{128, 100 * 128, 8 * 100 * 128}, true},
		{"rows of 4-byte multiples", []int{2, 100, 8, 60}, nil, [3]uint64{}, false},
		{"padded rows", []int{2, 100, 8, 60}, []int{100 * 8 * 64, 8 * 64, 64, 1}, [3]uint64{1024, 128, 100 * 1024}, true},
		{"zero stride of a long dim", []int{2, 100, 8, 64}, []int{0, 512, 64, 1}, [3]uint64{}, false},
	}
	for _, c := range cases {
		tn := DeviceTensor{DType: attn.BFloat16, Shape: c.shape, Strides: c.strides}
		got, ok := tmaStrides(tn)
		if ok != c.ok || ok && got != c.want {
			t.Errorf("%s: tmaStrides = %v, %v; want %v, %v", c.name, got, ok, c.want, c.ok)
		}
	}
}
