// The staging copies' primitives: the pack kernel (kernels.PackSource) uses none, so the
// block the emulator replaces is empty (see stage_emu_test.go).
