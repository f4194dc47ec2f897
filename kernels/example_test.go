package kernels_test

import (
	"fmt"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/kernels"
)

// The Hopper tile of a bf16 forward at head dim 128, and the variant it
// makes: two warpgroups of 64 query rows, 96 keys a tile.
func ExampleHopperTile() {
	v := kernels.Variant{DType: attn.BFloat16, DK: 128, DV: 128, LoadBytes: 16, LSE: true}
	tile, ok := kernels.HopperTile(v)
	fmt.Println(ok, tile.BlockM, tile.BlockN, tile.WarpsM, tile.WarpsN)
	v = tile.Apply(v)
	fmt.Println(v.Validate() == nil, v.Threads(), v.Name())
	// Output:
	// true 128 96 8 1
	// true 256 fwd90a_bf16_k128_v128_m128n96_w8x1_s2_l16_q0_mask-none_cap0_ps0_bias-none_drop0_var0_lse1_mb1
}

// Which backward head dims the Hopper kernels take (16-bit rows read with
// 16-byte copies): both dims up to 128, or both from 129 to 256.
func ExampleBwdHopperOK() {
	for _, d := range [][2]int{{64, 64}, {128, 128}, {256, 256}, {64, 256}, {320, 320}, {512, 256}} {
		v := kernels.BwdVariant{DType: attn.BFloat16, DK: d[0], DV: d[1], Vector: true}
		fmt.Println(d, kernels.BwdHopperOK(v))
	}
	// Output:
	// [64 64] true
	// [128 128] true
	// [256 256] true
	// [64 256] false
	// [320 320] true
	// [512 256] false
}
