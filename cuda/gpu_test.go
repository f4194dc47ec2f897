package cuda

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"sort"
	"sync"
	"testing"
	"time"
	"unsafe"
)

// randomFloats returns n random float32 values in [-1, 1).
func randomFloats(rng *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = rng.Float32()*2 - 1
	}
	return x
}

// floats decodes little-endian float32 values.
func floats(b []byte) []float32 {
	x := make([]float32, len(b)/4)
	for i := range x {
		x[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return x
}

// upload allocates a buffer holding x.
func upload(t testing.TB, d *Device, x []float32) *Buffer {
	t.Helper()
	b, err := d.Alloc(int64(4 * len(x)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Free() })
	if err := d.CopyToDevice(b, 0, AsBytes(x)); err != nil {
		t.Fatal(err)
	}
	return b
}

// download reads n float32 values from b.
func download(t testing.TB, d *Device, b *Buffer, n int) []float32 {
	t.Helper()
	out := make([]byte, 4*n)
	if err := d.CopyFromDevice(out, b, 0); err != nil {
		t.Fatal(err)
	}
	return floats(out)
}

// compileFunc compiles src for d and returns its kernel name.
func compileFunc(t testing.TB, d *Device, req CompileRequest, name string) *Function {
	t.Helper()
	testCompiler(t)
	m, err := d.Compile(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	f, err := m.Function(name)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestDeviceInfo(t *testing.T) {
	d := testDevice(t)
	info, err := Driver()
	if err != nil {
		t.Fatal(err)
	}
	major, minor := d.ComputeCapability()
	t.Logf("driver %s (CUDA %d.%d), %d device(s); device 0: %v, cc %d.%d, smem/block %d, optin %d, smem/SM %d, L2 %d",
		info.Path, info.Version/1000, info.Version%1000/10, info.Devices, d, major, minor,
		d.SharedMemoryPerBlock(), d.SharedMemoryPerBlockOptin(), d.SharedMemoryPerSM(), d.L2CacheSize())
	if d.Name() == "" || major < 5 || d.SMCount() <= 0 || d.WarpSize() != 32 || d.L2CacheSize() <= 0 ||
		d.SharedMemoryPerBlockOptin() < d.SharedMemoryPerBlock() || d.TotalMemory() <= 0 || info.Devices < 1 {
		t.Errorf("implausible properties: %v", d)
	}
	free, total, err := d.MemInfo()
	if err != nil || free <= 0 || free > total || total != d.TotalMemory() {
		t.Errorf("MemInfo = %d, %d, %v (total memory %d)", free, total, err, d.TotalMemory())
	}
	if v, err := d.Attribute(AttrMultiprocessorCount); err != nil || v != d.SMCount() {
		t.Errorf("Attribute(SM count) = %d, %v", v, err)
	}
	if _, err := Open(1 << 20); !errors.Is(err, ErrNoDevice) || !errors.Is(err, ErrCUDA) {
		t.Errorf("Open(huge ordinal): %v", err)
	}
}

func TestCopyRoundTrip(t *testing.T) {
	d := testDevice(t)
	rng := rand.New(rand.NewPCG(1, 2))
	for _, size := range []int{1, 3, 4096, 1<<20 + 5} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			src := make([]byte, size)
			for i := range src {
				src[i] = byte(rng.Uint32())
			}
			b, err := d.Alloc(int64(size) + 16)
			if err != nil {
				t.Fatal(err)
			}
			defer b.Free()
			if err := d.CopyToDevice(b, 16, src); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, size)
			if err := d.CopyFromDevice(got, b, 16); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, src) {
				t.Fatal("host -> device -> host changed the data")
			}
			c, err := d.Alloc(int64(size))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Free()
			if err := d.CopyDeviceToDevice(c, 0, b, 16, int64(size)); err != nil {
				t.Fatal(err)
			}
			clear(got)
			if err := d.CopyFromDevice(got, c, 0); err != nil || !bytes.Equal(got, src) {
				t.Fatalf("device -> device copy: %v", err)
			}

			// Asynchronous copies through pinned memory on a stream.
			s, err := d.NewStreamNonBlocking()
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			h, err := d.AllocHost(size)
			if err != nil {
				t.Fatal(err)
			}
			defer h.Free()
			hb := h.Bytes()
			for i := range hb {
				hb[i] = ^src[i]
			}
			if err := d.CopyToDeviceAsync(c, 0, hb, s); err != nil {
				t.Fatal(err)
			}
			if err := d.CopyDeviceToDeviceAsync(b, 0, c, 0, int64(size), s); err != nil {
				t.Fatal(err)
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
			clear(hb) // the stream has read hb: it may be reused
			if err := d.CopyFromDeviceAsync(hb, b, 0, s); err != nil {
				t.Fatal(err)
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
			for i := range hb {
				if hb[i] != ^src[i] {
					t.Fatalf("async round trip: byte %d is %#x, want %#x", i, hb[i], ^src[i])
				}
			}
		})
	}
}

func TestMemset(t *testing.T) {
	d := testDevice(t)
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	b, err := d.Alloc(4 * 1001)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	nan := math.Float32bits(float32(math.NaN()))
	tests := []struct {
		name string
		set  func() error
		want func(i int, got []byte) bool
	}{
		{"D8", func() error { return d.Memset8(b, 0xab) },
			func(i int, got []byte) bool { return got[i] == 0xab }},
		{"D32", func() error { return d.Memset32(b, nan) },
			func(i int, got []byte) bool { return binary.LittleEndian.Uint32(got[i&^3:]) == nan }},
		{"D8 async", func() error {
			if err := d.Memset8Async(b, 0x5c, s); err != nil {
				return err
			}
			return s.Synchronize()
		}, func(i int, got []byte) bool { return got[i] == 0x5c }},
		{"D32 async", func() error {
			if err := d.Memset32Async(b, 0x01020304, s); err != nil {
				return err
			}
			return s.Synchronize()
		}, func(i int, got []byte) bool { return binary.LittleEndian.Uint32(got[i&^3:]) == 0x01020304 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.set(); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, b.Size())
			if err := d.CopyFromDevice(got, b, 0); err != nil {
				t.Fatal(err)
			}
			for i := range got {
				if !tt.want(i, got) {
					t.Fatalf("byte %d = %#x", i, got[i])
				}
			}
		})
	}
}

func TestArgumentChecks(t *testing.T) {
	d := testDevice(t)
	b, err := d.Alloc(10)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	tests := []struct {
		name string
		err  error
	}{
		{"alloc 0", func() error { _, err := d.Alloc(0); return err }()},
		{"copy past end", d.CopyToDevice(b, 8, make([]byte, 3))},
		{"negative offset", d.CopyFromDevice(make([]byte, 1), b, -1)},
		{"d2d past end", d.CopyDeviceToDevice(b, 0, b, 5, 6)},
		{"memset32 odd size", d.Memset32(b, 0)},
		{"nil buffer", d.Memset8(nil, 0)},
		{"nil function", d.Launch(nil, [3]uint32{1, 1, 1}, [3]uint32{1, 1, 1}, 0, nil, nil)},
		{"capture default stream", (*Stream)(nil).BeginCapture(CaptureThreadLocal)},
		{"nil event", func() error { _, err := ElapsedMs(nil, nil); return err }()},
		{"empty image", func() error { _, err := d.LoadModule(nil); return err }()},
	}
	for _, tt := range tests {
		if !errors.Is(tt.err, ErrArgument) {
			t.Errorf("%s: err = %v, want ErrArgument", tt.name, tt.err)
		}
	}
}

func TestDriverErrors(t *testing.T) {
	d := testDevice(t)
	f := compileFunc(t, d, CompileRequest{Name: "vecadd.cu", Source: vecAddSource}, "vecadd")
	_, err := f.mod.Function("no_such_kernel")
	var e *Error
	if !errors.As(err, &e) || e.Code != ErrorNotFound || !errors.Is(err, ErrCUDA) || e.Name != "CUDA_ERROR_NOT_FOUND" {
		t.Errorf("unknown kernel: %v", err)
	}
	t.Logf("unknown kernel: %v", err)
	_, err = d.LoadModule([]byte(".version 99.0\n.target sm_90\n.visible .entry k() { ret; }\n"))
	if !errors.As(err, &e) || !errors.Is(err, ErrCUDA) {
		t.Errorf("bad PTX: %v", err)
	}
	t.Logf("bad PTX: %v", err)
	// A grid beyond the limit fails at launch, without poisoning the context.
	err = d.Launch(f, [3]uint32{1, 1 << 20, 1}, [3]uint32{1, 1, 1}, 0, nil, make([]byte, 32))
	if !errors.As(err, &e) || e.Code != ErrorInvalidValue {
		t.Errorf("oversized grid: %v", err)
	}
	if err := d.Synchronize(); err != nil {
		t.Errorf("context unusable after a rejected launch: %v", err)
	}
}

func TestLaunchVecAdd(t *testing.T) {
	d := testDevice(t)
	c := testCompiler(t)
	req := CompileRequest{Name: "vecadd.cu", Source: vecAddSource, Verbose: true, NoCache: true}
	m, err := d.Compile(req)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	t.Logf("NVRTC %s: compiled %s for %s in %v, loaded in %v; ptxas: %+v",
		c.VersionString(), req.Name, m.Stats.Target, m.Stats.CompileTime, m.Stats.LoadTime, m.Stats.Resources)
	f, err := m.Function("vecadd")
	if err != nil {
		t.Fatal(err)
	}
	attrs, err := f.Attributes()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("vecadd attributes: %+v", attrs)
	major, minor := d.ComputeCapability()
	if attrs.NumRegs <= 0 || attrs.MaxThreadsPerBlock <= 0 || attrs.BinaryVersion != 10*major+minor {
		t.Errorf("attributes %+v", attrs)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{1, 255, 256, 1<<20 + 3} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			a, b := randomFloats(rng, n), randomFloats(rng, n)
			da, db := upload(t, d, a), upload(t, d, b)
			dc, err := d.Alloc(int64(4 * n))
			if err != nil {
				t.Fatal(err)
			}
			defer dc.Free()
			if err := d.Memset32(dc, math.Float32bits(float32(math.NaN()))); err != nil {
				t.Fatal(err)
			}
			const alpha = 0.5 // a power of two: a+alpha*b rounds the same with or without FMA
			grid := uint32((n + 255) / 256)
			if err := d.Launch(f, [3]uint32{grid, 1, 1}, [3]uint32{256, 1, 1}, 0, nil, vecAddParams(da, db, dc, n, alpha)); err != nil {
				t.Fatal(err)
			}
			got := download(t, d, dc, n)
			for i := range got {
				if want := a[i] + alpha*b[i]; got[i] != want {
					t.Fatalf("c[%d] = %v, want %v", i, got[i], want)
				}
			}
		})
	}
	// The cached compile of the same request loads too.
	req.NoCache = false
	for i := range 2 {
		m2, err := d.Compile(req)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("compile %d through the cache: hit %v, %v", i, m2.Stats.CacheHit, m2.Stats.CompileTime)
		if i == 1 && !m2.Stats.CacheHit {
			t.Error("second cached compile missed")
		}
		m2.Close()
	}
}

const smemSource = `
struct SmemParams { float* out; int n; };

// Stores 0..n-1 in dynamic shared memory and writes it out reversed.
extern "C" __global__ void smem_reverse(SmemParams p) {
	extern __shared__ float buf[];
	for (int i = threadIdx.x; i < p.n; i += blockDim.x) buf[i] = (float)i;
	__syncthreads();
	for (int i = threadIdx.x; i < p.n; i += blockDim.x) p.out[i] = buf[p.n - 1 - i];
}
`

func TestDynamicSharedMemory(t *testing.T) {
	d := testDevice(t)
	f := compileFunc(t, d, CompileRequest{Name: "smem.cu", Source: smemSource}, "smem_reverse")
	attrs, err := f.Attributes()
	if err != nil {
		t.Fatal(err)
	}
	smem := d.SharedMemoryPerBlockOptin() - attrs.SharedBytes
	n := smem / 4
	out, err := d.Alloc(int64(smem))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Free()
	args := argsOf(1, false, true, false).Pack(&ptrsArgs{p: [3]uint64{out.Ptr()}, i32: int32(n)})
	launch := func() error {
		return d.Launch(f, [3]uint32{1, 1, 1}, [3]uint32{512, 1, 1}, uint32(smem), nil, args)
	}
	if smem > d.SharedMemoryPerBlock() {
		if err := launch(); !errors.Is(err, ErrCUDA) {
			t.Errorf("launch with %d bytes of shared memory before opting in: %v", smem, err)
		}
	}
	if err := f.SetMaxDynamicSharedMemory(smem); err != nil {
		t.Fatal(err)
	}
	if v, err := f.Attribute(FuncMaxDynamicSharedSizeBytes); err != nil || v != smem {
		t.Errorf("max dynamic shared = %d, %v; want %d", v, err, smem)
	}
	if err := launch(); err != nil {
		t.Fatal(err)
	}
	got := download(t, d, out, n)
	for i := range got {
		if got[i] != float32(n-1-i) {
			t.Fatalf("out[%d] = %v, want %d", i, got[i], n-1-i)
		}
	}
	t.Logf("launched with %d bytes of dynamic shared memory", smem)
}

const spinSource = `
struct SpinParams { unsigned long long* out; long long cycles; };

extern "C" __global__ void spin(SpinParams p) {
	long long t0 = clock64();
	while (clock64() - t0 < p.cycles) {}
	if (threadIdx.x == 0) atomicAdd(p.out, 1ull);
}

struct EmptyParams { float* p; };
extern "C" __global__ void empty(EmptyParams p) {}
`

// newCounter returns a zeroed 8-byte device counter, freed when t ends.
func newCounter(t *testing.T, d *Device) *Buffer {
	t.Helper()
	counter, err := d.Alloc(8)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { counter.Free() })
	if err := d.Memset8(counter, 0); err != nil {
		t.Fatal(err)
	}
	return counter
}

func TestEvents(t *testing.T) {
	d := testDevice(t)
	f := compileFunc(t, d, CompileRequest{Name: "spin.cu", Source: spinSource}, "spin")
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	counter := newCounter(t, d)
	start, err := d.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	defer start.Close()
	end, err := d.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	defer end.Close()
	clock, err := d.Attribute(AttrClockRate) // kHz
	if err != nil || clock <= 0 {
		t.Logf("clock rate attribute: %d, %v; assuming 1.5 GHz", clock, err)
		clock = 1500000
	}
	args := argsOf(1, true, false, false).Pack(&ptrsArgs{p: [3]uint64{counter.Ptr()}, i64: int64(clock) * 2}) // about 2 ms at the base clock
	if err := start.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := d.Launch(f, [3]uint32{4, 1, 1}, [3]uint32{32, 1, 1}, 0, s, args); err != nil {
		t.Fatal(err)
	}
	if err := end.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := end.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if done, err := end.Done(); err != nil || !done {
		t.Errorf("event not done after Synchronize: %v", err)
	}
	if done, err := s.Done(); err != nil || !done {
		t.Errorf("stream not done after its last event: %v", err)
	}
	ms, err := ElapsedMs(start, end)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("spin of %d cycles at %d kHz: %.3f ms", 2*clock, clock, ms)
	if ms < 0.5 || ms > 1000 {
		t.Errorf("elapsed %.3f ms for a 2 ms spin", ms)
	}
	got := make([]byte, 8)
	if err := d.CopyFromDevice(got, counter, 0); err != nil {
		t.Fatal(err)
	}
	if n := binary.LittleEndian.Uint64(got); n != 4 { // one per block
		t.Errorf("counter = %d, want 4", n)
	}
	// A second stream waits for the first one's event.
	s2, err := d.NewStreamNonBlocking()
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if err := d.Launch(f, [3]uint32{1, 1, 1}, [3]uint32{1, 1, 1}, 0, s, args); err != nil {
		t.Fatal(err)
	}
	if err := end.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := s2.WaitEvent(end); err != nil {
		t.Fatal(err)
	}
	if err := d.CopyFromDeviceAsync(got, counter, 0, s2); err != nil {
		t.Fatal(err)
	}
	if n := binary.LittleEndian.Uint64(got); n != 5 {
		t.Errorf("counter seen by the waiting stream = %d, want 5", n)
	}
}

// TestEventNoTimingForkJoin checks ordering-only events: a pair of them
// forks a stream's work onto a second stream and joins it back, eagerly
// (the first stream sees the second one's 2 ms kernel done) and in a
// captured graph, whose replays run the second stream's kernel too; they
// refuse ElapsedMs.
func TestEventNoTimingForkJoin(t *testing.T) {
	d := testDevice(t)
	f := compileFunc(t, d, CompileRequest{Name: "spin.cu", Source: spinSource}, "spin")
	var streams [2]*Stream
	var events [2]*Event
	for i := range 2 {
		var err error
		if streams[i], err = d.NewStreamNonBlocking(); err != nil {
			t.Fatal(err)
		}
		defer streams[i].Close()
		if events[i], err = d.NewEventNoTiming(); err != nil {
			t.Fatal(err)
		}
		defer events[i].Close()
	}
	s1, s2, fork, join := streams[0], streams[1], events[0], events[1]
	counter := newCounter(t, d)
	clock, err := d.Attribute(AttrClockRate) // kHz
	if err != nil || clock <= 0 {
		clock = 1500000
	}
	spin := func(cycles int64) []byte {
		return argsOf(1, true, false, false).Pack(&ptrsArgs{p: [3]uint64{counter.Ptr()}, i64: cycles})
	}
	one := [3]uint32{1, 1, 1}
	// work forks onto s2 (blocks CTAs spinning for cycles, each adding 1),
	// joins back, and adds 1 on s1
	work := func(blocks uint32, cycles int64) error {
		if err := fork.Record(s1); err != nil {
			return err
		}
		if err := s2.WaitEvent(fork); err != nil {
			return err
		}
		if err := d.Launch(f, [3]uint32{blocks, 1, 1}, [3]uint32{32, 1, 1}, 0, s2, spin(cycles)); err != nil {
			return err
		}
		if err := join.Record(s2); err != nil {
			return err
		}
		if err := s1.WaitEvent(join); err != nil {
			return err
		}
		return d.Launch(f, one, one, 0, s1, spin(1000))
	}
	if err := work(4, int64(clock)*2); err != nil { // about 2 ms on s2
		t.Fatal(err)
	}
	// the counter as the work enqueued on s1 so far leaves it
	count := func() uint64 {
		t.Helper()
		got := make([]byte, 8)
		if err := d.CopyFromDeviceAsync(got, counter, 0, s1); err != nil {
			t.Fatal(err)
		}
		return binary.LittleEndian.Uint64(got)
	}
	if n := count(); n != 5 {
		t.Errorf("counter seen on the joined stream = %d, want 5", n)
	}
	if _, err := ElapsedMs(fork, join); err == nil {
		t.Error("ElapsedMs on events without timing succeeded")
	}
	if err := s1.BeginCapture(CaptureThreadLocal); err != nil {
		t.Fatal(err)
	}
	werr := work(1, 1000)
	g, err := s1.EndCapture()
	if werr != nil || err != nil {
		t.Fatalf("capture: %v, %v", werr, err)
	}
	defer g.Close()
	for range 3 {
		if err := g.Launch(s1); err != nil {
			t.Fatal(err)
		}
	}
	if n := count(); n != 11 {
		t.Errorf("counter after 3 replays of the fork/join graph = %d, want 11", n)
	}
}

const graphSource = `
struct AxpyParams { const float* x; float* y; int n; float a; };

// y = a * x + y
extern "C" __global__ void axpy(AxpyParams p) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < p.n) p.y[i] = p.a * p.x[i] + p.y[i];
}
`

func TestGraphReplay(t *testing.T) {
	d := testDevice(t)
	vadd := compileFunc(t, d, CompileRequest{Name: "vecadd.cu", Source: vecAddSource}, "vecadd")
	axpy := compileFunc(t, d, CompileRequest{Name: "axpy.cu", Source: graphSource}, "axpy")
	const n = 1 << 16
	rng := rand.New(rand.NewPCG(5, 6))
	a, b := randomFloats(rng, n), randomFloats(rng, n)
	da, db := upload(t, d, a), upload(t, d, b)
	dc, err := d.Alloc(4 * n)
	if err != nil {
		t.Fatal(err)
	}
	defer dc.Free()
	s, err := d.NewStreamNonBlocking()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	grid, block := [3]uint32{n / 256, 1, 1}, [3]uint32{256, 1, 1}
	ap := argsOf(2, false, true, true).Pack(&ptrsArgs{p: [3]uint64{da.Ptr(), dc.Ptr()}, i32: n, f32: 2})
	// The work: c = NaN; c = a + 0.5 b; c = 2 a + c; c = 2 a + c.
	work := func() error {
		if err := d.Memset32Async(dc, 0x7fc00000, s); err != nil {
			return err
		}
		if err := d.Launch(vadd, grid, block, 0, s, vecAddParams(da, db, dc, n, 0.5)); err != nil {
			return err
		}
		for range 2 {
			if err := d.Launch(axpy, grid, block, 0, s, ap); err != nil {
				return err
			}
		}
		return nil
	}
	if err := work(); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	eager := download(t, d, dc, n)
	for i := range eager {
		want := 2*a[i] + (2*a[i] + (a[i] + 0.5*b[i]))
		if math.Abs(float64(eager[i]-want)) > 1e-5 {
			t.Fatalf("eager c[%d] = %v, want %v", i, eager[i], want)
		}
	}

	if err := d.Memset8(dc, 0); err != nil {
		t.Fatal(err)
	}
	if err := s.BeginCapture(CaptureThreadLocal); err != nil {
		t.Fatal(err)
	}
	if err := work(); err != nil {
		s.EndCapture()
		t.Fatal(err)
	}
	g, err := s.EndCapture()
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	// Capture ran nothing.
	if got := download(t, d, dc, 4); got[0] != 0 || got[3] != 0 {
		t.Fatalf("capture executed the work: %v", got)
	}
	for rep := range 3 {
		if err := g.Launch(s); err != nil {
			t.Fatal(err)
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		got := download(t, d, dc, n)
		for i := range got {
			if math.Float32bits(got[i]) != math.Float32bits(eager[i]) {
				t.Fatalf("replay %d: c[%d] = %v, eager run gave %v", rep, i, got[i], eager[i])
			}
		}
	}

	// Replay timing against eager launches of the same work.
	start, _ := d.NewEvent()
	end, _ := d.NewEvent()
	defer start.Close()
	defer end.Close()
	const reps = 200
	timeIt := func(run func() error) float32 {
		if err := start.Record(s); err != nil {
			t.Fatal(err)
		}
		for range reps {
			if err := run(); err != nil {
				t.Fatal(err)
			}
		}
		if err := end.Record(s); err != nil {
			t.Fatal(err)
		}
		if err := end.Synchronize(); err != nil {
			t.Fatal(err)
		}
		ms, err := ElapsedMs(start, end)
		if err != nil {
			t.Fatal(err)
		}
		return ms * 1000 / reps
	}
	eagerUs := timeIt(work)
	graphUs := timeIt(func() error { return g.Launch(s) })
	t.Logf("4 operations: eager %.1f µs per iteration, graph replay %.1f µs", eagerUs, graphUs)
}

func TestMakeCurrent(t *testing.T) {
	d := testDevice(t)
	// A fresh locked thread has no context until MakeCurrent; the thread
	// ends with the goroutine.
	got := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := d.MakeCurrent(); err != nil {
			got <- err
			return
		}
		var dev int32 = -1
		if err := d.api.check("cuCtxGetDevice", ccall(d.api.cuCtxGetDevice, uintptr(unsafe.Pointer(&dev)))); err != nil {
			got <- err
			return
		}
		if dev != d.dev {
			got <- fmt.Errorf("the thread's current device is %d, want %d", dev, d.dev)
			return
		}
		got <- nil
	}()
	if err := <-got; err != nil {
		t.Fatal(err)
	}
}

func TestConcurrentUse(t *testing.T) {
	d := testDevice(t)
	f := compileFunc(t, d, CompileRequest{Name: "vecadd.cu", Source: vecAddSource}, "vecadd")
	const goroutines, rounds, n = 16, 20, 10000
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- func() error {
				rng := rand.New(rand.NewPCG(uint64(g), 7))
				var s *Stream
				if g%2 == 0 { // half on own streams, half on the default stream
					var err error
					if s, err = d.NewStream(); err != nil {
						return err
					}
					defer s.Close()
				}
				for r := range rounds {
					a, b := randomFloats(rng, n), randomFloats(rng, n)
					bufs := make([]*Buffer, 3)
					for i := range bufs {
						var err error
						if bufs[i], err = d.Alloc(4 * n); err != nil {
							return err
						}
						defer bufs[i].Free()
					}
					if err := d.CopyToDevice(bufs[0], 0, AsBytes(a)); err != nil {
						return err
					}
					if err := d.CopyToDevice(bufs[1], 0, AsBytes(b)); err != nil {
						return err
					}
					alpha := float32(int(1) << ((g + r) % 8)) // exact with or without FMA
					if err := d.Launch(f, [3]uint32{(n + 127) / 128, 1, 1}, [3]uint32{128, 1, 1}, 0, s,
						vecAddParams(bufs[0], bufs[1], bufs[2], n, alpha)); err != nil {
						return err
					}
					if s != nil {
						if err := s.Synchronize(); err != nil {
							return err
						}
					}
					out := make([]byte, 4*n)
					if err := d.CopyFromDevice(out, bufs[2], 0); err != nil {
						return err
					}
					for i, v := range floats(out) {
						if want := a[i] + alpha*b[i]; v != want {
							return fmt.Errorf("goroutine %d round %d: c[%d] = %v, want %v", g, r, i, v, want)
						}
					}
				}
				return nil
			}()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}

func TestCloseAndFree(t *testing.T) {
	testDevice(t) // keeps the primary context alive while d2 comes and goes
	d2, err := Open(0)
	if err != nil {
		t.Fatal(err)
	}
	b, err := d2.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	kept, err := d2.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	s, err := d2.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	e, err := d2.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); err != nil || b.Ptr() != 0 {
		t.Errorf("second Free: %v, Ptr %#x", err, b.Ptr())
	}
	if err := d2.CopyToDevice(b, 0, []byte{1}); !errors.Is(err, ErrClosed) {
		t.Errorf("copy into a freed buffer: %v", err)
	}
	var live int
	d2.do(func() error { live = len(d2.live); return nil })
	if live != 3 {
		t.Errorf("%d live resources, want 3 (buffer, stream, event)", live)
	}
	if err := d2.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d2.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	for name, err := range map[string]error{
		"alloc":     func() error { _, err := d2.Alloc(1); return err }(),
		"copy":      d2.CopyToDevice(kept, 0, []byte{1}),
		"sync":      d2.Synchronize(),
		"stream":    s.Synchronize(),
		"event":     e.Record(nil),
		"new event": func() error { _, err := d2.NewEvent(); return err }(),
	} {
		if !errors.Is(err, ErrClosed) {
			t.Errorf("%s after Close: %v", name, err)
		}
	}
	for name, err := range map[string]error{"free": kept.Free(), "stream close": s.Close(), "event close": e.Close()} {
		if err != nil {
			t.Errorf("%s after device Close: %v", name, err)
		}
	}
}

func TestCleanupBackstop(t *testing.T) {
	d := testDevice(t)
	count := func() int {
		var n int
		d.do(func() error {
			for k := range d.live {
				if k.kind == resBuffer {
					n++
				}
			}
			return nil
		})
		return n
	}
	before := count()
	func() {
		for range 4 {
			if _, err := d.Alloc(1 << 20); err != nil {
				t.Fatal(err)
			}
		}
	}()
	if got := count(); got != before+4 {
		t.Fatalf("%d live buffers, want %d", got, before+4)
	}
	deadline := time.Now().Add(10 * time.Second)
	for count() > before && time.Now().Before(deadline) {
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	if got := count(); got != before {
		t.Errorf("%d live buffers after GC, want %d: the cleanup did not free them", got, before)
	}
}

func TestArchSpecificAndPTX(t *testing.T) {
	d := testDevice(t)
	c := testCompiler(t)
	major, minor := d.ComputeCapability()
	tests := []struct {
		name string
		req  CompileRequest
		skip string
	}{
		{"ptx jit", CompileRequest{Name: "vecadd.cu", Source: vecAddSource, PTX: true}, ""},
	}
	if major == 9 && minor == 0 {
		skip := ""
		if cm, _ := c.Version(); cm < 12 {
			skip = "NVRTC before 12.0 has no sm_90a"
		}
		tests = append(tests, struct {
			name string
			req  CompileRequest
			skip string
		}{"sm_90a", CompileRequest{Name: "vecadd.cu", Source: vecAddSource, ArchSpecific: true}, skip})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.skip != "" {
				t.Skip(tt.skip)
			}
			f := compileFunc(t, d, tt.req, "vecadd")
			t.Logf("target %s, compile %v, load %v", f.mod.Stats.Target, f.mod.Stats.CompileTime, f.mod.Stats.LoadTime)
			const n = 1000
			rng := rand.New(rand.NewPCG(8, 9))
			a, b := randomFloats(rng, n), randomFloats(rng, n)
			da, db := upload(t, d, a), upload(t, d, b)
			dc := upload(t, d, make([]float32, n))
			if err := d.Launch(f, [3]uint32{4, 1, 1}, [3]uint32{256, 1, 1}, 0, nil, vecAddParams(da, db, dc, n, -1)); err != nil {
				t.Fatal(err)
			}
			for i, v := range download(t, d, dc, n) {
				if v != a[i]-b[i] {
					t.Fatalf("c[%d] = %v, want %v", i, v, a[i]-b[i])
				}
			}
		})
	}
}

func TestLaunchOverhead(t *testing.T) {
	d := testDevice(t)
	f := compileFunc(t, d, CompileRequest{Name: "spin.cu", Source: spinSource}, "empty")
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	params := make([]byte, 8)
	one := [3]uint32{1, 1, 1}
	const reps = 2000
	var times []time.Duration
	for range 5 {
		t0 := time.Now()
		for range reps {
			if err := d.Launch(f, one, one, 0, s, params); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		times = append(times, time.Since(t0)/reps)
	}
	sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
	t.Logf("host time per Launch of an empty kernel: median %v (min %v, max %v) over 5 x %d", times[2], times[0], times[4], reps)
}

func BenchmarkLaunch(b *testing.B) {
	d := testDevice(b)
	f := compileFunc(b, d, CompileRequest{Name: "spin.cu", Source: spinSource}, "empty")
	params := make([]byte, 8)
	one := [3]uint32{1, 1, 1}
	for b.Loop() {
		if err := d.Launch(f, one, one, 0, nil, params); err != nil {
			b.Fatal(err)
		}
	}
	if err := d.Synchronize(); err != nil {
		b.Fatal(err)
	}
}

// earlySource is a producer that lets its dependents start at once and
// then spins before writing, and a consumer that waits for it
// (griddepcontrol.wait) before reading: with LaunchEarly the consumer
// still reads what the producer wrote.
const earlySource = `
struct EarlyParams { unsigned* buf; long long cycles; int n; };

extern "C" __global__ void produce(EarlyParams p) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  long long t0 = clock64();
  while (clock64() - t0 < p.cycles) {}
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.n) p.buf[i] = 3u * i + 1u;
}

extern "C" __global__ void consume(EarlyParams p) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.n) p.buf[p.n + i] = p.buf[i] + 7u;
}
`

// TestLaunchEarly launches a consumer early after a slow producer
// (programmatic dependent launch) and checks what it read, several times.
func TestLaunchEarly(t *testing.T) {
	d := testDevice(t)
	prod := compileFunc(t, d, CompileRequest{Name: "early.cu", Source: earlySource}, "produce")
	cons := compileFunc(t, d, CompileRequest{Name: "early.cu", Source: earlySource}, "consume")
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const n = 1 << 16
	buf, err := d.Alloc(8 * n)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	params := argsOf(1, true, true, false).Pack(&ptrsArgs{p: [3]uint64{buf.Ptr()}, i64: 200000, i32: n}) // cycles: about 0.1 ms
	grid, block := [3]uint32{n / 256, 1, 1}, [3]uint32{256, 1, 1}
	for rep := 0; rep < 5; rep++ {
		if err := d.Memset32(buf, 0); err != nil {
			t.Fatal(err)
		}
		if err := d.Launch(prod, grid, block, 0, s, params); err != nil {
			t.Fatal(err)
		}
		if err := d.LaunchEarly(cons, grid, block, 0, s, params); err != nil {
			t.Fatal(err)
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 8*n)
		if err := d.CopyFromDevice(got, buf, 0); err != nil {
			t.Fatal(err)
		}
		for i := 0; i < n; i++ {
			if v := binary.LittleEndian.Uint32(got[4*(n+i):]); v != 3*uint32(i)+8 {
				t.Fatalf("rep %d: consumer read %d at %d, want %d", rep, v, i, 3*i+8)
			}
		}
	}
}

// TestRegisterHost checks page-locking Go memory: asynchronous copies to
// and from it, a second lock of its pages refused with
// ErrorHostMemoryRegistered, Unregister twice, and an empty slice refused.
func TestRegisterHost(t *testing.T) {
	d := testDevice(t)
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	src := make([]byte, 3<<20+100)
	for i := range src {
		src[i] = byte(i*7 + 1)
	}
	part := src[5 : len(src)-9] // not page-aligned at either end
	r, err := d.RegisterHost(part)
	if err != nil {
		t.Fatalf("RegisterHost: %v", err)
	}
	if addr, n := r.Range(); addr%HostPageSize != 0 || n%HostPageSize != 0 || n < len(part) {
		t.Errorf("locked range %#x+%d is not the pages of %d bytes", addr, n, len(part))
	}
	var ce *Error
	if _, err := d.RegisterHost(src[100:200]); !errors.As(err, &ce) || ce.Code != ErrorHostMemoryRegistered {
		t.Errorf("locking a locked page again: %v, want code %d", err, ErrorHostMemoryRegistered)
	}
	buf, err := d.Alloc(int64(len(part)))
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	if err := d.CopyToDeviceAsync(buf, 0, part, s); err != nil {
		t.Fatal(err)
	}
	back := make([]byte, len(part))
	r2, err := d.RegisterHost(back)
	if err != nil {
		t.Fatalf("RegisterHost: %v", err)
	}
	if err := d.CopyFromDeviceAsync(back, buf, 0, s); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, part) {
		t.Error("the copies through locked Go memory changed the data")
	}
	for _, x := range []*HostRegistration{r, r, r2} {
		if err := x.Unregister(); err != nil {
			t.Errorf("Unregister: %v", err)
		}
	}
	if _, err := d.RegisterHost(nil); !errors.Is(err, ErrArgument) {
		t.Errorf("RegisterHost(nil): %v, want ErrArgument", err)
	}
}
