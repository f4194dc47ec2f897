package cpu

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/half"
)

// TestVisiblePVLayouts checks the row-by-row P·V of masked tiles on both
// packings of V, the float32 rows (vr) and the bfloat16 pairs (vrb, read
// on machines with native bfloat16 products only), against each other: with
// P representable in bfloat16 every product is exact, and the sums go in
// the same order, so the results must be bit-identical. Key blocks of odd
// length leave a half pair at the end.
func TestVisiblePVLayouts(t *testing.T) {
	r := rand.New(rand.NewPCG(4, 20))
	for _, tc := range []struct {
		name string
		n, m int
		dv   int
		opt  attn.Options
	}{
		{"causal odd keys", 40, 37, 24, attn.Options{Causal: true}},
		{"window odd dim", 70, 70, 7, attn.Options{Window: &attn.Window{Left: 5, Right: 3}, Align: attn.AlignTopLeft}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := attn.New(attn.BFloat16, 1, tc.n, 1, 8)
			k := attn.New(attn.BFloat16, 1, tc.m, 1, 8)
			v := attn.New(attn.BFloat16, 1, tc.m, 1, tc.dv)
			for i := range v.Bits {
				v.Bits[i] = uint16(half.BFloat16FromFloat32(float32(r.NormFloat64())))
			}
			var acc [2][]float32
			for pass, bf16 := range []bool{false, true} {
				c, err := newCall(q, k, v, tc.opt)
				if err != nil {
					t.Fatal(err)
				}
				c.bf16 = bf16
				nblk := c.kblk[c.p.B] * c.p.Hkv
				if bf16 {
					c.vrb = make([]uint16, nblk*blockK*tc.dv)
				} else {
					c.vr = make([]float32, nblk*blockK*tc.dv)
				}
				c.dkp, c.dvp = 8, tc.dv+tc.dv%2
				sc := c.newScratch()
				sc.pb = make([]uint16, blockQ*blockK)
				sg := c.segs[0]
				f := &fwd{call: c}
				pr := rand.New(rand.NewPCG(1, 1)) // the same P on both passes
				for jb := 0; jb*blockK < tc.m; jb++ {
					c.packKeys(sc, sg, 0, jb)
				}
				acc[pass] = make([]float32, tc.n*tc.dv)
				for i0 := 0; i0 < tc.n; i0 += blockQ {
					rows := min(blockQ, tc.n-i0)
					for jb := 0; jb*blockK < tc.m; jb++ {
						j0 := jb * blockK
						cols := min(blockK, tc.m-j0)
						for x := range sc.s {
							b := half.BFloat16FromFloat32(float32(pr.Float64()))
							sc.s[x], sc.pb[x] = b.Float32(), uint16(b)
						}
						f.visiblePV(sc, sg, i0, rows, j0, cols, c.block(sg, 0, jb), acc[pass][i0*tc.dv:])
					}
				}
			}
			for x := range acc[0] {
				if math.Float32bits(acc[0][x]) != math.Float32bits(acc[1][x]) {
					t.Fatalf("element %d: %v from float32 rows, %v from bfloat16 pairs", x, acc[0][x], acc[1][x])
				}
			}
			var nonzero bool
			for _, x := range acc[0] {
				nonzero = nonzero || x != 0
			}
			if !nonzero {
				t.Fatal("no product was accumulated")
			}
		})
	}
}
