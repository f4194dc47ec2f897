package attn

import (
	"errors"
	"testing"
)

func TestDropoutAt(t *testing.T) {
	q, k := New(Float32, 1, 4, 2, 8), New(Float32, 1, 4, 2, 8)
	for _, tc := range []struct {
		name string
		d    DropoutOrigin
		want error
		// want place of head 1: head, heads, qoff, koff
		place [4]int
	}{
		{"offsets", DropoutOrigin{Query: 3, Key: 5, Head: 4, Heads: 6}, nil, [4]int{5, 6, 3, 5}},
		{"own heads", DropoutOrigin{Query: 1}, nil, [4]int{1, 2, 1, 0}},
		{"negative", DropoutOrigin{Key: -1}, ErrOption, [4]int{}},
		{"heads past the end", DropoutOrigin{Head: 5, Heads: 6}, ErrOption, [4]int{}},
		{"head offset without heads", DropoutOrigin{Head: 1}, ErrOption, [4]int{}},
	} {
		p, err := NewProblem(q, k, k, Options{Dropout: 0.5, DropoutAt: &tc.d})
		if !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
			t.Errorf("%s: error %v, want %v", tc.name, err, tc.want)
			continue
		}
		if err != nil {
			continue
		}
		head, heads, qo, ko := p.DropoutPlace(1)
		if got := [4]int{head, heads, qo, ko}; got != tc.place {
			t.Errorf("%s: DropoutPlace(1) = %v, want %v", tc.name, got, tc.place)
		}
	}
}
