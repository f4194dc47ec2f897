package cp

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

func TestNCCLCandidates(t *testing.T) {
	glob := func(pat string) ([]string, error) {
		switch pat {
		case "/venv/lib/python3*/site-packages/nvidia/nccl/lib":
			return []string{"/venv/lib/python3.11/site-packages/nvidia/nccl/lib", "/venv/lib/python3.12/site-packages/nvidia/nccl/lib"}, nil
		case "/usr/local/lib/python3*/dist-packages/torch/lib":
			return []string{"/usr/local/lib/python3.10/dist-packages/torch/lib"}, nil
		}
		return nil, nil
	}
	cases := []struct {
		name   string
		env    map[string]string
		first  []string // the candidates must start with these
		order  []string // and hold these in this order
		absent []string
	}{
		{name: "exact path", env: map[string]string{EnvNCCL: "/x/libnccl.so.2", EnvNCCLLibrary: "/y/libnccl.so.2"},
			first: []string{"/x/libnccl.so.2"}},
		{name: "NCCL_LIBRARY", env: map[string]string{EnvNCCLLibrary: "/y/libnccl.so.2"}, first: []string{"/y/libnccl.so.2"}},
		{name: "search", env: map[string]string{"NCCL_HOME": "/opt/nccl", "CUDA_HOME": "/usr/local/cuda", "VIRTUAL_ENV": "/venv"},
			first: []string{"/opt/nccl/lib64/libnccl.so.2", "/opt/nccl/lib/libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"},
			order: []string{"libnccl.so.2", "/usr/lib/x86_64-linux-gnu/libnccl.so.2",
				"/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2",
				"/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2",
				"/usr/local/lib/python3.10/dist-packages/torch/lib/libnccl.so.2"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := ncclCandidates(func(k string) string { return c.env[k] }, glob)
			if len(got) < len(c.first) || !slices.Equal(got[:len(c.first)], c.first) {
				t.Fatalf("candidates %q do not start with %q", got, c.first)
			}
			last := -1
			for _, w := range c.order {
				i := slices.Index(got, w)
				if i <= last {
					t.Fatalf("%q missing or out of order in %q", w, got)
				}
				last = i
			}
			seen := map[string]bool{}
			for _, g := range got {
				if seen[g] {
					t.Errorf("%q listed twice", g)
				}
				seen[g] = true
			}
		})
	}
}

func TestOpenNCCLFailures(t *testing.T) {
	notLib := filepath.Join(t.TempDir(), "libnccl.so.2")
	if err := os.WriteFile(notLib, []byte("not a library"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name  string
		cands []string
		say   string
	}{
		{"nothing", nil, "nothing to try"},
		{"missing file", []string{"/nonexistent/libnccl.so.2"}, "/nonexistent/libnccl.so.2"},
		{"not a library", []string{notLib}, notLib + " ("},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := openNCCL(c.cands)
			if !errors.Is(err, ErrNoNCCL) || !strings.Contains(err.Error(), c.say) {
				t.Fatalf("got %v, want an ErrNoNCCL error saying %q", err, c.say)
			}
		})
	}
}

func TestNCCLErrors(t *testing.T) {
	cases := []struct {
		err  *NCCLError
		want string
	}{
		{&NCCLError{Op: "rank 1: ncclSend", Code: NCCLRemoteError, Message: "remote process exited", Detail: "peer 2 closed\n"},
			"cp: rank 1: ncclSend: ncclRemoteError (remote process exited): peer 2 closed"},
		{&NCCLError{Op: "ncclGroupEnd", Code: NCCLResult(42)}, "cp: ncclGroupEnd: ncclResult(42)"},
	}
	for _, c := range cases {
		if got := c.err.Error(); got != c.want {
			t.Errorf("got %q, want %q", got, c.want)
		}
		if !errors.Is(c.err, ErrNCCL) {
			t.Errorf("%v does not wrap ErrNCCL", c.err)
		}
	}
	if s := NCCLInProgress.String(); s != "ncclInProgress" {
		t.Errorf("NCCLInProgress is %q", s)
	}
}

// fakeNCCL is a communicator that was never created: enough to check
// arguments, which are refused before any NCCL call.
func fakeNCCL(rank, size int) *NCCL {
	n := &NCCL{rank: rank, size: size, comm: newCommCell(), timeout: DefaultNCCLTimeout}
	n.group = &ncclGroup{comms: []*NCCL{n}}
	return n
}

func TestNCCLArguments(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name string
		op   func(n *NCCL) error
		want error
	}{
		{"send to a rank outside", func(n *NCCL) error {
			return n.ExchangeOn(ctx, nil, []DeviceSend{{Peer: 2}}, nil)
		}, attn.ErrOption},
		{"receive from a negative rank", func(n *NCCL) error {
			return n.ExchangeOn(ctx, nil, nil, []DeviceRecv{{Peer: -1}})
		}, attn.ErrOption},
		{"bytes of a nil buffer", func(n *NCCL) error {
			return n.ExchangeOn(ctx, nil, []DeviceSend{{Peer: 1, Data: DeviceSpan{Len: 8}}}, nil)
		}, attn.ErrOption},
		{"negative offset", func(n *NCCL) error {
			return n.ExchangeOn(ctx, nil, nil, []DeviceRecv{{Peer: 0, Data: DeviceSpan{Off: -1}}})
		}, attn.ErrShape},
		{"all-to-all lengths differ", func(n *NCCL) error {
			return n.AllToAllOn(ctx, nil, DeviceSpan{Len: 8}, DeviceSpan{Len: 4})
		}, attn.ErrShape},
		{"all-to-all not a multiple", func(n *NCCL) error {
			return n.AllToAllOn(ctx, nil, DeviceSpan{Len: 3}, DeviceSpan{Len: 3})
		}, attn.ErrShape},
		{"all-gather too short", func(n *NCCL) error {
			return n.AllGatherOn(ctx, nil, DeviceSpan{Len: 4}, DeviceSpan{Len: 4})
		}, attn.ErrShape},
		{"host send outside", func(n *NCCL) error {
			return n.Exchange(ctx, []Send{{Peer: 3, Data: []byte{1}}}, nil)
		}, attn.ErrOption},
		{"host all-to-all", func(n *NCCL) error { return n.AllToAll(ctx, make([]byte, 3), make([]byte, 3)) }, attn.ErrShape},
		{"host all-gather", func(n *NCCL) error { return n.AllGather(ctx, make([]byte, 2), make([]byte, 2)) }, attn.ErrShape},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n := fakeNCCL(0, 2)
			if err := c.op(n); !errors.Is(err, c.want) {
				t.Fatalf("got %v, want an error wrapping %v", err, c.want)
			}
			// The failure aborted the group: what follows fails at once.
			if err := n.Barrier(ctx); !errors.Is(err, ErrAborted) || !errors.Is(err, c.want) {
				t.Fatalf("after the failure: %v, want ErrAborted and the cause", err)
			}
		})
	}
	t.Run("nothing to move", func(t *testing.T) {
		n := fakeNCCL(1, 2)
		if err := n.ExchangeOn(ctx, nil, []DeviceSend{{Peer: 0}}, []DeviceRecv{{Peer: 0}}); err != nil {
			t.Fatal(err)
		}
		if err := n.Exchange(ctx, []Send{{Peer: 0}}, []Recv{{Peer: 1}}); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("constructors", func(t *testing.T) {
		var id NCCLUniqueID
		if _, err := NewNCCL(ctx, nil, id, 0, 1); !errors.Is(err, attn.ErrOption) {
			t.Errorf("NewNCCL without a device: %v", err)
		}
		if _, err := NewNCCLAll(ctx, nil); !errors.Is(err, attn.ErrOption) {
			t.Errorf("NewNCCLAll without devices: %v", err)
		}
		for _, rs := range [][2]int{{0, 0}, {-1, 2}, {2, 2}} {
			if err := checkGroupShape(rs[0], rs[1]); !errors.Is(err, attn.ErrOption) {
				t.Errorf("rank %d of %d: %v", rs[0], rs[1], err)
			}
		}
	})
}

func TestNCCLAbsent(t *testing.T) {
	_, path, err := NCCLVersion()
	if err == nil {
		t.Skipf("NCCL present here (%s)", path)
	}
	if !errors.Is(err, ErrNoNCCL) {
		t.Fatalf("got %v, want ErrNoNCCL", err)
	}
	if os.Getenv("NCCL_NVLS_ENABLE") != "0" {
		t.Errorf("NCCL_NVLS_ENABLE=%q before loading", os.Getenv("NCCL_NVLS_ENABLE"))
	}
	if _, err := NewNCCLUniqueID(); !errors.Is(err, ErrNoNCCL) {
		t.Errorf("NewNCCLUniqueID: %v", err)
	}
}
