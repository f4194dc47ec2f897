#!/usr/bin/env bash
# Runs the whole comparison on a GPU machine in one go: flashattn's sweeps
# on the cuda backend, PyTorch SDPA's backends on the same shapes and card,
# then the comparison. Each stage runs under its own time limit and the next
# one runs whatever happened before; everything is logged.
#
# Build the binary first (the GPU machine has no Go toolchain):
#
#   CGO_ENABLED=0 go build -o .bin/flashattn ./cmd/flashattn
#
# then run this script from the repository root there, with .bin copied along:
#
#   bash bench/run-h200.sh
#
# Outputs under $OUT (at most 8 files, none deeper than $OUT itself):
#   log.txt                  every stage's output, with times
#   ours.json, peers.json    results files (flashattn's, PyTorch SDPA's)
#   compare.md               the merged tables and ratios
#   seqlen.png headdim.png gqa-kv.png gqa-contention.png   merged plots
#
# Regenerate the BENCHMARKS.md section (and full-size plots, SVG too) here:
#
#   go run ./cmd/flashattn compare --out docs/bench --img-prefix docs/bench/ \
#       --markdown ours.json peers.json > docs/bench/section.md
#
# Environment: PRESETS (default all), DTYPE (bf16), OURS_LIMIT and
# PEERS_LIMIT (seconds after which no new case starts; 210 and 190),
# FLASHATTN_BIN (.bin/flashattn), PEER_BACKENDS (flash,cudnn,mem_eff,math).
set -u

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/.bench-out}
BIN=${FLASHATTN_BIN:-$ROOT/.bin/flashattn}
PRESETS=${PRESETS:-all}
DTYPE=${DTYPE:-bf16}
OURS_LIMIT=${OURS_LIMIT:-210}
PEERS_LIMIT=${PEERS_LIMIT:-190}
PEER_BACKENDS=${PEER_BACKENDS:-flash,cudnn,mem_eff,math}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/flashattn-bench.XXXXXX")
LOG=$OUT/log.txt

mkdir -p "$OUT"
: >"$LOG"
# A compile cache archive (bench/check-h200.sh leaves one) saves the first-use
# NVRTC compiles.
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
mkdir -p "$FLASHATTN_CACHE_DIR"
[ -f "$ROOT/.bin/cache.tgz" ] && tar -xzf "$ROOT/.bin/cache.tgz" -C "$FLASHATTN_CACHE_DIR"
export PYTHONUNBUFFERED=1
# The driver and the toolkit (NVRTC dlopens libnvrtc-builtins) on the loader
# path of flashattn alone: PyTorch loads its own CUDA libraries.
OURS=(env "LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$BIN")

T0=$(date +%s)
# shellcheck source=bench/stage.sh
. "$ROOT/bench/stage.sh"

log "flashattn H200 comparison; work dir $WORK"
stage env 20 bash -c 'date -u; uname -a; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv; python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"cudnn\", torch.backends.cudnn.version(), \"triton\", triton.__version__)"'

if [ -x "$BIN" ]; then
	stage version 10 "${OURS[@]}" version
	# the default training step on host tensors, causal and not, and at D = 64, checked against the float64
	# reference (FAIL in the log on a wrong answer): the sweeps below time device-resident calls
	# and check nothing
	stage demo 90 "${OURS[@]}" demo
	stage demo-unmasked 90 "${OURS[@]}" demo --causal=false --iters 1
	stage demo-d64 90 "${OURS[@]}" demo --dim 64 --iters 1
	stage shapes 30 "${OURS[@]}" sweep --preset "$PRESETS" --dtype "$DTYPE" --emit-shapes "$WORK/shapes.json"
	stage ours $((OURS_LIMIT + 40)) "${OURS[@]}" sweep --preset "$PRESETS" --dtype "$DTYPE" --backend cuda \
		--out "$WORK/ours" --time-limit "${OURS_LIMIT}s"
else
	log "no flashattn binary at $BIN: build it with CGO_ENABLED=0 go build -o .bin/flashattn ./cmd/flashattn and copy .bin to the GPU machine"
fi

if [ -f "$WORK/shapes.json" ]; then
	stage peers $((PEERS_LIMIT + 40)) python3 "$ROOT/bench/peers/sdpa.py" --shapes "$WORK/shapes.json" \
		--out "$WORK/peers.json" --backends "$PEER_BACKENDS" --time-limit "$PEERS_LIMIT"
else
	log "no shape list: peers not run"
fi

inputs=()
[ -f "$WORK/ours/results.json" ] && cp "$WORK/ours/results.json" "$OUT/ours.json" && inputs+=("$OUT/ours.json")
[ -f "$WORK/peers.json" ] && cp "$WORK/peers.json" "$OUT/peers.json" && inputs+=("$OUT/peers.json")
if [ -x "$BIN" ] && [ ${#inputs[@]} -gt 0 ]; then
	stage compare 30 "${OURS[@]}" compare --out "$WORK/compare" "${inputs[@]}"
	[ -f "$WORK/compare/compare.md" ] && cp "$WORK/compare/compare.md" "$OUT/compare.md"
	for p in seqlen headdim gqa-kv gqa-contention; do
		[ -f "$WORK/compare/$p.png" ] && cp "$WORK/compare/$p.png" "$OUT/$p.png"
	done
else
	log "nothing to compare"
fi

log "outputs: $(cd "$OUT" && ls | tr '\n' ' ')"
grep -E '^(PASS|FAIL) ' "$LOG" | head -3 # the demos' verdicts
if [ -f "$OUT/compare.md" ]; then
	# The overview: the summary sentence and the ratio table per preset and pass.
	awk '/^Over |^No shape/ {print; print ""} /^\| preset \| pass/ {t=1} t && /^\|/ {print} t && !/^\|/ {exit}' "$OUT/compare.md"
fi
rm -rf "$WORK"
exit 0
