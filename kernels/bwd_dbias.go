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
)

// String returns the path's name: scratch, atomic or direct.
func (d DBiasPath) String() string {
	switch d {
	case DBiasScratch:
		return "scratch"
	case DBiasAtomic:
		return "atomic"
	case DBiasDirect:
		return "direct"
	}
	return fmt.Sprintf("DBiasPath(%d)", uint8(d))
}

// The non-finite fix-up rewrites the scratch entries, accumulator elements
// or dBias elements of the pairs it recomputes, before BwdDBiasKernel
// reads them (nfDBiasRewrite).

// dbiasStore returns the statement that hands dS value val of pair (query
// row i, key j) of head h, batch element b to dBias: its store into the
// scratch, its atomic add into the accumulator (DBiasAtomic) or its store
// into dBias (DBiasDirect).
func (g *bwdGen) dbiasStore(i, j, val string) string {
	return g.dbiasStoreAt(g.dbiasPlace(i, j), val)
}

// dbiasPlace returns the address of the element dbiasStore writes for
// pair (query row i, key j) of head h, batch element b; in every path the
// element of pair (i + r, j + k) lies r·p.M + k elements on (the scratch
// and the accumulator are fp32 [·, ·, N, M], dBias [B, H, N, M]).
func (g *bwdGen) dbiasPlace(i, j string) string {
	switch g.v.DBiasPath {
	case DBiasAtomic:
		return fmt.Sprintf("p.dbias_scratch + dbias_acc_at(p, b, h, %s, %s)", i, j)
	case DBiasDirect:
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
	if g.v.DBiasPath == DBiasDirect {
		return "BT*"
	}
	return "float*"
}

// dbiasStoreAt returns dbiasStore's statement for the element at address
// ptr (dbiasPlace).
func (g *bwdGen) dbiasStoreAt(ptr, val string) string {
	switch g.v.DBiasPath {
	case DBiasAtomic:
		return fmt.Sprintf("atomicAdd(%s, %s);", ptr, val)
	case DBiasDirect:
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
// scratch entry; under DBiasAtomic, its accumulator element's whole exact
// sum (a kernel's NaN cannot be taken back out of it; fix-up blocks that
// reach the same element write the same value); under DBiasDirect, the
// pair's dBias element, and zeros for the rows of the key's hidden pairs
// (whose dS the kernel may have stored as 0·NaN, where a non-finite dP or
// Delta made the key's dK NaN).
func (g *bwdGen) nfDBiasRewrite() (inRows, afterRows string) {
	switch {
	case !g.v.BiasGrad:
		return "", ""
	case g.v.DBiasPath == DBiasAtomic:
		return "        if (i < ihi) p.dbias_scratch[dbias_acc_at(p, b, h, i, j)] = nf_dbias_sum(p, b, h, i, j);\n", ""
	case g.v.DBiasPath == DBiasDirect:
		return "        if (i < ihi) " + g.dbiasStore("i", "j", "use ? dsb : 0.f") + "\n",
			`    for (int h = kvh * G; h < kvh * G + G; ++h)  // dBias of the hidden pairs: 0
      for (int i = lane; i < n; i += 32)
        if (i < ilo || i >= ihi) ` + g.dbiasStore("i", "j", "0.f") + "\n"
	}
	return "        if (use) " + g.dbiasStore("i", "j", "dsb") + "\n", ""
}

// dbiasAccFuncs writes, under DBiasAtomic, dbias_acc_at (a pair's element
// of the accumulator) and nf_dbias_sum (an element's exact value, which
// the fix-up writes); it uses nf_pair, so it comes after it.
func (g *bwdGen) dbiasAccFuncs(b *strings.Builder) {
	if g.v.DBiasPath != DBiasAtomic {
		return
	}
	b.WriteString(`// dbias_acc_at: the index, in the dBias accumulator [bias batches, bias heads, N, M], of the element that pair
// (query row i, key j) of head h, batch element b adds into (DBiasAtomic)
DEV long long dbias_acc_at(const BwdParams& p, int b, int h, int i, int j) {
  return (((long long)(p.bias_nb == 1 ? 0 : b) * p.bias_nh + (p.bias_nh == 1 ? 0 : h)) * p.N + i) * p.M + j;
}
// nf_dbias_sum: the exact value of the accumulator element of pair (i, j) of head h, batch element b: dS of that
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

// dbiasZero returns the preprocess's zeroing of query row i: under
// DBiasAtomic, of the accumulator's plane b·H + h (blocks past the
// accumulator's planes skip it), by 16-byte stores where rows are
// multiples of four floats (the workspace's offsets are 256-byte aligned);
// under DBiasDirect with a mask, of the hidden pairs of dBias's (batch
// element b, head h): the kernel stores every pair of the tiles it
// computes, the visible ones among them, and skips tiles of hidden pairs
// only.
func (g *bwdGen) dbiasZero() string {
	switch {
	case g.v.DBiasPath == DBiasDirect && g.v.Masked():
		return `    {  // the hidden pairs of row i of dBias: the keys before and after those it sees (all, where it sees none)
      BT* gd = p.dbias + ((long long)(b * p.H + h) * p.N + i) * p.M;
      const int off = p.bottom_right ? p.M - p.N : 0;
      int jlo = 0, jhi = p.M;
` + g.rowKeys("      ", "i") + `      jlo = min(jlo, p.M);
      jhi = max(jhi, jlo);
      for (int j = lane; j < jlo; j += 32) gd[j] = bt_from_f(0.f);
      for (int j = jhi + lane; j < p.M; j += 32) gd[j] = bt_from_f(0.f);
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
              const float4 s = *reinterpret_cast<const float4*>(srow + ((long long)x * p.H + y) * head + j);
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
            for (int y = h0; y < h1; ++y) acc += srow[((long long)x * p.H + y) * head + j];
        drow[j] = bt_from_f(acc);
      }
    }
  }
}

`, BwdDBiasThreads, BwdDBiasKernel, BwdDBiasThreads, what, terms)
}
