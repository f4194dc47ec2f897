package main

import (
	"errors"
	"strings"
	"testing"

	"github.com/flashattn/flashattn/gpu"
)

// TestHostRatesLine checks the demo's line of the host's own rates, with
// and without the page-locking measured.
func TestHostRatesLine(t *testing.T) {
	r := gpu.HostRates{ToPinned: 33.1e9, FromPinned: 29e9, Register: 12.34e9, Unregister: 40e9}
	for _, c := range []struct {
		name string
		err  error
		has  []string
		not  []string
	}{
		{"all", nil, []string{"Go→pinned 33.1 GB/s", "pinned→Go 29.0 GB/s", "page-locking Go memory 12.3 GB/s", "unlocking 40.0 GB/s"}, []string{"not measured"}},
		{"no locking", errors.New("gpu: host rates: cuda: cuMemHostRegister_v2 failed\nCUDA_ERROR_NOT_PERMITTED"), []string{"Go→pinned 33.1 GB/s", "page-locking not measured: gpu: host rates"}, []string{"\n", "unlocking"}},
	} {
		line := hostRatesLine(r, c.err)
		for _, h := range c.has {
			if !strings.Contains(line, h) {
				t.Errorf("%s: no %q in %q", c.name, h, line)
			}
		}
		for _, n := range c.not {
			if strings.Contains(line, n) {
				t.Errorf("%s: %q in %q", c.name, n, line)
			}
		}
	}
}
