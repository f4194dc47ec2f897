package gpu

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/flashattn/flashattn/attn"
	"github.com/flashattn/flashattn/cuda"
	"github.com/flashattn/flashattn/kernels"
)

// Backend is the CUDA attention backend. Its methods are safe for
// concurrent use.
type Backend struct {
	dev    *cuda.Device
	owns   bool         // Close closes dev
	stream *cuda.Stream // the host path's stream

	// Speculate lets the backend compile, on idle cores, the variants of
	// the same problem in the other element types when it compiles one.
	Speculate bool
	// Tiles chooses the tile of each kernel; nil means the tuning table
	// (kernels.TileForVariant). Benchmarks replace it to try other tiles.
	Tiles func(dt attn.DType, dk, dv int, narrow bool) (kernels.Tile, error)
	// WGMMA lets the forward and the backward run the Hopper kernels
	// (warpgroup products, compiled for sm_90a) wherever they apply (see
	// kernels.HopperTile and kernels.BwdHopperOK). New sets it on sm_90
	// devices when NVRTC can target sm_90a (12.0 or later) and EnvNoWGMMA
	// is unset; clearing it selects the mma.sync kernels.
	WGMMA bool
	// TMA lets the Hopper kernels of both passes load their tiles with the
	// tensor memory accelerator (kernels.Variant.TMA, kernels.BwdVariant.TMA)
	// where the tensors allow it (16-byte aligned rows and strides, not
	// packed variable-length batches). New sets it with WGMMA unless
	// EnvNoTMA is set; clearing it keeps the per-thread copies.
	TMA bool
	// Pipeline is the pipeline the Hopper forward runs on wherever the
	// variant allows it (kernels.Pipeline; each part is dropped where it
	// does not apply: warp specialization needs tensor-map loads and one
	// warpgroup per row group, ping-pong two compute warpgroups; the tiles
	// and the classes that keep the lockstep kernels are
	// kernels.HopperWSTable's). New reads it from EnvPipeline:
	// DefaultPipeline unless the variable names another; the zero value is
	// the lockstep pipeline.
	Pipeline kernels.Pipeline
	// ShortPipeline, when not nil, is the pipeline of Hopper forward calls
	// with at most ShortKeys keys (causal: ShortCausalKeys) or a window of
	// both sides bounded that spans at most ShortWindowKeys+1 keys, in
	// place of Pipeline. New sets it to
	// DefaultShortPipeline when EnvPipeline is empty, and leaves it nil
	// when the variable names a pipeline (that pipeline then serves every
	// call).
	ShortPipeline *kernels.Pipeline
	// EarlyDropoutAuto adds the early dropout bits
	// (kernels.Pipeline.EarlyDropout) to Pipeline for calls under dropout
	// where they measured faster: head dims 96–128 (their larger). New sets
	// it when EnvPipeline is empty (a named pipeline serves every call as
	// named).
	EarlyDropoutAuto bool
	// LazyRescale adds the lazy rescale (kernels.Pipeline.LazyRescale) to
	// every Hopper forward pipeline, the short one too, where the variant
	// allows it. New sets it on Hopper unless EnvFwdLazyRescale is "0".
	LazyRescale bool
	// FwdHeadMajor adds the head-major tile order
	// (kernels.Pipeline.HeadMajor) to the persistent forward launches;
	// FwdHeadMajorAuto to those of at most HeadMajorQueries queries, where
	// it measured faster than the L2 sections. New sets FwdHeadMajor when
	// EnvFwdHeadMajor is set, FwdHeadMajorAuto on Hopper unless it is "0".
	FwdHeadMajor, FwdHeadMajorAuto bool
	// FwdProducerDropout has the producer warpgroup's idle warps draw the
	// dropout keep bits (kernels.Pipeline.ProducerDropout) in every Hopper
	// forward launch under dropout whose variant allows them, in place of
	// the early bits. New sets it when EnvFwdProducerDropout is set.
	FwdProducerDropout bool
	// FwdDoubleQ gives the persistent forward launches two Q buffers
	// (kernels.Pipeline.DoubleQ) wherever their variant allows them, so
	// that the next tile's loads start a tile earlier. New sets it on
	// Hopper unless EnvFwdDoubleQ is "0".
	FwdDoubleQ bool
	// FwdCarryTurns carries ping-pong's turns across the tiles of the
	// persistent forward launches (kernels.Pipeline.CarryTurns), so that
	// one warpgroup starts a tile while the other writes the last one's O.
	// New sets it on Hopper unless EnvFwdCarryTurns is "0".
	FwdCarryTurns bool
	// FwdNarrowDoubleQ gives the persistent forward launches whose two Q
	// buffers do not fit beside their key blocks (head dims 129–256) key
	// blocks of NarrowDoubleQKeys, which leave room for them, in place of
	// one Q buffer and O's staging tile. New sets it when
	// EnvFwdNarrowDoubleQ is set.
	FwdNarrowDoubleQ bool
	// FwdPolyExp is how many of every four key groups of the Hopper
	// forward's softmax take their exponentials from a polynomial on the
	// FMA pipes instead of the MUFU (kernels.Pipeline.PolyExp; 0: none),
	// wherever the variant allows it. New reads it from EnvFwdPolyExp.
	FwdPolyExp int
	// DQ is the dQ algorithm of backward calls that leave the choice to the
	// backend (BackwardOptions.DQ = DQAuto, and host-tensor calls); DQAuto,
	// the default, picks by the measured table. Deterministic calls always
	// take DQSeparate. New reads it from EnvDQ.
	DQ DQAlgorithm
	// BulkDQ lets the Hopper backward with the atomic dQ add each step's
	// dQ tile with bulk reduce-adds from shared memory instead of vector
	// atomics from registers, wherever the variant allows it
	// (kernels.BwdVariant.BulkDQ). New sets it when EnvBulkDQ is set.
	BulkDQ bool
	// BwdPipeline is the pipeline of the Hopper backward's dK/dV and dQ
	// kernels wherever the variant allows it (tensor-map loads) and it did
	// not measure slower (head dims up to 32 without a mask keep lockstep):
	// the lockstep pipeline (the zero value) or warp specialization
	// (WarpSpecialized; kernels.BwdVariant.WarpSpecialized). Its other
	// parts do not apply to the backward. New reads it from EnvBwdPipeline:
	// DefaultBwdPipeline unless the variable names another.
	BwdPipeline kernels.Pipeline
	// BwdKeyRows lets the warp-specialized Hopper dK/dV kernel compute S
	// and dP with keys as rows wherever the variant allows it
	// (kernels.BwdVariant.KeyRows, kernels.KeyRowsOK: head dims up to
	// 128). New sets it when EnvBwdKeyRows is set.
	BwdKeyRows bool
	// BwdKeyRowsAuto runs that key-rows step, with the atomic dQ added by
	// bulk reduce-adds, on the problems where it measured faster than the
	// table's choice (keyRowsFaster: head dims 65–128, and 49–64 on steps
	// of 128 queries, at least 512 queries without a mask or window and
	// 1024 with one, fixed length, no dropout), for calls that leave the
	// dQ algorithm to the backend (DQAuto) or ask for DQAtomic and are not
	// deterministic.
	// New sets it unless EnvBwdKeyRows is "0".
	BwdKeyRowsAuto bool
	// BiasStaged stages a 16-bit bias through shared memory where the
	// bias's layout allows tensor-map loads: the warp-specialized Hopper
	// forward's producer loads each key block's tile after its K tile
	// (kernels.Variant.BiasStaged), the backward key-rows step's producer
	// each step's tile beside q and dO (kernels.BwdVariant.BiasStaged).
	// New sets it when EnvBiasStaged is set.
	BiasStaged bool
	// BiasStagedAuto stages the bias where that measured faster than loads
	// from global memory: in the forward wherever the tiles fit beside the
	// pipeline's others (BiasStaged also gives up the store of O by a
	// tensor map for them), in the backward wherever the variant allows it.
	// New sets it unless EnvBiasStaged is "0".
	BiasStagedAuto bool
	// DBiasAtomic has backward calls that compute the gradient of a bias
	// broadcast over the batch add each batch element's dS into an fp32
	// accumulator of dBias's shape by atomic adds, where the dK/dV kernel
	// otherwise stores one dS per batch element for a reduction in a fixed
	// order (kernels.DBiasAtomic); deterministic calls keep the
	// reduction. New sets it when EnvDBiasAtomic is set.
	DBiasAtomic bool
	// DBiasAtomicAuto adds it so where that measured faster: head dims
	// (their larger) above 64. New sets it unless EnvDBiasAtomic is "0".
	DBiasAtomicAuto bool
	// DBiasDirect has backward calls that compute the gradient of a bias
	// of every batch element and head store it from the dK/dV kernel into
	// dBias, where the kernel otherwise stores fp32 dS for a reduction that
	// converts it (kernels.DBiasDirect). New sets it unless EnvDBiasDirect
	// is "0".
	DBiasDirect bool
	// DBiasTiles has the dK/dV kernels that would add a bias's gradient by
	// atomic adds (DBiasAtomic, DBiasAtomicAuto) add it instead as one tile
	// a warpgroup and step by a bulk reduce-add into a tiled accumulator,
	// where the variant allows it (kernels.DBiasTiles,
	// kernels.DBiasTilesOK). New sets it unless EnvDBiasTiles is "0".
	DBiasTiles bool
	// DBiasStore has the dK/dV kernels that would store a bias's gradient
	// element by element (DBiasDirect) store each warpgroup's dS tile into
	// it by a tensor map instead, where the variant and dBias's layout
	// allow it (kernels.DBiasStore, kernels.DBiasStoreOK). New sets it
	// unless EnvDBiasStore is "0".
	DBiasStore bool
	// DBiasReduce has the dK/dV kernels that would add a bias's gradient
	// into an fp32 accumulator (DBiasAtomic, DBiasTiles) add each
	// warpgroup's dS tile into dBias itself instead, by a tensor-map
	// reduce-add in dBias's element type (batch element 0's stored by a
	// launch of its own where dBias has a plane a head), where the variant and dBias's
	// layout allow it (kernels.DBiasReduce, kernels.DBiasReduceOK). New sets
	// it unless EnvDBiasReduce is "0".
	DBiasReduce bool
	// FwdLightTail has masked forward launches of one tile a CTA end on
	// their lightest query blocks (kernels.Variant.LightTail). New sets it
	// when EnvFwdLightTail is set.
	FwdLightTail bool
	// HostRegister has the host path page-lock the Go memory of its inputs
	// and outputs while they are copied (cuda.Device.RegisterHost) and copy
	// it in place, instead of through pinned staging slots. New sets it
	// when EnvHostRegister is set.
	HostRegister bool
	// BwdLightTail has masked backward launches end on their lightest
	// blocks (kernels.BwdVariant.LightTail). New sets it on Hopper unless
	// EnvBwdLightTail is "0".
	BwdLightTail bool
	// BwdPersistent launches the key-rows dK/dV kernel persistent, one
	// CTA per multiprocessor working through the key tiles, where the
	// variant allows it (kernels.BwdVariant.Persistent,
	// kernels.PersistentOK). New sets it on Hopper when EnvBwdPersistent is
	// set.
	BwdPersistent bool
	// BwdProducerDropout has the producer warpgroup's idle warps of the
	// key-rows dK/dV kernel draw the dropout keep bits where the variant
	// allows it (kernels.BwdVariant.ProducerDropout). New sets it on Hopper
	// when EnvBwdProducerDropout is set.
	BwdProducerDropout bool
	// BwdQueryStep, when not zero, is the number of queries a step of the
	// key-rows dK/dV kernel takes where the variant allows it
	// (kernels.BwdVariant.QueryStep, kernels.QueryStepOK: 80 with the
	// separate dQ or the atomic one by bulk reduce-adds, 128 at padded head
	// dims up to 64); zero keeps 64.
	// New reads it from EnvBwdQueryStep.
	BwdQueryStep int
	// BwdDeep lets the backward run the Hopper kernels past head dim 256
	// (kernels.BwdHopperDeep) where WGMMA allows the Hopper kernels;
	// otherwise the mma.sync kernels serve those head dims. New sets it
	// unless EnvBwdDeep is "0".
	BwdDeep bool

	fill    filler      // the random-fill kernel
	modules moduleCache // every other kernel: forward and backward variants, the pack kernel

	pool   *memPool   // the host path's device buffers, kept between calls
	hostMu sync.Mutex // serializes host-path calls, which share copier
	copier hostCopier // the host path's pinned staging and the live pins (Pin)

	trace       atomic.Pointer[HostTrace] // where host-path calls record their breakdown (SetHostTrace)
	traceEvents []*cuda.Event             // the events of traced calls, reused (under hostMu)

	mu      sync.Mutex     // guards pbuf, tmaps and bwdMaps
	pbuf    []byte         // packed forward kernel argument, reused by every launch
	tmaps   tensorMapCache // the tensor maps of the last TMA forward
	bwdMaps tensorMapCache // the tensor maps of the last TMA backward
	sem     chan struct{}  // slots for background compilations

	nf nfArena // the forward's non-finite flags, one per stream (fwd_nonfinite.go)
}

// Open opens the first CUDA device and returns a backend on it. Errors wrap
// cuda.ErrNoDriver or cuda.ErrNoDevice when there is no usable GPU.
func Open() (*Backend, error) {
	dev, err := cuda.Open(0)
	if err != nil {
		return nil, fmt.Errorf("gpu: %w", err)
	}
	b, err := New(dev)
	if err != nil {
		dev.Close()
		return nil, err
	}
	b.owns = true
	return b, nil
}

// New returns a backend on an open device; Close leaves the device open.
// It reads the environment (EnvNoWGMMA, EnvNoTMA, EnvPipeline,
// EnvBwdPipeline, EnvBulkDQ, EnvBwdKeyRows, EnvBwdQueryStep, EnvBwdDeep,
// EnvDQ, EnvBiasStaged, EnvDBiasAtomic, EnvDBiasDirect, EnvDBiasTiles,
// EnvDBiasStore, EnvDBiasReduce, EnvFwdLightTail, EnvBwdLightTail,
// EnvHostRegister) once, into the knobs WGMMA, TMA, Pipeline, BwdPipeline,
// BulkDQ, BwdKeyRows, BwdKeyRowsAuto, BwdQueryStep, BwdDeep, DQ,
// BiasStaged, BiasStagedAuto, DBiasAtomic, DBiasAtomicAuto, DBiasDirect,
// DBiasTiles, DBiasStore, DBiasReduce, FwdLightTail, BwdLightTail and
// HostRegister.
func New(dev *cuda.Device) (*Backend, error) {
	b, err := envKnobs(hopperCapable(dev))
	if err != nil {
		return nil, err
	}
	s, err := dev.NewStream()
	if err != nil {
		return nil, fmt.Errorf("gpu: %w", err)
	}
	b.dev, b.stream, b.pool, b.copier = dev, s, newMemPool(dev), hostCopier{dev: dev}
	b.pbuf = make([]byte, kernels.Variant{Flat: true, FlatStaged: true}.TMAParamsSize()) // the largest argument
	b.sem = make(chan struct{}, max(1, min(16, runtime.NumCPU()-1)))
	if err := b.nf.init(dev); err != nil {
		s.Close()
		return nil, fmt.Errorf("gpu: non-finite flags: %w", err)
	}
	return b, nil
}

// envKnobs returns a backend with no device whose knobs are those New
// sets, from the environment of the moment, for a device that is (hopper)
// or is not Hopper-capable.
func envKnobs(hopper bool) (*Backend, error) {
	b := &Backend{
		Speculate:  true,
		WGMMA:      hopper,
		BulkDQ:     hopper && envSet(os.Getenv(EnvBulkDQ)),
		BwdKeyRows: hopper && envSet(os.Getenv(EnvBwdKeyRows)),

		BwdKeyRowsAuto: hopper && os.Getenv(EnvBwdKeyRows) != "0",
		BiasStaged:     hopper && envSet(os.Getenv(EnvBiasStaged)),
		BiasStagedAuto: hopper && os.Getenv(EnvBiasStaged) != "0",
		FwdLightTail:   envSet(os.Getenv(EnvFwdLightTail)),
		LazyRescale:    hopper && os.Getenv(EnvFwdLazyRescale) != "0",
		FwdHeadMajor:   hopper && envSet(os.Getenv(EnvFwdHeadMajor)),

		FwdProducerDropout: hopper && envSet(os.Getenv(EnvFwdProducerDropout)),
		FwdDoubleQ:         hopper && os.Getenv(EnvFwdDoubleQ) != "0",
		FwdCarryTurns:      hopper && os.Getenv(EnvFwdCarryTurns) != "0",
		FwdNarrowDoubleQ:   hopper && envSet(os.Getenv(EnvFwdNarrowDoubleQ)),

		FwdHeadMajorAuto: hopper && os.Getenv(EnvFwdHeadMajor) != "0",
		BwdLightTail:     hopper && os.Getenv(EnvBwdLightTail) != "0",
		BwdPersistent:    hopper && envSet(os.Getenv(EnvBwdPersistent)),

		BwdProducerDropout: hopper && envSet(os.Getenv(EnvBwdProducerDropout)),
		HostRegister:       envSet(os.Getenv(EnvHostRegister)),
		BwdDeep:            hopper && envBwdDeep(),
		TMA:                hopper && !envSet(os.Getenv(EnvNoTMA)),
	}
	b.readDBiasEnv()
	var err error
	if b.BwdQueryStep, err = parseQueryStep(os.Getenv(EnvBwdQueryStep)); err != nil {
		return nil, fmt.Errorf("gpu: %s: %w", EnvBwdQueryStep, err)
	}
	if b.FwdPolyExp, err = parsePolyExp(os.Getenv(EnvFwdPolyExp)); err != nil {
		return nil, fmt.Errorf("gpu: %s: %w", EnvFwdPolyExp, err)
	}
	if !hopper {
		b.FwdPolyExp = 0
	}
	if b.DQ, err = ParseDQAlgorithm(os.Getenv(EnvDQ)); err != nil {
		return nil, fmt.Errorf("gpu: %s: %w", EnvDQ, err)
	}
	if hopper {
		named := os.Getenv(EnvPipeline)
		if b.Pipeline, err = parsePipeline(named); err != nil {
			return nil, fmt.Errorf("gpu: %s: %w", EnvPipeline, err)
		}
		if named == "" {
			short := DefaultShortPipeline
			b.ShortPipeline, b.EarlyDropoutAuto = &short, true
		}
		if b.BwdPipeline, err = parseBwdPipeline(os.Getenv(EnvBwdPipeline)); err != nil {
			return nil, fmt.Errorf("gpu: %s: %w", EnvBwdPipeline, err)
		}
	}
	return b, nil
}

// Close releases the backend's stream, cached device memory, pinned
// staging and pins (Pin) and, when Open created the device, the device with
// every kernel and buffer on it.
func (b *Backend) Close() error {
	b.hostMu.Lock()
	var err error
	for len(b.copier.pins) > 0 {
		if e := b.copier.pins[0].unpinLocked(); err == nil {
			err = e
		}
	}
	b.copier.close()
	for _, e := range b.traceEvents {
		_ = e.Close()
	}
	b.traceEvents = nil
	b.hostMu.Unlock()
	b.pool.trim()
	b.nf.free()
	if e := b.stream.Close(); err == nil {
		err = e
	}
	if b.owns {
		if e := b.dev.Close(); err == nil {
			err = e
		}
	}
	return err
}

// Device returns the backend's device.
func (b *Backend) Device() *cuda.Device { return b.dev }

// Name returns "cuda".
func (b *Backend) Name() string { return "cuda" }

// EnvNoTMA, when set to anything but "" or "0", keeps the Hopper kernels
// of new backends on per-thread tile copies (Backend.TMA).
const EnvNoTMA = "FLASHATTN_NO_TMA"

// EnvDQ names the dQ algorithm of new backends' backward calls that leave
// the choice to the backend (Backend.DQ): auto, atomic or separate.
const EnvDQ = "FLASHATTN_DQ"

// EnvBulkDQ, when set to anything but "" or "0", lets the Hopper backward
// of new backends add the atomic dQ with bulk reduce-adds (Backend.BulkDQ).
const EnvBulkDQ = "FLASHATTN_BULK_DQ"

// EnvBwdKeyRows, when set to anything but "" or "0", lets the
// warp-specialized Hopper dK/dV kernel of new backends compute S and dP
// with keys as rows wherever it can (Backend.BwdKeyRows); unset, only where
// it measured faster (Backend.BwdKeyRowsAuto); "0", nowhere.
const EnvBwdKeyRows = "FLASHATTN_BWD_KEY_ROWS"

// EnvBiasStaged, when set to anything but "" or "0", lets the Hopper
// forward and backward of new backends stage a bias through shared memory
// wherever they can (Backend.BiasStaged); unset, only where it measured
// faster (Backend.BiasStagedAuto); "0", nowhere.
const EnvBiasStaged = "FLASHATTN_BIAS_STAGED"

// EnvDBiasAtomic, when set to anything but "" or "0", has the backward of
// new backends add a batch-broadcast bias's gradient by atomic adds
// wherever the call allows it (Backend.DBiasAtomic); unset, where it
// measured faster (Backend.DBiasAtomicAuto); "0", nowhere.
const EnvDBiasAtomic = "FLASHATTN_DBIAS_ATOMIC"

// EnvDBiasDirect, unless "0", has the backward of new backends store the
// gradient of a bias of every batch element and head directly
// (Backend.DBiasDirect).
const EnvDBiasDirect = "FLASHATTN_DBIAS_DIRECT"

// EnvDBiasTiles, unless "0", has the backward of new backends add a
// bias's gradient by tiles where it would add it by atomic adds and the
// variant allows it (Backend.DBiasTiles).
const EnvDBiasTiles = "FLASHATTN_DBIAS_TILES"

// EnvDBiasStore, unless "0", has the backward of new backends store a
// bias's gradient by tensor maps wherever they would store it element by
// element and the variant allows it (Backend.DBiasStore).
const EnvDBiasStore = "FLASHATTN_DBIAS_STORE"

// EnvDBiasReduce, unless "0", has the backward of new backends add a
// bias's gradient by tensor-map reduce-adds into dBias wherever they would
// add it into an fp32 accumulator and the variant allows it
// (Backend.DBiasReduce).
const EnvDBiasReduce = "FLASHATTN_DBIAS_REDUCE"

// readDBiasEnv sets the dBias paths' knobs (DBiasAtomic, DBiasAtomicAuto,
// DBiasDirect, DBiasTiles, DBiasStore, DBiasReduce) as EnvDBiasAtomic,
// EnvDBiasDirect, EnvDBiasTiles, EnvDBiasStore and EnvDBiasReduce ask.
func (b *Backend) readDBiasEnv() {
	b.DBiasAtomic = envSet(os.Getenv(EnvDBiasAtomic))
	b.DBiasAtomicAuto = os.Getenv(EnvDBiasAtomic) != "0"
	b.DBiasDirect = os.Getenv(EnvDBiasDirect) != "0"
	b.DBiasTiles = os.Getenv(EnvDBiasTiles) != "0"
	b.DBiasStore = os.Getenv(EnvDBiasStore) != "0"
	b.DBiasReduce = os.Getenv(EnvDBiasReduce) != "0"
}

// EnvFwdLightTail, when set to anything but "" or "0", has the masked
// forward launches of new backends that take one tile a CTA end on their
// lightest query blocks (Backend.FwdLightTail).
const EnvFwdLightTail = "FLASHATTN_FWD_LIGHT_TAIL"

// EnvFwdLazyRescale, when "0", has the Hopper forward of new backends
// rescale O whenever a row's maximum moves instead of keeping each row's
// reference maximum until a key block passes it by more than 2^8
// (Backend.LazyRescale, the default on Hopper).
const EnvFwdLazyRescale = "FLASHATTN_FWD_LAZY_RESCALE"

// EnvFwdHeadMajor, when set to anything but "" or "0", has the persistent
// forward launches of new backends number their tiles head by head
// (Backend.FwdHeadMajor); when "0", in L2 sections at every length
// (Backend.FwdHeadMajorAuto off).
const EnvFwdHeadMajor = "FLASHATTN_FWD_HEAD_MAJOR"

// EnvFwdProducerDropout, when set to anything but "" or "0", has the Hopper
// forward of new backends draw the dropout keep bits in the producer
// warpgroup's idle warps (Backend.FwdProducerDropout).
const EnvFwdProducerDropout = "FLASHATTN_FWD_PRODUCER_DROPOUT"

// EnvFwdDoubleQ, when "0", keeps the persistent forward launches of new
// backends on one Q buffer instead of two (Backend.FwdDoubleQ, the default
// on Hopper).
const EnvFwdDoubleQ = "FLASHATTN_FWD_DOUBLE_Q"

// EnvFwdCarryTurns, when "0", has new backends restart ping-pong's turns
// at every tile of persistent forward launches instead of carrying them
// across the tiles (Backend.FwdCarryTurns, the default on Hopper).
const EnvFwdCarryTurns = "FLASHATTN_FWD_CARRY_TURNS"

// EnvHostRegister, when set to anything but "" or "0", has the host path of
// new backends page-lock the caller's memory and copy it in place
// (Backend.HostRegister).
const EnvHostRegister = "FLASHATTN_HOST_REGISTER"

// EnvBwdLightTail, when "0", keeps the masked backward launches of new
// backends in their grid's order instead of ending on their lightest blocks
// (Backend.BwdLightTail, the default on Hopper).
const EnvBwdLightTail = "FLASHATTN_BWD_LIGHT_TAIL"

// EnvBwdPersistent, when set to anything but "" or "0", has new backends
// on Hopper launch the key-rows dK/dV kernel persistent
// (Backend.BwdPersistent).
const EnvBwdPersistent = "FLASHATTN_BWD_PERSISTENT"

// EnvBwdProducerDropout, when set to anything but "" or "0", has new
// backends draw the backward's dropout keep bits in the producer
// warpgroup's idle warps (Backend.BwdProducerDropout).
const EnvBwdProducerDropout = "FLASHATTN_BWD_PRODUCER_DROPOUT"

// EnvLineInfo, when set to anything but "" or "0", compiles the kernels
// with source line information (NVRTC's -lineinfo), so that
// compute-sanitizer and Nsight Compute name the generated source's lines;
// the code is the same, the cache keeps the two apart.
const EnvLineInfo = "FLASHATTN_LINEINFO"

// EnvBwdQueryStep names the queries a step of the key-rows dK/dV kernel of
// new backends takes where the variant allows it (Backend.BwdQueryStep):
// unset or 64 for the variant's own, 80, or 128. The key-rows step the
// backend takes on its own (Backend.BwdKeyRowsAuto) takes 128 queries at
// head dims 49–64 whatever it names.
const EnvBwdQueryStep = "FLASHATTN_BWD_QUERY_STEP"

// parseQueryStep returns the Backend.BwdQueryStep that s (EnvBwdQueryStep's
// value) names: 0 for "" or "64", 80 for "80", 128 for "128"; anything
// else is an error wrapping attn.ErrOption.
func parseQueryStep(s string) (int, error) {
	switch strings.TrimSpace(s) {
	case "", "64":
		return 0, nil
	case "80":
		return 80, nil
	case "128":
		return 128, nil
	}
	return 0, attn.Errorf(attn.ErrOption, "query step %q: want 64, 80 or 128", s)
}

// EnvFwdNarrowDoubleQ, when set to anything but "" or "0", has the
// persistent forward launches of new backends take narrower key blocks
// where that makes room for two Q buffers (Backend.FwdNarrowDoubleQ).
const EnvFwdNarrowDoubleQ = "FLASHATTN_FWD_NARROW_DOUBLE_Q"

// EnvFwdPolyExp, an integer 0–4, is how many of every four key groups
// of the Hopper forward's softmax take their exponentials from a
// polynomial instead of the MUFU in new backends (Backend.FwdPolyExp;
// unset: 0).
const EnvFwdPolyExp = "FLASHATTN_FWD_POLY_EXP"

// parsePolyExp reads EnvFwdPolyExp: "" is 0.
func parsePolyExp(s string) (int, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 || n > 4 {
		return 0, attn.Errorf(attn.ErrOption, "polynomial exponentials %q: want 0 to 4 key groups of every four", s)
	}
	return n, nil
}

// EnvBwdDeep, when "0", keeps the backward of new backends off the Hopper
// kernels past head dim 256 (Backend.BwdDeep), on the mma.sync kernels.
const EnvBwdDeep = "FLASHATTN_BWD_DEEP"

// envBwdDeep reports whether EnvBwdDeep lets new backends run the Hopper
// backward past head dim 256: unless it is "0".
func envBwdDeep() bool { return os.Getenv(EnvBwdDeep) != "0" }

// EnvPipeline names the pipeline of the Hopper forward of new backends
// (Backend.Pipeline) in kernels.ParsePipeline's words, e.g.
// "ws,pingpong,early-rescale" or "lockstep"; empty (or unset) means
// DefaultPipeline.
const EnvPipeline = "FLASHATTN_FWD_PIPELINE"

// DefaultPipeline is the pipeline of the Hopper forward of new backends
// when EnvPipeline is empty: warp specialization with ping-pong and the
// early rescale (persistent CTAs and the O store by tensor maps stay
// opt-in).
var DefaultPipeline = kernels.Pipeline{WarpSpecialized: true, PingPong: true, EarlyRescale: true}

// DefaultShortPipeline is the pipeline of the Hopper forward of new
// backends, when EnvPipeline is empty, for calls with at most ShortKeys
// keys (plain calls: ShortPlainKeys; causal: ShortCausalKeys) or a window
// of at most ShortWindowKeys+1 keys a row: DefaultPipeline with persistent CTAs and
// the O store by tensor maps, whose epilogue and tile changes weigh most
// where each tile has few key blocks (docs/kernels/forward.md).
var DefaultShortPipeline = func() kernels.Pipeline {
	p := DefaultPipeline
	p.Persistent, p.StoreO = true, true
	return p
}()

// ShortKeys is the largest key length of the forward calls that take
// Backend.ShortPipeline, ShortPlainKeys that of calls without a mask or
// per-element extras (softcap, dropout) at head dims up to ShortPlainDim
// (their larger), and ShortCausalKeys that of causal calls;
// ShortWindowKeys is the largest Left+Right of a window (both sides
// bounded) whose calls take it whatever their length.
const (
	ShortKeys       = 512
	ShortPlainKeys  = 2048
	ShortPlainDim   = 128
	ShortCausalKeys = 4096
	ShortWindowKeys = 2048
)

// parsePipeline reads a forward pipeline in kernels.ParsePipeline's words
// ("" is DefaultPipeline).
func parsePipeline(s string) (kernels.Pipeline, error) {
	if s == "" {
		return DefaultPipeline, nil
	}
	return kernels.ParsePipeline(s)
}

// EnvBwdPipeline names the pipeline of the Hopper backward of new
// backends (Backend.BwdPipeline): "lockstep" or "ws"; empty (or unset)
// means DefaultBwdPipeline.
const EnvBwdPipeline = "FLASHATTN_BWD_PIPELINE"

// DefaultBwdPipeline is the pipeline of the Hopper backward of new
// backends when EnvBwdPipeline is empty: warp specialization.
var DefaultBwdPipeline = kernels.Pipeline{WarpSpecialized: true}

// parseBwdPipeline reads a backward pipeline in kernels.ParsePipeline's
// words, of which the backward takes lockstep and ws ("" is
// DefaultBwdPipeline); the others give an error wrapping attn.ErrOption.
func parseBwdPipeline(s string) (kernels.Pipeline, error) {
	if s == "" {
		return DefaultBwdPipeline, nil
	}
	pl, err := kernels.ParsePipeline(s)
	if err != nil {
		return kernels.Pipeline{}, err
	}
	if pl != (kernels.Pipeline{WarpSpecialized: pl.WarpSpecialized}) {
		return kernels.Pipeline{}, attn.Errorf(attn.ErrOption, "gpu: backward pipeline %q: the backward takes lockstep or ws", s)
	}
	return pl, nil
}

// envSet reports whether an opt-in or opt-out variable's value is set:
// anything but "" or "0".
func envSet(value string) bool { return value != "" && value != "0" }

// EnvNoWGMMA, when set to anything but "" or "0", keeps new backends off the
// Hopper (WGMMA) kernels (Backend.WGMMA).
const EnvNoWGMMA = "FLASHATTN_NO_WGMMA"

// hopperCapable reports whether the Hopper kernels can run on dev: an sm_90
// device, an NVRTC that targets sm_90a, and no EnvNoWGMMA.
func hopperCapable(dev *cuda.Device) bool {
	major, minor := dev.ComputeCapability()
	nvrtc := 0
	if c, err := cuda.NewCompiler(); err == nil {
		nvrtc, _ = c.Version()
	}
	return hopperAllowed(major, minor, nvrtc, os.Getenv(EnvNoWGMMA))
}

// hopperAllowed is the rule of hopperCapable: compute capability 9.0 exactly
// (sm_90a code runs nowhere else), NVRTC 12 or later (0: none loaded), and
// the opt-out variable empty or "0".
func hopperAllowed(major, minor, nvrtcMajor int, noWGMMA string) bool {
	if envSet(noWGMMA) {
		return false
	}
	return major == 9 && minor == 0 && nvrtcMajor >= 12
}

// callCounts counts the validations and the plans of the calls made while
// a test holds it in callCounter (nil otherwise): every entry validates
// its call once and plans it once.
type callCounts struct{ validations, plans atomic.Int64 }

// callCounter is the counts of the test that set it.
var callCounter atomic.Pointer[callCounts]

// countValidation counts one validation of a call's arguments.
func countValidation() {
	if c := callCounter.Load(); c != nil {
		c.validations.Add(1)
	}
}

// countPlan counts one plan of a call's launches.
func countPlan() {
	if c := callCounter.Load(); c != nil {
		c.plans.Add(1)
	}
}
