package attn

import "sync"

// Generator hands out the dropout (Seed, Offset) pair of successive calls,
// the way a PyTorch generator feeds its dropout kernels: every call that
// draws from it gets a mask of its own, while the calls stay reproducible
// from the generator's starting state.
//
// The keep mask of one call is Philox4x32-10 at counter
// (key/16, query, batch·H + head, Offset) under the key Seed (the mapping
// is defined in package philox): a call uses the counters of one Offset
// value only, whatever its shape. Advancing Offset by one per call therefore gives every call
// counters that no other call uses; after 2^32 calls the offset wraps to 0
// and the seed moves on by one. The backward of a call must use the pair
// its forward drew: the Forwarded form of the root package keeps it.
//
// A Generator is safe for concurrent use; its zero value starts at seed 0,
// offset 0.
type Generator struct {
	mu     sync.Mutex
	seed   uint64
	offset uint32
}

// NewGenerator returns a generator whose first pair is (seed, 0).
func NewGenerator(seed uint64) *Generator {
	return &Generator{seed: seed}
}

// Next returns the pair of the next call and advances the generator.
func (g *Generator) Next() (seed uint64, offset uint32) {
	g.mu.Lock()
	defer g.mu.Unlock()
	seed, offset = g.seed, g.offset
	g.offset++
	if g.offset == 0 {
		g.seed++
	}
	return seed, offset
}

// Draw returns opt with Seed and Offset set to the next pair (advancing the
// generator) when opt.Dropout > 0, and opt unchanged otherwise: a call
// without dropout draws nothing, so evaluation steps do not move the
// masks of the training steps.
func (g *Generator) Draw(opt Options) Options {
	if opt.Dropout > 0 {
		opt.Seed, opt.Offset = g.Next()
	}
	return opt
}

// State returns the pair the next call will get, without advancing: with
// SetState it saves and restores the generator (a checkpoint).
func (g *Generator) State() (seed uint64, offset uint32) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.seed, g.offset
}

// SetState makes (seed, offset) the pair of the next call.
func (g *Generator) SetState(seed uint64, offset uint32) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.seed, g.offset = seed, offset
}
