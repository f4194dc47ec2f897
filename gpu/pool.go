package gpu

import (
	"errors"
	"sync"

	"github.com/flashattn/flashattn/cuda"
)

// memPool is the host path's caching allocator: buffers freed by one call
// are kept, by size class, for the next call instead of going back to the
// driver, so that a training loop's repeated shapes allocate device memory
// once. Work that used a buffer must have finished (the host path
// synchronizes its stream) before the buffer is put back.
type memPool struct {
	dev *cuda.Device

	mu     sync.Mutex
	free   map[int64][]*cuda.Buffer // by size class
	cached int64                    // bytes held in free
	limit  int64                    // cached bytes kept at most
	// poison makes get fill every buffer with 0xFF bytes (NaN in every
	// float type), so that tests see outputs a kernel failed to write
	// instead of an earlier call's values
	poison bool
}

// newMemPool returns a pool on dev that keeps at most a quarter of the
// device's memory cached.
func newMemPool(dev *cuda.Device) *memPool {
	return &memPool{dev: dev, free: make(map[int64][]*cuda.Buffer), limit: max(dev.TotalMemory()/4, 1<<30)}
}

// sizeClass rounds a request up: to 256 bytes below 1 MiB, to 1 MiB above.
func sizeClass(bytes int64) int64 {
	if bytes <= 1<<20 {
		return max(256, (bytes+255)&^255)
	}
	return (bytes + 1<<20 - 1) &^ (1<<20 - 1)
}

// get returns a buffer of at least bytes (positive) bytes, cached or new.
// When the device is out of memory it frees the cache and tries once more.
func (p *memPool) get(bytes int64) (*cuda.Buffer, error) {
	b, err := p.take(bytes)
	if err == nil && p.poison {
		if err = p.dev.Memset8(b, 0xFF); err != nil {
			p.put(b)
			return nil, err
		}
	}
	return b, err
}

// take returns a cached buffer of bytes' size class, or a new one.
func (p *memPool) take(bytes int64) (*cuda.Buffer, error) {
	c := sizeClass(bytes)
	p.mu.Lock()
	if l := p.free[c]; len(l) > 0 {
		b := l[len(l)-1]
		p.free[c] = l[:len(l)-1]
		p.cached -= c
		p.mu.Unlock()
		return b, nil
	}
	p.mu.Unlock()
	b, err := p.dev.Alloc(c)
	var ce *cuda.Error
	if errors.As(err, &ce) && ce.Code == cuda.ErrorOutOfMemory {
		p.trim()
		b, err = p.dev.Alloc(c)
	}
	return b, err
}

// put returns b to the pool (freeing it when the pool is full). b must come
// from get and no enqueued work may still use it.
func (p *memPool) put(b *cuda.Buffer) {
	if b == nil {
		return
	}
	c := b.Size()
	p.mu.Lock()
	if p.cached+c > p.limit {
		p.mu.Unlock()
		_ = b.Free()
		return
	}
	p.free[c] = append(p.free[c], b)
	p.cached += c
	p.mu.Unlock()
}

// trim frees every cached buffer.
func (p *memPool) trim() {
	p.mu.Lock()
	free := p.free
	p.free = make(map[int64][]*cuda.Buffer)
	p.cached = 0
	p.mu.Unlock()
	for _, l := range free {
		for _, b := range l {
			_ = b.Free()
		}
	}
}

// CachedBytes returns the device memory the host path's caching allocator
// holds for reuse.
func (b *Backend) CachedBytes() int64 {
	b.pool.mu.Lock()
	defer b.pool.mu.Unlock()
	return b.pool.cached
}

// ReleaseCache frees the device memory the host path keeps for reuse
// between calls (Forward and Backward on host tensors cache their device
// buffers by size). Close frees it too.
func (b *Backend) ReleaseCache() { b.pool.trim() }
