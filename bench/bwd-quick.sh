#!/usr/bin/env bash
# Checks the backward on a GPU machine and times it against the mma.sync
# kernels in one go: the gradient, determinism, atomic-under-load and
# whole-step tests, then `flashattn bench --pass bwd` at D = 64 and 128
# (and DIMS), N = 4096, causal and not, with the Hopper kernels allowed
# and with FLASHATTN_NO_WGMMA=1. Binaries built first where Go is:
#
#   CGO_ENABLED=0 go test -c -o .bin/gpu.test ./gpu
#   CGO_ENABLED=0 go build -o .bin/flashattn ./cmd/flashattn
#
# Environment: DIMS (head dims, default "64 128"), PASSES (default bwd;
# fwd fwdbwd too), TESTS (go test -run pattern; empty skips the tests). Logs under $OUT; a table prints last.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/.check-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
mkdir -p "$FLASHATTN_CACHE_DIR"
[ -f "$ROOT/.bin/cache.tgz" ] && tar -xzf "$ROOT/.bin/cache.tgz" -C "$FLASHATTN_CACHE_DIR"
TESTS=${TESTS-'TestBackwardGradients|TestBackwardDeterministic|TestBackwardAtomicUnderLoad|TestBackwardWholeStep'}
if [ -n "$TESTS" ]; then
	timeout --kill-after=10 300 "$ROOT/.bin/gpu.test" -test.v -test.run "$TESTS" >"$OUT/grad.log" 2>&1
	echo "tests rc=$? ($(grep -c 'sm90a' "$OUT/grad.log") lines name a Hopper variant)"
	grep -E '^(--- FAIL|    --- FAIL|FAIL|ok|PASS)' "$OUT/grad.log" | head -30
fi
: >"$OUT/bwd-quick.txt"
for pass in ${PASSES:-bwd}; do
for d in ${DIMS:-64 128}; do
	for c in "" --causal; do
		for no in 0 1; do
			r=$(FLASHATTN_NO_WGMMA=$no timeout 90 "$ROOT/.bin/flashattn" bench --backend cuda --pass "$pass" --batch 4 \
				--seqlen-q 4096 --heads $((2048 / d)) --head-dim "$d" $c 2>&1 | grep -E "^(rate|time)" | tr -s " " | tr "\n" " ")
			printf "%s D=%-4s %-8s no_wgmma=%s  %s\n" "$pass" "$d" "${c:-full}" "$no" "$r" | tee -a "$OUT/bwd-quick.txt"
		done
	done
done
done
tar -czf "$OUT/cache.tgz" -C "$FLASHATTN_CACHE_DIR" . 2>/dev/null
