package main

import (
	"fmt"

	. "github.com/mmcloughlin/avo/build"
	"github.com/mmcloughlin/avo/ir"
	. "github.com/mmcloughlin/avo/operand"
	"github.com/mmcloughlin/avo/reg"
)

// vdpbf16ps emits VDPBF16PS src2, src1, dst on zmm registers:
//
//	dst.fp32[l] += src1.bf16[2l+1]·src2.bf16[2l+1]; dst.fp32[l] += src1.bf16[2l]·src2.bf16[2l]
//
// (AVX512_BF16; inputs and outputs below the normal range are flushed to 0,
// rounding to nearest even). The Go assembler does not know the
// instruction, so it is written as its bytes, EVEX.512.F3.0F38.W0 52 /r,
// and the registers must be physical.
func vdpbf16ps(src2, src1, dst reg.VecPhysical) {
	d, s1, s2 := int(dst.PhysicalIndex()), int(src1.PhysicalIndex()), int(src2.PhysicalIndex())
	bit := func(x, b int) int { return (x >> b) & 1 }
	p0 := (1-bit(d, 3))<<7 | (1-bit(s2, 4))<<6 | (1-bit(s2, 3))<<5 | (1-bit(d, 4))<<4 | 0b10 // R X B R' 00 mm=0F38
	p1 := 0<<7 | (^s1&0xf)<<3 | 1<<2 | 0b10                                                  // W=0 vvvv 1 pp=F3
	p2 := 0<<7 | 0b10<<5 | 0<<4 | (1-bit(s1, 4))<<3 | 0                                      // z L'L=512 b V' aaa
	modrm := 0b11<<6 | (d&7)<<3 | s2&7
	Comment(fmt.Sprintf("VDPBF16PS %s, %s, %s", src2.Asm(), src1.Asm(), dst.Asm()))
	bytes := []int{0x62, p0, p1, p2, 0x52, modrm}
	for i, b := range bytes {
		in := &ir.Instruction{Opcode: "BYTE", Operands: []Op{U8(b)}}
		if i == len(bytes)-1 {
			// The registers are read and written by the instruction as a whole.
			in.Inputs, in.Outputs = []Op{src2, src1, dst}, []Op{dst}
		}
		Instruction(in)
	}
}

// zmms are the physical zmm registers, by number.
var zmms = []reg.VecPhysical{
	reg.Z0, reg.Z1, reg.Z2, reg.Z3, reg.Z4, reg.Z5, reg.Z6, reg.Z7,
	reg.Z8, reg.Z9, reg.Z10, reg.Z11, reg.Z12, reg.Z13, reg.Z14, reg.Z15,
	reg.Z16, reg.Z17, reg.Z18, reg.Z19, reg.Z20, reg.Z21, reg.Z22, reg.Z23,
	reg.Z24, reg.Z25, reg.Z26, reg.Z27, reg.Z28, reg.Z29, reg.Z30, reg.Z31,
}

// zmm returns physical zmm register i.
func zmm(i int) reg.VecPhysical { return zmms[i] }

const gemmBF16Sig = "func(mr, kp, n int, a *uint16, lda int, b *uint16, ldb int, c *float32, ldc int, acc bool)"

// gemmBF16512 emits gemmBF16512: C (+)= A·B for bfloat16 operands with
// VDPBF16PS. A(i, p) = a[i*lda+p]; B is stored in pairs of rows, B(p, j) =
// b[(p/2)*ldb + 2j + p%2], so that one 32-bit lane holds the two values of
// a column that one lane of VDPBF16PS multiplies with a pair of A. The
// panel is the one of gemm512: mr ≤ 6 rows by blocks of 64, 32 or 16
// columns in 24 accumulators (Z0–Z23), B in Z24–Z27, A pairs broadcast in
// Z28/Z29 — all physical, as vdpbf16ps needs.
func gemmBF16512() {
	TEXT("gemmBF16512", NOSPLIT, gemmBF16Sig)
	Doc(fmt.Sprintf("gemmBF16512 computes C (+)= A·B for mr ≤ %d rows of C and n > 0 columns from kp > 0 pairs of", mr512),
		"bfloat16 products, with AVX512_BF16: A(i,p) = a[i*lda+p], B(p,j) = b[(p/2)*ldb+2j+p%2],",
		"C(i,j) = c[i*ldc+j]. Each element adds, for p = 0, 2, 4, …, the products of p+1 and then p",
		"(each rounded to float32, subnormals flushed to 0), then C when acc.")
	Pragma("noescape")
	dispatchRows(mr512, func(mr int) {
		p := panelName(mr)
		nrem := Load(Param("n"), GP64())
		bcol := Load(Param("b"), GP64())
		ccol := Load(Param("c"), GP64())
		ldb2 := Load(Param("ldb"), GP64())
		SHLQ(U8(1), ldb2)
		ks := make([]reg.Register, 4)
		for v := range ks {
			ks[v] = K()
		}
		for _, nv := range []int{4, 2, 1} {
			l := fmt.Sprintf("%sw%d", p, nv)
			Label(l)
			if nv > 1 {
				CMPQ(nrem, U8(16*nv-16))
				JLE(LabelRef(fmt.Sprintf("%sw%d", p, nv/2)))
			} else {
				TESTQ(nrem, nrem)
				JLE(LabelRef(p + "done"))
			}
			blockBF16(l, mr, nv, nrem, bcol, ccol, ldb2, ks)
			ADDQ(U32(64*nv), bcol)
			ADDQ(U32(64*nv), ccol)
			SUBQ(U32(16*nv), nrem)
			if nv > 1 {
				JMP(LabelRef(l))
			}
		}
		Label(p + "done")
	})
}

// blockBF16 emits one block of mr rows by nv zmm vectors (16 columns each)
// of gemmBF16512.
func blockBF16(label string, mr, nv int, nrem, bcol, ccol, ldb2 reg.Register, ks []reg.Register) {
	Comment("Column masks: the first min(n, 16·nv) columns.")
	w := GP64()
	MOVQ(U32(16*nv), w)
	CMPQ(nrem, w)
	CMOVQLT(nrem, w)
	msk := GP64()
	MOVQ(I32(-1), msk)
	BZHIQ(w, msk, msk)
	for v := 0; v < nv; v++ {
		KMOVW(msk.As32(), ks[v])
		if v+1 < nv {
			SHRQ(U8(16), msk)
		}
	}
	acc := func(i, v int) reg.VecPhysical { return zmm(4*i + v) }
	bv := func(v int) reg.VecPhysical { return zmm(24 + v) }
	av := func(i int) reg.VecPhysical { return zmm(28 + i%2) }
	for i := 0; i < mr; i++ {
		for v := 0; v < nv; v++ {
			VPXORD(acc(i, v), acc(i, v), acc(i, v))
		}
	}
	// Rows of A: lda·2 bytes apart, 4 bytes (one pair) per step.
	pa := Load(Param("a"), GP64())
	lda4 := Load(Param("lda"), GP64())
	SHLQ(U8(1), lda4)
	var lda3 reg.Register
	if mr > 1 {
		lda3 = GP64()
		LEAQ(Mem{Base: lda4, Index: lda4, Scale: 2}, lda3)
	}
	bases := rowBases(pa, lda4, mr)
	pb := GP64()
	MOVQ(bcol, pb)
	cnt := Load(Param("kp"), GP64())

	Label(label + "loop")
	for v := 0; v < nv; v++ {
		VMOVUPS_Z(Mem{Base: pb, Disp: 64 * v}, ks[v], bv(v))
	}
	for i := 0; i < mr; i++ {
		VPBROADCASTD(rowAddr(bases, lda4, lda3, i, 0), av(i))
		for v := 0; v < nv; v++ {
			vdpbf16ps(av(i), bv(v), acc(i, v))
		}
	}
	for _, b := range bases {
		ADDQ(U8(4), b)
	}
	ADDQ(ldb2, pb)
	DECQ(cnt)
	JNZ(LabelRef(label + "loop"))

	Comment("Add C when accumulating, then store the block under its masks.")
	crow := cRows(ccol, mr)
	flag := Load(Param("acc"), GP8())
	TESTB(flag, flag)
	JZ(LabelRef(label + "store"))
	for i := 0; i < mr; i++ {
		for v := 0; v < nv; v++ {
			t := zmm(30)
			VMOVUPS_Z(crow(i, 64*v), ks[v], t)
			VADDPS(t, acc(i, v), acc(i, v))
		}
	}
	Label(label + "store")
	for i := 0; i < mr; i++ {
		for v := 0; v < nv; v++ {
			VMOVUPS(acc(i, v), ks[v], crow(i, 64*v))
		}
	}
}
