package main

import (
	"flag"
	"fmt"

	. "github.com/mmcloughlin/avo/build"
	. "github.com/mmcloughlin/avo/operand"
	"github.com/mmcloughlin/avo/reg"
)

// Register blocking of the matrix-product panels: a panel is mr rows of C
// by blocks of nv vectors of columns, each block held in mr·nv accumulators
// for the whole k loop. 6×(4 zmm) and 8×(2 zmm) ran at the same speed on
// 64×64×64 tiles; 4 zmm wide blocks cover a 64-column tile in one pass.
var (
	mr512  = 6 // rows per AVX-512 panel
	nv512  = 4 // widest AVX-512 column block, in zmm vectors (16 floats)
	mrAVX2 = 6 // rows per AVX2 panel
	nvAVX2 = 2 // ymm vectors (8 floats) per AVX2 column block
)

func init() {
	flag.IntVar(&mr512, "mr512", mr512, "rows per AVX-512 panel (at most 6 with -nv512 4, 14 with 2)")
	flag.IntVar(&nv512, "nv512", nv512, "widest AVX-512 column block in zmm vectors: 1, 2 or 4")
}

const gemmSig = "func(mr, k, n int, a *float32, lda int, b *float32, ldb int, c *float32, ldc int, acc bool)"

// rowAddr addresses row i of a matrix whose rows are ld4 bytes apart, given
// base pointers to rows 0, 4, 8, ... (bases[i/4]) and ld3 = 3·ld4.
func rowAddr(bases []reg.Register, ld4, ld3 reg.Register, i, disp int) Mem {
	m := Mem{Base: bases[i/4], Disp: disp}
	switch i % 4 {
	case 1:
		m.Index, m.Scale = ld4, 1
	case 2:
		m.Index, m.Scale = ld4, 2
	case 3:
		m.Index, m.Scale = ld3, 1
	}
	return m
}

// rowBases returns pointers to rows 0, 4, 8, ... below row mr of the matrix
// at p with rows ld4 bytes apart.
func rowBases(p, ld4 reg.Register, mr int) []reg.Register {
	bases := []reg.Register{p}
	for r := 4; r < mr; r += 4 {
		q := GP64()
		if r == 4 {
			LEAQ(Mem{Base: p, Index: ld4, Scale: 4}, q)
		} else {
			LEAQ(Mem{Base: bases[len(bases)-1], Index: ld4, Scale: 4}, q)
		}
		bases = append(bases, q)
	}
	return bases
}

// panelName is the label prefix of the code for an mr-row panel.
func panelName(mr int) string { return fmt.Sprintf("mr%d", mr) }

// dispatchRows emits the jump from the mr argument to the code of each panel
// height and returns after the last one.
func dispatchRows(maxMR int, panel func(mr int)) {
	mr := Load(Param("mr"), GP64())
	for r := maxMR; r >= 1; r-- {
		CMPQ(mr, U8(r))
		JEQ(LabelRef(panelName(r)))
	}
	RET()
	for r := maxMR; r >= 1; r-- {
		Label(panelName(r))
		panel(r)
		VZEROUPPER()
		RET()
	}
}

// gemmDoc documents a panel function.
func gemmDoc(name string, colA bool, isa string, maxMR int) {
	op := "A·B, A(i,p) = a[i*lda+p]"
	if colA {
		op = "Aᵀ·B, A(i,p) = a[p*lda+i]"
	}
	Doc(
		fmt.Sprintf("%s computes C (+)= %s, for mr ≤ %d rows of C", name, op, maxMR),
		fmt.Sprintf("and n > 0 columns, with %s; B(p,j) = b[p*ldb+j], C(i,j) = c[i*ldc+j], k > 0.", isa),
		"Each element is Σ_p in order of p with fused multiply-adds, then C is added when acc.",
	)
	Pragma("noescape")
}

// aWalker addresses A(i, p) for the current p of a panel (addr) and moves
// to the next p (next). With colA, A(i, p) = a[p*lda+i] and one pointer
// serves every row; otherwise A(i, p) = a[i*lda+p] and rows are addressed
// from pointers to every fourth row.
type aWalker struct {
	colA  bool
	bases []reg.Register
	lda4  reg.Register
	lda3  reg.Register
}

// newAWalker loads the A pointer and stride of an mr-row panel.
func newAWalker(colA bool, mr int) *aWalker {
	w := &aWalker{colA: colA}
	pa := Load(Param("a"), GP64())
	w.lda4 = Load(Param("lda"), GP64())
	SHLQ(U8(2), w.lda4)
	if colA {
		w.bases = []reg.Register{pa}
		return w
	}
	if mr > 1 {
		w.lda3 = GP64()
		LEAQ(Mem{Base: w.lda4, Index: w.lda4, Scale: 2}, w.lda3)
	}
	w.bases = rowBases(pa, w.lda4, mr)
	return w
}

func (w *aWalker) addr(i int) Mem {
	if w.colA {
		return Mem{Base: w.bases[0], Disp: 4 * i}
	}
	return rowAddr(w.bases, w.lda4, w.lda3, i, 0)
}

func (w *aWalker) next() {
	if w.colA {
		ADDQ(w.lda4, w.bases[0])
		return
	}
	for _, b := range w.bases {
		ADDQ(U8(4), b)
	}
}

// cRows returns the addressing of the rows of the current C block.
func cRows(ccol reg.Register, mr int) func(i, disp int) Mem {
	ldc4 := Load(Param("ldc"), GP64())
	SHLQ(U8(2), ldc4)
	var ldc3 reg.Register
	if mr > 1 {
		ldc3 = GP64()
		LEAQ(Mem{Base: ldc4, Index: ldc4, Scale: 2}, ldc3)
	}
	pc := GP64()
	MOVQ(ccol, pc)
	bases := rowBases(pc, ldc4, mr)
	return func(i, disp int) Mem { return rowAddr(bases, ldc4, ldc3, i, disp) }
}

// gemm512 emits gemmRowA512 or gemmColA512. Columns go in blocks of 64
// (4 zmm per row) while more than 48 remain, then blocks of 32 while more
// than 16 remain, then one block of 16; each block is held in mr·nv zmm
// accumulators over the whole k loop, and a block's last columns are masked.
func gemm512(colA bool) {
	name := "gemmRowA512"
	if colA {
		name = "gemmColA512"
	}
	TEXT(name, NOSPLIT, gemmSig)
	gemmDoc(name, colA, "AVX-512F", mr512)
	dispatchRows(mr512, func(mr int) {
		p := panelName(mr)
		nrem := Load(Param("n"), GP64())
		bcol := Load(Param("b"), GP64())
		ccol := Load(Param("c"), GP64())
		ldb4 := Load(Param("ldb"), GP64())
		SHLQ(U8(2), ldb4)
		// One set of registers serves the blocks of every width.
		regs := &blockRegs{ks: make([]reg.Register, nv512), bv: make([]reg.VecVirtual, nv512), t: ZMM()}
		for v := range regs.ks {
			regs.ks[v], regs.bv[v] = K(), ZMM()
		}
		regs.accs = make([][]reg.VecVirtual, mr)
		for i := range regs.accs {
			regs.accs[i] = make([]reg.VecVirtual, nv512)
			for v := range regs.accs[i] {
				regs.accs[i][v] = ZMM()
			}
		}
		for _, nv := range []int{4, 2, 1} {
			if nv > nv512 {
				continue
			}
			l := fmt.Sprintf("%sw%d", p, nv)
			Label(l)
			if nv > 1 {
				CMPQ(nrem, U8(16*nv-16))
				JLE(LabelRef(fmt.Sprintf("%sw%d", p, nv/2)))
			} else {
				TESTQ(nrem, nrem)
				JLE(LabelRef(p + "done"))
			}
			block512(l, colA, mr, nv, nrem, bcol, ccol, ldb4, regs)
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

// blockRegs are the masks, B vectors, broadcast A value and accumulators of
// a block.
type blockRegs struct {
	ks   []reg.Register
	bv   []reg.VecVirtual
	t    reg.VecVirtual
	accs [][]reg.VecVirtual
}

// block512 emits one AVX-512 block of mr rows by nv zmm vectors of columns
// at bcol/ccol, of which the first min(nrem, 16·nv) are computed.
func block512(label string, colA bool, mr, nv int, nrem, bcol, ccol, ldb4 reg.Register, regs *blockRegs) {
	Comment("Column masks: the first min(n, 16·nv) lanes.")
	w := GP64()
	MOVQ(U32(16*nv), w)
	CMPQ(nrem, w)
	CMOVQLT(nrem, w)
	msk := GP64()
	MOVQ(I32(-1), msk)
	BZHIQ(w, msk, msk)
	ks := regs.ks[:nv]
	for v := range ks {
		KMOVW(msk.As32(), ks[v])
		if v+1 < nv {
			SHRQ(U8(16), msk)
		}
	}

	accs := regs.accs
	for i := range accs {
		for v := 0; v < nv; v++ {
			VPXORD(accs[i][v], accs[i][v], accs[i][v])
		}
	}
	Comment("Fetch the block of C while the products run: it is read (acc) or written at the end.")
	pre := cRows(ccol, mr)
	for i := 0; i < mr; i++ {
		for v := 0; v < nv; v++ {
			PREFETCHT0(pre(i, 64*v))
		}
	}
	aw := newAWalker(colA, mr)
	pb := GP64()
	MOVQ(bcol, pb)
	cnt := Load(Param("k"), GP64())

	Label(label + "loop")
	bv := regs.bv[:nv]
	for v := range bv {
		VMOVUPS_Z(Mem{Base: pb, Disp: 64 * v}, ks[v], bv[v])
	}
	for i := 0; i < mr; i++ {
		t := regs.t
		VBROADCASTSS(aw.addr(i), t)
		for v := range bv {
			VFMADD231PS(bv[v], t, accs[i][v])
		}
	}
	aw.next()
	ADDQ(ldb4, pb)
	DECQ(cnt)
	JNZ(LabelRef(label + "loop"))

	Comment("Add C when accumulating, then store the block under its masks.")
	crow := cRows(ccol, mr)
	flag := Load(Param("acc"), GP8())
	TESTB(flag, flag)
	JZ(LabelRef(label + "store"))
	for i := 0; i < mr; i++ {
		for v := 0; v < nv; v++ {
			t := regs.t
			VMOVUPS_Z(crow(i, 64*v), ks[v], t)
			VADDPS(t, accs[i][v], accs[i][v])
		}
	}
	Label(label + "store")
	for i := 0; i < mr; i++ {
		for v := 0; v < nv; v++ {
			VMOVUPS(accs[i][v], ks[v], crow(i, 64*v))
		}
	}
}

// avx2Block emits one AVX2 column block of mr rows by nv ymm vectors starting
// at bcol/ccol. With a mask (nv = 1), B and C are accessed through it.
func avx2Block(label string, colA bool, mr, nv int, bcol, ccol, ldb4 reg.Register, mask reg.Register) {
	accs := make([][]reg.VecVirtual, mr)
	for i := range accs {
		accs[i] = make([]reg.VecVirtual, nv)
		for v := range accs[i] {
			accs[i][v] = YMM()
			VXORPS(accs[i][v], accs[i][v], accs[i][v])
		}
	}
	aw := newAWalker(colA, mr)
	pb := GP64()
	MOVQ(bcol, pb)
	cnt := Load(Param("k"), GP64())

	Label(label + "loop")
	bv := make([]reg.VecVirtual, nv)
	for v := range bv {
		bv[v] = YMM()
		if mask != nil {
			VMASKMOVPS(Mem{Base: pb}, mask, bv[v])
		} else {
			VMOVUPS(Mem{Base: pb, Disp: 32 * v}, bv[v])
		}
	}
	for i := 0; i < mr; i++ {
		t := YMM()
		VBROADCASTSS(aw.addr(i), t)
		for v := range bv {
			VFMADD231PS(bv[v], t, accs[i][v])
		}
	}
	aw.next()
	ADDQ(ldb4, pb)
	DECQ(cnt)
	JNZ(LabelRef(label + "loop"))

	crow := cRows(ccol, mr)
	flag := Load(Param("acc"), GP8())
	TESTB(flag, flag)
	JZ(LabelRef(label + "store"))
	for i := 0; i < mr; i++ {
		for v := 0; v < nv; v++ {
			if mask != nil {
				t := YMM()
				VMASKMOVPS(crow(i, 0), mask, t)
				VADDPS(t, accs[i][v], accs[i][v])
			} else {
				VADDPS(crow(i, 32*v), accs[i][v], accs[i][v])
			}
		}
	}
	Label(label + "store")
	for i := 0; i < mr; i++ {
		for v := 0; v < nv; v++ {
			if mask != nil {
				VMASKMOVPS(accs[i][v], mask, crow(i, 0))
			} else {
				VMOVUPS(accs[i][v], crow(i, 32*v))
			}
		}
	}
}

// maskTable holds eight all-ones lanes followed by eight zero lanes: the
// eight lanes at index 8-r form the mask of the first r lanes.
var maskTable Mem

func maskTab() Mem {
	if maskTable.Symbol.Name == "" {
		maskTable = GLOBL("maskTable", RODATA|NOPTR)
		for i := 0; i < 16; i++ {
			v := uint32(0)
			if i < 8 {
				v = 0xffffffff
			}
			DATA(4*i, U32(v))
		}
	}
	return maskTable
}

// loadMask loads into a new ymm register the mask of the first r lanes,
// 0 < r < 8.
func loadMask(r reg.Register) reg.VecVirtual {
	tab := GP64()
	LEAQ(maskTab(), tab)
	neg := GP64()
	MOVQ(r, neg)
	NEGQ(neg)
	m := YMM()
	VMOVDQU(Mem{Base: tab, Index: neg, Scale: 4, Disp: 32}, m)
	return m
}

// gemmAVX2 emits gemmRowAAVX2 or gemmColAAVX2: C blocks of mr×16, then one
// of mr×8, then a masked block for the last n mod 8 columns.
func gemmAVX2(colA bool) {
	name := "gemmRowAAVX2"
	if colA {
		name = "gemmColAAVX2"
	}
	TEXT(name, NOSPLIT, gemmSig)
	gemmDoc(name, colA, "AVX2 and FMA", mrAVX2)
	dispatchRows(mrAVX2, func(mr int) {
		p := panelName(mr)
		nrem := Load(Param("n"), GP64())
		bcol := Load(Param("b"), GP64())
		ccol := Load(Param("c"), GP64())
		ldb4 := Load(Param("ldb"), GP64())
		SHLQ(U8(2), ldb4)

		Label(p + "b16")
		CMPQ(nrem, U8(16))
		JLT(LabelRef(p + "b8"))
		avx2Block(p+"w16", colA, mr, nvAVX2, bcol, ccol, ldb4, nil)
		ADDQ(U8(64), bcol)
		ADDQ(U8(64), ccol)
		SUBQ(U8(16), nrem)
		JMP(LabelRef(p + "b16"))

		Label(p + "b8")
		CMPQ(nrem, U8(8))
		JLT(LabelRef(p + "tail"))
		avx2Block(p+"w8", colA, mr, 1, bcol, ccol, ldb4, nil)
		ADDQ(U8(32), bcol)
		ADDQ(U8(32), ccol)
		SUBQ(U8(8), nrem)

		Label(p + "tail")
		TESTQ(nrem, nrem)
		JZ(LabelRef(p + "done"))
		mask := loadMask(nrem)
		avx2Block(p+"wm", colA, mr, 1, bcol, ccol, ldb4, mask)
		Label(p + "done")
	})
}
