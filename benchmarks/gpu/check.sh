#!/usr/bin/env bash
# One GPU check for envhub's parallel strategies, weight sync, LoRA and packing (check.py's
# docstring; the LoRA and packed steps run through the trainer's config: check_trainer.py).
#   bash benchmarks/gpu/check.sh            # on a single H200/H100: ~0.5B Qwen2, CUDA, NCCL
#   bash benchmarks/gpu/check.sh --smoke    # anywhere: tiny model on CPU, gloo, shared memory
# Nothing is fetched from the network: what the GPU image lacks (megatron-core, pydantic,
# gymnasium, ...: benchmarks/gpu/wheels.txt) travels as wheels in .whl/, downloaded beforehand
# by benchmarks/gpu/fetch_wheels.sh and installed to /tmp/site when the interpreter lacks one.
# Figures go to $OUT (default ./gpu-out): gpu_check.json, summary.txt and check.log. The last
# line printed is "gpu_check: done". The whole check is bounded by CHECK_TIMEOUT_S (480 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
OUT="${OUT:-$ROOT/gpu-out}"
export OUT
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
if ls .whl/*.whl >/dev/null 2>&1 \
  && ! "$PY" -c "import megatron.core, peft, pydantic, gymnasium" >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" \
    || echo "check.sh: installing .whl/*.whl failed; the sections that need them will report it"
fi
export PYTHONPATH="$ROOT:${PYTHONPATH:-}"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "${1:-}" = "--smoke" ]; then export CUDA_VISIBLE_DEVICES=""; fi
timeout -k 10 "${CHECK_TIMEOUT_S:-480}" "$PY" benchmarks/gpu/check.py "$@" 2>&1 | tee "$OUT/check.log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 124 ]; then echo "check.sh: timed out; finished sections are in $OUT/gpu_check.json" | tee -a "$OUT/check.log"; fi
exit "$rc"
