package kernels

import (
	"fmt"
	"strings"
)

// DBiasPath is how a backward variant's dK/dV kernel hands each dS
// element to dBias, the sum of dS over the dimensions the bias broadcasts
// over (its batch or its heads of size 1).
type DBiasPath uint8

const (
	// DBiasScratch stores each batch element's and head's dS, fp32
	// [B, H, N, M], in the workspace, and BwdDBiasKernel sums those over
	// the broadcast dimensions in a fixed order: deterministic, at the
	// price of B·H·N·M·4 bytes written and read again.
	DBiasScratch DBiasPath = iota
	// DBiasAtomic adds each element into an fp32 accumulator of dBias's
	// own shape [bias batches, bias heads, N, M] in the scratch's place by
	// atomic adds (zeroed by the preprocess), and BwdDBiasKernel converts
	// it. It is meant for a bias broadcast over the batch, whose batch
	// elements' CTAs of a head run in one wave, so that their adds can
	// meet in the same lines of L2. The adds' order varies from call to
	// call, so dBias does too, in its last bits.
	DBiasAtomic
	// DBiasDirect (for a bias of every batch element and head: dBias is
	// dS) stores each element in dBias's element type into dBias itself,
	// whose hidden pairs the preprocess zeroes first under a mask (those of
	// the tiles the kernel skips among them); BwdDBiasKernel is not
	// launched.
	DBiasDirect
	// DBiasTiles adds, as DBiasAtomic does, every element into an fp32
	// accumulator of dBias's elements, laid out in tiles of 64 queries by
	// 64 keys (dbias_acc_at), so that a warpgroup's share of a step, its
	// 64 keys by the step's 64 queries, is 16 KB contiguous in it: the
	// key-rows step stores that share into shared memory (the tiled dQ
	// accumulator's tile of the warpgroup, free until dQ's stores) and
	// adds it with one bulk reduce-add, where DBiasAtomic issues an atomic
	// add an element. BwdDBiasKernel converts the accumulator. Only where
	// DBiasTilesOK.
	DBiasTiles
	// DBiasStore (for a bias of every batch element and head, as
	// DBiasDirect) stores each warpgroup's share of a step's dS, which the
	// atomic dQ's product reads from its tile in shared memory, into dBias
	// by one tensor-map store, where DBiasDirect stores each element from
	// registers. Only where DBiasStoreOK.
	DBiasStore
	// DBiasReduce (for a bias broadcast over the batch, as DBiasAtomic)
	// hands each warpgroup's share of a step's dS tile, as DBiasStore
	// stores it, to dBias itself by one tensor-map copy in dBias's element
	// type: no fp32 accumulator and no BwdDBiasKernel. Where dBias has a
	// plane per head, the dK/dV kernel is launched twice
	// (BwdDBiasReduceLaunches): over batch element 0 alone (a grid of one
	// batch element), whose tiles it stores, then over the whole batch,
	// whose element 0 leaves at once and whose other elements add their
	// tiles into dBias by tensor-map reduce-adds, each add rounded to the
	// element type; under a mask the preprocess zeroes the hidden pairs,
	// which no tile reaches. Where the heads share a plane, it is launched
	// once and every batch element and head adds, into a dBias the
	// preprocess zeroes. The adds' order varies from call to call, so dBias
	// does too. Only where DBiasReduceOK.
	DBiasReduce
)

// DBiasStoreOK reports whether v can take DBiasStore: the key-rows step
// with the atomic dQ, whose dS tile the store reads; a staged bias (the
// store's tensor map follows the bias's), dBias's element type the
// inputs' (the dS tile's), and no softcap (whose chain rule makes dS
// differ from dBias's elements).
func DBiasStoreOK(v BwdVariant) bool {
	return v.KeyRows && v.AtomicDQ && v.BiasGrad && v.BiasStaged && v.Bias.DType() == v.DType && !v.Softcap
}

// DBiasReduceOK reports whether v can take DBiasReduce: where it could
// take DBiasStore, whose dS tile and map it shares.
func DBiasReduceOK(v BwdVariant) bool { return DBiasStoreOK(v) }

// DBiasReduceMaxBatch is the largest batch whose broadcast bias's gradient
// the planner adds by DBiasReduce. Each add rounds the running sum to the
// element type, so dBias's error grows with the batch faster than the
// naive baseline's: on the host emulator (a [1, 1, N, M] bias, N = M = 64,
// D = 128) the largest error came to 0.28–0.31 of the criterion's bound at
// B = 16, 0.41–0.48 at 32 and 0.55–0.65 at 64 (bf16, fp16); larger
// batches keep the fp32 accumulator (DBiasTiles, DBiasAtomic) or the
// scratch.
const DBiasReduceMaxBatch = 32

// BwdDBiasReduceLaunches returns the batch extents of a DBiasReduce
// variant's dK/dV launches over a batch of b > 1 elements and h heads,
// dBias having biasHeads planes of heads (1 or h): where they are one per
// head, 1 (batch element 0, which stores its dS tiles into dBias) and b
// (the others add theirs; the kernel tells the launches apart by that
// extent, gridDim.y); where the heads share one, b alone (every element
// adds).
func BwdDBiasReduceLaunches(b, h, biasHeads int) []int {
	if biasHeads == h {
		return []int{1, b}
	}
	return []int{b}
}

// DBiasByMap reports whether v's dK/dV kernel hands its dS tiles to dBias
// through dBias's tensor map (DBiasStore, DBiasReduce), the last map of
// its argument (DBiasTMATensor).
func (v BwdVariant) DBiasByMap() bool { return v.DBiasPath == DBiasStore || v.DBiasPath == DBiasReduce }

// dbiasInPlace reports whether v's dK/dV kernel writes dBias's elements
// itself (DBiasDirect, DBiasStore): BwdDBiasKernel is not launched, and
// under a mask the preprocess zeroes dBias's hidden pairs. (DBiasReduce
// writes dBias by stores and adds of tiles, and zeroes it as dbiasZero
// says.)
func (v BwdVariant) dbiasInPlace() bool {
	return v.DBiasPath == DBiasDirect || v.DBiasPath == DBiasStore
}

// DBiasConverts reports whether v's backward ends with BwdDBiasKernel,
// which writes dBias from the scratch or the accumulator: every dBias path
// but those that write dBias itself (DBiasDirect, DBiasStore, DBiasReduce).
func (v BwdVariant) DBiasConverts() bool { return !v.dbiasInPlace() && v.DBiasPath != DBiasReduce }

// DBiasTilesOK reports whether v can take DBiasTiles: the key-rows step
// with the tiled dQ accumulator (DQAccTiled) at padded DK 128, where each
// warpgroup owns a 64 × 64 fp32 tile of shared memory, on steps of 64
// queries.
func DBiasTilesOK(v BwdVariant) bool {
	return v.KeyRows && v.DQAccTiled() && DBiasTilesDims(v.DK) && v.bwdHopperTile().BlockM == 64 && v.BiasGrad
}

// DBiasTilesDims reports whether head dim dk (q's and k's) pads to the
// 128 columns DBiasTilesOK asks of the Hopper kernels.
func DBiasTilesDims(dk int) bool { return padMMA(dk) == 128 }

// dbiasAccumulates reports whether v's dK/dV kernel adds dS into an fp32
// accumulator of dBias's elements (DBiasAtomic, DBiasTiles), which the
// preprocess zeroes and BwdDBiasKernel converts.
func (v BwdVariant) dbiasAccumulates() bool {
	return v.DBiasPath == DBiasAtomic || v.DBiasPath == DBiasTiles
}

// String returns the path's name: scratch, atomic, direct, tiles, store
// or reduce.
func (d DBiasPath) String() string {
	switch d {
	case DBiasScratch:
		return "scratch"
	case DBiasAtomic:
		return "atomic"
	case DBiasDirect:
		return "direct"
	case DBiasTiles:
		return "tiles"
	case DBiasStore:
		return "store"
	case DBiasReduce:
		return "reduce"
	}
	return fmt.Sprintf("DBiasPath(%d)", uint8(d))
}

// The non-finite fix-up rewrites the scratch entries, accumulator elements
// or dBias elements of the pairs it recomputes, before BwdDBiasKernel
// reads them (nfDBiasRewrite).

// dbiasStore returns the statement that hands dS value val of pair (query
// row i, key j) of head h, batch element b to dBias: its store into the
// scratch, its atomic add into the accumulator (DBiasAtomic) or its store
// into dBias (DBiasDirect; under DBiasReduce, whose kernel adds by tiles,
// the non-finite fix-up's store of the element's whole value).
func (g *bwdGen) dbiasStore(i, j, val string) string {
	return g.dbiasStoreAt(g.dbiasPlace(i, j), val)
}

// dbiasPlace returns the address of the element dbiasStore writes for
// pair (query row i, key j) of head h, batch element b; in every path but
// DBiasTiles the element of pair (i + r, j + k) lies r·p.M + k elements on
// (the scratch and the accumulator are fp32 [·, ·, N, M], dBias [B, H, N,
// M], or under DBiasReduce [bias batches, bias heads, N, M]).
func (g *bwdGen) dbiasPlace(i, j string) string {
	switch g.v.DBiasPath {
	case DBiasAtomic, DBiasTiles:
		return fmt.Sprintf("p.dbias_scratch + dbias_acc_at(p, b, h, %s, %s)", i, j)
	case DBiasReduce:
		return fmt.Sprintf("p.dbias + dbias_acc_at(p, b, h, %s, %s)", i, j)
	case DBiasDirect, DBiasStore:
		return "p.dbias + " + dsPlace(i, j)
	}
	return "p.dbias_scratch + " + dsPlace(i, j)
}

// dsPlace returns the index of pair (query row i, key j) of head h, batch
// element b in [B, H, N, M].
func dsPlace(i, j string) string {
	return fmt.Sprintf("(((long long)b * p.H + h) * p.N + %s) * p.M + %s", i, j)
}

// dbiasPointer returns the C type of dbiasPlace's address.
func (g *bwdGen) dbiasPointer() string {
	if !g.v.DBiasConverts() {
		return "BT*"
	}
	return "float*"
}

// dbiasStoreAt returns dbiasStore's statement for the element at address
// ptr (dbiasPlace).
func (g *bwdGen) dbiasStoreAt(ptr, val string) string {
	switch g.v.DBiasPath {
	case DBiasAtomic, DBiasTiles:
		return fmt.Sprintf("atomicAdd(%s, %s);", ptr, val)
	case DBiasDirect, DBiasStore, DBiasReduce:
		return fmt.Sprintf("*(%s) = bt_from_f(%s);", ptr, val)
	}
	return fmt.Sprintf("*(%s) = %s;", ptr, val)
}

// dbiasTerms returns the declarations of the batch elements [b0, b1) and
// heads [h0, h1) whose dS share the dBias element of batch element b and
// head h (expressions): all of a dimension the bias broadcasts over, else
// b or h alone; indent before each line.
func dbiasTerms(indent, b, h string) string {
	return fmt.Sprintf(`%[1]sconst int b0 = p.bias_nb == 1 ? 0 : %[2]s, b1 = p.bias_nb == 1 ? p.B : %[2]s + 1;
%[1]sconst int h0 = p.bias_nh == 1 ? 0 : %[3]s, h1 = p.bias_nh == 1 ? p.H : %[3]s + 1;
`, indent, b, h)
}

// nfDBiasRewrite returns nf_keys's statements for dBias, where it
// recomputes key j of batch element b over the query rows [ilo, ihi) of
// head h that see it (lane's row i, use: the row counts): the pair's
// scratch entry; under DBiasAtomic and DBiasTiles, its accumulator element's whole exact
// sum (a kernel's NaN cannot be taken back out of it; fix-up blocks that
// reach the same element write the same value); under DBiasDirect and DBiasStore, the
// pair's dBias element, and zeros for the rows of the key's hidden pairs
// (whose dS the kernel may have stored as 0·NaN, where a non-finite dP or
// Delta made the key's dK NaN); under DBiasReduce, the element's whole
// exact sum, and zeros for the hidden pairs, which the kernel may have
// added 0·NaN into.
func (g *bwdGen) nfDBiasRewrite() (inRows, afterRows string) {
	switch {
	case !g.v.BiasGrad:
		return "", ""
	case g.v.dbiasAccumulates():
		return "        if (i < ihi) p.dbias_scratch[dbias_acc_at(p, b, h, i, j)] = nf_dbias_sum(p, b, h, i, j);\n", ""
	case g.v.DBiasPath == DBiasReduce:
		return "        if (i < ihi) " + g.dbiasStore("i", "j", "nf_dbias_sum(p, b, h, i, j)") + "\n",
			`    for (int h = kvh * G; h < kvh * G + G; ++h)  // dBias of the hidden pairs: 0
      for (int i = lane; i < n; i += 32)
        if (i < ilo || i >= ihi) ` + g.dbiasStore("i", "j", "0.f") + "\n"
	case g.v.dbiasInPlace():
		return "        if (i < ihi) " + g.dbiasStore("i", "j", "use ? dsb : 0.f") + "\n",
			`    for (int h = kvh * G; h < kvh * G + G; ++h)  // dBias of the hidden pairs: 0
      for (int i = lane; i < n; i += 32)
        if (i < ilo || i >= ihi) ` + g.dbiasStore("i", "j", "0.f") + "\n"
	}
	return "        if (use) " + g.dbiasStore("i", "j", "dsb") + "\n", ""
}

// dbiasAccFuncs writes, under DBiasAtomic, DBiasTiles and DBiasReduce,
// dbias_acc_at (a pair's element of the accumulator, or of dBias; under
// DBiasTiles with the tiles' order, dbiasTileIndex) and nf_dbias_sum (an
// element's exact value, which the fix-up writes); it uses nf_pair, so it
// comes after it.
func (g *bwdGen) dbiasAccFuncs(b *strings.Builder) {
	switch g.v.DBiasPath {
	case DBiasAtomic, DBiasReduce:
		b.WriteString(`// dbias_acc_at: the index, in the dBias accumulator [bias batches, bias heads, N, M] (DBiasAtomic) or in dBias
// itself (DBiasReduce), of the element that pair (query row i, key j) of head h, batch element b adds into
DEV long long dbias_acc_at(const BwdParams& p, int b, int h, int i, int j) {
  return (((long long)(p.bias_nb == 1 ? 0 : b) * p.bias_nh + (p.bias_nh == 1 ? 0 : h)) * p.N + i) * p.M + j;
}
`)
	case DBiasTiles:
		b.WriteString(dbiasTileIndex + dbiasTileFuncs)
	default:
		return
	}
	b.WriteString(`// nf_dbias_sum: the exact value of the accumulator element of pair (i, j) of head h, batch element b: dS of that
// pair summed over every batch element and head that shares the element (fixed length), batch outer, head inner
DEV float nf_dbias_sum(const BwdParams& p, int b, int h, int i, int j) {
  const int G = p.H / p.Hkv;
` + dbiasTerms("  ", "b", "h") + `  float s = 0.f;
  for (int x = b0; x < b1; ++x)
    for (int y = h0; y < h1; ++y) {
      float pd, ds, dsb;
      if (nf_pair(p, x, y, y / G, 0, 0, i, j, pd, ds, dsb)) s += dsb;
    }
  return s;
}
`)
}

// dbiasTileFuncs is dbias_acc_at under DBiasTiles (dbias_tile_index lays
// the tiles out).
const dbiasTileFuncs = `// dbias_acc_at: the index, in the tiled dBias accumulator (dbias_tile_index), of the element that pair (query
// row i, key j) of head h, batch element b adds into (DBiasTiles)
DEV long long dbias_acc_at(const BwdParams& p, int b, int h, int i, int j) {
  return dbias_tile_index(p, (p.bias_nb == 1 ? 0 : b) * p.bias_nh + (p.bias_nh == 1 ? 0 : h), i, j);
}
`

// dbiasTileIndex declares, under DBiasTiles, dbias_tile_at and
// dbias_tile_index: the order of the tiled dBias accumulator, which the
// preprocess zeroes, the dK/dV kernel adds into and BwdDBiasKernel reads
// (the module's prelude declares it, with dbias_acc_at).
const dbiasTileIndex = `// The tiled dBias accumulator (DBiasTiles): plane x (bias batch, bias head) holds ceil(N / 64) x ceil(M / 64)
// tiles of 64 queries x 64 keys, query tiles outer; a tile's rows are its queries, 64 floats each, whose 8-float
// chunks are swizzled by bits 1-2 of the row (chunk c of row r at c ^ ((r >> 1) & 3)): a key-rows thread's four
// lanes of one key group (t4 = 0..3) hold queries 2t4 + c, so their 4-byte stores of one element fall on 32 banks.
// Rows and keys past the sequences are padding, added into and never read.
DEV int dbias_tile_at(int r, int c) { return r * 64 + ((((c >> 3) ^ ((r >> 1) & 3)) << 3) | (c & 7)); }
DEV long long dbias_tile_index(const BwdParams& p, int x, int i, int j) {
  const long long qt = (p.N + 63) >> 6, kt = (p.M + 63) >> 6;  // query and key tiles of a plane
  return (((long long)x * qt + (i >> 6)) * kt + (j >> 6)) * 4096 + dbias_tile_at(i & 63, j & 63);
}
`

// DBiasTilesFloats returns the floats of the tiled dBias accumulator
// (DBiasTiles) of planes bias batches × bias heads, n queries and m keys:
// whole tiles of 64 × 64.
func DBiasTilesFloats(planes, n, m int) int64 {
	return int64(planes) * int64((n+63)/64) * int64((m+63)/64) * BwdDQTileFloats
}

// dbiasZero returns the preprocess's zeroing of query row i: under
// DBiasAtomic, of the accumulator's plane b·H + h (blocks past the
// accumulator's planes skip it), by 16-byte stores where rows are
// multiples of four floats (the workspace's offsets are 256-byte aligned);
// under DBiasTiles, of row i's share of the tiled plane b·H + h;
// under DBiasReduce, of row i of dBias's plane b·H + h where the heads
// share the plane (every launch adds into it), and of the row's hidden
// pairs under a mask where it has one plane a head (the first launch
// stores every tile that holds a visible pair);
// under DBiasDirect and DBiasStore with a mask, of the hidden pairs of dBias's (batch
// element b, head h): the kernel stores every pair of the tiles it
// computes, the visible ones among them, and skips tiles of hidden pairs
// only.
func (g *bwdGen) dbiasZero() string {
	switch {
	case g.v.DBiasPath == DBiasReduce:
		hidden := ""
		if g.v.Masked() {
			hidden = ` else {  // one plane a head: the first launch stores the tiles of the keys the row sees; the hidden pairs
        // before and after them (all, where it sees none) are left to here
` + g.dbiasZeroHidden("        ") + `      }`
		}
		return `    if (b * p.H + h < p.bias_nb * p.bias_nh) {  // row i of dBias's plane b·H + h (rows of whole 16-byte units)
      BT* gd = p.dbias + ((long long)(b * p.H + h) * p.N + i) * p.M;
      if (p.bias_nh != p.H) {  // a plane the heads share: every launch adds into it, so all of it starts at 0
        for (int j = lane; 8 * j < p.M; j += 32) reinterpret_cast<uint4*>(gd)[j] = make_uint4(0u, 0u, 0u, 0u);
      }` + hidden + `
    }
`
	case g.v.dbiasInPlace() && g.v.Masked():
		return `    {  // the hidden pairs of row i of dBias: the keys before and after those it sees (all, where it sees none)
      BT* gd = p.dbias + ((long long)(b * p.H + h) * p.N + i) * p.M;
` + g.dbiasZeroHidden("      ") + `    }
`
	case g.v.DBiasPath == DBiasTiles:
		return `    if (b * p.H + h < p.bias_nb * p.bias_nh) {  // the tiled accumulator's plane b·H + h, as ceil(N / 64)·64 chunks
      // of ceil(M / 64)·64 floats: row i zeroes chunks i, i + N, ... (past N: the last tiles' padding rows' share)
      const long long kt = (p.M + 63) >> 6, chunks = ((p.N + 63) >> 6) * 64LL;
      float* gp = p.dbias_scratch + dbias_tile_index(p, b * p.H + h, 0, 0);
      for (long long c = i; c < chunks; c += p.N) {
        float4* ga = reinterpret_cast<float4*>(gp + c * kt * 64);
        for (int j = lane; j < kt * 16; j += 32) ga[j] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
`
	case g.v.DBiasPath != DBiasAtomic:
		return ""
	}
	return `    if (b * p.H + h < p.bias_nb * p.bias_nh) {  // row i of the dBias accumulator's plane b·H + h
      float* ga = p.dbias_scratch + ((long long)(b * p.H + h) * p.N + i) * p.M;
      if ((p.M & 3) == 0)
        for (int j = 4 * lane; j < p.M; j += 128) *reinterpret_cast<float4*>(ga + j) = make_float4(0.f, 0.f, 0.f, 0.f);
      else
        for (int j = lane; j < p.M; j += 32) ga[j] = 0.f;
    }
`
}

// dbiasZeroHidden returns the preprocess's statements that zero query row
// i's hidden pairs in the dBias row at gd: the keys before and after those
// the row sees (rowKeys), all where it sees none; indent before each line.
func (g *bwdGen) dbiasZeroHidden(indent string) string {
	return indent + "const int off = p.bottom_right ? p.M - p.N : 0;\n" +
		indent + "int jlo = 0, jhi = p.M;\n" + g.rowKeys(indent, "i") +
		indent + "jlo = min(jlo, p.M);\n" +
		indent + "jhi = max(jhi, jlo);\n" +
		indent + "for (int j = lane; j < jlo; j += 32) gd[j] = bt_from_f(0.f);\n" +
		indent + "for (int j = jhi + lane; j < p.M; j += 32) gd[j] = bt_from_f(0.f);\n"
}

func (g *bwdGen) dbiasKernel(b *strings.Builder) {
	what := `sum over the broadcast batches and heads, in a fixed order (batch
// outer, head inner), of the per-head dS scratch [B, H, N, M]`
	terms := dbiasTerms("    ", "bb", "bh") + `    const float* srow = p.dbias_scratch + (long long)i * p.M;  // query i's row of (batch 0, head 0)
`
	if g.v.DBiasPath == DBiasAtomic {
		what = `the accumulator [bias batches, bias heads, N, M] that the
// dK/dV kernel added every batch element's and head's dS into (DBiasAtomic),`
		terms = `    const int b0 = 0, b1 = 1, h0 = 0, h1 = 1;  // one term: the accumulator's row r, laid out as dBias
    const float* srow = p.dbias_scratch + r * p.M;
    (void)bb; (void)bh;
`
	}
	base, at := "srow", func(j string) string { return "((long long)x * p.H + y) * head + " + j } // the term's element at key j
	if g.v.DBiasPath == DBiasTiles {
		what = `the tiled accumulator (dbias_tile_index) that the dK/dV kernel
// added every batch element's and head's dS into (DBiasTiles),`
		terms = `    const int b0 = 0, b1 = 1, h0 = 0, h1 = 1;  // one term: the tiled accumulator's row i of plane q
    const float* trow = p.dbias_scratch + dbias_tile_index(p, (int)q, i & ~63, 0) + (i & 63) * 64;  // in its first key tile
    (void)bb; (void)bh; (void)head;
`
		base, at = "trow", func(j string) string {
			return fmt.Sprintf("(long long)(%[1]s >> 6) * 4096 + (((((%[1]s) >> 3) & 7) ^ ((i >> 1) & 3)) << 3) + ((%[1]s) & 7)", j)
		}
	}
	fmt.Fprintf(b, `// dBias[bb, bh, i, j] = %[4]s where key j is visible to
// query i; 0 elsewhere. Row-wise: TPR threads take one dBias row (bb, bh, i), a power of two
// from a warp to the block; the block takes NTH / TPR rows a step and strides over them. A
// thread sums VEC consecutive keys: 4, by 16-byte scratch loads and one store of the four
// values, where the rows' lengths and both pointers allow it; 1 otherwise.
extern "C" __global__ void __launch_bounds__(%[1]d) %[2]s(const BwdParams p) {
  constexpr int NTH = %[3]d;
  const int off = p.bottom_right ? p.M - p.N : 0;
  const bool vec = (p.M & 3) == 0 && ((unsigned long long)p.dbias_scratch & 15) == 0 &&
                   ((unsigned long long)p.dbias & (4 * sizeof(BT) - 1)) == 0;
  const int units = vec ? p.M >> 2 : p.M;  // a row's work items: VEC keys each
  int tpr = 32;
  while (tpr < units && tpr < NTH) tpr <<= 1;
  const int rpb = NTH / tpr, lane = threadIdx.x & (tpr - 1);
  const long long rows = (long long)p.bias_nb * p.bias_nh * p.N;
  const long long head = (long long)p.N * p.M;  // scratch elements of one (batch, head)
  for (long long r = (long long)blockIdx.x * rpb + threadIdx.x / tpr; r < rows; r += (long long)gridDim.x * rpb) {
    const int i = (int)(r %% p.N);
    const long long q = r / p.N;
    const int bh = (int)(q %% p.bias_nh), bb = (int)(q / p.bias_nh);
%[5]s    BT* drow = p.dbias + r * p.M;
    if (vec) {
      for (int u = lane; u < units; u += tpr) {
        const int j = u * 4;
        bool vis[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) vis[c] = visible(i, j + c, p.M, off, p.left, p.right);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (vis[0] || vis[1] || vis[2] || vis[3]) {
          for (int x = b0; x < b1; ++x)
            for (int y = h0; y < h1; ++y) {
              const float4 s = *reinterpret_cast<const float4*>(%[6]s + %[7]s);
              acc[0] += vis[0] ? s.x : 0.f;
              acc[1] += vis[1] ? s.y : 0.f;
              acc[2] += vis[2] ? s.z : 0.f;
              acc[3] += vis[3] ? s.w : 0.f;
            }
        }
        struct __align__(4 * sizeof(BT)) Four { BT e[4]; } o;
#pragma unroll
        for (int c = 0; c < 4; ++c) o.e[c] = bt_from_f(acc[c]);
        *reinterpret_cast<Four*>(drow + j) = o;
      }
    } else {
      for (int j = lane; j < p.M; j += tpr) {
        float acc = 0.f;
        if (visible(i, j, p.M, off, p.left, p.right))
          for (int x = b0; x < b1; ++x)
            for (int y = h0; y < h1; ++y) acc += %[6]s[%[7]s];
        drow[j] = bt_from_f(acc);
      }
    }
  }
}

`, BwdDBiasThreads, BwdDBiasKernel, BwdDBiasThreads, what, terms, base, at("j"))
}
