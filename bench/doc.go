// Package bench measures attention: it times one shape or a preset sweep of
// shapes on a backend, records every measurement in one JSON schema shared
// with the peer scripts in bench/peers, and renders the results as Markdown
// tables and PNG/SVG plots, alone or merged with the peers' results.
//
// # Operation counts
//
// The forward of one problem counts 2·(DK+DV) floating-point operations per
// visible (query, key) pair and query head: one multiply-add per feature for
// the score q·k and one per value feature for P·V. For a padded batch
// without mask and DK = DV = D this is the usual 4·B·H·N·M·D. Masked problems
// count only the visible pairs (attn.Problem.FLOPs), so a causal square
// problem counts B·H·N(N+1)/2 pairs, about half. The backward counts 2.5
// times the forward (five matrix products against two), and a timed forward
// plus backward 3.5 times. Softmax, masking, softcap, bias and dropout
// arithmetic (and the reduction of a broadcast bias's gradient) is not
// counted, and the recomputation a backward may do is not credited, so a
// feature's cost is its rate against the same shape without it.
// TFLOP/s is that count divided by the median time.
//
// # Timing
//
// Measure runs a Workload once (its wall-clock time, which on a GPU includes
// run-time compilation and module loading, is the first-use time), then
// warms up for at least Timing.Warmup, then times as many repeats as fill
// Timing.Budget (within MinRepeats and MaxRepeats) and reports their median,
// minimum and maximum. How one repeat is timed is the workload's business:
// the host runner reads the wall clock around each call; the CUDA runner
// records events on its stream around each launch sequence and reads them
// after one synchronisation. Inputs are random normal values, never zeros,
// and a workload may rotate among several input sets so that the sets
// together exceed the device's last-level cache (RotationSets).
//
// # Results
//
// A results file (File) holds one Record per measurement: the Case (preset,
// dtype, every size, the options, the pass), who measured it
// (implementation, backend, device), the times, the rate, the kernel variant
// and dQ algorithm when the backend reports them, and a status: "ok",
// "unsupported" (a valid problem the implementation does not run, with its
// reason) or "error". A shape list (ShapeList) holds the cases alone; the
// peer script reads it and writes a results file of the same schema.
package bench
