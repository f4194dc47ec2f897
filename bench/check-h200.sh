#!/usr/bin/env bash
# Checks and times the CUDA kernels on a GPU machine in one go: the
# backward's gradient, determinism and atomic-under-load tests, the
# conformance suite (short), the backward benchmark (throughput table, head
# dims, GQA contention) and the forward benchmark (odd head dims, tile
# sweep with FWD_SWEEP=-sweep). Each step runs under a time limit and logs under $OUT; a summary
# table prints last.
#
# Build the binaries first where Go is (the GPU machine needs no Go toolchain):
#
#   CGO_ENABLED=0 go test -c -o .bin/gpu.test ./gpu
#   CGO_ENABLED=0 go test -c -o .bin/kernels.test ./kernels
#   CGO_ENABLED=0 go test -c -o .bin/cuda.test ./cuda        (hostcheck)
#   CGO_ENABLED=0 go build -o .bin/benchfwd ./gpu/internal/benchfwd
#   CGO_ENABLED=0 go build -o .bin/flashattn ./cmd/flashattn
#
# then, on the GPU machine, from the repository root with .bin copied along:
#
#   bash bench/check-h200.sh
#
# Environment: STEPS (comma-separated: compile, sanitize, grad,
# conformance, forward, hostcheck, demo, demo64, hosttime, bwdbench,
# fwdbench; default all; demo and demo64 run `flashattn demo` (its
# default, and at D = 64) from .bin/flashattn when it was built; hostcheck
# runs the direct host path's tests (TestRegisterHost from .bin/cuda.test
# when it was built, TestHostRegister, TestHostPin, and TestHostIntoLayouts under
# FLASHATTN_HOST_REGISTER=1), hosttime `flashattn demo --breakdown` with
# FLASHATTN_HOST_REGISTER=0 and =1 alternating, two rounds (each run prints
# the pinned Into forms' times too); sanitize runs the staging
# tests under compute-sanitizer's memcheck where it is installed), FWD_ONLY (benchfwd -only groups;
# main,odd,big),
# BWD_BENCH_ENV (extra variables for the backward benchmark, such as
# FLASHATTN_BWD_BENCH_TILES=1). A compile cache archive at .bin/cache.tgz
# is unpacked first, and the cache is packed into $OUT/cache.tgz at the end
# so that the next run can reuse it.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/.check-out}
STEPS=${STEPS:-compile,sanitize,grad,conformance,forward,hostcheck,demo,demo64,hosttime,bwdbench,fwdbench}
FWD_ONLY=${FWD_ONLY:-main,odd,big}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
mkdir -p "$FLASHATTN_CACHE_DIR"
[ -f "$ROOT/.bin/cache.tgz" ] && tar -xzf "$ROOT/.bin/cache.tgz" -C "$FLASHATTN_CACHE_DIR"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
T0=$(date +%s)

# step NAME SECONDS CMD...: runs CMD under a limit, output to $OUT/NAME.log.
step() {
	local name=$1 secs=$2
	shift 2
	case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
	local t=$(date +%s)
	timeout --kill-after=10 "$secs" "$@" >"$OUT/$name.log" 2>&1
	local rc=$?
	printf '%-12s rc=%-3d %4ds  %s\n' "$name" "$rc" "$(($(date +%s) - t))" \
		"$(grep -cE '^\s*--- FAIL' "$OUT/$name.log") failed subtests" | tee -a "$SUMMARY"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a "$SUMMARY"
step compile 120 "$ROOT/.bin/kernels.test" -test.v -test.run "${COMPILE_RUN:-TestBwdCompileMain|TestCompileMain|TestCompileHopper|TestBwdCompileHopper}"
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$SANITIZER" ] && step sanitize 240 "$SANITIZER" --tool memcheck --leak-check no --error-exitcode 9 \
	"$ROOT/.bin/gpu.test" -test.v -test.run 'TestForwardStaging|TestBackwardGradients/(d59|d111-127|d199-257)/'
step grad 300 "$ROOT/.bin/gpu.test" -test.v -test.run 'TestBackwardGradients|TestBackwardKeyRowsDefault|TestBackwardDeterministic|TestBackwardAtomicUnderLoad|TestBackwardWholeStep'
step conformance 180 "$ROOT/.bin/gpu.test" -test.v -test.short -test.run 'TestConformance|TestShapes|TestPoisonGuards|TestForwardStaging'
step forward 180 "$ROOT/.bin/gpu.test" -test.v -test.run 'TestDropoutKeepMask|TestDropoutAt|TestSoftcapChain|TestRepeatBitIdentical|TestDeviceErrors|TestHugeTensor|TestBackwardWholeStep|TestForeignMemoryGraph|TestHostIntoLayouts'
hostcheck() {
	if [ -x "$ROOT/.bin/cuda.test" ]; then (cd "$ROOT/cuda" && "$ROOT/.bin/cuda.test" -test.v -test.run 'TestRegisterHost') || return; fi
	"$ROOT/.bin/gpu.test" -test.v -test.run 'TestHostRegister|TestHostPin|TestHostRates' || return
	FLASHATTN_HOST_REGISTER=1 "$ROOT/.bin/gpu.test" -test.v -test.run 'TestHostIntoLayouts'
}
hosttime() {
	local r e
	for r in 1 2; do
		for e in 0 1; do
			echo "== FLASHATTN_HOST_REGISTER=$e, round $r"
			FLASHATTN_HOST_REGISTER=$e "$ROOT/.bin/flashattn" demo --breakdown | grep -E '^(host|link|pinned|breakdown|          |PASS|FAIL)' || return
		done
	done
}
export ROOT
export -f hostcheck hosttime
step hostcheck 150 bash -c hostcheck
[ -x "$ROOT/.bin/flashattn" ] && step demo 240 "$ROOT/.bin/flashattn" demo
[ -x "$ROOT/.bin/flashattn" ] && step demo64 120 "$ROOT/.bin/flashattn" demo --dim 64 --iters 1
[ -x "$ROOT/.bin/flashattn" ] && step hosttime 200 bash -c hosttime
step bwdbench 240 env FLASHATTN_BWD_BENCH=1 ${BWD_BENCH_ENV:-} "$ROOT/.bin/gpu.test" -test.v -test.run TestBackwardBench
step fwdbench 180 "$ROOT/.bin/benchfwd" ${FWD_SWEEP:-} -only "$FWD_ONLY" -reps 20
tar -czf "$OUT/cache.tgz" -C "$FLASHATTN_CACHE_DIR" . 2>/dev/null
echo "wall $(($(date +%s) - T0))s" | tee -a "$SUMMARY"
for f in compile sanitize grad conformance forward hostcheck; do
	[ -f "$OUT/$f.log" ] && grep -E '^(--- FAIL|FAIL|ok|PASS)' "$OUT/$f.log" | head -20
done
[ -f "$OUT/demo.log" ] && cat "$OUT/demo.log"
[ -f "$OUT/demo64.log" ] && grep -E '^(PASS|FAIL) ' "$OUT/demo64.log"
[ -f "$OUT/hosttime.log" ] && cat "$OUT/hosttime.log"
[ -f "$OUT/bwd_bench.md" ] && cat "$OUT/bwd_bench.md"
[ -f "$OUT/fwdbench.log" ] && tail -n 40 "$OUT/fwdbench.log"
cat "$SUMMARY"
