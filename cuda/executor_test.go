package cuda

import (
	"errors"
	"runtime"
	"sync"
	"syscall"
	"testing"
)

// newBareExecutor starts a Device executor with no driver behind it, to
// test the executor on machines without CUDA. stop ends it.
func newBareExecutor(t testing.TB) (d *Device, stop func()) {
	d = &Device{work: make(chan func(), 64), live: map[resourceKey]func(){}}
	go func() {
		runtime.LockOSThread()
		d.loop()
	}()
	return d, func() {
		d.mu.Lock()
		d.closed = true
		close(d.work)
		d.mu.Unlock()
	}
}

func TestExecutorOneThread(t *testing.T) {
	d, stop := newBareExecutor(t)
	defer stop()
	const goroutines, calls = 32, 200
	tids := make(chan int, goroutines*calls)
	var wg sync.WaitGroup
	for range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range calls {
				if err := d.do(func() error { tids <- syscall.Gettid(); return nil }); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(tids)
	first, n := -1, 0
	for tid := range tids {
		if first < 0 {
			first = tid
		}
		if tid != first {
			t.Fatalf("closures ran on threads %d and %d", first, tid)
		}
		n++
	}
	if n != goroutines*calls {
		t.Errorf("%d closures ran, want %d", n, goroutines*calls)
	}
}

func TestExecutorErrorsAndPanics(t *testing.T) {
	d, stop := newBareExecutor(t)
	sentinel := errors.New("boom")
	if err := d.do(func() error { return sentinel }); err != sentinel {
		t.Errorf("do returned %v, want the closure's error", err)
	}
	func() {
		defer func() {
			if p := recover(); p != "executor panic" {
				t.Errorf("recovered %v, want the closure's panic", p)
			}
		}()
		d.do(func() error { panic("executor panic") })
	}()
	if err := d.do(func() error { return nil }); err != nil {
		t.Errorf("executor unusable after a panic: %v", err)
	}
	stop()
	if err := d.do(func() error { t.Error("closure ran after stop"); return nil }); !errors.Is(err, ErrClosed) {
		t.Errorf("do after stop: %v, want ErrClosed", err)
	}
	if err := d.MakeCurrent(); !errors.Is(err, ErrClosed) {
		t.Errorf("MakeCurrent after stop: %v, want ErrClosed", err)
	}
}

func BenchmarkExecutorRoundTrip(b *testing.B) {
	d, stop := newBareExecutor(b)
	defer stop()
	for b.Loop() {
		d.do(func() error { return nil })
	}
}
