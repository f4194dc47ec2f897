#!/usr/bin/env python3
"""Summarizes Nsight Compute's per-instruction warp-state samples.

Reads the CSV that `ncu --import REPORT --page source --csv --print-source sass`
writes (plain or gzip-compressed; one section per profiled kernel, each opening
with a "Kernel Name" line) and prints for each kernel:

  - the stall reasons' shares of all warp samples;
  - the instructions holding the most samples, with their two main reasons and
    how many times each warp instruction executed (instructions executed the
    same number of times belong to the same loop, or the same warps' loop); a
    branch that closes a polling loop (an mbarrier try_wait's) is followed by
    the instruction before it, which names the barrier's address;
  - the opcodes' shares of the samples beside their shares of the executed
    warp instructions.

With --details FILE (the CSV of `ncu --import REPORT --page details --csv`)
it first prints each kernel's duration and issue figures from that file.

Usage: python3 bench/ncu_source.py [--top N] [--details FILE] FILE.csv[.gz] ...
bench/ncu-source.sh collects the CSV on the GPU machine and runs this.
"""

import argparse
import collections
import csv
import gzip
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def open_text(path):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", newline="")
    return open(path, newline="")


def kernels(path):
    """Yields (kernel name, header, rows) for each kernel section of path."""
    name, header, rows = None, None, []
    with open_text(path) as f:
        for r in csv.reader(f):
            if not r:
                continue
            if r[0] == "Kernel Name":
                if header is not None:
                    yield name, header, rows
                name, header, rows = (r[1] if len(r) > 1 else "?"), None, []
            elif header is None and r[0] == "Address":
                header = r
            elif header is not None and len(r) == len(header):
                rows.append(r)
    if header is not None:
        yield name, header, rows


def number(s):
    try:
        return int(float(s.replace(",", ""))) if s not in ("", "-") else 0
    except ValueError:
        return 0


def opcode(sass):
    """The opcode of a SASS line without its predicate and modifiers."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def summarize(name, header, rows, top, out):
    col = {h: i for i, h in enumerate(header)}
    if SAMPLES not in col or "Source" not in col:
        print("%s: no warp-state samples in this section (was SourceCounters collected?)" % name, file=out)
        return
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    samples = [number(r[col[SAMPLES]]) for r in rows]
    executed = [number(r[col[EXECUTED]]) if EXECUTED in col else 0 for r in rows]
    total, total_exec = sum(samples), sum(executed)
    print("kernel %s: %d instructions, %d warp samples, %d warp instructions executed" % (name, len(rows), total, total_exec), file=out)
    if total == 0:
        return
    by_reason = {h: sum(number(r[col[h]]) for r in rows) for h in reasons}
    shares = ", ".join("%s %.1f %%" % (h[len("stall_"):], 100.0 * v / total)
                       for h, v in sorted(by_reason.items(), key=lambda x: -x[1]) if v > 0)
    print("  stall reasons: " + shares, file=out)
    print("  instructions with the most samples (share, address, SASS, main reasons, executed):", file=out)
    order = sorted(range(len(rows)), key=lambda i: -samples[i])[:top]
    for i in order:
        r = rows[i]
        main = sorted(((number(r[col[h]]), h) for h in reasons), reverse=True)[:2]
        why = " ".join("%s:%d" % (h[len("stall_"):], v) for v, h in main if v > 0)
        print("    %5.1f %%  %s  %-58s %-32s %d" % (100.0 * samples[i] / total, r[col["Address"]], r[col["Source"]].strip()[:58], why, executed[i]), file=out)
        if opcode(r[col["Source"]].strip()) == "BRA" and i > 0 and "WAIT" in rows[i - 1][col["Source"]]:
            print("              after %s" % rows[i - 1][col["Source"]].strip(), file=out)
    ops, ops_exec = collections.Counter(), collections.Counter()
    for r, s, e in zip(rows, samples, executed):
        op = opcode(r[col["Source"]].strip())
        ops[op] += s
        ops_exec[op] += e
    print("  opcodes (share of samples, of executed warp instructions):", file=out)
    for op, s in ops.most_common(top):
        print("    %-12s %5.1f %%  %5.1f %%" % (op, 100.0 * s / total, 100.0 * ops_exec[op] / max(1, total_exec)), file=out)


HEADLINE = ("Duration", "Compute (SM) Throughput", "Issue Slots Busy", "Issued Warp Per Scheduler",
            "Eligible Warps Per Scheduler", "Warp Cycles Per Issued Instruction", "Registers Per Thread")


def details(path, out):
    """Prints the HEADLINE metrics of each kernel in ncu's details CSV."""
    with open_text(path) as f:
        rows = list(csv.reader(f))
    if not rows:
        return
    col = {h: i for i, h in enumerate(rows[0])}
    need = ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")
    if any(h not in col for h in need):
        print("%s: not a details page" % path, file=out)
        return
    seen = collections.OrderedDict()
    for r in rows[1:]:
        if len(r) <= max(col[h] for h in need) or r[col["Metric Name"]] not in HEADLINE:
            continue
        key = (r[col["ID"]], r[col["Kernel Name"]])
        seen.setdefault(key, {})[r[col["Metric Name"]]] = (r[col["Metric Value"]] + " " + r[col["Metric Unit"]]).strip()
    for (_, name), m in seen.items():
        print("kernel %s: " % name + ", ".join("%s %s" % (k, m[k]) for k in HEADLINE if k in m), file=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=15, help="instructions and opcodes listed per kernel")
    ap.add_argument("--details", help="ncu's details page (CSV) of the same report")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    if args.details:
        details(args.details, sys.stdout)
    found = False
    for path in args.files:
        for name, header, rows in kernels(path):
            found = True
            summarize(name, header, rows, args.top, sys.stdout)
    if not found:
        print("no kernel section in %s" % ", ".join(args.files), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
