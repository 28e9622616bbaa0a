"""Running a benchmark's worker under torchrun, on this machine's CPU settings, and reading back its JSON."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(extra: dict | None = None) -> dict:
    """The environment a benchmark's torchrun gets on this machine: vLLM in process, one compute thread per rank,
    1 GiB of KV cache per engine unless the caller's environment says otherwise; then ``extra``."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra or {})
    return env


def run_worker(name: str, nproc: int, args: list[str], raw_path: str, extra_env: dict | None = None) -> dict:
    """``torchrun --nproc-per-node nproc -m reflow.bench.<name> <name> <args> --worker=<raw_path>``: vLLM in
    process, one compute thread per rank. Returns the JSON the worker's rank 0 wrote to ``raw_path``;
    raises with the tail of its stderr if it failed."""
    env = cpu_env(extra_env)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
        "-m", f"reflow.bench.{name}", name, *args, f"--worker={raw_path}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} benchmark failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(raw_path) as f:
        return json.load(f)
