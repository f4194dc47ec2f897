//go:build race

package cp

// raceEnabled reports whether the race detector is on.
const raceEnabled = true
