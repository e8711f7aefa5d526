"""Where a run's slow requests come from, from the per-request logs bench/peers.sh writes.

    python3 bench/tails.py [--skip SECONDS] FILE.requests.jsonl...

Per file: the engine-time TTFT p50 and p99 of all requests and of those sent after the first
SECONDS (default 2: the start, when every prefix is new and the gateways' estimates are
young); how many requests were served less than the arrival-time oracle promised (a prefix
another request had already sent, but not there or not yet stored), by the second they were
sent, and by kind (a conversation's first request, a follow-up, a branch) with the requests
each worker served, most first; the slowest 5 % by send time, with what each reused against the oracle; and the
client's TTFT less the engine's at p10/p50/p90/p99 (the hops, the gateway and the machine's
scheduling between the engine's first token and the client's first byte).
"""
import collections
import json
import sys


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


def report(path, skip):
    rs = [json.loads(line) for line in open(path)]
    rs = [r for r in rs if r.get("engine_ttft_s") is not None and not r.get("failure")]
    ms = lambda r: r["engine_ttft_s"] * 1e3
    late = [r for r in rs if r["sent_at_s"] >= skip]
    print(path.rsplit("/", 1)[-1])
    print(f"  requests {len(rs)}: TTFT p50 {pct([ms(r) for r in rs], .5):.0f} ms, "
          f"p99 {pct([ms(r) for r in rs], .99):.0f} ms")
    print(f"  sent after {skip:g} s ({len(late)}): TTFT p50 {pct([ms(r) for r in late], .5):.0f} ms, "
          f"p99 {pct([ms(r) for r in late], .99):.0f} ms")
    short = [r for r in rs if r["cached_tokens"] < r["oracle_tokens"]]
    lost = sum(r["oracle_tokens"] - r["cached_tokens"] for r in short)
    by_s = collections.Counter(int(r["sent_at_s"]) for r in short)
    print(f"  below the oracle: {len(short)} requests, {lost} tokens; by second sent: "
          + ", ".join(f"{s}: {n}" for s, n in sorted(by_s.items())))
    kinds = {"first requests": lambda r: r["turn"] == 0,
             "follow-ups": lambda r: r["turn"] > 0 and not r["branch"],
             "branches": lambda r: r["turn"] > 0 and r["branch"]}
    by_kind = []
    for name, is_kind in kinds.items():
        ks = [r for r in short if is_kind(r)]
        by_kind.append(f"{name} {sum(r['oracle_tokens'] - r['cached_tokens'] for r in ks)} "
                       f"tokens ({len(ks)})")
    per_worker = sorted(collections.Counter(r["worker"] for r in rs).values(), reverse=True)
    print("  below the oracle by kind: " + ", ".join(by_kind) + "; requests per worker: "
          + ", ".join(str(n) for n in per_worker))
    tail = sorted(rs, key=ms)[int(len(rs) * 0.95):]
    early = sum(1 for r in tail if r["sent_at_s"] < skip)
    print(f"  slowest 5 % ({len(tail)}): {early} sent in the first {skip:g} s; "
          f"{sum(1 for r in tail if r['cached_tokens'] < r['oracle_tokens'])} below the oracle")
    gap = [(r["ttft_s"] - r["engine_ttft_s"]) * 1e3 for r in rs if r.get("ttft_s") is not None]
    print("  client - engine TTFT: " + ", ".join(f"p{round(q * 100)} {pct(gap, q):.1f}"
                                               for q in (.1, .5, .9, .99)) + " ms")


def main(argv):
    skip = 2.0
    if len(argv) > 1 and argv[0] == "--skip":
        skip, argv = float(argv[1]), argv[2:]
    for p in argv:
        report(p, skip)


if __name__ == "__main__":
    main(sys.argv[1:])
