"""``reflow``: one launcher for every ReFlow command, in the project's own environment.

    reflow train [--nproc-per-node N] [torchrun flags] --config X [--section.key=value ...]
    reflow train --config X --dry-run        # the resolved config and memory plan, no ranks
    reflow evaluate --config X --hf DIR      # python -m reflow.bench.evaluate
    reflow export --config X [--step N]      # python -m reflow.export
    reflow bench modes ...                   # python -m reflow.bench

``reflow train`` checks the config, the placement for the world it will start, the data, the model folder and
the checkpoint in this process first: bad input is one line and exit code 2 here, before torchrun starts a
rank (under torchrun the same line would sit under torchrun's own traceback, with exit code 1). Then it runs
torchrun with the flags it recognizes as torchrun's (``--nproc-per-node``, ``--nnodes``, ``--rdzv-*``,
``--max-restarts``, ... anywhere on the line; the rest goes to ``reflow.train``). Without
``--nproc-per-node`` it starts the world the config's placement plans, on this node; without rendezvous
flags it runs torchrun ``--standalone`` (a free port). The CPU environment defaults (in-process vLLM engine,
one compute thread per rank) are set unless already set.
"""

from __future__ import annotations

import os
import sys

USAGE = __doc__.split("\n\n")[1]


def _torchrun_options() -> dict[str, bool]:
    """torchrun's option strings -> whether the option takes a value."""
    from torch.distributed.run import get_args_parser

    options = {}
    for action in get_args_parser()._actions:
        if action.dest in ("help", "module", "no_python", "run_path", "training_script", "training_script_args"):
            continue
        for option in action.option_strings:
            options[option] = action.nargs != 0
    return options


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's flags, reflow.train's arguments), each in the order given."""
    options = _torchrun_options()
    torchrun, train = [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name in options:
            torchrun.append(token)
            if options[name] and "=" not in token:
                if i + 1 >= len(argv):
                    raise SystemExit(f"reflow train: {name} needs a value")
                torchrun.append(argv[i + 1])
                i += 1
        else:
            train.append(token)
        i += 1
    return torchrun, train


def _flag(flags: list[str], *names: str) -> str | None:
    for i, token in enumerate(flags):
        name, _, value = token.partition("=")
        if name in names:
            return value or (flags[i + 1] if i + 1 < len(flags) else None)
    return None


def train(argv: list[str]) -> int:
    from reflow.config import ConfigError, ConfigManager
    from reflow.train import _planned_world_size
    from reflow.train import main as train_main

    torchrun, args = split_arguments(argv)
    if any(a in ("--dry-run", "--check", "-h", "--help") for a in args):
        return train_main(args)  # no ranks
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("TOKENIZERS_PARALLELISM", "false"), ("OMP_NUM_THREADS", "1")):
        os.environ.setdefault(key, value)
    nproc = _flag(torchrun, "--nproc-per-node", "--nproc_per_node")
    if nproc is None:
        try:
            nproc = str(_planned_world_size(ConfigManager().parse_args(args)))
        except (ConfigError, ValueError) as error:
            print(f"reflow: config error: {error}", file=sys.stderr)
            return 2
        torchrun = ["--nproc-per-node", nproc, *torchrun]
    nnodes = _flag(torchrun, "--nnodes") or "1"
    if not nproc.isdigit() or not nnodes.isdigit():
        print(f"reflow train: --nproc-per-node {nproc} and --nnodes {nnodes} must be whole numbers here "
              "(elastic ranges: run torchrun yourself after `reflow train --check`)", file=sys.stderr)
        return 2
    # 1. check in this process, for the world torchrun will start: one line and exit code 2 on bad input
    env_world = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(int(nproc) * int(nnodes))
    try:
        code = train_main(["--check", *args])
    finally:
        if env_world is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = env_world
    if code != 0:
        return code
    # 2. torchrun: a free port on one node unless a rendezvous was given
    rendezvous = any(_flag(torchrun, name) is not None for name in ("--rdzv-endpoint", "--rdzv_endpoint", "--master-addr",
                                                                    "--master_addr", "--master-port", "--master_port"))
    if not rendezvous and "--standalone" not in torchrun and nnodes == "1":
        torchrun = ["--standalone", *torchrun]
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun, "-m", "reflow.train", *args]
    sys.stdout.flush()
    os.execv(sys.executable, command)
    return 0  # (not reached)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        return train(rest)
    if command == "evaluate":
        from reflow.bench.evaluate import main as evaluate_main

        return evaluate_main(rest)
    if command == "export":
        from reflow.export import main as export_main

        return export_main(rest)
    if command == "bench":
        os.execv(sys.executable, [sys.executable, "-m", "reflow.bench", *rest])
    print(f"reflow: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
