"""Mean TTFT of one router's runs in two directories, whole and by prompt length.

    python3 bench/means.py [--router R] [--short N] [--long M] bench/out/A bench/out/B

A ratio of medians or a geometric mean over requests can read a gain where waiting only moved
from some requests to others; the arithmetic mean, the total wait over the requests, does
not. For every run of R (default kvroute-hybrid) in A and the same cell and run number in B:
the mean engine TTFT of each run's served requests (failures and requests without a TTFT left
out; each run over its own requests), A's over B's, and for the prompts shorter than N tokens
(default 1,000) and those of M tokens or more (default 8,000): how many (in A), each run's
mean TTFT over them, and A's total TTFT over them less B's in seconds.
"""
import json
import pathlib
import sys


def served(path):
    """(prompt tokens, engine TTFT ms) of each request a run served."""
    out = []
    for line in open(path):
        r = json.loads(line)
        if r.get("failure") or r.get("engine_ttft_s") is None:
            continue
        out.append((r["prompt_tokens"], r["engine_ttft_s"] * 1e3))
    return out


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def part(a, b, keep):
    """Count in A, A's mean, B's mean (ms) and A's sum less B's (s) over the prompts kept."""
    xa = [t for p, t in a if keep(p)]
    xb = [t for p, t in b if keep(p)]
    if not xa or not xb:
        return f"{len(xa)} · – · –"
    return f"{len(xa)} · {mean(xa):.0f} / {mean(xb):.0f} · {(sum(xa) - sum(xb)) / 1e3:+.1f}"


def main(argv):
    router, short, long = "kvroute-hybrid", 1000, 8000
    while argv and argv[0] in ("--router", "--short", "--long") and len(argv) > 1:
        if argv[0] == "--router":
            router = argv[1]
        elif argv[0] == "--short":
            short = int(argv[1])
        else:
            long = int(argv[1])
        argv = argv[2:]
    if len(argv) != 2:
        sys.exit(__doc__)
    print(f"| cell | run | mean TTFT A / B ms | A / B | prompts < {short:,}: n · mean A / B ms "
          f"· sum A − B s | prompts ≥ {long:,}: n · mean A / B ms · sum A − B s |")
    print("|---|---|---|---|---|---|")
    for p in sorted(pathlib.Path(argv[0]).glob(f"*.{router}.*.requests.jsonl")):
        q = pathlib.Path(argv[1]) / p.name
        if not q.exists():
            continue
        cell, _who, run = p.name[: -len(".requests.jsonl")].rsplit(".", 2)
        a, b = served(p), served(q)
        if not a or not b:
            continue
        ma, mb = mean([t for _, t in a]), mean([t for _, t in b])
        print(f"| {cell} | {run} | {ma:.1f} / {mb:.1f} | {ma / mb:.3f} "
              f"| {part(a, b, lambda n: n < short)} | {part(a, b, lambda n: n >= long)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
