// Package philox implements the Philox4x32-10 counter-based random number
// generator (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011) and the dropout keep mask that every flashattn backend draws from
// it.
//
// # The mapping
//
// This comment is the mapping's one definition: the CPU backend, its
// float64 reference and every GPU kernel reproduce it bit for bit, and the
// backward regenerates it. Element (b, h, i, j) of an attention call, with b
// the batch index (the segment index of a packed variable-length batch), h
// the query head of H, i the query position and j the key position (both
// counted from the start of the sequence or segment), draws the 8-bit number
//
//	key     = (lo32(seed), hi32(seed))
//	counter = (uint32(j >> 4), uint32(i), uint32(b·H + h), offset)
//	r       = Philox4x32-10(counter, key)             four 32-bit words r[0..3]
//	u       = (r[(j >> 2) & 3] >> (8·(j & 3))) & 0xFF
//
// that is, byte j & 15 of the sixteen bytes of r read little-endian, so that
// one Philox call serves the sixteen consecutive keys 16k … 16k+15 of a row.
// Under dropout probability p the element is kept when
//
//	u < T,   T = ⌊256·(1 − p) + ½⌋   (Threshold; 1 − p and the product in float64)
//
// and a kept probability is multiplied by 256/T (Scale).
//
// # Resolution of p
//
// T is the number of the 256 values of u that keep an element, so the mask
// resolves p in steps of 1/256: the probability actually drawn is
// p′ = 1 − T/256, the multiple of 1/256 nearest p (p = 0.1 runs as
// 26/256 = 0.1015625, p = 0.5 exactly). The scale 256/T equals 1/(1 − p′),
// which keeps the expectation of a kept-and-scaled probability equal to the
// probability for the p′ drawn; 1/(1 − p) would scale it by
// (1 − p′)/(1 − p) on average (0.17 % low at p = 0.1). A p in (0, 1) that
// would round to T = 256 (p ≤ 1/512: nothing dropped) or T = 0
// (p > 1 − 1/512: everything dropped) is refused with ErrResolution, never
// run as another p; attn.NewProblem wraps that in attn.ErrOption. p = 0 is
// T = 256, no dropout.
package philox

import (
	"errors"
	"fmt"
	"math"
)

// Philox4x32-10 round and key-schedule constants.
const (
	mul0  = 0xD2511F53
	mul1  = 0xCD9E8D57
	weyl0 = 0x9E3779B9
	weyl1 = 0xBB67AE85
)

// Levels is the number of values of an element's 8-bit number u: the
// dropout probability is resolved in steps of 1/Levels.
const Levels = 256

// ErrResolution reports a dropout probability in (0, 1) that the mask
// cannot represent at its resolution of 1/Levels (it would keep or drop
// every element), or one outside [0, 1).
var ErrResolution = errors.New("philox: dropout probability not representable")

// Block returns the four 32-bit words Philox4x32-10 produces for counter c
// under key k.
func Block(c [4]uint32, k [2]uint32) [4]uint32 {
	c0, c1, c2, c3 := c[0], c[1], c[2], c[3]
	k0, k1 := k[0], k[1]
	for range 10 {
		c0, c1, c2, c3 = round(c0, c1, c2, c3, k0, k1)
		k0, k1 = k0+weyl0, k1+weyl1
	}
	return [4]uint32{c0, c1, c2, c3}
}

// round is one Philox4x32 round of counter (c0, c1, c2, c3) under the
// round's key (k0, k1).
func round(c0, c1, c2, c3, k0, k1 uint32) (uint32, uint32, uint32, uint32) {
	p0, p1 := uint64(mul0)*uint64(c0), uint64(mul1)*uint64(c2)
	return uint32(p1>>32) ^ c1 ^ k0, uint32(p1), uint32(p0>>32) ^ c3 ^ k1, uint32(p0)
}

// block2 is Block for two counters that differ only in their first word
// (two consecutive groups of keys of one row), the rounds of both
// interleaved so that their multiplications overlap.
func block2(c0a, c0b, c1, c2, c3 uint32, k [2]uint32) (a, b [4]uint32) {
	a0, a1, a2, a3 := c0a, c1, c2, c3
	b0, b1, b2, b3 := c0b, c1, c2, c3
	k0, k1 := k[0], k[1]
	for range 10 {
		a0, a1, a2, a3 = round(a0, a1, a2, a3, k0, k1)
		b0, b1, b2, b3 = round(b0, b1, b2, b3, k0, k1)
		k0, k1 = k0+weyl0, k1+weyl1
	}
	return [4]uint32{a0, a1, a2, a3}, [4]uint32{b0, b1, b2, b3}
}

// Threshold returns T = ⌊256·(1 − p) + ½⌋, the number of the 256 values of
// an element's 8-bit number that keep it under dropout probability p: 256
// for p = 0, 1 … 255 for 1/512 < p ≤ 1 − 1/512. Any other p (in (0, 1) but
// outside that range, negative, 1 or more, NaN) returns an error wrapping
// ErrResolution that names the resolution.
func Threshold(p float64) (uint32, error) {
	if !(p >= 0 && p < 1) {
		return 0, fmt.Errorf("%w: dropout %v outside [0, 1)", ErrResolution, p)
	}
	t := math.Floor(Levels*(1-p) + 0.5)
	if p > 0 && (t <= 0 || t >= Levels) {
		return 0, fmt.Errorf("%w: dropout %v rounds to %v/256 at the mask's resolution of 1/256 (it would keep or drop every element); want 0 or 1/512 < p ≤ 1 − 1/512", ErrResolution, p, Levels-t)
	}
	return uint32(t), nil
}

// Scale returns the factor of a kept probability under threshold t:
// 256/t, that is 1/(1 − p′) for the probability p′ = 1 − t/256 the mask
// draws. It returns 0 for t = 0.
func Scale(t uint32) float64 {
	if t == 0 {
		return 0
	}
	return Levels / float64(t)
}

// Mask generates dropout keep decisions for one (batch, head) pair.
type Mask struct {
	key       [2]uint32
	bh        uint32
	offset    uint32
	threshold uint32
}

// NewMask returns the keep-mask generator for batch (or segment) b and query
// head h of a problem with heads query heads, under threshold t (from
// Threshold; 256 or more keeps every element, 0 drops every one).
func NewMask(seed uint64, offset uint32, t uint32, b, h, heads int) Mask {
	return Mask{
		key:       [2]uint32{uint32(seed), uint32(seed >> 32)},
		bh:        uint32(b*heads + h),
		offset:    offset,
		threshold: t,
	}
}

// Words returns the four random words whose sixteen bytes serve keys
// 16·(j/16) … 16·(j/16)+15 of query row i.
func (m Mask) Words(i, j int) [4]uint32 {
	return Block([4]uint32{uint32(j >> 4), uint32(i), m.bh, m.offset}, m.key)
}

// byteOf returns key j's 8-bit number from the words of its group.
func byteOf(w [4]uint32, j int) uint32 {
	return (w[(j>>2)&3] >> (8 * (j & 3))) & 0xFF
}

// Byte returns the 8-bit number u of element (i, j) of this (batch, head).
func (m Mask) Byte(i, j int) uint32 {
	return byteOf(m.Words(i, j), j)
}

// Keep reports whether element (i, j) of this (batch, head) is kept.
func (m Mask) Keep(i, j int) bool {
	return m.Byte(i, j) < m.threshold
}

// KeepRow fills keep[j-j0] for keys j0 … j0+len(keep)-1 of query row i,
// calling the generator once per group of sixteen keys.
func (m Mask) KeepRow(i, j0 int, keep []bool) {
	end := j0 + len(keep)
	t := m.threshold
	group := func(k []bool, w [4]uint32) { // a whole group: its sixteen bytes in order
		for g, x := range w {
			k[4*g] = x&0xFF < t
			k[4*g+1] = x>>8&0xFF < t
			k[4*g+2] = x>>16&0xFF < t
			k[4*g+3] = x>>24 < t
		}
	}
	for j := j0; j < end; {
		if j&15 == 0 && end-j >= 32 { // two whole groups, generated together
			a, b := block2(uint32(j>>4), uint32(j>>4+1), uint32(i), m.bh, m.offset, m.key)
			group(keep[j-j0:j-j0+16], a)
			group(keep[j-j0+16:j-j0+32], b)
			j += 32
			continue
		}
		w := m.Words(i, j)
		if j&15 == 0 && end-j >= 16 {
			group(keep[j-j0:j-j0+16], w)
			j += 16
			continue
		}
		next := min(end, (j|15)+1) // the first key of the next group
		for ; j < next; j++ {
			keep[j-j0] = byteOf(w, j) < t
		}
	}
}
