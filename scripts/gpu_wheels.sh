#!/usr/bin/env bash
# Download, on this machine, the wheels a lent GPU machine lacks for scripts/gpu_smoke.sh's trainer stages: it
# has python3 and torch but no torchtitan, no network, and takes 64 MiB of carried files. The wheels are for
# its Python (3.12 unless GPU_PYTHON_VERSION says otherwise) and land in gpu_wheels/ (git-ignored): carry that
# folder; gpu_smoke.sh installs it from there, offline, before the stages run.
#   scripts/gpu_wheels.sh && du -sh gpu_wheels
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
VERSION="${GPU_PYTHON_VERSION:-3.12}"
rm -rf gpu_wheels && mkdir -p gpu_wheels
# torchtitan and what it imports on the trainer path (its other requirements, datasets and wandb among them, are
# not imported there); no torch: the machine's own stays
"$PY" -m pip download -q --only-binary=:all: --no-deps --python-version "$VERSION" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d gpu_wheels \
  torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring_parser typeguard typing_extensions tomli safetensors einops
ls gpu_wheels
du -sh gpu_wheels
