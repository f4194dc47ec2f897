// The merge kernels' primitives: the merge kernels (kernels.MergeSource) use none, so the block the
// emulator replaces is empty (see merge_emu_test.go).
