#!/usr/bin/env bash
# Profiles the default kernels with Nsight Compute at the shapes the Hopper
# goals name: one launch of each kernel of `flashattn bench --pass fwd|bwd`
# per shape, with the sections that say where a kernel's time goes (speed of
# light, warp states, scheduler, occupancy, launch), then a summary table:
# kernel, duration, compute and memory throughput, issue slots busy, warps
# per scheduler, eligible warps, registers, the bytes read from DRAM, the L2
# hit rate, the warp instructions executed (every warp's, the barrier waits'
# polling loops included), and the top stall reasons.
#
# Build the binary first where Go is (the GPU machine needs no Go toolchain):
#
#   CGO_ENABLED=0 go build -o .bin/flashattn ./cmd/flashattn
#
# then, on the GPU machine, from the repository root with .bin copied along:
#
#   bash bench/ncu-h200.sh
#
# Outputs under $OUT: log.txt (every run's output), ncu-<shape>.csv (the raw
# metrics, one row per kernel and metric), summary.txt (the table, printed
# last). Environment: SHAPES (space-separated PASS:B:H:N:D[:causal]; default
# the D = 128 forward and backward at N = 4096 and 16384, causal at 4096, the
# FLUX step, N = 512, D = 64 and D = 256 causal), PIPELINE_ENV (environment
# words for every run, such as FLASHATTN_FWD_PIPELINE=lockstep; default
# none: the defaults), BENCH_FLAGS (flags added to every shape's `flashattn bench`, such as
# "--bias 1hnm --bias-grad"), NCU (the ncu binary), LIMIT (seconds per shape, 90),
# PEER (a PyTorch SDPA backend — cudnn, flash or mem_eff — to profile instead
# of flashattn: bench/peers/sdpa.py runs each shape with it, and the kernels
# whose names say attention — sdpa, fmha, flash, cudnn, attn, fprop, bprop —
# are profiled; its forward's kernels appear beside the backward's, and
# BENCH_FLAGS does not apply), PIPES (1: also the MUFU's and the tensor cores' utilization).
# Each row also gives the launch's grid, block and shared memory, which
# name a peer's tile configuration.
# Clocks stay as the driver sets them (--clock-control none), so durations
# compare with the benchmarks'.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/.ncu-out}
BIN=${FLASHATTN_BIN:-$ROOT/.bin/flashattn}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
LIMIT=${LIMIT:-90}
SHAPES=${SHAPES:-fwd:4:16:4096:128 bwd:4:16:4096:128 fwd:4:16:4096:128:causal bwd:4:16:4096:128:causal fwd:1:16:16384:128 bwd:1:16:16384:128 fwd:1:24:4608:128 bwd:1:24:4608:128 fwd:32:16:512:128 bwd:32:16:512:128 fwd:4:32:4096:64 bwd:4:32:4096:64 bwd:4:8:4096:256:causal}
PIPELINE_ENV=${PIPELINE_ENV:-}
mkdir -p "$OUT"
LOG=$OUT/log.txt
SUMMARY=$OUT/summary.txt
: >"$LOG"
: >"$SUMMARY"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
mkdir -p "$FLASHATTN_CACHE_DIR"
[ -f "$ROOT/.bin/cache.tgz" ] && tar -xzf "$ROOT/.bin/cache.tgz" -C "$FLASHATTN_CACHE_DIR"

METRICS=launch__grid_size,launch__block_size,launch__shared_mem_per_block,gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_issued.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,launch__registers_per_thread,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_membar.ratio,smsp__average_warp_latency_issue_stalled_sleeping.ratio,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,smsp__inst_executed.sum
# PIPES=1: also the MUFU's (xu) and the tensor cores' (gmma) share of their peak, printed after the stalls
[ "${PIPES:-}" = 1 ] && METRICS=$METRICS,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active

{
	echo "ncu of ${PEER:+the PyTorch SDPA backend $PEER, not }the default kernels, $(date -u +%F)"
	nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
	"$NCU" --version | tail -1
	printf '%-28s %-26s %9s %6s %6s %6s %6s %6s %5s %7s %5s %7s %7s %5s %6s  %s\n' shape kernel ms sm% mem% issue% warps elig regs dramGB l2hit% Minstr grid block smemKB "stall cycles per issue: barrier/long-sb/wait/math/membar/sleep"
} | tee -a "$SUMMARY"

for s in $SHAPES; do
	IFS=: read -r pass b h n d causal <<<"$s"
	flags=(--backend cuda --dtype bf16 --pass "$pass" --batch "$b" --heads "$h" --seqlen-q "$n" --head-dim "$d" --repeats 1 --warmup 0s --budget 1ms)
	[ "${causal:-}" = causal ] && flags+=(--causal)
	read -ra extra <<<"${BENCH_FLAGS:-}"
	flags+=("${extra[@]}")
	tag=$(echo "$s" | tr ':' '-')
	csv=$OUT/ncu-$tag.csv
	echo "== $s" >>"$LOG"
	# the pass's kernels only (the backward's inputs come from forwards, not profiled): the forward
	# and its non-finite fix-up, or the backward's pre, dK/dV, dQ, convert and fix-up kernels; the
	# summary keeps the last launch of each name
	kern='regex:^(flash_fwd|fa_fwd)'
	[ "$pass" = bwd ] && kern='regex:^fa_bwd'
	cmd=("$BIN" bench "${flags[@]}")
	count=12
	if [ -n "${PEER:-}" ]; then
		# the one case as sdpa.py reads it (flashattn-shapes/1), timed briefly; the kernels whose
		# names say attention (PyTorch's element-wise and copy kernels left out)
		shapes=$OUT/shapes-$tag.json
		is_causal=false
		[ "${causal:-}" = causal ] && is_causal=true
		printf '{"schema": "flashattn-shapes/1", "preset": "ncu", "cases": [{"preset": "ncu", "dtype": "bf16", "batch": %d, "seqlen_q": %d, "seqlen_k": %d, "heads": %d, "kv_heads": %d, "head_dim": %d, "head_dim_v": %d, "causal": %s, "align": "bottom-right", "softcap": 0, "dropout": 0, "deterministic": false, "pass": "%s"}]}\n' \
			"$b" "$n" "$n" "$h" "$h" "$d" "$d" "$is_causal" "$pass" >"$shapes"
		kern='regex:(sdpa|fmha|flash|cudnn|attn|attention|dot_product|fprop|bprop)'
		cmd=(python3 "$ROOT/bench/peers/sdpa.py" --shapes "$shapes" --out "$OUT/peer-$tag.json" --backends "$PEER" --warmup-ms 0 --rep-ms 1)
		count=40
	fi
	timeout "$LIMIT" env $PIPELINE_ENV "$NCU" --clock-control none --target-processes all -k "$kern" \
		--launch-skip 0 --launch-count "$count" --metrics "$METRICS" --csv --print-units base \
		"${cmd[@]}" >"$csv" 2>>"$LOG"
	echo "rc=$?" >>"$LOG"
	# one line per kernel launch: the last launch of each kernel name (the timed call's)
	python3 - "$csv" "$s" >>"$SUMMARY" <<'EOF'
import csv, sys
path, shape = sys.argv[1], sys.argv[2]
rows = [r for r in csv.reader(open(path)) if len(r) > 10]
if not rows:
    print("%-28s no kernel profiled (see log.txt)" % shape)
    sys.exit()
head = rows[0]
col = {name: i for i, name in enumerate(head)}
last = {}
for r in rows[1:]:
    if r[col["Metric Name"]] == "":
        continue
    key = (r[col["ID"]], r[col["Kernel Name"]])
    last.setdefault(key, {})[r[col["Metric Name"]]] = r[col["Metric Value"]]
byname = {}
for (i, name), m in sorted(last.items(), key=lambda x: int(x[0][0])):
    byname[name.split("(")[0]] = m
def f(m, k, scale=1.0, fmt="%.1f"):
    try:
        return fmt % (float(m[k].replace(",", "")) * scale)
    except (KeyError, ValueError):
        return "-"
for name, m in byname.items():
    stalls = "/".join(f(m, "smsp__average_warp_latency_issue_stalled_%s.ratio" % s) for s in
                      ("barrier", "long_scoreboard", "wait", "math_pipe_throttle", "membar", "sleeping"))
    print("%-28s %-26s %9s %6s %6s %6s %6s %6s %5s %7s %5s %7s %7s %5s %6s  %s" % (
        shape, name[:26], f(m, "gpu__time_duration.sum", 1e-6, "%.3f"),
        f(m, "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
        f(m, "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
        f(m, "sm__inst_issued.avg.pct_of_peak_sustained_active"),
        f(m, "smsp__warps_active.avg.per_cycle_active", 1, "%.2f"),
        f(m, "smsp__warps_eligible.avg.per_cycle_active", 1, "%.2f"),
        f(m, "launch__registers_per_thread", 1, "%.0f"), f(m, "dram__bytes_read.sum", 1e-9, "%.2f"),
        f(m, "lts__t_sector_hit_rate.pct", 1, "%.0f"), f(m, "smsp__inst_executed.sum", 1e-6, "%.0f"),
        f(m, "launch__grid_size", 1, "%.0f"), f(m, "launch__block_size", 1, "%.0f"),
        f(m, "launch__shared_mem_per_block", 1 / 1024, "%.1f"), stalls) + (
        "  xu/gmma %s/%s" % (f(m, "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
                             f(m, "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"))
        if "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active" in m else ""))
EOF
done
cat "$SUMMARY"
exit 0
