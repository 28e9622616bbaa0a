"""Shared test helpers: the repo root, the tiny assets, and a torchrun launcher for multi-rank tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_HF = os.path.join(ROOT, "assets", "tiny-qwen3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(nproc: int, args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Launch ``torchrun --nproc-per-node nproc <args>`` (gloo on CPU) and return the finished process."""
    full_env = dict(os.environ)
    full_env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONPATH=ROOT + os.pathsep + full_env.get("PYTHONPATH", ""),
    )
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
           *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout[-4000:] + "\n---stderr---\n" + proc.stderr[-8000:])
        pytest.fail(f"torchrun {' '.join(args)} failed with exit {proc.returncode}:\n{tail}")
    return proc


@pytest.fixture
def root() -> str:
    return ROOT


def require_kernel_sandbox():
    """The code sandbox's kernel boundary on this host, or a skip that prints what is missing (bubblewrap, user
    namespaces): tests of tasks that run model code need it (``make test`` installs bubblewrap where it can)."""
    from reflow.envs.isolation import SandboxUnavailable
    from reflow.envs.sandbox import checked_boundary

    try:
        return checked_boundary()
    except SandboxUnavailable as error:
        pytest.skip(f"kernel sandbox unavailable on this host: {error}")
