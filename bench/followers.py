#!/usr/bin/env python3
"""TTFT by the prompts that reached the same worker right after a request.

    python3 bench/followers.py [--window MS] FILE.requests.jsonl...

A chunked-prefill engine schedules a prompt's last chunk in a step with whatever prompts are
waiting by then (vLLM's scheduler: the running requests first, then the waiting ones in arrival
order, within the step's token budget), so a request's first token can wait for prompts that
arrived after it. Those prompts were not sent when the gateway decided, so no prediction made
then can see them. Per file, requests are split by their followers: the requests sent to the
same worker within MS milliseconds after it (default 40) and before its first token (by the
client's clock: sent_at_s and ttft_s), counted 0, 1 and 2 or more. The window is fixed so that
a request's own wait does not decide how many followers it can collect (counting up to the
first token would give every slow request more); requests answered within the window have
less of it. Per group: the requests and their share of the file, the median TTFT (the
client's, which the gateway's prediction is set against), and, where the log carries the
decisions (`kvroute bench --requests-log` through a gateway run with `--explain-always`), the
median predicted TTFT, the median relative error |predicted - observed| / observed, the share
within 10 %, and the mean signed error predicted - observed (ms; positive: predicted too slow).
Failed requests and those without a TTFT are left out; medians are the lower middle (rank
(n - 1) // 2 of the sorted values).
"""
import json
import sys


def median(xs):
    xs = sorted(xs)
    return xs[(len(xs) - 1) // 2] if xs else float("nan")


def followers(rs, window_s):
    """Each served request with the number of its followers."""
    rs = sorted(rs, key=lambda r: r["sent_at_s"])
    out = []
    for i, r in enumerate(rs):
        first = r["sent_at_s"] + min(r["ttft_s"], window_s)
        n = 0
        for q in rs[i + 1:]:
            if q["sent_at_s"] >= first:
                break
            n += q["worker"] == r["worker"]
        out.append((r, n))
    return out


def report(path, window_s):
    rs = [json.loads(line) for line in open(path) if line.strip()]
    rs = [r for r in rs if not r.get("failure") and r.get("ttft_s") is not None]
    print(path.rsplit("/", 1)[-1])
    groups = {}
    for r, n in followers(rs, window_s):
        groups.setdefault(min(n, 2), []).append(r)
    for k in sorted(groups):
        g = groups[k]
        obs = [r["ttft_s"] * 1e3 for r in g]
        line = (f"  followers {('0', '1', '2+')[k]}: {len(g)} requests "
                f"({100 * len(g) / len(rs):.0f} %), TTFT median {median(obs):.1f} ms")
        pairs = [(r["decision"]["predicted_ttft_ms"], r["ttft_s"] * 1e3) for r in g
                 if isinstance(r.get("decision"), dict)
                 and r["decision"].get("predicted_ttft_ms") is not None]
        if pairs:
            err = [abs(p - o) / o for p, o in pairs if o > 0]
            line += (f"; predicted median {median(p for p, _ in pairs):.1f} ms, "
                     f"median relative error {100 * median(err):.1f} %, "
                     f"within 10 % {100 * sum(e <= 0.1 for e in err) / len(err):.0f} %, "
                     f"mean predicted - observed {sum(p - o for p, o in pairs) / len(pairs):+.1f} ms")
        print(line)


def main(argv):
    window_ms = 40.0
    if argv[:1] == ["--window"] and len(argv) > 1:
        window_ms = float(argv[1])
        argv = argv[2:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for path in argv:
        report(path, window_ms / 1e3)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
