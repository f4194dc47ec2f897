package kernels

import (
	"encoding/binary"
	"fmt"
	"math"
	"strings"
)

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

	DropThreshold uint32  // keep iff philox word < threshold
	DropScale     float32 // 1/(1-p)
	SeedLo        uint32
	SeedHi        uint32
	DropOffset    uint32
}

// ctype is the C type of one parameter field.
type ctype int

const (
	cU64 ctype = iota // pointer, carried as unsigned long long
	cI64
	cI32
	cU32
	cF32
)

func (t ctype) size() int {
	if t == cU64 || t == cI64 {
		return 8
	}
	return 4
}

func (t ctype) decl() string {
	return [...]string{"u64", "i64", "int", "u32", "float"}[t]
}

// field is one row of the parameter table: the C name, type, comment and
// the Go accessor returning the raw bits.
type field struct {
	name string
	typ  ctype
	doc  string
	bits func(*Params) uint64
}

func i64f(f func(*Params) int64) func(*Params) uint64 {
	return func(p *Params) uint64 { return uint64(f(p)) }
}
func i32f(f func(*Params) int32) func(*Params) uint64 {
	return func(p *Params) uint64 { return uint64(uint32(f(p))) }
}
func u32f(f func(*Params) uint32) func(*Params) uint64 {
	return func(p *Params) uint64 { return uint64(f(p)) }
}
func f32f(f func(*Params) float32) func(*Params) uint64 {
	return func(p *Params) uint64 { return uint64(math.Float32bits(f(p))) }
}

// paramTable is the single source of the kernel argument's layout: the C
// struct and the Go packing are both generated from it.
var paramTable = []field{
	{"q", cU64, "q [B, N, H, DK]", func(p *Params) uint64 { return p.Q }},
	{"k", cU64, "k [B, M, Hkv, DK]", func(p *Params) uint64 { return p.K }},
	{"v", cU64, "v [B, M, Hkv, DV]", func(p *Params) uint64 { return p.V }},
	{"o", cU64, "o [B, N, H, DV]", func(p *Params) uint64 { return p.O }},
	{"lse", cU64, "lse [B, H, N] float32", func(p *Params) uint64 { return p.LSE }},
	{"bias", cU64, "bias [B|1, H|1, N, M]", func(p *Params) uint64 { return p.Bias }},
	{"cu_q", cU64, "B+1 query segment offsets (int32)", func(p *Params) uint64 { return p.CuSeqlensQ }},
	{"cu_k", cU64, "B+1 key segment offsets (int32)", func(p *Params) uint64 { return p.CuSeqlensK }},
	{"q_sb", cI64, "q strides: batch", i64f(func(p *Params) int64 { return p.QStrideB })},
	{"q_sn", cI64, "q strides: position", i64f(func(p *Params) int64 { return p.QStrideN })},
	{"q_sh", cI64, "q strides: head", i64f(func(p *Params) int64 { return p.QStrideH })},
	{"k_sb", cI64, "k strides: batch", i64f(func(p *Params) int64 { return p.KStrideB })},
	{"k_sn", cI64, "k strides: position", i64f(func(p *Params) int64 { return p.KStrideN })},
	{"k_sh", cI64, "k strides: head", i64f(func(p *Params) int64 { return p.KStrideH })},
	{"v_sb", cI64, "v strides: batch", i64f(func(p *Params) int64 { return p.VStrideB })},
	{"v_sn", cI64, "v strides: position", i64f(func(p *Params) int64 { return p.VStrideN })},
	{"v_sh", cI64, "v strides: head", i64f(func(p *Params) int64 { return p.VStrideH })},
	{"o_sb", cI64, "o strides: batch", i64f(func(p *Params) int64 { return p.OStrideB })},
	{"o_sn", cI64, "o strides: position", i64f(func(p *Params) int64 { return p.OStrideN })},
	{"o_sh", cI64, "o strides: head", i64f(func(p *Params) int64 { return p.OStrideH })},
	{"lse_sb", cI64, "lse strides: batch", i64f(func(p *Params) int64 { return p.LSEStrideB })},
	{"lse_sh", cI64, "lse strides: head", i64f(func(p *Params) int64 { return p.LSEStrideH })},
	{"lse_sn", cI64, "lse strides: position", i64f(func(p *Params) int64 { return p.LSEStrideN })},
	{"bias_sb", cI64, "bias strides: batch (0: broadcast)", i64f(func(p *Params) int64 { return p.BiasStrideB })},
	{"bias_sh", cI64, "bias strides: head (0: broadcast)", i64f(func(p *Params) int64 { return p.BiasStrideH })},
	{"bias_sn", cI64, "bias strides: query", i64f(func(p *Params) int64 { return p.BiasStrideN })},
	{"bias_sm", cI64, "bias strides: key", i64f(func(p *Params) int64 { return p.BiasStrideM })},
	{"b", cI32, "batch size (segments when varlen)", i32f(func(p *Params) int32 { return p.B })},
	{"h", cI32, "query heads", i32f(func(p *Params) int32 { return p.H })},
	{"group", cI32, "query heads per key/value head", i32f(func(p *Params) int32 { return p.Group })},
	{"n", cI32, "query length (padded batch)", i32f(func(p *Params) int32 { return p.N })},
	{"m", cI32, "key length (padded batch)", i32f(func(p *Params) int32 { return p.M })},
	{"d_k", cI32, "actual q/k head dim", i32f(func(p *Params) int32 { return p.DK })},
	{"d_v", cI32, "actual v/o head dim", i32f(func(p *Params) int32 { return p.DV })},
	{"scale_log2", cF32, "scale·log2(e)", f32f(func(p *Params) float32 { return p.ScaleLog2 })},
	{"softcap_in", cF32, "scale/softcap", f32f(func(p *Params) float32 { return p.SoftcapIn })},
	{"softcap_out", cF32, "softcap·log2(e)", f32f(func(p *Params) float32 { return p.SoftcapOut })},
	{"win_left", cI32, "window: keys before the diagonal (-1 unbounded)", i32f(func(p *Params) int32 { return p.WinLeft })},
	{"win_right", cI32, "window: keys after the diagonal (-1 unbounded)", i32f(func(p *Params) int32 { return p.WinRight })},
	{"align_br", cI32, "1: diagonal aligned bottom-right", i32f(func(p *Params) int32 { return p.AlignBR })},
	{"o_vec2", cI32, "1: O stores may pair two elements", i32f(func(p *Params) int32 { return p.OVec2 })},
	{"drop_threshold", cU32, "dropout: keep iff word < threshold", u32f(func(p *Params) uint32 { return p.DropThreshold })},
	{"drop_scale", cF32, "dropout: 1/(1-p)", f32f(func(p *Params) float32 { return p.DropScale })},
	{"seed_lo", cU32, "philox key, low word of the seed", u32f(func(p *Params) uint32 { return p.SeedLo })},
	{"seed_hi", cU32, "philox key, high word of the seed", u32f(func(p *Params) uint32 { return p.SeedHi })},
	{"drop_offset", cU32, "philox counter word 3", u32f(func(p *Params) uint32 { return p.DropOffset })},
}

// layout returns the byte offset of each table field (natural alignment)
// and the struct size (a multiple of 8).
func layout() (offs []int, size int) {
	offs = make([]int, len(paramTable))
	off := 0
	for i, f := range paramTable {
		s := f.typ.size()
		off = roundUp(off, s)
		offs[i] = off
		off += s
	}
	return offs, roundUp(off, 8)
}

// ParamsSize is the size in bytes of the packed Params.
var ParamsSize = func() int { _, s := layout(); return s }()

// Pack returns the kernel argument bytes of p, laid out as the generated C
// struct (little-endian).
func (p *Params) Pack() []byte {
	b := make([]byte, ParamsSize)
	p.PackInto(b)
	return b
}

// PackInto writes the kernel argument bytes of p into b, which must hold
// ParamsSize bytes; it allocates nothing.
func (p *Params) PackInto(b []byte) {
	offs, _ := layout()
	for i, f := range paramTable {
		v := f.bits(p)
		if f.typ.size() == 8 {
			binary.LittleEndian.PutUint64(b[offs[i]:], v)
		} else {
			binary.LittleEndian.PutUint32(b[offs[i]:], uint32(v))
		}
	}
}

// cParams returns the C declaration of the Params struct, followed by
// static assertions that pin every offset to the Go layout.
func cParams() string {
	var s strings.Builder
	offs, size := layout()
	s.WriteString("// Kernel argument (one struct, passed by value). Strides are in elements.\n")
	s.WriteString("struct __align__(8) Params {\n")
	for _, f := range paramTable {
		fmt.Fprintf(&s, "  %-6s %-15s // %s\n", f.typ.decl(), f.name+";", f.doc)
	}
	s.WriteString("};\n")
	fmt.Fprintf(&s, "static_assert(sizeof(Params) == %d, \"Params size differs from the Go packing\");\n", size)
	// NVRTC's front end lacks __builtin_offsetof; nvcc checks every offset.
	s.WriteString("#ifndef __CUDACC_RTC__\n")
	for i, f := range paramTable {
		fmt.Fprintf(&s, "static_assert(__builtin_offsetof(Params, %s) == %d, \"Params.%s offset\");\n", f.name, offs[i], f.name)
	}
	s.WriteString("#endif\n")
	return s.String()
}
