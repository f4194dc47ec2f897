package gpu

import (
	"fmt"
	"os"
	"runtime"
	"sort"
	"sync"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// The module cache: every kernel the backend launches — the forward's
// variants, the backward's variants (each a module of several kernels) and
// the staging-copy (pack) kernel — compiles once per backend, on first use
// or ahead of it (Prefetch, PrepareForward, PrepareBackward, speculation),
// with the package cuda disk cache under NVRTC. Different modules compile
// concurrently; a caller that needs a module being compiled waits for it.

// module is one compiled CUDA module and its kernels (or one being
// compiled: done closes when fns or err is set).
type module struct {
	spec  moduleSpec
	fns   map[string]*cuda.Function
	stats cuda.CompileStats
	err   error
	done  chan struct{}
}

// function returns the module's kernel of the given name.
func (m *module) function(name string) *cuda.Function { return m.fns[name] }

// moduleSpec says how to build a module: its source, the kernels to look
// up and the dynamic shared memory each needs beyond the default 48 KiB.
type moduleSpec struct {
	key       any    // what identifies it in the cache (a kernels.Variant, a backward key, a kernel name)
	name      string // for NVRTC and errors
	what      string // for errors: "forward kernel", "backward kernels", ...
	source    func() (string, error)
	arch      bool // compile for the architecture-specific target (sm_90a)
	verbose   bool // ask ptxas for its resource report
	functions []string
	smem      map[string]int // dynamic shared memory bytes by kernel
	variant   *kernels.Variant
}

// fwdModuleSpec is the module of forward variant v.
func fwdModuleSpec(v kernels.Variant) moduleSpec {
	smem := map[string]int{}
	if v.SharedBytes() > 48<<10 {
		smem[kernels.KernelName] = v.SharedBytes()
	}
	return moduleSpec{key: v, name: v.Name(), what: "forward kernel", source: v.Source, arch: v.WGMMA, verbose: true,
		functions: []string{kernels.KernelName, kernels.NonFiniteKernel}, smem: smem, variant: &v}
}

// bwdModuleSpec is the module of backward variant v: its preprocess,
// dK/dV, dQ (or dQ conversion), dBias and pack kernels.
func bwdModuleSpec(v kernels.BwdVariant) moduleSpec {
	return moduleSpec{key: v.Name(), name: v.Name(), what: "backward kernels", source: func() (string, error) { return v.Source() },
		arch: v.WGMMA, functions: kernels.BwdKernelNames(v),
		smem: map[string]int{kernels.BwdDKDVKernel: v.DKDVSharedBytes(), kernels.BwdDQKernel: v.DQSharedBytes()}}
}

// packModuleSpec is the module of the forward's staging-copy kernel.
var packModuleSpec = moduleSpec{key: kernels.PackKernel, name: kernels.PackKernel, what: "pack kernel",
	source: func() (string, error) { return kernels.PackSource, nil }, functions: []string{kernels.PackKernel}}

// moduleCache holds a backend's modules.
type moduleCache struct {
	mu sync.Mutex
	m  map[any]*module
}

// entry returns the cache's module of spec and whether the caller must
// build it (it was not there).
func (c *moduleCache) entry(spec moduleSpec) (*module, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if m, ok := c.m[spec.key]; ok {
		return m, false
	}
	if c.m == nil {
		c.m = map[any]*module{}
	}
	m := &module{spec: spec, done: make(chan struct{})}
	c.m[spec.key] = m
	return m, true
}

// all returns every module in the cache.
func (c *moduleCache) all() []*module {
	c.mu.Lock()
	defer c.mu.Unlock()
	ms := make([]*module, 0, len(c.m))
	for _, m := range c.m {
		ms = append(ms, m)
	}
	return ms
}

// module returns the compiled module of spec, compiling it now (or waiting
// for a compilation in progress) on first use.
func (b *Backend) module(spec moduleSpec) (*module, error) {
	m, build := b.modules.entry(spec)
	if build {
		b.build(m)
	} else {
		<-m.done
	}
	return m, m.err
}

// lookup returns the compiled forward kernel of v, compiling it on first
// use and then speculating on the other element types.
func (b *Backend) lookup(v kernels.Variant) (*module, error) {
	m, build := b.modules.entry(fwdModuleSpec(v))
	if build {
		b.build(m)
		b.speculate(v)
	} else {
		<-m.done
	}
	return m, m.err
}

// prefetch starts compiling spec's module in the background unless the
// cache has it. With wait unset it starts nothing when every background
// slot is taken.
func (b *Backend) prefetch(spec moduleSpec, wait bool) {
	if _, ok := b.modules.peek(spec.key); ok {
		return
	}
	if !wait {
		select {
		case b.sem <- struct{}{}:
		default:
			return
		}
	}
	m, build := b.modules.entry(spec)
	if !build {
		if !wait {
			<-b.sem
		}
		return
	}
	go func() {
		if wait {
			b.sem <- struct{}{}
		}
		defer func() { <-b.sem }()
		b.build(m)
	}()
}

// peek reports whether the cache has the module of key.
func (c *moduleCache) peek(key any) (*module, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m, ok := c.m[key]
	return m, ok
}

// Prefetch compiles the given variants in the background, several at a
// time, so that later launches find them ready. It returns at once.
func (b *Backend) Prefetch(vs ...kernels.Variant) {
	for _, v := range vs {
		if v.Validate() != nil {
			continue
		}
		b.prefetch(fwdModuleSpec(v), true)
	}
}

// speculate prefetches the variants a caller is likely to want next: the
// same problem in the other element types (test suites and sweeps walk the
// dtypes of one shape in a row). It uses idle cores only.
func (b *Backend) speculate(v kernels.Variant) {
	if runtime.NumCPU() < 4 || !b.Speculate {
		return
	}
	var vs []kernels.Variant
	for _, dt := range []attn.DType{attn.Float32, attn.Float16, attn.BFloat16} {
		if dt == v.DType {
			continue
		}
		w := v
		w.DType = dt
		if dt == attn.Float32 && w.LoadBytes == 2 {
			w.LoadBytes = 4
		}
		if t, ok := kernels.HopperTile(w); ok && b.WGMMA {
			vs = append(vs, t.Apply(w)) // the kernel plan would pick for that type
			continue
		}
		w.WGMMA = false
		tile, err := kernels.TileForVariant(w)
		if err != nil {
			continue
		}
		vs = append(vs, tile.Apply(w))
	}
	b.Prefetch(vs...)
}

// bwdSpeculate starts, on idle cores, the compilation of the backward
// variants a caller is likely to ask for next: v (the one just planned)
// in the other dtypes. A later call that needs one waits for it.
func (b *Backend) bwdSpeculate(v kernels.BwdVariant) {
	dt := v.DType
	for _, other := range []attn.DType{attn.Float32, attn.Float16, attn.BFloat16} {
		if other == dt {
			continue
		}
		w := v
		w.DType = other
		if w.Biased() && w.Bias.DType() == dt {
			w.Bias = kernels.BiasFor(other)
		}
		g := 16 / other.Size()
		w.Vector = w.Vector && w.DK%g == 0 && w.DV%g == 0
		w.Flat = w.Flat && other.Size() == 2 // (rows read in place: 16-bit only)
		w.Staged = !w.Vector && !w.Flat && kernels.BwdNeedsStaging(other, w.DK, w.DV)
		w.WGMMA = w.WGMMA && kernels.BwdHopperOK(w)
		w.TMA = w.TMA && w.WGMMA // (the same strides in bytes: still whole 16-byte units)
		if w.Validate() != nil {
			continue
		}
		b.prefetch(bwdModuleSpec(w), false)
	}
}

// build compiles and loads m's module, looks up its kernels and closes
// m.done.
func (b *Backend) build(m *module) {
	defer close(m.done)
	s := m.spec
	src, err := s.source()
	if err != nil {
		m.err = err
		return
	}
	var opts []string
	if envSet(os.Getenv(EnvLineInfo)) {
		opts = append(opts, "-lineinfo")
	}
	mod, err := b.dev.Compile(cuda.CompileRequest{Name: s.name + ".cu", Source: src, Options: opts, Verbose: s.verbose, ArchSpecific: s.arch})
	if err != nil {
		m.err = fmt.Errorf("gpu: compile %s %s: %w", s.what, s.name, err)
		return
	}
	m.stats = mod.Stats
	fns := map[string]*cuda.Function{}
	for _, name := range s.functions {
		fn, err := mod.Function(name)
		if err == nil && s.smem[name] > 0 {
			err = fn.SetMaxDynamicSharedMemory(s.smem[name])
		}
		if err != nil {
			mod.Close()
			m.err = fmt.Errorf("gpu: load %s %s (%s, %d bytes of shared memory): %w", s.what, s.name, name, s.smem[name], err)
			return
		}
		fns[name] = fn
	}
	m.fns = fns
}

// KernelStats describes one compiled kernel.
type KernelStats struct {
	// Variant is the kernel's variant; Name is its name.
	Variant kernels.Variant
	Name    string
	// CompileTime is NVRTC's time (or the disk-cache read on a hit); LoadTime
	// the module load.
	CompileTime, LoadTime time.Duration
	// CacheHit reports that the image came from the disk cache.
	CacheHit bool
	// Registers, StackBytes and SpillBytes are ptxas's report.
	Registers, StackBytes, SpillBytes int
	// Err is the compile or load error, if any.
	Err error
}

// KernelStats returns the compile statistics of every forward kernel
// compiled so far (waiting for those in progress), sorted by name.
func (b *Backend) KernelStats() []KernelStats {
	var out []KernelStats
	for _, m := range b.modules.all() {
		if m.spec.variant == nil {
			continue
		}
		<-m.done
		s := KernelStats{Variant: *m.spec.variant, Name: m.spec.name, CompileTime: m.stats.CompileTime, LoadTime: m.stats.LoadTime,
			CacheHit: m.stats.CacheHit, Err: m.err}
		for _, r := range m.stats.Resources {
			if r.Name == kernels.KernelName {
				s.Registers, s.StackBytes, s.SpillBytes = r.Registers, r.StackBytes, r.SpillStores
			}
		}
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}
