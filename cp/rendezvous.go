package cp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/flashattn/flashattn/attn"
)

// ErrRendezvous reports a rendezvous that failed: a rank that did not show
// up in time, died, or disagreed about the group.
var ErrRendezvous = errors.New("rendezvous failed")

// DefaultRendezvousTimeout bounds Env.Share when neither its context nor
// Env.Timeout gives a limit.
const DefaultRendezvousTimeout = 5 * time.Minute

// EnvTimeout is the environment variable that sets Env.Timeout (a Go
// duration such as "90s"); flashattn launch sets it from --timeout.
const EnvTimeout = "FLASHATTN_CP_TIMEOUT"

// Env is where this process stands in a job of several processes, as its
// launcher described it in the environment.
type Env struct {
	// Rank is this process's rank in [0, Size).
	Rank, Size int
	// LocalRank is its rank among the LocalSize processes of its machine;
	// it usually selects the GPU. LocalSize is 0 when unknown.
	LocalRank, LocalSize int
	// Addr is the host:port on which rank 0 listens during Share.
	Addr string
	// Source names what set the environment: "flashattn launch",
	// "torchrun", "slurm", "environment" (RANK and WORLD_SIZE set by
	// something else) or "single process" (nothing set).
	Source string
	// Timeout bounds Share when its context has no deadline (0:
	// DefaultRendezvousTimeout).
	Timeout time.Duration
}

// FromEnv describes this process from its environment (see ParseEnv).
func FromEnv() (Env, error) { return ParseEnv(os.Getenv) }

// ParseEnv describes a process from the environment getenv reads:
//
//   - RANK and WORLD_SIZE, as flashattn launch and torchrun set them, with
//     LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
//   - otherwise SLURM_PROCID and SLURM_NTASKS, as srun sets them, with
//     SLURM_LOCALID and SLURM_NTASKS_PER_NODE (or SLURM_TASKS_PER_NODE);
//     the address is MASTER_ADDR, else SLURM_LAUNCH_NODE_IPADDR (the node
//     srun ran on, which must be rank 0's: set MASTER_ADDR otherwise),
//     and the port MASTER_PORT, else one derived from SLURM_JOB_ID;
//   - otherwise a single process, rank 0 of 1.
//
// FLASHATTN_CP_TIMEOUT sets Timeout. A group of more than one rank needs
// an address and a port. A value that does not parse, or ranks outside
// their group, fail with an error wrapping attn.ErrOption.
func ParseEnv(getenv func(string) string) (Env, error) {
	e := Env{Source: "single process", Size: 1}
	var err error
	if t := getenv(EnvTimeout); t != "" {
		d, perr := time.ParseDuration(t)
		if perr != nil || d < 0 {
			return Env{}, attn.Errorf(attn.ErrOption, "cp: %s=%q is not a duration", EnvTimeout, t)
		}
		e.Timeout = d
	}
	num := func(name string) (int, bool) {
		v := strings.TrimSpace(getenv(name))
		if v == "" {
			return 0, false
		}
		// Slurm writes counts per node as "4(x2)" or "4,2": the first
		// number is this node's, for the homogeneous jobs this reads.
		if i := strings.IndexAny(v, "(,"); i > 0 && strings.HasPrefix(name, "SLURM_") {
			v = v[:i]
		}
		n, perr := strconv.Atoi(v)
		if perr != nil && err == nil {
			err = attn.Errorf(attn.ErrOption, "cp: %s=%q is not an integer", name, getenv(name))
		}
		return n, perr == nil
	}
	host, port := getenv("MASTER_ADDR"), getenv("MASTER_PORT")
	switch {
	case getenv("RANK") != "" || getenv("WORLD_SIZE") != "":
		e.Source = "environment"
		if getenv("FLASHATTN_LAUNCH") != "" {
			e.Source = "flashattn launch"
		} else if getenv("TORCHELASTIC_RUN_ID") != "" || getenv("TORCHELASTIC_RESTART_COUNT") != "" {
			e.Source = "torchrun"
		}
		var okR, okW bool
		e.Rank, okR = num("RANK")
		e.Size, okW = num("WORLD_SIZE")
		if err == nil && (!okR || !okW) {
			return Env{}, attn.Errorf(attn.ErrOption, "cp: RANK and WORLD_SIZE must both be set (RANK=%q WORLD_SIZE=%q)", getenv("RANK"), getenv("WORLD_SIZE"))
		}
		var ok bool
		if e.LocalRank, ok = num("LOCAL_RANK"); !ok {
			e.LocalRank = e.Rank
		}
		e.LocalSize, _ = num("LOCAL_WORLD_SIZE")
	case getenv("SLURM_PROCID") != "" && getenv("SLURM_NTASKS") != "":
		e.Source = "slurm"
		e.Rank, _ = num("SLURM_PROCID")
		e.Size, _ = num("SLURM_NTASKS")
		e.LocalRank, _ = num("SLURM_LOCALID")
		if n, ok := num("SLURM_NTASKS_PER_NODE"); ok {
			e.LocalSize = n
		} else {
			e.LocalSize, _ = num("SLURM_TASKS_PER_NODE")
		}
		if host == "" {
			host = getenv("SLURM_LAUNCH_NODE_IPADDR")
		}
		if port == "" {
			if job, ok := num("SLURM_JOB_ID"); ok {
				port = strconv.Itoa(20000 + job%20000)
			}
		}
	}
	if err != nil {
		return Env{}, err
	}
	if e.Size < 1 {
		return Env{}, attn.Errorf(attn.ErrOption, "cp: a group of %d ranks (%s)", e.Size, e.Source)
	}
	if e.Rank < 0 || e.Rank >= e.Size {
		return Env{}, attn.Errorf(attn.ErrOption, "cp: rank %d outside a group of %d ranks (%s)", e.Rank, e.Size, e.Source)
	}
	if e.LocalRank < 0 || (e.LocalSize > 0 && e.LocalRank >= e.LocalSize) {
		return Env{}, attn.Errorf(attn.ErrOption, "cp: local rank %d outside %d local ranks (%s)", e.LocalRank, e.LocalSize, e.Source)
	}
	if host != "" || port != "" {
		if host == "" || port == "" {
			return Env{}, attn.Errorf(attn.ErrOption, "cp: the rendezvous needs both an address and a port, got %q and %q (%s)", host, port, e.Source)
		}
		if p, perr := strconv.Atoi(port); perr != nil || p < 1 || p > 65535 {
			return Env{}, attn.Errorf(attn.ErrOption, "cp: port %q (%s)", port, e.Source)
		}
		e.Addr = net.JoinHostPort(host, port)
	} else if e.Size > 1 {
		return Env{}, attn.Errorf(attn.ErrOption, "cp: rank %d of %d has no rendezvous address: set MASTER_ADDR and MASTER_PORT (%s)", e.Rank, e.Size, e.Source)
	}
	return e, nil
}

// The rendezvous protocol, over one TCP connection from each rank r > 0 to
// rank 0: r sends a hello (magic, version, its rank, the group size);
// once every rank has said hello, rank 0 answers each with a status byte,
// a length and the blob (status ok) or a message (status failed); r
// acknowledges the blob with one byte. Rank 0 answers failed to every rank
// it holds when anything goes wrong, so that nobody waits for a timeout.
const (
	rdvMagic   = 0x46414350 // "FACP"
	rdvVersion = 1
	rdvOK      = 0
	rdvFailed  = 1
	rdvAck     = 0xac
	// rdvMaxBlob bounds what a rank accepts from rank 0.
	rdvMaxBlob = 1 << 20
	// rdvGrace is how long a rank waits for rank 0's verdict past its own
	// deadline: rank 0 knows who is missing.
	rdvGrace = time.Second
)

// Share hands blob from rank 0 to every rank: rank 0 passes the blob and
// gets it back, the others pass nil and receive it. It returns once every
// rank has arrived, and also serves as a barrier. Rank 0 listens on Addr's
// port; the others connect, retrying until rank 0 is up. It fails with an
// error wrapping ErrRendezvous that names the ranks at fault when ctx
// ends first (Timeout or DefaultRendezvousTimeout without a deadline), a
// rank disconnects before the hand-off, or the ranks disagree about the
// group. A rank that arrives after rank 0 gave up finds nobody listening
// and waits for its own deadline; under flashattn launch, rank 0's exit
// ends it at once.
func (e Env) Share(ctx context.Context, blob []byte) ([]byte, error) {
	if e.Size < 1 || e.Rank < 0 || e.Rank >= e.Size {
		return nil, attn.Errorf(attn.ErrOption, "cp: rendezvous of rank %d among %d", e.Rank, e.Size)
	}
	if e.Rank == 0 && len(blob) > rdvMaxBlob {
		return nil, attn.Errorf(attn.ErrOption, "cp: rendezvous blob of %d bytes (at most %d)", len(blob), rdvMaxBlob)
	}
	if e.Size == 1 {
		return slices.Clone(blob), nil
	}
	if e.Addr == "" {
		return nil, attn.Errorf(attn.ErrOption, "cp: rank %d of %d: no rendezvous address", e.Rank, e.Size)
	}
	if _, ok := ctx.Deadline(); !ok {
		d := e.Timeout
		if d <= 0 {
			d = DefaultRendezvousTimeout
		}
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	if e.Rank == 0 {
		return slices.Clone(blob), e.serve(ctx, blob)
	}
	return e.join(ctx)
}

// rdvErrorf returns an ErrRendezvous error of rank; a %w in format also
// wraps its cause (a network error, a deadline).
func rdvErrorf(rank int, format string, args ...any) error {
	return fmt.Errorf("cp: rendezvous: rank %d: %w: %w", rank, fmt.Errorf(format, args...), ErrRendezvous)
}

// peerEvent is what rank 0 learns about a connected rank: its hello
// (rank and size), its acknowledgement, or its connection failing (err).
type peerEvent struct {
	conn       net.Conn
	rank, size int // rank is -1 before the hello
	ack        bool
	err        error
}

// serve is rank 0's side: accept every other rank, hand over blob, wait for
// the acknowledgements.
func (e Env) serve(ctx context.Context, blob []byte) error {
	_, port, err := net.SplitHostPort(e.Addr)
	if err != nil {
		return rdvErrorf(0, "address %q: %w", e.Addr, err)
	}
	// Listen on every interface, unless the address is a loopback one.
	listen := ":" + port
	if host, _, _ := net.SplitHostPort(e.Addr); host == "localhost" || net.ParseIP(host).IsLoopback() {
		listen = e.Addr
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", listen)
	if err != nil {
		return rdvErrorf(0, "listening on %s: %w", listen, err)
	}
	defer ln.Close()
	events := make(chan peerEvent, 2*e.Size)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return // the listener closed
			}
			go readPeer(c, events)
		}
	}()
	conns := map[int]net.Conn{}
	var stray []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
		for _, c := range stray {
			c.Close()
		}
	}()
	// fail tells every connected rank why the rendezvous failed.
	fail := func(err error) error {
		for _, c := range conns {
			writeVerdict(c, rdvFailed, []byte(err.Error()))
		}
		return err
	}
	for len(conns) < e.Size-1 {
		select {
		case <-ctx.Done():
			return fail(fmt.Errorf("cp: rendezvous: rank 0: ranks %v did not arrive at %s: %w: %w", missing(conns, e.Size), e.Addr, ErrRendezvous, context.Cause(ctx)))
		case ev := <-events:
			switch {
			case ev.err != nil && ev.rank < 0:
				stray = append(stray, ev.conn) // not one of ours, or it said nothing
			case ev.err != nil:
				return fail(rdvErrorf(0, "rank %d disconnected before the hand-off (%w): did it die?", ev.rank, ev.err))
			case ev.size != e.Size || ev.rank < 1 || ev.rank >= e.Size:
				stray = append(stray, ev.conn)
				writeVerdict(ev.conn, rdvFailed, []byte(fmt.Sprintf("rank 0 leads a group of %d ranks", e.Size)))
				return fail(rdvErrorf(0, "a process says it is rank %d of %d, in a group of %d ranks", ev.rank, ev.size, e.Size))
			default:
				if _, dup := conns[ev.rank]; dup {
					stray = append(stray, ev.conn)
					return fail(rdvErrorf(0, "two processes claim rank %d", ev.rank))
				}
				conns[ev.rank] = ev.conn
			}
		}
	}
	for _, c := range conns {
		if err := writeVerdict(c, rdvOK, blob); err != nil {
			return fail(rdvErrorf(0, "sending to %v: %w", c.RemoteAddr(), err))
		}
	}
	for acked := 0; acked < e.Size-1; {
		select {
		case <-ctx.Done():
			return fmt.Errorf("cp: rendezvous: rank 0: not every rank acknowledged: %w: %w", ErrRendezvous, context.Cause(ctx))
		case ev := <-events:
			switch {
			case ev.ack:
				acked++
			case ev.err != nil && ev.rank >= 0:
				return rdvErrorf(0, "rank %d disconnected during the hand-off (%w): did it die?", ev.rank, ev.err)
			}
		}
	}
	return nil
}

// missing lists the ranks in [1, size) that have no connection.
func missing(conns map[int]net.Conn, size int) []int {
	var m []int
	for r := 1; r < size; r++ {
		if _, ok := conns[r]; !ok {
			m = append(m, r)
		}
	}
	return m
}

// readPeer reads a rank's hello and then its acknowledgement, reporting
// each, or the error that ends the connection, on events.
func readPeer(c net.Conn, events chan<- peerEvent) {
	var h [16]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		events <- peerEvent{conn: c, rank: -1, err: err}
		return
	}
	magic, version := binary.BigEndian.Uint32(h[0:]), binary.BigEndian.Uint32(h[4:])
	rank := int(int32(binary.BigEndian.Uint32(h[8:])))
	size := int(int32(binary.BigEndian.Uint32(h[12:])))
	if magic != rdvMagic || version != rdvVersion {
		events <- peerEvent{conn: c, rank: -1, err: fmt.Errorf("not a rendezvous hello")}
		return
	}
	events <- peerEvent{conn: c, rank: rank, size: size}
	var b [1]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		events <- peerEvent{conn: c, rank: rank, err: err}
		return
	}
	if b[0] != rdvAck {
		events <- peerEvent{conn: c, rank: rank, err: fmt.Errorf("bad acknowledgement %#x", b[0])}
		return
	}
	events <- peerEvent{conn: c, rank: rank, ack: true}
}

// writeVerdict sends rank 0's answer: a status, a length and the payload.
func writeVerdict(c net.Conn, status byte, payload []byte) error {
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	msg := make([]byte, 5+len(payload))
	msg[0] = status
	binary.BigEndian.PutUint32(msg[1:], uint32(len(payload)))
	copy(msg[5:], payload)
	_, err := c.Write(msg)
	return err
}

// join is the side of a rank other than 0: connect (retrying while rank 0
// is not up), say hello, receive the blob and acknowledge it.
func (e Env) join(ctx context.Context) ([]byte, error) {
	c, err := dial(ctx, e.Addr)
	if err != nil {
		return nil, fmt.Errorf("cp: rendezvous: rank %d: rank 0 not reachable at %s: %w: %w", e.Rank, e.Addr, ErrRendezvous, err)
	}
	defer c.Close()
	// A cancelled context closes the connection; a deadline leaves rank 0
	// a grace period to say who is missing.
	stop := context.AfterFunc(ctx, func() {
		if ctx.Err() != context.DeadlineExceeded {
			c.Close()
		}
	})
	defer stop()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl.Add(rdvGrace))
	}
	var h [16]byte
	binary.BigEndian.PutUint32(h[0:], rdvMagic)
	binary.BigEndian.PutUint32(h[4:], rdvVersion)
	binary.BigEndian.PutUint32(h[8:], uint32(e.Rank))
	binary.BigEndian.PutUint32(h[12:], uint32(e.Size))
	if _, err := c.Write(h[:]); err != nil {
		return nil, rdvErrorf(e.Rank, "saying hello to rank 0 at %s: %w", e.Addr, err)
	}
	var v [5]byte
	if _, err := io.ReadFull(c, v[:]); err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("cp: rendezvous: rank %d: no answer from rank 0 at %s: %w: %w", e.Rank, e.Addr, ErrRendezvous, context.Cause(ctx))
		}
		return nil, rdvErrorf(e.Rank, "rank 0 at %s closed the connection before the hand-off (%w): did it die?", e.Addr, err)
	}
	n := binary.BigEndian.Uint32(v[1:])
	if n > rdvMaxBlob {
		return nil, rdvErrorf(e.Rank, "rank 0 announced %d bytes", n)
	}
	payload := make([]byte, n)
	if _, err := io.ReadFull(c, payload); err != nil {
		return nil, rdvErrorf(e.Rank, "reading from rank 0: %w", err)
	}
	if v[0] != rdvOK {
		return nil, rdvErrorf(e.Rank, "rank 0 reported: %s", payload)
	}
	if _, err := c.Write([]byte{rdvAck}); err != nil {
		return nil, rdvErrorf(e.Rank, "acknowledging: %w", err)
	}
	return payload, nil
}

// dial connects to addr, retrying every 50 ms until ctx ends.
func dial(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	var last error
	for {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			return c, nil
		}
		last = err
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w (last attempt: %v)", context.Cause(ctx), last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
