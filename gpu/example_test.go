package gpu_test

import (
	"fmt"
	"log"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/gpu"
)

// This example runs training steps on host tensors that the loop refills
// every step, pinned once so that each step's copies go over the link in
// place, and the outputs written into tensors allocated once. It prints
// nothing on a machine without a GPU.
func ExampleBackend_Pin() {
	b, err := gpu.Open()
	if cuda.Unavailable(err) {
		return
	} else if err != nil {
		log.Fatal(err)
	}
	defer b.Close()

	const B, N, H, D = 2, 1024, 8, 64
	q, k, v, dO := attn.New(attn.BFloat16, B, N, H, D), attn.New(attn.BFloat16, B, N, H, D),
		attn.New(attn.BFloat16, B, N, H, D), attn.New(attn.BFloat16, B, N, H, D)
	res := attn.Result{O: attn.New(attn.BFloat16, B, N, H, D), LSE: attn.New(attn.Float32, B, H, N)}
	g := attn.Gradients{DQ: attn.New(attn.BFloat16, B, N, H, D), DK: attn.New(attn.BFloat16, B, N, H, D), DV: attn.New(attn.BFloat16, B, N, H, D)}
	pin, err := b.Pin(q, k, v, dO, res.O, res.LSE, g.DQ, g.DK, g.DV)
	if err != nil {
		log.Fatal(err)
	}
	defer pin.Unpin()

	opt := attn.Options{Causal: true}
	for step := range 3 {
		for _, t := range []attn.Tensor{q, k, v, dO} {
			t.Fill(0.01 * float32(step+1)) // the step's inputs, written in place
		}
		if err := b.ForwardInto(q, k, v, res, opt); err != nil {
			log.Fatal(err)
		}
		if err := b.BackwardInto(q, k, v, res.O, res.LSE, dO, g, opt); err != nil {
			log.Fatal(err)
		}
	}
	fmt.Println(res.O.At(0, 0, 0, 0))
}
