"""Serve a Hugging Face checkpoint (a trained policy, an export) behind an OpenAI-compatible API, with the same
engine and endpoint code a training run's rollout side uses (``reflow.serving``): for evaluation and demos.

    python -m reflow.serve --hf outputs/tiny/hf_final [--config train_configs/tiny.toml] [--port 8000]
                           [--host 127.0.0.1] [--model-name NAME] [--api-key-file F] [--section.key=value ...]

The config gives the recipe and the [rollout] engine settings (context length, batch, KV cache); --hf replaces
its model. The API is ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` at
``http://HOST:PORT/v1``, bound to loopback unless --host says otherwise. Every request needs the run's key
(``Authorization: Bearer KEY``): the REFLOW_API_KEY environment variable, or a new random key written to
--api-key-file (default ~/.cache/reflow/serve_api_key; created anew with mode 0600, never through a link)
and never printed. It serves until SIGINT or SIGTERM.
Errors before serving (a bad folder, config or port) are one line, exit code 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def write_secret(path: str, secret: str) -> None:
    """``secret`` into ``path``, readable by this user alone: written to a new file (mode 0600, never an existing
    file or a link's target) beside it, then renamed over it."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(descriptor, "w") as f:
            f.write(secret + "\n")
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    ap = argparse.ArgumentParser(prog="python -m reflow.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="the Hugging Face folder to serve")
    ap.add_argument("--config", default="train_configs/tiny.toml", help="the recipe and [rollout] engine settings")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: any free port")
    ap.add_argument("--model-name", default="", help="the model's name in the API (default: the folder's name)")
    ap.add_argument("--api-key-file", default=os.path.expanduser("~/.cache/reflow/serve_api_key"),
                    help="where a new key is written (mode 0600)")
    ap.add_argument("--seed", type=int, default=0)
    a, overrides = ap.parse_known_args(argv)
    unknown = [arg for arg in overrides if not arg.startswith("--") or "=" not in arg]
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)} (config overrides are --section.key=value)")
    try:
        from reflow.config import ConfigManager
        from reflow.model.recipe import load_recipe
        from reflow.trainer.hf_io import check_hf_dir

        check_hf_dir(a.hf, "--hf")
        if not 0 <= a.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {a.port}")
        cfg = ConfigManager().parse_args(["--config", a.config, *overrides])
        recipe = load_recipe(cfg.model.recipe)
    except ValueError as error:
        print(f"reflow.serve: {error}", file=sys.stderr)
        return 2
    from reflow.rollout.engine import RolloutEngine
    from reflow.rollout.tokenizer import PromptTokenizer
    from reflow.serving.engine_loop import EngineLoop
    from reflow.serving.openai_api import ServedModel, build_app
    from reflow.serving.server import EndpointServer, new_api_key

    key = os.environ.get("REFLOW_API_KEY", "")
    if not key:
        key = new_api_key()
        try:
            write_secret(a.api_key_file, key)
        except OSError as error:
            print(f"reflow.serve: --api-key-file {a.api_key_file}: {error.strerror}", file=sys.stderr)
            return 2
    engine = RolloutEngine(cfg.rollout, recipe, a.hf, seed=a.seed)
    loop = EngineLoop(engine)
    name = a.model_name or os.path.basename(os.path.normpath(a.hf))
    served = ServedModel(loop, PromptTokenizer(a.hf), name, cfg.rollout.max_model_len)
    server = EndpointServer(build_app(served, key), a.host, a.port)
    try:
        base_url = server.start()
    except RuntimeError as error:
        loop.close()
        print(f"reflow.serve: {error}", file=sys.stderr)
        return 2
    where = "REFLOW_API_KEY" if os.environ.get("REFLOW_API_KEY") else a.api_key_file
    print(f"reflow.serve: {name} at {base_url} (key: {where})", file=sys.stderr, flush=True)
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    done.wait()
    server.stop()
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
