#!/usr/bin/env bash
# One GPU check for envhub's parallel strategies and weight sync (see check.py's docstring).
#   bash benchmarks/gpu/check.sh            # on a single H200/H100: ~0.5B Qwen2, CUDA, NCCL
#   bash benchmarks/gpu/check.sh --smoke    # anywhere: tiny model on CPU, gloo, shared memory
# Nothing is fetched from the network. megatron-core travels as a wheel in .whl/ (installed to
# /tmp/site when the interpreter lacks it). Figures go to $OUT (default ./gpu-out): gpu_check.json,
# summary.txt and check.log. The last line printed is "gpu_check: done".
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
OUT="${OUT:-$ROOT/gpu-out}"
export OUT
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
if ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import megatron.core" >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" \
    || echo "check.sh: installing .whl/*.whl failed; the megatron section will report it"
fi
export PYTHONPATH="$ROOT:${PYTHONPATH:-}"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "${1:-}" = "--smoke" ]; then export CUDA_VISIBLE_DEVICES=""; fi
timeout -k 10 "${CHECK_TIMEOUT_S:-400}" "$PY" benchmarks/gpu/check.py "$@" 2>&1 | tee "$OUT/check.log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 124 ]; then echo "check.sh: timed out; finished sections are in $OUT/gpu_check.json" | tee -a "$OUT/check.log"; fi
exit "$rc"
