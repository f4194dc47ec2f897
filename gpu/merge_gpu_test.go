package gpu

import (
	"fmt"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// mergeDev is a mergeExec on a GPU: each placed tensor in a buffer of its
// own, the calls on one stream.
type mergeDev struct {
	t *testing.T
	b *Backend
	s *cuda.Stream
}

func (e *mergeDev) place(buf []byte, dt attn.DType, shape, strides []int, off int) (DeviceTensor, any) {
	e.t.Helper()
	dbuf, err := e.b.dev.Alloc(int64(len(buf)))
	if err == nil {
		err = e.b.dev.CopyToDevice(dbuf, 0, buf)
	}
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = dbuf.Free() })
	return DeviceTensor{Buf: dbuf, Offset: int64(off), DType: dt, Shape: shape, Strides: strides}, dbuf
}

func (e *mergeDev) fetch(handle any, n int) []byte {
	e.t.Helper()
	out := make([]byte, n)
	if err := e.s.Synchronize(); err != nil {
		e.t.Fatal(err)
	}
	if err := e.b.dev.CopyFromDevice(out, handle.(*cuda.Buffer), 0); err != nil {
		e.t.Fatal(err)
	}
	return out
}

func (e *mergeDev) run(c *mergeCall) {
	e.t.Helper()
	if err := e.b.launchMerge(e.s, c, c.kernel); err != nil {
		e.t.Fatal(err)
	}
}

// TestMergeOnDevice runs the cases of TestMergeEmulated,
// TestMergeGradientEmulated and TestCombineEmulated on the GPU. Skips without one.
func TestMergeOnDevice(t *testing.T) {
	b := fwdBackend(t)
	for _, dt := range []attn.DType{attn.BFloat16, attn.Float16, attn.Float32} {
		for _, d := range []int{128, 59, 8, 3, 512} {
			for _, l := range mergeLayouts {
				t.Run(fmt.Sprintf("%v-d%d-%s", dt, d, l.name), func(t *testing.T) {
					s := testStream(t, b.Device())
					mergeCase(t, &mergeDev{t: t, b: b, s: s}, dt, d, l.rows, l.lse)
					gradCase(t, &mergeDev{t: t, b: b, s: s}, dt, d, l.rows, l.lse)
					combineCase(t, &mergeDev{t: t, b: b, s: s}, dt, d, l.rows, l.lse)
				})
			}
		}
	}
}

// TestDownload checks Download against Upload for a contiguous tensor and
// for a strided view of it (every other row).
func TestDownload(t *testing.T) {
	b := fwdBackend(t)
	tb := newTestBufs(t, b)
	x := attn.FromFloat32(attn.BFloat16, []float32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, 1, 6, 1, 2)
	d := tb.upload(x)
	got, err := b.Download(nil, d)
	if err != nil {
		t.Fatal(err)
	}
	if i, ok := sameBits(got, x); !ok {
		t.Fatalf("element %d differs", i)
	}
	view := d
	view.Shape, view.Strides, view.Offset = []int{1, 3, 1, 2}, []int{12, 4, 2, 1}, 2
	got, err = b.Download(nil, view)
	if err != nil {
		t.Fatal(err)
	}
	if want := []float32{3, 4, 7, 8, 11, 12}; fmt.Sprint(got.Float32s()) != fmt.Sprint(want) {
		t.Fatalf("strided view: %v, want %v", got.Float32s(), want)
	}
}
