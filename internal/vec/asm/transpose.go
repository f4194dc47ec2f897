package main

import (
	"fmt"

	. "github.com/mmcloughlin/avo/build"
	. "github.com/mmcloughlin/avo/operand"
	"github.com/mmcloughlin/avo/reg"
)

const transposeSig = "func(rows, cols int, src *float32, lds int, dst *float32, ldd int)"

// transposeISA describes the vector registers of one transpose kernel.
type transposeISA struct {
	name  string
	lanes int
	vec   func() reg.VecVirtual
	zero  func(r reg.VecVirtual)
	// mask returns the mask of the first w lanes; load loads one row under it.
	mask func(w reg.Register) reg.Register
	load func(m Mem, mask reg.Register, dst reg.VecVirtual)
	// transpose transposes r in registers and returns the transposed rows.
	transpose func(r []reg.VecVirtual) []reg.VecVirtual
}

// transposeKernel emits a kernel that writes dst[p*ldd+j] = src[j*lds+p] for
// j < rows and p < cols, and zeros dst[p*ldd+j] for rows ≤ j < the next
// multiple of the vector width.
func transposeKernel(t transposeISA) {
	L := t.lanes
	TEXT(t.name, NOSPLIT, transposeSig)
	Doc(
		fmt.Sprintf("%s sets dst[p*ldd+j] = src[j*lds+p] for j < rows and p < cols (both > 0),", t.name),
		fmt.Sprintf("in %d×%d blocks, and zeros dst[p*ldd+j] for rows ≤ j < rows rounded up to %d.", L, L, L),
	)
	Pragma("noescape")
	jrem := Load(Param("rows"), GP64())
	srcJ := Load(Param("src"), GP64())
	dstJ := Load(Param("dst"), GP64())
	lds4 := Load(Param("lds"), GP64())
	SHLQ(U8(2), lds4)
	ldd4 := Load(Param("ldd"), GP64())
	SHLQ(U8(2), ldd4)

	Label("jblock")
	rc := GP64()
	MOVQ(U32(L), rc)
	CMPQ(jrem, rc)
	CMOVQLT(jrem, rc)
	prem := Load(Param("cols"), GP64())
	ps := GP64()
	MOVQ(srcJ, ps)
	pd := GP64()
	MOVQ(dstJ, pd)

	Label("pblock")
	w := GP64()
	MOVQ(U32(L), w)
	CMPQ(prem, w)
	CMOVQLT(prem, w)
	mask := t.mask(w)
	r := make([]reg.VecVirtual, L)
	for i := range r {
		r[i] = t.vec()
	}
	q := GP64()
	MOVQ(ps, q)
	CMPQ(rc, U32(L))
	JLT(LabelRef("partialrows"))
	for i := 0; i < L; i++ {
		t.load(Mem{Base: q}, mask, r[i])
		if i+1 < L {
			ADDQ(lds4, q)
		}
	}
	JMP(LabelRef("loaded"))
	Label("partialrows")
	Comment("Rows past the end read as zero.")
	for i := 0; i < L; i++ {
		t.zero(r[i])
	}
	for i := 0; i < L-1; i++ {
		t.load(Mem{Base: q}, mask, r[i])
		ADDQ(lds4, q)
		CMPQ(rc, U32(i+1))
		JEQ(LabelRef("loaded"))
	}
	Label("loaded")
	out := t.transpose(r)

	MOVQ(pd, q)
	CMPQ(w, U32(L))
	JLT(LabelRef("partialcols"))
	for i := 0; i < L; i++ {
		VMOVUPS(out[i], Mem{Base: q})
		if i+1 < L {
			ADDQ(ldd4, q)
		}
	}
	JMP(LabelRef("stored"))
	Label("partialcols")
	for i := 0; i < L-1; i++ {
		VMOVUPS(out[i], Mem{Base: q})
		ADDQ(ldd4, q)
		CMPQ(w, U32(i+1))
		JEQ(LabelRef("stored"))
	}
	Label("stored")
	ADDQ(U32(4*L), ps)
	for i := 0; i < L; i++ {
		ADDQ(ldd4, pd)
	}
	SUBQ(U32(L), prem)
	JGT(LabelRef("pblock"))

	for i := 0; i < L; i++ {
		ADDQ(lds4, srcJ)
	}
	ADDQ(U32(4*L), dstJ)
	SUBQ(U32(L), jrem)
	JGT(LabelRef("jblock"))
	VZEROUPPER()
	RET()
}

func transpose512() {
	transposeKernel(transposeISA{
		name:  "transpose512",
		lanes: 16,
		vec:   ZMM,
		zero:  func(r reg.VecVirtual) { VPXORD(r, r, r) },
		mask: func(w reg.Register) reg.Register {
			m := GP64()
			MOVQ(I32(-1), m)
			BZHIQ(w, m, m)
			k := K()
			KMOVW(m.As32(), k)
			return k
		},
		load: func(m Mem, k reg.Register, dst reg.VecVirtual) { VMOVUPS_Z(m, k, dst) },
		transpose: func(r []reg.VecVirtual) []reg.VecVirtual {
			t := make([]reg.VecVirtual, 16)
			for i := range t {
				t[i] = ZMM()
			}
			// Pairs of rows interleaved: 2×2 blocks.
			for i := 0; i < 8; i++ {
				VUNPCKLPS(r[2*i+1], r[2*i], t[2*i])
				VUNPCKHPS(r[2*i+1], r[2*i], t[2*i+1])
			}
			// 4×4 blocks within each 128-bit lane.
			for g := 0; g < 4; g++ {
				VUNPCKLPD(t[4*g+2], t[4*g], r[4*g])
				VUNPCKHPD(t[4*g+2], t[4*g], r[4*g+1])
				VUNPCKLPD(t[4*g+3], t[4*g+1], r[4*g+2])
				VUNPCKHPD(t[4*g+3], t[4*g+1], r[4*g+3])
			}
			// 128-bit lanes across registers.
			for h := 0; h < 2; h++ {
				for q := 0; q < 4; q++ {
					VSHUFF32X4(U8(0x88), r[8*h+4+q], r[8*h+q], t[8*h+q])
					VSHUFF32X4(U8(0xdd), r[8*h+4+q], r[8*h+q], t[8*h+4+q])
				}
			}
			for q := 0; q < 8; q++ {
				VSHUFF32X4(U8(0x88), t[8+q], t[q], r[q])
				VSHUFF32X4(U8(0xdd), t[8+q], t[q], r[8+q])
			}
			return r
		},
	})
}

func transposeAVX2() {
	transposeKernel(transposeISA{
		name:  "transposeAVX2",
		lanes: 8,
		vec:   YMM,
		zero:  func(r reg.VecVirtual) { VXORPS(r, r, r) },
		mask:  func(w reg.Register) reg.Register { return loadMask(w) },
		load:  func(m Mem, k reg.Register, dst reg.VecVirtual) { VMASKMOVPS(m, k, dst) },
		transpose: func(r []reg.VecVirtual) []reg.VecVirtual {
			t := make([]reg.VecVirtual, 8)
			for i := range t {
				t[i] = YMM()
			}
			for i := 0; i < 4; i++ {
				VUNPCKLPS(r[2*i+1], r[2*i], t[2*i])
				VUNPCKHPS(r[2*i+1], r[2*i], t[2*i+1])
			}
			for g := 0; g < 2; g++ {
				VSHUFPS(U8(0x44), t[4*g+2], t[4*g], r[4*g])
				VSHUFPS(U8(0xee), t[4*g+2], t[4*g], r[4*g+1])
				VSHUFPS(U8(0x44), t[4*g+3], t[4*g+1], r[4*g+2])
				VSHUFPS(U8(0xee), t[4*g+3], t[4*g+1], r[4*g+3])
			}
			for q := 0; q < 4; q++ {
				VPERM2F128(U8(0x20), r[4+q], r[q], t[q])
				VPERM2F128(U8(0x31), r[4+q], r[q], t[4+q])
			}
			return t
		},
	})
}
