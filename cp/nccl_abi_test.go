package cp

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// fakeNCCLSource is a stand-in libnccl.so.2 whose constructors encode
// their arguments in the communicator handle they return, to check how
// the unique id (a 128-byte struct passed by value), the rank after it and
// the configuration reach C.
const fakeNCCLSource = `
#include <stdint.h>
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct { uint64_t size; unsigned magic, version; int blocking; } config;
static uintptr_t encode(int n, ncclUniqueId id, int r) {
	uintptr_t s = 0;
	for (int i = 0; i < 128; i++) s += (unsigned char)id.internal[i] * (i + 1);
	return s * 100000 + n * 100 + r;
}
int ncclGetVersion(int* v) { *v = 22703; return 0; }
int ncclCommInitRank(void** c, int n, ncclUniqueId id, int r) { *c = (void*)encode(n, id, r); return 0; }
int ncclCommInitRankConfig(void** c, int n, ncclUniqueId id, int r, config* cfg) {
	*c = (void*)encode(n, id, r);
	/* ncclInProgress for the expected non-blocking configuration, else ncclInvalidArgument */
	return cfg->magic == 0xcafebeef && cfg->size == 20 && cfg->version == 21400 && cfg->blocking == 0 ? 7 : 4;
}
const char* ncclGetErrorString(int r) { return r == 4 ? "invalid argument" : "other"; }
#define STUB(name) int name() { return 0; }
STUB(ncclGetUniqueId) STUB(ncclCommInitAll) STUB(ncclCommDestroy) STUB(ncclCommAbort) STUB(ncclCommCuDevice)
STUB(ncclGroupStart) STUB(ncclGroupEnd) STUB(ncclSend) STUB(ncclRecv) STUB(ncclAllGather)
STUB(ncclCommGetAsyncError) STUB(ncclCommCount)
`

func TestNCCLCallingConvention(t *testing.T) {
	cc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("no C compiler to build a stand-in NCCL")
	}
	dir := t.TempDir()
	src, lib := filepath.Join(dir, "fake.c"), filepath.Join(dir, "libnccl.so.2")
	if err := os.WriteFile(src, []byte(fakeNCCLSource), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(cc, "-shared", "-fPIC", "-o", lib, src).CombinedOutput(); err != nil {
		t.Skipf("building a stand-in NCCL: %v\n%s", err, out)
	}
	a, err := openNCCL([]string{lib})
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
