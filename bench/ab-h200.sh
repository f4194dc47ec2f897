#!/usr/bin/env bash
# Times two or more builds of flashattn against each other on the same
# machine: `flashattn bench` of every case by every build, the builds
# alternating within each case and each case timed ROUNDS times, so that
# clock drift falls on all of them alike. The summary (printed last, and in
# $OUT/summary.txt) gives per case and build the mean of the rounds' median
# times, the rate, and each build's speed relative to the first one
# (its time ÷ the build's; above 1: faster), overall and round by round.
#
# Build the binaries where Go is, one per commit, e.g.
#
#   git worktree add /tmp/old <commit> && (cd /tmp/old && CGO_ENABLED=0 go build -o "$PWD/.bin/flashattn-old" ./cmd/flashattn)
#   CGO_ENABLED=0 go build -o .bin/flashattn ./cmd/flashattn
#
# then, on the GPU machine, from the repository root with .bin copied along:
#
#   CASES="--heads 16 --head-dim 128 --bias 1hnm; --heads 32 --head-dim 64 --bias 1hnm" bash bench/ab-h200.sh
#
# A build may also be the same binary under settings of its own: ENV_LABEL
# (LABEL as in BUILDS, each character other than a letter, digit or _ as _)
# holds VAR=VALUE words that build's runs get, e.g.
#
#   BUILDS="base=.bin/flashattn noct=.bin/flashattn" ENV_noct="FLASHATTN_FWD_CARRY_TURNS=0" \
#     COMMON="--pass fwd --budget 200ms" CASES="--batch 32 --seqlen-q 512 --heads 16 --head-dim 128" bash bench/ab-h200.sh
#
# Environment: BUILDS (space-separated LABEL=PATH; default
# old=.bin/flashattn-old new=.bin/flashattn), ENV_LABEL, CASES (flag sets separated by
# ";", each added to COMMON), COMMON (default "--pass bwd --batch 4
# --seqlen-q 4096 --budget 300ms"), ROUNDS (2), LIMIT (seconds a run, 120),
# OUT (default .ab-out). Each run's raw line (case, build, round, median ms,
# TFLOP/s, the kernel variant it ran, flags) goes to $OUT/times.txt. Stopped
# by a TERM (a timeout around the script), it summarizes the runs done and
# says so in $OUT/stopped.txt.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/.ab-out}
BUILDS=${BUILDS:-old=$ROOT/.bin/flashattn-old new=$ROOT/.bin/flashattn}
COMMON=${COMMON:---pass bwd --batch 4 --seqlen-q 4096 --budget 300ms}
ROUNDS=${ROUNDS:-2}
LIMIT=${LIMIT:-120}
: "${CASES:?CASES: flag sets separated by ';'}"
mkdir -p "$OUT"
TIMES=$OUT/times.txt
: >"$TIMES"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
mkdir -p "$FLASHATTN_CACHE_DIR"
[ -f "$ROOT/.bin/cache.tgz" ] && tar -xzf "$ROOT/.bin/cache.tgz" -C "$FLASHATTN_CACHE_DIR"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/env.txt"
date -u | tee -a "$OUT/env.txt"

# A TERM (from a timeout around the script, which signals the run under way
# too) stops the runs, and the summary of those done still follows.
stopped=
trap 'stopped=1' TERM
IFS=';' read -ra cases <<<"$CASES"
for i in "${!cases[@]}"; do
	c=$(echo "${cases[$i]}" | xargs)
	[ -z "$c" ] && continue
	for r in $(seq "$ROUNDS"); do
		for build in $BUILDS; do
			[ -n "$stopped" ] && break 3
			label=${build%%=*} bin=${build#*=}
			envvar=ENV_${label//[^A-Za-z0-9_]/_}
			# shellcheck disable=SC2086 # the flag sets and the settings are word lists
			line=$(timeout "$LIMIT" env ${!envvar:-} "$bin" bench $COMMON $c --json 2>>"$OUT/err.txt" |
				python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["median_ms"], r["tflops"], r.get("kernel_variant", ""))' 2>>"$OUT/err.txt")
			printf '%d\t%s\t%d\t%s\t%s\n' "$i" "$label" "$r" "${line:-failed}" "$c" | tee -a "$TIMES"
		done
	done
done

[ -n "$stopped" ] && echo "stopped by TERM: the summary covers the runs done" | tee "$OUT/stopped.txt"
python3 - "$TIMES" "$BUILDS" <<'EOF' | tee "$OUT/summary.txt"
import collections, sys
labels = [b.split("=", 1)[0] for b in sys.argv[2].split()]
ms, rate, flags, by_round = collections.defaultdict(list), collections.defaultdict(list), {}, {}
for line in open(sys.argv[1]):
    f = line.rstrip("\n").split("\t")
    if len(f) < 5 or f[3] == "failed":
        continue
    t, r = f[3].split()[:2]
    ms[(f[0], f[1])].append(float(t))
    by_round[(f[0], f[1], f[2])] = float(t)
    rate[(f[0], f[1])].append(float(r))
    flags[f[0]] = f[4]
print("| case | " + " | ".join(f"{l} ms (TFLOP/s)" for l in labels) + " | " + " | ".join(f"{l} ×" for l in labels[1:]) +
      " | " + " | ".join(f"{l} × by round" for l in labels[1:]) + " |")
print("|---|" + "--:|" * (2 * len(labels) - 1) + "---|" * (len(labels) - 1))
for c in sorted(flags, key=int):
    cells, base = [], None
    for l in labels:
        v = ms.get((c, l))
        if not v:
            cells.append("failed")
            continue
        m = sum(v) / len(v)
        base = m if l == labels[0] else base
        cells.append(f"{m:.3f} ({sum(rate[(c, l)]) / len(v):.1f})")
    ratios, rounds = [], []
    rs = sorted({k[2] for k in by_round if k[0] == c}, key=int)  # the case's rounds
    for l in labels[1:]:
        v = ms.get((c, l))
        ratios.append(f"{base / (sum(v) / len(v)):.3f}" if v and base else "—")
        # each round's ratio: the first build's time ÷ this build's, in the same round
        rounds.append(", ".join(f"{by_round[(c, labels[0], r)] / by_round[(c, l, r)]:.3f}" for r in rs
                                if (c, labels[0], r) in by_round and (c, l, r) in by_round) or "—")
    print(f"| {flags[c]} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " | " + " | ".join(rounds) + " |")
EOF
