package flashattn_test

import (
	"errors"
	"fmt"
	"math"
	"slices"

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

// Reading results back: a Result holds O [B, N, H, DV] and LSE [B, H, N] as
// Tensors (Tensor is attn.Tensor; go doc on this package does not list its
// methods). Shape gives the sizes, At one element, Float32s every element
// in row-major order.
func Example_readingResults() {
	// Two queries, two keys, two heads of dimension 2: [B=1, N=2, H=2, D=2].
	q := flashattn.New(flashattn.Float32, 1, 2, 2, 2)
	k := flashattn.New(flashattn.Float32, 1, 2, 2, 2)
	v := flashattn.FromFloat32(flashattn.Float32, []float32{
		1, 2, 10, 20, // key 0: head 0, head 1
		3, 4, 30, 40, // key 1
	}, 1, 2, 2, 2)
	b, err := flashattn.Open("cpu")
	if err != nil {
		panic(err)
	}
	res, err := b.Forward(q, k, v, flashattn.Options{}) // zero scores: the mean of v
	if err != nil {
		panic(err)
	}
	fmt.Println("O shape:", res.O.Shape, "LSE shape:", res.LSE.Shape)
	fmt.Println("O[b=0, i=1, h=1, :]:", res.O.At(0, 1, 1, 0), res.O.At(0, 1, 1, 1))
	fmt.Printf("LSE[0, 0, 0] = ln 2: %.4f\n", res.LSE.At(0, 0, 0))
	fmt.Println("O:", res.O.Float32s())
	// Output:
	// O shape: [1 2 2 2] LSE shape: [1 2 2]
	// O[b=0, i=1, h=1, :]: 20 30
	// LSE[0, 0, 0] = ln 2: 0.6931
	// O: [2 3 20 30 2 3 20 30]
}

// The forward/backward contract: ForwardOn returns a Forwarded that keeps
// what its backward needs (backend, inputs, O, LSE and options), so its
// Backward takes only dO and cannot be given other options than the
// forward's. Changing opt after the forward changes nothing.
func ExampleForwardOn() {
	b, err := flashattn.Open("cpu")
	if err != nil {
		panic(err)
	}
	q := flashattn.FromFloat32(flashattn.Float32, []float32{1, 1}, 1, 2, 1, 1)
	k := flashattn.FromFloat32(flashattn.Float32, []float32{0, float32(math.Log(3))}, 1, 2, 1, 1)
	v := flashattn.FromFloat32(flashattn.Float32, []float32{4, 8}, 1, 2, 1, 1)
	opt := flashattn.Options{Causal: true}

	fw, err := flashattn.ForwardOn(b, q, k, v, opt)
	if err != nil {
		panic(err)
	}
	fmt.Printf("O  = %.4f\n", fw.O.Float32s()) // fw.O and fw.LSE: the embedded Result

	opt.Causal = false // too late: the backward uses the forward's options
	dO := flashattn.FromFloat32(flashattn.Float32, []float32{1, 1}, 1, 2, 1, 1)
	g, err := fw.Backward(dO)
	if err != nil {
		panic(err)
	}
	fmt.Printf("dV = %.4f\n", g.DV.Float32s())
	fmt.Println("causal:", fw.Options().Causal)
	// Output:
	// O  = [4.0000 7.0000]
	// dV = [1.2500 0.7500]
	// causal: true
}

// A dropout generator hands each call its own (seed, offset) pair, so that
// repeated calls draw different masks, as PyTorch's generator does; the
// Forwarded of each call keeps its pair for the backward.
func ExampleGenerator() {
	b, err := flashattn.Open("cpu")
	if err != nil {
		panic(err)
	}
	x := make([]float32, 64*8)
	for i := range x {
		x[i] = float32(i%7) / 7
	}
	q := flashattn.FromFloat32(flashattn.Float32, x, 1, 64, 1, 8)
	opt := flashattn.Options{Dropout: 0.5}

	gen := flashattn.NewGenerator(2024)
	first, err := flashattn.ForwardOn(b, q, q, q, gen.Draw(opt))
	if err != nil {
		panic(err)
	}
	second, err := flashattn.ForwardOn(b, q, q, q, gen.Draw(opt))
	if err != nil {
		panic(err)
	}
	for _, fw := range []*flashattn.Forwarded{first, second} {
		o := fw.Options()
		fmt.Printf("seed %d offset %d\n", o.Seed, o.Offset)
	}
	fmt.Println("same mask:", slices.Equal(first.O.Float32s(), second.O.Float32s()))
	seed, offset := gen.State()
	fmt.Printf("next: seed %d offset %d\n", seed, offset)

	// Without dropout nothing is drawn.
	fmt.Println(gen.Draw(flashattn.Options{}).Offset, gen.Draw(opt).Offset)
	// Output:
	// seed 2024 offset 0
	// seed 2024 offset 1
	// same mask: false
	// next: seed 2024 offset 2
	// 0 2
}

// Tensors in PyTorch's scaled_dot_product_attention order [B, H, N, D] are
// passed through BHSD, a view in flashattn's [B, N, H, D] order that copies
// nothing; without it they would be read with heads and positions swapped.
// ToBHSD views results back in PyTorch's order, and the gradients of a BHSD
// view come back (on the CPU backend) laid out like it, so that their
// ToBHSD view is a contiguous [B, H, N, D] tensor.
func ExampleBHSD() {
	b, err := flashattn.Open("cpu")
	if err != nil {
		panic(err)
	}
	// [B=1, H=2, N=3, D=1], as a PyTorch tensor q.transpose(1, 2) would hold it.
	data := []float32{
		1, 2, 3, // head 0, positions 0..2
		10, 20, 30, // head 1
	}
	qt := flashattn.FromFloat32(flashattn.Float32, data, 1, 2, 3, 1)
	q, err := flashattn.BHSD(qt)
	if err != nil {
		panic(err)
	}
	fmt.Println("view:", q.Shape, q.Strides, "q[0, pos 2, head 1] =", q.At(0, 2, 1, 0))

	fw, err := flashattn.ForwardOn(b, q, q, q, flashattn.Options{Causal: true})
	if err != nil {
		panic(err)
	}
	o, _ := flashattn.ToBHSD(fw.O) // [B, H, N, DV]
	fmt.Println("O[0, head 0, pos 0] =", o.At(0, 0, 0, 0), "O[0, head 1, pos 0] =", o.At(0, 1, 0, 0))

	g, err := fw.Backward(fw.O) // any dO shaped like O
	if err != nil {
		panic(err)
	}
	dq, _ := flashattn.ToBHSD(g.DQ)
	fmt.Println("dQ:", g.DQ.Shape, g.DQ.Strides, "as BHSD:", dq.Shape, dq.Strides)

	_, err = flashattn.BHSD(flashattn.New(flashattn.Float32, 2, 3, 4))
	fmt.Println(errors.Is(err, flashattn.ErrShape))
	// Output:
	// view: [1 3 2 1] [6 1 3 1] q[0, pos 2, head 1] = 30
	// O[0, head 0, pos 0] = 1 O[0, head 1, pos 0] = 10
	// dQ: [1 3 2 1] [6 1 3 1] as BHSD: [1 2 3 1] [6 3 1 1]
	// true
}
