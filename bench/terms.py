#!/usr/bin/env python3
"""The cost-term A/B table from bench/terms.sh's runs.

    python3 bench/terms.py DIR                 # the A/B table and verdicts
    python3 bench/terms.py --summary DIR...    # each setting's mean and range
    python3 bench/terms.py --replicas DIR...   # three replicas (r3.peers) against one (r1.defaults),
                                               # and one against itself where r1.again runs exist

Each run is DIR/WORKLOAD.PRESET.BLOCKS.RATE.rREPLICAS.SETTING.REPEAT.json (`kvroute bench`'s
JSON). SETTING is `defaults`, a default-on term's name (that term switched off) or NAME-on (a
default-off term switched on). For every cell and term, the term's effect is the mean of the
runs with it on minus the mean of those with it off, per figure (reuse; TTFT mean, p50, p99;
ITL p50; end-to-end p50),
and the noise is the larger of the two settings' ranges over their repeats (max − min). The
term is ahead on a figure when its effect is better than the noise (more reuse, less time),
behind when it is worse than the noise. Prints a Markdown table and, per term, the verdict the A/B rule gives: on by default
only if ahead on some cell and behind on none.
"""
import collections
import json
import pathlib
import statistics
import sys

# The figures each term is judged on: reuse, TTFT, and the decode figures that the decode
# interference and prefill stall terms aim at (inter-token latency and end-to-end time, p50).
FIGURES = [("reuse", +1), ("ttft_mean_ms", -1), ("ttft_p50_ms", -1), ("ttft_p99_ms", -1),
           ("itl_p50_ms", -1), ("e2e_p50_ms", -1)]


def figure(t, name):
    if name == "ttft_mean_ms":
        v = t.get("ttft_mean_ms")
        if v is None:
            v = (t.get("client_ttft_ms") or {}).get("mean")
        return v
    if name in ("itl_p50_ms", "e2e_p50_ms"):
        return (t.get(name[:3] + "_ms") or {}).get("p50")
    return t.get(name)


def load(dirs):
    runs = collections.defaultdict(list)
    if isinstance(dirs, str):
        dirs = [dirs]
    for p in sorted(q for d in dirs for q in pathlib.Path(d).glob("*.json")):
        parts = p.name[: -len(".json")].split(".")
        if len(parts) < 7:
            continue
        # The rate may itself hold a dot (2.3): the cell is everything before rREPLICAS.
        i = next(k for k, s in enumerate(parts) if s.startswith("r") and s[1:].isdigit())
        cell = ".".join(parts[:i])
        replicas, setting, rep = parts[i], parts[i + 1], parts[i + 2]
        t = json.loads(p.read_text())["targets"][0]
        runs[(cell, replicas, setting)].append(t)
    return runs


def difference(first, second, name):
    """The difference of `name`'s means over two sets of runs (first − second) and the noise
    (the larger of the two ranges), both unscaled; None where either set lacks the figure."""
    a = [figure(t, name) for t in first if figure(t, name) is not None]
    b = [figure(t, name) for t in second if figure(t, name) is not None]
    if not a or not b:
        return None
    return statistics.mean(a) - statistics.mean(b), max(max(a) - min(a), max(b) - min(b))


def main(d):
    runs = load(d)
    cells = sorted({(c, r) for c, r, _ in runs})
    terms = sorted({s for _, _, s in runs if s != "defaults"})
    verdict = {t: {"ahead": [], "behind": []} for t in terms}
    print("| term | cell | replicas | runs (on/off) | " + " | ".join(
        f"{n} on − off (noise)" for n, _ in FIGURES) + " |")
    print("|---|---|---|---|" + "---|" * len(FIGURES))
    for term in terms:
        for cell, rep in cells:
            on, off = runs.get((cell, rep, "defaults"), []), runs.get((cell, rep, term), [])
            if term.endswith("-on"):
                on, off = off, on
            if not on or not off:
                continue
            row = []
            for name, better in FIGURES:
                got = difference(on, off, name)
                if got is None:
                    row.append("—")
                    continue
                delta, noise = got
                scale = 100 if name == "reuse" else 1
                mark = ""
                if abs(delta) > noise:
                    good = delta * better > 0
                    mark = " ✓" if good else " ✗"
                    verdict[term]["ahead" if good else "behind"].append(f"{cell} {name}")
                row.append(f"{delta * scale:+.1f} ({noise * scale:.1f}){mark}")
            print(f"| {term} | {cell} | {rep[1:]} | {len(on)}/{len(off)} | " + " | ".join(row) + " |")
    print()
    print("| term | ahead beyond the noise | behind beyond the noise | A/B rule |")
    print("|---|---|---|---|")
    for term in terms:
        v = verdict[term]
        keep = bool(v["ahead"]) and not v["behind"]
        print(f"| {term} | {len(v['ahead'])}: {', '.join(v['ahead']) or '—'} | "
              f"{len(v['behind'])}: {', '.join(v['behind']) or '—'} | "
              f"{'on' if keep else 'off'} |")


def summary(d):
    """Per cell, replica count and setting: each figure's mean and range over the repeats."""
    runs = load(d)
    print("| cell | replicas | setting | runs | " + " | ".join(n for n, _ in FIGURES) + " |")
    print("|---|---|---|---|" + "---|" * len(FIGURES))
    for (cell, rep, setting) in sorted(runs):
        ts = runs[(cell, rep, setting)]
        row = []
        for name, _ in FIGURES:
            v = [figure(t, name) for t in ts if figure(t, name) is not None]
            if not v:
                row.append("—")
                continue
            scale = 100 if name == "reuse" else 1
            row.append(f"{statistics.mean(v) * scale:.1f} [{min(v) * scale:.1f}–{max(v) * scale:.1f}]")
        print(f"| {cell} | {rep[1:]} | {setting} | {len(ts)} | " + " | ".join(row) + " |")


def replicas(dirs):
    """Per cell: three peered replicas (r3.peers) against one (r1.defaults), each figure's
    difference of the means with the noise (the larger of the two ranges over the repeats),
    and whether three replicas are within the noise, ahead or behind; then the counts. Where
    the runs hold a second one-replica setting (r1.again, `bench/replicas.sh --settings
    defaults,peers,again`), the same table for one replica against itself follows: how many
    figures the rule calls ahead or behind when nothing differs but the run."""
    runs = load(dirs)
    compare(runs, ("r3", "peers"), ("r1", "defaults"), "3 − 1")
    if any(s == "again" for _, _, s in runs):
        print()
        compare(runs, ("r1", "again"), ("r1", "defaults"), "1 − 1")


def compare(runs, first, second, label):
    cells = sorted({c for c, _, _ in runs})
    print(f"| cell | runs ({first[0][1:]}/{second[0][1:]}) | "
          + " | ".join(f"{n} {label} (noise)" for n, _ in FIGURES) + " | behind on |")
    print("|---|---|" + "---|" * len(FIGURES) + "---|")
    tally = collections.Counter()
    for cell in cells:
        a, b = runs.get((cell, *first)), runs.get((cell, *second))
        if not a or not b:
            continue
        row, behind = [], []
        for name, better in FIGURES:
            got = difference(a, b, name)
            if got is None:
                row.append("—")
                continue
            scale = 100 if name == "reuse" else 1
            diff, noise = got[0] * scale, got[1] * scale
            if abs(diff) <= noise:
                mark = ""
                tally["within"] += 1
            elif diff * better > 0:
                mark = " ahead"
                tally["ahead"] += 1
            else:
                mark = " **behind**"
                tally["behind"] += 1
                behind.append(name)
            row.append(f"{diff:+.1f} ({noise:.1f}){mark}")
        print(f"| {cell} | {len(a)}/{len(b)} | " + " | ".join(row) + " | "
              + (", ".join(behind) or "—") + " |")
    print(f"\n{first[0]}.{first[1]} against {second[0]}.{second[1]}: figures within the noise: "
          f"{tally['within']}, ahead: {tally['ahead']}, behind: {tally['behind']}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    dirs = args or ["bench/out"]
    if "--summary" in sys.argv:
        summary(dirs)
    elif "--replicas" in sys.argv:
        replicas(dirs)
    else:
        main(dirs[0])
