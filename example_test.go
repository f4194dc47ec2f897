package flashattn_test

import (
	"errors"
	"fmt"
	"math"

	"github.com/flashattn/flashattn"
)

// A causal forward and backward on the CPU backend: two queries, two keys,
// one head of dimension 1. Query 0 sees only key 0, so its output is v0 = 4;
// query 1 sees both keys with scores 0 and ln 3, so it weighs them 1/4 and
// 3/4: 0.25·4 + 0.75·8 = 7, and its log-sum-exp is ln 4.
func Example() {
	b, err := flashattn.Open("cpu")
	if err != nil {
		panic(err)
	}
	// Shapes are [B, seq, heads, dim].
	q := flashattn.FromFloat32(flashattn.Float32, []float32{1, 1}, 1, 2, 1, 1)
	k := flashattn.FromFloat32(flashattn.Float32, []float32{0, float32(math.Log(3))}, 1, 2, 1, 1)
	v := flashattn.FromFloat32(flashattn.Float32, []float32{4, 8}, 1, 2, 1, 1)
	opt := flashattn.Options{Causal: true}

	res, err := b.Forward(q, k, v, opt)
	if err != nil {
		panic(err)
	}
	fmt.Printf("O   = %.4f\n", res.O.Float32s())
	fmt.Printf("LSE = %.4f\n", res.LSE.Float32s())

	dO := flashattn.FromFloat32(flashattn.Float32, []float32{1, 1}, 1, 2, 1, 1)
	g, err := b.Backward(q, k, v, res.O, res.LSE, dO, opt)
	if err != nil {
		panic(err)
	}
	// dV_j sums the probabilities with which the queries used key j.
	fmt.Printf("dV  = %.4f\n", g.DV.Float32s())
	// Output:
	// O   = [4.0000 7.0000]
	// LSE = [0.0000 1.3863]
	// dV  = [1.2500 0.7500]
}

// Bad input returns an error that wraps a sentinel.
func ExampleForward_error() {
	q := flashattn.New(flashattn.Float32, 1, 4, 3, 8) // 3 query heads
	k := flashattn.New(flashattn.Float32, 1, 4, 2, 8) // 2 key/value heads
	v := flashattn.New(flashattn.Float32, 1, 4, 2, 8)
	_, err := flashattn.Forward(q, k, v, flashattn.Options{})
	fmt.Println(errors.Is(err, flashattn.ErrShape))
	fmt.Println(err)
	// Output:
	// true
	// flashattn: query heads H=3 not a multiple of key/value heads Hkv=2: bad shape
}

// Open takes "cpu", "cuda" or "auto"; auto always yields a backend.
func ExampleOpen() {
	b, err := flashattn.Open("auto")
	if err != nil {
		panic(err)
	}
	fmt.Println(b.Name() == "cpu" || b.Name() == "cuda")
	_, err = flashattn.Open("tpu")
	fmt.Println(err)
	// Output:
	// true
	// flashattn: backend "tpu" is not cpu, cuda or auto: bad option
}
