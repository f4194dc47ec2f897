package gpu

import (
	"reflect"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// TestDeviceProblemResolvesLikeHost checks that the device path's
// validation (deviceProblem) resolves every option as attn.NewProblem does
// for host tensors of the same shapes: scale, dropout threshold and scale,
// window sides and mask, dropout origin. A field it leaves unset (the
// dropout's threshold once was: every element dropped, O = 0) fails here
// without a GPU.
func TestDeviceProblemResolvesLikeHost(t *testing.T) {
	cases := []struct {
		name                    string
		b, n, m, h, hkv, dk, dv int
		opt                     attn.Options
	}{
		{"plain", 2, 50, 70, 4, 2, 64, 64, attn.Options{}},
		{"dropout", 2, 500, 700, 4, 2, 128, 128, attn.Options{Causal: true, Dropout: 0.1, Seed: 5}},
		{"dropout at", 1, 64, 96, 2, 1, 32, 16, attn.Options{Dropout: 0.3, Seed: 9, Offset: 4, DropoutAt: &attn.DropoutOrigin{Query: 64, Key: 32, Head: 2, Heads: 4}}},
		{"scale softcap", 1, 30, 30, 2, 2, 48, 80, attn.Options{Scale: -0.3, Softcap: 20}},
		{"window top-left", 1, 90, 40, 3, 1, 16, 16, attn.Options{Window: &attn.Window{Left: 7, Right: 2}, Align: attn.AlignTopLeft}},
		{"window wider than the sequences", 1, 20, 20, 1, 1, 8, 8, attn.Options{Window: &attn.Window{Left: 1 << 40, Right: 0}}},
	}
	fake := func(dt attn.DType, shape ...int) DeviceTensor {
		buf, err := (*cuda.Device)(nil).BorrowBuffer(1<<40, int64(attn.NumElements(shape)*dt.Size()))
		if err != nil {
			t.Fatal(err)
		}
		return DeviceTensor{Buf: buf, DType: dt, Shape: shape}
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dt := attn.BFloat16
			host, err := attn.NewProblem(attn.New(dt, c.b, c.n, c.h, c.dk), attn.New(dt, c.b, c.m, c.hkv, c.dk), attn.New(dt, c.b, c.m, c.hkv, c.dv), c.opt)
			if err != nil {
				t.Fatalf("NewProblem: %v", err)
			}
			dev, err := deviceProblem(fake(dt, c.b, c.n, c.h, c.dk), fake(dt, c.b, c.m, c.hkv, c.dk), fake(dt, c.b, c.m, c.hkv, c.dv), DeviceOptions{Options: c.opt})
			if err != nil {
				t.Fatalf("deviceProblem: %v", err)
			}
			if !reflect.DeepEqual(dev, host) {
				t.Errorf("device problem\n%+v\nhost problem\n%+v", *dev, *host)
			}
		})
	}
}
