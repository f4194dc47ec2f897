package cuda

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
)

// cacheFormat names the layout of cache entries; changing it invalidates
// every entry.
const cacheFormat = "flashattn/cuda compile cache v1"

// cacheKey returns the hex SHA-256 that identifies a compilation: the
// source, every NVRTC option (in order), the target, the output kind and
// the NVRTC version. Each part is length-prefixed, so no two different
// inputs share an encoding.
func cacheKey(source string, options []string, target string, ptx bool, nvrtcVersion string) string {
	h := sha256.New()
	put := func(s string) {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	put(cacheFormat)
	put(source)
	put(fmt.Sprint(len(options)))
	for _, o := range options {
		put(o)
	}
	put(target)
	if ptx {
		put("ptx")
	} else {
		put("cubin")
	}
	put(nvrtcVersion)
	return hex.EncodeToString(h.Sum(nil))
}

// cacheDir returns the compile cache directory, creating it: the value of
// FLASHATTN_CACHE_DIR, else flashattn/kernels under os.UserCacheDir.
func cacheDir() (string, error) {
	dir := os.Getenv(EnvCacheDir)
	if dir == "" {
		base, err := os.UserCacheDir()
		if err != nil {
			return "", fmt.Errorf("cuda: compile cache: %w", err)
		}
		dir = filepath.Join(base, "flashattn", "kernels")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("cuda: compile cache: %w", err)
	}
	return dir, nil
}

// CacheDir returns the directory of the compile cache (see EnvCacheDir),
// creating it if needed.
func CacheDir() (string, error) { return cacheDir() }

// writeFileAtomic writes data to path through a temporary file in the same
// directory and a rename, so that readers (other processes too) see either
// no file or the whole of one writer's data, never a partial file.
func writeFileAtomic(path string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	if _, err := f.Write(data); err != nil {
		f.Close()
		os.Remove(tmp)
		return err
	}
	if err := f.Close(); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Chmod(tmp, 0o644); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}
