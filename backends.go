package flashattn

import (
	"github.com/flashattn/flashattn/cpu"
	"github.com/flashattn/flashattn/gpu"
)

// openCPU returns the pure-Go backend.
func openCPU() Backend { return cpu.New() }

// openCUDA returns the GPU backend on the first CUDA device, or the reason
// there is none (errors wrap cuda.ErrNoDriver or cuda.ErrNoDevice when no
// GPU is usable).
func openCUDA() (Backend, error) {
	b, err := gpu.Open()
	if err != nil {
		return nil, err
	}
	return b, nil
}
