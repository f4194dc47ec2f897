#!/usr/bin/env bash
# Profiles one `flashattn bench` case's kernel with Nsight Compute's
# per-instruction warp-state sampling and prints where its warps wait:
# the stall reasons' shares, the instructions holding the most samples
# (polling loops with the barrier they poll) and the opcodes' shares
# (bench/ncu_source.py). Where bench/ncu-h200.sh says how busy a kernel
# is, this says on which instruction it waits.
#
# Build the binary first where Go is (the GPU machine needs no Go toolchain):
#
#   CGO_ENABLED=0 go build -o .bin/flashattn ./cmd/flashattn
#
# then, on the GPU machine, from the repository root with .bin copied along,
# with the case's flags:
#
#   bash bench/ncu-source.sh --pass fwd --batch 4 --heads 16 --seqlen-q 4096 --head-dim 128 --dropout 0.1
#
# Outputs under $OUT: $TAG.csv.gz (ncu's source page of the kernel, SASS
# with every sampling and execution counter), $TAG-details.csv (the
# kernel's full section set, as ncu --page details writes it), log.txt
# and summary.txt (printed last). Environment: KERNEL (ncu's kernel
# filter; default the pass's main kernel: the forward, or the backward's
# dK/dV kernel), PIPELINE_ENV (environment words for the run, such as
# FLASHATTN_FWD_DOUBLE_Q=0), TAG (file name stem, default kernel), TOP
# (instructions and opcodes listed, 15), NCU (the ncu binary), LIMIT
# (seconds, 150).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/.ncu-out}
BIN=${FLASHATTN_BIN:-$ROOT/.bin/flashattn}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
LIMIT=${LIMIT:-150}
TAG=${TAG:-kernel}
TOP=${TOP:-15}
PIPELINE_ENV=${PIPELINE_ENV:-}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
mkdir -p "$FLASHATTN_CACHE_DIR"
[ -f "$ROOT/.bin/cache.tgz" ] && tar -xzf "$ROOT/.bin/cache.tgz" -C "$FLASHATTN_CACHE_DIR"

kern='regex:^(flash_fwd|fa_fwd)'
case " $* " in *" --pass bwd "* | *" --pass fwdbwd "*) kern='regex:^fa_bwd_dkdv' ;; esac
kern=${KERNEL:-$kern}
rep=$OUT/$TAG
# one launch of the kernel: the first of the bench's runs (its first run compiles and runs once)
# shellcheck disable=SC2086 # PIPELINE_ENV is a word list
timeout "$LIMIT" env $PIPELINE_ENV "$NCU" --clock-control none -k "$kern" --launch-count 1 --set full \
	--import-source no -o "$rep" "$BIN" bench --backend cuda --repeats 1 --warmup 0s --budget 1ms "$@" >"$OUT/log.txt" 2>&1
echo "ncu rc=$?" >>"$OUT/log.txt"
if [ ! -f "$rep.ncu-rep" ]; then
	tail -5 "$OUT/log.txt"
	exit 1
fi
"$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass 2>>"$OUT/log.txt" | gzip >"$rep.csv.gz"
"$NCU" -i "$rep.ncu-rep" --page details --csv >"$rep-details.csv" 2>>"$OUT/log.txt"
rm -f "$rep.ncu-rep"
{
	echo "ncu source of $kern, flashattn bench $*${PIPELINE_ENV:+ under $PIPELINE_ENV}, $(date -u +%F)"
	command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
	python3 "$ROOT/bench/ncu_source.py" --top "$TOP" --details "$rep-details.csv" "$rep.csv.gz"
} | tee "$OUT/summary.txt"
exit 0
