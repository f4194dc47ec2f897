package gpu

import (
	"fmt"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

// softcapChainCases are the 16-bit softcap problems run forward and then
// backward with the forward's O and LSE: from nearly linear scores (a cap
// far above them, Gemma's regime) to saturated ones, where the derivative
// 1 − t² is small and the error of an approximate t largest relative to
// it. Their softcapped scores stay within ±8, where bf16's hardware tanh
// at its documented bound (relative error 2^-11: at most 2^-8, bf16's unit
// roundoff, in a score) keeps the LSE within the criterion's epsilon;
// with large, the cases with scores up to 30 and 50 as well, which rely
// on the hardware's measured accuracy (docs/kernels/forward.md, "Softcap").
func softcapChainCases(large bool) []bwdCase {
	cs := []bwdCase{
		{name: "cap5-causal-gqa", b: 1, n: 70, m: 150, h: 2, hkv: 1, dk: 128, dv: 128, softcap: 5, causal: true},
		{name: "cap8-scores-to-8", b: 1, n: 70, m: 150, h: 2, hkv: 2, dk: 64, dv: 64, softcap: 8, scale: 0.5},
		{name: "cap1-saturated", b: 1, n: 70, m: 150, h: 1, hkv: 1, dk: 64, dv: 64, softcap: 1, scale: 0.5},
	}
	if large {
		cs = append(cs,
			bwdCase{name: "cap30-scores-to-30", b: 1, n: 70, m: 150, h: 2, hkv: 2, dk: 64, dv: 64, softcap: 30, scale: 1},
			bwdCase{name: "cap50-scores-to-50-causal-gqa", b: 2, n: 256, m: 256, h: 4, hkv: 2, dk: 128, dv: 128, softcap: 50, scale: 2, causal: true})
	}
	return cs
}

// TestSoftcapEmulatedChain runs softcapChainCases on the host emulator as
// a training step does: the forward, then the backward with the forward's
// O and LSE, so that the backward recomputes P from the LSE of a forward
// whose scores took the same tanh (bf16: tanh.approx.f32, modelled at its
// documented error bound, FLASHATTN_EMU_TANH in testdata/emu/prims.h;
// fp16: tanhf). O and LSE are checked against the float64 oracle, the
// gradients too (FlashAttention's criterion against the naive computation
// in the storage type), on the mma.sync kernels and on the Hopper kernels
// (the forward with ping-pong, the backward with tensor maps)
// (FLASHATTN_BWD_EMU=1; needs g++).
func TestSoftcapEmulatedChain(t *testing.T) {
	emuSkip(t, "FLASHATTN_BWD_EMU", "backward")
	families := []struct {
		name     string
		fwd, bwd emuKernels
	}{{"mma.sync", emuMMA, emuMMA}, {"hopper", emuHopperPP, emuHopperTMA}}
	for ci, c := range softcapChainCases(false) {
		for _, dt := range []attn.DType{attn.BFloat16, attn.Float16} {
			for _, f := range families {
				t.Run(fmt.Sprintf("%s/%s/%v", f.name, c.name, dt), func(t *testing.T) {
					in := c.inputs(t, dt, uint64(ci+1500))
					res, vr := fwdEmuRunOn(t, in.q, in.k, in.v, in.opt, f.fwd)
					t.Logf("forward %s", vr.Name())
					fwdCheck(t, dt, in.q, in.k, in.v, in.opt, res)
					in.o, in.lse = res.O, res.LSE
					ref, naive := in.oracles(t)
					for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
						t.Run(algo.String(), func(t *testing.T) {
							checkGrads(t, dt, emuRunOn(t, in, algo, false, f.bwd), ref, naive)
						})
					}
				})
			}
		}
	}
}

// TestSoftcapChain runs every softcapChainCases problem (scores up to 50
// included) on the device as a training step does, the forward and then
// the backward with its O and LSE, and checks O, LSE and the gradients
// against the float64 oracle with FlashAttention's criterion: with the
// hardware's tanh (bf16) at its real accuracy rather than the emulator's
// documented bound.
func TestSoftcapChain(t *testing.T) {
	b := fwdBackend(t)
	for ci, c := range softcapChainCases(true) {
		for _, dt := range []attn.DType{attn.BFloat16, attn.Float16} {
			t.Run(fmt.Sprintf("%s/%v", c.name, dt), func(t *testing.T) {
				in := c.inputs(t, dt, uint64(ci+1500))
				res, err := b.Forward(in.q, in.k, in.v, in.opt)
				if err != nil {
					t.Fatalf("Forward: %v", err)
				}
				fwdCheck(t, dt, in.q, in.k, in.v, in.opt, res)
				g, err := b.Backward(in.q, in.k, in.v, res.O, res.LSE, in.dO, in.opt)
				if err != nil {
					t.Fatalf("Backward: %v", err)
				}
				ref, naive := in.oracles(t)
				checkGrads(t, dt, g, ref, naive)
			})
		}
	}
}
