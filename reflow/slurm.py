"""Render (and optionally submit) the Slurm batch script of a config: nodes and tasks follow its placement.

    python -m reflow.slurm --config train_configs/qwen3_8b.toml [--gpus-per-node 8] [--partition P]
        [--time 24:00:00] [--account A] [--out FILE] [--submit] [--section.key=value ...]
    python -m reflow.slurm --config train_configs/tiny.toml --gpus-per-node 0 --ranks-per-node 2 --tasks-per-node 2

The config's placement fixes the world size W (trainer replicas x shard degree + rollout ranks; with
trainer_shard_degree = -1, pass --world-size). A node runs
``--ranks-per-node`` ranks (default: its GPUs), split over ``--tasks-per-node`` torchrun agents (default 1),
so the job has W / (ranks per agent) agents on ceil(agents / tasks per node) nodes; every agent joins one
c10d rendezvous on the first node (torchrun's own multi-node launch). ``--gpus-per-node 0`` is a CPU cluster.

The script checks the config, placement, data, model folder and checkpoint once (``reflow.train --check``)
before ``srun`` starts any rank; asks Slurm for SIGUSR1 ``--signal-s`` seconds before the time limit,
which torchrun forwards to every rank (each stops after its step and checkpoints; rank 0 records the stop,
``reflow.run_record``). torchrun itself then exits 1 with a SignalException, so the script decides by the
stop record instead: a run stopped by SIGUSR1 after a checkpoint requeues the job (``scontrol requeue``: it
resumes from that checkpoint in a new allocation) and ends 0; one stopped by SIGTERM (scancel, preemption,
which Slurm requeues itself under ``--requeue``) ends 0. On a GPU cluster the job asks for host memory from
the memory plan: the pinned host memory of a node's ranks plus ``HOST_GIB_PER_RANK`` for each rank's own
(``--mem``; a CPU cluster's ranks hold everything in host memory, which the plan does not size). The log
goes to ``<dump_folder>/slurm/%x-%j.out``, a folder this command creates (Slurm opens the log before the
script runs).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

from reflow.config import ConfigError, ConfigManager
from reflow.config.validate import validate, validate_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_GIB_PER_RANK = 16
"""Host memory a GPU rank uses beside its pinned buffers (the interpreter, torch, CUDA and NCCL host state,
vLLM's scheduler and tokenizer, the prompts): an allowance, not a measurement (no GPU node has run one yet)."""


@dataclass(frozen=True)
class JobShape:
    world_size: int
    nodes: int
    tasks_per_node: int
    ranks_per_task: int
    gpus_per_node: int

    @property
    def agents(self) -> int:
        return self.world_size // self.ranks_per_task


def job_shape(world_size: int, gpus_per_node: int, ranks_per_node: int, tasks_per_node: int) -> JobShape:
    """Nodes and torchrun agents for ``world_size`` ranks; ValueError naming the flag when they do not divide."""
    per_node = min(ranks_per_node, world_size)
    if per_node % tasks_per_node:
        raise ValueError(f"--tasks-per-node {tasks_per_node} must divide the ranks per node ({per_node})")
    per_task = per_node // tasks_per_node
    if world_size % per_task:
        raise ValueError(
            f"the placement's {world_size} ranks do not split into torchrun agents of {per_task} ranks "
            f"(--ranks-per-node {ranks_per_node} / --tasks-per-node {tasks_per_node})"
        )
    agents = world_size // per_task
    return JobShape(world_size, math.ceil(agents / tasks_per_node), min(tasks_per_node, agents), per_task, gpus_per_node)


def host_memory_gib(pinned_bytes_per_node: int, ranks_per_node: int) -> int:
    """The host memory a GPU node's job asks for (``--mem``): its pinned buffers plus each rank's own, whole GiB."""
    return math.ceil(pinned_bytes_per_node / 2**30 + HOST_GIB_PER_RANK * ranks_per_node)


def render(shape: JobShape, config: str, overrides: list[str], dump_folder: str, job_name: str, options: argparse.Namespace,
           mem_gib: int = 0) -> str:
    python = shlex.quote(options.python)
    args = " ".join(shlex.quote(a) for a in ["--config", config, *overrides])
    header = [
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={shape.nodes}",
        f"#SBATCH --ntasks-per-node={shape.tasks_per_node}",
        f"#SBATCH --ntasks={shape.agents}",
        f"#SBATCH --cpus-per-task={options.cpus_per_task}",
        f"#SBATCH --output={os.path.join(dump_folder, 'slurm', '%x-%j.out')}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=USR1@{options.signal_s}",
        "#SBATCH --requeue",
    ]
    if shape.gpus_per_node:
        header.append(f"#SBATCH --gpus-per-node={shape.gpus_per_node}")
    if mem_gib:
        header.append(f"#SBATCH --mem={mem_gib}G")
    for flag in ("partition", "time", "account"):
        if getattr(options, flag):
            header.append(f"#SBATCH --{flag}={getattr(options, flag)}")
    cpu_env = "" if shape.gpus_per_node else (
        "export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}\nexport OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}\n"
    )
    return f"""#!/bin/bash
# Rendered by `python -m reflow.slurm` for {config}: {shape.world_size} ranks = {shape.agents} torchrun agent(s) x
# {shape.ranks_per_task} rank(s), {shape.tasks_per_node} agent(s) per node on {shape.nodes} node(s).
{chr(10).join(header)}

set -euo pipefail
cd {shlex.quote(ROOT)}
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
{cpu_env}head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=$((20000 + SLURM_JOB_ID % 20000))

# bad input is one line and exit code 2 here, before any rank starts
WORLD_SIZE={shape.world_size} {python} -m reflow.train {args} --check

started=$(date +%s)
set +e
srun --kill-on-bad-exit=1 {python} -m torch.distributed.run \\
  --nnodes {shape.agents} --nproc-per-node {shape.ranks_per_task} \\
  --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head_node:$port" \\
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout {max(options.signal_s - 10, 10)} \\
  -m reflow.train {args}
code=$?
set -e
# a stop signal: the ranks checkpointed and stopped, and torchrun exits 1 after forwarding the signal; the stop
# record (rank 0's) says what happened. SIGUSR1 is the time limit's warning: requeue, to resume in a new allocation
stop=$({python} -m reflow.run_record stopped {shlex.quote(dump_folder)} "$started" || true)
if [ -n "$stop" ]; then
  echo "reflow: the run stopped on $stop after its checkpoint"
  if [ "$stop" = SIGUSR1 ]; then
    echo "reflow: requeueing job $SLURM_JOB_ID: it resumes from that checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  exit 0
fi
exit $code
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reflow.slurm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--world-size", type=int, default=0,
                    help="ranks, when the placement leaves it open (trainer_shard_degree -1)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (0: a CPU cluster)")
    ap.add_argument("--ranks-per-node", type=int, default=0, help="ranks per node (default: --gpus-per-node)")
    ap.add_argument("--tasks-per-node", type=int, default=1, help="torchrun agents per node")
    ap.add_argument("--cpus-per-task", type=int, default=16)
    ap.add_argument("--partition", default="")
    ap.add_argument("--time", default="")
    ap.add_argument("--account", default="")
    ap.add_argument("--signal-s", type=int, default=120, help="seconds before the time limit that SIGUSR1 comes")
    ap.add_argument("--python", default=sys.executable, help="the Python the job runs (default: this one)")
    ap.add_argument("--out", default="", help="the sbatch file (default: <dump_folder>/slurm/<config name>.sbatch)")
    ap.add_argument("--submit", action="store_true", help="submit it with sbatch")
    options, overrides = ap.parse_known_args(argv)
    manager = ConfigManager()
    try:
        cfg = manager.parse_args(["--config", options.config, *overrides])
        validate(cfg, manager.where)
        placement = cfg.placement
        if placement.trainer_shard_degree > 0:
            world = placement.trainer_replicate_degree * placement.trainer_shard_degree + placement.num_rollout_ranks
            if options.world_size and options.world_size != world:
                raise ValueError(f"--world-size {options.world_size}: the config's placement has {world} ranks")
        elif options.world_size:
            world = options.world_size
        else:
            raise ValueError(
                f"{manager.where('placement.trainer_shard_degree')}: placement.trainer_shard_degree = -1 (every rank that "
                f"does not generate trains) leaves the world size open: pass --world-size"
            )
        built_placement = validate_world(cfg, world, manager.where)
        shape = job_shape(world, options.gpus_per_node, options.ranks_per_node or options.gpus_per_node or world,
                          options.tasks_per_node)
        mem_gib = 0
        if shape.gpus_per_node:
            from reflow.memory_plan import memory_plan
            from reflow.model.recipe import load_recipe

            plan = memory_plan(cfg, load_recipe(cfg.model.recipe), built_placement)
            ranks_per_node = shape.tasks_per_node * shape.ranks_per_task
            mem_gib = host_memory_gib(plan.pinned_host_bytes_per_rank() * ranks_per_node, ranks_per_node)
    except (ConfigError, ValueError) as e:
        print(f"reflow.slurm: {e}", file=sys.stderr)
        return 2
    dump = os.path.join(ROOT, cfg.job.dump_folder)  # the job runs in the repository, as the launchers do
    os.makedirs(os.path.join(dump, "slurm"), exist_ok=True)
    name = os.path.splitext(os.path.basename(options.config))[0]
    out = options.out or os.path.join(dump, "slurm", f"{name}.sbatch")
    with open(out, "w") as f:
        f.write(render(shape, os.path.abspath(options.config), overrides, dump, f"reflow-{name}", options, mem_gib))
    print(out)
    if options.submit:
        return subprocess.run(["sbatch", out]).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
