package main

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/flashattn/flashattn"
	"github.com/flashattn/flashattn/gpu"
)

// hostTracer is a backend whose host-tensor calls can record their phase
// breakdown.
type hostTracer interface {
	SetHostTrace(t *gpu.HostTrace)
}

// passFloor is what the floor of one host-tensor pass is made of: its
// device-resident kernel time and the measured link rates in bytes per
// second (0: not measured, no floor).
type passFloor struct {
	kernelMs float64
	h2d, d2h float64
}

// known reports whether the floor was measured.
func (f passFloor) known() bool { return f.h2d > 0 && f.d2h > 0 }

// ms returns the floor in milliseconds of a call that moves in bytes to
// the device and out bytes back: the kernel time plus their time over the
// link.
func (f passFloor) ms(in, out float64) float64 { return f.kernelMs + 1e3*(in/f.h2d+out/f.d2h) }

// gapTerm is one term of a traced call's time above its floor, in ms.
type gapTerm struct {
	name string
	ms   float64
}

// floorGap returns the floor of traced call c (f's kernel time plus the
// bytes c moved over f's link) and the terms its wall time exceeds it by,
// which add up to wall − floor exactly: the time outside the stream's
// span, the stream's idle time inside it, each DMA's time over the link's
// rate, and the traced kernels' time over the device-resident one.
func floorGap(c gpu.HostCall, f passFloor) (floorMs float64, terms []gapTerm) {
	inMs, outMs := 1e3*float64(c.ToDevice)/f.h2d, 1e3*float64(c.FromDevice)/f.d2h
	floorMs = f.ms(float64(c.ToDevice), float64(c.FromDevice))
	terms = []gapTerm{
		{"outside the stream span", ms(c.Wall - c.Span)},
		{"stream idle", ms(c.Idle())},
		{"H2D DMA over the link rate", ms(c.Stream[gpu.StreamToDevice]) - inMs},
		{"D2H DMA over the link rate", ms(c.Stream[gpu.StreamFromDevice]) - outMs},
		{"kernels over device-resident", ms(c.Stream[gpu.StreamKernels]) - f.kernelMs},
	}
	return floorMs, terms
}

// ms returns d in milliseconds.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// gbps returns bytes over d in GB/s (0 for no time).
func gbps(bytes int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(bytes) / d.Seconds() / 1e9
}

// breakdownLines formats the breakdown of traced call c: its host phases,
// its stream work and, when f is known, its floor and the terms of the
// difference.
func breakdownLines(c gpu.HostCall, f passFloor) []string {
	var host []string
	for p := range gpu.NumHostPhases {
		host = append(host, fmt.Sprintf("%s %.2f", p, ms(c.Host[p])))
	}
	lines := []string{fmt.Sprintf("breakdown %s, median traced call %.2f ms = %s ms (host side)",
		c.Op, ms(c.Wall), strings.Join(host, " + "))}
	if c.StreamErr != nil {
		return append(lines, fmt.Sprintf("          stream not timed: %s", oneLine(c.StreamErr)))
	}
	h2d, d2h := c.Stream[gpu.StreamToDevice], c.Stream[gpu.StreamFromDevice]
	lines = append(lines, fmt.Sprintf("          stream %s %.2f ms (%.0f MB, %.1f GB/s) + %s %.2f ms + %s %.2f ms (%.0f MB, %.1f GB/s) + idle %.2f ms = span %.2f ms (CUDA events)",
		gpu.StreamToDevice, ms(h2d), float64(c.ToDevice)/1e6, gbps(c.ToDevice, h2d),
		gpu.StreamKernels, ms(c.Stream[gpu.StreamKernels]),
		gpu.StreamFromDevice, ms(d2h), float64(c.FromDevice)/1e6, gbps(c.FromDevice, d2h),
		ms(c.Idle()), ms(c.Span)))
	if !f.known() {
		return append(lines, "          floor not measured (no device-resident timing or link measurement)")
	}
	floorMs, terms := floorGap(c, f)
	var parts []string
	for _, t := range terms {
		parts = append(parts, fmt.Sprintf("%s %.2f", t.name, t.ms))
	}
	return append(lines, fmt.Sprintf("          %.2fx the floor of %.2f ms (kernel %.2f + %.0f MB in + %.0f MB out at the link's rates); over it by %.2f ms = %s ms",
		ms(c.Wall)/floorMs, floorMs, f.kernelMs, float64(c.ToDevice)/1e6, float64(c.FromDevice)/1e6, ms(c.Wall)-floorMs, strings.Join(parts, " + ")))
}

// breakdown times iters forward and iters backward host-tensor calls again
// with tracing on and prints the breakdown of each pass's median call
// next to its floor (floors[0] forward, floors[1] backward).
func breakdown(b flashattn.Backend, q, k, v, dO flashattn.Tensor, opt flashattn.Options, iters int, floors [2]passFloor, stdout io.Writer) error {
	ht, ok := b.(hostTracer)
	if !ok {
		fmt.Fprintf(stdout, "note      --breakdown: the %s backend cannot trace its host path\n", b.Name())
		return nil
	}
	tr := &gpu.HostTrace{}
	ht.SetHostTrace(tr)
	err := func() error {
		var res flashattn.Result
		var err error
		for range iters {
			if res, err = b.Forward(q, k, v, opt); err != nil {
				return fmt.Errorf("traced forward: %w", err)
			}
		}
		for range iters {
			if _, err := b.Backward(q, k, v, res.O, res.LSE, dO, opt); err != nil {
				return fmt.Errorf("traced backward: %w", err)
			}
		}
		return nil
	}()
	ht.SetHostTrace(nil)
	if err != nil {
		return err
	}
	calls := tr.Calls()
	for i, op := range []string{"forward", "backward"} {
		c, ok := gpu.MedianCall(calls, op)
		if !ok {
			continue
		}
		for _, l := range breakdownLines(c, floors[i]) {
			fmt.Fprintln(stdout, l)
		}
	}
	return nil
}
