package cp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
)

// openNCCLDevice returns GPU 0, or skips the test where there is no GPU or
// no NCCL.
func openNCCLDevice(t *testing.T) *cuda.Device {
	t.Helper()
	dev, err := cuda.Open(0)
	if cuda.Unavailable(err) {
		t.Skipf("no GPU: %v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	v, path, err := NCCLVersion()
	if errors.Is(err, ErrNoNCCL) {
		t.Skipf("no NCCL: %v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	t.Logf("NCCL %d from %s on %v", v, path, dev)
	return dev
}

// pattern returns n bytes that differ from rank to rank and from byte to
// byte.
func pattern(rank, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rank*37 + i*11 + 1)
	}
	return b
}

// checkOneRank runs every operation of a one-rank communicator and checks
// what arrives.
func checkOneRank(t *testing.T, n *NCCL) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dev := n.Device()
	if st, err := n.asyncError("test"); err != nil || st != NCCLSuccess {
		t.Fatalf("ncclCommGetAsyncError: %v, %v", st, err)
	}
	const size = 4096
	buf, err := dev.Alloc(2 * size)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	want := pattern(n.Rank(), size)
	if err := dev.CopyToDevice(buf, 0, want); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	read := func(what string) {
		t.Helper()
		if err := n.Wait(ctx, nil); err != nil {
			t.Fatalf("%s: wait: %v", what, err)
		}
		if err := dev.CopyFromDevice(got, buf, size); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%s: the received bytes differ from the sent ones", what)
		}
		if err := dev.Memset8(buf, 0); err != nil {
			t.Fatal(err)
		}
		if err := dev.CopyToDevice(buf, 0, want); err != nil {
			t.Fatal(err)
		}
	}
	src, dst := DeviceSpan{buf, 0, size}, DeviceSpan{buf, size, size}
	// Grouped send/recv to self, in two messages.
	half := DeviceSpan{buf, 0, size / 2}
	if err := n.ExchangeOn(ctx, nil,
		[]DeviceSend{{0, half}, {0, DeviceSpan{buf, size / 2, size / 2}}},
		[]DeviceRecv{{0, DeviceSpan{buf, size, size / 2}}, {0, DeviceSpan{buf, size + size/2, size / 2}}}); err != nil {
		t.Fatal(err)
	}
	read("send/recv to self")
	if err := n.AllToAllOn(ctx, nil, src, dst); err != nil {
		t.Fatal(err)
	}
	read("all-to-all")
	if err := n.AllGatherOn(ctx, nil, src, dst); err != nil {
		t.Fatal(err)
	}
	read("all-gather")

	// The byte Transport, staged through device memory.
	hostGot := make([]byte, size)
	if err := n.Exchange(ctx, []Send{{0, want}}, []Recv{{0, hostGot}}); err != nil || !bytes.Equal(hostGot, want) {
		t.Fatalf("Exchange: %v (equal %v)", err, bytes.Equal(hostGot, want))
	}
	clear(hostGot)
	if err := n.AllToAll(ctx, want, hostGot); err != nil || !bytes.Equal(hostGot, want) {
		t.Fatalf("AllToAll: %v", err)
	}
	clear(hostGot)
	if err := n.AllGather(ctx, want, hostGot); err != nil || !bytes.Equal(hostGot, want) {
		t.Fatalf("AllGather: %v", err)
	}
	if err := n.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
	if st, err := n.asyncError("test"); err != nil || st != NCCLSuccess {
		t.Fatalf("ncclCommGetAsyncError after the operations: %v, %v", st, err)
	}
}

// newOneRank returns a one-rank communicator on dev, closed at the end of
// the test.
func newOneRank(t *testing.T, ctx context.Context, dev *cuda.Device) *NCCL {
	t.Helper()
	id, err := NewNCCLUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	n, err := NewNCCL(ctx, dev, id, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	return n
}

func TestNCCLOneRankGPU(t *testing.T) {
	dev := openNCCLDevice(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	t.Run("InitRank", func(t *testing.T) {
		// OpenNCCL with a one-rank environment: the unique id, the
		// rendezvous (trivial) and ncclCommInitRankConfig.
		n, err := OpenNCCL(ctx, Env{Size: 1}, dev)
		if err != nil {
			t.Fatal(err)
		}
		checkOneRank(t, n)
		if err := n.Close(); err != nil {
			t.Fatal(err)
		}
		if err := n.Barrier(ctx); err == nil {
			t.Fatal("Barrier after Close succeeded")
		}
	})
	t.Run("InitAll", func(t *testing.T) {
		ns, err := NewNCCLAll(ctx, []*cuda.Device{dev})
		if err != nil {
			t.Fatal(err)
		}
		checkOneRank(t, ns[0])
		if err := ns[0].Close(); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("Split", func(t *testing.T) {
		// ncclCommSplit of a one-rank group: a communicator of its own.
		n := newOneRank(t, ctx, dev)
		sub, err := SplitGroup(ctx, n, 0, 0)
		if errors.Is(err, attn.ErrUnsupported) {
			t.Skipf("this NCCL cannot split: %v", err)
		}
		if err != nil {
			t.Fatal(err)
		}
		checkOneRank(t, sub.(*NCCL))
		if err := sub.(*NCCL).Close(); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("Abort", func(t *testing.T) {
		n := newOneRank(t, ctx, dev)
		cause := errors.New("test abort")
		n.Abort(cause)
		if err := n.Barrier(ctx); !errors.Is(err, ErrAborted) || !errors.Is(err, cause) {
			t.Fatalf("after Abort: %v", err)
		}
	})
	t.Run("Timeout", func(t *testing.T) {
		// A receive nobody sends: Wait must give up at the deadline and
		// abort the communicator, which stops the waiting kernel.
		n := newOneRank(t, ctx, dev)
		buf, err := dev.Alloc(1024)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { buf.Free() })
		short, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		start := time.Now()
		err = n.ExchangeOn(short, nil, nil, []DeviceRecv{{0, DeviceSpan{buf, 0, 1024}}})
		if err == nil {
			err = n.Wait(short, nil)
		}
		if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, ErrNCCL) {
			t.Fatalf("a receive without a send: %v", err)
		}
		if d := time.Since(start); d > 30*time.Second {
			t.Errorf("took %v", d)
		}
		t.Logf("a receive without a send: %v", err)
		if err := n.Barrier(ctx); !errors.Is(err, ErrAborted) {
			t.Fatalf("after the timeout: %v", err)
		}
		if err := dev.Synchronize(); err != nil {
			t.Logf("the device after the abort: %v", err)
		}
	})
}

// ringShift sends this rank's pattern to the next rank and checks the
// previous rank's, from device memory, then runs the byte Transport's
// all-to-all and a barrier.
func ringShift(ctx context.Context, n *NCCL) error {
	const size = 1 << 16
	dev, p, r := n.Device(), n.Size(), n.Rank()
	buf, err := dev.Alloc(2 * size)
	if err != nil {
		return err
	}
	defer buf.Free()
	if err := dev.CopyToDevice(buf, 0, pattern(r, size)); err != nil {
		return err
	}
	next, prev := (r+1)%p, (r+p-1)%p
	if err := n.ExchangeOn(ctx, nil, []DeviceSend{{next, DeviceSpan{buf, 0, size}}},
		[]DeviceRecv{{prev, DeviceSpan{buf, size, size}}}); err != nil {
		return err
	}
	if err := n.Wait(ctx, nil); err != nil {
		return err
	}
	got := make([]byte, size)
	if err := dev.CopyFromDevice(got, buf, size); err != nil {
		return err
	}
	if !bytes.Equal(got, pattern(prev, size)) {
		return fmt.Errorf("rank %d: the bytes from rank %d differ", r, prev)
	}
	// Part t of rank r's all-to-all send is pattern(r*p+t); rank r
	// receives part r of every rank t.
	const part = 1024
	send, recv := make([]byte, 0, p*part), make([]byte, p*part)
	for t := range p {
		send = append(send, pattern(r*p+t, part)...)
	}
	if err := n.AllToAll(ctx, send, recv); err != nil {
		return err
	}
	for t := range p {
		if !bytes.Equal(recv[t*part:(t+1)*part], pattern(t*p+r, part)) {
			return fmt.Errorf("rank %d: all-to-all part %d differs", r, t)
		}
	}
	return n.Barrier(ctx)
}

func TestNCCLAllGPUs(t *testing.T) {
	info, err := cuda.Driver()
	if cuda.Unavailable(err) {
		t.Skipf("no GPU: %v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	if info.Devices < 2 {
		t.Skipf("%d GPU: a group of one process needs two", info.Devices)
	}
	if _, _, err := NCCLVersion(); errors.Is(err, ErrNoNCCL) {
		t.Skipf("no NCCL: %v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	devs := make([]*cuda.Device, min(info.Devices, 8))
	for i := range devs {
		d, err := cuda.Open(i)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		devs[i] = d
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	comms, err := NewNCCLAll(ctx, devs)
	if err != nil {
		t.Fatal(err)
	}
	for r, n := range comms {
		if n.Rank() != r || n.Size() != len(devs) || n.Device() != devs[r] {
			t.Fatalf("communicator %d: rank %d of %d on %v", r, n.Rank(), n.Size(), n.Device())
		}
	}
	// Each rank from its own goroutine, as Run drives them.
	errs := make(chan error, len(comms))
	for _, n := range comms {
		go func() { errs <- ringShift(ctx, n) }()
	}
	for range comms {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	for _, n := range comms {
		if err := n.Close(); err != nil {
			t.Error(err)
		}
	}
}
