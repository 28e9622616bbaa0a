#!/usr/bin/env bash
# The GPU path on one GPU, a PASS or FAIL line per stage (scripts/gpu_smoke.py says what each checks).
# A lent machine without vLLM runs the trainer stages: carry gpu_wheels/ (scripts/gpu_wheels.sh downloads it
# here) and this script installs it offline first.
#   scripts/gpu_smoke.sh            exit status 0 when every stage passed
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
if [ -d gpu_wheels ] && ! "$PY" -c "import torchtitan" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps gpu_wheels/*.whl
fi
# under the lent machine's 600 s per command, so the summary line is printed even when a stage hangs
exec timeout -k 10 ${SMOKE_TIMEOUT_S:-540} "$PY" -m torch.distributed.run --nproc-per-node 1 scripts/gpu_smoke.py
