"""Reference block hashes computed the way vLLM computes them, with Python's own pickle,
hashlib and cbor2. Reads JSON cases on stdin, prints one hex digest per case.

A case: {"algo": "sha256"|"sha256_cbor", "seed": str, "parent": hex|null,
         "tokens": [int], "extra": null | [[str|int, ...], ...], "lookahead": [int]?}

With a non-empty "lookahead" (vLLM 0.33's lookahead block hashes) the extra keys are the flat
tuple (extra, t_e, ..., t_{e+L-1}).
"""
import hashlib
import json
import pickle
import sys

import cbor2


def dumps(algo, obj):
    if algo == "sha256":
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return cbor2.dumps(obj, canonical=True)


def main():
    cases = json.load(sys.stdin)
    none_hashes = {}
    out = []
    for c in cases:
        algo, seed = c["algo"], c["seed"]
        key = (algo, seed)
        if key not in none_hashes:
            none_hashes[key] = hashlib.sha256(dumps(algo, seed)).digest()
        parent = bytes.fromhex(c["parent"]) if c["parent"] else none_hashes[key]
        extra = None if c["extra"] is None else tuple(tuple(k) for k in c["extra"])
        lookahead = c.get("lookahead") or []
        if lookahead:
            extra = (extra, *lookahead)
        obj = (parent, tuple(c["tokens"]), extra)
        out.append(hashlib.sha256(dumps(algo, obj)).hexdigest())
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
