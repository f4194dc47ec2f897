package kernels

// BwdStrides are the element strides of a [batch, row, head, dim] tensor
// whose last dimension is contiguous. For a packed variable-length tensor
// Batch is 0 and Row indexes the packed token.
type BwdStrides struct {
	Batch, Row, Head int64
}

// BwdParams is the single argument of every backward kernel. Pointers are
// device addresses (0 where unused); strides are in elements. Its byte form
// (Pack) matches the C struct the generator emits (bwdParamsStruct).
type BwdParams struct {
	Q, K, V, O, DO           uint64 // inputs: q, k, v, o, dO in the variant's dtype
	LSE                      uint64 // float32 natural-log LSE
	DQ, DK, DV               uint64 // outputs in the variant's dtype
	DQAcc                    uint64 // float32 [rows, H, DK] accumulator (AtomicDQ)
	Delta, LSE2              uint64 // float32 scratch in the LSE's layout: rowsum(dO∘O) and LSE·log2(e) (+inf for a row with no key)
	Bias                     uint64 // bias in the variant's Bias element type
	DBiasScratch             uint64 // float32 [B, H, N, M] per-head dS (BiasGrad)
	DBias                    uint64 // dBias in the bias's element type, contiguous in the bias's own shape
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
	Softcap                  float32
	SoftcapIn                float32 // scale/softcap, as the forward's Params.SoftcapIn
	DropScale                float32 // dropout: 256/T (package philox)
	DropThreshold            uint32  // dropout: T = round(256·(1 − p)); keep when the element's 8-bit number is below it
	SeedLo, SeedHi, DropOffs uint32
	// DropoutAt's origin, as Params.DropQ0 … DropHeads of the forward.
	DropQ0, DropK0, DropH0, DropHeads uint32
}

// bwdStrides lists the stride triples of BwdParams in declaration order,
// with the prefix of their C names.
var bwdStrides = []struct {
	name string
	get  func(*BwdParams) *BwdStrides
}{
	{"q", func(p *BwdParams) *BwdStrides { return &p.QS }}, {"k", func(p *BwdParams) *BwdStrides { return &p.KS }},
	{"v", func(p *BwdParams) *BwdStrides { return &p.VS }}, {"o", func(p *BwdParams) *BwdStrides { return &p.OS }},
	{"do", func(p *BwdParams) *BwdStrides { return &p.DOS }}, {"dq", func(p *BwdParams) *BwdStrides { return &p.DQS }},
	{"dk", func(p *BwdParams) *BwdStrides { return &p.DKS }}, {"dv", func(p *BwdParams) *BwdStrides { return &p.DVS }},
	{"dqa", func(p *BwdParams) *BwdStrides { return &p.DQAccS }}, {"pq", func(p *BwdParams) *BwdStrides { return &p.PQS }},
	{"pk", func(p *BwdParams) *BwdStrides { return &p.PKS }}, {"pv", func(p *BwdParams) *BwdStrides { return &p.PVS }},
	{"pdo", func(p *BwdParams) *BwdStrides { return &p.PDOS }},
}

// bwdParamsStruct is the layout of BwdParams: 8-byte members first, so the
// C struct has no padding before its 4-byte tail.
var bwdParamsStruct = func() *CStruct[BwdParams] {
	type P = BwdParams
	ptr := func(ctype, name string, get func(*P) uint64) CField[P] { return CPtr(ctype, name, "", get) }
	i64 := func(name string, get func(*P) int64) CField[P] { return CI64("long long", name, "", get) }
	i32 := func(name string, get func(*P) int32) CField[P] { return CI32("int", name, "", get) }
	u32 := func(name string, get func(*P) uint32) CField[P] { return CU32("unsigned", name, "", get) }
	f32 := func(name string, get func(*P) float32) CField[P] { return CF32(name, "", get) }
	fs := []CField[P]{
		ptr("const T*", "q", func(p *P) uint64 { return p.Q }),
		ptr("const T*", "k", func(p *P) uint64 { return p.K }),
		ptr("const T*", "v", func(p *P) uint64 { return p.V }),
		ptr("const T*", "o", func(p *P) uint64 { return p.O }),
		ptr("const T*", "dout", func(p *P) uint64 { return p.DO }),
		ptr("const float*", "lse", func(p *P) uint64 { return p.LSE }),
		ptr("T*", "dq", func(p *P) uint64 { return p.DQ }),
		ptr("T*", "dk", func(p *P) uint64 { return p.DK }),
		ptr("T*", "dv", func(p *P) uint64 { return p.DV }),
		ptr("float*", "dqacc", func(p *P) uint64 { return p.DQAcc }),
		ptr("float*", "delta", func(p *P) uint64 { return p.Delta }),
		ptr("float*", "lse2", func(p *P) uint64 { return p.LSE2 }),
		ptr("const BT*", "bias", func(p *P) uint64 { return p.Bias }),
		ptr("float*", "dbias_scratch", func(p *P) uint64 { return p.DBiasScratch }),
		ptr("BT*", "dbias", func(p *P) uint64 { return p.DBias }),
		ptr("const int*", "cuq", func(p *P) uint64 { return p.CuSeqlensQ }),
		ptr("const int*", "cuk", func(p *P) uint64 { return p.CuSeqlensK }),
		ptr("T*", "pq", func(p *P) uint64 { return p.PQ }),
		ptr("T*", "pk", func(p *P) uint64 { return p.PK }),
		ptr("T*", "pv", func(p *P) uint64 { return p.PV }),
		ptr("T*", "pdo", func(p *P) uint64 { return p.PDO }),
		ptr("unsigned*", "nf_flag", func(p *P) uint64 { return p.NFFlag }),
	}
	for _, st := range bwdStrides {
		get := st.get
		fs = append(fs,
			i64(st.name+"_sb", func(p *P) int64 { return get(p).Batch }),
			i64(st.name+"_sr", func(p *P) int64 { return get(p).Row }),
			i64(st.name+"_sh", func(p *P) int64 { return get(p).Head }))
	}
	fs = append(fs,
		i64("lse_sb", func(p *P) int64 { return p.LSEBatch }),
		i64("lse_sh", func(p *P) int64 { return p.LSEHead }),
		i64("stat_sb", func(p *P) int64 { return p.StatBatch }),
		i64("stat_sh", func(p *P) int64 { return p.StatHead }),
		i64("bias_sb", func(p *P) int64 { return p.BiasB }),
		i64("bias_sh", func(p *P) int64 { return p.BiasH }),
		i64("bias_si", func(p *P) int64 { return p.BiasI }),
		i64("bias_sj", func(p *P) int64 { return p.BiasJ }),
		i64("dbias_elems", func(p *P) int64 { return p.DBiasElems }),
		i32("B", func(p *P) int32 { return p.B }),
		i32("N", func(p *P) int32 { return p.N }),
		i32("M", func(p *P) int32 { return p.M }),
		i32("H", func(p *P) int32 { return p.H }),
		i32("Hkv", func(p *P) int32 { return p.Hkv }),
		i32("left", func(p *P) int32 { return p.Left }),
		i32("right", func(p *P) int32 { return p.Right }),
		i32("bottom_right", func(p *P) int32 { return p.BottomRight }),
		i32("bias_nb", func(p *P) int32 { return p.BiasBatches }),
		i32("bias_nh", func(p *P) int32 { return p.BiasHeads }),
		f32("scale", func(p *P) float32 { return p.Scale }),
		f32("scale_log2", func(p *P) float32 { return p.ScaleLog2 }),
		f32("softcap", func(p *P) float32 { return p.Softcap }),
		f32("softcap_in", func(p *P) float32 { return p.SoftcapIn }),
		f32("drop_scale", func(p *P) float32 { return p.DropScale }),
		u32("drop_threshold", func(p *P) uint32 { return p.DropThreshold }),
		u32("seed_lo", func(p *P) uint32 { return p.SeedLo }),
		u32("seed_hi", func(p *P) uint32 { return p.SeedHi }),
		u32("drop_offset", func(p *P) uint32 { return p.DropOffs }),
		u32("drop_q0", func(p *P) uint32 { return p.DropQ0 }),
		u32("drop_k0", func(p *P) uint32 { return p.DropK0 }),
		u32("drop_h0", func(p *P) uint32 { return p.DropH0 }),
		u32("drop_heads", func(p *P) uint32 { return p.DropHeads }),
	)
	return NewCStruct("BwdParams", 8, fs...)
}()

// Pack returns the params in the layout of the generated C struct.
func (p *BwdParams) Pack() []byte { return bwdParamsStruct.Pack(p) }
