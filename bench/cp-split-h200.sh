#!/usr/bin/env bash
# Measures the cost of splitting attention over P virtual ranks on one GPU,
# everything on the device (flashattn bench --cp-split): every rank's step
# calls and the kernels merging their partial results, back to back on one
# stream, against the single call, and the same split as the device ring
# runs it (each rank's calls on its compute stream while its communication
# stream copies the next K/V block; cp.DeviceRing), for P = 2, 4, 8,
# forward and backward:
#
#   long    B=1 H=16 N=100352 D=128 bf16, full and causal (zigzag)
#   flux    B=1 H=24 N=4608 D=128 bf16, full (one FLUX step's attention)
#
# First, when the test binaries are there, the GPU checks of the pieces it
# runs on: the merge kernels against the host merge's semantics, the split
# against the float64 oracle (and the single calls) on the accuracy table's
# cases, on one stream and as the device ring, the measurement's report;
# then (stage ring-check) the ordering-only events across streams, the
# device ring's API and Sim.OnDevice against the oracle.
#
# Build the binaries first where Go is (the GPU machine needs no Go toolchain):
#
#   CGO_ENABLED=0 go build -o .bin/flashattn ./cmd/flashattn
#   CGO_ENABLED=0 go test -c -o .bin/cp.test ./cp
#   CGO_ENABLED=0 go test -c -o .bin/gpu.test ./gpu
#   CGO_ENABLED=0 go test -c -o .bin/kernels.test ./kernels
#   CGO_ENABLED=0 go test -c -o .bin/cuda.test ./cuda
#
# then, on the GPU machine, from the repository root with .bin copied along:
#
#   bash bench/cp-split-h200.sh
#
# Output: $OUT/log.txt, every stage's output with times (a table per
# shape: P, pass, single call, step calls, merge kernels, total, ratio,
# parts (steps + merges timed apart, over the single call),
# the device ring's time and a rank's step); the summary prints last.
# Environment: STAGES (comma-separated: check, ring-check, long-full,
# long-causal, flux; default all), RANKS (2,4,8), PASS (fwdbwd), REPEATS
# (5), FLASHATTN_BIN (.bin/flashattn). A compile cache archive at
# .bin/cache.tgz (bench/check-h200.sh leaves one) is unpacked first.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/.cp-split-out}
BIN=${FLASHATTN_BIN:-$ROOT/.bin/flashattn}
STAGES=${STAGES:-check,ring-check,long-full,long-causal,flux}
RANKS=${RANKS:-2,4,8}
PASS=${PASS:-fwdbwd}
REPEATS=${REPEATS:-5}
LOG=$OUT/log.txt
mkdir -p "$OUT"
: >"$LOG"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
mkdir -p "$FLASHATTN_CACHE_DIR"
[ -f "$ROOT/.bin/cache.tgz" ] && tar -xzf "$ROOT/.bin/cache.tgz" -C "$FLASHATTN_CACHE_DIR"

T0=$(date +%s)
STAGE_FILTER=$STAGES
# shellcheck source=bench/stage.sh
. "$ROOT/bench/stage.sh"

# split NAME SECONDS FLAGS...: one shape, every P of RANKS, into the log.
split() {
	local name=$1 secs=$2
	shift 2
	stage "$name" "$secs" "$BIN" bench --backend cuda --dtype bf16 --batch 1 --head-dim 128 \
		--cp "$RANKS" --cp-split --pass "$PASS" --repeats "$REPEATS" "$@"
}

log "flashattn cost of splitting on one GPU"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader 2>&1 | tee -a "$LOG"
[ -x "$ROOT/.bin/kernels.test" ] && stage check 120 "$ROOT/.bin/kernels.test" -test.v -test.run 'TestCompileMerge'
[ -x "$ROOT/.bin/gpu.test" ] && stage check 300 "$ROOT/.bin/gpu.test" -test.v -test.run 'TestMergeOnDevice|TestDownload'
[ -x "$ROOT/.bin/cp.test" ] && stage check 540 "$ROOT/.bin/cp.test" -test.v -test.run 'TestDeviceSplitOnCUDA|TestMeasureDeviceSplit'
[ -x "$ROOT/.bin/cuda.test" ] && (cd "$ROOT/cuda" && stage ring-check 120 "$ROOT/.bin/cuda.test" -test.v -test.run 'TestEventNoTimingForkJoin')
[ -x "$ROOT/.bin/cp.test" ] && (cd "$ROOT/cp" && stage ring-check 540 "$ROOT/.bin/cp.test" -test.v -test.run 'TestDeviceRingAPI|TestSimOnDevice')
if [ -x "$BIN" ]; then
	split long-full 540 --heads 16 --seqlen-q 100352
	split long-causal 540 --heads 16 --seqlen-q 100352 --causal
	split flux 300 --heads 24 --seqlen-q 4608
else
	log "no flashattn binary at $BIN: build it with CGO_ENABLED=0 go build -o .bin/flashattn ./cmd/flashattn and copy .bin to the GPU machine"
fi
log "outputs: $(cd "$OUT" && ls | tr '\n' ' ')"
grep -E '^(--- FAIL|FAIL|ok|PASS)|^ *P pass|^ *[0-9]+ (fwd|bwd) |^case|^flashattn|== [a-z-]+: ' "$LOG" | cut -c1-300
exit 0
