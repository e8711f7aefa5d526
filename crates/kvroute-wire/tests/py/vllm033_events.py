"""Writes tests/data/vllm033-lookahead/batches.jsonl: event batches encoded the way vLLM 0.33's
ZmqEventPublisher encodes them (msgspec structs: the batch array_like, events tagged maps with
defaults omitted, BlockStored ending in 0.33's `lookahead_token_ids`), with block hashes
computed as a 0.33 engine with lookahead hashes computes them (pickle + sha256, NONE_HASH of
"vllm-none-hash", hash block 4).

Each line: {"name", "lookahead", "tokens", "payload": base64 msgpack}.
Run from the crate directory: python3 tests/py/vllm033_events.py
"""

import base64
import hashlib
import json
import pickle
from typing import Any, Optional, Union

import msgspec

BLOCK = 4


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


# The 0.33 field table: 0.32's fields, then lookahead_token_ids.
class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Any]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[list[list[int]]] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


def sha256(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE_HASH = sha256("vllm-none-hash")


def chain(tokens, lookahead, salt=None):
    """(digest, block tokens, lookahead tokens) of every block with e + L <= n."""
    out = []
    parent = None
    s = 0
    while s + BLOCK + lookahead <= len(tokens):
        e = s + BLOCK
        keys = (("cache_salt", salt),) if s == 0 and salt else None
        extra = (keys, *tokens[e:e + lookahead]) if lookahead else keys
        parent = sha256((parent or NONE_HASH, tuple(tokens[s:e]), extra))
        out.append((parent, tokens[s:e], tokens[e:e + lookahead]))
        s = e
    return out


def stored(blocks, parent, lookahead, int_hashes=False, salt=None):
    def h(d):
        return int.from_bytes(d[-8:], "big") if int_hashes else d

    extra = None
    if salt is not None:
        # Published untagged: the bare salt on the first block, None after.
        extra = [(salt,) if parent is None and i == 0 else None for i in range(len(blocks))]
    return BlockStored(
        block_hashes=[h(d) for d, _, _ in blocks],
        parent_block_hash=None if parent is None else h(parent),
        token_ids=[t for _, toks, _ in blocks for t in toks],
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=extra,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        lookahead_token_ids=[list(la) for _, _, la in blocks] if lookahead else None,
    )


def batch(events):
    return base64.b64encode(
        msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=events, data_parallel_rank=0))
    ).decode()


def main():
    lines = []
    tokens = [(i * 7919) % 50_000 for i in range(23)]
    for lookahead in (1, 3):
        blocks = chain(tokens, lookahead)
        # Two stores: the first three blocks, then the rest chained on the third.
        first = stored(blocks[:3], None, lookahead)
        rest = stored(blocks[3:], blocks[2][0], lookahead)
        lines.append({"name": f"bytes-l{lookahead}", "lookahead": lookahead, "tokens": tokens,
                      "payload": batch([first, rest])})
        ints = stored(blocks, None, lookahead, int_hashes=True)
        removed = BlockRemoved(block_hashes=[int.from_bytes(blocks[-1][0][-8:], "big")],
                               medium="GPU", group_idx=0)
        lines.append({"name": f"int-l{lookahead}", "lookahead": lookahead, "tokens": tokens,
                      "payload": batch([ints, removed])})
        salted = chain(tokens, lookahead, salt="tenant")
        lines.append({"name": f"salt-l{lookahead}", "lookahead": lookahead, "tokens": tokens,
                      "payload": batch([stored(salted, None, lookahead, salt="tenant")])})
    # Without lookahead (L = 0) a 0.33 engine publishes 0.32's event: the field is omitted.
    plain = chain(tokens, 0)
    lines.append({"name": "bytes-l0", "lookahead": 0, "tokens": tokens,
                  "payload": batch([stored(plain, None, 0)])})
    with open("tests/data/vllm033-lookahead/batches.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
