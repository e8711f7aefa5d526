"""The TTFT floor of a peer-matrix cell: what no router can beat on the simulated engines.

    python3 bench/floor.py bench/out/DIR [bench/out/DIR2 ...]

For every request a run logged (`--requests-log`, written by bench/peers.sh), the floor is its
engine TTFT on an idle worker that reuses what the arrival-time oracle says was reusable: the
simulator's step time model (docs/sim.md: 4 ms a step, 60 µs a prefill token, 2 ns an
attention pair, at most 2,048 prefill tokens a step) over its uncached tokens, with no wait
for a step in progress, no queue and no decode batched beside it. Every request's measured TTFT
is at least the floor at the tokens its engine really reused (the script checks that on every
logged request and reports the exceptions), and the reuse of any router is at most the
oracle's, so the p50 (p99) of the floors is a lower bound of any router's p50 (p99) on the same
requests. Per cell: the best peer's TTFT p50 and p99 (each the lowest of the peers' figures,
each peer's the mean over its runs, so p50 and p99 may come from different peers), the
floor's, and the most any router could cut the best peer's figure, `1 − floor / best peer`.
"""
import collections
import json
import math
import pathlib
import statistics
import sys

PEERS = ("smg-cache", "vr-cache", "vr-kv")
STEP_S, TOKEN_S, PAIR_S, BUDGET = 0.004, 60e-6, 2e-9, 2048


def floor_ms(prompt, cached):
    """An idle engine's TTFT for `prompt` tokens of which `cached` are reused."""
    n = max(prompt - cached, 1)
    steps = math.ceil(n / BUDGET)
    return 1000 * (steps * STEP_S + n * TOKEN_S + PAIR_S * n * (cached + (n + 1) / 2))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(dirs):
    runs = collections.defaultdict(list)
    floors = {}
    below = [0, 0]
    for d in dirs:
        for p in sorted(pathlib.Path(d).glob("*.json")):
            parts = p.name.split(".")
            # CELL(4 parts).ROUTER.RUN.json, not a run's saved /admin/workers (.workers.json).
            if len(parts) != 7:
                continue
            cell, router = ".".join(parts[:4]), parts[4]
            runs[(cell, router)].append(json.loads(p.read_text())["targets"][0])
            log = p.with_name(p.name[: -len(".json")] + ".requests.jsonl")
            if not log.exists():
                continue
            fl = []
            for line in log.read_text().splitlines():
                r = json.loads(line)
                if r.get("failure") or r.get("engine_ttft_s") is None:
                    continue
                fl.append(floor_ms(r["prompt_tokens"], r["oracle_tokens"]))
                below[1] += 1
                # The model's own check: nothing runs faster than an idle engine would.
                if r["engine_ttft_s"] * 1000 < 0.99 * floor_ms(r["prompt_tokens"], r["cached_tokens"]):
                    below[0] += 1
            # The oracle is the workload's, the same for every router of the cell.
            floors.setdefault(cell, fl)
    print("| cell | best peer TTFT p50 / p99 ms | floor p50 / p99 ms | most any router can cut p50 | p99 |")
    print("|---|---|---|---|---|")
    for cell in sorted({c for c, _ in runs}):
        peers = [(statistics.fmean(r["ttft_p50_ms"] for r in rs), statistics.fmean(r["ttft_p99_ms"] for r in rs))
                 for (c, router), rs in runs.items() if c == cell and router in PEERS]
        fl = floors.get(cell)
        if not peers or not fl:
            continue
        b50, b99 = min(p for p, _ in peers), min(p for _, p in peers)
        f50, f99 = pct(fl, 0.5), pct(fl, 0.99)
        print(f"| {cell} | {b50:.0f} / {b99:.0f} | {f50:.0f} / {f99:.0f} | "
              f"{(1 - f50 / b50) * 100:.0f} % | {(1 - f99 / b99) * 100:.0f} % |")
    print(f"\nrequests measured faster than the floor at their own reuse: {below[0]} of {below[1]}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["bench/out"])
