package main

import (
	. "github.com/mmcloughlin/avo/build"
	. "github.com/mmcloughlin/avo/operand"
	"github.com/mmcloughlin/avo/reg"
)

// The tile kernels of the softmax: every row of a rows×cols tile with
// leading dimension lds is processed in turn, its columns in blocks of four
// zmm vectors, then single vectors, then one masked vector.

// expConsts512 broadcasts every exp constant into its own zmm register.
func expConsts512() map[string]reg.VecVirtual {
	c := map[string]reg.VecVirtual{}
	for _, k := range expConsts {
		c[k.name] = ZMM()
		VBROADCASTSS(expConst(k.name), c[k.name])
	}
	return c
}

// paramAddr returns the stack address of a named scalar argument.
func paramAddr(name string) Mem {
	b, err := Param(name).Resolve()
	if err != nil {
		panic(err)
	}
	return b.Addr
}

// expRow512 emits x = exp(prep(x)) for the n elements at p (both registers
// are consumed). With sums (four accumulators), the new values are also
// added: sums[v] collects vector v of each block of four, sums[0] the
// single and masked vectors, always in this order.
func expRow512(prefix string, p, n reg.Register, prep func(x reg.VecVirtual), c map[string]reg.VecVirtual, sums []reg.VecVirtual) {
	const u = expUnroll512
	Label(prefix + "blk")
	CMPQ(n, U8(16*u))
	JLT(LabelRef(prefix + "one"))
	xs := make([]reg.VecVirtual, u)
	for i := range xs {
		xs[i] = ZMM()
		VMOVUPS(Mem{Base: p, Disp: 64 * i}, xs[i])
		prep(xs[i])
	}
	exp512(xs, c)
	for i := range xs {
		VMOVUPS(xs[i], Mem{Base: p, Disp: 64 * i})
		if sums != nil {
			VADDPS(xs[i], sums[i], sums[i])
		}
	}
	ADDQ(U32(64*u), p)
	SUBQ(U8(16*u), n)
	JMP(LabelRef(prefix + "blk"))

	Label(prefix + "one")
	TESTQ(n, n)
	JLE(LabelRef(prefix + "end"))
	k := lanesMask512(n)
	x := ZMM()
	VMOVUPS_Z(Mem{Base: p}, k, x)
	prep(x)
	exp512([]reg.VecVirtual{x}, c)
	VMOVUPS(x, k, Mem{Base: p})
	if sums != nil {
		VADDPS(x, sums[0], k, sums[0])
	}
	ADDQ(U8(64), p)
	SUBQ(U8(16), n)
	JMP(LabelRef(prefix + "one"))
	Label(prefix + "end")
}

// zeroRow512 stores zeros in the n elements at p (both registers consumed).
func zeroRow512(prefix string, p, n reg.Register, zero reg.VecVirtual) {
	Label(prefix + "loop")
	TESTQ(n, n)
	JLE(LabelRef(prefix + "end"))
	k := lanesMask512(n)
	VMOVUPS(zero, k, Mem{Base: p})
	ADDQ(U8(64), p)
	SUBQ(U8(16), n)
	JMP(LabelRef(prefix + "loop"))
	Label(prefix + "end")
}

// isNegInf jumps to label when the low lane of x is -Inf.
func isNegInf(x reg.VecVirtual, label string) {
	g := GP32()
	VMOVD(x.AsX(), g)
	CMPL(g, U32(0xff800000))
	JEQ(LabelRef(label))
}

// rowStart returns a fresh pointer to the current row and a fresh count of
// its columns.
func rowStart(row reg.Register) (p, n reg.Register) {
	p, n = GP64(), GP64()
	MOVQ(row, p)
	Load(Param("cols"), n)
	return p, n
}

// reducePerm holds the lane permutation that puts the result of reduce16
// in row order: lane r of the output is lane 4·(r%4) + r/4 of the tree's.
var reducePerm Mem

func reducePermTab() Mem {
	if reducePerm.Symbol.Name == "" {
		reducePerm = GLOBL("reducePerm", RODATA|NOPTR)
		for r := 0; r < 16; r++ {
			DATA(4*r, U32(4*(r%4)+r/4))
		}
	}
	return reducePerm
}

// reduce16 returns a vector whose lane r is the reduction by op of the 16
// lanes of the vector stored at tmp+64r, for r < 16. The lanes are combined
// by a fixed tree: halves, then quarters, then pairs, then single lanes.
// op(x, y) must leave op of its operands in x.
func reduce16(tmp Mem, op func(x, y reg.VecVirtual)) reg.VecVirtual {
	level := func(imm1, imm2 uint8, shuf func(imm Op, y, x, dst reg.VecVirtual), x, y reg.VecVirtual) reg.VecVirtual {
		lo, hi := ZMM(), ZMM()
		shuf(U8(imm1), y, x, lo)
		shuf(U8(imm2), y, x, hi)
		op(lo, hi)
		return lo
	}
	f32x4 := func(imm Op, y, x, dst reg.VecVirtual) { VSHUFF32X4(imm, y, x, dst) }
	ps := func(imm Op, y, x, dst reg.VecVirtual) { VSHUFPS(imm, y, x, dst) }
	load := func(r int) reg.VecVirtual {
		v := ZMM()
		VMOVUPS(tmp.Offset(64*r), v)
		return v
	}
	l1 := func(k int) reg.VecVirtual { return level(0x44, 0xee, f32x4, load(2*k), load(2*k+1)) }
	l2 := func(k int) reg.VecVirtual { return level(0x88, 0xdd, f32x4, l1(2*k), l1(2*k+1)) }
	l3 := func(k int) reg.VecVirtual { return level(0x44, 0xee, ps, l2(2*k), l2(2*k+1)) }
	d := level(0x88, 0xdd, ps, l3(0), l3(1))
	idx, out := ZMM(), ZMM()
	VMOVDQU32(reducePermTab(), idx)
	VPERMPS(d, idx, out)
	return out
}

func softmaxOnline512() {
	TEXT("softmaxOnline512", 0, "func(s *float32, lds, rows, cols int, scale float32, m, l, alpha *float32)")
	Doc("softmaxOnline512 is the online-softmax step of SoftmaxOnline (rows, cols > 0), with AVX-512F.",
		"Row r: t = scale·x, mNew = max(m[r], max t); a row with mNew = -Inf becomes 0 with alpha[r] = 1;",
		"otherwise x = exp(scale·x − mNew) (one rounding before exp), alpha[r] = exp(m[r] − mNew),",
		"l[r] = l[r]·alpha[r] + Σx (fused) and m[r] = mNew. The rows go in groups of 16: the partial",
		"maxima and sums of each row (per lane, in a fixed order) are reduced for the whole group by",
		"one tree of shuffles, and m, l and alpha are updated as vectors.")
	tmp := AllocLocal(16 * 64)
	mv := AllocLocal(64)
	grp := Load(Param("s"), GP64())
	lds4 := Load(Param("lds"), GP64())
	SHLQ(U8(2), lds4)
	rows := Load(Param("rows"), GP64())
	pm := Load(Param("m"), GP64())
	pl := Load(Param("l"), GP64())
	pa := Load(Param("alpha"), GP64())
	scale := ZMM()
	VBROADCASTSS(paramAddr("scale"), scale)
	c := expConsts512()

	Label("group")
	g := GP64()
	MOVQ(U32(16), g)
	CMPQ(rows, g)
	CMOVQLT(rows, g)

	Comment("Phase 1: per row, the lane-wise maxima of scale·x, stored in tmp.")
	row, pt, cnt := GP64(), GP64(), GP64()
	MOVQ(grp, row)
	LEAQ(tmp, pt)
	MOVQ(g, cnt)
	Label("maxrow")
	p, n := rowStart(row)
	mx := ZMM()
	ninf := GP32()
	MOVL(U32(0xff800000), ninf)
	VPBROADCASTD(ninf, mx)
	Label("maxloop")
	CMPQ(n, U8(16))
	JLT(LabelRef("maxtail"))
	x := ZMM()
	VMULPS(Mem{Base: p}, scale, x)
	VMAXPS(mx, x, mx) // mx when x is NaN
	ADDQ(U8(64), p)
	SUBQ(U8(16), n)
	JMP(LabelRef("maxloop"))
	Label("maxtail")
	TESTQ(n, n)
	JLE(LabelRef("maxdone"))
	k := lanesMask512(n)
	xt := ZMM()
	VMULPS_Z(Mem{Base: p}, scale, k, xt)
	VMAXPS(mx, xt, k, mx)
	Label("maxdone")
	VMOVUPS(mx, Mem{Base: pt})
	ADDQ(lds4, row)
	ADDQ(U8(64), pt)
	DECQ(cnt)
	JNZ(LabelRef("maxrow"))

	Comment("Phase 2: mNew and alpha for the group's rows, as vectors.")
	kg := lanesMask512(g)
	rmax := reduce16(tmp, func(x, y reg.VecVirtual) { VMAXPS(y, x, x) })
	mold, mnew := ZMM(), ZMM()
	VMOVUPS_Z(Mem{Base: pm}, kg, mold)
	VMAXPS(rmax, mold, mnew)
	keq := K()
	VCMPPS(U8(0), mnew, mold, keq) // unchanged maximum (or both -Inf): alpha = 1
	av := ZMM()
	VSUBPS(mnew, mold, av)
	exp512([]reg.VecVirtual{av}, c)
	VMOVAPS(c["one"], keq, av)
	VMOVUPS(av, kg, Mem{Base: pa})
	VMOVUPS(mnew, kg, Mem{Base: pm})
	VMOVUPS(mnew, mv)
	ni := ZMM()
	MOVL(U32(0xff800000), ninf)
	VPBROADCASTD(ninf, ni)
	kinf := K()
	VCMPPS(U8(0), ni, mnew, kinf)
	bits := GP32()
	KMOVW(kinf, bits)

	Comment("Phase 3: per row, x = exp(scale·x − mNew) and its lane-wise sums, stored in tmp.")
	pmv := GP64()
	MOVQ(grp, row)
	LEAQ(tmp, pt)
	LEAQ(mv, pmv)
	MOVQ(g, cnt)
	Label("exprow")
	TESTL(U32(1), bits)
	JNZ(LabelRef("masked"))
	nm := ZMM()
	VBROADCASTSS(Mem{Base: pmv}, nm)
	sums := make([]reg.VecVirtual, expUnroll512)
	for i := range sums {
		sums[i] = ZMM()
		VPXORD(sums[i], sums[i], sums[i])
	}
	p2, n2 := rowStart(row)
	expRow512("exp", p2, n2, func(x reg.VecVirtual) { VFMSUB213PS(nm, scale, x) }, c, sums)
	for w := expUnroll512 / 2; w >= 1; w /= 2 {
		for i := 0; i < w; i++ {
			VADDPS(sums[i+w], sums[i], sums[i])
		}
	}
	VMOVUPS(sums[0], Mem{Base: pt})
	JMP(LabelRef("nextrow"))
	Label("masked")
	Comment("No visible element yet: the row becomes 0 and adds 0.")
	zero := ZMM()
	VPXORD(zero, zero, zero)
	VMOVUPS(zero, Mem{Base: pt})
	p3, n3 := rowStart(row)
	zeroRow512("zero", p3, n3, zero)
	Label("nextrow")
	ADDQ(lds4, row)
	ADDQ(U8(64), pt)
	ADDQ(U8(4), pmv)
	SHRL(U8(1), bits)
	DECQ(cnt)
	JNZ(LabelRef("exprow"))

	Comment("Phase 4: l = l·alpha + Σx for the group's rows.")
	sum := reduce16(tmp, func(x, y reg.VecVirtual) { VADDPS(y, x, x) })
	lold, al := ZMM(), ZMM()
	VMOVUPS_Z(Mem{Base: pl}, kg, lold)
	VMOVUPS_Z(Mem{Base: pa}, kg, al)
	VFMADD231PS(al, lold, sum)
	VMOVUPS(sum, kg, Mem{Base: pl})

	MOVQ(row, grp)
	ADDQ(U8(64), pm)
	ADDQ(U8(64), pl)
	ADDQ(U8(64), pa)
	SUBQ(U8(16), rows)
	JG(LabelRef("group"))
	VZEROUPPER()
	RET()
}

func expRows512() {
	TEXT("expRows512", NOSPLIT, "func(s *float32, lds, rows, cols int, scale float32, lse *float32)")
	Doc("expRows512 sets x = exp(scale·x − lse[r]) (one rounding before exp) in every row r",
		"of the tile, and x = 0 in the rows whose lse[r] is -Inf (rows, cols > 0), with AVX-512F.")
	Pragma("noescape")
	row := Load(Param("s"), GP64())
	lds4 := Load(Param("lds"), GP64())
	SHLQ(U8(2), lds4)
	rows := Load(Param("rows"), GP64())
	pl := Load(Param("lse"), GP64())
	scale := ZMM()
	VBROADCASTSS(paramAddr("scale"), scale)
	c := expConsts512()
	zero := ZMM()
	VPXORD(zero, zero, zero)

	Label("row")
	lse := XMM()
	VMOVSS(Mem{Base: pl}, lse)
	isNegInf(lse, "masked")
	nl := ZMM()
	VBROADCASTSS(lse, nl)
	p, n := rowStart(row)
	expRow512("exp", p, n, func(x reg.VecVirtual) { VFMSUB213PS(nl, scale, x) }, c, nil)
	JMP(LabelRef("next"))
	Label("masked")
	p2, n2 := rowStart(row)
	zeroRow512("zero", p2, n2, zero)
	Label("next")
	ADDQ(lds4, row)
	ADDQ(U8(4), pl)
	DECQ(rows)
	JNZ(LabelRef("row"))
	VZEROUPPER()
	RET()
}

func softmaxGrad512() {
	TEXT("softmaxGrad512", NOSPLIT, "func(p *float32, ldp int, dp *float32, lddp, rows, cols int, delta *float32)")
	Doc("softmaxGrad512 sets dp = p·(dp − delta[r]) in every row r of the tile (rows, cols > 0),",
		"with AVX-512F.")
	Pragma("noescape")
	prow := Load(Param("p"), GP64())
	ldp4 := Load(Param("ldp"), GP64())
	SHLQ(U8(2), ldp4)
	drow := Load(Param("dp"), GP64())
	ldd4 := Load(Param("lddp"), GP64())
	SHLQ(U8(2), ldd4)
	rows := Load(Param("rows"), GP64())
	pd := Load(Param("delta"), GP64())

	Label("row")
	dv := ZMM()
	VBROADCASTSS(Mem{Base: pd}, dv)
	pp, n := rowStart(prow)
	q := GP64()
	MOVQ(drow, q)
	Label("blk")
	CMPQ(n, U8(64))
	JLT(LabelRef("one"))
	for i := 0; i < 4; i++ {
		t := ZMM()
		VMOVUPS(Mem{Base: q, Disp: 64 * i}, t)
		VSUBPS(dv, t, t)
		VMULPS(Mem{Base: pp, Disp: 64 * i}, t, t)
		VMOVUPS(t, Mem{Base: q, Disp: 64 * i})
	}
	ADDQ(U32(256), pp)
	ADDQ(U32(256), q)
	SUBQ(U8(64), n)
	JMP(LabelRef("blk"))
	Label("one")
	TESTQ(n, n)
	JLE(LabelRef("next"))
	k := lanesMask512(n)
	t := ZMM()
	VMOVUPS_Z(Mem{Base: q}, k, t)
	VSUBPS(dv, t, t)
	pv := ZMM()
	VMOVUPS_Z(Mem{Base: pp}, k, pv)
	VMULPS(pv, t, t)
	VMOVUPS(t, k, Mem{Base: q})
	ADDQ(U8(64), pp)
	ADDQ(U8(64), q)
	SUBQ(U8(16), n)
	JMP(LabelRef("one"))

	Label("next")
	ADDQ(ldp4, prow)
	ADDQ(ldd4, drow)
	ADDQ(U8(4), pd)
	DECQ(rows)
	JNZ(LabelRef("row"))
	VZEROUPPER()
	RET()
}
