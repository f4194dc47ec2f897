package bench

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/flashattn/flashattn/attn"
)

// Schema versions written in File.Schema and ShapeList.Schema.
const (
	ResultsSchema = "flashattn-bench/1"
	ShapesSchema  = "flashattn-shapes/1"
)

// ResultsName is the name of the results file inside a sweep's output folder.
const ResultsName = "results.json"

// The record statuses.
const (
	StatusOK          = "ok"
	StatusUnsupported = "unsupported"
	StatusError       = "error"
)

// Ours is the implementation name of flashattn's own records; every other
// implementation is a peer.
const Ours = "flashattn"

// Record is one measurement. Its JSON form flattens the Case fields.
type Record struct {
	Case
	// Implementation is "flashattn" or a peer such as "torch-flash".
	Implementation string `json:"implementation"`
	// Backend is the backend or library path ("cpu", "cuda", "sdpa").
	Backend string `json:"backend"`
	// Device names the processor the measurement ran on.
	Device string `json:"device"`
	// FLOPs is the conventional operation count of one run (see the package doc).
	FLOPs float64 `json:"flops"`
	// MedianMs, MinMs and MaxMs are over Repeats timed runs, in milliseconds.
	MedianMs float64 `json:"median_ms"`
	MinMs    float64 `json:"min_ms"`
	MaxMs    float64 `json:"max_ms"`
	Repeats  int     `json:"repeats"`
	// FirstMs is the wall-clock time of the first run, compilation included.
	FirstMs float64 `json:"first_ms,omitempty"`
	// TFLOPs is FLOPs over the median, in 10¹² operations per second.
	TFLOPs float64 `json:"tflops"`
	// KernelVariant and DQAlgorithm are what the backend reports it chose:
	// the forward's kernel variant, then " + " and the backward's when the
	// pass ran one.
	KernelVariant string `json:"kernel_variant,omitempty"`
	DQAlgorithm   string `json:"dq_algorithm,omitempty"`
	// Status is "ok", "unsupported" or "error"; Message says why when not ok.
	Status  string `json:"status"`
	Message string `json:"message,omitempty"`
	// CP holds a context-parallel case's measurement (Case.CPRanks > 0);
	// MedianMs, MinMs and MaxMs are then its critical path (CriticalMs).
	CP *CPResult `json:"cp,omitempty"`
}

// OK reports whether the record holds a measurement.
func (r Record) OK() bool { return r.Status == StatusOK }

// File is a results file: metadata and the records.
type File struct {
	Schema  string    `json:"schema"`
	Created time.Time `json:"created"`
	// Command is the command line that produced the file.
	Command string `json:"command,omitempty"`
	// Host names the machine.
	Host    string   `json:"host,omitempty"`
	Records []Record `json:"records"`
}

// NewFile returns an empty results file stamped now.
func NewFile(command string) *File {
	host, _ := os.Hostname()
	return &File{Schema: ResultsSchema, Created: time.Now().UTC().Truncate(time.Second), Command: command, Host: host,
		Records: []Record{}}
}

// ShapeList is the list of cases `flashattn sweep --emit-shapes` writes for
// the peer scripts.
type ShapeList struct {
	Schema  string    `json:"schema"`
	Created time.Time `json:"created"`
	Preset  string    `json:"preset"`
	Cases   []Case    `json:"cases"`
}

// writeJSON writes v to path through a temporary file and a rename, so a
// reader never sees half a file.
func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("bench: encode %s: %w", path, err)
	}
	data = append(data, '\n')
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path)+"-*")
	if err != nil {
		return fmt.Errorf("bench: write %s: %w", path, err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		os.Remove(tmp.Name())
		return fmt.Errorf("bench: write %s: %w", path, err)
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		os.Remove(tmp.Name())
		return fmt.Errorf("bench: write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("bench: write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("bench: write %s: %w", path, err)
	}
	return nil
}

// Write writes f as indented JSON to path, atomically.
func (f *File) Write(path string) error { return writeJSON(path, f) }

// Write writes the shape list as indented JSON to path, atomically.
func (s *ShapeList) Write(path string) error { return writeJSON(path, s) }

// ReadFile reads a results file. A folder is read as its results.json. A
// file whose schema is not ResultsSchema fails with attn.ErrOption.
func ReadFile(path string) (*File, error) {
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		path = filepath.Join(path, ResultsName)
	}
	f, err := readJSON(path, "a results file", ResultsSchema, func(f *File) string { return f.Schema })
	if err != nil {
		return nil, err
	}
	for i := range f.Records {
		f.Records[i].Normalize()
	}
	return f, nil
}

// ReadShapes reads a shape list.
func ReadShapes(path string) (*ShapeList, error) {
	return readJSON(path, "a shape list", ShapesSchema, func(s *ShapeList) string { return s.Schema })
}

// readJSON reads the JSON document at path into a T (what names its kind
// in errors) and checks that its schema, read by schemaOf, is want.
func readJSON[T any](path, what, want string, schemaOf func(*T) string) (*T, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	var x T
	if err := json.Unmarshal(data, &x); err != nil {
		return nil, attn.Errorf(attn.ErrOption, "%s is not %s: %v", path, what, err)
	}
	if got := schemaOf(&x); got != want {
		return nil, attn.Errorf(attn.ErrOption, "%s has schema %q, want %q", path, got, want)
	}
	return &x, nil
}
