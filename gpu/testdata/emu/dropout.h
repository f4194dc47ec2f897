// The dropout mask probe's primitives: the probe kernels (dropout_emu_test.go) use none, so the
// block the emulator replaces is empty.
