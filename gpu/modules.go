package gpu

import (
	"fmt"
	"runtime"
	"sort"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// kernel is one compiled variant (or one being compiled: done closes when
// fn or err is set).
type kernel struct {
	v     kernels.Variant
	fn    *cuda.Function
	stats cuda.CompileStats
	err   error
	done  chan struct{}
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

// lookup returns the compiled kernel of v, compiling it now (or waiting for
// a compilation in progress) on first use.
func (b *Backend) lookup(v kernels.Variant) (*kernel, error) {
	b.mu.Lock()
	k, ok := b.kernels[v]
	if !ok {
		k = &kernel{v: v, done: make(chan struct{})}
		b.kernels[v] = k
	}
	b.mu.Unlock()
	if !ok {
		b.build(k)
		b.speculate(v)
	} else {
		<-k.done
	}
	return k, k.err
}

// Prefetch compiles the given variants in the background, several at a
// time, so that later launches find them ready. It returns at once.
func (b *Backend) Prefetch(vs ...kernels.Variant) {
	for _, v := range vs {
		if v.Validate() != nil {
			continue
		}
		b.mu.Lock()
		_, ok := b.kernels[v]
		var k *kernel
		if !ok {
			k = &kernel{v: v, done: make(chan struct{})}
			b.kernels[v] = k
		}
		b.mu.Unlock()
		if !ok {
			go func() {
				b.sem <- struct{}{}
				defer func() { <-b.sem }()
				b.build(k)
			}()
		}
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

// build compiles and loads k's variant and closes k.done.
func (b *Backend) build(k *kernel) {
	defer close(k.done)
	src, err := k.v.Source()
	if err != nil {
		k.err = err
		return
	}
	mod, err := b.dev.Compile(cuda.CompileRequest{Name: k.v.Name() + ".cu", Source: src, Verbose: true, ArchSpecific: k.v.WGMMA})
	if err != nil {
		k.err = fmt.Errorf("gpu: compile %s: %w", k.v.Name(), err)
		return
	}
	k.stats = mod.Stats
	fn, err := mod.Function(kernels.KernelName)
	if err == nil && k.v.SharedBytes() > 48<<10 {
		err = fn.SetMaxDynamicSharedMemory(k.v.SharedBytes())
	}
	if err != nil {
		k.err = fmt.Errorf("gpu: load %s: %w", k.v.Name(), err)
		return
	}
	k.fn = fn
}

// KernelStats returns the compile statistics of every kernel compiled so far
// (waiting for those in progress), sorted by name.
func (b *Backend) KernelStats() []KernelStats {
	b.mu.Lock()
	ks := make([]*kernel, 0, len(b.kernels))
	for _, k := range b.kernels {
		ks = append(ks, k)
	}
	b.mu.Unlock()
	out := make([]KernelStats, 0, len(ks))
	for _, k := range ks {
		<-k.done
		s := KernelStats{Variant: k.v, Name: k.v.Name(), CompileTime: k.stats.CompileTime, LoadTime: k.stats.LoadTime,
			CacheHit: k.stats.CacheHit, Err: k.err}
		for _, r := range k.stats.Resources {
			if r.Name == kernels.KernelName {
				s.Registers, s.StackBytes, s.SpillBytes = r.Registers, r.StackBytes, r.SpillStores
			}
		}
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}
