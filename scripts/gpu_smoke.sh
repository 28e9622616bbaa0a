#!/usr/bin/env bash
# The GPU path on one GPU, a PASS or FAIL line per stage (scripts/gpu_smoke.py says what each checks).
# A lent machine without vLLM runs the trainer stages: carry torchtitan's wheel and pip install it first.
#   scripts/gpu_smoke.sh            exit status 0 when every stage passed
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
exec timeout 600 "$PY" -m torch.distributed.run --nproc-per-node 1 scripts/gpu_smoke.py
