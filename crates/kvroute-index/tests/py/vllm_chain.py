"""Reference request chains computed the way vLLM 0.33's request block hasher walks a request,
with Python's own pickle, hashlib and cbor2. Reads JSON cases on stdin, prints one list of hex
digests per case.

A case: {"algo": "sha256"|"sha256_cbor", "seed": str, "tokens": [int], "block": int,
         "lookahead": int, "lora": [name, path]|null, "salt": str|null}

Block [s, e) is hashed once e + lookahead <= len(tokens). Its extra keys E are the tagged LoRA
key on every block and the tagged salt on the first (None when there are none); with lookahead
L > 0 the hashed extra keys are (E, t_e, ..., t_{e+L-1}).
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


def chain(c):
    algo, tokens, block, lookahead = c["algo"], c["tokens"], c["block"], c["lookahead"]
    none_hash = hashlib.sha256(dumps(algo, c["seed"])).digest()
    out = []
    parent = None
    start = 0
    while start + block + lookahead <= len(tokens):
        end = start + block
        keys = []
        if c["lora"] is not None:
            keys.append(("lora", c["lora"][0], c["lora"][1]))
        if start == 0 and c["salt"]:
            keys.append(("cache_salt", c["salt"]))
        extra = tuple(keys) if keys else None
        if lookahead:
            extra = (extra, *tokens[end:end + lookahead])
        obj = (parent or none_hash, tuple(tokens[start:end]), extra)
        parent = hashlib.sha256(dumps(algo, obj)).digest()
        out.append(parent.hex())
        start = end
    return out


def main():
    json.dump([chain(c) for c in json.load(sys.stdin)], sys.stdout)


if __name__ == "__main__":
    main()
