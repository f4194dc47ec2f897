package main

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/flashattn/flashattn/gpu"
)

// tracedCall returns a traced call: 10 ms of wall time, 120 MB in over
// 3 ms of DMA, 2 ms of kernels, 40 MB out over 1 ms, a 7 ms span.
func tracedCall() gpu.HostCall {
	ms := time.Millisecond
	c := gpu.HostCall{Op: "forward", Wall: 10 * ms, Span: 7 * ms, ToDevice: 120e6, FromDevice: 40e6}
	c.Host[gpu.HostPlan], c.Host[gpu.HostToPinned], c.Host[gpu.HostWait], c.Host[gpu.PinnedToHost] = ms, 4*ms, 3*ms, 2*ms
	c.Stream[gpu.StreamToDevice], c.Stream[gpu.StreamKernels], c.Stream[gpu.StreamFromDevice] = 3*ms, 2*ms, ms
	return c
}

func TestFloorGap(t *testing.T) {
	c := tracedCall()
	// 50 GB/s each way, kernels 1.5 ms device-resident: the floor is
	// 1.5 + 2.4 + 0.8 = 4.7 ms.
	floor, terms := floorGap(c, passFloor{kernelMs: 1.5, h2d: 50e9, d2h: 50e9})
	if math.Abs(floor-4.7) > 1e-9 {
		t.Errorf("floor %.6f ms, want 4.7", floor)
	}
	want := map[string]float64{
		"outside the stream span":      3,
		"stream idle":                  1,
		"H2D DMA over the link rate":   0.6,
		"D2H DMA over the link rate":   0.2,
		"kernels over device-resident": 0.5,
	}
	sum := 0.0
	for _, term := range terms {
		if w, ok := want[term.name]; !ok || math.Abs(term.ms-w) > 1e-9 {
			t.Errorf("term %q = %.6f ms, want %.6f", term.name, term.ms, w)
		}
		sum += term.ms
	}
	if len(terms) != len(want) || math.Abs(sum-(10-floor)) > 1e-9 {
		t.Errorf("%d terms adding up to %.6f ms, want %d adding up to wall − floor %.6f", len(terms), sum, len(want), 10-floor)
	}
}

func TestBreakdownLines(t *testing.T) {
	known := passFloor{kernelMs: 1.5, h2d: 50e9, d2h: 50e9}
	failed := tracedCall()
	failed.StreamErr = errors.New("gpu: host trace: event record failed")
	cases := []struct {
		name  string
		c     gpu.HostCall
		f     passFloor
		lines int
		has   []string
	}{
		{"with a floor", tracedCall(), known, 3, []string{
			"breakdown forward, median traced call 10.00 ms = plan 1.00 + alloc 0.00 + host→pinned 4.00 + register 0.00 + enqueue 0.00 + wait 3.00 + pinned→host 2.00 + outputs 0.00 + other 0.00 ms",
			"H2D DMA 3.00 ms (120 MB, 40.0 GB/s) + kernels 2.00 ms + D2H DMA 1.00 ms (40 MB, 40.0 GB/s) + idle 1.00 ms = span 7.00 ms",
			"2.13x the floor of 4.70 ms (kernel 1.50 + 120 MB in + 40 MB out",
			"over it by 5.30 ms = outside the stream span 3.00 + stream idle 1.00 + H2D DMA over the link rate 0.60 + D2H DMA over the link rate 0.20 + kernels over device-resident 0.50 ms",
		}},
		{"without a floor", tracedCall(), passFloor{}, 3, []string{"span 7.00 ms", "floor not measured"}},
		{"stream not timed", failed, known, 2, []string{"median traced call 10.00 ms", "stream not timed: gpu: host trace: event record failed"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			lines := breakdownLines(c.c, c.f)
			text := strings.Join(lines, "\n")
			if len(lines) != c.lines {
				t.Errorf("%d lines, want %d:\n%s", len(lines), c.lines, text)
			}
			for _, h := range c.has {
				if !strings.Contains(text, h) {
					t.Errorf("no %q in:\n%s", h, text)
				}
			}
		})
	}
}
