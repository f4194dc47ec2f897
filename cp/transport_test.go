package cp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/flashattn/flashattn/attn"
)

// testTimeout bounds every group a test runs: a hang fails the test
// instead of stalling the suite.
const testTimeout = 20 * time.Second

func TestLocalCollectives(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4, 8} {
		t.Run(fmt.Sprint("P=", p), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			err := Run(ctx, p, func(ctx context.Context, tr Transport) error {
				r := tr.Rank()
				if tr.Size() != p {
					return fmt.Errorf("size %d, want %d", tr.Size(), p)
				}
				// Ring: send 3 bytes to the next rank, receive from the previous one.
				next, prev := (r+1)%p, (r+p-1)%p
				got := make([]byte, 3)
				if err := tr.Exchange(ctx, []Send{{Peer: next, Data: []byte{byte(r), 1, 2}}},
					[]Recv{{Peer: prev, Data: got}}); err != nil {
					return err
				}
				if !bytes.Equal(got, []byte{byte(prev), 1, 2}) {
					return fmt.Errorf("ring: got %v from rank %d", got, prev)
				}
				// All-to-all: part t of rank r's send is (r, t).
				send, recv := make([]byte, 2*p), make([]byte, 2*p)
				for t := range p {
					send[2*t], send[2*t+1] = byte(r), byte(t)
				}
				if err := tr.AllToAll(ctx, send, recv); err != nil {
					return err
				}
				for t := range p {
					if recv[2*t] != byte(t) || recv[2*t+1] != byte(r) {
						return fmt.Errorf("all-to-all: part %d is %v", t, recv[2*t:2*t+2])
					}
				}
				all := make([]byte, p)
				if err := tr.AllGather(ctx, []byte{byte(10 + r)}, all); err != nil {
					return err
				}
				for t := range p {
					if all[t] != byte(10+t) {
						return fmt.Errorf("all-gather: %v", all)
					}
				}
				return tr.Barrier(ctx)
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestLocalErrors(t *testing.T) {
	errBoom := errors.New("boom")
	for _, tc := range []struct {
		name string
		p    int
		fn   func(ctx context.Context, tr Transport) error
		want error
	}{
		{"size mismatch", 2, func(ctx context.Context, tr Transport) error {
			if tr.Rank() == 0 {
				return tr.Exchange(ctx, []Send{{Peer: 1, Data: make([]byte, 4)}}, nil)
			}
			return tr.Exchange(ctx, nil, []Recv{{Peer: 0, Data: make([]byte, 8)}})
		}, attn.ErrShape},
		{"all-to-all not divisible", 3, func(ctx context.Context, tr Transport) error {
			return tr.AllToAll(ctx, make([]byte, 4), make([]byte, 4))
		}, attn.ErrShape},
		{"peer out of range", 2, func(ctx context.Context, tr Transport) error {
			return tr.Exchange(ctx, []Send{{Peer: 2}}, nil)
		}, attn.ErrOption},
		{"a rank fails before its collective", 4, func(ctx context.Context, tr Transport) error {
			if tr.Rank() == 2 {
				return errBoom
			}
			return tr.Barrier(ctx)
		}, errBoom},
		{"a rank fails later", 3, func(ctx context.Context, tr Transport) error {
			for i := range 5 {
				if tr.Rank() == 1 && i == 3 {
					return errBoom
				}
				if err := tr.Barrier(ctx); err != nil {
					return err
				}
			}
			return nil
		}, errBoom},
		{"a rank never joins", 3, func(ctx context.Context, tr Transport) error {
			if tr.Rank() == 0 {
				return nil
			}
			ctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
			defer cancel()
			return tr.Barrier(ctx)
		}, context.DeadlineExceeded},
		{"a rank panics", 2, func(ctx context.Context, tr Transport) error {
			if tr.Rank() == 1 {
				var s []int
				_ = s[tr.Size()]
			}
			return tr.Barrier(ctx)
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			errs := make([]error, tc.p)
			err := Run(ctx, tc.p, func(ctx context.Context, tr Transport) error {
				errs[tr.Rank()] = tc.fn(ctx, tr)
				return errs[tr.Rank()]
			})
			if err == nil {
				t.Fatal("no error")
			}
			if ctx.Err() != nil {
				t.Fatalf("the group hung until the test's deadline: %v", err)
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("error %v does not wrap %v", err, tc.want)
			}
			if errors.Is(err, ErrAborted) {
				t.Errorf("Run returned a consequence, not the cause: %v", err)
			}
			for r, e := range errs {
				if e != nil && !errors.Is(e, ErrAborted) && !errors.Is(e, tc.want) {
					t.Errorf("rank %d: %v wraps neither ErrAborted nor %v", r, e, tc.want)
				}
			}
		})
	}
}
