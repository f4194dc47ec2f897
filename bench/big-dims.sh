#!/usr/bin/env bash
# Times flashattn against PyTorch's mem_eff SDPA backend past D = 256, in one
# run on a GPU machine: the headdim preset's shape (B = 1, H = 16, N = 4096,
# not causal), forward and backward, for the head dims in DIMS. Binaries built
# first where Go is (CGO_ENABLED=0 go build -o .bin/flashattn ./cmd/flashattn),
# .bin copied along. Logs under $OUT; the table (TFLOP/s and ratios) prints last.
#
# Environment: DIMS (default "320 352 384 448 512"), PASSES (fwd bwd),
# PEER (SDPA backend, default mem_eff).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/.big-out}
DIMS=${DIMS:-320 352 384 448 512}
PASSES=${PASSES:-fwd bwd}
PEER=${PEER:-mem_eff}
BIN=$ROOT/.bin/flashattn
mkdir -p "$OUT"
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
mkdir -p "$FLASHATTN_CACHE_DIR"
[ -f "$ROOT/.bin/cache.tgz" ] && tar -xzf "$ROOT/.bin/cache.tgz" -C "$FLASHATTN_CACHE_DIR"
LIBS=/usr/local/nvidia/lib64:/usr/local/cuda/lib64
ours="$OUT/big-ours.tsv"
: >"$ours"
for d in $DIMS; do
	for pass in $PASSES; do
		r=$(LD_LIBRARY_PATH=$LIBS timeout 120 "$BIN" bench --backend cuda --pass "$pass" --batch 1 --seqlen-q 4096 \
			--heads 16 --head-dim "$d" 2>>"$OUT/big-ours.log" | tee -a "$OUT/big-ours.log" | awk '/^rate/ {print $2}')
		printf "%s\t%s\t%s\n" "$d" "$pass" "${r:-0}" >>"$ours"
	done
done
"$BIN" sweep --preset headdim --emit-shapes "$OUT/big-shapes-all.json" >/dev/null
python3 - "$OUT/big-shapes-all.json" "$OUT/big-shapes.json" "$DIMS" "$PASSES" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
dims = {int(d) for d in sys.argv[3].split()}
passes = set(sys.argv[4].split())
doc["cases"] = [c for c in doc["cases"] if c["head_dim"] in dims and c["pass"] in passes]
json.dump(doc, open(sys.argv[2], "w"))
PY
timeout 300 python3 "$ROOT/bench/peers/sdpa.py" --shapes "$OUT/big-shapes.json" --out "$OUT/big-peers.json" \
	--backends "$PEER" >"$OUT/big-peers.log" 2>&1
python3 - "$ours" "$OUT/big-peers.json" "$PEER" <<'PY'
import json, sys
peer = {}
try:
    for r in json.load(open(sys.argv[2])).get("records", []):
        if r.get("status") == "ok":
            peer[(r["head_dim"], r["pass"])] = r["tflops"]
except (OSError, ValueError) as e:
    print("no peer results:", e)
print("| D | pass | ours TFLOP/s | %s TFLOP/s | ours / %s |" % (sys.argv[3], sys.argv[3]))
print("|---|---|--:|--:|--:|")
for line in open(sys.argv[1]):
    d, p, r = line.split()
    o, q = float(r), peer.get((int(d), p), 0)
    print("| %s | %s | %.0f | %.0f | %s |" % (d, p, o, q, "%.2f" % (o / q) if q else "-"))
PY
