package main

import (
	"bytes"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestLaunch(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	killGrace = 500 * time.Millisecond
	cases := []struct {
		name   string
		args   []string
		code   int
		stdout []string // lines that must appear
		stderr []string // words the error must hold
		within time.Duration
	}{
		{name: "environment", args: []string{"-n", "3", "--master-port", "29511", "--", "sh", "-c",
			`echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $FLASHATTN_LAUNCH"`},
			stdout: []string{"[rank 0] 0 3 0 3 127.0.0.1 29511 1", "[rank 1] 1 3 1 3 127.0.0.1 29511 1", "[rank 2] 2 3 2 3 127.0.0.1 29511 1"},
			within: 10 * time.Second},
		{name: "a rank fails", args: []string{"-n", "3", "--", "sh", "-c",
			`if [ "$RANK" = 1 ]; then echo going; exit 3; fi; sleep 30`},
			code: 1, stdout: []string{"[rank 1] going"}, stderr: []string{"rank 1 exited with status 3", "stopped"},
			within: 10 * time.Second},
		{name: "a rank is killed", args: []string{"-n", "2", "--", "sh", "-c",
			`if [ "$RANK" = 0 ]; then kill -9 $$; fi; sleep 30`},
			code: 1, stderr: []string{"rank 0 was killed by signal killed"}, within: 10 * time.Second},
		{name: "timeout", args: []string{"-n", "2", "--timeout", "300ms", "--", "sh", "-c", `echo "$FLASHATTN_CP_TIMEOUT"; sleep 30`},
			code: 1, stdout: []string{"[rank 0] 300ms"}, stderr: []string{"--timeout 300ms"}, within: 10 * time.Second},
		{name: "no such command", args: []string{"-n", "2", "--", "/nonexistent/program"},
			code: 1, stderr: []string{"rank 0: starting /nonexistent/program"}, within: 10 * time.Second},
		{name: "no command", args: []string{"-n", "2"}, code: 2, stderr: []string{"needs a command"}, within: time.Second},
		{name: "no processes", args: []string{"-n", "0", "--", "true"}, code: 2, stderr: []string{"-n must be at least 1"}, within: time.Second},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			start := time.Now()
			code := dispatch(append([]string{"launch"}, c.args...), &stdout, &stderr)
			if d := time.Since(start); d > c.within {
				t.Errorf("took %v", d)
			}
			if code != c.code {
				t.Errorf("exit status %d, want %d; stderr %q", code, c.code, stderr.String())
			}
			lines := strings.Split(stdout.String(), "\n")
			for _, w := range c.stdout {
				if !containsLine(lines, w) {
					t.Errorf("stdout %q lacks the line %q", stdout.String(), w)
				}
			}
			for _, w := range c.stderr {
				if !strings.Contains(stderr.String(), w) {
					t.Errorf("stderr %q does not say %q", stderr.String(), w)
				}
			}
		})
	}
}

// containsLine reports whether lines holds want.
func containsLine(lines []string, want string) bool {
	for _, l := range lines {
		if l == want {
			return true
		}
	}
	return false
}

func TestPrefixWriter(t *testing.T) {
	var out bytes.Buffer
	p := &prefixWriter{mu: new(sync.Mutex), w: &out, prefix: "[rank 3] "}
	for _, chunk := range []string{"a", "b\nc\n", "", "d\ne", "f"} {
		fmt.Fprint(p, chunk)
	}
	p.flush()
	if want := "[rank 3] ab\n[rank 3] c\n[rank 3] d\n[rank 3] ef\n"; out.String() != want {
		t.Fatalf("got %q, want %q", out.String(), want)
	}
}
