package gpu

import (
	"bytes"
	"fmt"
	"testing"
)

func TestCopyWith(t *testing.T) {
	src := make([]byte, 1<<20+7)
	for i := range src {
		src[i] = byte(i*131 + 7)
	}
	for _, workers := range []int{0, 1, 2, 3, 8, 16} {
		dst := make([]byte, len(src))
		copyWith(dst, src, workers)
		if !bytes.Equal(dst, src) {
			t.Errorf("%d goroutines: the copy differs", workers)
		}
	}
	dst := make([]byte, len(src))
	parallelCopy(dst, src)
	if !bytes.Equal(dst, src) {
		t.Error("parallelCopy: the copy differs")
	}
}

// BenchmarkHostCopy measures the host side of the staging loop: one
// stagingChunk copied between Go memory and a plain []byte standing in for
// the pinned slot, by 1, 2, 4, 8 and 16 goroutines (copyWith; the host
// path uses up to 16), each way. The Go side walks 128 MiB, more than the
// caches of common hosts hold, as a call's tensors do, so that the copy
// runs from and to memory.
func BenchmarkHostCopy(b *testing.B) {
	const chunks = 8
	heap := make([]byte, chunks*stagingChunk)
	for i := range heap {
		heap[i] = byte(i * 31)
	}
	slot := make([]byte, stagingChunk)
	copy(slot, heap) // fault the slot's pages in, as a pinned slot is
	for _, dir := range []string{"to-slot", "from-slot"} {
		for _, g := range []int{1, 2, 4, 8, 16} {
			b.Run(fmt.Sprintf("%s/goroutines=%d", dir, g), func(b *testing.B) {
				b.SetBytes(stagingChunk)
				k := 0
				for b.Loop() {
					part := heap[k*stagingChunk : (k+1)*stagingChunk]
					if dir == "to-slot" {
						copyWith(slot, part, g)
					} else {
						copyWith(part, slot, g)
					}
					k = (k + 1) % chunks
				}
			})
		}
	}
}
