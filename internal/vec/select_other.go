//go:build !amd64 || purego

package vec

// selectKernels returns the portable implementation on architectures
// without assembly kernels (and in purego builds).
func selectKernels() kernels { return pureGo }

// available lists every implementation this machine can run.
func available() []kernels { return []kernels{pureGo} }
