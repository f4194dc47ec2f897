package kernels

import (
	"slices"

	"github.com/flashattn/flashattn/attn"
)

// The tensor memory accelerator path of the Hopper forward (Variant.TMA).
//
// Instead of every thread copying 16-byte chunks with cp.async, one thread
// asks the tensor memory accelerator for whole boxes: a box is 64 columns
// (one 128-byte swizzle atom) of BM query or BN key rows of one (batch,
// head), and lands in shared memory already in the 128-byte swizzle the
// warpgroup products read. Each tile (Q, a K buffer, a V buffer) has an
// mbarrier: the issuing thread announces the tile's bytes, the copies
// complete them, and the warps wait on the barrier's phase before the
// product that reads the tile. Columns past the head dim and rows past the
// sequence come in as zeros (out-of-bounds fill). The warps' own load path
// stays idle, which past D = 128 was a quarter of the kernel's time.
//
// The tensor maps (one each for q, k and v: dims head dim, position, head,
// batch) are encoded on the host (package gpu keeps the last launch's) and
// passed by value in TMAParams, ahead of the usual Params.

// tmaArgs holds the argument of a TMA kernel: its tensor maps, then Params.
type tmaArgs struct {
	maps [][128]byte
	p    *Params
}

// tensorMapField is member i of a TMA argument: the tensor map maps[i]
// (TensorMap, 128 bytes, 64-aligned).
func tensorMapField[T any](name, doc string, get func(*T) *[128]byte) CField[T] {
	return CBlob("TensorMap", name, doc, 128, 64, func(a *T, b []byte) { copy(b, get(a)[:]) })
}

// tmaLayout numbers the layouts of a TMA argument (tmaLayoutMaps): 0 for
// q, k and v; 1 with FlatStaged's staging copies; 2 with StoreO's o; each
// plus 3 with BiasStaged's bias.
func (v Variant) tmaLayout() int {
	l := 0
	switch {
	case v.FlatStaged:
		l = 1
	case v.StoreO:
		l = 2
	}
	if v.BiasStaged {
		l += 3
	}
	return l
}

// tmaLayoutMaps are the tensor maps of each layout of the argument, in
// order.
var tmaLayoutMaps = func() [6][]string {
	var m [6][]string
	for i, more := range [][]string{nil, {"qs", "ks", "vs"}, {"o"}} {
		m[i] = append([]string{"q", "k", "v"}, more...)
		m[i+3] = append(slices.Clone(m[i]), "bias")
	}
	return m
}()

// tmaMapDocs are the C comments of the tensor maps past q, k and v.
var tmaMapDocs = map[string]string{
	"vs":   "FlatStaged: the staging copies of the heads that do not fit in place",
	"o":    "StoreO: O, stored by the tensor memory accelerator",
	"bias": "BiasStaged: the bias, [64 rows][64 keys] boxes",
}

// tmaStructs are the layouts of the C struct TmaParams (by tmaLayout): the
// tensor maps, then Params.
var tmaStructs = func() [6]*CStruct[tmaArgs] {
	var out [6]*CStruct[tmaArgs]
	for l, names := range tmaLayoutMaps {
		var fields []CField[tmaArgs]
		for i, n := range names {
			f := tensorMapField(n, tmaMapDocs[n], func(a *tmaArgs) *[128]byte { return &a.maps[i] })
			if n == "k" || n == "v" || n == "ks" || n == "vs" { // on the line of q (qs)
				f = f.Joined()
			}
			fields = append(fields, f)
		}
		fields = append(fields, CBlob("Params", "p", "", ParamsSize, 8, func(a *tmaArgs, b []byte) { a.p.PackInto(b) }))
		out[l] = NewCStruct("TmaParams", 64, fields...)
		if slices.Contains(names, "qs") {
			out[l].DocColumn = 22
		}
	}
	return out
}()

// TMAMapNames returns the names of the tensor maps of v's TMA argument in
// order: q, k and v; with FlatStaged their staging copies' (qs, ks, vs);
// with StoreO o's; then with BiasStaged the bias's.
func (v Variant) TMAMapNames() []string { return slices.Clone(tmaLayoutMaps[v.tmaLayout()]) }

// TMAMaps returns the number of tensor maps a TMA variant's argument holds:
// q, k and v; with FlatStaged their staging copies', with StoreO o's; with
// BiasStaged the bias's.
func (v Variant) TMAMaps() int { return len(tmaLayoutMaps[v.tmaLayout()]) }

// TMAParamsSize returns the size in bytes of the TMA variant's argument:
// its TMAMaps 128-byte tensor maps ahead of Params, the whole a multiple of
// 64 bytes.
func (v Variant) TMAParamsSize() int { return tmaStructs[v.tmaLayout()].Size() }

// PackTMA writes the argument of v's kernel into b (TMAParamsSize bytes):
// the tensor maps (q, k, v, then with FlatStaged the copies' qs, ks, vs,
// with StoreO o, with BiasStaged the bias), then p.
func (v Variant) PackTMA(b []byte, p *Params, maps ...[128]byte) {
	tmaStructs[v.tmaLayout()].PackInto(b, &tmaArgs{maps: maps, p: p})
}

// TMATensor describes one of q, k, v for its tensor map: the box is 64
// columns by Rows rows of one head and batch element.
type TMATensor struct {
	Addr                 uint64    // device address of element (0, 0, 0, 0)
	Cols, Rows, Heads, B uint64    // extents: head dim (a multiple of 8), positions, heads, batch
	Strides              [3]uint64 // bytes between positions, heads, batch elements
	BoxRows              uint32    // rows per box (BM for q, BN for k and v)
	// AddsIn marks a map through which a kernel reduce-adds its boxes into
	// the tensor (DBiasReduce's dBias): the accelerator takes its elements
	// as numbers of type DType (fp16 or bf16). Other maps copy 16-bit
	// elements as bits.
	AddsIn bool
	DType  attn.DType
}

// Packed returns t over a packed batch of rows rows in all (the
// sequences' rows one after another, batch extent 1): a kernel addresses a
// sequence's rows from its first row in the packed tensor, batch 0.
func (t TMATensor) Packed(rows int) TMATensor {
	t.Rows, t.B, t.Strides[2] = uint64(rows), 1, 16
	return t
}

// TMAStride returns the byte stride a tensor map gets for a dim of extent
// elements elemStride elements apart (elements of elemSize bytes): a dim of
// extent one is never stepped over and gets 16, which every encoder takes.
// Whether another stride suits the encoder is cuda.TensorMapStrideOK's to
// say (a negative one comes out far too large).
func TMAStride(extent int, elemStride int64, elemSize int) uint64 {
	if extent <= 1 {
		return 16
	}
	return uint64(elemStride * int64(elemSize))
}

// BiasTMATensor returns the tensor a BiasStaged variant's producer reads
// the bias tiles from, for a launch with params p (biasTMATensor), boxes of
// 64 rows: one compute warpgroup's.
func (v Variant) BiasTMATensor(p *Params) TMATensor {
	return biasTMATensor(p.Bias, p.N, p.M, p.H, p.B, [3]int64{p.BiasStrideN, p.BiasStrideH, p.BiasStrideB}, 64)
}

// biasTMATensor describes a 16-bit bias of n rows by m keys for its tensor
// map: keys as columns, then rows, heads and batch elements (element
// strides: rows, heads, batch; 0 where broadcast). A broadcast head or
// batch dim has extent 1, and the kernels address it at 0 (biasMapCoords);
// a broadcast row dim keeps its stride 0, which the encoder refuses (no box
// of rows reads one row for all).
func biasTMATensor(addr uint64, n, m, h, b int32, strides [3]int64, boxRows int) TMATensor {
	heads, batch := int(h), int(b)
	if strides[1] == 0 {
		heads = 1
	}
	if strides[2] == 0 {
		batch = 1
	}
	return TMATensor{
		Addr: addr, Cols: uint64(m), Rows: uint64(n), Heads: uint64(heads), B: uint64(batch),
		Strides: [3]uint64{TMAStride(int(n), strides[0], 2), TMAStride(heads, strides[1], 2), TMAStride(batch, strides[2], 2)},
		BoxRows: uint32(boxRows),
	}
}

// biasMapCoords returns the head and batch coordinates of a bias box
// (biasTMATensor) for query head h and batch element b (expressions): 0
// on a broadcast dim.
func biasMapCoords(h, b string) string {
	return "p.bias_sh != 0 ? " + h + " : 0, p.bias_sb != 0 ? " + b + " : 0"
}

// TMATensors returns the three tensor descriptions of a TMA variant's
// launch with params p, given the byte strides of q, k and v (position,
// head, batch) and the head dims' stored widths (a multiple of 8; staged
// rows may be wider than the head dim, and are zero past it).
func (v Variant) TMATensors(p *Params, colsK, colsV uint64, qs, ks, vs [3]uint64) [3]TMATensor {
	return [3]TMATensor{
		{Addr: p.Q, Cols: colsK, Rows: uint64(p.N), Heads: uint64(p.H), B: uint64(p.B), Strides: qs, BoxRows: uint32(v.BlockM)},
		{Addr: p.K, Cols: colsK, Rows: uint64(p.M), Heads: uint64(p.H / p.Group), B: uint64(p.B), Strides: ks, BoxRows: uint32(v.BlockN)},
		{Addr: p.V, Cols: colsV, Rows: uint64(p.M), Heads: uint64(p.H / p.Group), B: uint64(p.B), Strides: vs, BoxRows: uint32(v.BlockN)},
	}
}

// cTensorMap is the C type of an encoded tensor map (CUtensorMap), which
// the forward's and the backward's TMA arguments hold.
const cTensorMap = "struct __align__(64) TensorMap { unsigned long long w[16]; };  // an encoded tensor map (CUtensorMap)\n"

// tmaParamsDecl returns the C declaration of the TMA kernel's argument
// (Variant.TMAParamsSize bytes).
func (v Variant) tmaParamsDecl() string {
	s := tmaStructs[v.tmaLayout()]
	return `// ---- the TMA kernel's argument: tensor maps of q, k, v (dims: head dim, position, head, batch;
// encoded on the host), then the usual Params
` + cTensorMap + s.Decl() + s.SizeAssert()
}

// tmaPrimitives returns the mbarrier and bulk tensor copy wrappers and
// tma_rows (a tile's boxes), shared by the forward and backward TMA kernels.
func tmaPrimitives() string {
	return `// ---- mbarriers and bulk tensor copies (tensor memory accelerator)
DEV void mbar_init(u32 bar, u32 count) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count)); }
// makes the barriers' initialization visible to the copy engine
DEV void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// one arrival that also announces bytes the copies will complete
DEV void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
DEV bool mbar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
// waits until the barrier's phase with this parity has completed
DEV void mbar_wait(u32 bar, u32 parity) { while (!mbar_try_wait(bar, parity)) {} }
// box (c0.., c1.., c2, c3) of the tensor map at generic address map into shared memory at dst,
// completing its bytes on bar
DEV void tma_load_4d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
               ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
// tma_rows issues ATOMS boxes of [ROWS][64 columns] (rows row0.., one head and batch element,
// columns from col0: 0, or where a flat map's head's boxes start, flat_shift before it) into the swizzled
// [ATOMS][ROWS][64] tile at dst, box a at dst + a·ROWS·128, completing on bar (whose bytes the
// caller announces; out-of-bounds parts count too, as zeros)
template <int ROWS, int ATOMS>
DEV void tma_rows(u32 dst, const TensorMap* map, u32 bar, int row0, int head, int batch, int col0 = 0) {
#pragma unroll
  for (int a = 0; a < ATOMS; ++a) tma_load_4d(dst + a * ROWS * 128, map, bar, col0 + a * 64, row0, head, batch);
}
`
}

// tmaLoaders returns the tile loaders of the TMA kernel: one thread issues
// every box of a tile and announces its bytes on the tile's barrier.
func tmaLoaders() string {
	return `// ---- a tile by the tensor memory accelerator (tma_rows), its bytes announced on its own barrier;
// one thread issues it
template <int ROWS, int ATOMS>
DEV void tma_tile(u32 dst, const TensorMap* map, u32 bar, int row0, int head, int batch, int col0 = 0) {
  mbar_expect_tx(bar, ATOMS * ROWS * 128);
  tma_rows<ROWS, ATOMS>(dst, map, bar, row0, head, batch, col0);
}
`
}

// tmaBarrierBytes is the shared memory of the TMA kernel's mbarriers: Q,
// two K and two V buffers, 8 bytes each, rounded to 64.
const tmaBarrierBytes = 64

// OutputTMATensor returns the tensor description of o's map for a StoreO
// launch with params p, given o's byte strides (position, head, batch):
// the call's p.DV columns (the stores clip there; a variant's DV may be a
// staged, padded width), boxes of 64 rows, one warpgroup's.
func (v Variant) OutputTMATensor(p *Params, strides [3]uint64) TMATensor {
	return TMATensor{Addr: p.O, Cols: uint64(p.DV), Rows: uint64(p.N), Heads: uint64(p.H), B: uint64(p.B), Strides: strides, BoxRows: 64}
}
