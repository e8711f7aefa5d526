#!/usr/bin/env python3
"""kvroute's TTFT prediction error per run, from the gateway's own histograms.

    python3 bench/prederr.py DIR [DIR ...]

Reads every `CELL.ROUTER.RUN.metrics.prom` that bench/peers.sh saves beside a kvroute run
(GET /metrics at the end of the run) and prints, per run and over all runs of each router,
the streamed answers the gateway predicted a TTFT for, the share whose relative error
|predicted - observed| / observed is at most 5, 10 and 20 % (the histogram's bucket bounds),
the median relative error (interpolated within its histogram bucket, at most 500 %), and the
mean signed error predicted - observed (ms, exact: the histogram's sum over its count;
positive: predicted too slow). The observed TTFT is the gateway's own clock, from
the decision to the first byte of the worker's answer.
"""
import pathlib
import re
import sys

SUM = re.compile(r'^(\w+)_(sum|count)\{[^}]*\}\s+(\S+)$')
LINE = re.compile(r'^(\w+)_bucket\{(?:[^}]*,)?le="([^"]+)"(?:,[^}]*)?\}\s+(\S+)$')


def buckets(text, name):
    """Cumulative counts per upper bound, summed over every worker label."""
    out = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if not m or m.group(1) != name:
            continue
        le = float("inf") if m.group(2) == "+Inf" else float(m.group(2))
        out[le] = out.get(le, 0.0) + float(m.group(3))
    return sorted(out.items())


def sum_count(text, name):
    """The histogram's sum and count, over every worker label."""
    out = [0.0, 0.0]
    for line in text.splitlines():
        m = SUM.match(line)
        if m and m.group(1) == name:
            out[0 if m.group(2) == "sum" else 1] += float(m.group(3))
    return out


def share_under(cum, bound):
    total = cum[-1][1] if cum else 0
    for le, c in cum:
        if le == bound:
            return c / total if total else float("nan")
    return float("nan")


def quantile(cum, q):
    """The q-quantile of a histogram whose first bucket starts at 0, linear within the bucket
    that holds it."""
    total = cum[-1][1] if cum else 0
    if not total:
        return float("nan")
    want, prev_le, prev_c = q * total, 0.0, 0.0
    for le, c in cum:
        if c >= want:
            if le == float("inf"):
                return prev_le
            span = c - prev_c
            return prev_le + (le - prev_le) * ((want - prev_c) / span if span else 0.0)
        prev_le, prev_c = le, c
    return prev_le


def add(a, b):
    d = dict(a)
    for le, c in b:
        d[le] = d.get(le, 0.0) + c
    return sorted(d.items())


def row(name, rel, err):
    n = int(rel[-1][1]) if rel else 0
    if not n:
        return f"| {name} | 0 | | | | | |"
    mean = err[0] / err[1] if err[1] else float("nan")
    return "| {} | {} | {:.0f} % | {:.0f} % | {:.0f} % | {:.1f} % | {:+.1f} |".format(
        name,
        n,
        100 * share_under(rel, 0.05),
        100 * share_under(rel, 0.1),
        100 * share_under(rel, 0.2),
        100 * quantile(rel, 0.5),
        1000 * mean,
    )


def main(dirs):
    if not dirs:
        sys.exit(__doc__)
    totals, rows = {}, []
    for d in dirs:
        for p in sorted(pathlib.Path(d).glob("*.metrics.prom")):
            text = p.read_text()
            rel = buckets(text, "kvroute_ttft_prediction_relative_error")
            err = sum_count(text, "kvroute_ttft_prediction_error_seconds")
            run = p.name[: -len(".metrics.prom")]
            rows.append(row(run, rel, err))
            # CELL(4 parts).ROUTER.RUN
            router = run.split(".")[4] if run.count(".") >= 5 else "?"
            r0, e0 = totals.get(router, ([], []))
            totals[router] = (add(r0, rel), [a + b for a, b in zip(e0 or [0.0, 0.0], err)])
    print("| run | answers | ≤ 5 % | ≤ 10 % | ≤ 20 % | median rel. error | mean predicted − observed ms |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for router, (rel, err) in sorted(totals.items()):
        print(row(f"all {router}", rel, err))


if __name__ == "__main__":
    main(sys.argv[1:])
