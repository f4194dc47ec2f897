package gpu

import (
	"fmt"
	"math"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/kernels"
)

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
	dqaccBytes                int64 // bytes of the fp32 dQ accumulator (room for either layout)
	statBatch, statHead       int64 // strides of Delta and LSE2
	// Staged variants: byte offsets of the padded copies of q, k, v, dO
	// and their element strides.
	pq, pk, pv, pdo     int64
	pqS, pkS, pvS, pdoS kernels.BwdStrides
	nf                  int64 // byte offset of the non-finite flag and the fix-up's done counter
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
		size := rows * int64(p.H) * int64(kernels.BwdDQAccDim(p.DK))
		if cols := kernels.BwdDQAccTiledCols(p.DK); !p.Varlen && cols > 0 { // room for the tiled layout too (kernels.BwdVariant.DQAccTiled), whichever the plan takes
			tb, _ := kernels.BwdDQAccTiledStrides(p.N, p.H, cols)
			size = max(size, int64(p.B)*tb)
		}
		w.dqaccBytes = size * 4
		w.total += align256(w.dqaccBytes)
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
		size := int64(p.B) * int64(p.H) * int64(p.N) * int64(p.M)
		if !p.Varlen && kernels.DBiasTilesDims(p.DK) { // room for the tiled accumulator too (kernels.DBiasTiles), whichever the plan takes
			size = max(size, kernels.DBiasTilesFloats(p.B*p.H, p.N, p.M))
		}
		w.total += align256(size * 4)
	}
	w.nf = w.total
	w.total += kernels.BwdNonFiniteFlagBytes
	return w
}

// BackwardWorkspaceBytes returns the device scratch a backward call of p
// in dtype dt with dQ algorithm algo needs (DQAuto: enough for either
// algorithm, since the choice depends on the device's kernels); dbias says
// whether the call computes dBias. Head dims that are not multiples of 16
// bytes add padded copies of q, k, v and dO. The last 16 bytes hold the
// non-finite flag of the fix-up kernel (kernels.BwdNonFiniteKernel), which
// the call zeroes itself.
func BackwardWorkspaceBytes(p *attn.Problem, dt attn.DType, algo DQAlgorithm, dbias bool) int64 {
	if algo == DQAuto && !p.Opt.Deterministic {
		return max(backwardWorkspace(p, dt, DQAtomic, dbias).total, backwardWorkspace(p, dt, DQSeparate, dbias).total)
	}
	return backwardWorkspace(p, dt, resolveDQ(p, algo, DQKernels{}), dbias).total
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
		StatBatch: w.statBatch, StatHead: w.statHead, NFFlag: a.Workspace + uint64(w.nf),
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
		kp.Softcap, kp.SoftcapIn = float32(c), float32(p.Scale/c)
	}
	if p.Opt.Dropout > 0 {
		kp.DropThreshold, kp.DropScale = p.DropThreshold, float32(p.DropScale)
		kp.SeedLo, kp.SeedHi = uint32(p.Opt.Seed), uint32(p.Opt.Seed>>32)
		kp.DropOffs = p.Opt.Offset
		head, heads, qo, ko := p.DropoutPlace(0)
		kp.DropQ0, kp.DropK0, kp.DropH0, kp.DropHeads = uint32(qo), uint32(ko), uint32(head), uint32(heads)
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

// bwdRequest is what the backward planner takes: a validated problem, the
// device views of its tensors, the dQ algorithm asked for and the device's
// and backend's settings.
type bwdRequest struct {
	p    *attn.Problem
	dt   attn.DType
	a    bwdArgs
	algo DQAlgorithm // DQAuto: SelectDQAlgorithmFor
	sms  int         // the device's multiprocessors
	// hopper allows the Hopper dK/dV and dQ kernels where they apply, tma
	// their tensor-map loads (Backend.WGMMA, Backend.TMA).
	hopper, tma bool
	// bulkDQ adds the atomic dQ with bulk reduce-adds where the variant
	// allows it (Backend.BulkDQ).
	bulkDQ bool
	// ws runs the dK/dV and dQ kernels warp-specialized where the variant
	// allows it (Backend.BwdPipeline).
	ws bool
	// keyRows has the warp-specialized dK/dV kernel compute S and dP with
	// keys as rows where the variant allows it (Backend.BwdKeyRows);
	// keyRowsAuto where it measured faster (Backend.BwdKeyRowsAuto).
	keyRows, keyRowsAuto bool
	// queryStep, when not zero, is the queries a key-rows step takes where
	// the variant allows it (Backend.BwdQueryStep).
	queryStep int
	// biasStaged stages a 16-bit bias through shared memory in the
	// key-rows step where the variant and the bias's layout allow it
	// (Backend.BiasStaged, Backend.BiasStagedAuto).
	biasStaged bool
	// lightTail orders a masked launch's CTAs so that it ends on its
	// lightest blocks (Backend.BwdLightTail).
	lightTail bool
	// persistent launches the key-rows dK/dV kernel persistent where the
	// variant allows it (Backend.BwdPersistent).
	persistent bool
	// producerDropout has the producer's idle warps draw the dropout keep
	// bits where the variant allows it (Backend.BwdProducerDropout).
	producerDropout bool
	// dbiasAtomic adds a batch-broadcast bias's gradient by atomic adds
	// where the call allows it, dbiasAtomicAuto where that measured faster;
	// dbiasDirect stores the gradient of a bias of every batch element and
	// head directly (Backend.DBiasAtomic, Backend.DBiasAtomicAuto,
	// Backend.DBiasDirect, dbiasPath).
	dbiasAtomic, dbiasAtomicAuto, dbiasDirect bool
	// dbiasTiles adds it by tiles where it would be added by atomic adds
	// and the final variant allows it (Backend.DBiasTiles).
	dbiasTiles bool
	// dbiasStore stores it by tensor maps where it would be stored element
	// by element and the final variant allows it (Backend.DBiasStore).
	dbiasStore bool
	// dbiasReduce adds it by tensor-map reduce-adds into dBias where it
	// would add it into an fp32 accumulator and the final variant allows it
	// (Backend.DBiasReduce).
	dbiasReduce bool
	// deep allows the Hopper kernels past head dim 256 (Backend.BwdDeep).
	deep bool
}

// bwdRequest returns the planner's request for a backward of p in dt on
// views a with the backend's knobs.
func (b *Backend) bwdRequest(p *attn.Problem, dt attn.DType, a bwdArgs, algo DQAlgorithm) bwdRequest {
	if algo == DQAuto {
		algo = b.DQ
	}
	return bwdRequest{p: p, dt: dt, a: a, algo: algo, sms: b.dev.SMCount(), hopper: b.WGMMA, tma: b.TMA, bulkDQ: b.BulkDQ, ws: b.BwdPipeline.WarpSpecialized, keyRows: b.BwdKeyRows,
		keyRowsAuto: b.BwdKeyRowsAuto, queryStep: b.BwdQueryStep, biasStaged: b.biasStaged(), lightTail: b.BwdLightTail, persistent: b.BwdPersistent, producerDropout: b.BwdProducerDropout, deep: b.BwdDeep, dbiasAtomic: b.DBiasAtomic,
		dbiasAtomicAuto: b.DBiasAtomicAuto, dbiasDirect: b.DBiasDirect, dbiasTiles: b.DBiasTiles, dbiasStore: b.DBiasStore, dbiasReduce: b.DBiasReduce}
}

// biasStaged reports whether the backend's forward and backward stage a
// bias where the variant allows it (BiasStaged or BiasStagedAuto: the loads
// by tensor maps measured faster than the global loads with and without a
// mask).
func (b *Backend) biasStaged() bool { return b.BiasStaged || b.BiasStagedAuto }

// bwdPlan is the launch sequence of a backward call: a pure function of
// its request.
type bwdPlan struct {
	r        bwdRequest
	v        kernels.BwdVariant
	algo     DQAlgorithm
	w        bwdWorkspace
	params   kernels.BwdParams
	launches []bwdLaunch
	tma      []kernels.TMATensor // v.TMA: the tensors of the dK/dV kernel's maps (q, dO), then the dQ kernel's (k, v), then with BiasStaged the bias's
}

// planBackward validates the kernel choice of a backward call and returns
// its launch sequence. The dQ algorithm the call leaves to the table
// (DQAuto) is the row of the kernels that run it: planned first for the
// warp-specialized kernels where the request asks for them, and again for
// the lockstep ones where those kernels decline the call. Where the
// request allows the key-rows step where it measured faster, the call is
// such a problem and its dQ algorithm is left to the table or atomic, it
// takes that step with the atomic dQ by bulk reduce-adds, unless the
// variant declines one of them; so a call planned again with the
// algorithm its first plan returned (PrepareBackward, then
// BackwardDevice) gets the same plan.
func planBackward(r bwdRequest) (*bwdPlan, error) {
	countPlan()
	if step, faster := keyRowsFaster(r.p); r.keyRowsAuto && r.ws && r.hopper && r.algo != DQSeparate && faster {
		k := r
		k.algo, k.bulkDQ, k.keyRows = DQAtomic, true, true
		if step != 0 {
			k.queryStep = step
		}
		if pl, err := planBackwardOn(k, true); err == nil && pl.v.KeyRows && pl.v.BulkDQ && pl.algo == DQAtomic && (step == 0 || pl.v.QueryStep == step) {
			return pl, nil
		}
	}
	pl, err := planBackwardOn(r, r.ws)
	if err == nil && r.ws && !pl.v.WarpSpecialized && resolveDQ(r.p, r.algo, DQKernels{Hopper: pl.v.WGMMA}) != pl.algo {
		return planBackwardOn(r, false)
	}
	return pl, err
}

// planBackwardOn is planBackward with the dQ table's row for the
// warp-specialized kernels (ws) or for the others.
func planBackwardOn(r bwdRequest, ws bool) (*bwdPlan, error) {
	p, dt, a := r.p, r.dt, &r.a
	if err := checkDropoutAt(p); err != nil {
		return nil, err
	}
	run := bwdHopperRuns(p, dt, a, r.hopper, r.deep)
	algo := resolveDQ(p, r.algo, DQKernels{Hopper: run, WarpSpecialized: ws})
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
	v.DBiasPath = r.dbiasPath()
	if err := v.Validate(); err != nil {
		return nil, err
	}
	pl := &bwdPlan{r: r, v: v, algo: algo, w: backwardWorkspace(p, dt, algo, a.DBias != nil)}
	if v.Staged != (pl.w.pq != 0) {
		return nil, fmt.Errorf("flashattn: backward %s: staging buffers and variant disagree", v.Name())
	}
	pl.setParams()
	if run && r.tma && (!p.Varlen || packedTMARows(p)) {
		if !v.Staged || !pl.useFlat(p, dt, a) {
			pl.useTMA()
		}
	}
	if r.bulkDQ && run && algo == DQAtomic {
		w := pl.v
		w.BulkDQ = true
		pl.tryVariant(w)
	}
	if ws && pl.v.TMA && !bwdWSSlower(p) {
		w := pl.v
		w.WarpSpecialized = true
		pl.tryVariant(w)
	}
	if r.keyRows {
		w := pl.v
		w.KeyRows = true
		if !pl.tryVariant(w) && r.queryStep != 0 {
			// a key-rows step only its query step makes (128 queries with the atomic dQ at D ≤ 64)
			w.QueryStep = r.queryStep
			pl.tryTMA(w)
		}
	}
	if r.queryStep != 0 && pl.v.KeyRows && pl.v.QueryStep == 0 {
		w := pl.v
		w.QueryStep = r.queryStep
		pl.tryTMA(w) // q's and dO's maps take the step's rows a box
	}
	if pr := pl.params; r.biasStaged && pl.v.KeyRows && biasStageable(pr.Bias, pr.BiasJ, pr.BiasI, pr.BiasH, pr.BiasB) {
		w := pl.v
		w.BiasStaged = true
		pl.tryTMA(w) // with the bias's map
	}
	if r.lightTail { // (Validate declines it unmasked)
		w := pl.v
		w.LightTail = true
		pl.tryVariant(w)
	}
	if r.persistent && pl.v.KeyRows { // (with the dQ kernel's maps of k and v, which the dK/dV kernel takes too)
		w := pl.v
		w.Persistent = true
		pl.tryTMA(w)
	}
	if r.producerDropout {
		w := pl.v
		w.ProducerDropout = true
		pl.tryVariant(w)
	}
	if r.dbiasTiles && pl.v.DBiasPath == kernels.DBiasAtomic {
		w := pl.v
		w.DBiasPath = kernels.DBiasTiles
		pl.tryVariant(w)
	}
	if r.dbiasStore && pl.v.DBiasPath == kernels.DBiasDirect && pl.v.TMA {
		w := pl.v
		w.DBiasPath = kernels.DBiasStore
		pl.tryTMA(w) // with dBias's map
	}
	if r.dbiasReduces() && pl.v.TMA { // in place of whichever path dbiasPath chose
		w := pl.v
		w.DBiasPath = kernels.DBiasReduce
		pl.tryTMA(w) // with dBias's map
	}
	pl.setParams() // the final variant's: its dQ accumulator layout
	pl.launches = bwdLaunches(p, pl.v, algo, a.DBias != nil, &pl.params, r.sms)
	return pl, nil
}

// dbiasPath returns how the request's dK/dV kernel hands dS to dBias
// (kernels.DBiasPath), before the tile paths replace it where the final
// variant allows them: directly where asked (dbiasDirect) for a bias of
// every batch element and head; by atomic adds where asked (dbiasAtomic,
// or dbiasAtomicAuto at head dims above 64: it measured faster at 128 and
// slower at 64) for a bias broadcast over the batch (dbiasBatchSum);
// through the scratch otherwise (docs/kernels/backward.md, "dBias by
// atomic adds").
func (r bwdRequest) dbiasPath() kernels.DBiasPath {
	p, a := r.p, &r.a
	switch {
	case a.DBias == nil || a.Bias == nil || p.Varlen:
	case r.dbiasDirect && a.Bias.Batches == p.B && a.Bias.Heads == p.H:
		return kernels.DBiasDirect
	case (r.dbiasAtomic || r.dbiasAtomicAuto && max(p.DK, p.DV) > 64) && r.dbiasBatchSum():
		return kernels.DBiasAtomic
	}
	return kernels.DBiasScratch
}

// dbiasBatchSum reports whether dBias may be summed over the batch in an
// order that varies from call to call (the atomic adds, the tiles, the
// reduce-adds): a bias broadcast over a batch of more than one element
// (whose elements' CTAs of a head run together, so that their adds meet
// in L2), fixed length, not deterministic.
func (r bwdRequest) dbiasBatchSum() bool {
	p, a := r.p, &r.a
	return a.DBias != nil && a.Bias != nil && !p.Varlen && a.Bias.Batches == 1 && p.B > 1 && !p.Opt.Deterministic
}

// dbiasReduces reports whether the request asks for dBias by tensor-map
// reduce-adds (dbiasReduce) where the batch sum allows them
// (dbiasBatchSum) for batches up to kernels.DBiasReduceMaxBatch, whatever
// path dbiasPath chose ("dBias by tensor-map reduce-adds").
func (r bwdRequest) dbiasReduces() bool {
	return r.dbiasReduce && r.dbiasBatchSum() && r.p.B <= kernels.DBiasReduceMaxBatch
}

// keyRowsFaster reports the problems whose backward measured faster on the
// key-rows step with the atomic dQ by bulk reduce-adds (into the tiled
// accumulator) than on the dQ table's choice for the warp-specialized
// kernels, and the query step they take (0: the variant's own): head dims
// 65–128 (their larger) on the variant's step, where the step takes the
// atomic dQ only at a DK padded to 128 (113–128: kernels.KeyRowsOK; the
// others keep the table's choice), 49–64 (padded to 64) on
// steps of 128 queries (which under dropout take neither a softcap nor a
// bias: kernels.QueryStepOK; those keep the table's choice); at least 512
// queries without a mask or window and 1024 with one, fixed length, not
// deterministic (docs/kernels/backward.md, "The tiled dQ accumulator",
// "Steps of 128 queries at D ≤ 64" and "Dropout in the key-rows step").
func keyRowsFaster(p *attn.Problem) (queryStep int, faster bool) {
	d := max(p.DK, p.DV)
	minN := 512
	if p.Masked {
		minN = 1024
	}
	if d <= 48 || d > 128 || p.Varlen || p.N < minN || p.Opt.Deterministic {
		return 0, false
	}
	if d <= 64 {
		return 128, true
	}
	return 0, true
}

// bwdWSSlower reports the problems whose warp-specialized backward
// measured slower than the lockstep one, which keep the lockstep kernels:
// head dims up to 32 without a mask (docs/kernels/backward.md, "The
// warp-specialized backward by head dim").
func bwdWSSlower(p *attn.Problem) bool { return max(p.DK, p.DV) <= 32 && !p.Masked }

// bwdLaunches returns the kernel launches of a backward of p with variant
// v, dQ algorithm algo and kernel parameters params (dbias: it computes
// dBias, of params.DBiasElems elements in params.BiasHeads planes of heads;
// sms: the device's multiprocessors).
func bwdLaunches(p *attn.Problem, v kernels.BwdVariant, algo DQAlgorithm, dbias bool, params *kernels.BwdParams, sms int) []bwdLaunch {
	var ls []bwdLaunch
	t := v.ResolvedTiles()
	cdiv := func(a, b int) int { return (a + b - 1) / b }
	add := func(k string, grid [3]int, threads, smem int) {
		for _, g := range grid {
			if g <= 0 {
				return // an empty dimension: nothing to do
			}
		}
		ls = append(ls, bwdLaunch{k, grid, threads, smem})
	}
	rowGrid := [3]int{cdiv(p.N, kernels.BwdPreRows), p.B, p.H}
	if v.Staged {
		add(kernels.BwdPackKernel, kernels.BwdPackGrid(p.B, p.N, p.M, p.H, p.Hkv), kernels.PackThreads, kernels.PackSharedBytes)
	}
	add(kernels.BwdPreKernel, rowGrid, kernels.BwdPreThreads, 0)
	if v.DBiasPath == kernels.DBiasReduce { // batch element 0 stores its dS tiles into dBias, then the others add theirs
		for _, nb := range kernels.BwdDBiasReduceLaunches(p.B, p.H, int(params.BiasHeads)) {
			add(kernels.BwdDKDVKernel, [3]int{cdiv(p.M, t.DKDV.BlockN), nb, p.Hkv}, 32*t.DKDV.Warps, v.DKDVSharedBytes())
		}
	} else if v.Persistent { // one CTA per multiprocessor at most, each through its share of the key tiles
		add(kernels.BwdDKDVKernel, [3]int{kernels.PersistentGrid(cdiv(p.M, t.DKDV.BlockN)*p.B*p.Hkv, sms), 1, 1}, 32*t.DKDV.Warps, v.DKDVSharedBytes())
	} else {
		add(kernels.BwdDKDVKernel, [3]int{cdiv(p.M, t.DKDV.BlockN), p.B, p.Hkv}, 32*t.DKDV.Warps, v.DKDVSharedBytes())
	}
	if algo == DQAtomic {
		add(kernels.BwdDQConvertKernel, rowGrid, kernels.BwdPreThreads, 0)
	} else {
		add(kernels.BwdDQKernel, [3]int{cdiv(p.N, t.DQ.BlockM), p.B, p.H}, 32*t.DQ.Warps, v.DQSharedBytes())
	}
	// the non-finite fix-up (a flag test unless a main kernel raised it), before the dBias reduction
	add(kernels.BwdNonFiniteKernel, [3]int{kernels.BwdNonFiniteBlocks(p.B, p.N, p.M, p.H, p.Hkv, sms), 1, 1}, kernels.BwdNonFiniteThreads, 0)
	if dbias && params.DBiasElems > 0 && v.DBiasConverts() {
		blocks := min(int(cdiv64(params.DBiasElems, kernels.BwdDBiasThreads)), 8*max(sms, 1))
		add(kernels.BwdDBiasKernel, [3]int{blocks, 1, 1}, kernels.BwdDBiasThreads, 0)
	}
	return ls
}

// setParams sets the plan's kernel parameters from its problem, views and
// workspace, in the layouts of its variant: the tiled dQ accumulator's
// strides where the variant adds dQ into one (kernels.BwdVariant.DQAccTiled).
// Planning and bind both set them here, so that a plan bound to its
// workspace keeps the layouts its kernels were generated for.
func (pl *bwdPlan) setParams() {
	p := pl.r.p
	pl.params = bwdParams(p, &pl.r.a, pl.w)
	if pl.v.DQAccTiled() {
		sb, sh := kernels.BwdDQAccTiledStrides(p.N, p.H, kernels.BwdDQAccTiledCols(p.DK))
		pl.params.DQAccS = kernels.BwdStrides{Batch: sb, Head: sh}
	}
}

// bind points a plan made on a workspace at address 0 (the host path
// plans before it allocates) at the workspace at address ws: the kernel
// parameters and the tensor maps of the staging copies in it. The kernels
// stay those planned (a workspace is 256-byte aligned wherever it lies).
func (pl *bwdPlan) bind(ws uint64) {
	pl.r.a.Workspace = ws
	pl.setParams()
	if pl.v.TMA {
		pl.tma = pl.tmaTensors(pl.v)
	}
}

// tmaTensors returns the tensor maps' tensors of v (a tensor-map variant
// of the plan's kernels): q and dO of the dK/dV kernel, k and v of the dQ
// kernel, over every sequence's rows in a packed batch; then with
// BiasStaged the bias's, and where its dK/dV kernel hands dBias tiles by
// a tensor map (kernels.BwdVariant.DBiasByMap) dBias's.
func (pl *bwdPlan) tmaTensors(v kernels.BwdVariant) []kernels.TMATensor {
	dkdv, dq := v.TMATensors(&pl.params)
	if p := pl.r.p; p.Varlen {
		return []kernels.TMATensor{dkdv[0].Packed(p.TotalQ), dkdv[1].Packed(p.TotalQ), dq[0].Packed(p.TotalK), dq[1].Packed(p.TotalK)}
	}
	ts := []kernels.TMATensor{dkdv[0], dkdv[1], dq[0], dq[1]}
	if v.BiasStaged {
		ts = append(ts, v.BiasTMATensor(&pl.params))
	}
	if v.DBiasByMap() {
		ts = append(ts, v.DBiasTMATensor(&pl.params))
	}
	return ts
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

// tryVariant makes v (the plan's variant with one part more, on the same
// tensors) the plan's where it validates, and reports whether it did.
func (pl *bwdPlan) tryVariant(v kernels.BwdVariant) bool {
	if v.Validate() != nil {
		return false
	}
	pl.v = v
	return true
}

// tryTMA makes v (a tensor-map variant of the plan's kernels) the plan's
// where it validates and the encoder would take its four maps, and reports
// whether it did.
func (pl *bwdPlan) tryTMA(v kernels.BwdVariant) bool {
	ts := pl.tmaTensors(v)
	for _, t := range ts {
		if tensorMapSpec(t).Check() != nil {
			return false
		}
	}
	if !pl.tryVariant(v) {
		return false
	}
	pl.tma = ts
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

// kernelArgs returns the argument of each of the plan's kernel launches:
// BwdParams, or for the TMA dK/dV and dQ kernels the maps of pl.tma (maps,
// in that order: q and dO for the one, k and v for the other, then for
// both the bias's where the variant stages it and dBias's where it hands
// dBias tiles by a tensor map, or k's and v's again for a persistent
// dK/dV kernel) ahead of them.
func (pl *bwdPlan) kernelArgs(maps [][128]byte) func(kernel string) []byte {
	params := pl.params.Pack()
	if !pl.v.TMA {
		return func(string) []byte { return params }
	}
	extra := maps[4:] // the bias's (BiasStaged) and dBias's (DBiasByMap), which both kernels' arguments hold
	if pl.v.Persistent {
		extra = maps[2:4] // k's and v's, which the persistent dK/dV kernel loads
	}
	dkdv := kernels.BwdTMAArgs(params, append([][128]byte{maps[0], maps[1]}, extra...)...)
	dq := kernels.BwdTMAArgs(params, append([][128]byte{maps[2], maps[3]}, extra...)...)
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

func cdiv64(a, b int64) int64 { return (a + b - 1) / b }
