"""Request-by-request comparison of kvroute with each peer on the cells bench/peers.sh ran.

    python3 bench/paired.py [--router R] bench/out/DIR [bench/out/DIR2 ...]

Every router of a cell is sent the same requests at the same times, so each request's engine
TTFT under kvroute (R, default kvroute-hybrid) can be set against the same request's under a
peer. Where two routers' medians sit on either side of a step in the TTFT distribution (on the
simulated engines many requests finish either in the step they land in or one step later), the
two p50s can differ by a whole step while the routers serve most requests alike; the paired
figures show that. Per cell and peer (the first run of each): requests paired (by session, turn
and branch; only those both served), the geometric mean of kvroute's TTFT over the peer's, the
median per-request difference in ms, and how many requests kvroute served more than 10 % (and
1 ms) faster and slower.
"""
import collections
import json
import math
import pathlib
import statistics
import sys

PEERS = ("smg-cache", "vr-cache", "vr-kv")


def requests(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        if r.get("failure") or r.get("engine_ttft_s") is None:
            continue
        key = (r.get("session"), r.get("turn"), r.get("branch"))
        # A key seen twice (should not happen) is left out rather than paired wrongly.
        out[key] = None if key in out else r["engine_ttft_s"] * 1e3
    return {k: v for k, v in out.items() if v is not None}


def compare(mine, peer):
    keys = sorted(set(mine) & set(peer))
    if not keys:
        return None
    ratios = [math.log(max(mine[k], 1e-3) / max(peer[k], 1e-3)) for k in keys]
    diffs = [mine[k] - peer[k] for k in keys]
    faster = sum(1 for k in keys if mine[k] < peer[k] * 0.9 and peer[k] - mine[k] > 1)
    slower = sum(1 for k in keys if mine[k] > peer[k] * 1.1 and mine[k] - peer[k] > 1)
    return len(keys), math.exp(statistics.mean(ratios)), statistics.median(diffs), faster, slower


def main(argv):
    router = "kvroute-hybrid"
    if len(argv) > 1 and argv[0] == "--router":
        router, argv = argv[1], argv[2:]
    if not argv:
        sys.exit(__doc__)
    runs = collections.defaultdict(dict)  # cell -> router -> first run's log
    for d in argv:
        for p in sorted(pathlib.Path(d).glob("*.requests.jsonl")):
            parts = p.name[: -len(".requests.jsonl")].rsplit(".", 2)
            if len(parts) != 3:
                continue
            cell, who, _run = parts
            runs[cell].setdefault(who, p)
    print(f"| cell | peer | paired | {router} / peer (geometric mean) | median difference ms "
          f"| {router} faster | slower |")
    print("|---|---|---|---|---|---|---|")
    for cell in sorted(runs):
        if router not in runs[cell]:
            continue
        mine = requests(runs[cell][router])
        for peer in PEERS:
            if peer not in runs[cell]:
                continue
            c = compare(mine, requests(runs[cell][peer]))
            if c is None:
                continue
            n, gm, med, faster, slower = c
            print(f"| {cell} | {peer} | {n} | {gm:.2f} | {med:+.1f} | {faster} | {slower} |")


if __name__ == "__main__":
    main(sys.argv[1:])
