package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/flashattn/flashattn/cp"
)

const launchUsage = `Usage: flashattn launch -n P [flags] -- <command> [args]

Starts P processes of <command> on this machine, as torchrun does: each gets
RANK and LOCAL_RANK (0 … P-1), WORLD_SIZE and LOCAL_WORLD_SIZE (P), and
MASTER_ADDR and MASTER_PORT, where rank 0 hands the NCCL unique id to the
others (cp.FromEnv and cp.OpenNCCL read them). Each line a process writes
is forwarded with a "[rank r]" prefix. When a process exits with a non-zero
status or is killed, the others are stopped (SIGTERM, then SIGKILL) and
launch fails naming that rank. Ctrl-C (SIGINT) and SIGTERM are forwarded.

Flags:
  -n P                 number of processes (at least 1)
  --timeout D          stop every process after D (a Go duration such as
                       90s; 0: no limit); also exported as
                       FLASHATTN_CP_TIMEOUT, which bounds the rendezvous
  --master-addr HOST   address of rank 0's rendezvous (default 127.0.0.1)
  --master-port PORT   its port (default: a free one)
`

// launchStderr receives the processes' standard error (prefixed).
var launchStderr io.Writer = os.Stderr

// killGrace is how long a stopped process has between SIGTERM and SIGKILL.
var killGrace = 3 * time.Second

func init() {
	c := &command{name: "launch", summary: "start P processes of a multi-process job (like torchrun)", usage: launchUsage}
	c.run = func(args []string, stdout io.Writer) error {
		fs := newFlagSet(c)
		n := fs.Int("n", 0, "")
		timeout := fs.Duration("timeout", 0, "")
		addr := fs.String("master-addr", "127.0.0.1", "")
		port := fs.Int("master-port", 0, "")
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return err
			}
			return usageErrorf("%v", err)
		}
		switch {
		case *n < 1:
			return usageErrorf("-n must be at least 1, got %d", *n)
		case *timeout < 0:
			return usageErrorf("--timeout must not be negative, got %v", *timeout)
		case *port < 0 || *port > 65535:
			return usageErrorf("--master-port %d", *port)
		case fs.NArg() == 0:
			return usageErrorf("launch needs a command after --")
		}
		return launch(launchJob{procs: *n, timeout: *timeout, addr: *addr, port: *port, argv: fs.Args()}, stdout, launchStderr)
	}
	register(c)
}

// launchJob is what launch starts.
type launchJob struct {
	procs   int
	timeout time.Duration
	addr    string
	port    int
	argv    []string
}

// exitOf is one process's end.
type exitOf struct {
	rank int
	err  error
}

// launch runs job's processes to the end and returns nil when all exited
// with status 0, or an error naming the first rank that failed.
func launch(job launchJob, stdout, stderr io.Writer) error {
	port := job.port
	if port == 0 {
		p, err := freeTCPPort(job.addr)
		if err != nil {
			return err
		}
		port = p
	}
	var outMu sync.Mutex
	cmds := make([]*exec.Cmd, job.procs)
	var flush []*prefixWriter
	exits := make(chan exitOf, job.procs)
	started := 0
	exited := make([]bool, job.procs)
	stopAll := func(sig syscall.Signal) {
		for r, c := range cmds[:started] {
			if !exited[r] {
				syscall.Kill(-c.Process.Pid, sig) // the process group: its children too
			}
		}
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)

	var failure error
	for r := range job.procs {
		c := exec.Command(job.argv[0], job.argv[1:]...)
		c.Env = append(os.Environ(),
			"RANK="+strconv.Itoa(r), "WORLD_SIZE="+strconv.Itoa(job.procs),
			"LOCAL_RANK="+strconv.Itoa(r), "LOCAL_WORLD_SIZE="+strconv.Itoa(job.procs),
			"GROUP_RANK=0", "MASTER_ADDR="+job.addr, "MASTER_PORT="+strconv.Itoa(port), "FLASHATTN_LAUNCH=1")
		if job.timeout > 0 {
			c.Env = append(c.Env, cp.EnvTimeout+"="+job.timeout.String())
		}
		o := &prefixWriter{mu: &outMu, w: stdout, prefix: fmt.Sprintf("[rank %d] ", r)}
		e := &prefixWriter{mu: &outMu, w: stderr, prefix: fmt.Sprintf("[rank %d] ", r)}
		flush = append(flush, o, e)
		c.Stdout, c.Stderr = o, e
		c.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		c.WaitDelay = time.Second // a leftover child holding the output must not hold launch
		cmds[r] = c
		if err := c.Start(); err != nil {
			failure = fmt.Errorf("rank %d: starting %s: %w", r, job.argv[0], err)
			break
		}
		started++
		go func() { exits <- exitOf{r, c.Wait()} }()
	}

	var deadline <-chan time.Time
	if job.timeout > 0 {
		deadline = time.After(job.timeout)
	}
	var kill <-chan time.Time
	stop := func(err error) {
		if failure == nil {
			failure = err
		}
		if kill == nil {
			stopAll(syscall.SIGTERM)
			kill = time.After(killGrace)
		}
	}
	if failure != nil {
		stop(failure)
	}
	for left := started; left > 0; {
		select {
		case ex := <-exits:
			left--
			exited[ex.rank] = true
			if ex.err != nil && failure == nil {
				stop(fmt.Errorf("rank %d %s; the other ranks were stopped", ex.rank, describeExit(ex.err)))
			}
		case <-deadline:
			stop(fmt.Errorf("the job ran past --timeout %v; every rank was stopped", job.timeout))
		case s := <-sigs:
			sig := s.(syscall.Signal)
			if failure == nil {
				failure = fmt.Errorf("interrupted by %v; forwarded to every rank", sig)
				stopAll(sig)
				kill = time.After(killGrace)
			} else {
				stopAll(syscall.SIGKILL) // a second signal: no more waiting
			}
		case <-kill:
			stopAll(syscall.SIGKILL)
			kill = make(chan time.Time) // never again
		}
	}
	for _, w := range flush {
		w.flush()
	}
	return failure
}

// describeExit says how a process ended, from exec.Cmd.Wait's error.
func describeExit(err error) string {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if st, ok := ee.Sys().(syscall.WaitStatus); ok && st.Signaled() {
			return fmt.Sprintf("was killed by signal %v", st.Signal())
		}
		return fmt.Sprintf("exited with status %d", ee.ExitCode())
	}
	return fmt.Sprintf("failed: %v", err)
}

// freeTCPPort returns a port on host that was free a moment ago.
func freeTCPPort(host string) (int, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, fmt.Errorf("finding a free port on %s: %w", host, err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// prefixWriter forwards whole lines to w, each after prefix; writers that
// share mu never interleave within a line.
type prefixWriter struct {
	mu     *sync.Mutex
	w      io.Writer
	prefix string
	buf    []byte
}

// Write forwards the complete lines of what was written so far.
func (p *prefixWriter) Write(b []byte) (int, error) {
	p.buf = append(p.buf, b...)
	i := bytes.LastIndexByte(p.buf, '\n')
	if i < 0 {
		return len(b), nil
	}
	lines := p.buf[:i+1]
	var out []byte
	for len(lines) > 0 {
		j := bytes.IndexByte(lines, '\n')
		out = append(out, p.prefix...)
		out = append(out, lines[:j+1]...)
		lines = lines[j+1:]
	}
	p.buf = append(p.buf[:0], p.buf[i+1:]...)
	p.mu.Lock()
	defer p.mu.Unlock()
	_, err := p.w.Write(out)
	return len(b), err
}

// flush forwards a last line that had no newline.
func (p *prefixWriter) flush() {
	if len(p.buf) > 0 {
		p.Write([]byte{'\n'})
	}
}
