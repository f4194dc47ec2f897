package main

import (
	"fmt"
	"math"

	. "github.com/mmcloughlin/avo/build"
	. "github.com/mmcloughlin/avo/operand"
	"github.com/mmcloughlin/avo/reg"
)

// The exp of ExpSub: d is clamped to [expLo, expHi] (NaN kept), n =
// round(d·log2(e)), r = d − n·ln2 in two parts (ln2Hi exact in few bits),
// exp(r) = 1 + r·(1 + r·P(r)) on |r| ≤ ln2/2 with the Cephes expf polynomial,
// and the result is exp(r)·2ⁿ with a single rounding. exp(expLo) rounds to 0
// and exp(expHi) overflows to +Inf, so -Inf gives 0 and +Inf gives +Inf.
var expConsts = []struct {
	name string
	v    float32
}{
	{"lo", -104},
	{"hi", 89},
	{"log2e", math.Log2E},
	{"ln2hi", 0.693359375},
	{"ln2lo", -2.12194440e-4},
	{"p0", 1.9875691500e-4},
	{"p1", 1.3981999507e-3},
	{"p2", 8.3334519073e-3},
	{"p3", 4.1665795894e-2},
	{"p4", 1.6666665459e-1},
	{"p5", 5.0000001201e-1},
	{"one", 1},
}

// expIndex returns the position of a constant in expConsts.
func expIndex(name string) int {
	for i, c := range expConsts {
		if c.name == name {
			return i
		}
	}
	panic("no exp constant " + name)
}

// expTable holds every exp constant repeated 8 times (32 bytes each) and the
// integers the AVX2 kernel needs.
var expTable Mem

func expTab() Mem {
	if expTable.Symbol.Name == "" {
		expTable = GLOBL("expTable", RODATA|NOPTR)
		for i, c := range expConsts {
			for l := 0; l < 8; l++ {
				DATA(32*i+4*l, U32(math.Float32bits(c.v)))
			}
		}
		for l := 0; l < 8; l++ {
			DATA(32*len(expConsts)+4*l, U32(127))
		}
	}
	return expTable
}

// expConst returns the memory of the 8 copies of a constant.
func expConst(name string) Mem { return expTab().Offset(32 * expIndex(name)) }

// expBias is the memory of eight int32 127s.
func expBias() Mem { return expTab().Offset(32 * len(expConsts)) }

// expUnroll512 is the number of zmm vectors per iteration of expSub512.
const expUnroll512 = 4

// exp512 replaces each d in ds by exp(d), using constant registers c. The
// polynomial is evaluated as 1 + r·(1 + r·P(r)) with fused multiply-adds.
func exp512(ds []reg.VecVirtual, c map[string]reg.VecVirtual) {
	n := make([]reg.VecVirtual, len(ds))
	p := make([]reg.VecVirtual, len(ds))
	for i, d := range ds {
		n[i], p[i] = ZMM(), ZMM()
		VMAXPS(d, c["lo"], d) // max(lo, d); NaN d is kept
		VMINPS(d, c["hi"], d)
		VMULPS(c["log2e"], d, n[i])
		VRNDSCALEPS(U8(0), n[i], n[i])
		VFNMADD231PS(c["ln2hi"], n[i], d) // d = r
		VFNMADD231PS(c["ln2lo"], n[i], d)
		VMOVAPS(c["p0"], p[i])
	}
	for _, k := range []string{"p1", "p2", "p3", "p4", "p5", "one", "one"} {
		for i, d := range ds {
			VFMADD213PS(c[k], d, p[i])
		}
	}
	for i, d := range ds {
		VSCALEFPS(n[i], p[i], d)
	}
}

// hsum512 returns in the low lane of an xmm register the sum of the 16 lanes
// of s, added in a fixed order.
func hsum512(s reg.VecVirtual) reg.VecVirtual {
	hi := YMM()
	VEXTRACTF64X4(U8(1), s, hi)
	lo := s.AsY().(reg.VecVirtual)
	VADDPS(hi, lo, lo)
	return hsumY(lo)
}

// hsumY returns in the low lane of an xmm register the sum of the 8 lanes of
// the ymm register y, added in a fixed order.
func hsumY(y reg.VecVirtual) reg.VecVirtual {
	h := XMM()
	VEXTRACTF128(U8(1), y, h)
	x := XMM()
	VADDPS(h, y.AsX(), x)
	VMOVHLPS(x, x, h)
	VADDPS(h, x, x)
	VMOVSHDUP(x, h)
	VADDSS(h, x, x)
	return x
}

// lanesMask512 returns the opmask of the first min(n, 16) lanes.
func lanesMask512(n reg.Register) reg.Register {
	w := GP64()
	MOVQ(U32(16), w)
	CMPQ(n, w)
	CMOVQLT(n, w)
	m := GP64()
	MOVQ(I32(-1), m)
	BZHIQ(w, m, m)
	k := K()
	KMOVW(m.As32(), k)
	return k
}

func expSub512() {
	TEXT("expSub512", NOSPLIT, "func(x []float32, m float32) float32")
	Doc("expSub512 sets x[i] = exp(x[i]-m) and returns their sum (m finite), with AVX-512F.",
		fmt.Sprintf("Lane l of accumulator a sums the elements %dq+16a+l; the accumulators", 16*expUnroll512),
		"and then their lanes are added in a fixed order.")
	Pragma("noescape")
	p := Load(Param("x").Base(), GP64())
	n := Load(Param("x").Len(), GP64())
	mv := ZMM()
	VBROADCASTSS(NewParamAddr("m", 24), mv)
	c := map[string]reg.VecVirtual{}
	for _, k := range expConsts {
		c[k.name] = ZMM()
		VBROADCASTSS(expConst(k.name), c[k.name])
	}
	const u = expUnroll512
	s := make([]reg.VecVirtual, u)
	for i := range s {
		s[i] = ZMM()
		VPXORD(s[i], s[i], s[i])
	}
	s0 := s[0]

	Label("loop")
	CMPQ(n, U8(16*u))
	JLT(LabelRef("tail"))
	xs := make([]reg.VecVirtual, u)
	for i := range xs {
		xs[i] = ZMM()
		VMOVUPS(Mem{Base: p, Disp: 64 * i}, xs[i])
		VSUBPS(mv, xs[i], xs[i])
	}
	exp512(xs, c)
	for i := range xs {
		VMOVUPS(xs[i], Mem{Base: p, Disp: 64 * i})
		VADDPS(xs[i], s[i], s[i])
	}
	ADDQ(U32(64*u), p)
	SUBQ(U8(16*u), n)
	JMP(LabelRef("loop"))

	Label("tail")
	TESTQ(n, n)
	JLE(LabelRef("done"))
	k := lanesMask512(n)
	x := ZMM()
	VMOVUPS_Z(Mem{Base: p}, k, x)
	VSUBPS(mv, x, x)
	exp512([]reg.VecVirtual{x}, c)
	VMOVUPS(x, k, Mem{Base: p})
	VADDPS(x, s0, k, s0)
	ADDQ(U8(64), p)
	SUBQ(U8(16), n)
	JMP(LabelRef("tail"))

	Label("done")
	for w := u / 2; w >= 1; w /= 2 {
		for i := 0; i < w; i++ {
			VADDPS(s[i+w], s[i], s[i])
		}
	}
	sum := hsum512(s0)
	VZEROUPPER()
	Store(sum, ReturnIndex(0))
	RET()
}

// expAVX2 replaces d by exp(d) with AVX2 and FMA: 2ⁿ is applied as two
// factors 2^(n>>1) and 2^(n-(n>>1)), both normal numbers, so that results
// in the subnormal range are rounded once.
// lo and hi hold the clamp bounds: a register operand keeps NaN.
func expAVX2(d, lo, hi reg.VecVirtual) {
	VMAXPS(d, lo, d)
	VMINPS(d, hi, d)
	n := YMM()
	VMULPS(expConst("log2e"), d, n)
	VROUNDPS(U8(0), n, n)
	VFNMADD231PS(expConst("ln2hi"), n, d) // d = r
	VFNMADD231PS(expConst("ln2lo"), n, d)
	p := YMM()
	VMOVUPS(expConst("p0"), p)
	for _, k := range []string{"p1", "p2", "p3", "p4", "p5"} {
		VFMADD213PS(expConst(k), d, p)
	}
	VFMADD213PS(expConst("one"), d, p)
	VFMADD213PS(expConst("one"), d, p)
	ni := YMM()
	VCVTPS2DQ(n, ni)
	n1 := YMM()
	VPSRAD(U8(1), ni, n1)
	VPSUBD(n1, ni, ni)
	VPADDD(expBias(), n1, n1)
	VPADDD(expBias(), ni, ni)
	VPSLLD(U8(23), n1, n1)
	VPSLLD(U8(23), ni, ni)
	VMULPS(n1, p, p)
	VMULPS(ni, p, d)
}

func expSubAVX2() {
	TEXT("expSubAVX2", NOSPLIT, "func(x []float32, m float32) float32")
	Doc("expSubAVX2 sets x[i] = exp(x[i]-m) and returns their sum (m finite, len(x) a",
		"multiple of 8), with AVX2 and FMA. Lane l of two accumulators sums elements",
		"16q+l and 16q+8+l; the accumulators and then their lanes are added in a fixed order.")
	Pragma("noescape")
	p := Load(Param("x").Base(), GP64())
	n := Load(Param("x").Len(), GP64())
	mv := YMM()
	VBROADCASTSS(NewParamAddr("m", 24), mv)
	s0, s1 := YMM(), YMM()
	VXORPS(s0, s0, s0)
	VXORPS(s1, s1, s1)
	lo, hi := YMM(), YMM()
	VMOVUPS(expConst("lo"), lo)
	VMOVUPS(expConst("hi"), hi)

	Label("loop")
	CMPQ(n, U8(16))
	JLT(LabelRef("tail"))
	x0, x1 := YMM(), YMM()
	VMOVUPS(Mem{Base: p}, x0)
	VMOVUPS(Mem{Base: p, Disp: 32}, x1)
	VSUBPS(mv, x0, x0)
	VSUBPS(mv, x1, x1)
	expAVX2(x0, lo, hi)
	expAVX2(x1, lo, hi)
	VMOVUPS(x0, Mem{Base: p})
	VMOVUPS(x1, Mem{Base: p, Disp: 32})
	VADDPS(x0, s0, s0)
	VADDPS(x1, s1, s1)
	ADDQ(U8(64), p)
	SUBQ(U8(16), n)
	JMP(LabelRef("loop"))

	Label("tail")
	TESTQ(n, n)
	JZ(LabelRef("done"))
	x := YMM()
	VMOVUPS(Mem{Base: p}, x)
	VSUBPS(mv, x, x)
	expAVX2(x, lo, hi)
	VMOVUPS(x, Mem{Base: p})
	VADDPS(x, s0, s0)

	Label("done")
	VADDPS(s1, s0, s0)
	sum := hsumY(s0)
	VZEROUPPER()
	Store(sum, ReturnIndex(0))
	RET()
}

func max512() {
	TEXT("max512", NOSPLIT, "func(x []float32) float32")
	Doc("max512 returns the largest element of x (len(x) > 0), ignoring NaN, with AVX-512F.")
	Pragma("noescape")
	p := Load(Param("x").Base(), GP64())
	n := Load(Param("x").Len(), GP64())
	acc := make([]reg.VecVirtual, 4)
	ninf := GP32()
	MOVL(U32(0xff800000), ninf)
	for i := range acc {
		acc[i] = ZMM()
		VPBROADCASTD(ninf, acc[i])
	}
	Label("loop")
	CMPQ(n, U8(64))
	JLT(LabelRef("tail"))
	for i := range acc {
		x := ZMM()
		VMOVUPS(Mem{Base: p, Disp: 64 * i}, x)
		VMAXPS(acc[i], x, acc[i]) // max(x, acc): acc when x is NaN
	}
	ADDQ(U32(256), p)
	SUBQ(U8(64), n)
	JMP(LabelRef("loop"))
	Label("tail")
	TESTQ(n, n)
	JLE(LabelRef("done"))
	k := lanesMask512(n)
	x := ZMM()
	VMOVUPS_Z(Mem{Base: p}, k, x)
	VMAXPS(acc[0], x, k, acc[0])
	ADDQ(U8(64), p)
	SUBQ(U8(16), n)
	JMP(LabelRef("tail"))
	Label("done")
	VMAXPS(acc[1], acc[0], acc[0])
	VMAXPS(acc[3], acc[2], acc[2])
	VMAXPS(acc[2], acc[0], acc[0])
	hi := YMM()
	VEXTRACTF64X4(U8(1), acc[0], hi)
	lo := acc[0].AsY().(reg.VecVirtual)
	VMAXPS(hi, lo, lo)
	r := hmaxY(lo)
	VZEROUPPER()
	Store(r, ReturnIndex(0))
	RET()
}

// hmaxY returns in the low lane of an xmm register the largest of the 8
// lanes of y (none of them NaN).
func hmaxY(y reg.VecVirtual) reg.VecVirtual {
	h := XMM()
	VEXTRACTF128(U8(1), y, h)
	x := XMM()
	VMAXPS(h, y.AsX(), x)
	VMOVHLPS(x, x, h)
	VMAXPS(h, x, x)
	VMOVSHDUP(x, h)
	VMAXSS(h, x, x)
	return x
}

func maxAVX2() {
	TEXT("maxAVX2", NOSPLIT, "func(x []float32) float32")
	Doc("maxAVX2 returns the largest element of x (len(x) a positive multiple of 8),",
		"ignoring NaN, with AVX2.")
	Pragma("noescape")
	p := Load(Param("x").Base(), GP64())
	n := Load(Param("x").Len(), GP64())
	acc := make([]reg.VecVirtual, 4)
	ninf := GP32()
	MOVL(U32(0xff800000), ninf)
	t := XMM()
	MOVD(ninf, t)
	for i := range acc {
		acc[i] = YMM()
		VBROADCASTSS(t, acc[i])
	}
	Label("loop")
	CMPQ(n, U8(32))
	JLT(LabelRef("tail"))
	for i := range acc {
		x := YMM()
		VMOVUPS(Mem{Base: p, Disp: 32 * i}, x)
		VMAXPS(acc[i], x, acc[i])
	}
	ADDQ(U8(128), p)
	SUBQ(U8(32), n)
	JMP(LabelRef("loop"))
	Label("tail")
	TESTQ(n, n)
	JZ(LabelRef("done"))
	x := YMM()
	VMOVUPS(Mem{Base: p}, x)
	VMAXPS(acc[0], x, acc[0])
	ADDQ(U8(32), p)
	SUBQ(U8(8), n)
	JMP(LabelRef("tail"))
	Label("done")
	VMAXPS(acc[1], acc[0], acc[0])
	VMAXPS(acc[3], acc[2], acc[2])
	VMAXPS(acc[2], acc[0], acc[0])
	r := hmaxY(acc[0])
	VZEROUPPER()
	Store(r, ReturnIndex(0))
	RET()
}

func scale512() {
	TEXT("scale512", NOSPLIT, "func(x []float32, s float32)")
	Doc("scale512 multiplies every element of x by s, with AVX-512F.")
	Pragma("noescape")
	p := Load(Param("x").Base(), GP64())
	n := Load(Param("x").Len(), GP64())
	s := ZMM()
	VBROADCASTSS(NewParamAddr("s", 24), s)
	Label("loop")
	CMPQ(n, U8(64))
	JLT(LabelRef("tail"))
	for i := 0; i < 4; i++ {
		x := ZMM()
		VMULPS(Mem{Base: p, Disp: 64 * i}, s, x)
		VMOVUPS(x, Mem{Base: p, Disp: 64 * i})
	}
	ADDQ(U32(256), p)
	SUBQ(U8(64), n)
	JMP(LabelRef("loop"))
	Label("tail")
	TESTQ(n, n)
	JLE(LabelRef("done"))
	k := lanesMask512(n)
	x := ZMM()
	VMOVUPS_Z(Mem{Base: p}, k, x)
	VMULPS(s, x, x)
	VMOVUPS(x, k, Mem{Base: p})
	ADDQ(U8(64), p)
	SUBQ(U8(16), n)
	JMP(LabelRef("tail"))
	Label("done")
	VZEROUPPER()
	RET()
}

func scaleAVX2() {
	TEXT("scaleAVX2", NOSPLIT, "func(x []float32, s float32)")
	Doc("scaleAVX2 multiplies every element of x (len(x) a multiple of 8) by s, with AVX2.")
	Pragma("noescape")
	p := Load(Param("x").Base(), GP64())
	n := Load(Param("x").Len(), GP64())
	s := YMM()
	VBROADCASTSS(NewParamAddr("s", 24), s)
	Label("loop")
	TESTQ(n, n)
	JZ(LabelRef("done"))
	x := YMM()
	VMULPS(Mem{Base: p}, s, x)
	VMOVUPS(x, Mem{Base: p})
	ADDQ(U8(32), p)
	SUBQ(U8(8), n)
	JMP(LabelRef("loop"))
	Label("done")
	VZEROUPPER()
	RET()
}

// Integer constants of the binary16 conversion.
var halfConsts = []uint32{0x8000, 0x7fff, 0x7c00, 0x7f800000, math.Float32bits(0x1p112)}

var halfTable Mem

// halfConst returns the memory of 8 copies of halfConsts[i].
func halfConst(i int) Mem {
	if halfTable.Symbol.Name == "" {
		halfTable = GLOBL("halfTable", RODATA|NOPTR)
		for j, v := range halfConsts {
			for l := 0; l < 8; l++ {
				DATA(32*j+4*l, U32(v))
			}
		}
	}
	return halfTable.Offset(32 * i)
}

const convertSig = "func(dst []float32, src []uint16)"

// convertLoop emits the loop over vectors of lanes elements shared by the
// converters; body converts the 16-bit values zero-extended in h.
func convertLoop(lanes int, vec func() reg.VecVirtual, body func(h reg.VecVirtual)) {
	d := Load(Param("dst").Base(), GP64())
	s := Load(Param("src").Base(), GP64())
	n := Load(Param("src").Len(), GP64())
	Label("loop")
	TESTQ(n, n)
	JZ(LabelRef("done"))
	h := vec()
	VPMOVZXWD(Mem{Base: s}, h)
	body(h)
	VMOVUPS(h, Mem{Base: d})
	ADDQ(U8(4*lanes), d)
	ADDQ(U8(2*lanes), s)
	SUBQ(U8(lanes), n)
	JMP(LabelRef("loop"))
	Label("done")
	VZEROUPPER()
	RET()
}

func convert512() {
	TEXT("bf16ToFloat32512", NOSPLIT, convertSig)
	Doc("bf16ToFloat32512 widens bfloat16 src to float32 dst (len(src) a multiple of 16,",
		"len(dst) ≥ len(src)), with AVX-512F.")
	Pragma("noescape")
	convertLoop(16, ZMM, func(h reg.VecVirtual) { VPSLLD(U8(16), h, h) })

	TEXT("float16ToFloat32512", NOSPLIT, convertSig)
	Doc("float16ToFloat32512 converts binary16 src to float32 dst exactly (len(src) a",
		"multiple of 16, len(dst) ≥ len(src)), with AVX-512F integer operations: NaN",
		"payloads are kept as they are, signaling NaNs included.")
	Pragma("noescape")
	c := make([]reg.VecVirtual, len(halfConsts))
	for i := range c {
		c[i] = ZMM()
		VBROADCASTSS(halfConst(i), c[i])
	}
	convertLoop(16, ZMM, func(h reg.VecVirtual) { half512(h, c) })
}

// half512 converts the binary16 values in the int32 lanes of h to float32.
func half512(h reg.VecVirtual, c []reg.VecVirtual) {
	sign, t, e := ZMM(), ZMM(), ZMM()
	VPANDD(c[0], h, sign)
	VPSLLD(U8(16), sign, sign)
	VPANDD(c[1], h, t)
	VPSLLD(U8(13), t, t)
	VPANDD(c[2], h, e)
	k := K()
	VPCMPEQD(c[2], e, k)
	VMULPS(c[4], t, h) // exponent rebias; exact for normals and subnormals
	VPORD(c[3], t, k, h)
	VPORD(sign, h, h)
}

func convertAVX2() {
	TEXT("bf16ToFloat32AVX2", NOSPLIT, convertSig)
	Doc("bf16ToFloat32AVX2 widens bfloat16 src to float32 dst (len(src) a multiple of 8,",
		"len(dst) ≥ len(src)), with AVX2.")
	Pragma("noescape")
	convertLoop(8, YMM, func(h reg.VecVirtual) { VPSLLD(U8(16), h, h) })

	TEXT("float16ToFloat32AVX2", NOSPLIT, convertSig)
	Doc("float16ToFloat32AVX2 converts binary16 src to float32 dst exactly (len(src) a",
		"multiple of 8, len(dst) ≥ len(src)), with AVX2 integer operations.")
	Pragma("noescape")
	convertLoop(8, YMM, func(h reg.VecVirtual) {
		sign, t, e := YMM(), YMM(), YMM()
		VPAND(halfConst(0), h, sign)
		VPSLLD(U8(16), sign, sign)
		VPAND(halfConst(1), h, t)
		VPSLLD(U8(13), t, t)
		VPAND(halfConst(2), h, e)
		VPCMPEQD(halfConst(2), e, e)
		VMULPS(halfConst(4), t, h)
		VPOR(halfConst(3), t, t)
		VBLENDVPS(e, t, h, h)
		VPOR(sign, h, h)
	})
}
