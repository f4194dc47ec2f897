package cuda

// Library is a shared library loaded at run time with the search, error
// reporting and symbol resolution that load the driver and NVRTC, for
// packages that bind other CUDA libraries the same way (NCCL).
type Library struct{ lib *library }

// OpenLibrary opens the first of cands (absolute paths, or bare sonames
// for the dynamic loader's own search) that loads, skipping link-time
// stubs. On failure it returns an error wrapping sentinel that lists every
// attempt ("nothing to try" when cands is empty).
func OpenLibrary(cands []string, sentinel error) (*Library, error) {
	l, tried := openFirst(cands)
	if l == nil {
		return nil, notFoundError(sentinel, tried)
	}
	return &Library{lib: l}, nil
}

// Path returns what was opened: an absolute path or a soname.
func (l *Library) Path() string { return l.lib.path }

// Symbols resolves each name into the address ptrs maps it to, and fails
// with an error naming every missing symbol.
func (l *Library) Symbols(ptrs map[string]*uintptr) error { return l.lib.symbols(ptrs) }

// OptionalSymbol returns the address of name, or 0 when the library lacks
// it.
func (l *Library) OptionalSymbol(name string) uintptr { return l.lib.optionalSymbol(name) }
