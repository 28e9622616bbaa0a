#!/usr/bin/env bash
# The device probe on a lent GPU machine, in one call (scripts/gpu_probe.py says what each stage measures).
# The machine has python3 with torch, no torchtitan, no network: carry gpu_wheels/ (scripts/gpu_wheels.sh
# downloads it here, about 2.5 MB, for Python 3.12). The wheels are unpacked into .probe_site/ (a wheel is a zip;
# no pip needed) and put on PYTHONPATH; the machine's own torch stays.
#   run tool: command "bash scripts/gpu_probe.sh $OUT", carry ["gpu_wheels"], timeout_s 600
#   here:     bash scripts/gpu_probe.sh /tmp/probe -- --cpu-selftest
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-probe_out}"
shift || true
[ "${1:-}" = "--" ] && shift
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
if [ -d gpu_wheels ]; then
  rm -rf .probe_site && mkdir -p .probe_site
  "$PY" - <<'PYEOF'
import glob, zipfile
for wheel in glob.glob("gpu_wheels/*.whl"):
    zipfile.ZipFile(wheel).extractall(".probe_site")
PYEOF
  export PYTHONPATH="$PWD/.probe_site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import torch, sys; print('probe: python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# the stages' caps sum to 480 s; the whole stays under the lent machine's 600 s per command, so the JSON comes back
status=0
timeout -k 10 "${PROBE_TIMEOUT_S:-540}" "$PY" scripts/gpu_probe.py --out "$OUT_DIR/gpu_probe.json" "$@" || status=$?
cat "$OUT_DIR/gpu_probe.json"
exit $status
