// Package philox implements the Philox4x32-10 counter-based random number
// generator (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011) and the dropout keep-mask mapping every flashattn backend shares.
//
// The mapping is fixed and documented here, because the GPU kernels must
// reproduce it bit for bit and the backward pass regenerates it:
//
//	key     = (lo32(seed), hi32(seed))
//	counter = (uint32(j >> 2), uint32(i), uint32(b*H + h), offset)
//	r       = Philox4x32-10(counter, key)[j & 3]
//	keep(b, h, i, j) = r < Threshold(p)
//
// where b is the batch index (the segment index of a packed variable-length
// batch), h the query head, H the number of query heads, i the query position
// and j the key position (both counted from the start of the sequence or
// segment). One Philox call therefore serves four neighbouring keys of a row.
// A kept probability is scaled by 1/(1-p).
package philox

import "math"

// Philox4x32-10 round and key-schedule constants.
const (
	mul0  = 0xD2511F53
	mul1  = 0xCD9E8D57
	weyl0 = 0x9E3779B9
	weyl1 = 0xBB67AE85
)

// Block returns the four 32-bit words Philox4x32-10 produces for counter c
// under key k.
func Block(c [4]uint32, k [2]uint32) [4]uint32 {
	for round := 0; round < 10; round++ {
		p0 := uint64(mul0) * uint64(c[0])
		p1 := uint64(mul1) * uint64(c[2])
		hi0, lo0 := uint32(p0>>32), uint32(p0)
		hi1, lo1 := uint32(p1>>32), uint32(p1)
		c = [4]uint32{hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0}
		k[0] += weyl0
		k[1] += weyl1
	}
	return c
}

// Threshold returns the 32-bit threshold below which a random word keeps an
// element under dropout probability p: floor((1-p)·2^32), clamped to
// 2^32-1. p must be in [0, 1); Threshold(0) is 2^32-1 (callers skip dropout
// entirely when p is 0).
func Threshold(p float64) uint32 {
	t := math.Floor((1 - p) * 4294967296.0)
	if t >= 4294967295.0 {
		return math.MaxUint32
	}
	if t < 0 {
		return 0
	}
	return uint32(t)
}

// Mask generates dropout keep decisions for one (batch, head) pair.
type Mask struct {
	key       [2]uint32
	bh        uint32
	offset    uint32
	threshold uint32
}

// NewMask returns the keep-mask generator for batch (or segment) b and query
// head h of a problem with heads query heads.
func NewMask(seed uint64, offset uint32, p float64, b, h, heads int) Mask {
	return Mask{
		key:       [2]uint32{uint32(seed), uint32(seed >> 32)},
		bh:        uint32(b*heads + h),
		offset:    offset,
		threshold: Threshold(p),
	}
}

// Words returns the four random words that serve keys 4·(j/4) … 4·(j/4)+3 of
// query row i.
func (m Mask) Words(i, j int) [4]uint32 {
	return Block([4]uint32{uint32(j >> 2), uint32(i), m.bh, m.offset}, m.key)
}

// Keep reports whether element (i, j) of this (batch, head) is kept.
func (m Mask) Keep(i, j int) bool {
	return m.Words(i, j)[j&3] < m.threshold
}

// KeepRow fills keep[j-j0] for keys j0 … j0+len(keep)-1 of query row i,
// calling the generator once per group of four keys.
func (m Mask) KeepRow(i, j0 int, keep []bool) {
	j := j0
	end := j0 + len(keep)
	for j < end {
		w := m.Words(i, j)
		for ; j < end; j++ {
			keep[j-j0] = w[j&3] < m.threshold
			if j&3 == 3 {
				j++
				break
			}
		}
	}
}
