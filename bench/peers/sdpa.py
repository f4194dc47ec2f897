#!/usr/bin/env python3
"""Time PyTorch's scaled_dot_product_attention backends on flashattn's shapes.

Reads the shape list that `flashattn sweep --emit-shapes FILE` writes and
times each case with each SDPA backend (flash, cudnn, mem_eff, and math where
its score matrices fit the --math-max-gib limit), writing a results file in
flashattn's schema ("flashattn-bench/1"): one record per (case, backend), with
status "ok", "unsupported" (the backend refuses the shape or option, with the
reason) or "error".

Timing (the default, --timer events) mirrors flashattn's own harness: one
first call, warm-up for --warmup-ms, then as many repeats as fill --rep-ms
(10 to 1000), each between two CUDA events on the current stream, rotating
among input sets that together exceed twice the L2 cache; the median, min and
max are recorded. --timer do_bench uses triton.testing.do_bench instead (which
clears the L2 between repeats) and records its median only.

The backward is timed as torch.autograd.grad of a retained graph: the forward
runs once per input set outside the timed region, and each timed repeat runs
only the backward kernels (plus the autograd engine's bookkeeping). The
forward-plus-backward pass ("fwdbwd") times both.

Operations are counted as flashattn counts them: 2*B*H*(DK+DV) per visible
query-key pair for the forward, 2.5x that for the backward, 3.5x for both.

Inputs are standard normal (never zeros). GQA (kv_heads < heads) is passed
with enable_gqa=True; a backend that refuses that is timed with k and v
expanded to all heads beforehand, and the record's kernel_variant says so.
Causal with seqlen_q != seqlen_k uses PyTorch's causal_lower_right bias for
bottom-right alignment and is_causal for top-left. Sliding windows and
softcap do not exist in SDPA: those cases are recorded as unsupported. A bias
("bias": "bhnm", "1hnm", "b1nm" or "11nm", a 1 where it broadcasts) is passed as
a float attn_mask of the case's dtype, drawn once and shared by every input
set (under a causal mask, the bias with -inf where the mask hides the key, as
one tensor); with "bias_grad" the backward returns its gradient too.
Deterministic cases run under torch.use_deterministic_algorithms(True);
a backend that has no deterministic backward raises, which is recorded.

Usage: python3 sdpa.py --shapes shapes.json --out peers.json
Needs torch (and triton for --timer do_bench); nothing else beyond Python's
standard library.
"""

import argparse
import datetime
import json
import math
import os
import socket
import sys
import time
import warnings

# Deterministic cases turn on torch.use_deterministic_algorithms, under which
# cuBLAS needs a fixed workspace; it must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

SCHEMA = "flashattn-bench/1"
SHAPES_SCHEMA = "flashattn-shapes/1"
BACKENDS = ["flash", "cudnn", "mem_eff", "math"]
CASE_FIELDS = [
    "preset", "dtype", "batch", "seqlen_q", "seqlen_k", "heads", "kv_heads",
    "head_dim", "head_dim_v", "causal", "align", "window", "softcap",
    "dropout", "bias", "bias_grad", "deterministic", "pass",
]


class Unsupported(Exception):
    """A valid case the backend does not run."""


def pass_factor(p):
    return {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[p]


def visible_pairs(n, m, causal, align, window):
    """Visible (query, key) pairs of one sequence, as attn.Problem counts them."""
    left, right = -1, -1
    if window:
        left = window["left"] if window["left"] >= 0 else -1
        right = window["right"] if window["right"] >= 0 else -1
    if causal and right != 0:
        right = 0
    if left < 0 and right < 0:
        return n * m
    off = m - n if align != "top-left" else 0
    total = 0
    for i in range(n):
        d = i + off
        lo, hi = 0, m
        if left >= 0:
            lo = max(lo, d - left)
        if right >= 0:
            hi = min(hi, d + right + 1)
        if hi > lo:
            total += hi - lo
    return total


def flops(c):
    pairs = visible_pairs(c["seqlen_q"], c["seqlen_k"], c["causal"], c["align"], c.get("window"))
    fwd = 2.0 * c["batch"] * c["heads"] * pairs * (c["head_dim"] + c["head_dim_v"])
    return fwd * pass_factor(c["pass"])


def case_bytes(c):
    es = 4 if c["dtype"] == "fp32" else 2
    b, n, m, h, hk = c["batch"], c["seqlen_q"], c["seqlen_k"], c["heads"], c["kv_heads"]
    dk, dv = c["head_dim"], c["head_dim_v"]
    q, k, v, o = b * n * h * dk, b * m * hk * dk, b * m * hk * dv, b * n * h * dv
    total = (q + k + v + o) * es + b * h * n * 4
    if c["pass"] != "fwd":
        total += (q + k + v + o) * es + b * h * n * 4
    shape = bias_shape(c)
    if shape:
        bias = math.prod(shape) * es
        total += bias * (2 if c.get("bias_grad") and c["pass"] != "fwd" else 1)
    return total


def bias_shape(c):
    """The shape of the case's bias, [B or 1, H or 1, N, M], or None."""
    s = c.get("bias") or ""
    if not s:
        return None
    return [c["batch"] if s[0] == "b" else 1, c["heads"] if s[1] == "h" else 1, c["seqlen_q"], c["seqlen_k"]]


def rotation_sets(set_bytes, cache_bytes, max_sets=64):
    if cache_bytes <= 0 or set_bytes <= 0:
        return 1
    return max(1, min(max_sets, -(-2 * cache_bytes // set_bytes)))


def summarize(ms):
    s = sorted(ms)
    n = len(s)
    med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return med, s[0], s[-1]


class Peer:
    def __init__(self, torch, args):
        self.torch = torch
        self.args = args
        from torch.nn.attention import SDPBackend, sdpa_kernel
        self.sdpa_kernel = sdpa_kernel
        self.kinds = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "mem_eff": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH,
        }
        props = torch.cuda.get_device_properties(0)
        self.device_name = props.name
        self.l2 = getattr(props, "L2_cache_size", 0) or (60 << 20)

    def dtype(self, name):
        t = self.torch
        return {"bf16": t.bfloat16, "fp16": t.float16, "fp32": t.float32}[name]

    def make_call(self, c, backend, expand):
        """Returns (fn(set) -> None, sets, variant) for one case and backend."""
        t = self.torch
        F = t.nn.functional
        if c.get("window"):
            raise Unsupported("sdpa has no sliding window")
        if c.get("softcap", 0) > 0:
            raise Unsupported("sdpa has no softcap")
        b, n, m, h, hk = c["batch"], c["seqlen_q"], c["seqlen_k"], c["heads"], c["kv_heads"]
        dk, dv = c["head_dim"], c["head_dim_v"]
        if backend == "math":
            need = b * h * n * m * 4 * 4 / 2**30  # fp32 scores, probabilities and their gradients
            if need > self.args.math_max_gib:
                raise Unsupported("math backend skipped: its score matrices need about %.1f GiB (limit %g GiB)" %
                                  (need, self.args.math_max_gib))
        dt = self.dtype(c["dtype"])
        kwargs = {"dropout_p": float(c.get("dropout", 0.0))}
        mask = None
        if c["causal"]:
            if n == m or c["align"] == "top-left":
                kwargs["is_causal"] = True
            else:
                from torch.nn.attention.bias import causal_lower_right
                mask = causal_lower_right(n, m)
        gqa = hk != h
        variant = ""
        if gqa and not expand:
            kwargs["enable_gqa"] = True
        elif gqa:
            variant = "kv expanded to all heads (enable_gqa refused)"
        need_grad = c["pass"] != "fwd"
        sets = rotation_sets(case_bytes(c), self.l2)
        gen = t.Generator(device="cuda")
        gen.manual_seed(hash((b, n, m, h, hk, dk, dv)) & 0x7FFFFFFF)
        bias_grad = False
        shape = bias_shape(c)
        if shape:
            bias = t.randn(*shape, device="cuda", dtype=dt, generator=gen)
            if c["causal"]:
                off = m - n if c["align"] != "top-left" else 0
                visible = t.ones(n, m, device="cuda", dtype=t.bool).tril(diagonal=off)
                bias = bias.masked_fill(~visible, float("-inf"))
                kwargs.pop("is_causal", None)
            bias_grad = bool(c.get("bias_grad")) and need_grad
            mask = bias.requires_grad_(bias_grad)
        data = []
        for _ in range(sets):
            q = t.randn(b, h, n, dk, device="cuda", dtype=dt, generator=gen)
            k = t.randn(b, hk, m, dk, device="cuda", dtype=dt, generator=gen)
            v = t.randn(b, hk, m, dv, device="cuda", dtype=dt, generator=gen)
            if gqa and expand:
                k = k.repeat_interleave(h // hk, dim=1).contiguous()
                v = v.repeat_interleave(h // hk, dim=1).contiguous()
            for x in (q, k, v):
                x.requires_grad_(need_grad)
            d = {"q": q, "k": k, "v": v}
            if need_grad:
                d["do"] = t.randn(b, h, n, dv, device="cuda", dtype=dt, generator=gen)
            data.append(d)
        kind = self.kinds[backend]

        def inputs(d):
            return (d["q"], d["k"], d["v"], mask) if bias_grad else (d["q"], d["k"], d["v"])

        def fwd(d):
            if mask is not None:
                return F.scaled_dot_product_attention(d["q"], d["k"], d["v"], attn_mask=mask, **kwargs)
            return F.scaled_dot_product_attention(d["q"], d["k"], d["v"], **kwargs)

        p = c["pass"]
        if p == "fwd":
            def run(i):
                with t.no_grad(), self.sdpa_kernel([kind]):
                    fwd(data[i % sets])
        elif p == "bwd":
            with self.sdpa_kernel([kind]):
                for d in data:
                    d["out"] = fwd(d)

            def run(i):
                d = data[i % sets]
                with self.sdpa_kernel([kind]):
                    t.autograd.grad(d["out"], inputs(d), d["do"], retain_graph=True)
        else:
            def run(i):
                d = data[i % sets]
                with self.sdpa_kernel([kind]):
                    out = fwd(d)
                    t.autograd.grad(out, inputs(d), d["do"])
        return run, sets, variant

    def measure(self, run, sets):
        t = self.torch
        a = self.args
        t0 = time.perf_counter()
        run(0)
        t.cuda.synchronize()
        first = (time.perf_counter() - t0) * 1e3
        if a.timer == "do_bench":
            import triton.testing
            counter = [0]

            def fn():
                counter[0] += 1
                run(counter[0])
            med = triton.testing.do_bench(fn, warmup=a.warmup_ms, rep=a.rep_ms, return_mode="median")
            return med, med, med, 0, first
        n = 0
        t0 = time.perf_counter()
        while n == 0 or (time.perf_counter() - t0) * 1e3 < a.warmup_ms:
            for i in range(sets):
                run(i)
            n += sets
            t.cuda.synchronize()
        per = (time.perf_counter() - t0) * 1e3 / n
        reps = int(a.rep_ms / per) if per > 0 else 1000
        reps = min(max(reps, 10), 1000)
        starts = [t.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [t.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            run(i + 1)
            ends[i].record()
        t.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        med, lo, hi = summarize(times)
        return med, lo, hi, reps, first

    def one(self, c, backend):
        t = self.torch
        rec = {k: c.get(k) for k in CASE_FIELDS if k in c}
        rec.update({
            "implementation": "torch-" + backend,
            "backend": "sdpa",
            "device": self.device_name,
            "flops": flops(c),
            "median_ms": 0, "min_ms": 0, "max_ms": 0, "repeats": 0,
            "tflops": 0,
            "status": "ok",
        })
        det = bool(c.get("deterministic"))
        prev_det = t.are_deterministic_algorithms_enabled()
        expand = False
        try:
            t.use_deterministic_algorithms(det)
            while True:
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        try:
                            run, sets, variant = self.make_call(c, backend, expand)
                            med, lo, hi, reps, first = self.measure(run, sets)
                        except t.cuda.OutOfMemoryError:
                            raise
                        except RuntimeError as e:
                            reasons = "; ".join(str(w.message).splitlines()[0] for w in caught
                                                if "sdp" in str(w.message).lower() or "kernel" in str(w.message).lower())
                            raise RuntimeError("%s%s" % (str(e).splitlines()[0], (" (" + reasons + ")") if reasons else ""))
                    break
                except t.cuda.OutOfMemoryError:
                    raise
                except RuntimeError as e:
                    msg = str(e)
                    if c["kv_heads"] != c["heads"] and not expand and "No available kernel" in msg:
                        expand = True
                        t.cuda.empty_cache()
                        continue
                    raise
            rec.update({"median_ms": med, "min_ms": lo, "max_ms": hi, "repeats": reps, "first_ms": first})
            if variant:
                rec["kernel_variant"] = variant
            rec["tflops"] = rec["flops"] / (med * 1e-3) / 1e12 if med > 0 else 0
        except Unsupported as e:
            rec.update({"status": "unsupported", "message": str(e)})
        except t.cuda.OutOfMemoryError as e:
            rec.update({"status": "unsupported", "message": "out of memory: " + str(e).splitlines()[0]})
        except RuntimeError as e:
            msg = " ".join(str(e).split())[:400]
            unsupported = any(s in msg for s in ("No available kernel", "not supported", "does not support",
                                                 "deterministic", "Unsupported"))
            rec.update({"status": "unsupported" if unsupported else "error", "message": msg})
        except Exception as e:  # a failure of one case must not end the run
            rec.update({"status": "error", "message": "%s: %s" % (type(e).__name__, " ".join(str(e).split())[:400])})
        finally:
            t.use_deterministic_algorithms(prev_det)
            t.cuda.synchronize()
            t.cuda.empty_cache()
        return rec


def write_json(path, doc):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", required=True, help="shape list from flashattn sweep --emit-shapes")
    ap.add_argument("--out", required=True, help="results file to write")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated SDPA backends")
    ap.add_argument("--timer", choices=["events", "do_bench"], default="events")
    ap.add_argument("--warmup-ms", type=float, default=25.0)
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--math-max-gib", type=float, default=16.0,
                    help="skip the math backend when its score matrices need more")
    ap.add_argument("--time-limit", type=float, default=0, help="start no case after this many seconds (0: none)")
    args = ap.parse_args(argv)

    with open(args.shapes) as f:
        shapes = json.load(f)
    if shapes.get("schema") != SHAPES_SCHEMA:
        sys.exit("sdpa.py: %s has schema %r, want %r" % (args.shapes, shapes.get("schema"), SHAPES_SCHEMA))
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            sys.exit("sdpa.py: unknown backend %r (have %s)" % (b, ", ".join(BACKENDS)))

    doc = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "command": "python3 " + " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "host": socket.gethostname(),
        "records": [],
    }
    reason = ""
    try:
        import torch
        if not torch.cuda.is_available():
            reason = "no CUDA device visible to torch"
    except ImportError as e:
        reason = "torch cannot be imported: %s" % e
    if reason:
        for c in shapes["cases"]:
            for b in backends:
                rec = {k: c.get(k) for k in CASE_FIELDS if k in c}
                rec.update({"implementation": "torch-" + b, "backend": "sdpa", "device": "", "flops": flops(c),
                            "median_ms": 0, "min_ms": 0, "max_ms": 0, "repeats": 0, "tflops": 0,
                            "status": "unsupported", "message": reason})
                doc["records"].append(rec)
        write_json(args.out, doc)
        print("sdpa.py: %s; wrote %d unsupported records" % (reason, len(doc["records"])))
        return 0
    doc["command"] += "  # torch %s, CUDA %s, cuDNN %s" % (torch.__version__, torch.version.cuda,
                                                          torch.backends.cudnn.version())
    peer = Peer(torch, args)
    cases = shapes["cases"]
    total = len(cases) * len(backends)
    start = time.time()
    done = 0
    for c in cases:
        for b in backends:
            if args.time_limit and time.time() - start > args.time_limit:
                print("sdpa.py: time limit reached after %d of %d measurements" % (done, total))
                write_json(args.out, doc)
                return 0
            rec = peer.one(c, b)
            doc["records"].append(rec)
            done += 1
            write_json(args.out, doc)
            status = "%.1f TFLOP/s" % rec["tflops"] if rec["status"] == "ok" else rec["status"] + ": " + rec.get("message", "")[:100]
            print("[%d/%d %.0fs] %s %s B%d N%d M%d H%d/%d D%d/%d%s%s %s: %s" % (
                done, total, time.time() - start, rec["implementation"], c.get("preset", ""), c["batch"], c["seqlen_q"],
                c["seqlen_k"], c["heads"], c["kv_heads"], c["head_dim"], c["head_dim_v"],
                " causal" if c["causal"] else "", " det" if c.get("deterministic") else "", c["pass"], status))
    write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
