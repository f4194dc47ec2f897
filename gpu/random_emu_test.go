package gpu

import (
	"os"
	"testing"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/conformance"
)

// randomEmuCases returns the conformance suite's random cases
// (conformance.RandomCases) as backward cases, each in one dtype, taken in
// turn from those the suite runs it in (bf16, fp16, and fp32 up to head
// dims of 128): the Short subset, or all of them when
// FLASHATTN_EMU_RANDOM=all.
func randomEmuCases() []bwdCase {
	var out []bwdCase
	for i, rc := range conformance.RandomCases() {
		if !rc.Short && os.Getenv("FLASHATTN_EMU_RANDOM") != "all" {
			continue
		}
		dts := []attn.DType{attn.BFloat16, attn.Float16}
		if max(rc.DK, rc.DV) <= 128 {
			dts = append(dts, attn.Float32)
		}
		dt := dts[i%len(dts)]
		c := bwdCase{name: rc.Name, b: rc.B, n: rc.N, m: rc.M, h: rc.H, hkv: rc.Hkv, dk: rc.DK, dv: rc.DV,
			causal: rc.Opt.Causal, align: rc.Opt.Align, window: rc.Opt.Window, softcap: rc.Opt.Softcap, scale: rc.Opt.Scale,
			dropout: rc.Opt.Dropout, cuQ: rc.Opt.CuSeqlensQ, cuK: rc.Opt.CuSeqlensK, biasGrad: rc.BiasGrad, dtypes: []attn.DType{dt}}
		if rc.BiasB > 0 {
			c.bias = []int{rc.BiasB, rc.BiasH}
		}
		out = append(out, c)
	}
	return out
}

// TestRandomCasesEmulated runs the conformance suite's random cases — every
// feature drawn together — through the kernels the planner picks for a new
// backend (on sm_90 with tensor maps, device tensors without staging; the
// defaults, or the pipelines and bulk dQ that FLASHATTN_FWD_PIPELINE,
// FLASHATTN_BWD_PIPELINE and FLASHATTN_BULK_DQ name, as New reads them), on
// the host emulator, against the float64 reference: the forward
// (FLASHATTN_FWD_EMU) and the backward with both dQ algorithms
// (FLASHATTN_BWD_EMU); FLASHATTN_EMU_RANDOM=all runs every case, not only
// the Short subset; needs g++.
func TestRandomCasesEmulated(t *testing.T) {
	fwd, bwd := os.Getenv("FLASHATTN_FWD_EMU") != "", os.Getenv("FLASHATTN_BWD_EMU") != ""
	env := "FLASHATTN_FWD_EMU" // skips when neither is set, else checks for g++
	if !fwd {
		env = "FLASHATTN_BWD_EMU"
	}
	emuSkip(t, env, "forward and backward")
	cases := randomEmuCases()
	if len(cases) == 0 {
		t.Fatal("no random case")
	}
	for ci, c := range cases {
		dt := c.dtypes[0]
		in := c.inputs(t, dt, uint64(ci+900))
		t.Run(c.name+"/"+dt.String(), func(t *testing.T) {
			if fwd {
				t.Run("fwd", func(t *testing.T) {
					res, v := fwdEmuRunOn(t, in.q, in.k, in.v, in.opt, emuDefault)
					t.Logf("%s", v.Name())
					fwdCheck(t, dt, in.q, in.k, in.v, in.opt, res)
				})
			}
			if bwd {
				ref, naive := in.oracles(t)
				for _, algo := range []DQAlgorithm{DQAtomic, DQSeparate} {
					t.Run("bwd/"+algo.String(), func(t *testing.T) {
						g := emuRunOn(t, in, algo, false, emuDefault)
						checkGrads(t, dt, g, ref, naive)
						if c.biasGrad {
							checkGrad(t, "dBias", dt, *g.DBias, ref.DBias, naive.DBias)
						}
						checkMaskedRowsZero(t, in, g.DQ)
					})
				}
			}
		})
	}
}
