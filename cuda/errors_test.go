package cuda

import (
	"errors"
	"strings"
	"testing"
)

func TestErrorFormat(t *testing.T) {
	tests := []struct {
		name string
		err  *Error
		want string
		is   []error
		not  []error
	}{
		{
			name: "driver names",
			err:  &Error{Op: "cuMemAlloc_v2(1024 bytes)", Code: ErrorOutOfMemory, Name: "CUDA_ERROR_OUT_OF_MEMORY", Message: "out of memory"},
			want: "cuda: cuMemAlloc_v2(1024 bytes): CUDA_ERROR_OUT_OF_MEMORY (2): out of memory",
			is:   []error{ErrCUDA},
			not:  []error{ErrNoDevice, ErrNoDriver, ErrCompile},
		},
		{
			name: "name from the table",
			err:  &Error{Op: "cuLaunchKernel", Code: 719},
			want: "cuda: cuLaunchKernel: CUDA_ERROR_LAUNCH_FAILED (719)",
			is:   []error{ErrCUDA},
		},
		{
			name: "unknown code",
			err:  &Error{Code: 12345},
			want: "cuda: CUresult(12345) (12345)",
			is:   []error{ErrCUDA},
		},
		{
			name: "no device",
			err:  &Error{Op: "cuInit", Code: ErrorNoDevice, Message: "no CUDA-capable device is detected", also: ErrNoDevice},
			want: "cuda: cuInit: CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected",
			is:   []error{ErrCUDA, ErrNoDevice},
			not:  []error{ErrNoDriver},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var err error = tt.err
			if got := err.Error(); got != tt.want {
				t.Errorf("Error() = %q, want %q", got, tt.want)
			}
			for _, s := range tt.is {
				if !errors.Is(err, s) {
					t.Errorf("errors.Is(%v) = false", s)
				}
			}
			for _, s := range tt.not {
				if errors.Is(err, s) {
					t.Errorf("errors.Is(%v) = true", s)
				}
			}
			wrapped := errors.Join(errors.New("context"), err)
			var e *Error
			if !errors.As(wrapped, &e) || e.Code != tt.err.Code {
				t.Errorf("errors.As lost the *Error")
			}
			if Unavailable(err) != errors.Is(err, ErrNoDevice) {
				t.Errorf("Unavailable = %v", Unavailable(err))
			}
		})
	}
}

func TestResultName(t *testing.T) {
	tests := []struct {
		r    Result
		name string
	}{
		{Success, "CUDA_SUCCESS"},
		{ErrorInvalidValue, "CUDA_ERROR_INVALID_VALUE"},
		{ErrorStubLibrary, "CUDA_ERROR_STUB_LIBRARY"},
		{ErrorIllegalAddress, "CUDA_ERROR_ILLEGAL_ADDRESS"},
		{ErrorStreamCaptureInvalid, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"},
		{ErrorUnknown, "CUDA_ERROR_UNKNOWN"},
		{-1, "CUresult(-1)"},
	}
	for _, tt := range tests {
		if got := tt.r.Name(); got != tt.name {
			t.Errorf("Result(%d).Name() = %q, want %q", tt.r, got, tt.name)
		}
	}
	if got := ErrorOutOfMemory.String(); got != "CUDA_ERROR_OUT_OF_MEMORY (2)" {
		t.Errorf("String() = %q", got)
	}
}

func TestCompileErrorFormat(t *testing.T) {
	e := &CompileError{Name: "k.cu", Arch: "sm_90a", Result: "NVRTC_ERROR_COMPILATION",
		Log: "k.cu(3): error: identifier \"x\" is undefined\n\n1 error detected\n", SourcePath: "/c/abc.cu"}
	var err error = e
	want := "cuda: compile k.cu for sm_90a: NVRTC_ERROR_COMPILATION (source: /c/abc.cu)\n" +
		"k.cu(3): error: identifier \"x\" is undefined\n\n1 error detected"
	if err.Error() != want {
		t.Errorf("Error() = %q, want %q", err.Error(), want)
	}
	if !errors.Is(err, ErrCompile) || errors.Is(err, ErrCUDA) {
		t.Error("CompileError must wrap ErrCompile only")
	}
	e.SourcePath, e.Log = "", ""
	if got := e.Error(); got != "cuda: compile k.cu for sm_90a: NVRTC_ERROR_COMPILATION" {
		t.Errorf("without log: %q", got)
	}
}

func TestArgumentAndClosedErrors(t *testing.T) {
	if err := argErrorf("range [%d, %d)", 1, 2); !errors.Is(err, ErrArgument) || !strings.HasSuffix(err.Error(), "range [1, 2)") {
		t.Errorf("argErrorf: %v", err)
	}
	if err := closedErrorf("stream closed"); !errors.Is(err, ErrClosed) || Unavailable(err) {
		t.Errorf("closedErrorf: %v", err)
	}
	if ignoreClosed(closedErrorf("x")) != nil || ignoreClosed(ErrCUDA) != ErrCUDA {
		t.Error("ignoreClosed")
	}
}
