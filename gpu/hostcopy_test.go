package gpu

import (
	"bytes"
	"fmt"
	"slices"
	"testing"
	"unsafe"

	"github.com/flashattn/flashattn/cuda"
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

// TestPageChunks checks that the direct copies' parts cover the slice in
// order, each but the last ending on a page boundary, none longer than a
// chunk and a page.
func TestPageChunks(t *testing.T) {
	backing := make([]byte, 1<<20)
	for _, tc := range []struct{ start, n, chunk int }{
		{0, 1, 4096}, {0, 4096, 4096}, {0, 4097, 4096}, {3, 100000, 8192}, {4095, 9000, 4096}, {17, 1<<20 - 17, 1 << 16}, {100, 5000, 1 << 20},
	} {
		b := backing[tc.start : tc.start+tc.n]
		base := uintptr(unsafe.Pointer(&b[0]))
		parts := pageChunks(b, tc.chunk)
		next := 0
		for i, p := range parts {
			if p[0] != next || p[1] <= p[0] {
				t.Fatalf("%+v: part %d is %v after %d", tc, i, p, next)
			}
			if last := i == len(parts)-1; !last && (base+uintptr(p[1]))%cuda.HostPageSize != 0 {
				t.Errorf("%+v: part %d ends inside a page", tc, i)
			}
			if p[1]-p[0] > tc.chunk+cuda.HostPageSize {
				t.Errorf("%+v: part %d is %d bytes", tc, i, p[1]-p[0])
			}
			next = p[1]
		}
		if next != tc.n {
			t.Errorf("%+v: parts cover %d of %d bytes", tc, next, tc.n)
		}
	}
	if pageChunks(nil, 4096) != nil {
		t.Error("an empty slice has parts")
	}
}

// TestUncoveredPages checks the range subtraction that keeps a direct copy
// from locking a page twice.
func TestUncoveredPages(t *testing.T) {
	type r = [2]uintptr
	for _, tc := range []struct {
		lo, hi uintptr
		held   []r
		want   []r
	}{
		{0, 10, nil, []r{{0, 10}}},
		{0, 10, []r{{10, 20}}, []r{{0, 10}}},
		{0, 10, []r{{0, 10}}, nil},
		{0, 10, []r{{0, 3}}, []r{{3, 10}}},
		{0, 10, []r{{7, 12}}, []r{{0, 7}}},
		{0, 10, []r{{3, 5}}, []r{{0, 3}, {5, 10}}},
		{0, 10, []r{{3, 5}, {6, 8}, {9, 30}}, []r{{0, 3}, {5, 6}, {8, 9}}},
		{5, 10, []r{{0, 6}, {8, 9}}, []r{{6, 8}, {9, 10}}},
	} {
		got := uncoveredPages(tc.lo, tc.hi, tc.held)
		if !slices.Equal(got, tc.want) {
			t.Errorf("[%d, %d) less %v = %v, want %v", tc.lo, tc.hi, tc.held, got, tc.want)
		}
	}
}

// TestRegistrationPieces checks how a direct copy's bytes split at the
// edges of the registrations that hold them: one DMA per registration.
func TestRegistrationPieces(t *testing.T) {
	type r = [2]uintptr
	for _, tc := range []struct {
		base uintptr
		n    int
		held []r
		want [][2]int
	}{
		{100, 50, []r{{0, 4096}}, [][2]int{{0, 50}}},
		{4000, 200, []r{{4096, 8192}, {0, 4096}}, [][2]int{{0, 96}, {96, 200}}},
		{4000, 9000, []r{{8192, 16384}, {0, 4096}, {4096, 8192}, {20000, 30000}}, [][2]int{{0, 96}, {96, 4192}, {4192, 9000}}},
		{5000, 10, []r{{0, 4096}, {4096, 8192}}, [][2]int{{0, 10}}},
	} {
		if got := registrationPieces(tc.base, tc.n, tc.held); !slices.Equal(got, tc.want) {
			t.Errorf("%d bytes at %d over %v = %v, want %v", tc.n, tc.base, tc.held, got, tc.want)
		}
	}
}

// TestPinnedPieces checks which copies go over the link in place from the
// backend's pins (pinnedPieces): bytes inside one pin as one
// piece, bytes across two adjacent pins as two, and none where a byte
// lies outside every pin or there is no pin.
func TestPinnedPieces(t *testing.T) {
	buf := make([]byte, 3*cuda.HostPageSize)
	a := uintptr(unsafe.Pointer(&buf[0]))
	p0 := [2]uintptr{a, a + cuda.HostPageSize}
	p1 := [2]uintptr{a + cuda.HostPageSize, a + 2*cuda.HostPageSize}
	for _, tc := range []struct {
		name   string
		pins   [][2]uintptr
		lo, hi int
		want   [][2]int
		ok     bool
	}{
		{"inside one pin", [][2]uintptr{p0}, 10, 4000, [][2]int{{0, 3990}}, true},
		{"across two pins", [][2]uintptr{p1, p0}, 100, 5000, [][2]int{{0, 3996}, {3996, 4900}}, true},
		{"past the pins", [][2]uintptr{p0, p1}, 8000, 8300, nil, false},
		{"partly pinned", [][2]uintptr{p0}, 4000, 4200, nil, false},
		{"no pins", nil, 0, 100, nil, false},
		{"empty", [][2]uintptr{p0}, 5, 5, nil, false},
	} {
		got, ok := pinnedPieces(buf[tc.lo:tc.hi], tc.pins)
		if ok != tc.ok || !slices.Equal(got, tc.want) {
			t.Errorf("%s: pieces %v (%v), want %v (%v)", tc.name, got, ok, tc.want, tc.ok)
		}
	}
}
