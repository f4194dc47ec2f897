package gpu

import (
	"os"
	"sync"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// bwdBuffers tracks the device buffers of one host-level backward call.
type bwdBuffers struct {
	dev  *cuda.Device
	bufs []*cuda.Buffer
}

func (bb *bwdBuffers) alloc(bytes int64) (*cuda.Buffer, error) {
	b, err := bb.dev.Alloc(max(align256(bytes), 256))
	if err != nil {
		return nil, err
	}
	bb.bufs = append(bb.bufs, b)
	return b, nil
}

func (bb *bwdBuffers) upload(data []byte) (*cuda.Buffer, error) {
	b, err := bb.alloc(int64(len(data)))
	if err != nil {
		return nil, err
	}
	if len(data) > 0 {
		if err := bb.dev.CopyToDevice(b, 0, data); err != nil {
			return nil, err
		}
	}
	return b, nil
}

func (bb *bwdBuffers) free() {
	for _, b := range bb.bufs {
		_ = b.Free()
	}
	bb.bufs = nil
}

// seqView returns the view of a contiguous [B, seq, heads, dim] (packed:
// [total, heads, dim]) tensor at ptr.
func seqView(ptr uint64, dt attn.DType, shape []int) bwdView {
	if len(shape) == 3 {
		return bwdView{Ptr: ptr, DType: dt, Row: int64(shape[1] * shape[2]), Head: int64(shape[2])}
	}
	return bwdView{Ptr: ptr, DType: dt, Batch: int64(shape[1] * shape[2] * shape[3]), Row: int64(shape[2] * shape[3]), Head: int64(shape[3])}
}

// lseView returns the view of a contiguous LSE ([B, H, N] or [H, totalQ]).
func lseView(ptr uint64, shape []int) bwdView {
	if len(shape) == 2 {
		return bwdView{Ptr: ptr, DType: attn.Float32, Head: int64(shape[1])}
	}
	return bwdView{Ptr: ptr, DType: attn.Float32, Batch: int64(shape[1] * shape[2]), Head: int64(shape[2])}
}

// biasView returns the view of a contiguous [bB, bH, N, M] bias at ptr.
func biasView(ptr uint64, dt attn.DType, shape []int) *bwdBiasView {
	return &bwdBiasView{Ptr: ptr, DType: dt, Batches: shape[0], Heads: shape[1],
		Batch: int64(shape[1] * shape[2] * shape[3]), Head: int64(shape[2] * shape[3]), Query: int64(shape[3]), Key: 1}
}

// bwdBackend is the backend on the shared backward test device (bwdDev).
var (
	bwdBackendOnce sync.Once
	bwdBackend     *Backend
	bwdBackendErr  error
)

// bwdTestBackend returns the backend on dev, the shared test device.
func bwdTestBackend(t testing.TB, dev *cuda.Device) *Backend {
	t.Helper()
	bwdBackendOnce.Do(func() { bwdBackend, bwdBackendErr = New(dev) })
	if bwdBackendErr != nil {
		t.Fatal(bwdBackendErr)
	}
	return bwdBackend
}

// bwdTestRequest is the request of a backward of p on b with the knobs New
// would set under the environment of the moment (the family tests set
// EnvNoWGMMA and EnvNoTMA; TestBackwardPersistent EnvBwdPersistent, and
// EnvBwdKeyRows, EnvBulkDQ and EnvBwdQueryStep to have the key-rows step
// at any length).
func bwdTestRequest(b *Backend, p *attn.Problem, dt attn.DType, a bwdArgs, algo DQAlgorithm) bwdRequest {
	r := b.bwdRequest(p, dt, a, algo)
	r.hopper = hopperCapable(b.dev)
	r.tma = r.hopper && !envSet(os.Getenv(EnvNoTMA))
	r.persistent = r.hopper && envSet(os.Getenv(EnvBwdPersistent))
	r.keyRows = r.keyRows || r.hopper && envSet(os.Getenv(EnvBwdKeyRows))
	r.bulkDQ = r.bulkDQ || r.hopper && envSet(os.Getenv(EnvBulkDQ))
	if q, err := parseQueryStep(os.Getenv(EnvBwdQueryStep)); err == nil && q != 0 {
		r.queryStep = q
	}
	return r
}

// bwdEnqueue plans a backward of p on the test backend of dev and enqueues
// it on s; it returns the dQ algorithm used.
func bwdEnqueue(t testing.TB, dev *cuda.Device, s *cuda.Stream, p *attn.Problem, dt attn.DType, a bwdArgs, algo DQAlgorithm) (DQAlgorithm, error) {
	t.Helper()
	b := bwdTestBackend(t, dev)
	pl, err := planBackward(bwdTestRequest(b, p, dt, a, algo))
	if err != nil {
		return algo, err
	}
	if bwdPlanned != nil {
		bwdPlanned(pl.v)
	}
	return pl.algo, b.enqueueBackward(s, pl)
}

// bwdPlanned, when set, sees the variant of each plan bwdEnqueue launches
// (a test that must know which kernels ran).
var bwdPlanned func(kernels.BwdVariant)

// bwdPrepare compiles the kernels bwdEnqueue would launch.
func bwdPrepare(t testing.TB, dev *cuda.Device, p *attn.Problem, dt attn.DType, a bwdArgs, algo DQAlgorithm) error {
	t.Helper()
	b := bwdTestBackend(t, dev)
	pl, err := planBackward(bwdTestRequest(b, p, dt, a, algo))
	if err != nil {
		return err
	}
	_, err = b.module(bwdModuleSpec(pl.v))
	return err
}
