"""Which requests make two routers' percentiles differ, on one cell bench/peers.sh ran.

    python3 bench/crossing.py [--p 50] [--e2e] [--router R] [--peer P] [--run N] DIR CELL

CELL is a cell's name as the files spell it (`mooncake.gemma3.tight.low`). Every router of a
cell is sent the same requests at the same times, so a gap between two routers' p50s comes
from the requests that sit below the percentile under one router and above it under the other
(the crossers). Prints:

- each router's value at the percentile (the same rank `bench/matrix.py` reads: sorted values,
  index int(p/100 · n)), and the values at the ranks around it, with each request's prompt
  tokens: where the distribution is steep there, one crosser moves the percentile by a whole
  gap between neighbouring ranks;
- the crossers at the peer's value T: the requests above T under R and at or below it under the
  peer, and the other way round. R's count at or below T falls short of the peer's by the first
  group's size less the second's, which is how many ranks R's percentile sits above the peer's.
  Each crosser with its prompt, its latency under each router, the worker each router sent it
  to, and what that worker was doing when it was sent (the requests in flight there by the
  client's clock: `P` still before their first token, `D` decoding; tokens and the ms they had
  left to their first token or their end).

R defaults to kvroute-hybrid, P to the peer (SMG or vllm-router) whose value at the
percentile is lowest; `--peer kvroute-blind` sets two of kvroute's policies side by side. Reads only
the requests logs; failures are left out. `--e2e` ranks end-to-end latency instead of engine
TTFT.
"""
import json
import pathlib
import sys

from paired import PEERS  # the peers bench/peers.sh runs (this script's directory)


def load(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        if r.get("failure") or r.get("engine_ttft_s") is None or r.get("ttft_s") is None:
            continue
        out[(r.get("session"), r.get("turn"), r.get("branch"))] = r
    return out


def ranked(reqs, field):
    return sorted(reqs, key=lambda k: reqs[k][field])


def at(order, p):
    return min(len(order) - 1, int(p / 100 * len(order)))


def in_flight(reqs, t, me):
    """What each worker was doing at time t by the client's clock (excluding `me`)."""
    busy = {}
    for k, x in reqs.items():
        if k == me or x.get("worker") is None or x.get("e2e_s") is None:
            continue
        sent, first, end = x["sent_at_s"], x["sent_at_s"] + x["ttft_s"], x["sent_at_s"] + x["e2e_s"]
        if sent <= t < end:
            what = f"P{x['prompt_tokens']}:{(first - t) * 1e3:.0f}" if t < first else \
                f"D{x['prompt_tokens']}:{(end - t) * 1e3:.0f}"
            busy.setdefault(x["worker"], []).append(what)
    return busy


def short(worker):
    return (worker or "?").rsplit(":", 1)[-1]


def show_state(reqs, k):
    r = reqs[k]
    state = in_flight(reqs, r["sent_at_s"], k)
    mine = state.get(r.get("worker"), [])
    others = {short(w): len(v) for w, v in sorted(state.items()) if w != r.get("worker")}
    return f"on {short(r.get('worker'))}: [{' '.join(mine) or 'idle'}]; elsewhere busy {others or '{}'}"


def main(argv):
    p, field, router, peer, run = 50.0, "engine_ttft_s", "kvroute-hybrid", None, "1"
    while argv and argv[0].startswith("--"):
        flag = argv[0]
        if flag == "--e2e":
            field, argv = "e2e_s", argv[1:]
            continue
        if len(argv) < 2:
            sys.exit(__doc__)
        value, argv = argv[1], argv[2:]
        if flag == "--p":
            p = float(value)
        elif flag == "--router":
            router = value
        elif flag == "--peer":
            peer = value
        elif flag == "--run":
            run = value
        else:
            sys.exit(__doc__)
    if len(argv) != 2:
        sys.exit(__doc__)
    d, cell = pathlib.Path(argv[0]), argv[1]
    logs = {}
    for f in sorted(d.glob(f"{cell}.*.{run}.requests.jsonl")):
        who = f.name[len(cell) + 1:-len(f".{run}.requests.jsonl")]
        if who == router or who in PEERS or who == peer:
            logs[who] = load(f)
    if router not in logs or len(logs) < 2:
        sys.exit(f"{d}: no requests logs of {router} and a peer for {cell} (run {run})")
    value = {who: reqs[ranked(reqs, field)[at(ranked(reqs, field), p)]][field] * 1e3
             for who, reqs in logs.items()}
    if peer is None:
        peer = min((w for w in logs if w != router), key=lambda w: value[w])
    if peer not in logs:
        sys.exit(f"{d}: no requests log of {peer} for {cell} (run {run})")
    a, b = logs[router], logs[peer]
    keys = set(a) & set(b)
    a = {k: a[k] for k in keys}
    b = {k: b[k] for k in keys}
    what = "end-to-end" if field == "e2e_s" else "engine TTFT"
    print(f"{cell}, run {run}, {what} p{p:g} over the {len(keys)} requests both served")
    cut = {}
    for who, reqs in ((router, a), (peer, b)):
        order = ranked(reqs, field)
        i = at(order, p)
        cut[who] = reqs[order[i]][field]
        around = " ".join(
            f"{reqs[k]['prompt_tokens']}:{reqs[k][field] * 1e3:.0f}" for k in order[max(0, i - 5):i + 6])
        print(f"  {who:<15} p{p:g} = {cut[who] * 1e3:.1f} ms (rank {i}); ranks {max(0, i - 5)}-{i + 5} "
              f"as prompt:ms: {around}")
    # A crosser is on one side of the peer's value under one router and on the other under the other.
    t = cut[peer]
    up = [k for k in keys if a[k][field] > t and b[k][field] <= t]
    down = [k for k in keys if a[k][field] <= t and b[k][field] > t]
    print(f"  at T = {t * 1e3:.1f} ms: {len(up)} requests above T under {router} only, {len(down)} under "
          f"{peer} only (net {len(up) - len(down):+d} ranks)")
    for title, group in ((f"above T under {router}, at or below under {peer}", up),
                         (f"at or below T under {router}, above under {peer}", down)):
        print(f"  {len(group)} {title}:")
        for k in sorted(group, key=lambda k: a[k]["sent_at_s"]):
            print(f"    t={a[k]['sent_at_s']:.2f}s prompt {a[k]['prompt_tokens']} (cached "
                  f"{a[k].get('cached_tokens')}/{b[k].get('cached_tokens')}): {router} "
                  f"{a[k][field] * 1e3:.0f} ms, {peer} {b[k][field] * 1e3:.0f} ms")
            print(f"      {router:<15} {show_state(a, k)}")
            print(f"      {peer:<15} {show_state(b, k)}")


if __name__ == "__main__":
    main(sys.argv[1:])
