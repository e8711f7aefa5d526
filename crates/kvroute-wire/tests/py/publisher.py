"""A stand-in engine publisher for kvroute-wire's tests, written like vLLM's ZmqEventPublisher.

Usage: publisher.py v032|old
  v032: vLLM 0.32 -- events as tagged msgspec maps (omit_defaults), batch
        [ts, events, data_parallel_rank], replay replies ["", topic, seq, payload].
  old:  SGLang / vLLM <= 0.25 -- events as tagged positional arrays with signed hashes,
        batch [ts, events, attn_dp_rank], replay replies ["", seq, payload].
Prints "ready <pub_port> <replay_port>", then reads one JSON command per line on stdin:
  {"op": "publish", "hashes": [...], "live": true}   -> prints "ok <seq>"
  {"op": "restart"}                                  -> prints "ok"  (seq back to 0, buffer emptied)
  {"op": "quit"}
"""

import json
import sys
import threading
import time
from collections import deque
from typing import Any, Optional, Union

import msgspec
import zmq

LAYOUT = sys.argv[1]
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOPIC = b"kv"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


# vLLM 0.32: tagged maps, default fields omitted.
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Any]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


# SGLang / older: tagged positional arrays.
class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


def signed(h: int) -> int:
    return h - (1 << 64) if h >= (1 << 63) else h


def encode(hashes: list[int]) -> bytes:
    tokens = list(range(len(hashes) * 4))
    if LAYOUT == "v032":
        ev = BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=4,
            lora_id=None, medium="GPU", lora_name=None, extra_keys=[None] * len(hashes),
            group_idx=0, kv_cache_spec_kind="full_attention",
        )
    else:
        ev = OldBlockStored(
            block_hashes=[signed(h) for h in hashes], parent_block_hash=None, token_ids=tokens,
            block_size=4, lora_id=None,
        )
    return msgspec.msgpack.encode(EventBatch(ts=time.time(), events=[ev], data_parallel_rank=0))


def main() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    lock = threading.Lock()
    buffer: deque = deque(maxlen=10_000)
    state = {"seq": 0, "running": True}

    def serve_replay() -> None:
        while state["running"]:
            if not router.poll(50):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with lock:
                items = [(s, p) for s, p in buffer if s >= start_seq]
            for s, p in items:
                if LAYOUT == "v032":
                    router.send_multipart((client, b"", TOPIC, s.to_bytes(8, "big"), p))
                else:
                    router.send_multipart((client, b"", s.to_bytes(8, "big"), p))
            if LAYOUT == "v032":
                router.send_multipart((client, b"", b"", END_SEQ, b""))
            else:
                router.send_multipart((client, b"", END_SEQ, b""))

    t = threading.Thread(target=serve_replay, daemon=True)
    t.start()
    print(f"ready {pub_port} {replay_port}", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "publish":
            payload = encode(cmd["hashes"])
            with lock:
                seq = state["seq"]
                state["seq"] += 1
                buffer.append((seq, payload))
            if cmd.get("live", True):
                pub.send_multipart((TOPIC, seq.to_bytes(8, "big"), payload))
            print(f"ok {seq}", flush=True)
        elif cmd["op"] == "restart":
            with lock:
                state["seq"] = 0
                buffer.clear()
            print("ok", flush=True)
        elif cmd["op"] == "quit":
            break
    state["running"] = False
    t.join(timeout=1)
    pub.close(linger=0)
    router.close(linger=0)


if __name__ == "__main__":
    main()
