#!/usr/bin/env bash
# Download benchmarks/gpu/wheels.txt into .whl/ (git-ignored) for the GPU machine: CPython 3.12,
# manylinux x86-64, no dependencies beyond the list (its image has torch, transformers, numpy,
# pyyaml, accelerate). Run it here, where pip reaches PyPI; check.sh installs .whl/*.whl there
# into /tmp/site when the interpreter lacks megatron-core, peft, pydantic or gymnasium.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
mkdir -p .whl
grep -v '^#' benchmarks/gpu/wheels.txt | grep . | while read -r wheel; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
    "$wheel"
done
ls -1 .whl
