"""Request-by-request comparison of kvroute with each peer on the cells bench/peers.sh ran.

    python3 bench/paired.py [--router R] [--e2e] bench/out/DIR [bench/out/DIR2 ...]
    python3 bench/paired.py --ab [--router R] [--e2e] bench/out/A bench/out/B

Every router of a cell is sent the same requests at the same times, so each request's engine
TTFT under kvroute (R, default kvroute-hybrid) can be set against the same request's under a
peer. Where two routers' medians sit on either side of a step in the TTFT distribution (on the
simulated engines many requests finish either in the step they land in or one step later), the
two p50s can differ by a whole step while the routers serve most requests alike; the paired
figures show that. Per cell and peer (the first run of each): requests paired (by session, turn
and branch; only those both served), the geometric mean of kvroute's TTFT over the peer's, the
median per-request difference in ms, and how many requests kvroute served more than 10 % (and
1 ms) faster and slower. `--e2e` compares each request's end-to-end latency (the client's
clock, first byte sent to last byte received) instead of its engine TTFT.

`--ab A B` compares two settings of one router instead (an ablation: `KVROUTE_ARGS` in one
directory, not in the other): every run of R in A against the same cell and run number in B,
"faster" meaning A's.
"""
import collections
import json
import math
import pathlib
import statistics
import sys

PEERS = ("smg-cache", "vr-cache", "vr-kv")


def requests(path, field="engine_ttft_s"):
    out = {}
    for line in open(path):
        r = json.loads(line)
        if r.get("failure") or r.get(field) is None:
            continue
        key = (r.get("session"), r.get("turn"), r.get("branch"))
        # A key seen twice (should not happen) is left out rather than paired wrongly.
        out[key] = None if key in out else r[field] * 1e3
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


def ab(router, field, a, b):
    """Each run of `router` in directory a against the same cell and run in directory b."""
    what = "end-to-end" if field == "e2e_s" else "TTFT"
    print(f"| cell | run | paired | A / B ({what}, geometric mean) | median difference ms "
          f"| A faster | slower |")
    print("|---|---|---|---|---|---|---|")
    for p in sorted(pathlib.Path(a).glob(f"*.{router}.*.requests.jsonl")):
        q = pathlib.Path(b) / p.name
        if not q.exists():
            continue
        cell, _who, run = p.name[: -len(".requests.jsonl")].rsplit(".", 2)
        c = compare(requests(p, field), requests(q, field))
        if c is None:
            continue
        n, gm, med, faster, slower = c
        print(f"| {cell} | {run} | {n} | {gm:.2f} | {med:+.1f} | {faster} | {slower} |")


def main(argv):
    router, field, is_ab = "kvroute-hybrid", "engine_ttft_s", False
    while argv and argv[0] in ("--router", "--e2e", "--ab"):
        if argv[0] == "--e2e":
            field, argv = "e2e_s", argv[1:]
        elif argv[0] == "--ab":
            is_ab, argv = True, argv[1:]
        elif len(argv) > 1:
            router, argv = argv[1], argv[2:]
        else:
            sys.exit(__doc__)
    if not argv or (is_ab and len(argv) != 2):
        sys.exit(__doc__)
    if is_ab:
        ab(router, field, argv[0], argv[1])
        return
    runs = collections.defaultdict(dict)  # cell -> router -> first run's log
    for d in argv:
        for p in sorted(pathlib.Path(d).glob("*.requests.jsonl")):
            parts = p.name[: -len(".requests.jsonl")].rsplit(".", 2)
            if len(parts) != 3:
                continue
            cell, who, _run = parts
            runs[cell].setdefault(who, p)
    what = "end-to-end" if field == "e2e_s" else "TTFT"
    print(f"| cell | peer | paired | {router} / peer ({what}, geometric mean) | median difference ms "
          f"| {router} faster | slower |")
    print("|---|---|---|---|---|---|---|")
    for cell in sorted(runs):
        if router not in runs[cell]:
            continue
        mine = requests(runs[cell][router], field)
        for peer in PEERS:
            if peer not in runs[cell]:
                continue
            c = compare(mine, requests(runs[cell][peer], field))
            if c is None:
                continue
            n, gm, med, faster, slower = c
            print(f"| {cell} | {peer} | {n} | {gm:.2f} | {med:+.1f} | {faster} | {slower} |")


if __name__ == "__main__":
    main(sys.argv[1:])
