package cp_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cp"
	"github.com/flashattn/flashattn/cpu"
)

// Example runs causal attention over a sequence of 64 tokens on four
// in-process ranks with the zigzag ring, and compares the reassembled
// output with a single device's.
func Example() {
	const p, n = 4, 64
	r := rand.New(rand.NewPCG(1, 2))
	rnd := func(shape ...int) attn.Tensor {
		x := make([]float32, attn.NumElements(shape))
		for i := range x {
			x[i] = float32(r.NormFloat64())
		}
		return attn.FromFloat32(attn.Float32, x, shape...)
	}
	q, k, v := rnd(1, n, 4, 16), rnd(1, n, 4, 16), rnd(1, n, 4, 16)
	opt := attn.Options{Causal: true}

	// Rank 1 of 4 holds chunks 1 and 6 of 8: positions 8–15 and 48–55.
	pos, _ := cp.Positions(cp.Zigzag, n, p, 1)
	fmt.Println("rank 1 holds", pos[0], "to", pos[7], "and", pos[8], "to", pos[15])

	outs := make([]attn.Tensor, p)
	err := cp.Run(context.Background(), p, func(ctx context.Context, t cp.Transport) error {
		var shards [3]attn.Tensor
		for i, x := range []attn.Tensor{q, k, v} {
			var err error
			if shards[i], err = cp.Shard(x, 1, cp.Zigzag, p, t.Rank()); err != nil {
				return err
			}
		}
		a := &cp.Attention{Backend: cpu.New(), Transport: t, Layout: cp.Zigzag, Scheme: cp.Ring}
		res, err := a.Forward(ctx, shards[0], shards[1], shards[2], opt)
		outs[t.Rank()] = res.O
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	o, err := cp.Unshard(outs, 1, cp.Zigzag)
	if err != nil {
		fmt.Println(err)
		return
	}
	single, err := cpu.New().Forward(q, k, v, opt)
	if err != nil {
		fmt.Println(err)
		return
	}
	var diff float64
	want := single.O.Float32s()
	for i, x := range o.Float32s() {
		diff = max(diff, math.Abs(float64(x-want[i])))
	}
	fmt.Println("same as one device:", diff < 1e-5)
	// Output:
	// rank 1 holds 8 to 15 and 48 to 55
	// same as one device: true
}
