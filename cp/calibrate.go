package cp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/flashattn/flashattn/attn"
)

// Calibration says what Calibrate measures.
type Calibration struct {
	// Machine names the host and device; it keys the cache file.
	Machine string
	// DType, H, Hkv, DK and DV are the kernel class measured: the calls
	// of the problems the profile will model.
	DType          attn.DType
	H, Hkv, DK, DV int
	// MaxLen is the longest side of a block measured: unmasked blocks of
	// every pair of lengths 16, 64, 256, … up to MaxLen (queries × keys),
	// and causal square blocks of each length.
	MaxLen int
	// Budget is the time spent timing each block size and pass, after one
	// untimed run (default 20ms).
	Budget time.Duration
	// LinkBytes is the size of the message that measures the link's
	// bandwidth (default 4 MiB); a one-byte message measures its latency.
	LinkBytes int
}

// blockLens returns the block lengths measured.
func (c Calibration) blockLens() []int {
	var ns []int
	for n := 16; n < c.MaxLen; n *= 4 {
		ns = append(ns, n)
	}
	return append(ns, max(c.MaxLen, 1))
}

// Calibrate measures a profile: the forward and backward rates of b on the
// blocks of the calibration's kernel class (batch 1; see MaxLen), and
// the link of a transport through measureLink (MeasureLocalLink for the
// in-process transport). It fails with an error wrapping attn.ErrOption
// for a calibration without sizes, or with the backend's error.
func Calibrate(ctx context.Context, b attn.Backend, c Calibration, measureLink func(ctx context.Context, bytes int) (bandwidth, latency float64, err error)) (*Profile, error) {
	if c.H < 1 || c.Hkv < 1 || c.H%c.Hkv != 0 || c.DK < 1 || c.DV < 1 || c.MaxLen < 1 {
		return nil, attn.Errorf(attn.ErrOption, "cp: calibration of %s up to %d keys: sizes must be positive, H a multiple of Hkv",
			KernelClass(c.DType, c.H, c.Hkv, c.DK, c.DV), c.MaxLen)
	}
	if c.Budget <= 0 {
		c.Budget = 20 * time.Millisecond
	}
	if c.LinkBytes <= 0 {
		c.LinkBytes = 4 << 20
	}
	pr := &Profile{Machine: c.Machine, Backend: b.Name(), Kernel: KernelClass(c.DType, c.H, c.Hkv, c.DK, c.DV),
		Measured: time.Now().UTC().Truncate(time.Second)}
	rng := rand.New(rand.NewPCG(1, 2))
	ns := c.blockLens()
	for _, rows := range ns {
		for _, cols := range ns {
			if err := c.measureBlock(ctx, b, pr, rng, rows, cols, false); err != nil {
				return nil, err
			}
		}
		if err := c.measureBlock(ctx, b, pr, rng, rows, rows, true); err != nil {
			return nil, err
		}
	}
	var err error
	if pr.Bandwidth, pr.Latency, err = measureLink(ctx, c.LinkBytes); err != nil {
		return nil, fmt.Errorf("cp: calibration of the link: %w", err)
	}
	return pr, pr.check()
}

// measureBlock times the forward and backward of one block of rows
// queries and cols keys, under a top-left causal mask when masked, and
// appends their rates to pr.
func (c Calibration) measureBlock(ctx context.Context, b attn.Backend, pr *Profile, rng *rand.Rand, rows, cols int, masked bool) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("cp: calibration: %w", err)
	}
	q := randomTensor(rng, c.DType, 1, rows, c.H, c.DK)
	k := randomTensor(rng, c.DType, 1, cols, c.Hkv, c.DK)
	v := randomTensor(rng, c.DType, 1, cols, c.Hkv, c.DV)
	dO := randomTensor(rng, c.DType, 1, rows, c.H, c.DV)
	opt := attn.Options{Causal: masked, Align: attn.AlignTopLeft}
	gp, err := attn.NewProblem(q, k, v, opt)
	if err != nil {
		return err
	}
	var res attn.Result
	fwd, err := timeCall(c.Budget, func() (err error) {
		res, err = b.Forward(q, k, v, opt)
		return err
	})
	if err != nil {
		return fmt.Errorf("cp: calibration forward, %d×%d: %w", rows, cols, err)
	}
	bwd, err := timeCall(c.Budget, func() error {
		_, err := b.Backward(q, k, v, res.O, res.LSE, dO, opt)
		return err
	})
	if err != nil {
		return fmt.Errorf("cp: calibration backward, %d×%d: %w", rows, cols, err)
	}
	flops := gp.FLOPs()
	pr.Forward = append(pr.Forward, Rate{Rows: rows, Cols: cols, Masked: masked, FLOPs: flops, PerSecond: flops / max(fwd.Seconds(), 1e-9)})
	pr.Backward = append(pr.Backward, Rate{Rows: rows, Cols: cols, Masked: masked, FLOPs: 2.5 * flops,
		PerSecond: 2.5 * flops / max(bwd.Seconds(), 1e-9)})
	return nil
}

// timeCall runs fn once untimed, then times it until budget has passed (at
// least three times) and returns the median time.
func timeCall(budget time.Duration, fn func() error) (time.Duration, error) {
	if err := fn(); err != nil {
		return 0, err
	}
	var ts []time.Duration
	start := time.Now()
	for len(ts) < 3 || time.Since(start) < budget {
		t0 := time.Now()
		if err := fn(); err != nil {
			return 0, err
		}
		ts = append(ts, time.Since(t0))
	}
	slices.Sort(ts)
	return ts[len(ts)/2], nil
}

// randomTensor returns a tensor of standard normal values rounded to dt.
func randomTensor(rng *rand.Rand, dt attn.DType, shape ...int) attn.Tensor {
	t := attn.New(dt, shape...)
	for i := range t.NumElements() {
		t.Store(i, float32(rng.NormFloat64()))
	}
	return t
}

// MeasureLink measures the link of a transport; every rank of the group
// calls it. Each rank exchanges messages with its ring neighbours as the
// ring does: one-byte messages for the latency, messages of bytes for the
// bandwidth, repeated for a few milliseconds. The ranks agree on the
// slowest rank's times, so all return the same bandwidth (bytes per
// second) and latency (seconds).
func MeasureLink(ctx context.Context, t Transport, bytes int) (bandwidth, latency float64, err error) {
	p, r := t.Size(), t.Rank()
	if p < 2 {
		return 0, 0, attn.Errorf(attn.ErrOption, "cp: measuring a link needs two ranks, the group has %d", p)
	}
	if bytes < 1 {
		return 0, 0, attn.Errorf(attn.ErrOption, "cp: measuring a link with %d-byte messages", bytes)
	}
	next, prev := (r+1)%p, (r+p-1)%p
	hop := func(n, reps int) (time.Duration, error) {
		send, recv := make([]byte, n), make([]byte, n)
		if err := t.Exchange(ctx, []Send{{next, send}}, []Recv{{prev, recv}}); err != nil {
			return 0, err
		}
		if err := t.Barrier(ctx); err != nil {
			return 0, err
		}
		start := time.Now()
		for range reps {
			if err := t.Exchange(ctx, []Send{{next, send}}, []Recv{{prev, recv}}); err != nil {
				return 0, err
			}
		}
		return time.Since(start) / time.Duration(reps), nil
	}
	small, err := hop(1, 200)
	if err != nil {
		return 0, 0, err
	}
	large, err := hop(bytes, 8)
	if err != nil {
		return 0, 0, err
	}
	// Agree on the slowest rank's times.
	mine := []byte(fmt.Sprintf("%020d%020d", small.Nanoseconds(), large.Nanoseconds()))
	all := make([]byte, len(mine)*p)
	if err := t.AllGather(ctx, mine, all); err != nil {
		return 0, 0, err
	}
	for i := range p {
		var s, l int64
		if _, err := fmt.Sscanf(string(all[i*40:(i+1)*40]), "%020d%020d", &s, &l); err != nil {
			return 0, 0, fmt.Errorf("cp: link times of rank %d: %w", i, err)
		}
		small, large = max(small, time.Duration(s)), max(large, time.Duration(l))
	}
	latency = small.Seconds()
	extra := max(large-small, time.Nanosecond)
	return float64(bytes) / extra.Seconds(), latency, nil
}

// MeasureLocalLink measures the in-process transport (NewLocal) between
// two ranks with MeasureLink.
func MeasureLocalLink(ctx context.Context, bytes int) (bandwidth, latency float64, err error) {
	err = Run(ctx, 2, func(ctx context.Context, t Transport) error {
		bw, lat, err := MeasureLink(ctx, t, bytes)
		if t.Rank() == 0 {
			bandwidth, latency = bw, lat
		}
		return err
	})
	return bandwidth, latency, err
}

// profileFile is the JSON form of a cache file.
type profileFile struct {
	Schema   string     `json:"schema"`
	Profiles []*Profile `json:"profiles"`
}

// profileSchema is the schema of the cache file.
const profileSchema = "flashattn-cp-profile/1"

// ProfilePath returns the cache file of a machine's profiles:
// <user cache dir>/flashattn/cp-<machine>.json, the machine's name made
// safe for a file name.
func ProfilePath(machine string) (string, error) {
	dir, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("cp: profile cache: %w", err)
	}
	safe := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '.' {
			return r
		}
		return '_'
	}, machine)
	return filepath.Join(dir, "flashattn", "cp-"+safe+".json"), nil
}

// ErrNoProfile reports a cache file without the profile asked for.
var ErrNoProfile = errors.New("cp: no cached profile")

// readProfiles reads a cache file; a missing file holds no profiles.
func readProfiles(path string) (*profileFile, error) {
	f := &profileFile{Schema: profileSchema}
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return f, nil
	}
	if err != nil {
		return nil, fmt.Errorf("cp: profile cache: %w", err)
	}
	if err := json.Unmarshal(data, f); err != nil {
		return nil, fmt.Errorf("cp: profile cache %s: %w", path, err)
	}
	if f.Schema != profileSchema {
		return nil, fmt.Errorf("cp: profile cache %s has schema %q, want %q", path, f.Schema, profileSchema)
	}
	return f, nil
}

// LoadProfile returns the profile of the given key (Profile.Key) from the
// cache file at path; it fails with an error wrapping ErrNoProfile when the
// file or the profile is missing.
func LoadProfile(path, key string) (*Profile, error) {
	f, err := readProfiles(path)
	if err != nil {
		return nil, err
	}
	for _, pr := range f.Profiles {
		if pr != nil && pr.Key() == key {
			return pr, pr.check()
		}
	}
	return nil, fmt.Errorf("%w for %q in %s", ErrNoProfile, key, path)
}

// SaveProfile stores pr in the cache file at path, replacing a profile of
// the same key, creating the file and its directory when missing. The file
// is replaced whole, by a rename, so a reader never sees half of it.
func SaveProfile(path string, pr *Profile) error {
	f, err := readProfiles(path)
	if err != nil {
		f = &profileFile{Schema: profileSchema}
	}
	f.Profiles = slices.DeleteFunc(f.Profiles, func(x *Profile) bool { return x == nil || x.Key() == pr.Key() })
	f.Profiles = append(f.Profiles, pr)
	data, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return fmt.Errorf("cp: profile cache: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("cp: profile cache: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".cp-profile-*")
	if err != nil {
		return fmt.Errorf("cp: profile cache: %w", err)
	}
	_, werr := tmp.Write(append(data, '\n'))
	cerr := tmp.Close()
	if err := errors.Join(werr, cerr); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("cp: profile cache: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("cp: profile cache: %w", err)
	}
	return nil
}

// CachedProfile returns the profile of key from the cache file at path,
// or, when there is none, measures one with measure and stores it there
// (a failure to store is returned with the profile, which is usable).
func CachedProfile(path, key string, measure func() (*Profile, error)) (*Profile, error) {
	if pr, err := LoadProfile(path, key); err == nil {
		return pr, nil
	}
	pr, err := measure()
	if err != nil {
		return nil, err
	}
	if pr.Key() != key {
		return nil, attn.Errorf(attn.ErrOption, "cp: measured profile %q, asked for %q", pr.Key(), key)
	}
	return pr, SaveProfile(path, pr)
}
