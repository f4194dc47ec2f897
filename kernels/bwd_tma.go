package kernels

// The tensor memory accelerator in the Hopper backward kernels
// (BwdVariant.TMA).
//
// Each kernel streams one pair of tiles per step: q and dO (BM = 64 rows)
// in the dK/dV kernel, k and v (BN rows) in the dQ kernel. With TMA one
// thread asks the accelerator for them as 64-column boxes landing in the
// 128-byte swizzle the warpgroup products read (as in the forward, tma.go),
// completing on the stage's mbarrier; the warps wait on the barrier's phase
// instead of on their own cp.async copies. The tiles loaded once per block
// (k and v in the dK/dV kernel; q, dO and the row statistics in the dQ
// kernel) and the per-step statistics stay on cp.async.
//
// The two kernels then take BwdTmaParams (BwdTMAArgs): the tensor maps of their two
// streamed tensors (and with a staged bias the bias's), then BwdParams. The other kernels of the module still
// take BwdParams.

// BwdTMAArgs returns the argument of a TMA dK/dV or dQ kernel launch: the
// tensor maps (dK/dV: q, dO; dQ: k, v; then, for a variant whose dK/dV
// kernel stages the bias, BwdVariant.BiasStaged, the bias's, and after it
// for DBiasStore and DBiasReduce dBias's, which both kernels take; for a
// Persistent variant k's and v's again, which its dK/dV kernel loads), then the bytes of
// BwdParams (BwdParams.Pack), the whole padded to 64 bytes as the C struct
// BwdTmaParams is. It takes two, three or four maps.
func BwdTMAArgs(params []byte, maps ...[128]byte) []byte {
	return bwdTMAStructs[len(maps)].Pack(&bwdTMAArgs{maps: maps, params: params})
}

// bwdTMAArgs holds the argument of a TMA dK/dV or dQ kernel.
type bwdTMAArgs struct {
	maps   [][128]byte
	params []byte // BwdParams.Pack
}

// bwdTMAStructs are the layouts of the C struct BwdTmaParams, by their
// number of tensor maps: the two streamed tensors' and, with a staged
// bias, the bias's.
var bwdTMAStructs = func() map[int]*CStruct[bwdTMAArgs] {
	m := func(i int) func(*bwdTMAArgs) *[128]byte { return func(x *bwdTMAArgs) *[128]byte { return &x.maps[i] } }
	params := CBlob("BwdParams", "p", "", bwdParamsStruct.Size(), 8, func(x *bwdTMAArgs, b []byte) { copy(b, x.params) })
	a := tensorMapField("a", "dK/dV kernel: q; dQ kernel: k", m(0))
	b := tensorMapField("b", "dK/dV kernel: dO; dQ kernel: v", m(1))
	c := tensorMapField("c", "BiasStaged: the bias (the dK/dV kernel's); Persistent: k (the dQ kernel's map)", m(2))
	d := tensorMapField("d", "DBiasStore, DBiasReduce: dBias (the dK/dV kernel's); Persistent: v (the dQ kernel's map)", m(3))
	two, three, four := NewCStruct("BwdTmaParams", 64, a, b, params), NewCStruct("BwdTmaParams", 64, a, b, c, params),
		NewCStruct("BwdTmaParams", 64, a, b, c, d, params)
	two.DocColumn, three.DocColumn, four.DocColumn = 13, 13, 13
	return map[int]*CStruct[bwdTMAArgs]{2: two, 3: three, 4: four}
}()

// DBiasTMATensor returns the tensor the dK/dV kernel of a DBiasStore or
// DBiasReduce variant stores or adds its dS tiles into, for a launch with
// params p: dBias, [bias batches, bias heads, N, M] of the bias's element
// type ([B, H, N, M] for DBiasStore), boxes of the step's BM rows and a
// warpgroup's 64 keys; DBiasReduce's map gives the accelerator that
// element type, in which it adds.
func (v BwdVariant) DBiasTMATensor(p *BwdParams) TMATensor {
	m, nm := int64(p.M), int64(p.N)*int64(p.M)
	t := biasTMATensor(p.DBias, p.N, p.M, p.BiasHeads, p.BiasBatches, [3]int64{m, nm, int64(p.BiasHeads) * nm}, v.ResolvedTiles().DKDV.BlockM)
	if v.DBiasPath == DBiasReduce {
		t.AddsIn, t.DType = true, v.Bias.DType()
	}
	return t
}

// BiasTMATensor returns the tensor the dK/dV kernel of a BiasStaged
// variant reads its bias tiles from, for a launch with params p
// (biasTMATensor), boxes of the step's BM rows.
func (v BwdVariant) BiasTMATensor(p *BwdParams) TMATensor {
	return biasTMATensor(p.Bias, p.N, p.M, p.H, p.B, [3]int64{p.BiasI, p.BiasH, p.BiasB}, v.ResolvedTiles().DKDV.BlockM)
}

// TMATensors returns the tensors the TMA kernels of v read with tensor
// maps, for a launch with params p: q and dO for the dK/dV kernel, k and v
// for the dQ kernel (the staging copies for Staged variants). A dimension
// of extent one gets a stride of 16 bytes (it is never stepped over);
// whether every other stride suits the accelerator is for the caller to
// check (package gpu checks each map's cuda.TensorMapSpec).
func (v BwdVariant) TMATensors(p *BwdParams) (dkdv, dq [2]TMATensor) {
	esz := v.elem()
	colsK, colsV := uint64(TMACols(v.DK)), uint64(TMACols(v.DV))
	q, do, k, vv := p.Q, p.DO, p.K, p.V
	qs, dos, ks, vs := p.QS, p.DOS, p.KS, p.VS
	if v.Staged {
		colsK, colsV = uint64(BwdStagedDim(v.DType, v.DK)), uint64(BwdStagedDim(v.DType, v.DV))
		q, do, k, vv = p.PQ, p.PDO, p.PK, p.PV
		qs, dos, ks, vs = p.PQS, p.PDOS, p.PKS, p.PVS
	}
	t := v.ResolvedTiles()
	mk := func(addr, cols uint64, rows, heads int32, s BwdStrides, box int) TMATensor {
		x := TMATensor{Addr: addr, Cols: cols, Rows: uint64(rows), Heads: uint64(heads), B: uint64(p.B), BoxRows: uint32(box)}
		x.Strides = [3]uint64{TMAStride(int(rows), s.Row, esz), TMAStride(int(heads), s.Head, esz), TMAStride(int(p.B), s.Batch, esz)}
		return x
	}
	dkdv = [2]TMATensor{mk(q, colsK, p.N, p.H, qs, t.DKDV.BlockM), mk(do, colsV, p.N, p.H, dos, t.DKDV.BlockM)}
	dq = [2]TMATensor{mk(k, colsK, p.M, p.Hkv, ks, t.DQ.BlockN), mk(vv, colsV, p.M, p.Hkv, vs, t.DQ.BlockN)}
	if v.Flat {
		dkdv = [2]TMATensor{dkdv[0].OverFlatRows(v.DK), dkdv[1].OverFlatRows(v.DV)}
		dq = [2]TMATensor{dq[0].OverFlatRows(v.DK), dq[1].OverFlatRows(v.DV)}
	}
	return dkdv, dq
}

// bwdTMADecl returns the C declaration of v's TMA kernels' argument (the
// accelerator's primitives, tmaPrimitives, go in the Hopper primitives).
func (v BwdVariant) bwdTMADecl() string {
	s := bwdTMAStructs[2]
	switch {
	case v.DBiasByMap(), v.Persistent:
		s = bwdTMAStructs[4]
	case v.BiasStaged:
		s = bwdTMAStructs[3]
	}
	return `// ---- the TMA kernels' argument: tensor maps of the two streamed tensors (dims: head dim, position,
// head, batch; encoded on the host), then the usual BwdParams
` + cTensorMap + s.Decl() + s.SizeAssert()
}
