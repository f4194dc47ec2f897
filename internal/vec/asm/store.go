package main

import (
	. "github.com/mmcloughlin/avo/build"
	. "github.com/mmcloughlin/avo/operand"
	"github.com/mmcloughlin/avo/reg"
)

// Output conversions and the dot product, AVX-512F: whole vectors, then
// one masked vector.

// storeLoop512 emits the loop over the len(src) float32 elements of src:
// x = s·src (one vector, zero beyond the mask), then store(x, mask, dst)
// writes the vector; dst advances by dstBytes per element. setup, when not
// nil, runs once before the loop.
func storeLoop512(name string, doc []string, sig string, dstBytes int, setup func(), store func(x reg.VecVirtual, k reg.Register, dst Mem, masked bool)) {
	TEXT(name, NOSPLIT, sig)
	Doc(doc...)
	Pragma("noescape")
	if setup != nil {
		setup()
	}
	d := Load(Param("dst").Base(), GP64())
	s := Load(Param("src").Base(), GP64())
	n := Load(Param("src").Len(), GP64())
	sv := ZMM()
	VBROADCASTSS(paramAddr("s"), sv)
	Label("loop")
	CMPQ(n, U8(16))
	JLT(LabelRef("tail"))
	x := ZMM()
	VMULPS(Mem{Base: s}, sv, x)
	store(x, nil, Mem{Base: d}, false)
	ADDQ(U8(64), s)
	ADDQ(U8(16*dstBytes), d)
	SUBQ(U8(16), n)
	JMP(LabelRef("loop"))
	Label("tail")
	TESTQ(n, n)
	JLE(LabelRef("done"))
	k := lanesMask512(n)
	xt := ZMM()
	VMULPS_Z(Mem{Base: s}, sv, k, xt)
	store(xt, k, Mem{Base: d}, true)
	Label("done")
	VZEROUPPER()
	RET()
}

// bf16Consts are the integer constants of the rounding to bfloat16.
var bf16Consts = []uint32{0x7fff, 1, 0x7fffffff, 0x7f800000, 0x40}

func store512() {
	storeLoop512("scaleTo512",
		[]string{"scaleTo512 sets dst[i] = s·src[i] for i < len(src) (len(dst) ≥ len(src)), with AVX-512F."},
		"func(dst []float32, src []float32, s float32)", 4, nil,
		func(x reg.VecVirtual, k reg.Register, dst Mem, masked bool) {
			if masked {
				VMOVUPS(x, k, dst)
			} else {
				VMOVUPS(x, dst)
			}
		})

	storeLoop512("toFloat16512",
		[]string{"toFloat16512 sets dst[i] to s·src[i] (rounded to float32) rounded to binary16, to nearest even,",
			"for i < len(src) (len(dst) ≥ len(src)), with AVX-512F."},
		"func(dst []uint16, src []float32, s float32)", 2, nil,
		func(x reg.VecVirtual, k reg.Register, dst Mem, masked bool) {
			if masked {
				VCVTPS2PH(U8(0), x, k, dst)
			} else {
				VCVTPS2PH(U8(0), x, dst)
			}
		})

	var c []reg.VecVirtual
	storeLoop512("toBF16512",
		[]string{"toBF16512 sets dst[i] to s·src[i] (rounded to float32) rounded to bfloat16, to nearest even",
			"(NaN: the high half with the quiet bit set), for i < len(src) (len(dst) ≥ len(src)), with AVX-512F."},
		"func(dst []uint16, src []float32, s float32)", 2,
		func() {
			c = make([]reg.VecVirtual, len(bf16Consts))
			for i, v := range bf16Consts {
				g := GP32()
				MOVL(U32(v), g)
				c[i] = ZMM()
				VPBROADCASTD(g, c[i])
			}
		},
		func(x reg.VecVirtual, k reg.Register, dst Mem, masked bool) {
			lsb, r, a, nan := ZMM(), ZMM(), ZMM(), ZMM()
			VPSRLD(U8(16), x, lsb)
			VPANDD(c[1], lsb, lsb)
			VPADDD(c[0], x, r)
			VPADDD(lsb, r, r)
			VPSRLD(U8(16), r, r)
			VPANDD(c[2], x, a)
			kn := K()
			VPCMPGTD(c[3], a, kn) // |x| > +Inf: NaN
			VPSRLD(U8(16), x, nan)
			VPORD(c[4], nan, nan)
			VMOVDQA32(nan, kn, r)
			if masked {
				VPMOVDW(r, k, dst)
			} else {
				VPMOVDW(r, dst)
			}
		})
}

func dot512() {
	TEXT("dot512", NOSPLIT, "func(x, y []float32) float32")
	Doc("dot512 returns Σ x[i]·y[i] over i < len(x) (len(y) ≥ len(x)), with AVX-512F.",
		"Lane l of accumulator a sums the products 64q+16a+l with fused multiply-adds (the",
		"single and masked vectors after the blocks of four go to accumulator 0); the accumulators",
		"and then their lanes are added in a fixed order.")
	Pragma("noescape")
	px := Load(Param("x").Base(), GP64())
	py := Load(Param("y").Base(), GP64())
	n := Load(Param("x").Len(), GP64())
	acc := make([]reg.VecVirtual, 4)
	for i := range acc {
		acc[i] = ZMM()
		VPXORD(acc[i], acc[i], acc[i])
	}
	Label("blk")
	CMPQ(n, U8(64))
	JLT(LabelRef("one"))
	for i := range acc {
		t := ZMM()
		VMOVUPS(Mem{Base: px, Disp: 64 * i}, t)
		VFMADD231PS(Mem{Base: py, Disp: 64 * i}, t, acc[i])
	}
	ADDQ(U32(256), px)
	ADDQ(U32(256), py)
	SUBQ(U8(64), n)
	JMP(LabelRef("blk"))
	Label("one")
	TESTQ(n, n)
	JLE(LabelRef("done"))
	k := lanesMask512(n)
	a, b := ZMM(), ZMM()
	VMOVUPS_Z(Mem{Base: px}, k, a)
	VMOVUPS_Z(Mem{Base: py}, k, b)
	VFMADD231PS(b, a, acc[0])
	ADDQ(U8(64), px)
	ADDQ(U8(64), py)
	SUBQ(U8(16), n)
	JMP(LabelRef("one"))
	Label("done")
	VADDPS(acc[1], acc[0], acc[0])
	VADDPS(acc[3], acc[2], acc[2])
	VADDPS(acc[2], acc[0], acc[0])
	sum := hsum512(acc[0])
	VZEROUPPER()
	Store(sum, ReturnIndex(0))
	RET()
}

func interleave512() {
	TEXT("interleave512", NOSPLIT, "func(dst []uint16, a, b []uint16)")
	Doc("interleave512 sets dst[2i] = a[i] and dst[2i+1] = b[i] for i < len(a) (len(a) a multiple of 16,",
		"len(b) ≥ len(a), len(dst) ≥ 2·len(a)), with AVX-512F.")
	Pragma("noescape")
	d := Load(Param("dst").Base(), GP64())
	pa := Load(Param("a").Base(), GP64())
	pb := Load(Param("b").Base(), GP64())
	n := Load(Param("a").Len(), GP64())
	Label("loop")
	TESTQ(n, n)
	JZ(LabelRef("done"))
	x, y := ZMM(), ZMM()
	VPMOVZXWD(Mem{Base: pa}, x)
	VPMOVZXWD(Mem{Base: pb}, y)
	VPSLLD(U8(16), y, y)
	VPORD(y, x, x)
	VMOVDQU32(x, Mem{Base: d})
	ADDQ(U8(32), pa)
	ADDQ(U8(32), pb)
	ADDQ(U8(64), d)
	SUBQ(U8(16), n)
	JMP(LabelRef("loop"))
	Label("done")
	VZEROUPPER()
	RET()
}
