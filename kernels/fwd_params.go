package kernels

// Params is the forward kernel's single argument. Strides are in elements
// (64-bit) and name the dims of each tensor: q, k, v and o are indexed
// (batch, position, head) plus a unit-stride feature dim; lse is indexed
// (batch, head, position); bias (batch, head, query, key), with 0 for a
// broadcast dim. For packed variable-length batches the batch strides are 0
// and positions count from the start of the packed tensor.
type Params struct {
	Q, K, V, O, LSE, Bias uint64 // device pointers (LSE, Bias may be 0 when unused)
	CuSeqlensQ            uint64 // device pointer to B+1 int32 offsets (Varlen)
	CuSeqlensK            uint64
	NFFlag                uint64 // device pointer to four uint32: the non-finite flag, the fix-up's done counter, a persistent launch's tile counter and CTAs done (zero between calls)

	QStrideB, QStrideN, QStrideH int64
	KStrideB, KStrideN, KStrideH int64
	VStrideB, VStrideN, VStrideH int64
	OStrideB, OStrideN, OStrideH int64
	LSEStrideB, LSEStrideH       int64
	LSEStrideN                   int64
	BiasStrideB, BiasStrideH     int64
	BiasStrideN, BiasStrideM     int64

	B, H  int32 // batch (segments) and query heads
	Group int32 // query heads per key/value head (H/Hkv)
	N, M  int32 // query and key lengths (padded batch; ignored when Varlen)
	DK    int32 // actual head dims, at most the variant's capacities
	DV    int32

	ScaleLog2  float32 // scale·log2(e)
	SoftcapIn  float32 // scale/softcap
	SoftcapOut float32 // softcap·log2(e)
	WinLeft    int32   // window extents around the diagonal; -1 unbounded
	WinRight   int32
	AlignBR    int32 // 1: diagonal at i + M - N (bottom-right); 0: at i
	OVec2      int32 // 1: O rows allow paired stores (even dims, aligned)

	DropThreshold uint32  // dropout: keep iff the element's 8-bit number < T = round(256·(1 − p)) (package philox)
	DropScale     float32 // dropout: 256/T
	SeedLo        uint32
	SeedHi        uint32
	DropOffset    uint32
	// Where the call sits in a larger problem for the dropout mask
	// (attn.Options.DropoutAt): element (b, h, i, j) draws the decision of
	// (b, DropH0 + h, DropQ0 + i, DropK0 + j) of a problem of DropHeads
	// heads; 0, 0, 0 and H for a call of its own.
	DropQ0, DropK0, DropH0, DropHeads uint32

	Scale float32 // scale (Variant.naturalScores: a bias without softcap)
}

// paramsStruct is the single source of the kernel argument's layout: the C
// struct and the Go packing are both generated from it.
var paramsStruct = func() *CStruct[Params] {
	s := NewCStruct("Params", 8,
		CPtr("u64", "q", "q [B, N, H, DK]", func(p *Params) uint64 { return p.Q }),
		CPtr("u64", "k", "k [B, M, Hkv, DK]", func(p *Params) uint64 { return p.K }),
		CPtr("u64", "v", "v [B, M, Hkv, DV]", func(p *Params) uint64 { return p.V }),
		CPtr("u64", "o", "o [B, N, H, DV]", func(p *Params) uint64 { return p.O }),
		CPtr("u64", "lse", "lse [B, H, N] float32", func(p *Params) uint64 { return p.LSE }),
		CPtr("u64", "bias", "bias [B|1, H|1, N, M]", func(p *Params) uint64 { return p.Bias }),
		CPtr("u64", "cu_q", "B+1 query segment offsets (int32)", func(p *Params) uint64 { return p.CuSeqlensQ }),
		CPtr("u64", "cu_k", "B+1 key segment offsets (int32)", func(p *Params) uint64 { return p.CuSeqlensK }),
		CPtr("u64", "nf_flag", "u32[4]: non-finite flag, fix-up done counter, persistent tile counter, CTAs done", func(p *Params) uint64 { return p.NFFlag }),
		CI64("i64", "q_sb", "q strides: batch", func(p *Params) int64 { return p.QStrideB }),
		CI64("i64", "q_sn", "q strides: position", func(p *Params) int64 { return p.QStrideN }),
		CI64("i64", "q_sh", "q strides: head", func(p *Params) int64 { return p.QStrideH }),
		CI64("i64", "k_sb", "k strides: batch", func(p *Params) int64 { return p.KStrideB }),
		CI64("i64", "k_sn", "k strides: position", func(p *Params) int64 { return p.KStrideN }),
		CI64("i64", "k_sh", "k strides: head", func(p *Params) int64 { return p.KStrideH }),
		CI64("i64", "v_sb", "v strides: batch", func(p *Params) int64 { return p.VStrideB }),
		CI64("i64", "v_sn", "v strides: position", func(p *Params) int64 { return p.VStrideN }),
		CI64("i64", "v_sh", "v strides: head", func(p *Params) int64 { return p.VStrideH }),
		CI64("i64", "o_sb", "o strides: batch", func(p *Params) int64 { return p.OStrideB }),
		CI64("i64", "o_sn", "o strides: position", func(p *Params) int64 { return p.OStrideN }),
		CI64("i64", "o_sh", "o strides: head", func(p *Params) int64 { return p.OStrideH }),
		CI64("i64", "lse_sb", "lse strides: batch", func(p *Params) int64 { return p.LSEStrideB }),
		CI64("i64", "lse_sh", "lse strides: head", func(p *Params) int64 { return p.LSEStrideH }),
		CI64("i64", "lse_sn", "lse strides: position", func(p *Params) int64 { return p.LSEStrideN }),
		CI64("i64", "bias_sb", "bias strides: batch (0: broadcast)", func(p *Params) int64 { return p.BiasStrideB }),
		CI64("i64", "bias_sh", "bias strides: head (0: broadcast)", func(p *Params) int64 { return p.BiasStrideH }),
		CI64("i64", "bias_sn", "bias strides: query", func(p *Params) int64 { return p.BiasStrideN }),
		CI64("i64", "bias_sm", "bias strides: key", func(p *Params) int64 { return p.BiasStrideM }),
		CI32("int", "b", "batch size (segments when varlen)", func(p *Params) int32 { return p.B }),
		CI32("int", "h", "query heads", func(p *Params) int32 { return p.H }),
		CI32("int", "group", "query heads per key/value head", func(p *Params) int32 { return p.Group }),
		CI32("int", "n", "query length (padded batch)", func(p *Params) int32 { return p.N }),
		CI32("int", "m", "key length (padded batch)", func(p *Params) int32 { return p.M }),
		CI32("int", "d_k", "actual q/k head dim", func(p *Params) int32 { return p.DK }),
		CI32("int", "d_v", "actual v/o head dim", func(p *Params) int32 { return p.DV }),
		CF32("scale_log2", "scale·log2(e)", func(p *Params) float32 { return p.ScaleLog2 }),
		CF32("softcap_in", "scale/softcap", func(p *Params) float32 { return p.SoftcapIn }),
		CF32("softcap_out", "softcap·log2(e)", func(p *Params) float32 { return p.SoftcapOut }),
		CI32("int", "win_left", "window: keys before the diagonal (-1 unbounded)", func(p *Params) int32 { return p.WinLeft }),
		CI32("int", "win_right", "window: keys after the diagonal (-1 unbounded)", func(p *Params) int32 { return p.WinRight }),
		CI32("int", "align_br", "1: diagonal aligned bottom-right", func(p *Params) int32 { return p.AlignBR }),
		CI32("int", "o_vec2", "1: O stores may pair two elements", func(p *Params) int32 { return p.OVec2 }),
		CU32("u32", "drop_threshold", "dropout: keep iff the 8-bit number u < T (package philox)", func(p *Params) uint32 { return p.DropThreshold }),
		CF32("drop_scale", "dropout: 256/T", func(p *Params) float32 { return p.DropScale }),
		CU32("u32", "seed_lo", "philox key, low word of the seed", func(p *Params) uint32 { return p.SeedLo }),
		CU32("u32", "seed_hi", "philox key, high word of the seed", func(p *Params) uint32 { return p.SeedHi }),
		CU32("u32", "drop_offset", "philox counter word 3", func(p *Params) uint32 { return p.DropOffset }),
		CU32("u32", "drop_q0", "dropout: query position origin (Options.DropoutAt)", func(p *Params) uint32 { return p.DropQ0 }),
		CU32("u32", "drop_k0", "dropout: key position origin (a multiple of 16)", func(p *Params) uint32 { return p.DropK0 }),
		CU32("u32", "drop_h0", "dropout: head origin", func(p *Params) uint32 { return p.DropH0 }),
		CU32("u32", "drop_heads", "dropout: heads of the larger problem (H of its own)", func(p *Params) uint32 { return p.DropHeads }),
		CF32("scale", "scale (the scores of a bias without softcap: natural units)", func(p *Params) float32 { return p.Scale }),
	)
	s.TypeWidth, s.DocColumn = 6, 22
	return s
}()

// ParamsSize is the size in bytes of the packed Params.
var ParamsSize = paramsStruct.Size()

// Pack returns the kernel argument bytes of p, laid out as the generated C
// struct (little-endian).
func (p *Params) Pack() []byte { return paramsStruct.Pack(p) }

// PackInto writes the kernel argument bytes of p into b, which must hold
// ParamsSize bytes; it allocates nothing.
func (p *Params) PackInto(b []byte) { paramsStruct.PackInto(b, p) }

// cParams returns the C declaration of the Params struct, followed by
// static assertions that pin every offset to the Go layout.
func cParams() string {
	return "// Kernel argument (one struct, passed by value). Strides are in elements.\n" +
		paramsStruct.Decl() + paramsStruct.SizeAssert() + paramsStruct.OffsetAsserts()
}
