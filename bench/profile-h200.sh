#!/usr/bin/env bash
# Profiles flashattn's main kernels and PyTorch's flash kernels on the same
# shapes with Nsight Compute (hardware counters; needs a machine where ncu
# can read them), so that their instruction mix, pipe use, stalls and
# shared-memory traffic can be compared side by side.
#
# Build the binary first (the GPU machine has no Go toolchain):
#
#   CGO_ENABLED=0 go build -o .bin/flashattn ./cmd/flashattn
#
# then run from the repository root there, with .bin carried:
#
#   bash bench/profile-h200.sh
#
# Environment: SHAPES (space-separated "D:causal" items, default
# "128:0 256:0"), PASSES (fwd, bwd or both; default both), OPCODES=1 (also
# the executed instructions per SASS opcode). Writes
# $OUT/ncu-ours.txt and $OUT/ncu-flash.txt; prints a short table of the
# headline counters last.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/.profile-out}
BIN=${FLASHATTN_BIN:-$ROOT/.bin/flashattn}
SHAPES=${SHAPES:-"128:0 256:0"}
PASSES=${PASSES:-"fwd bwd"}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
mkdir -p "$FLASHATTN_CACHE_DIR"
[ -f "$ROOT/.bin/cache.tgz" ] && tar -xzf "$ROOT/.bin/cache.tgz" -C "$FLASHATTN_CACHE_DIR"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis
  --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section InstructionStats"
METRICS="--metrics smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,smsp__sass_inst_executed_op_ldsm.sum,gpu__time_duration.sum"
[ "${OPCODES:-}" = 1 ] && METRICS="$METRICS,sass__inst_executed_per_opcode --print-metric-instances values"
: >"$OUT/ncu-ours.txt"
: >"$OUT/ncu-flash.txt"
for shape in $SHAPES; do
	d=${shape%%:*}
	c=${shape##*:}
	h=$((2048 / d))
	causal=""
	[ "$c" = 1 ] && causal="--causal"
	for pass in $PASSES; do
		kern='regex:flash_fwd'
		tk='regex:flash_fwd'
		[ "$pass" = bwd ] && kern='regex:fa_bwd_dkdv' && tk='regex:flash_bwd_dq_dk_dv'
		echo "=== D=$d causal=$c $pass (B=4 N=4096 H=$h)" | tee -a "$OUT/ncu-ours.txt" >>"$OUT/ncu-flash.txt"
		timeout 150 "$NCU" --clock-control none -k "$kern" -s 2 -c 1 $SECTIONS $METRICS \
			"$BIN" bench --backend cuda --pass "$pass" --batch 4 --seqlen-q 4096 --heads "$h" --head-dim "$d" $causal \
			--repeats 3 >>"$OUT/ncu-ours.txt" 2>&1
		is_causal=False
		[ "$c" = 1 ] && is_causal=True
		timeout 150 "$NCU" --clock-control none -k "$tk" -s 2 -c 1 $SECTIONS $METRICS python3 -c "
import torch
from torch.nn.attention import sdpa_kernel, SDPBackend
q, k, v = (torch.randn(4, $h, 4096, $d, device='cuda', dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for _ in range(4):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=$is_causal)
        o.backward(torch.ones_like(o))
torch.cuda.synchronize()
" >>"$OUT/ncu-flash.txt" 2>&1
	done
done
tar -czf "$OUT/cache.tgz" -C "$FLASHATTN_CACHE_DIR" . 2>/dev/null
# Headline counters, ours then flash, per profiled kernel.
for f in ours flash; do
	echo "--- $f"
	grep -E '^===|^  [a-z_]+\.sum|^  sm__pipe|Duration|Registers Per|Achieved Occupancy|Executed Ipc Active|Stall (Long|Short|MIO|Math|Wait|Barrier|Not Selected)|Warp Cycles Per Issued|Dynamic Shared|Local Memory Spilling|^    [A-Za-z ]*(flash|fa_)' "$OUT/ncu-$f.txt" | cut -c1-150
done
