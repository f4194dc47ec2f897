package gpu

import (
	"fmt"
	"slices"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// tensorMapCache keeps the tensor maps of the last TMA launch. Each encode
// is a driver call on the executor thread, three or four per launch, while
// a training loop or a benchmark launches on the same buffers again and
// again; a map depends on nothing but its TMATensor.
type tensorMapCache struct {
	key  []kernels.TMATensor
	maps [][128]byte // as kernels.PackTMA and BwdTMAArgs take them
}

// get returns the maps of the tensors described by key (names: theirs, for
// errors), encoding them with encode unless they are the last ones encoded.
func (c *tensorMapCache) get(key []kernels.TMATensor, names []string, encode func(kernels.TMATensor) (cuda.TensorMap, error)) ([][128]byte, error) {
	if c.maps != nil && slices.Equal(c.key, key) {
		return c.maps, nil
	}
	maps := make([][128]byte, len(key))
	for i, t := range key {
		m, err := encode(t)
		if err != nil {
			return nil, fmt.Errorf("tensor map of %s: %w", names[i], err)
		}
		maps[i] = m
	}
	c.key, c.maps = slices.Clone(key), maps
	return maps, nil
}

// tensorMapSpec is the tensor map of one TMA tensor: boxes of 64 columns
// (one 128-byte swizzle atom) by BoxRows positions of one head and batch
// element, stored with the 128-byte swizzle.
func tensorMapSpec(t kernels.TMATensor) cuda.TensorMapSpec {
	s := cuda.TensorMapSpec{
		Addr:       t.Addr,
		Dims:       []uint64{t.Cols, t.Rows, t.Heads, t.B},
		Strides:    t.Strides[:],
		Box:        []uint32{64, t.BoxRows, 1, 1},
		Swizzle128: true,
	}
	if t.AddsIn {
		s.Elem = cuda.TensorMapBFloat16
		if t.DType == attn.Float16 {
			s.Elem = cuda.TensorMapFloat16
		}
	}
	return s
}

// fwdTMANames names the forward's tensor maps in errors, in the order of
// the kernel's argument (kernels.Variant.TMAMapNames).
func fwdTMANames(v kernels.Variant) []string { return v.TMAMapNames() }

// bwdTMANames names the tensors of bwdPlan.tma in errors.
var bwdTMANames = []string{"q", "dO", "k", "v", "bias", "dbias"}
