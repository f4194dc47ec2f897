package kernels

import (
	"encoding/binary"
	"fmt"
	"math"
	"strings"
)

// BwdStrides are the element strides of a [batch, row, head, dim] tensor
// whose last dimension is contiguous. For a packed variable-length tensor
// Batch is 0 and Row indexes the packed token.
type BwdStrides struct {
	Batch, Row, Head int64
}

// BwdParams is the single argument of every backward kernel. Pointers are
// device addresses (0 where unused); strides are in elements. Its byte form
// (Bytes) matches the C struct the generator emits.
type BwdParams struct {
	Q, K, V, O, DO           uint64 // inputs: q, k, v, o, dO in the variant's dtype
	LSE                      uint64 // float32 natural-log LSE
	DQ, DK, DV               uint64 // outputs in the variant's dtype
	DQAcc                    uint64 // float32 [rows, H, DK] accumulator (AtomicDQ)
	Delta, LSE2              uint64 // float32 scratch in the LSE's layout: rowsum(dO∘O) and LSE·log2(e) (+inf for a row with no key)
	Bias                     uint64 // bias in BiasDType
	DBiasScratch             uint64 // float32 [B, H, N, M] per-head dS (BiasGrad)
	DBias                    uint64 // dBias in BiasDType, contiguous in the bias's own shape
	CuSeqlensQ, CuSeqlensK   uint64 // int32 [B+1] (Varlen)
	PQ, PK, PV, PDO          uint64 // Staged: the padded copies of q, k, v and dO the main kernels read
	NFFlag                   uint64 // uint32 [2] in the workspace: the non-finite flag and the fix-up's done counter
	QS, KS, VS, OS, DOS      BwdStrides
	PQS, PKS, PVS, PDOS      BwdStrides // strides of the padded copies
	DQS, DKS, DVS, DQAccS    BwdStrides
	LSEBatch, LSEHead        int64 // strides of the LSE input (row stride 1)
	StatBatch, StatHead      int64 // strides of the Delta and LSE2 scratch (row stride 1)
	BiasB, BiasH, BiasI      int64 // bias strides (0 on a broadcast dimension); BiasJ is the key stride
	BiasJ                    int64
	DBiasElems               int64 // number of dBias elements: BiasBatches·BiasHeads·N·M
	B, N, M, H, Hkv          int32 // N, M: the longest segment when Varlen
	Left, Right              int32 // window (negative: unbounded)
	BottomRight              int32 // 1: diagonal aligned bottom-right
	BiasBatches, BiasHeads   int32 // dBias shape [BiasBatches, BiasHeads, N, M]
	Scale, ScaleLog2         float32
	Softcap, InvSoftcap      float32
	DropScale                float32 // 1/(1-p)
	DropThreshold            uint32  // keep when the Philox word is below it
	SeedLo, SeedHi, DropOffs uint32
}

// bwdField is one member of the params struct: its C type and name, and
// how its value is written.
type bwdField struct {
	ctype, name string
	size        int
	put         func(b []byte)
}

// fields lists the members in declaration order (8-byte members first, so
// the C struct has no padding before its 4-byte tail).
func (p *BwdParams) fields() []bwdField {
	var fs []bwdField
	ptr := func(ctype, name string, x uint64) {
		fs = append(fs, bwdField{ctype, name, 8, func(b []byte) { binary.LittleEndian.PutUint64(b, x) }})
	}
	i64 := func(name string, x int64) {
		fs = append(fs, bwdField{"long long", name, 8, func(b []byte) { binary.LittleEndian.PutUint64(b, uint64(x)) }})
	}
	i32 := func(name string, x int32) {
		fs = append(fs, bwdField{"int", name, 4, func(b []byte) { binary.LittleEndian.PutUint32(b, uint32(x)) }})
	}
	u32 := func(name string, x uint32) {
		fs = append(fs, bwdField{"unsigned", name, 4, func(b []byte) { binary.LittleEndian.PutUint32(b, x) }})
	}
	f32 := func(name string, x float32) {
		fs = append(fs, bwdField{"float", name, 4, func(b []byte) { binary.LittleEndian.PutUint32(b, math.Float32bits(x)) }})
	}
	ptr("const T*", "q", p.Q)
	ptr("const T*", "k", p.K)
	ptr("const T*", "v", p.V)
	ptr("const T*", "o", p.O)
	ptr("const T*", "dout", p.DO)
	ptr("const float*", "lse", p.LSE)
	ptr("T*", "dq", p.DQ)
	ptr("T*", "dk", p.DK)
	ptr("T*", "dv", p.DV)
	ptr("float*", "dqacc", p.DQAcc)
	ptr("float*", "delta", p.Delta)
	ptr("float*", "lse2", p.LSE2)
	ptr("const BT*", "bias", p.Bias)
	ptr("float*", "dbias_scratch", p.DBiasScratch)
	ptr("BT*", "dbias", p.DBias)
	ptr("const int*", "cuq", p.CuSeqlensQ)
	ptr("const int*", "cuk", p.CuSeqlensK)
	ptr("T*", "pq", p.PQ)
	ptr("T*", "pk", p.PK)
	ptr("T*", "pv", p.PV)
	ptr("T*", "pdo", p.PDO)
	ptr("unsigned*", "nf_flag", p.NFFlag)
	for _, s := range []struct {
		n string
		s BwdStrides
	}{{"q", p.QS}, {"k", p.KS}, {"v", p.VS}, {"o", p.OS}, {"do", p.DOS}, {"dq", p.DQS}, {"dk", p.DKS}, {"dv", p.DVS}, {"dqa", p.DQAccS},
		{"pq", p.PQS}, {"pk", p.PKS}, {"pv", p.PVS}, {"pdo", p.PDOS}} {
		i64(s.n+"_sb", s.s.Batch)
		i64(s.n+"_sr", s.s.Row)
		i64(s.n+"_sh", s.s.Head)
	}
	i64("lse_sb", p.LSEBatch)
	i64("lse_sh", p.LSEHead)
	i64("stat_sb", p.StatBatch)
	i64("stat_sh", p.StatHead)
	i64("bias_sb", p.BiasB)
	i64("bias_sh", p.BiasH)
	i64("bias_si", p.BiasI)
	i64("bias_sj", p.BiasJ)
	i64("dbias_elems", p.DBiasElems)
	i32("B", p.B)
	i32("N", p.N)
	i32("M", p.M)
	i32("H", p.H)
	i32("Hkv", p.Hkv)
	i32("left", p.Left)
	i32("right", p.Right)
	i32("bottom_right", p.BottomRight)
	i32("bias_nb", p.BiasBatches)
	i32("bias_nh", p.BiasHeads)
	f32("scale", p.Scale)
	f32("scale_log2", p.ScaleLog2)
	f32("softcap", p.Softcap)
	f32("inv_softcap", p.InvSoftcap)
	f32("drop_scale", p.DropScale)
	u32("drop_threshold", p.DropThreshold)
	u32("seed_lo", p.SeedLo)
	u32("seed_hi", p.SeedHi)
	u32("drop_offset", p.DropOffs)
	return fs
}

// Bytes returns the params in the layout of the generated C struct.
func (p *BwdParams) Bytes() []byte {
	fs := p.fields()
	n := 0
	for _, f := range fs {
		n += f.size
	}
	n = (n + 7) / 8 * 8
	b := make([]byte, n)
	o := 0
	for _, f := range fs {
		f.put(b[o : o+f.size])
		o += f.size
	}
	return b
}

// bwdParamsStruct returns the C declaration of the params struct.
func bwdParamsStruct() string {
	var p BwdParams
	var b strings.Builder
	b.WriteString("struct __align__(8) BwdParams {\n")
	for _, f := range p.fields() {
		fmt.Fprintf(&b, "  %s %s;\n", f.ctype, f.name)
	}
	b.WriteString("};\n")
	return b.String()
}
