package kernels

import "fmt"

// The staging copies: rows of 16-bit tensors whose head dim is not a
// multiple of 8 elements start only 2-byte aligned, so the kernels would
// load them element by element. The pack kernel copies such a tensor into
// workspace rows of StagedDim elements (zero beyond the head dim), which the
// forward then reads with 16-byte asynchronous copies; the backward's pack
// kernel does the same with the shared device code of stageSource.

// PackKernel is the name of the kernel in PackSource.
const PackKernel = "fa_pack_rows"

// PackSharedBytes is the dynamic shared memory of a pack kernel launch:
// the source address of each of a block's (row, head) pairs.
const PackSharedBytes = PackRowsPerBlock * 8

// PackThreads is the block size of the pack kernel.
const PackThreads = 256

// PackRowsPerBlock is the number of (row, head) pairs one block of the pack
// kernel copies (see PackGrid).
const PackRowsPerBlock = 128

// stageSource holds the device functions of every staging copy. A copy
// moves 16-byte chunks: each comes out of the (at most two) aligned 16-byte
// blocks of the source that it overlaps, so a row that starts only 2-byte
// aligned is still read with 16-byte loads. Bytes at or past a row's end are
// never read except as part of an aligned block that ends within the row,
// and the first block of a row starts at most 14 bytes before it, inside the
// same 16-byte aligned block (allocations are at least 16-byte aligned).
const stageSource = selectedHeadsSource + `// stage_block returns the 16 bytes at the 16-byte aligned address blk, zero from end on: one 16-byte
// load when the block ends at or before end, 2-byte loads of the bytes before end otherwise.
__device__ __forceinline__ uint4 stage_block(const unsigned char* blk, const unsigned char* end) {
  if (blk + 16 <= end) return *reinterpret_cast<const uint4*>(blk);
  unsigned w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; i++)
    if (blk + 2 * i < end) w[i >> 1] |= (unsigned)*reinterpret_cast<const unsigned short*>(blk + 2 * i) << (16 * (i & 1));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// stage_chunk returns bytes [16c, 16c + 16) of the row that starts at s (2-byte aligned) and ends at
// end, zero from end on. The chunk overlaps two aligned 16-byte blocks; where both end at or before lim
// (the end of the tensor's bytes, at or past end) they come in two 16-byte loads, bytes past end
// included, else through stage_block. The row's byte offset within a 16-byte block (sh, even, the same
// for every chunk of the row) then selects the chunk's bytes, and a mask clears those from end on:
// straight-line code, the same for every chunk.
__device__ __forceinline__ uint4 stage_chunk(const unsigned char* s, const unsigned char* end, const unsigned char* lim, int c) {
  const unsigned char* a = s + 16 * c;
  const int sh = (int)(reinterpret_cast<unsigned long long>(a) & 15ull);
  const unsigned char* blk = a - sh;
  uint4 x, y;
  if (blk + 32 <= lim) {
    x = *reinterpret_cast<const uint4*>(blk);
    y = *reinterpret_cast<const uint4*>(blk + 16);
  } else {
    x = stage_block(blk, end);
    y = stage_block(blk + 16, end);
  }
  // the 32-byte window x|y moved down by sh bytes: whole words first (by 2, then by 1; five words are
  // needed after that), then a half-word by byte permutes
  unsigned w0 = x.x, w1 = x.y, w2 = x.z, w3 = x.w, w4 = y.x;
  if (sh & 8) { w0 = w2; w1 = w3; w2 = w4; w3 = y.y; w4 = y.z; }
  if (sh & 4) {
    w0 = w1; w1 = w2; w2 = w3; w3 = w4;
    w4 = (sh & 8) ? y.w : y.y;
  }
  const unsigned sel = (sh & 2) ? 0x5432u : 0x3210u;
  unsigned o[4] = {__byte_perm(w0, w1, sel), __byte_perm(w1, w2, sel), __byte_perm(w2, w3, sel), __byte_perm(w3, w4, sel)};
  // clear the bytes from the row's end on: word k keeps min(max(valid - 4k, 0), 4) bytes (an even count)
  const int valid = (int)(end - a);
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int keep = min(max(valid - 4 * k, 0), 4);
    o[k] &= keep == 4 ? 0xffffffffu : (1u << (8 * keep)) - 1u;
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// stage_rows_by copies rows [0, nrows) of nb bytes, row r from src(r) into dst(r) (rows of nbs bytes,
// a multiple of 16, 16-byte aligned), zero from byte nb on; lim(r) bounds row r's whole 16-byte loads
// past its end (stage_chunk: an address at or past the row's end up to which the tensor's bytes go
// on). The block's NTH threads take the rows' 16-byte chunks in turn, SU at a time: all SU chunks'
// loads are issued before any store, so that each thread keeps several loads in flight.
constexpr int SU = 2;
template <int NTH, class Dst, class Src, class Lim>
__device__ __forceinline__ void stage_rows_by(Dst dst, Src src, int nrows, int nb, int nbs, Lim lim) {
  const int cpr = nbs >> 4;
  // this thread's next chunk (row r, chunk c), stepped NTH chunks on at a time: dr rows and dc chunks
  // (one division per thread, none per chunk)
  const int dr = NTH / cpr, dc = NTH - dr * cpr;
  int r = (int)threadIdx.x / cpr, c = (int)threadIdx.x - r * cpr;
  while (r < nrows) {
    uint4 x[SU];
    int rs[SU], cs[SU];
#pragma unroll
    for (int u = 0; u < SU; u++) {
      rs[u] = r, cs[u] = c;
      if (r < nrows) {
        const unsigned char* s = src(r);
        x[u] = stage_chunk(s, s + nb, lim(r), c);
      }
      r += dr, c += dc;
      if (c >= cpr) c -= cpr, r++;
    }
#pragma unroll
    for (int u = 0; u < SU; u++)
      if (rs[u] < nrows) *reinterpret_cast<uint4*>(dst(rs[u]) + 16 * cs[u]) = x[u];
  }
}

// stage_pairs copies n consecutive (row, head) pairs f0 .. f0+n-1 (f = row·kh + j, head j of the kh =
// selected_heads(heads, hmask) a row has; nf pairs in all) of rows of d elements of es bytes, pair
// (r, h) at s + (r·sr + h·sh)·es, into staging rows of ds elements at o (pair f0 + i at o + i·ds·es),
// zero beyond d. Pairs back to back in the source (the usual layout, every head) are read straight;
// others through the table of their addresses at row_src (shared memory, n entries, one division per
// pair instead of one per chunk). Whole 16-byte loads run on up to lim; a null lim bounds them by what
// the pairs themselves cover (back to back: the end of the last pair; otherwise each pair's own end).
template <int NTH>
__device__ __forceinline__ void stage_pairs(unsigned char* o, const unsigned char* s, long long sr, long long sh,
                                            int heads, unsigned hmask, int d, int ds, int es, long long f0, int n,
                                            long long nf, const unsigned char* lim, const unsigned char** row_src) {
  auto dst = [=](int i) { return o + (long long)i * ds * es; };
  const int nb = es * d, nbs = es * ds;
  if (hmask == 0u && (heads == 1 || sh == d) && sr == (long long)heads * d) {
    const unsigned char* s0 = s + f0 * nb;
    const unsigned char* end = lim ? lim : s0 + (long long)n * nb;
    stage_rows_by<NTH>(dst, [=](int i) { return s0 + (long long)i * nb; }, n, nb, nbs, [=](int) { return end; });
    return;
  }
  const int kh = selected_heads(heads, hmask);
  for (int i = threadIdx.x; i < n; i += NTH) {
    const long long f = f0 + i;
    // 32-bit division where the pair index fits (a 64-bit one costs several times more)
    const long long r = nf <= 0x7fffffffll ? (long long)((unsigned)f / (unsigned)kh) : f / kh, j = f - r * kh;
    const long long h = hmask ? selected_head((int)j, hmask) : j;
    row_src[i] = s + (r * sr + h * sh) * es;
  }
  __syncthreads();
  if (lim) {
    stage_rows_by<NTH>(dst, [&](int i) { return row_src[i]; }, n, nb, nbs, [=](int) { return lim; });
  } else {
    stage_rows_by<NTH>(dst, [&](int i) { return row_src[i]; }, n, nb, nbs, [&](int i) { return row_src[i] + nb; });
  }
}
`

// PackSource is the CUDA source of the pack kernel. It copies bit patterns,
// so one module serves fp16 and bf16.
var PackSource = fmt.Sprintf(`// Staging copies of up to three 16-bit [B, rows, heads, D] tensors (q, k and v of one forward, one B; any
// strides, feature dim contiguous) into contiguous [B, rows, heads, DS] buffers, DS = D rounded up to
// 16 elements, zero beyond D (with a head mask, only the heads it selects: [B, rows, selected, DS]), in
// one launch: grid (ceil(max rows·heads / %[1]d), max B, 3), %[2]d
// threads, blockIdx.z the tensor (blocks past a tensor's pairs return at once). A block copies %[1]d
// consecutive (row, head) pairs f = row·heads + head of one batch element: consecutive in the buffer
// and, for the usual contiguous layout, in the source too, so that both sides stream whole cache
// lines. Its threads take 16-byte chunks.
typedef unsigned short u16;
%[5]sstruct PackArgs { PackParams t[3]; };
%[3]s
extern "C" __global__ void __launch_bounds__(%[2]d) %[4]s(const PackArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // a forward launched early after this copy (programmatic dependent launch) may start now: its blocks
  // that read the copies wait for this grid to finish (griddepcontrol.wait)
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  // this block's tensor, field by field (no dynamic index into the parameter space)
  const int z = blockIdx.z;
#define PICK(f) (z == 0 ? a.t[0].f : z == 1 ? a.t[1].f : a.t[2].f)
  const PackParams p = {PICK(src), PICK(dst), PICK(lim), PICK(sb), PICK(sr), PICK(sh), PICK(rows), PICK(heads), PICK(d), PICK(ds), PICK(hmask), 0};
#undef PICK
  const long long f0 = (long long)blockIdx.x * %[1]d, nf = (long long)p.rows * selected_heads(p.heads, p.hmask);
  if (f0 >= nf) return;  // past this tensor's pairs (none when rows = 0)
  const int b = blockIdx.y, n = (int)min((long long)%[1]d, nf - f0);
  extern __shared__ __align__(16) unsigned char smem[];  // the pairs' source addresses (PackSharedBytes)
  stage_pairs<%[2]d>(reinterpret_cast<unsigned char*>(p.dst + (b * nf + f0) * p.ds), reinterpret_cast<const unsigned char*>(p.src + b * p.sb),
                     p.sr, p.sh, p.heads, p.hmask, p.d, p.ds, 2, f0, n, nf, p.lim, reinterpret_cast<const unsigned char**>(smem));
}
`, PackRowsPerBlock, PackThreads, stageSource, PackKernel, packParamsStruct.Decl()+packParamsStruct.SizeAssert())

// PackGrid returns the grid of the pack kernel for a tensor of batch
// elements of rows × heads rows each (z: one tensor); with a head mask,
// heads is the number it selects (FlatStagedCount).
func PackGrid(rows, heads, batch int) [3]uint32 {
	f := int64(rows) * int64(heads)
	return [3]uint32{uint32((f + PackRowsPerBlock - 1) / PackRowsPerBlock), uint32(batch), 1}
}

// PackLaunch returns the grid and argument of one pack launch that copies
// every tensor of ps (at most 3; Rows = 0: none) whose grids are grids.
func PackLaunch(ps []PackParams, grids [][3]uint32) ([3]uint32, []byte) {
	var g [3]uint32
	n := packParamsStruct.Size()
	args := make([]byte, 3*n)
	for i, p := range ps {
		g[0], g[1] = max(g[0], grids[i][0]), max(g[1], grids[i][1])
		packParamsStruct.PackInto(args[i*n:], &p)
	}
	g[2] = 3
	return g, args
}

// PackParams are the arguments of the pack kernel for one tensor; Pack
// gives the C struct's layout.
type PackParams struct {
	Src, Dst                           uint64 // device addresses of the source tensor's element 0 and of the staging buffer
	Lim                                uint64 // device address just past the source's last element (16-byte loads stay below it)
	BatchStride, RowStride, HeadStride int64  // source strides in elements
	Rows, Heads, D, DS                 int32  // rows per batch element (0: no copy), heads, head dim, staged row length
	// HeadMask, when not 0, copies only the heads h with bit h mod 8 set
	// (FlatStagedHeads), back to back: the buffer is [B, rows,
	// FlatStagedCount(Heads, HeadMask), DS].
	HeadMask uint8
}

// packParamsStruct is the layout of the C struct PackParams.
var packParamsStruct = func() *CStruct[PackParams] {
	type P = PackParams
	s := NewCStruct("PackParams", 0,
		CPtr("const u16*", "src", "element (b, r, h, 0) at src + b*sb + r*sr + h*sh", func(p *P) uint64 { return p.Src }),
		CPtr("u16*", "dst", "element (b, r, h, 0) at dst + ((b*rows + r)*heads + h)*ds", func(p *P) uint64 { return p.Dst }),
		CPtr("const unsigned char*", "lim", "the end of the source's bytes (its last element + 1)", func(p *P) uint64 { return p.Lim }),
		CI64("long long", "sb", "", func(p *P) int64 { return p.BatchStride }),
		CI64("long long", "sr", "", func(p *P) int64 { return p.RowStride }).Joined(),
		CI64("long long", "sh", "source strides in elements", func(p *P) int64 { return p.HeadStride }).Joined(),
		CI32("int", "rows", "", func(p *P) int32 { return p.Rows }),
		CI32("int", "heads", "", func(p *P) int32 { return p.Heads }).Joined(),
		CI32("int", "d", "", func(p *P) int32 { return p.D }).Joined(),
		CI32("int", "ds", "rows = 0: no copy", func(p *P) int32 { return p.DS }).Joined(),
		CU32("unsigned", "hmask", "0: every head; else only heads h with bit h mod 8 set, back to back", func(p *P) uint32 { return uint32(p.HeadMask) }),
		CI32("int", "pad_", "", func(*P) int32 { return 0 }),
	)
	s.DocColumn = 26
	return s
}()

// Pack returns the params in the layout of the C struct PackParams.
func (p PackParams) Pack() []byte { return packParamsStruct.Pack(&p) }
