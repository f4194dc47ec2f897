package attn

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error returned for bad input wraps exactly one of
// them; test with errors.Is.
var (
	// ErrShape reports tensor shapes that do not fit together or are out of range.
	ErrShape = errors.New("bad shape")
	// ErrDType reports an element type that is not allowed where it was given.
	ErrDType = errors.New("bad dtype")
	// ErrLayout reports strides that make a tensor overlap itself or run past its data.
	ErrLayout = errors.New("bad layout")
	// ErrOption reports an option value outside its domain (dropout, scale, softcap, window, cu_seqlens).
	ErrOption = errors.New("bad option")
	// ErrUnsupported reports a valid problem that the chosen backend or variant cannot run.
	ErrUnsupported = errors.New("unsupported")
)

// Errorf returns an error whose message is "flashattn: " followed by the
// formatted text and the sentinel's text, and which wraps sentinel.
func Errorf(sentinel error, format string, args ...any) error {
	return fmt.Errorf("flashattn: %s: %w", fmt.Sprintf(format, args...), sentinel)
}
