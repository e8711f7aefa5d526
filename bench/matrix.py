"""The peer matrix as a Markdown table, from the JSON files bench/peers.sh wrote.

    python3 bench/matrix.py bench/out [bench/out/MORE ...]

One row per cell (workload.preset.pool.load, with ` ×N` when the router ran as N replicas behind
a balancer: the JSON's per-target `replicas`) and router: reuse, the arrival-time oracle, TTFT
p50/p99 (engine time), inter-token latency and end-to-end latency p50 (client time),
failures, as means over the repeated runs with their range (the runs of every directory
given); then, per cell, kvroute hybrid-aware against the best peer (SMG and vllm-router
policies, SMG's mesh among them). Writes the table to the first directory's matrix.md too.
"""
import collections
import json
import pathlib
import statistics
import sys

PEERS = ("smg-cache", "smg-mesh", "vr-cache", "vr-kv")
ORDER = ("kvroute-hybrid", "kvroute-isolated", "kvroute-blind", "smg-cache", "smg-mesh", "vr-cache", "vr-kv", "round-robin")


def load(outs):
    runs = collections.defaultdict(list)
    for p in sorted(q for out in outs for q in pathlib.Path(out).glob("*.json")):
        parts = p.name.split(".")
        # CELL(4 parts).ROUTER.RUN.json; a run's saved /admin/workers (.workers.json) is not one.
        if len(parts) != 7:
            continue
        cell, router = ".".join(parts[:4]), parts[4]
        target = json.loads(p.read_text())["targets"][0]
        replicas = len(target.get("replicas") or [None])
        if replicas > 1:
            cell += f" ×{replicas}"
        runs[(cell, router)].append(target)
    return runs


def get(r, key):
    """A figure of one run: `key` or `key.sub` (e.g. `e2e_ms.p50`)."""
    for k in key.split("."):
        r = r[k]
    return r


def mean(rs, key):
    return statistics.fmean(get(r, key) for r in rs)


def spread(rs, key, scale=1.0, digits=1):
    if len(rs) < 2:
        return ""
    lo, hi = min(get(r, key) for r in rs) * scale, max(get(r, key) for r in rs) * scale
    return f" ({lo:.{digits}f}–{hi:.{digits}f})"


def busiest(rs):
    """The largest share of requests one worker took (the engines' own count)."""
    shares = []
    for r in rs:
        total = sum(r.get("per_worker", {}).values())
        if total:
            shares.append(max(r["per_worker"].values()) / total)
    return f"{statistics.fmean(shares) * 100:.0f} %" if shares else "–"


def main(outs):
    runs = load(outs)
    cells = sorted({c for c, _ in runs})
    lines = ["| cell | router | runs | reuse % | oracle % | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | e2e p50 ms | req/s | busiest worker | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = ["", "| cell | kvroute p50 / best peer | kvroute p99 / best peer | e2e p50 / best peer | kvroute reuse − best peer (pts) | of oracle | hybrid − blind reuse (pts) |",
                "|---|---|---|---|---|---|---|"]
    for cell in cells:
        for router in ORDER:
            rs = runs.get((cell, router))
            if not rs:
                continue
            lines.append(
                f"| {cell} | {router} | {len(rs)} | {mean(rs, 'reuse') * 100:.1f}{spread(rs, 'reuse', 100)} "
                f"| {mean(rs, 'oracle_reuse') * 100:.1f} | {mean(rs, 'ttft_p50_ms'):.0f}{spread(rs, 'ttft_p50_ms', 1, 0)} "
                f"| {mean(rs, 'ttft_p99_ms'):.0f}{spread(rs, 'ttft_p99_ms', 1, 0)} "
                f"| {mean(rs, 'itl_ms.p50'):.1f} | {mean(rs, 'e2e_ms.p50'):.0f}{spread(rs, 'e2e_ms.p50', 1, 0)} "
                f"| {mean(rs, 'throughput_rps'):.1f} "
                f"| {busiest(rs)} | {sum(r['failed'] for r in rs)} |")
        k = runs.get((cell, "kvroute-hybrid"))
        peers = [runs[(cell, p)] for p in PEERS if (cell, p) in runs]
        if not k or not peers:
            continue
        best50 = min(mean(p, "ttft_p50_ms") for p in peers)
        best99 = min(mean(p, "ttft_p99_ms") for p in peers)
        best_e2e = min(mean(p, "e2e_ms.p50") for p in peers)
        best_reuse = max(mean(p, "reuse") for p in peers)
        blind = runs.get((cell, "kvroute-blind"))
        hb = f"{(mean(k, 'reuse') - mean(blind, 'reuse')) * 100:+.1f}" if blind else "–"
        oracle = mean(k, "oracle_reuse")
        verdicts.append(
            f"| {cell} | {mean(k, 'ttft_p50_ms') / best50:.2f} | {mean(k, 'ttft_p99_ms') / best99:.2f} "
            f"| {mean(k, 'e2e_ms.p50') / best_e2e:.2f} "
            f"| {(mean(k, 'reuse') - best_reuse) * 100:+.1f} | {mean(k, 'reuse') / oracle * 100 if oracle else 0:.0f} % | {hb} |")
    text = "\n".join(lines + verdicts) + "\n"
    (pathlib.Path(outs[0]) / "matrix.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:] or ["bench/out"])
