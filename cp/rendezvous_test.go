package cp

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/flashattn/flashattn/attn"
)

// childRoleEnv, when set, makes the test binary act as one rank of a
// multi-process rendezvous test instead of running the tests.
const childRoleEnv = "FLASHATTN_CP_TEST_ROLE"

func TestMain(m *testing.M) {
	if role := os.Getenv(childRoleEnv); role != "" {
		os.Exit(runChild(role))
	}
	os.Exit(m.Run())
}

// testBlob is what rank 0 hands over in the tests.
var testBlob = bytes.Repeat([]byte{0xfa, 0x01, 0x7e}, 43)[:NCCLUniqueIDBytes]

// runChild is one rank of TestShareProcesses: "share" takes part in a
// rendezvous and prints the blob it got; "die" waits for the others to
// arrive, says hello to rank 0 and exits at once with status 3.
func runChild(role string) int {
	env, err := FromEnv()
	if err != nil {
		fmt.Println("ERR", err)
		return 1
	}
	switch role {
	case "share":
		var blob []byte
		if env.Rank == 0 {
			blob = testBlob
		}
		got, err := env.Share(context.Background(), blob)
		if err != nil {
			fmt.Println("ERR", err)
			return 1
		}
		fmt.Println("OK", hex.EncodeToString(got))
		return 0
	case "die":
		time.Sleep(1500 * time.Millisecond)
		c, err := dial(context.Background(), env.Addr)
		if err == nil {
			c.Write(hello(env.Rank, env.Size))
		}
		return 3
	}
	fmt.Println("ERR unknown role", role)
	return 1
}

// hello is a rank's first message to rank 0.
func hello(rank, size int) []byte {
	var h [16]byte
	binary.BigEndian.PutUint32(h[0:], rdvMagic)
	binary.BigEndian.PutUint32(h[4:], rdvVersion)
	binary.BigEndian.PutUint32(h[8:], uint32(rank))
	binary.BigEndian.PutUint32(h[12:], uint32(size))
	return h[:]
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Skipf("no loopback TCP: %v", err)
	}
	defer ln.Close()
	return strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
}

func TestParseEnv(t *testing.T) {
	cases := []struct {
		name string
		env  map[string]string
		want Env
		err  error
	}{
		{"nothing", nil, Env{Size: 1, Source: "single process"}, nil},
		{"launch", map[string]string{"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
			"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "FLASHATTN_LAUNCH": "1", EnvTimeout: "90s"},
			Env{Rank: 2, Size: 4, LocalRank: 2, LocalSize: 4, Addr: "127.0.0.1:29500", Source: "flashattn launch", Timeout: 90 * time.Second}, nil},
		{"torchrun", map[string]string{"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
			"MASTER_ADDR": "node0", "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "x"},
			Env{Rank: 5, Size: 8, LocalRank: 1, LocalSize: 4, Addr: "node0:1234", Source: "torchrun"}, nil},
		{"torchrun IPv6", map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "::1", "MASTER_PORT": "1234"},
			Env{Rank: 0, Size: 2, Addr: "[::1]:1234", Source: "environment"}, nil},
		{"slurm", map[string]string{"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3",
			"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7", "SLURM_JOB_ID": "123456"},
			Env{Rank: 3, Size: 8, LocalRank: 3, LocalSize: 4, Addr: "10.0.0.7:23456", Source: "slurm"}, nil},
		{"slurm with master", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
			"SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "7", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7"},
			Env{Rank: 0, Size: 2, LocalRank: 0, LocalSize: 2, Addr: "h:7", Source: "slurm"}, nil},
		{"rank without size", map[string]string{"RANK": "1"}, Env{}, attn.ErrOption},
		{"rank outside", map[string]string{"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, Env{}, attn.ErrOption},
		{"not a number", map[string]string{"RANK": "one", "WORLD_SIZE": "4"}, Env{}, attn.ErrOption},
		{"local rank outside", map[string]string{"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, Env{}, attn.ErrOption},
		{"no address", map[string]string{"RANK": "1", "WORLD_SIZE": "2"}, Env{}, attn.ErrOption},
		{"address without port", map[string]string{"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, Env{}, attn.ErrOption},
		{"bad port", map[string]string{"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, Env{}, attn.ErrOption},
		{"bad timeout", map[string]string{EnvTimeout: "soon"}, Env{}, attn.ErrOption},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := ParseEnv(func(k string) string { return c.env[k] })
			if c.err != nil {
				if !errors.Is(err, c.err) {
					t.Fatalf("got %+v, %v; want an error wrapping %v", got, err, c.err)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("got %+v, %v; want %+v", got, err, c.want)
			}
		})
	}
}

// shareAll runs Share on ranks of a group of size on goroutines (ranks
// lists which ranks take part; rank late starts 300 ms after the others,
// -1 for none) and returns each rank's blob and error.
func shareAll(t *testing.T, size int, ranks []int, late int, timeout time.Duration, env func(r int) Env) ([][]byte, []error) {
	t.Helper()
	blobs := make([][]byte, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for _, r := range ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			defer cancel()
			if r == late {
				time.Sleep(300 * time.Millisecond)
			}
			var blob []byte
			if r == 0 {
				blob = testBlob
			}
			blobs[r], errs[r] = env(r).Share(ctx, blob)
		}()
	}
	wg.Wait()
	return blobs, errs
}

func TestShareInProcess(t *testing.T) {
	for _, p := range []int{1, 2, 5} {
		t.Run(fmt.Sprint(p), func(t *testing.T) {
			addr := net.JoinHostPort("127.0.0.1", freePort(t))
			ranks := make([]int, p)
			for r := range ranks {
				ranks[r] = r
			}
			blobs, errs := shareAll(t, p, ranks, -1, 10*time.Second, func(r int) Env { return Env{Rank: r, Size: p, Addr: addr} })
			for r := range p {
				if errs[r] != nil || !bytes.Equal(blobs[r], testBlob) {
					t.Errorf("rank %d: got %x, %v", r, blobs[r], errs[r])
				}
			}
		})
	}
}

func TestShareFailures(t *testing.T) {
	cases := []struct {
		name  string
		size  int
		ranks []int
		env   func(addr string, r int) Env
		want  []string // in every error
		is    error
	}{
		{"missing rank times out", 3, []int{0, 1}, func(addr string, r int) Env { return Env{Rank: r, Size: 3, Addr: addr} },
			[]string{"[2]", "did not arrive"}, context.DeadlineExceeded},
		// Rank 2 comes late, after rank 1 is waiting, so that rank 0 can
		// tell rank 1 why it gives up.
		{"sizes disagree", 3, []int{0, 1, 2}, func(addr string, r int) Env {
			if r == 2 {
				return Env{Rank: r, Size: 4, Addr: addr}
			}
			return Env{Rank: r, Size: 3, Addr: addr}
		}, []string{"group of"}, ErrRendezvous},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			addr := net.JoinHostPort("127.0.0.1", freePort(t))
			start := time.Now()
			_, errs := shareAll(t, c.size, c.ranks, 2, 700*time.Millisecond, func(r int) Env { return c.env(addr, r) })
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("took %v", d)
			}
			for _, r := range c.ranks {
				err := errs[r]
				if !errors.Is(err, ErrRendezvous) {
					t.Errorf("rank %d: %v, want an error wrapping ErrRendezvous", r, err)
					continue
				}
				if r == 0 && !errors.Is(err, c.is) {
					t.Errorf("rank 0: %v, want an error wrapping %v", err, c.is)
				}
				for _, w := range c.want {
					if r != 2 && !strings.Contains(err.Error(), w) {
						t.Errorf("rank %d: %q does not say %q", r, err, w)
					}
				}
			}
		})
	}
	t.Run("bad arguments", func(t *testing.T) {
		for _, e := range []Env{{Rank: 0, Size: 0}, {Rank: 2, Size: 2}, {Rank: 1, Size: 2}} {
			if _, err := e.Share(context.Background(), nil); !errors.Is(err, attn.ErrOption) {
				t.Errorf("%+v: %v, want attn.ErrOption", e, err)
			}
		}
		big := make([]byte, rdvMaxBlob+1)
		if _, err := (Env{Size: 2, Addr: "127.0.0.1:1"}).Share(context.Background(), big); !errors.Is(err, attn.ErrOption) {
			t.Errorf("oversized blob: %v", err)
		}
	})
	t.Run("cause wrapped", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Skipf("no loopback listener: %v", err)
		}
		defer ln.Close()
		_, err = Env{Rank: 0, Size: 2, Addr: ln.Addr().String(), Timeout: time.Second}.Share(context.Background(), nil)
		if !errors.Is(err, ErrRendezvous) || !errors.Is(err, syscall.EADDRINUSE) {
			t.Errorf("rank 0 on a port in use: %v, want an error wrapping ErrRendezvous and EADDRINUSE", err)
		}
	})
}

// startRanks starts the test binary as ranks of a group of size (roles
// maps a rank to its role; ranks without one are not started) and returns
// each started rank's output and error once all have exited.
func startRanks(t *testing.T, size int, roles map[int]string, timeout string) map[int]string {
	t.Helper()
	port := freePort(t)
	cmds := map[int]*exec.Cmd{}
	outs := map[int]*bytes.Buffer{}
	for r, role := range roles {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), childRoleEnv+"="+role, "RANK="+strconv.Itoa(r), "WORLD_SIZE="+strconv.Itoa(size),
			"LOCAL_RANK="+strconv.Itoa(r), "LOCAL_WORLD_SIZE="+strconv.Itoa(size),
			"MASTER_ADDR=127.0.0.1", "MASTER_PORT="+port, EnvTimeout+"="+timeout)
		outs[r] = new(bytes.Buffer)
		cmd.Stdout, cmd.Stderr = outs[r], outs[r]
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds[r] = cmd
	}
	res := map[int]string{}
	for r, cmd := range cmds {
		err := cmd.Wait()
		res[r] = strings.TrimSpace(outs[r].String())
		if err != nil {
			res[r] += fmt.Sprintf(" [exit: %v]", err)
		}
	}
	return res
}

func TestShareProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Run("hand-off", func(t *testing.T) {
		res := startRanks(t, 3, map[int]string{0: "share", 1: "share", 2: "share"}, "20s")
		want := "OK " + hex.EncodeToString(testBlob)
		for r, out := range res {
			if out != want {
				t.Errorf("rank %d: %s", r, out)
			}
		}
	})
	t.Run("a rank dies", func(t *testing.T) {
		// Rank 3 never comes, so the hand-off cannot happen before rank 0
		// sees rank 2 go; the others must not wait for the 20 s timeout.
		start := time.Now()
		res := startRanks(t, 4, map[int]string{0: "share", 1: "share", 2: "die"}, "20s")
		if d := time.Since(start); d > 10*time.Second {
			t.Errorf("the ranks took %v to fail", d)
		}
		for _, r := range []int{0, 1} {
			if !strings.HasPrefix(res[r], "ERR") || !strings.Contains(res[r], "rank 2 disconnected") {
				t.Errorf("rank %d: %s", r, res[r])
			}
		}
		if !strings.Contains(res[2], "exit status 3") {
			t.Errorf("rank 2: %s", res[2])
		}
	})
	t.Run("a rank never comes", func(t *testing.T) {
		res := startRanks(t, 3, map[int]string{0: "share", 1: "share"}, "1s")
		for _, r := range []int{0, 1} {
			if !strings.HasPrefix(res[r], "ERR") || !strings.Contains(res[r], "ranks [2] did not arrive") {
				t.Errorf("rank %d: %s", r, res[r])
			}
		}
	})
}
