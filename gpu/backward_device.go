package gpu

import (
	"fmt"
	"math"
	"os"
	"sync"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
	"github.com/flashattn/flashattn/philox"
)

// DQAlgorithm selects how the backward pass computes dQ.
type DQAlgorithm int

const (
	// DQAuto picks by the measured table (SelectDQAlgorithmFor); with
	// Options.Deterministic it is always DQSeparate.
	DQAuto DQAlgorithm = iota
	// DQAtomic accumulates dQ in fp32 with atomic adds from the dK/dV
	// kernel (five matrix products), then converts it. Not bit-for-bit
	// deterministic.
	DQAtomic
	// DQSeparate computes dQ in its own kernel that recomputes S, P and dP
	// per query block (seven matrix products in all). Deterministic.
	DQSeparate
)

// String returns "auto", "atomic" or "separate".
func (a DQAlgorithm) String() string {
	switch a {
	case DQAtomic:
		return "atomic"
	case DQSeparate:
		return "separate"
	}
	return "auto"
}

// dqRule is one row of the dQ algorithm table: problems whose padded head
// dimension is at most MaxDim and whose query length per head is at least
// MinN (and below MaxN, 0 meaning unbounded) use Algo. Hopper says which
// kernels the row is for: -1 any, 0 the mma.sync kernels, 1 the Hopper
// (wgmma) kernels. FixedLength limits the row to fixed-length batches (the
// Hopper kernels load their tiles by tensor maps there, and by cp.async for
// packed batches).
type dqRule struct {
	MaxDim      int
	Causal      int // -1 any, 0 not causal/windowed, 1 masked
	MinN, MaxN  int
	Hopper      int
	FixedLength bool
	Algo        DQAlgorithm
}

// dqTable is the measured choice of dQ algorithm per shape class, first
// matching row wins. See kernels/NOTES-bwd.md for the measurements.
var dqTable = []dqRule{
	// bf16 on the H200 (2026-12-04, the tensor-map kernels), N = 1K, 4K, 16K
	// with B·N = 16K and H·D = 2048: at D = 64 the atomic dQ is 1–6 % faster
	// everywhere; at D = 128 the separate one is 2–6 % faster without a mask
	// (4K: 3.526 ms against 3.682) and 1–7 % slower with the causal one
	// (4K: 2.349 against 2.269). Dims between 64 and 128 follow 128.
	{MaxDim: 64, Causal: -1, Hopper: 1, Algo: DQAtomic},
	{MaxDim: 128, Causal: 0, Hopper: 1, FixedLength: true, Algo: DQSeparate},
	// bf16 on the H200 (2026-12-03), the Hopper kernels with cp.async loads,
	// N = 4K causal or not and the head-dim spectrum: the atomic dQ is 5–15 %
	// faster up to D = 128; past it, where the dK/dV kernel's warpgroups
	// split columns over 64 keys, its atomics cost more than the separate dQ
	// kernel (D = 256: 4.74 ms separate, 5.61 atomic; with tensor maps 3.699
	// against 5.006 at 4K).
	{MaxDim: 128, Causal: -1, Hopper: 1, Algo: DQAtomic},
	{MaxDim: 256, Causal: -1, Hopper: 1, Algo: DQSeparate},
	// bf16 on the H200 (2026-12-02, second table), the mma.sync kernels, N =
	// 1K…16K causal or not, and the head-dim spectrum 64…512 at N = 4K:
	// since the atomic dQ adds accumulator pairs (8-byte vector atomics) it
	// wins everywhere measured, by 10–23 % up to D=128, 1–11 % beyond.
	// Options.Deterministic still picks DQSeparate.
	{MaxDim: 512, Causal: -1, Hopper: -1, Algo: DQAtomic},
}

// SelectDQAlgorithm returns the dQ algorithm the backward uses for p when
// asked for DQAuto on the mma.sync kernels (SelectDQAlgorithmFor with
// hopper false).
func SelectDQAlgorithm(p *attn.Problem) DQAlgorithm { return SelectDQAlgorithmFor(p, false) }

// SelectDQAlgorithmFor returns the dQ algorithm the backward uses for p when
// asked for DQAuto: DQSeparate when p.Opt.Deterministic is set, otherwise
// the first matching row of the measured table; hopper says that the Hopper
// kernels run p (see kernels.BwdHopperOK).
func SelectDQAlgorithmFor(p *attn.Problem, hopper bool) DQAlgorithm {
	if p.Opt.Deterministic {
		return DQSeparate
	}
	d := max(p.DK, p.DV)
	for _, r := range dqTable {
		if d > r.MaxDim || p.N < r.MinN || (r.MaxN > 0 && p.N >= r.MaxN) {
			continue
		}
		if r.Causal >= 0 && (r.Causal == 1) != p.Masked {
			continue
		}
		if r.Hopper >= 0 && (r.Hopper == 1) != hopper || r.FixedLength && p.Varlen {
			continue
		}
		return r.Algo
	}
	return DQSeparate
}

// bwdHopperRuns reports whether the backward of p in dt with arguments a
// runs the Hopper kernels on a device where they are available (hopper).
// It decides both the kernels planBackward picks and the row of the dQ table
// that applies, so the two cannot disagree.
func bwdHopperRuns(p *attn.Problem, dt attn.DType, a *bwdArgs, hopper bool) bool {
	return hopper && kernels.BwdHopperOK(bwdVariantFor(p, dt, a, DQSeparate))
}

// resolveDQ turns DQAuto into a concrete algorithm (hopper: the Hopper
// kernels run p); Deterministic always wins over an explicit DQAtomic.
func resolveDQ(p *attn.Problem, a DQAlgorithm, hopper bool) DQAlgorithm {
	if a == DQAuto || p.Opt.Deterministic {
		return SelectDQAlgorithmFor(p, hopper)
	}
	return a
}

// bwdView is a tensor in device memory as the backward kernels read it:
// the address of element 0, the dtype, and the element strides of the batch
// (0 for packed variable-length tensors), row (sequence position or packed
// token) and head dimensions; the feature dimension is contiguous. For the
// LSE ([B, H, N], packed [H, totalQ]) Batch and Head are its strides and
// rows are contiguous.
type bwdView struct {
	Ptr              uint64
	DType            attn.DType
	Batch, Row, Head int64
}

// bwdBiasView is a bias or dBias in device memory: [Batches, Heads, N, M]
// with Batches ∈ {1, B} and Heads ∈ {1, H}, element strides per dimension
// (a broadcast dimension's stride is ignored). dBias must be contiguous.
type bwdBiasView struct {
	Ptr                     uint64
	DType                   attn.DType
	Batches, Heads          int
	Batch, Head, Query, Key int64
}

// bwdArgs are the device buffers of one backward call. Q, K, V, O, DO
// and the outputs DQ, DK, DV are [B, seq, heads, dim] (packed: [total,
// heads, dim]); LSE is float32 [B, H, N] (packed [H, totalQ]). Bias and
// DBias are set when the problem has a bias (DBias when it asks for its
// gradient). CuSeqlensQ/K are device int32 arrays of B+1 offsets for packed
// batches. Workspace must hold BackwardWorkspaceBytes bytes.
type bwdArgs struct {
	Q, K, V, O, DO, LSE    bwdView
	DQ, DK, DV             bwdView
	Bias, DBias            *bwdBiasView
	CuSeqlensQ, CuSeqlensK uint64
	Workspace              uint64
	// Tiles overrides the tile table (zero: the table); benchmarks use it.
	Tiles kernels.BwdTiles
}

// bwdWorkspace is the layout of the backward's device scratch.
type bwdWorkspace struct {
	delta, lse2, dqacc, dbias int64 // byte offsets
	statBatch, statHead       int64 // strides of Delta and LSE2
	// Staged variants: byte offsets of the padded copies of q, k, v, dO
	// and their element strides.
	pq, pk, pv, pdo     int64
	pqS, pkS, pvS, pdoS kernels.BwdStrides
	total               int64
}

func align256(x int64) int64 { return (x + 255) &^ 255 }

// backwardWorkspace lays out the scratch of a backward call in dtype dt.
func backwardWorkspace(p *attn.Problem, dt attn.DType, algo DQAlgorithm, biasGrad bool) bwdWorkspace {
	var w bwdWorkspace
	rows, krows := int64(p.B)*int64(p.N), int64(p.B)*int64(p.M)
	if p.Varlen {
		rows, krows = int64(p.TotalQ), int64(p.TotalK)
		w.statBatch, w.statHead = 0, int64(p.TotalQ)
	} else {
		w.statBatch, w.statHead = int64(p.H)*int64(p.N), int64(p.N)
	}
	stat := align256(rows * int64(p.H) * 4)
	w.delta = 0
	w.lse2 = stat
	w.total = 2 * stat
	if algo == DQAtomic {
		w.dqacc = w.total
		w.total += align256(rows * int64(p.H) * int64(kernels.BwdDQAccDim(p.DK)) * 4)
	}
	if kernels.BwdNeedsStaging(dt, p.DK, p.DV) {
		// Padded copies [rows, heads, staged dim] in the batch layout of the
		// inputs (batch stride 0 when packed).
		staged := func(off *int64, st *kernels.BwdStrides, seq, nrows int64, heads, d int) {
			ds := int64(kernels.BwdStagedDim(dt, d))
			*st = kernels.BwdStrides{Batch: seq * int64(heads) * ds, Row: int64(heads) * ds, Head: ds}
			if p.Varlen {
				st.Batch = 0
			}
			*off = w.total
			w.total += align256(nrows * int64(heads) * ds * int64(dt.Size()))
		}
		staged(&w.pq, &w.pqS, int64(p.N), rows, p.H, p.DK)
		staged(&w.pdo, &w.pdoS, int64(p.N), rows, p.H, p.DV)
		staged(&w.pk, &w.pkS, int64(p.M), krows, p.Hkv, p.DK)
		staged(&w.pv, &w.pvS, int64(p.M), krows, p.Hkv, p.DV)
	}
	if biasGrad {
		w.dbias = w.total
		w.total += align256(int64(p.B) * int64(p.H) * int64(p.N) * int64(p.M) * 4)
	}
	if w.total == 0 {
		w.total = 256
	}
	return w
}

// BackwardWorkspaceBytes returns the device scratch a backward call of p
// in dtype dt with dQ algorithm algo needs (DQAuto: enough for either
// algorithm, since the choice depends on the device's kernels); dbias says
// whether the call computes dBias. Head dims that are not multiples of 16
// bytes add padded copies of q, k, v and dO.
func BackwardWorkspaceBytes(p *attn.Problem, dt attn.DType, algo DQAlgorithm, dbias bool) int64 {
	if algo == DQAuto && !p.Opt.Deterministic {
		return max(backwardWorkspace(p, dt, DQAtomic, dbias).total, backwardWorkspace(p, dt, DQSeparate, dbias).total)
	}
	return backwardWorkspace(p, dt, resolveDQ(p, algo, false), dbias).total
}

// bwdModule is one compiled backward variant.
type bwdModule struct {
	v                kernels.BwdVariant
	mod              *cuda.Module
	fns              map[string]*cuda.Function // by kernels.BwdKernelNames
	dkdvSmem, dqSmem int
}

// function returns the module's kernel of the given name (a kernels.Bwd*Kernel).
func (m *bwdModule) function(name string) *cuda.Function { return m.fns[name] }

// bwdCache holds the compiled backward variants of one device.
type bwdCache struct {
	mu  sync.Mutex
	dev *cuda.Device
	m   map[string]*bwdEntry

	tmu   sync.Mutex     // guards tmaps
	tmaps tensorMapCache // the tensor maps of the last TMA backward on dev
}

// bwdEntry is one variant's compilation, done once.
type bwdEntry struct {
	once sync.Once
	m    *bwdModule
	err  error
}

var bwdCaches sync.Map // *cuda.Device -> *bwdCache

// bwdCacheFor returns dev's backward cache, made on first use.
func bwdCacheFor(dev *cuda.Device) *bwdCache {
	ci, _ := bwdCaches.LoadOrStore(dev, &bwdCache{dev: dev, m: map[string]*bwdEntry{}})
	return ci.(*bwdCache)
}

// bwdModuleFor returns the compiled kernels of v on dev, compiling (NVRTC,
// with the package cuda disk cache) on first use. Different variants
// compile concurrently.
func bwdModuleFor(dev *cuda.Device, v kernels.BwdVariant) (*bwdModule, error) {
	c := bwdCacheFor(dev)
	key := v.Name()
	c.mu.Lock()
	e, ok := c.m[key]
	if !ok {
		e = &bwdEntry{}
		c.m[key] = e
	}
	c.mu.Unlock()
	e.once.Do(func() { e.m, e.err = compileBwd(dev, v) })
	return e.m, e.err
}

// compileBwd compiles and loads v's module and looks up its kernels.
func compileBwd(dev *cuda.Device, v kernels.BwdVariant) (*bwdModule, error) {
	key := v.Name()
	src, err := v.Source()
	if err != nil {
		return nil, err
	}
	mod, err := dev.Compile(cuda.CompileRequest{Name: key + ".cu", Source: src, ArchSpecific: v.WGMMA})
	if err != nil {
		return nil, fmt.Errorf("flashattn: backward kernels %s: %w", key, err)
	}
	m := &bwdModule{v: v, mod: mod, fns: map[string]*cuda.Function{}, dkdvSmem: v.DKDVSharedBytes(), dqSmem: v.DQSharedBytes()}
	for _, name := range kernels.BwdKernelNames(v) {
		fn, err := mod.Function(name)
		if err != nil {
			mod.Close()
			return nil, fmt.Errorf("flashattn: backward kernels %s: %w", key, err)
		}
		m.fns[name] = fn
	}
	if err := m.function(kernels.BwdDKDVKernel).SetMaxDynamicSharedMemory(m.dkdvSmem); err != nil {
		mod.Close()
		return nil, fmt.Errorf("flashattn: backward dK/dV kernel %s, %d bytes of shared memory: %w", key, m.dkdvSmem, err)
	}
	if err := m.function(kernels.BwdDQKernel).SetMaxDynamicSharedMemory(m.dqSmem); err != nil {
		mod.Close()
		return nil, fmt.Errorf("flashattn: backward dQ kernel %s, %d bytes of shared memory: %w", key, m.dqSmem, err)
	}
	return m, nil
}

// prepareBackward compiles (or loads from the cache) the kernels a
// backward call of p with these arguments would use, so that a later
// enqueueBackward only enqueues (as a CUDA graph capture requires).
func prepareBackward(dev *cuda.Device, p *attn.Problem, dt attn.DType, a bwdArgs, algo DQAlgorithm) error {
	pl, err := planBackward(p, dt, &a, algo, dev.SMCount(), hopperCapable(dev))
	if err != nil {
		return err
	}
	_, err = bwdModuleFor(dev, pl.v)
	return err
}

// bwdVariantFor returns the kernel variant of a backward call.
func bwdVariantFor(p *attn.Problem, dt attn.DType, a *bwdArgs, algo DQAlgorithm) kernels.BwdVariant {
	v := kernels.BwdVariant{
		DType: dt,
		DK:    p.DK,
		DV:    p.DV,
		Features: kernels.Features{
			Mask:    kernels.MaskFor(p.Masked),
			Softcap: p.Opt.Softcap > 0,
			Dropout: p.Opt.Dropout > 0,
			Varlen:  p.Varlen,
		},
		AtomicDQ: algo == DQAtomic,
		Tiles:    a.Tiles,
	}
	if a.Bias != nil {
		v.Bias = kernels.BiasFor(a.Bias.DType)
		v.BiasGrad = a.DBias != nil
	}
	v.Vector = vectorOK(dt, p, a)
	v.Staged = !v.Vector && kernels.BwdNeedsStaging(dt, p.DK, p.DV)
	return v
}

// vectorOK reports whether every row of the 16-byte-copied tensors starts
// on a 16-byte boundary.
func vectorOK(dt attn.DType, p *attn.Problem, a *bwdArgs) bool {
	g := int64(16 / dt.Size())
	if int64(p.DK)%g != 0 || int64(p.DV)%g != 0 {
		return false
	}
	for _, t := range []bwdView{a.Q, a.K, a.V, a.O, a.DO, a.DQ, a.DK, a.DV} {
		if t.Ptr%16 != 0 || t.Batch%g != 0 || t.Row%g != 0 || t.Head%g != 0 {
			return false
		}
	}
	return true
}

// bwdParams fills the kernel parameters of a backward call.
func bwdParams(p *attn.Problem, a *bwdArgs, w bwdWorkspace) kernels.BwdParams {
	st := func(t bwdView) kernels.BwdStrides {
		return kernels.BwdStrides{Batch: t.Batch, Row: t.Row, Head: t.Head}
	}
	kp := kernels.BwdParams{
		Q: a.Q.Ptr, K: a.K.Ptr, V: a.V.Ptr, O: a.O.Ptr, DO: a.DO.Ptr, LSE: a.LSE.Ptr,
		DQ: a.DQ.Ptr, DK: a.DK.Ptr, DV: a.DV.Ptr,
		Delta: a.Workspace + uint64(w.delta), LSE2: a.Workspace + uint64(w.lse2),
		CuSeqlensQ: a.CuSeqlensQ, CuSeqlensK: a.CuSeqlensK,
		QS: st(a.Q), KS: st(a.K), VS: st(a.V), OS: st(a.O), DOS: st(a.DO),
		DQS: st(a.DQ), DKS: st(a.DK), DVS: st(a.DV),
		LSEBatch: a.LSE.Batch, LSEHead: a.LSE.Head,
		StatBatch: w.statBatch, StatHead: w.statHead,
		B: int32(p.B), N: int32(p.N), M: int32(p.M), H: int32(p.H), Hkv: int32(p.Hkv),
		Left: clampWindow(p.Left, p.N, p.M), Right: clampWindow(p.Right, p.N, p.M),
		Scale:     float32(p.Scale),
		ScaleLog2: float32(p.Scale * math.Log2E),
	}
	if p.Opt.Align == attn.AlignBottomRight {
		kp.BottomRight = 1
	}
	if w.dqacc != 0 {
		kp.DQAcc = a.Workspace + uint64(w.dqacc)
		da := int64(kernels.BwdDQAccDim(p.DK))
		rows := int64(p.H) * da
		kp.DQAccS = kernels.BwdStrides{Batch: int64(p.N) * rows, Row: rows, Head: da}
		if p.Varlen {
			kp.DQAccS.Batch = 0
		}
	}
	if w.pq != 0 {
		kp.PQ, kp.PK, kp.PV, kp.PDO = a.Workspace+uint64(w.pq), a.Workspace+uint64(w.pk), a.Workspace+uint64(w.pv), a.Workspace+uint64(w.pdo)
		kp.PQS, kp.PKS, kp.PVS, kp.PDOS = w.pqS, w.pkS, w.pvS, w.pdoS
	}
	if c := p.Opt.Softcap; c > 0 {
		kp.Softcap, kp.InvSoftcap = float32(c), float32(1/c)
	}
	if d := p.Opt.Dropout; d > 0 {
		kp.DropScale = float32(1 / (1 - d))
		kp.DropThreshold = philox.Threshold(d)
		kp.SeedLo, kp.SeedHi = uint32(p.Opt.Seed), uint32(p.Opt.Seed>>32)
		kp.DropOffs = p.Opt.Offset
	}
	if a.Bias != nil {
		kp.Bias = a.Bias.Ptr
		kp.BiasB, kp.BiasH, kp.BiasI, kp.BiasJ = a.Bias.Batch, a.Bias.Head, a.Bias.Query, a.Bias.Key
		if a.Bias.Batches == 1 {
			kp.BiasB = 0
		}
		if a.Bias.Heads == 1 {
			kp.BiasH = 0
		}
		kp.BiasBatches, kp.BiasHeads = int32(a.Bias.Batches), int32(a.Bias.Heads)
		if a.DBias != nil {
			kp.DBias = a.DBias.Ptr
			kp.DBiasScratch = a.Workspace + uint64(w.dbias)
			kp.DBiasElems = int64(a.Bias.Batches) * int64(a.Bias.Heads) * int64(p.N) * int64(p.M)
		}
	}
	return kp
}

// bwdLaunch is one kernel launch of a backward call.
type bwdLaunch struct {
	kernel  string // one of the kernels.Bwd*Kernel names
	grid    [3]int
	threads int
	smem    int
}

// bwdPlan is the launch sequence of a backward call: a pure function of
// the problem, the variant and the device's multiprocessor count.
type bwdPlan struct {
	v        kernels.BwdVariant
	algo     DQAlgorithm
	w        bwdWorkspace
	params   kernels.BwdParams
	launches []bwdLaunch
	tma      []kernels.TMATensor // v.TMA: the tensors of the dK/dV kernel's maps (q, dO), then the dQ kernel's (k, v)
}

// planBackward validates a backward call and returns its launch sequence;
// hopper allows the Hopper dK/dV and dQ kernels where they apply (sms: the device's
// multiprocessors).
func planBackward(p *attn.Problem, dt attn.DType, a *bwdArgs, algo DQAlgorithm, sms int, hopper bool) (*bwdPlan, error) {
	run := bwdHopperRuns(p, dt, a, hopper)
	algo = resolveDQ(p, algo, run)
	if a.DBias != nil && a.Bias == nil {
		return nil, attn.Errorf(attn.ErrOption, "backward: dBias without bias")
	}
	if a.DBias != nil && a.DBias.DType != a.Bias.DType {
		return nil, attn.Errorf(attn.ErrDType, "backward: dBias dtype %v differs from the bias's %v", a.DBias.DType, a.Bias.DType)
	}
	for _, x := range []bwdView{a.Q, a.K, a.V, a.O, a.DO, a.DQ, a.DK, a.DV} {
		if x.DType != dt {
			return nil, attn.Errorf(attn.ErrDType, "backward: device tensor of dtype %v in a %v call", x.DType, dt)
		}
	}
	v := bwdVariantFor(p, dt, a, algo)
	v.WGMMA = run
	if err := v.Validate(); err != nil {
		return nil, err
	}
	pl := &bwdPlan{v: v, algo: algo, w: backwardWorkspace(p, dt, algo, a.DBias != nil)}
	if v.Staged != (pl.w.pq != 0) {
		return nil, fmt.Errorf("flashattn: backward %s: staging buffers and variant disagree", v.Name())
	}
	pl.params = bwdParams(p, a, pl.w)
	if run && !p.Varlen && !optedOut(os.Getenv(EnvNoTMA)) {
		if !v.Staged || !pl.useFlat(p, dt, a) {
			pl.useTMA()
		}
	}
	v = pl.v
	t := pl.v.ResolvedTiles()
	cdiv := func(a, b int) int { return (a + b - 1) / b }
	add := func(k string, grid [3]int, threads, smem int) {
		for _, g := range grid {
			if g <= 0 {
				return // an empty dimension: nothing to do
			}
		}
		pl.launches = append(pl.launches, bwdLaunch{k, grid, threads, smem})
	}
	rowGrid := [3]int{cdiv(p.N, kernels.BwdPreRows), p.B, p.H}
	if v.Staged {
		add(kernels.BwdPackKernel, kernels.BwdPackGrid(p.B, p.N, p.M, p.H, p.Hkv), kernels.PackThreads, kernels.PackSharedBytes)
	}
	add(kernels.BwdPreKernel, rowGrid, kernels.BwdPreThreads, 0)
	add(kernels.BwdDKDVKernel, [3]int{cdiv(p.M, t.DKDV.BlockN), p.B, p.Hkv}, 32*t.DKDV.Warps, pl.v.DKDVSharedBytes())
	if algo == DQAtomic {
		add(kernels.BwdDQConvertKernel, rowGrid, kernels.BwdPreThreads, 0)
	} else {
		add(kernels.BwdDQKernel, [3]int{cdiv(p.N, t.DQ.BlockM), p.B, p.H}, 32*t.DQ.Warps, pl.v.DQSharedBytes())
	}
	if a.DBias != nil && pl.params.DBiasElems > 0 {
		blocks := min(int(cdiv64(pl.params.DBiasElems, kernels.BwdDBiasThreads)), 8*max(sms, 1))
		add(kernels.BwdDBiasKernel, [3]int{blocks, 1, 1}, kernels.BwdDBiasThreads, 0)
	}
	return pl, nil
}

// useTMA switches the plan's Hopper kernels to tensor-map loads of their
// streamed tiles where the encoder would take the four maps (16-byte
// aligned, strides whole 16-byte units: cuda.TensorMapSpec.Check) and the
// variant takes them.
func (pl *bwdPlan) useTMA() {
	v := pl.v
	v.TMA = true
	pl.tryTMA(v)
}

// tryTMA makes v (a tensor-map variant of the plan's kernels) the plan's
// where it validates and the encoder would take its four maps, and reports
// whether it did.
func (pl *bwdPlan) tryTMA(v kernels.BwdVariant) bool {
	dkdv, dq := v.TMATensors(&pl.params)
	ts := []kernels.TMATensor{dkdv[0], dkdv[1], dq[0], dq[1]}
	for _, t := range ts {
		if tensorMapSpec(t).Check() != nil {
			return false
		}
	}
	if v.Validate() != nil {
		return false
	}
	pl.v, pl.tma = v, ts
	return true
}

// useFlat switches a staged Hopper plan to reading q, k, v and dO in place
// over flat rows (kernels.BwdVariant.Flat) where they allow it: 16-bit, one
// query head per key head, room for the shift (kernels.FlatFits), layouts
// kernels.FlatRowsOK takes (o's too: the preprocess reads o and dO over
// flat rows), and maps the encoder takes. The staging
// buffers of the workspace then go unused. It reports whether it switched.
func (pl *bwdPlan) useFlat(p *attn.Problem, dt attn.DType, a *bwdArgs) bool {
	if dt.Size() != 2 || p.H != p.Hkv || !kernels.FlatFits(p.DK, p.DV) {
		return false
	}
	for i, t := range []bwdView{a.Q, a.K, a.V, a.DO, a.O} {
		d := p.DK
		if i >= 2 {
			d = p.DV
		}
		if !kernels.FlatRowsOK(t.Ptr, p.H, d, t.Head, t.Row, t.Batch, p.B) {
			return false
		}
	}
	v := pl.v
	v.Staged, v.Flat, v.TMA = false, true, true
	return pl.tryTMA(v)
}

// bwdTMANames names the tensors of bwdPlan.tma in errors.
var bwdTMANames = []string{"q", "dO", "k", "v"}

// launchArgs returns the argument of each of the plan's kernel launches
// (kernelArgs), the TMA kernels' tensor maps encoded on dev unless the
// device's last backward used the same tensors.
func (pl *bwdPlan) launchArgs(dev *cuda.Device) (func(kernel string) []byte, error) {
	if !pl.v.TMA {
		return pl.kernelArgs(nil), nil
	}
	c := bwdCacheFor(dev)
	c.tmu.Lock()
	maps, err := c.tmaps.get(pl.tma, bwdTMANames, func(t kernels.TMATensor) (cuda.TensorMap, error) {
		return dev.EncodeTensorMap(tensorMapSpec(t))
	})
	c.tmu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("flashattn: backward %s: %w", pl.v.Name(), err)
	}
	return pl.kernelArgs(maps), nil
}

// kernelArgs returns the argument of each of the plan's kernel launches:
// BwdParams, or for the TMA dK/dV and dQ kernels the maps of pl.tma (maps,
// in that order) ahead of them.
func (pl *bwdPlan) kernelArgs(maps [][128]byte) func(kernel string) []byte {
	params := pl.params.Pack()
	if !pl.v.TMA {
		return func(string) []byte { return params }
	}
	dkdv, dq := kernels.BwdTMAArgs(maps[0], maps[1], params), kernels.BwdTMAArgs(maps[2], maps[3], params)
	return func(kernel string) []byte {
		switch kernel {
		case kernels.BwdDKDVKernel:
			return dkdv
		case kernels.BwdDQKernel:
			return dq
		}
		return params
	}
}

// enqueueBackward enqueues the backward pass of p on stream s: dQ, dK, dV
// (and dBias when a.DBias is set) from the device buffers of a, with dQ
// algorithm algo (DQAuto: SelectDQAlgorithmFor). It only enqueues: no host
// synchronisation, no host arithmetic on the data, so a caller may capture
// it in a CUDA graph. The kernels compile on first use of a variant (call
// prepareBackward before capturing). It returns the algorithm it used.
func enqueueBackward(dev *cuda.Device, s *cuda.Stream, p *attn.Problem, dt attn.DType, a bwdArgs, algo DQAlgorithm) (DQAlgorithm, error) {
	hopper := hopperCapable(dev)
	pl, err := planBackward(p, dt, &a, algo, dev.SMCount(), hopper)
	if err != nil {
		return resolveDQ(p, algo, bwdHopperRuns(p, dt, &a, hopper)), err
	}
	m, err := bwdModuleFor(dev, pl.v)
	if err != nil {
		return pl.algo, err
	}
	args, err := pl.launchArgs(dev)
	if err != nil {
		return pl.algo, err
	}
	for _, l := range pl.launches {
		g := [3]uint32{uint32(l.grid[0]), uint32(l.grid[1]), uint32(l.grid[2])}
		if err := dev.Launch(m.function(l.kernel), g, [3]uint32{uint32(l.threads), 1, 1}, uint32(l.smem), s, args(l.kernel)); err != nil {
			return pl.algo, fmt.Errorf("flashattn: backward %s %v: %w", l.kernel, l.grid, err)
		}
	}
	return pl.algo, nil
}

func cdiv64(a, b int64) int64 { return (a + b - 1) / b }
