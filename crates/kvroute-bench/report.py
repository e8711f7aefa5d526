#!/usr/bin/env python3
"""Turns criterion's estimates into the table of docs/benchmarks.md.

Reads the mean of every `{op}_{block}_{index}-{groups}g` run under target/criterion (the main
workspace) and benches/dynamo/target/criterion, divides by the blocks one iteration handles
(the fleet's 128 x 8192 / block for store, store-warm and remove; the request's 8192 / block
for predict) and prints markdown. Run from the repository root after the benches.
"""
import json
import pathlib

ROOTS = [pathlib.Path("target/criterion"), pathlib.Path("benches/dynamo/target/criterion")]
WORKERS, TOKENS = 128, 8192


def load():
    out = {}
    for root in ROOTS:
        for est in root.glob("*/new/estimates.json"):
            op, block, who = est.parent.parent.name.split("_")
            mean = json.loads(est.read_text())["mean"]["point_estimate"]
            out[(op, int(block), who)] = mean
    return out


def per_block(op, block, ns):
    blocks = TOKENS // block if op.startswith("predict") else WORKERS * TOKENS // block
    return ns / blocks


def fmt(ns):
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1000:.1f} µs" if ns >= 1000 else f"{ns:.1f} ns"


def main():
    est = load()
    ops = ["store", "store-warm", "remove", "predict", "predict-evidence", "predict-hashing"]
    whos = ["kvroute-1g", "kvroute-2g", "kvroute-4g", "chain-1g", "dynamo-1g"]
    print("| op | block | index | per iteration | per block | chain / kvroute-1g | dynamo / kvroute-1g | kvroute Ng / 1g |")
    print("|---|---|---|---|---|---|---|---|")
    for op in ops:
        for block in (16, 64):
            base = est.get((op, block, "kvroute-1g"))
            for who in whos:
                ns = est.get((op, block, who))
                if ns is None:
                    continue
                row = [op, str(block), who, fmt(ns), fmt(per_block(op, block, ns))]
                chain = est.get((op, block, "chain-1g"))
                dynamo = est.get((op, block, "dynamo-1g"))
                if who == "kvroute-1g":
                    row += [f"{chain / ns:.2f}x" if chain else "", f"{dynamo / ns:.2f}x" if dynamo else "", ""]
                elif who.startswith("kvroute"):
                    row += ["", "", f"{ns / base:.2f}x" if base else ""]
                else:
                    row += ["", "", ""]
                print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
