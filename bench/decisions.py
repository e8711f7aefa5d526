#!/usr/bin/env python3
"""Two decision logs of the same requests, side by side.

A decision log is what a gateway writes with KVROUTE_DECISION_LOG=FILE: one JSON object a
decision (the request's routing facts, the snapshot it was decided from, the decision). Given
two logs of the same workload (one gateway against three replicas, or two builds), this prints
how many of the decisions, taken in order, went to another worker; the first few of those, with
each worker's snapshot figures that differed; and, per log, the chosen workers' mean figures at
decision time (requests running, prefill queued, predicted TTFT, predicted cached tokens).

    python3 bench/decisions.py A.jsonl B.jsonl [--show N]

Decisions are paired by position; a pair whose prompts differ in length ends the comparison
(the logs are of different requests from there on). Replicas of one process append to one log
in the order they decide, which is the requests' order when each is decided before the next
arrives.
"""
import argparse
import json
import sys

FIELDS = ["cached", "queued_tokens", "running", "ttft", "arrivals_per_ms", "live", "load_wait_ms",
          "decode_delta_ms", "mean_running", "eviction_rate", "outlook"]


def read(path):
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{n}: not JSON ({e})")
    return out


def chosen(entry):
    """The chosen worker's snapshot and candidate entries."""
    name = entry["decision"]["worker"]
    snap = next(w for w in entry["snapshot"]["workers"] if w["name"] == name)
    cand = next(c for c in entry["decision"]["candidates"] if c["worker"] == name)
    return snap, cand


def means(log):
    rows = [chosen(e) for e in log]
    n = max(len(rows), 1)
    return {
        "running": sum(s["running"] for s, _ in rows) / n,
        "queued_tokens": sum(s["queued_tokens"] for s, _ in rows) / n,
        "predicted_ttft_ms": sum(c["predicted_ttft_ms"] for _, c in rows) / n,
        "predicted_cached": sum(c["predicted_cached"] for _, c in rows) / n,
    }


def differing(x, y):
    """Per worker, the snapshot fields whose values differ between two decisions."""
    out = {}
    for wx, wy in zip(x["snapshot"]["workers"], y["snapshot"]["workers"]):
        d = {f: (wx.get(f), wy.get(f)) for f in FIELDS if wx.get(f) != wy.get(f)}
        if d:
            out[wx["name"]] = d
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--show", type=int, default=3, help="decisions that differ to print")
    args = ap.parse_args()
    a, b = read(args.a), read(args.b)
    paired = 0
    moved = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x["request"]["tokens"] != y["request"]["tokens"]:
            print(f"decision {i}: the prompts differ ({x['request']['tokens']} against "
                  f"{y['request']['tokens']} tokens); compared up to there")
            break
        paired += 1
        if x["decision"]["worker"] != y["decision"]["worker"]:
            moved.append(i)
            if len(moved) <= args.show:
                print(f"decision {i}: {x['decision']['worker']} against {y['decision']['worker']}")
                for w, d in differing(x, y).items():
                    print(f"  {w}: " + ", ".join(f"{f} {u} / {v}" for f, (u, v) in d.items()))
    print(f"{len(moved)} of {paired} decisions went to another worker")
    for name, log in ((args.a, a[:paired]), (args.b, b[:paired])):
        m = means(log)
        print(f"{name}: chosen worker's running {m['running']:.2f}, queued "
              f"{m['queued_tokens']:.0f} tokens, predicted TTFT {m['predicted_ttft_ms']:.1f} ms, "
              f"predicted cached {m['predicted_cached']:.0f} tokens")


if __name__ == "__main__":
    main()
