#!/usr/bin/env bash
# Local launcher: one node, NPROC ranks.
#   NPROC=2 CONFIG=train_configs/tiny.toml bash torchrun_scripts/run_train.sh [--section.key=value ...]
set -euo pipefail
NPROC=${NPROC:-2}
CONFIG=${CONFIG:-train_configs/tiny.toml}
# the project's environment when there is one (make creates .venv), else python3 from PATH
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
MASTER_PORT=${MASTER_PORT:-29511}
# vLLM runs inside each rank (no engine subprocess); small KV cache on CPU.
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Check the config, the placement for NPROC ranks, the data, the model folder and the checkpoint first: bad
# input is one line and exit code 2 here, before torchrun starts a rank.
WORLD_SIZE="$NPROC" "$PYTHON" -m reflow.train --config "$CONFIG" --check "$@"
exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" \
  -m reflow.train --config "$CONFIG" "$@"
