package cp

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/flashattn/flashattn/cuda"
)

// fakeNCCLSource is a stand-in libnccl.so.2. Its constructors encode their
// arguments in the communicator handle they return, to check how the
// unique id (a 128-byte struct passed by value), the rank after it and the
// configuration reach C. It also keeps a log of the group calls, each with
// the calling thread, the group depth on that thread and the device the
// test made current on that thread (fakeSetDevice stands for the CUDA
// context), and it can be told to fail a rank, to report ranks in progress
// for a number of polls, to fail one asynchronously, or to hold
// ncclGroupEnd until released. Built with -DNO_CONFIG it lacks
// ncclCommInitRankConfig, as NCCL before 2.14 does.
const fakeNCCLSource = `
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <unistd.h>
#include <sys/syscall.h>
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct { uint64_t size; unsigned magic, version; int blocking; } config;

/* The log: each entry is {kind, a, b, c, d, e, f, g}. */
enum { evGroupStart = 1, evInit = 2, evGroupEnd = 3, evAbort = 4, evUniqueId = 5 };
#define MAXEV 256
static long events[MAXEV][8];
static int nEvents;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread long curDev = -1; /* what the test made current on this thread */
static __thread long depth;       /* group nesting on this thread */
static int failRank = -1, asyncFailRank = -1, pending;
static volatile int holdEnd;
static int polls[100];

static void record(long k, long a, long b, long c, long d, long e, long f, long g) {
	pthread_mutex_lock(&mu);
	if (nEvents < MAXEV) {
		long* ev = events[nEvents++];
		ev[0] = k; ev[1] = a; ev[2] = b; ev[3] = c; ev[4] = d; ev[5] = e; ev[6] = f; ev[7] = g;
	}
	pthread_mutex_unlock(&mu);
}
static long tid(void) { return (long)syscall(SYS_gettid); }
static uintptr_t idSum(ncclUniqueId id) {
	uintptr_t s = 0;
	for (int i = 0; i < 128; i++) s += (unsigned char)id.internal[i] * (i + 1);
	return s;
}
static uintptr_t encode(int n, ncclUniqueId id, int r) { return idSum(id) * 100000 + n * 100 + r; }

int fakeSetDevice(long d) { curDev = d; return 0; }
int fakeConfigure(int fail, int asyncFail, int pendingPolls, int hold) {
	failRank = fail; asyncFailRank = asyncFail; pending = pendingPolls; holdEnd = hold;
	memset(polls, 0, sizeof polls);
	return 0;
}
int fakeRelease(void) { holdEnd = 0; return 0; }
int fakeEvent(int i, long* out) {
	pthread_mutex_lock(&mu);
	int n = nEvents;
	if (i >= 0 && i < n) memcpy(out, events[i], sizeof events[i]);
	pthread_mutex_unlock(&mu);
	return n;
}

int ncclGetVersion(int* v) { *v = 22703; return 0; }
int ncclGetUniqueId(ncclUniqueId* id) {
	for (int i = 0; i < 128; i++) id->internal[i] = (char)(i * 5 + 1);
	record(evUniqueId, tid(), 0, 0, 0, 0, 0, 0);
	return 0;
}
int ncclGroupStart(void) { depth++; record(evGroupStart, tid(), depth, 0, 0, 0, 0, 0); return 0; }
int ncclGroupEnd(void) {
	record(evGroupEnd, tid(), depth, 0, 0, 0, 0, 0);
	depth--;
	while (holdEnd) usleep(1000);
	return 0;
}
static int init(void** c, int n, ncclUniqueId id, int r, long blocking) {
	record(evInit, r, n, (long)idSum(id), curDev, tid(), depth, blocking);
	if (r == failRank) return 5; /* ncclInvalidUsage, no communicator */
	*c = (void*)encode(n, id, r);
	return 0;
}
int ncclCommInitRank(void** c, int n, ncclUniqueId id, int r) {
	if (depth == 0) { *c = (void*)encode(n, id, r); return 0; } /* the calling-convention check */
	return init(c, n, id, r, -1);
}
#ifndef NO_CONFIG
int ncclCommInitRankConfig(void** c, int n, ncclUniqueId id, int r, config* cfg) {
	/* ncclInProgress for the expected non-blocking configuration, else ncclInvalidArgument */
	int ok = cfg->magic == 0xcafebeef && cfg->size == 20 && cfg->version == 21400 && cfg->blocking == 0;
	if (depth == 0) { *c = (void*)encode(n, id, r); return ok ? 7 : 4; }
	if (!ok) return 4;
	int res = init(c, n, id, r, cfg->blocking);
	return res ? res : 7;
}
#endif
int ncclCommGetAsyncError(void* c, int* st) {
	int r = (int)((uintptr_t)c % 100);
	pthread_mutex_lock(&mu);
	int p = ++polls[r];
	pthread_mutex_unlock(&mu);
	*st = r == asyncFailRank ? 6 : p <= pending ? 7 : 0;
	return 0;
}
int ncclCommAbort(void* c) { record(evAbort, (long)((uintptr_t)c % 100), 0, 0, 0, 0, 0, 0); return 0; }
const char* ncclGetErrorString(int r) { return r == 4 ? "invalid argument" : "other"; }
#define STUB(name) int name() { return 0; }
STUB(ncclCommDestroy) STUB(ncclCommCuDevice) STUB(ncclSend) STUB(ncclRecv) STUB(ncclAllGather) STUB(ncclCommCount)
`

// buildFakeNCCL compiles the stand-in NCCL with the extra compiler flags
// and returns its path, skipping the test without a C compiler.
func buildFakeNCCL(t *testing.T, flags ...string) string {
	t.Helper()
	cc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("no C compiler to build a stand-in NCCL")
	}
	dir := t.TempDir()
	src, lib := filepath.Join(dir, "fake.c"), filepath.Join(dir, "libnccl.so.2")
	if err := os.WriteFile(src, []byte(fakeNCCLSource), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"-shared", "-fPIC", "-o", lib, src, "-lpthread"}, flags...)
	if out, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
		t.Skipf("building a stand-in NCCL: %v\n%s", err, out)
	}
	return lib
}

func TestNCCLCallingConvention(t *testing.T) {
	a, err := openNCCL([]string{buildFakeNCCL(t)})
	if err != nil {
		t.Fatal(err)
	}
	if a.version != 22703 || a.commInitRankCfg == nil || a.commFinalize != 0 {
		t.Fatalf("version %d, config constructor %v, finalize %#x", a.version, a.commInitRankCfg != nil, a.commFinalize)
	}
	var id ncclUniqueIDArg
	var sum uintptr
	for i := range id.internal {
		id.internal[i] = byte(i*7 + 3)
		sum += uintptr(id.internal[i]) * uintptr(i+1)
	}
	want := sum*100000 + 5*100 + 3
	c := newCommCell()
	if r := a.commInitRank(c, 5, id, 3); r != 0 || *c != want {
		t.Errorf("ncclCommInitRank: result %d, handle %d, want %d", r, *c, want)
	}
	*c = 0
	if r := NCCLResult(a.commInitRankCfg(c, 5, id, 3, newNCCLConfig())); r != NCCLInProgress || *c != want {
		t.Errorf("ncclCommInitRankConfig: result %v, handle %d, want ncclInProgress and %d", r, *c, want)
	}
	if e := a.err("op", NCCLInvalidArgument, 0); e.Message != "invalid argument" {
		t.Errorf("error string %q", e.Message)
	}
}

// standIn is the stand-in library loaded for a test: its API and its
// test-only entry points.
type standIn struct {
	api                                  *ncclAPI
	setDevice, configure, release, event uintptr
}

// loadFakeNCCL builds and loads a stand-in NCCL with the compiler flags.
func loadFakeNCCL(t *testing.T, flags ...string) *standIn {
	t.Helper()
	path := buildFakeNCCL(t, flags...)
	a, err := openNCCL([]string{path})
	if err != nil {
		t.Fatal(err)
	}
	lib, err := cuda.OpenLibrary([]string{path}, ErrNoNCCL)
	if err != nil {
		t.Fatal(err)
	}
	f := &standIn{api: a}
	if err := lib.Symbols(map[string]*uintptr{"fakeSetDevice": &f.setDevice, "fakeConfigure": &f.configure,
		"fakeRelease": &f.release, "fakeEvent": &f.event}); err != nil {
		t.Fatal(err)
	}
	return f
}

// fakeEvent is one entry of the stand-in's log.
type fakeEvent [8]int64

// The kinds of logged calls.
const (
	evGroupStart = 1
	evInit       = 2
	evGroupEnd   = 3
	evAbort      = 4
	evUniqueID   = 5
)

// events returns the stand-in's log.
func (f *standIn) events() []fakeEvent {
	var ev fakeEvent
	n := int(ncall(f.event, 0, uintptr(unsafe.Pointer(&ev))))
	out := make([]fakeEvent, n)
	for i := range out {
		ncall(f.event, uintptr(i), uintptr(unsafe.Pointer(&out[i])))
	}
	return out
}

// kinds returns the kinds of the logged calls, in order.
func kinds(evs []fakeEvent) []int64 {
	var out []int64
	for _, e := range evs {
		out = append(out, e[0])
	}
	return out
}

// aborted returns the ranks whose communicators the log shows aborted,
// once each.
func aborted(evs []fakeEvent) map[int64]int {
	out := map[int64]int{}
	for _, e := range evs {
		if e[0] == evAbort {
			out[e[1]]++
		}
	}
	return out
}

func TestNCCLGroupInit(t *testing.T) {
	const size = 3
	errDevice := errors.New("device 1 is closed")
	cases := []struct {
		name        string
		flags       []string // compiler flags of the stand-in
		failRank    int      // ncclCommInitRank* fails for this rank
		asyncFail   int      // this rank reports ncclRemoteError when polled
		pending     int      // polls answered ncclInProgress per rank
		hold        bool     // ncclGroupEnd waits for a release
		badDevice   int      // current(badDevice) fails
		timeout     time.Duration
		blocking    bool
		wantErr     []error // what the error wraps; none: success
		wantInits   int     // ranks NCCL was asked to create
		wantAborted []int64 // communicators aborted (ranks)
	}{
		{name: "non-blocking", failRank: -1, asyncFail: -1, pending: 2, badDevice: -1, wantInits: size},
		{name: "blocking without ncclCommInitRankConfig", flags: []string{"-DNO_CONFIG"}, failRank: -1, asyncFail: -1,
			badDevice: -1, blocking: true, wantInits: size},
		{name: "a rank fails to start", failRank: 1, asyncFail: -1, badDevice: -1,
			wantErr: []error{ErrNCCL}, wantInits: 2, wantAborted: []int64{0}},
		{name: "a rank fails while polled", failRank: -1, asyncFail: 2, badDevice: -1,
			wantErr: []error{ErrNCCL}, wantInits: size, wantAborted: []int64{0, 1, 2}},
		{name: "a device that cannot be made current", failRank: -1, asyncFail: -1, badDevice: 1,
			wantErr: []error{errDevice}, wantInits: 0},
		{name: "deadline while polled", failRank: -1, asyncFail: -1, pending: 1 << 30, badDevice: -1,
			timeout: 100 * time.Millisecond, wantErr: []error{context.DeadlineExceeded}, wantInits: size,
			wantAborted: []int64{0, 1, 2}},
		{name: "deadline inside a blocking group", flags: []string{"-DNO_CONFIG"}, failRank: -1, asyncFail: -1,
			hold: true, badDevice: -1, timeout: 100 * time.Millisecond, blocking: true,
			wantErr: []error{context.DeadlineExceeded}, wantInits: size, wantAborted: []int64{0, 1, 2}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := loadFakeNCCL(t, c.flags...)
			hold := 0
			if c.hold {
				hold = 1
			}
			ncall(f.configure, uintptr(int64(c.failRank)), uintptr(int64(c.asyncFail)), uintptr(c.pending), uintptr(hold))
			id, err := f.api.uniqueID()
			if err != nil {
				t.Fatal(err)
			}
			var idSum int64
			for i, b := range id {
				if b != byte(i*5+1) {
					t.Fatalf("unique id byte %d is %d", i, b)
				}
				idSum += int64(b) * int64(i+1)
			}
			comms := newProcessGroup(f.api, make([]*cuda.Device, size))
			for _, n := range comms {
				n.SetTimeout(time.Minute)
			}
			ctx := context.Background()
			if c.timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, c.timeout)
				defer cancel()
			}
			// Device r is 10+r in the stand-in; it records which one is
			// current on the thread that creates each rank.
			current := func(r int) error {
				if r == c.badDevice {
					return errDevice
				}
				ncall(f.setDevice, uintptr(10+r))
				return nil
			}
			start := time.Now()
			err = initGroup(ctx, comms, id, current)
			if c.hold {
				if d := time.Since(start); d > 5*time.Second {
					t.Errorf("the deadline returned after %v", d)
				}
				ncall(f.release)
			}
			if len(c.wantErr) == 0 && err != nil {
				t.Fatal(err)
			}
			for _, w := range c.wantErr {
				if !errors.Is(err, w) {
					t.Fatalf("got %v, want an error wrapping %v", err, w)
				}
			}
			if c.blocking && c.hold && !strings.Contains(err.Error(), "cannot be interrupted") {
				t.Errorf("the error does not say the blocking init cannot be interrupted: %v", err)
			}

			// The aborts of a blocking group come once it returns.
			var evs []fakeEvent
			for deadline := time.Now().Add(5 * time.Second); ; {
				evs = f.events()
				if len(aborted(evs)) >= len(c.wantAborted) || time.Now().After(deadline) {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			if got := aborted(evs); len(got) != len(c.wantAborted) {
				t.Errorf("aborted ranks %v, want %v", got, c.wantAborted)
			} else {
				for _, r := range c.wantAborted {
					if got[r] != 1 {
						t.Errorf("rank %d aborted %d times, want once", r, got[r])
					}
				}
			}

			// The log: the unique id, then (unless a device failed first)
			// one group on one thread: start, the inits with their
			// devices current, end.
			if evs[0][0] != evUniqueID {
				t.Fatalf("log %v does not start with ncclGetUniqueId", kinds(evs))
			}
			var group []fakeEvent
			for _, e := range evs[1:] {
				if e[0] != evAbort {
					group = append(group, e)
				}
			}
			if c.wantInits == 0 {
				if len(group) != 0 {
					t.Fatalf("a group was issued (%v) although a device could not be made current", kinds(group))
				}
				return
			}
			if len(group) != c.wantInits+2 || group[0][0] != evGroupStart || group[len(group)-1][0] != evGroupEnd {
				t.Fatalf("group calls %v, want start, %d inits, end", kinds(group), c.wantInits)
			}
			thread := group[0][1]
			if group[0][2] != 1 || group[len(group)-1][1] != thread || group[len(group)-1][2] != 1 {
				t.Errorf("group start %v and end %v: not one outermost group on one thread", group[0], group[len(group)-1])
			}
			for r, e := range group[1 : len(group)-1] {
				wantBlocking := int64(0)
				if c.blocking {
					wantBlocking = -1 // ncclCommInitRank: no configuration
				}
				want := fakeEvent{evInit, int64(r), size, idSum, int64(10 + r), thread, 1, wantBlocking}
				if e != want {
					t.Errorf("init %d: {kind rank nranks idsum device thread depth blocking} = %v, want %v", r, e, want)
				}
			}
			if len(c.wantErr) > 0 {
				return
			}
			for r, n := range comms {
				if want := uintptr(idSum)*100000 + size*100 + uintptr(r); *n.comm != want {
					t.Errorf("rank %d: handle %d, want %d", r, *n.comm, want)
				}
				if n.blocking != c.blocking || (n.cfg == nil) != c.blocking {
					t.Errorf("rank %d: blocking %v, configuration %v", r, n.blocking, n.cfg != nil)
				}
			}
		})
	}
}
