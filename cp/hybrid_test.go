package cp

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cpu"
)

// TestSplitGroup checks that the in-process group splits by color into
// groups ordered by key, whose collectives reach only their members, and
// that an abort in a sub-group reaches the parent's ranks.
func TestSplitGroup(t *testing.T) {
	const p = 6
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	err := Run(ctx, p, func(ctx context.Context, tr Transport) error {
		r := tr.Rank()
		// Colors r%2, keys descending: group c holds ranks c, c+2, c+4
		// ranked in reverse.
		sub, err := SplitGroup(ctx, tr, r%2, -r)
		if err != nil {
			return err
		}
		if want := (p - 1 - r) / 2; sub.Size() != p/2 || sub.Rank() != want {
			return fmt.Errorf("rank %d: sub-group rank %d of %d, want %d of %d", r, sub.Rank(), sub.Size(), want, p/2)
		}
		all := make([]byte, sub.Size())
		if err := sub.AllGather(ctx, []byte{byte(r)}, all); err != nil {
			return err
		}
		for i, b := range all {
			if want := byte(p - 1 - 2*i - (1 - r%2)); b != want {
				return fmt.Errorf("rank %d: sub-group all-gather %v", r, all)
			}
		}
		// A second split of the same parent, then a split of the sub-group.
		one, err := SplitGroup(ctx, tr, 0, r)
		if err != nil || one.Size() != p || one.Rank() != r {
			return fmt.Errorf("rank %d: whole split: %v", r, err)
		}
		solo, err := SplitGroup(ctx, sub, sub.Rank(), 0)
		if err != nil || solo.Size() != 1 || solo.Rank() != 0 {
			return fmt.Errorf("rank %d: single split: %v", r, err)
		}
		return one.Barrier(ctx)
	})
	if err != nil {
		t.Fatal(err)
	}
	// An abort in one sub-group ends the other's waits.
	err = Run(ctx, 4, func(ctx context.Context, tr Transport) error {
		sub, err := SplitGroup(ctx, tr, tr.Rank()%2, 0)
		if err != nil {
			return err
		}
		switch tr.Rank() {
		case 1:
			return errBackend
		case 3:
			return sub.Barrier(context.Background())
		}
		return tr.Barrier(context.Background())
	})
	if !errors.Is(err, errBackend) {
		t.Errorf("abort from a sub-group's rank: %v", err)
	}
	if _, err := SplitGroup(ctx, struct{ Transport }{}, 0, 0); !errors.Is(err, attn.ErrUnsupported) {
		t.Errorf("SplitGroup of a transport that cannot: %v", err)
	}
	err = Run(ctx, 2, func(ctx context.Context, tr Transport) error {
		_, err := SplitGroup(ctx, tr, -1, 0)
		return err
	})
	if !errors.Is(err, attn.ErrOption) {
		t.Errorf("negative color: %v", err)
	}
}

// TestHybridDegree checks the automatic and given all-to-all degrees and
// the refusals, through Strategy as callers see them.
func TestHybridDegree(t *testing.T) {
	for _, tc := range []struct {
		s       string
		hkv, p  int
		want    int
		wantErr error
	}{
		{"hybrid", 2, 8, 2, nil},
		{"hybrid", 2, 6, 2, nil},
		{"hybrid", 1, 8, 1, nil},
		{"hybrid", 24, 8, 8, nil},
		{"hybrid", 6, 4, 2, nil},
		{"hybrid-2", 4, 8, 2, nil},
		{"hybrid-4", 2, 8, 0, attn.ErrUnsupported},
		{"hybrid-3", 3, 8, 0, attn.ErrUnsupported},
	} {
		t.Run(fmt.Sprintf("%s/hkv=%d/P=%d", tc.s, tc.hkv, tc.p), func(t *testing.T) {
			s, err := ParseStrategy(tc.s)
			if err != nil || s.String() != tc.s {
				t.Fatalf("ParseStrategy(%q) = %v, %v", tc.s, s, err)
			}
			err = s.Check(96, 96, tc.hkv, tc.p)
			if !errors.Is(err, tc.wantErr) || tc.wantErr == nil && err != nil {
				t.Fatalf("Check: %v, want %v", err, tc.wantErr)
			}
			if a, err := HybridDegree(s.Groups, tc.hkv, tc.p); err == nil && a != tc.want {
				t.Errorf("degree %d, want %d", a, tc.want)
			}
		})
	}
	for _, bad := range []string{"hybrid-0", "hybrid-x", "hybrid-02", "hybrid-"} {
		if _, err := ParseStrategy(bad); !errors.Is(err, attn.ErrOption) {
			t.Errorf("ParseStrategy(%q): %v, want ErrOption", bad, err)
		}
	}
	if err := (Strategy{Scheme: Ring, Groups: 2}).Check(8, 8, 2, 2); !errors.Is(err, attn.ErrOption) {
		t.Errorf("a ring with groups: %v", err)
	}
}

// TestHybridGivenDegree runs hybrid with a degree below the automatic one
// (A = 2 of 4 key heads on 8 ranks: 4 groups in a ring) and checks it
// against the single-device oracle; a degree that does not divide the key
// heads is refused.
func TestHybridGivenDegree(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	tc := accCase{"causal-gqa-given-degree", 1, 48, 48, 8, 4, 16, 8, attn.Options{Causal: true, Dropout: 0.1, Seed: 3}}
	q := normal(r, attn.Float32, tc.b, tc.n, tc.h, tc.dk)
	k := normal(r, attn.Float32, tc.b, tc.m, tc.hkv, tc.dk)
	v := normal(r, attn.Float32, tc.b, tc.m, tc.hkv, tc.dv)
	dO := normal(r, attn.Float32, tc.b, tc.n, tc.h, tc.dv)
	ref, _ := cpu.Reference(q, k, v, tc.opt)
	refG, _ := cpu.ReferenceBackward(q, k, v, dO, tc.opt)
	sim := &Sim{Backend: cpu.New(), P: 8, Layout: Zigzag, Scheme: Hybrid, Groups: 2, Timeout: testTimeout}
	res, err := sim.Forward(q, k, v, tc.opt)
	if err != nil {
		t.Fatal(err)
	}
	within(t, "O", attn.Float32, 2, res.O.Float64s(), ref.O, nil)
	within(t, "LSE", attn.Float32, 2, res.LSE.Float64s(), ref.LSE, nil)
	g, err := sim.Backward(q, k, v, res.O, res.LSE, dO, tc.opt)
	if err != nil {
		t.Fatal(err)
	}
	within(t, "dQ", attn.Float32, 3, g.DQ.Float64s(), refG.DQ, nil)
	within(t, "dK", attn.Float32, 3, g.DK.Float64s(), refG.DK, nil)
	within(t, "dV", attn.Float32, 3, g.DV.Float64s(), refG.DV, nil)
	sim.Groups = 3
	if _, err := sim.Forward(q, k, v, tc.opt); !errors.Is(err, attn.ErrUnsupported) {
		t.Errorf("degree 3 of 4 key heads: %v, want ErrUnsupported", err)
	}
}

// TestHybridReusesGroups checks that an Attention splits its sub-groups
// once across calls and releases them on Close.
func TestHybridReusesGroups(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	q, k, v := normal(r, attn.Float32, 1, 8, 4, 8), normal(r, attn.Float32, 1, 8, 2, 8), normal(r, attn.Float32, 1, 8, 2, 8)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	err := Run(ctx, 4, func(ctx context.Context, tr Transport) error {
		a := &Attention{Backend: cpu.New(), Transport: tr, Layout: Zigzag, Scheme: Hybrid}
		var first *hybridComms
		for i := range 2 {
			if _, err := a.Forward(ctx, q, k, v, attn.Options{Causal: true}); err != nil {
				return err
			}
			if i == 0 {
				first = a.hybrid
			} else if a.hybrid != first || first.degree != 2 || first.group.Size() != 2 || first.ring.Size() != 2 {
				return fmt.Errorf("rank %d: sub-groups %+v after the second call, %+v after the first", tr.Rank(), a.hybrid, first)
			}
		}
		if err := a.Close(); err != nil || a.hybrid != nil {
			return fmt.Errorf("Close: %v", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestEstimateHybrid checks the model of hybrid: with one key head it is
// the zigzag ring (A = 1), and where larger blocks run faster it beats the
// ring over all ranks, and Choose picks it where all-to-all cannot run.
func TestEstimateHybrid(t *testing.T) {
	gp := &attn.Problem{B: 1, N: 4096, M: 4096, H: 8, Hkv: 1, DK: 64, DV: 64, Opt: attn.Options{Causal: true}}
	flat := flatProfile(1e15, 0)
	zig, err := flat.Estimate(gp, attn.BFloat16, 8, ZigzagStrategy, true)
	if err != nil {
		t.Fatal(err)
	}
	hyb, err := flat.Estimate(gp, attn.BFloat16, 8, HybridStrategy, true)
	if err != nil || hyb.Err != nil {
		t.Fatal(err, hyb.Err)
	}
	if hyb.Time != zig.Time || hyb.Calls != zig.Calls || hyb.Sent != zig.Sent || hyb.Steps != 8 {
		t.Errorf("MQA hybrid %+v, zigzag %+v: want the same", hyb, zig)
	}
	// Rates that grow with the block: hybrid's ring of 4 runs blocks twice
	// as long as zigzag's ring of 8.
	grow := flatProfile(1e15, 0)
	grow.Forward = []Rate{{Rows: 64, Cols: 64, PerSecond: 1e9}, {Rows: 4096, Cols: 4096, PerSecond: 1e11}}
	g2 := *gp
	g2.Hkv = 2
	s, all, err := grow.Choose(&g2, attn.BFloat16, 8, false)
	if err != nil || s != HybridStrategy || len(all) != 4 || all[2].Err == nil {
		t.Fatalf("Choose = %v, %v (a2a: %v)", s, err, all[2].Err)
	}
	if h := all[3]; h.Steps != 4 || h.Exposed <= 0 || h.Speedup() <= all[1].Speedup() {
		t.Errorf("hybrid %+v, zigzag %+v", h, all[1])
	}
}

// TestNCCLSplitWithoutLibrary checks that an NCCL communicator whose
// library lacks ncclCommSplit refuses to split with ErrUnsupported, and
// that hybrid on it says so.
func TestNCCLSplitWithoutLibrary(t *testing.T) {
	n := fakeNCCL(0, 2)
	n.api = &ncclAPI{version: 21703}
	_, err := SplitGroup(context.Background(), n, 0, 0)
	if !errors.Is(err, attn.ErrUnsupported) {
		t.Fatalf("SplitGroup: %v, want ErrUnsupported", err)
	}
	a := &Attention{Backend: cpu.New(), Transport: n, Layout: Zigzag, Scheme: Hybrid}
	q := attn.New(attn.Float32, 1, 4, 2, 8)
	if _, err := a.Forward(context.Background(), q, q, q, attn.Options{}); !errors.Is(err, attn.ErrUnsupported) {
		t.Errorf("hybrid on it: %v, want ErrUnsupported", err)
	}
}
