package bench

import (
	"errors"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
)

// OpenRunner returns the runner of a backend: "cpu", "cuda", or "auto" (the
// CUDA runner when a GPU works, otherwise the CPU runner). A backend that
// cannot be opened gives a runner whose every case is unsupported, with the
// reason, so that a sweep records why instead of stopping. Any other name
// fails with attn.ErrOption.
func OpenRunner(backend string) (Runner, error) {
	switch backend {
	case "cpu":
		return NewHostRunner(cpu.New(), ""), nil
	case "cuda":
		r, err := openCUDA()
		if err != nil {
			return Unavailable("cuda", err), nil
		}
		return r, nil
	case "auto":
		if r, err := openCUDA(); err == nil {
			return r, nil
		}
		return NewHostRunner(cpu.New(), ""), nil
	}
	return nil, attn.Errorf(attn.ErrOption, "backend %q is not cpu, cuda or auto", backend)
}

// unavailable is the runner of a backend that could not be opened.
type unavailable struct {
	backend string
	err     error
}

// Unavailable returns a runner named backend whose Prepare always fails
// with err, wrapped so that it matches attn.ErrUnsupported.
func Unavailable(backend string, err error) Runner {
	if !errors.Is(err, attn.ErrUnsupported) {
		err = attn.Errorf(attn.ErrUnsupported, "%s backend unavailable: %v", backend, err)
	}
	return &unavailable{backend: backend, err: err}
}

func (u *unavailable) Implementation() string { return Ours }
func (u *unavailable) Backend() string        { return u.backend }
func (u *unavailable) Device() string         { return "" }
func (u *unavailable) Close() error           { return nil }

func (u *unavailable) Prepare(Case) (Workload, error) { return nil, u.err }
