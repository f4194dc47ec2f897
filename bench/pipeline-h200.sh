#!/usr/bin/env bash
# Checks and times the Hopper kernels' pipeline choices on a GPU machine: for
# each forward pipeline (kernels.Pipeline, FLASHATTN_FWD_PIPELINE), the GPU
# correctness tests with the backend set to it, then `flashattn bench --pass
# fwd` over the main training shapes, the pipelines alternating within each
# shape and each shape timed ROUNDS times, so that clock drift falls on all
# of them alike; for the backward, the gradient tests with the atomic dQ by
# bulk reduce-adds (FLASHATTN_BULK_DQ=1, FLASHATTN_DQ=atomic), then `flashattn
# bench --pass bwd` with the separate dQ, the atomic dQ by vector atomics and
# by bulk reduce-adds, each on the lockstep and the warp-specialized backward
# (FLASHATTN_BWD_PIPELINE=ws), alternating the same way. Summary tables (median ms,
# TFLOP/s, ratio to the first choice) print last.
#
# Build the binaries first where Go is (the GPU machine needs no Go toolchain):
#
#   CGO_ENABLED=0 go test -c -o .bin/gpu.test ./gpu
#   CGO_ENABLED=0 go build -o .bin/flashattn ./cmd/flashattn
#   CGO_ENABLED=0 go build -o .bin/benchfwd ./gpu/internal/benchfwd   (tiles)
#
# then, on the GPU machine, from the repository root with .bin copied along:
#
#   bash bench/pipeline-h200.sh
#
# To compare the winner with PyTorch's backends in the same run, give it to
# the whole comparison: FLASHATTN_FWD_PIPELINE=<words> bash bench/run-h200.sh.
#
# Environment: PIPELINES (space-separated lists of kernels.ParsePipeline's
# words, timed; default lockstep, then ws, pingpong, early-rescale,
# persistent and tma-store added one at a time, and tma-store and
# early-rescale alone), CHECK_PIPELINES (those the check step tests under;
# default three that together hold every part), SHAPES (space-separated
# B:H:N:D[:causal or -[:L,R, a window]]; default D = 128 at N = 4096, 16384, FLUX's 4608 and 512,
# and D = 64 and 256 at 4096, the seqlen sweep's H·D = 2048), BWD_SHAPES
# (default the D = 64 and 128 ones), WIN_SHAPES (B:H:N:D:-:L,R, the windows
# wintime times), ROUNDS (2), STEPS (check, time,
# bwdcheck, wscheck, keyrowscheck, q80check, bwdtime, wintime, biastime, tiles, xtiles, ntiles,
# sanitize; default all but q80check, wintime, biastime, tiles, xtiles, ntiles and sanitize;
# biastime times the forward and the backward with a [1,1,N,M] bias loaded from global memory,
# staged where the default stages it, and staged wherever it can be (FLASHATTN_BIAS_STAGED=0,
# unset, 1; BIAS_CONFIGS, LABEL=VAR=VALUE,VAR=VALUE each) on BIAS_SHAPES, after the forward
# and gradient tests under the staging everywhere (BIAS_CHECK=0 skips them, BIAS_CHECK_ENV adds
# variables to them); BIAS_KIND (bhnm, 1hnm, b1nm; default 11nm) is the bias's broadcast,
# BIAS_PASSES (default "fwd bwd") the passes timed; wintime times the
# forward under windows on the default pipeline and on the short-sequence
# one (persistent, tma-store), the default for windows with L + R <= 2048; wscheck is bwdcheck with the warp-specialized backward,
# FLASHATTN_BWD_PIPELINE=ws, keyrowscheck with its key-rows step too,
# FLASHATTN_BWD_KEY_ROWS=1, q80check that with steps of 80 queries too,
# FLASHATTN_BWD_QUERY_STEP=80), BWD_CONFIGS (the backward's timed choices,
# space-separated LABEL=VAR=VALUE,VAR=VALUE; default the dQ algorithms on
# both pipelines and the key-rows step); sanitize runs a few shapes of the full
# pipeline, the bulk dQ, the warp-specialized backward, the 128-query step at D = 64 and
# the staged bias under compute-sanitizer's racecheck and synccheck; each step fits one
# 10-minute call), TILE_PIPELINE (tiles: the Hopper tile sweep, `benchfwd
# -only hsweep`, under this pipeline; default ws,pingpong,early-rescale;
# xtiles: the key tiles of softcap, dropout and bias variants at D = 64 and 128,
# `benchfwd -only xsweep`, under the default pipeline; ntiles: 128 and 160
# keys at D = 128 and 192 and 128 query rows at D = 64 from N = 512 to 16384, `benchfwd -only
# nsweep`).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/.pipeline-out}
PIPELINES=${PIPELINES:-lockstep ws ws,pingpong ws,pingpong,early-rescale ws,pingpong,early-rescale,persistent ws,pingpong,early-rescale,persistent,tma-store tma-store early-rescale}
SHAPES=${SHAPES:-4:16:4096:128 4:16:4096:128:causal 1:16:16384:128 1:24:4608:128 32:16:512:128 32:16:512:128:causal 4:32:4096:64 4:32:4096:64:causal 4:8:4096:256 4:8:4096:256:causal}
ROUNDS=${ROUNDS:-2}
BWD_SHAPES=${BWD_SHAPES:-4:16:4096:128 4:16:4096:128:causal 1:24:4608:128 4:32:4096:64 4:32:4096:64:causal}
STEPS=${STEPS:-check,time,bwdcheck,wscheck,keyrowscheck,bwdtime}
TILE_PIPELINE=${TILE_PIPELINE:-ws,pingpong,early-rescale}
# the pipelines the check step runs the tests under: together every part, each in one run of at most 4 minutes
CHECK_PIPELINES=${CHECK_PIPELINES:-ws,pingpong,early-rescale ws,pingpong,early-rescale,persistent,tma-store tma-store}
BIN=$ROOT/.bin/flashattn
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
mkdir -p "$FLASHATTN_CACHE_DIR"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a "$SUMMARY"

# tag PIPELINE: a file-name-safe form of the pipeline's words.
tag() { echo "$1" | tr ',' '+'; }

if [[ ",$STEPS," == *",check,"* ]]; then
	for p in $CHECK_PIPELINES; do
		log=$OUT/check-$(tag "$p").log
		(cd "$ROOT/gpu" && FLASHATTN_FWD_PIPELINE=$p timeout --kill-after=10 240 "$ROOT/.bin/gpu.test" -test.v -test.short \
			-test.run 'TestConformance|TestShapes|TestForwardNonFinite|TestForwardStaging|TestRepeatBitIdentical|TestForeignMemoryGraph') >"$log" 2>&1
		printf 'check %-32s rc=%-3d %s failed subtests\n' "$p" "$?" "$(grep -cE '^\s*--- FAIL' "$log")" | tee -a "$SUMMARY"
	done
fi

# time_configs FILE PASS SHAPES CONFIGS: times every shape under each config
# (label=VAR=value,VAR=value), alternating, ROUNDS times; one line per run in FILE.
time_configs() {
	local file=$1 pass=$2 shapes=$3 configs=$4
	: >"$file"
	for s in $shapes; do
		IFS=: read -r b h n d causal win <<<"$s"
		flags=(--pass "$pass" --batch "$b" --heads "$h" --seqlen-q "$n" --head-dim "$d" --budget 500ms)
		[ "${causal:-}" = causal ] && flags+=(--causal)
		[ -n "${win:-}" ] && flags+=(--window "$win")
		for r in $(seq "$ROUNDS"); do
			for cfg in $configs; do
				label=${cfg%%=*}
				IFS=, read -ra vars <<<"${cfg#*=}"
				line=$(env "${vars[@]}" timeout 120 "$BIN" bench "${flags[@]}" ${BENCH_FLAGS:-} --json 2>>"$OUT/time.err" |
					python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["median_ms"], r["tflops"], r.get("kernel_variant",""), r.get("dq_algorithm",""))' 2>>"$OUT/time.err")
				echo "$s $label $r $line" | tee -a "$file"
			done
		done
	done
}

# summarize FILE LABELS: per shape and label, the mean of the rounds' medians and the ratio to the first label.
summarize() {
	python3 - "$1" "$2" <<'EOF'
import sys, collections
rows = collections.defaultdict(list)
rates = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) < 5:
        continue
    rows[(f[0], f[1])].append(float(f[3]))
    rates[(f[0], f[1])].append(float(f[4]))
labels = sys.argv[2].split()
print("%-24s" % "shape (B:H:N:D)" + "".join("%28s" % p for p in labels))
for s in dict.fromkeys(k[0] for k in rows):
    base = rows.get((s, labels[0]))
    cells = []
    for p in labels:
        ms = rows.get((s, p))
        if not ms:
            cells.append("%28s" % "-")
            continue
        m = sum(ms) / len(ms)
        t = sum(rates[(s, p)]) / len(rates[(s, p)])
        ratio = (sum(base) / len(base)) / m if base else float("nan")
        cells.append("%28s" % ("%.4f ms %5.0f TF %.3fx" % (m, t, ratio)))
    print("%-24s" % s + "".join(cells))
EOF
}

if [[ ",$STEPS," == *",time,"* ]]; then
	configs=""
	labels=""
	for p in $PIPELINES; do
		configs+=" $(tag "$p")=FLASHATTN_FWD_PIPELINE=$(tag "$p")"  # (the + form: time_configs splits settings at commas)
		labels+=" $(tag "$p")"
	done
	time_configs "$OUT/times.txt" fwd "$SHAPES" "$configs"
	summarize "$OUT/times.txt" "$labels" >>"$SUMMARY"
fi

BWD_CONFIGS=${BWD_CONFIGS:-"separate=FLASHATTN_DQ=separate,FLASHATTN_BWD_PIPELINE=lockstep atomic=FLASHATTN_DQ=atomic,FLASHATTN_BWD_PIPELINE=lockstep
 bulk=FLASHATTN_DQ=atomic,FLASHATTN_BULK_DQ=1,FLASHATTN_BWD_PIPELINE=lockstep
 ws-separate=FLASHATTN_DQ=separate,FLASHATTN_BWD_PIPELINE=ws ws-atomic=FLASHATTN_DQ=atomic,FLASHATTN_BWD_PIPELINE=ws
 ws-bulk=FLASHATTN_DQ=atomic,FLASHATTN_BULK_DQ=1,FLASHATTN_BWD_PIPELINE=ws
 ws-keyrows=FLASHATTN_DQ=separate,FLASHATTN_BWD_PIPELINE=ws,FLASHATTN_BWD_KEY_ROWS=1
 ws-keyrows-bulk=FLASHATTN_DQ=atomic,FLASHATTN_BULK_DQ=1,FLASHATTN_BWD_PIPELINE=ws,FLASHATTN_BWD_KEY_ROWS=1"}
# bwd_check LABEL VAR=VALUE...: the gradient tests with the bulk dQ allowed (the tests run both dQ
# algorithms) and the variables given
bwd_check() {
	local label=$1 log=$OUT/bwdcheck-$1.log
	shift
	(cd "$ROOT/gpu" && env FLASHATTN_BULK_DQ=1 "$@" timeout --kill-after=10 280 "$ROOT/.bin/gpu.test" -test.v \
		-test.run 'TestBackwardGradients|TestBackwardAtomicUnderLoad|TestBackwardWholeStep|TestBackwardNonFinite|TestBackwardDeterministic') >"$log" 2>&1
	printf 'bwdcheck %-8s rc=%-3d %s failed subtests\n' "$label" "$?" "$(grep -cE '^\s*--- FAIL' "$log")" | tee -a "$SUMMARY"
}
if [[ ",$STEPS," == *",bwdcheck,"* ]]; then
	bwd_check bulk FLASHATTN_BWD_PIPELINE=lockstep
fi
if [[ ",$STEPS," == *",wscheck,"* ]]; then
	bwd_check ws FLASHATTN_BWD_PIPELINE=ws
fi
if [[ ",$STEPS," == *",keyrowscheck,"* ]]; then
	bwd_check keyrows FLASHATTN_BWD_PIPELINE=ws FLASHATTN_BWD_KEY_ROWS=1
fi
if [[ ",$STEPS," == *",q80check,"* ]]; then
	bwd_check q80 FLASHATTN_BWD_PIPELINE=ws FLASHATTN_BWD_KEY_ROWS=1 FLASHATTN_BWD_QUERY_STEP=80
fi
if [[ ",$STEPS," == *",bwdtime,"* ]]; then
	time_configs "$OUT/bwdtimes.txt" bwd "$BWD_SHAPES" "$BWD_CONFIGS"
	summarize "$OUT/bwdtimes.txt" "$(for c in $BWD_CONFIGS; do printf '%s ' "${c%%=*}"; done)" >>"$SUMMARY"
fi
WIN_SHAPES=${WIN_SHAPES:-4:16:4096:128:-:256,0 4:16:4096:128:-:128,128 4:16:4096:128:-:1024,0 4:16:4096:128:-:2048,0 4:16:4096:128:-:4096,0}
if [[ ",$STEPS," == *",wintime,"* ]]; then
	wconfigs="ws+pingpong+early-rescale=FLASHATTN_FWD_PIPELINE=ws+pingpong+early-rescale short=FLASHATTN_FWD_PIPELINE=ws+pingpong+early-rescale+persistent+tma-store"
	time_configs "$OUT/wintimes.txt" fwd "$WIN_SHAPES" "$wconfigs"
	summarize "$OUT/wintimes.txt" "ws+pingpong+early-rescale short" >>"$SUMMARY"
fi
BIAS_SHAPES=${BIAS_SHAPES:-4:16:4096:128 4:16:4096:128:causal 1:16:16384:128 4:32:4096:64}
BIAS_CONFIGS=${BIAS_CONFIGS:-global=FLASHATTN_BIAS_STAGED=0 default=FLASHATTN_BIAS_STAGED= staged=FLASHATTN_BIAS_STAGED=1}
if [[ ",$STEPS," == *",biastime,"* ]]; then
	if [ "${BIAS_CHECK:-1}" != 0 ]; then
		log=$OUT/biascheck.log
		(cd "$ROOT/gpu" && FLASHATTN_BIAS_STAGED=1 ${BIAS_CHECK_ENV:-} timeout --kill-after=10 240 "$ROOT/.bin/gpu.test" -test.v -test.short \
			-test.run 'TestShapes|TestForwardNonFinite|TestConformance|TestBackwardGradients$|TestBackwardKeyRowsDefault') >"$log" 2>&1
		printf 'biascheck rc=%-3d %s failed subtests\n' "$?" "$(grep -cE '^\s*--- FAIL' "$log")" | tee -a "$SUMMARY"
	fi
	labels=$(for c in $BIAS_CONFIGS; do printf '%s ' "${c%%=*}"; done)
	for pass in ${BIAS_PASSES:-fwd bwd}; do
		BENCH_FLAGS="--bias ${BIAS_KIND:-11nm}" time_configs "$OUT/biastimes-$pass.txt" $pass "$BIAS_SHAPES" "$BIAS_CONFIGS"
		echo "bias, $pass:" >>"$SUMMARY"
		summarize "$OUT/biastimes-$pass.txt" "$labels" >>"$SUMMARY"
	done
fi
if [[ ",$STEPS," == *",sanitize,"* ]]; then
	SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
	for tool in racecheck synccheck; do
		log=$OUT/sanitize-$tool.log
		(cd "$ROOT/gpu" && FLASHATTN_FWD_PIPELINE=ws,pingpong,early-rescale,persistent,tma-store FLASHATTN_BULK_DQ=1 FLASHATTN_BWD_PIPELINE=ws \
			timeout --kill-after=10 280 "$SANITIZER" --tool "$tool" --error-exitcode 9 "$ROOT/.bin/gpu.test" -test.v \
			-test.run 'TestShapes/(seq4224-causal-bf16|d127-gqa6:2-n>m)|TestDropoutAt') >"$log" 2>&1
		printf 'sanitize %-10s rc=%-3d %s\n' "$tool" "$?" "$(grep -m1 -E 'ERROR SUMMARY|hazard' "$log")" | tee -a "$SUMMARY"
		# the backward's key-rows step with the bulk dQ, and the deep kernels past 256
		log=$OUT/sanitize-bwd-$tool.log
		(cd "$ROOT/gpu" && FLASHATTN_BULK_DQ=1 FLASHATTN_BWD_KEY_ROWS=1 FLASHATTN_BWD_CASES='^(plain|d320)' \
			timeout --kill-after=10 280 "$SANITIZER" --tool "$tool" --error-exitcode 9 "$ROOT/.bin/gpu.test" -test.v \
			-test.run 'TestBackwardGradients$') >"$log" 2>&1
		printf 'sanitize bwd %-6s rc=%-3d %s\n' "$tool" "$?" "$(grep -m1 -E 'ERROR SUMMARY|hazard' "$log")" | tee -a "$SUMMARY"
		# the 128-query key-rows step at D = 64, its dQ rows split (tiled accumulator), and the staged
		# bias
		log=$OUT/sanitize-q128-$tool.log
		(cd "$ROOT/gpu" && FLASHATTN_BULK_DQ=1 FLASHATTN_BWD_KEY_ROWS=1 FLASHATTN_BWD_QUERY_STEP=128 FLASHATTN_BIAS_STAGED=1 \
			FLASHATTN_BWD_CASES='^(plain|softcap)$' \
			timeout --kill-after=10 280 "$SANITIZER" --tool "$tool" --error-exitcode 9 "$ROOT/.bin/gpu.test" -test.v \
			-test.run 'TestBackwardGradients$|TestBackwardKeyRowsDefault/keyrows-d128-bias') >"$log" 2>&1
		printf 'sanitize q128 %-5s rc=%-3d %s\n' "$tool" "$?" "$(grep -m1 -E 'ERROR SUMMARY|hazard' "$log")" | tee -a "$SUMMARY"
	done
fi
if [[ ",$STEPS," == *",tiles,"* ]]; then
	FLASHATTN_FWD_PIPELINE=$TILE_PIPELINE timeout --kill-after=10 540 "$ROOT/.bin/benchfwd" -only hsweep -reps 20 >"$OUT/tiles.log" 2>&1
	echo "tiles ($TILE_PIPELINE) rc=$?" >>"$SUMMARY"
	tail -n 60 "$OUT/tiles.log" >>"$SUMMARY"
fi
if [[ ",$STEPS," == *",xtiles,"* ]]; then
	timeout --kill-after=10 300 "$ROOT/.bin/benchfwd" -only xsweep -reps 20 >"$OUT/xtiles.log" 2>&1
	echo "xtiles rc=$?" >>"$SUMMARY"
	grep -E 'x-|spill +[1-9]' "$OUT/xtiles.log" >>"$SUMMARY"
fi
if [[ ",$STEPS," == *",ntiles,"* ]]; then
	timeout --kill-after=10 300 "$ROOT/.bin/benchfwd" -only nsweep -reps 20 >"$OUT/ntiles.log" 2>&1
	echo "ntiles rc=$?" >>"$SUMMARY"
	grep -E 'nsweep|spill +[1-9]' "$OUT/ntiles.log" >>"$SUMMARY"
fi
cat "$SUMMARY"
