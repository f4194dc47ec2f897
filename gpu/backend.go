package gpu

import (
	"fmt"
	"os"
	"runtime"
	"sync"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// Backend is the CUDA attention backend. Its methods are safe for
// concurrent use.
type Backend struct {
	dev    *cuda.Device
	owns   bool         // Close closes dev
	stream *cuda.Stream // the host path's stream

	// Speculate lets the backend compile, on idle cores, the variants of
	// the same problem in the other element types when it compiles one.
	Speculate bool
	// Tiles chooses the tile of each kernel; nil means the tuning table
	// (kernels.TileForVariant). Benchmarks replace it to try other tiles.
	Tiles func(dt attn.DType, dk, dv int, narrow bool) (kernels.Tile, error)
	// WGMMA lets the forward run the Hopper kernel (warpgroup products,
	// compiled for sm_90a) wherever it applies (see kernels.HopperTile).
	// New sets it on sm_90 devices when NVRTC can target sm_90a (12.0 or
	// later) and FLASHATTN_NO_WGMMA is unset; clearing it selects the
	// mma.sync forward kernels. (The backward reads FLASHATTN_NO_WGMMA at
	// every call.)
	WGMMA bool
	// TMA lets the Hopper forward load its tiles with the tensor memory
	// accelerator (kernels.Variant.TMA) where q, k and v allow it (16-byte
	// aligned rows and strides, not packed variable-length batches). New
	// sets it with WGMMA unless FLASHATTN_NO_TMA is set; clearing it keeps
	// the per-thread copies. (The backward reads FLASHATTN_NO_TMA at every
	// call.)
	TMA bool

	fill filler // the random-fill kernel
	pack packer // the forward's staging-copy kernel

	pool   *memPool   // the host path's device buffers, kept between calls
	hostMu sync.Mutex // serializes host-path calls, which share copier
	copier hostCopier // the host path's pinned staging

	mu      sync.Mutex // guards kernels, pbuf and tmaps
	kernels map[kernels.Variant]*kernel
	pbuf    []byte         // packed kernel argument, reused by every launch
	tmaps   tensorMapCache // the tensor maps of the last TMA launch
	sem     chan struct{}

	nf nfArena // the forward's non-finite flags, one per stream (fwd_nonfinite.go)
}

// Open opens the first CUDA device and returns a backend on it. Errors wrap
// cuda.ErrNoDriver or cuda.ErrNoDevice when there is no usable GPU.
func Open() (*Backend, error) {
	dev, err := cuda.Open(0)
	if err != nil {
		return nil, fmt.Errorf("gpu: %w", err)
	}
	b, err := New(dev)
	if err != nil {
		dev.Close()
		return nil, err
	}
	b.owns = true
	return b, nil
}

// New returns a backend on an open device; Close leaves the device open.
func New(dev *cuda.Device) (*Backend, error) {
	s, err := dev.NewStream()
	if err != nil {
		return nil, fmt.Errorf("gpu: %w", err)
	}
	hopper := hopperCapable(dev)
	b := &Backend{
		dev:       dev,
		stream:    s,
		pool:      newMemPool(dev),
		copier:    hostCopier{dev: dev},
		Speculate: true,
		WGMMA:     hopper,
		TMA:       hopper && !optedOut(os.Getenv(EnvNoTMA)),
		kernels:   make(map[kernels.Variant]*kernel),
		pbuf:      make([]byte, kernels.Variant{Flat: true, FlatStaged: true}.TMAParamsSize()), // the largest argument
		sem:       make(chan struct{}, max(1, min(16, runtime.NumCPU()-1))),
	}
	if err := b.nf.init(dev); err != nil {
		s.Close()
		return nil, fmt.Errorf("gpu: non-finite flags: %w", err)
	}
	return b, nil
}

// Close releases the backend's stream, cached device memory and pinned
// staging and, when Open created the device, the device with every kernel
// and buffer on it.
func (b *Backend) Close() error {
	b.hostMu.Lock()
	b.copier.close()
	b.hostMu.Unlock()
	b.pool.trim()
	b.nf.free()
	err := b.stream.Close()
	if b.owns {
		if e := b.dev.Close(); err == nil {
			err = e
		}
	}
	return err
}

// Device returns the backend's device.
func (b *Backend) Device() *cuda.Device { return b.dev }

// Name returns "cuda".
func (b *Backend) Name() string { return "cuda" }

// Backward computes dQ, dK, dV (and dBias) of host tensors on the GPU
// (see backward.go).
func (b *Backend) Backward(q, k, v, o, lse, dO attn.Tensor, opt attn.Options) (attn.Gradients, error) {
	return b.backward(q, k, v, o, lse, dO, opt)
}

// Forward computes O and LSE of host tensors on the GPU and returns them
// contiguous: O [B, N, H, DV] in q's dtype (packed: [totalQ, H, DV]) and
// float32 LSE [B, H, N] (packed: [H, totalQ]). Inputs keep their strides
// on the device where their feature dim has stride 1 and are gathered
// otherwise. ForwardInto writes into tensors the caller provides.
func (b *Backend) Forward(q, k, v attn.Tensor, opt attn.Options) (attn.Result, error) {
	p, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return attn.Result{}, err
	}
	res := attn.Result{O: header(q.DType, p.OutputShape()), LSE: header(attn.Float32, p.LSEShape())}
	late := allocLate(res.O, res.LSE)
	if err := b.forwardHost(p, q, k, v, res, late, opt); err != nil {
		return attn.Result{}, err
	}
	ts := late.wait()
	return attn.Result{O: ts[0], LSE: ts[1]}, nil
}

// ForwardDevice enqueues the forward pass on stream s (nil: the legacy
// default stream): q [B, N, H, DK], k [B, M, Hkv, DK], v [B, M, Hkv, DV]
// (packed: drop B, give cu_seqlens), o [B, N, H, DV] in q's dtype and lse
// [B, H, N] (packed: [H, totalQ]) float32, all on the device with any
// strides (feature dims of q, k, v, o with stride 1). It neither
// synchronizes nor allocates device memory, so it can be captured in a CUDA
// graph once its kernel is compiled (the first call with a new variant
// compiles it; PrepareForward compiles ahead). With opt.Staging, q, k and v
// whose rows allow only 2-byte loads are first copied into it with padded
// rows (see PrepareForward). Errors from the kernel's execution appear at
// the stream's next synchronization.
func (b *Backend) ForwardDevice(s *cuda.Stream, q, k, v, o, lse DeviceTensor, opt DeviceOptions) error {
	l, p, st, err := b.planForward(q, k, v, o, lse, opt)
	if err != nil || p.N == 0 || p.B == 0 {
		return err
	}
	kn, err := b.lookup(l.v)
	if err != nil {
		return err
	}
	if l.params.NFFlag, err = b.nf.slot(b.dev, s); err != nil {
		return err
	}
	packed := false
	if st != nil {
		if packed, err = b.enqueueStaging(s, st); err != nil {
			return err
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	args := b.pbuf[:kernels.ParamsSize]
	if l.v.TMA {
		maps, err := b.tmaps.get(l.tma[:], fwdTMANames, func(t kernels.TMATensor) (cuda.TensorMap, error) {
			return b.dev.EncodeTensorMap(tensorMapSpec(t))
		})
		if err != nil {
			return fmt.Errorf("gpu: %s: %w", l.v.Name(), err)
		}
		args = b.pbuf[:l.v.TMAParamsSize()]
		kernels.PackTMA(args, &l.params, maps...)
	} else {
		l.params.PackInto(args)
	}
	launch := b.dev.Launch
	if packed && l.v.FlatStaged {
		// the heads read in place need nothing of the pack kernel just enqueued: the forward starts
		// alongside it, and only the blocks of staged heads wait for it (griddep_wait)
		launch = b.dev.LaunchEarly
	}
	if err := launch(kn.fn, l.grid, [3]uint32{uint32(l.v.Threads()), 1, 1}, uint32(l.v.SharedBytes()), s, args); err != nil {
		return fmt.Errorf("gpu: launch %s: %w", l.v.Name(), err)
	}
	return b.launchNonFinite(kn, l, s, args)
}

// Variant returns the kernel variant ForwardDevice would launch for these
// arguments (for Prefetch, benchmarks and reports).
func (b *Backend) Variant(q, k, v, o, lse DeviceTensor, opt DeviceOptions) (kernels.Variant, error) {
	l, _, _, err := b.planForward(q, k, v, o, lse, opt)
	return l.v, err
}

// planDevice validates the device arguments and plans the launch.
func (b *Backend) planDevice(q, k, v, o, lse DeviceTensor, opt DeviceOptions) (launch, *attn.Problem, error) {
	p, err := deviceProblem(q, k, v, opt)
	if err != nil {
		return launch{}, nil, err
	}
	if err := checkOutputs(p, q.DType, o, lse); err != nil {
		return launch{}, nil, err
	}
	var cuq, cuk uint64
	if p.Varlen {
		cuq, cuk = opt.CuSeqlensQ.Ptr(), opt.CuSeqlensK.Ptr()
	}
	l, err := plan(p, q.DType, q, k, v, o, lse, opt.Bias, cuq, cuk, b.Tiles, false, b.WGMMA, b.TMA, nil)
	return l, p, err
}

// EnvNoTMA, when set to anything but "" or "0", keeps the Hopper forward
// of new backends on per-thread tile copies (Backend.TMA), and the Hopper
// backward kernels too (read at every backward call).
const EnvNoTMA = "FLASHATTN_NO_TMA"

// optedOut reports whether an opt-out variable's value is set: anything
// but "" or "0".
func optedOut(value string) bool { return value != "" && value != "0" }

// EnvNoWGMMA, when set to anything but "" or "0", keeps new backends off the
// Hopper (WGMMA) kernels.
const EnvNoWGMMA = "FLASHATTN_NO_WGMMA"

// hopperCapable reports whether the Hopper kernels can run on dev: an sm_90
// device, an NVRTC that targets sm_90a, and no EnvNoWGMMA.
func hopperCapable(dev *cuda.Device) bool {
	major, minor := dev.ComputeCapability()
	nvrtc := 0
	if c, err := cuda.NewCompiler(); err == nil {
		nvrtc, _ = c.Version()
	}
	return hopperAllowed(major, minor, nvrtc, os.Getenv(EnvNoWGMMA))
}

// hopperAllowed is the rule of hopperCapable: compute capability 9.0 exactly
// (sm_90a code runs nowhere else), NVRTC 12 or later (0: none loaded), and
// the opt-out variable empty or "0".
func hopperAllowed(major, minor, nvrtcMajor int, noWGMMA string) bool {
	if optedOut(noWGMMA) {
		return false
	}
	return major == 9 && minor == 0 && nvrtcMajor >= 12
}
