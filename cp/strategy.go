package cp

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/flashattn/flashattn/attn"
)

// Strategy is a layout and a scheme together, the choice a caller makes
// when it splits a call: "ring" (Contiguous, Ring), "zigzag" (Zigzag,
// Ring), "a2a" (Contiguous, AllToAll) or "hybrid" (Zigzag, Hybrid; with a
// given all-to-all degree A, "hybrid-A").
type Strategy struct {
	Layout Layout
	Scheme Scheme
	// Groups is the Hybrid scheme's all-to-all degree A (0: automatic, see
	// HybridDegree); the other schemes leave it 0.
	Groups int
}

// The strategies a caller can choose from, in the order Strategies lists
// them.
var (
	// RingStrategy passes K/V around the ring of contiguous shards.
	RingStrategy = Strategy{Layout: Contiguous, Scheme: Ring}
	// ZigzagStrategy passes K/V around the ring of zigzag shards, which
	// balances a causal mask.
	ZigzagStrategy = Strategy{Layout: Zigzag, Scheme: Ring}
	// AllToAllStrategy trades sequence shards for head shards (Ulysses).
	AllToAllStrategy = Strategy{Layout: Contiguous, Scheme: AllToAll}
	// HybridStrategy trades heads within groups and passes K/V around a
	// ring of the groups, zigzag across the ring, with the automatic
	// all-to-all degree.
	HybridStrategy = Strategy{Layout: Zigzag, Scheme: Hybrid}
)

// Strategies returns ring, zigzag, a2a and hybrid.
func Strategies() []Strategy {
	return []Strategy{RingStrategy, ZigzagStrategy, AllToAllStrategy, HybridStrategy}
}

// String returns "ring", "zigzag", "a2a", "hybrid" or "hybrid-A" (or the
// layout and scheme of another combination).
func (s Strategy) String() string {
	switch s {
	case RingStrategy:
		return "ring"
	case ZigzagStrategy:
		return "zigzag"
	case AllToAllStrategy:
		return "a2a"
	case HybridStrategy:
		return "hybrid"
	}
	if h := HybridStrategy; s.Layout == h.Layout && s.Scheme == h.Scheme && s.Groups > 0 {
		return "hybrid-" + strconv.Itoa(s.Groups)
	}
	if s.Groups != 0 {
		return fmt.Sprintf("%v/%v/%d", s.Scheme, s.Layout, s.Groups)
	}
	return fmt.Sprintf("%v/%v", s.Scheme, s.Layout)
}

// ParseStrategy parses "ring", "zigzag", "a2a", "hybrid" or "hybrid-A"
// (A ≥ 1, the all-to-all degree). Other text (including "auto", which
// callers resolve with a cost model, see Profile.Choose) fails with an
// error wrapping attn.ErrOption.
func ParseStrategy(name string) (Strategy, error) {
	for _, s := range Strategies() {
		if s.String() == name {
			return s, nil
		}
	}
	if a, ok := strings.CutPrefix(name, "hybrid-"); ok {
		if g, err := strconv.Atoi(a); err == nil && g >= 1 && strconv.Itoa(g) == a {
			s := HybridStrategy
			s.Groups = g
			return s, nil
		}
	}
	return Strategy{}, attn.Errorf(attn.ErrOption, "cp: scheme %q is not ring, zigzag, a2a, hybrid or hybrid-A (A ≥ 1)", name)
}

// Default returns the strategy used when none is chosen: zigzag under a
// causal mask (it balances the work), ring otherwise.
func Default(causal bool) Strategy {
	if causal {
		return ZigzagStrategy
	}
	return RingStrategy
}

// Check reports whether strategy s can split a global problem of n
// queries, m keys and hkv key/value heads over p ranks: p ≥ 1 (else an
// error wrapping attn.ErrOption), n and m cut into equal chunks (else
// attn.ErrShape: shards are never uneven), for all-to-all p dividing hkv
// and for hybrid its degree dividing both (else attn.ErrUnsupported). The
// messages name the sizes and the fix.
func (s Strategy) Check(n, m, hkv, p int) error {
	if p < 1 {
		return attn.Errorf(attn.ErrOption, "cp: %d ranks: need at least 1", p)
	}
	if s.Layout != Contiguous && s.Layout != Zigzag || s.Scheme != Ring && s.Scheme != AllToAll && s.Scheme != Hybrid ||
		s.Groups < 0 || s.Groups > 0 && s.Scheme != Hybrid {
		return attn.Errorf(attn.ErrOption, "cp: unknown strategy %v", s)
	}
	c := s.Layout.numChunks(p)
	var bad []string
	if n%c != 0 {
		bad = append(bad, fmt.Sprintf("N = %d", n))
	}
	if m%c != 0 {
		bad = append(bad, fmt.Sprintf("M = %d", m))
	}
	if len(bad) > 0 {
		return attn.Errorf(attn.ErrShape, "cp: %s over %d ranks cuts each sequence into %d equal chunks, but %s is not a multiple of %d: uneven shards",
			s, p, c, strings.Join(bad, " and "), c)
	}
	if s.Scheme == AllToAll && hkv%p != 0 {
		return attn.Errorf(attn.ErrUnsupported, "cp: a2a over %d ranks needs the %d key/value heads to split evenly (its degree is capped by Hkv); use ring or zigzag",
			p, hkv)
	}
	if s.Scheme == Hybrid {
		if _, err := HybridDegree(s.Groups, hkv, p); err != nil {
			return err
		}
	}
	return nil
}

// Sim returns a Sim running strategy s on p in-process ranks over b.
func (s Strategy) Sim(b attn.Backend, p int) *Sim {
	return &Sim{Backend: b, P: p, Layout: s.Layout, Scheme: s.Scheme, Groups: s.Groups}
}
