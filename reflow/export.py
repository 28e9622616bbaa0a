"""Export a run's checkpoint (any step, not only the end) as a Hugging Face folder that vLLM and transformers load.

    python -m reflow.export --config train_configs/tiny.toml [--step 40] [--out DIR] [--shard-gib 5] [--section.key=value ...]

The run is named by its config (its ``job.dump_folder`` and ``checkpoint.folder``, as training resolves them;
the run's own overrides, such as ``--job.dump_folder``, go after it). ``--step`` picks a saved step (default:
the latest complete one); ``--out`` defaults to ``<dump_folder>/hf_step<N>``. One process, no ranks: each
parameter is read from the distributed checkpoint on its own, converted to its Hugging Face name and written in
safetensors shards of at most ``--shard-gib`` (several shards come with the standard
``model.safetensors.index.json``), so the host never holds more than one shard, whatever the model's size. The
tokenizer and config files are copied from the run's source checkpoint. Every error is one line, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys


class ExportError(ValueError):
    pass


def export_checkpoint(argv: list[str]) -> dict:
    from reflow.checkpoint import CheckpointManager
    from reflow.config import ConfigManager
    from reflow.config.validate import validate
    from reflow.model.qwen3 import build_model_config, build_on_meta
    from reflow.model.recipe import load_recipe
    from reflow.train import resolve_hf_dir
    from reflow.trainer.hf_io import HF_SIDE_FILES, build_adapter

    ap = argparse.ArgumentParser(prog="python -m reflow.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the run's config (its dump folder and checkpoint folder)")
    ap.add_argument("--step", type=int, default=-1, help="the saved step to export (default: the latest)")
    ap.add_argument("--out", default="", help="output folder (default: <dump_folder>/hf_step<N>)")
    ap.add_argument("--shard-gib", type=float, default=5.0, help="largest safetensors shard, GiB")
    args, overrides = ap.parse_known_args(argv)
    manager = ConfigManager()
    cfg = manager.parse_args(["--config", args.config, *overrides])
    validate(cfg, manager.where)
    checkpoints = CheckpointManager(cfg.checkpoint, cfg.job.dump_folder)
    steps = checkpoints.available_steps()
    if not steps:
        raise ExportError(f"checkpoint.folder: no complete checkpoint in {checkpoints.folder} (the run saves them with "
                          "checkpoint.enable = true, every checkpoint.interval steps)")
    step = steps[-1] if args.step < 0 else args.step
    if step not in steps:
        raise ExportError(f"--step {step}: no complete checkpoint of that step in {checkpoints.folder} (available: {steps})")
    recipe = load_recipe(cfg.model.recipe)
    source = resolve_hf_dir(cfg, recipe, manager.where)
    model_cfg = build_model_config(recipe, cfg.model.attention)
    adapter = build_adapter(model_cfg, source)
    out = args.out or os.path.join(cfg.job.dump_folder, f"hf_step{step}")
    meta = build_on_meta(model_cfg)
    lora_scale = 0.0
    if cfg.lora.enabled:  # a LoRA run's checkpoint holds the base and the adapters: written merged
        from reflow.trainer.lora import apply_lora, model_projections

        apply_lora(meta, cfg.lora, model_projections(adapter))
        lora_scale = cfg.lora.alpha / cfg.lora.rank
    names = _write_shards(checkpoints._path(step), meta, adapter, out, int(args.shard_gib * 2**30), lora_scale)
    for name in HF_SIDE_FILES:
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), os.path.join(out, name))
    with open(os.path.join(out, "reflow_export.json"), "w") as f:
        json.dump({"source": os.path.abspath(source), "checkpoint": checkpoints._path(step), "step": step,
                   "num_tensors": len(names)}, f)
    return {"out": out, "step": step, "num_tensors": len(names)}


def _write_shards(checkpoint: str, meta_model, adapter, out: str, shard_bytes: int, lora_scale: float = 0.0) -> list[str]:
    """Every parameter read alone from the checkpoint (DCP reads just its bytes), renamed for HF, in float32,
    streamed into shards of at most ``shard_bytes`` (``reflow.trainer.hf_shards``); returns the HF names written.
    A LoRA run's projections are read with their adapters and written merged (``lora_scale``: alpha / rank)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from reflow.trainer.hf_io import is_derived_buffer, is_lora_key
    from reflow.trainer.hf_shards import ShardWriter
    from reflow.trainer.lora import adapters_of, merge

    def read(key: str, shape) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=torch.float32)
        dcp.load({"trainer": {"model": {key: tensor}}}, checkpoint_id=checkpoint, no_dist=True)
        return tensor

    writer = ShardWriter(out, shard_bytes)
    state = meta_model.state_dict()
    adapted = adapters_of(state, state)
    for key, meta in state.items():
        if not meta.is_floating_point() or is_derived_buffer(key) or is_lora_key(key):
            continue  # not in a checkpoint, or merged into its projection
        tensor = read(key, meta.shape)
        if key in adapted:
            a, b = (read(name, state[name].shape) for name in adapted[key])
            tensor = merge(tensor, a, b, lora_scale)
        for hf_name, value in adapter.to_hf({key: tensor}).items():
            writer.add(hf_name, value.numel() * value.element_size(), lambda value=value: value)
    return writer.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        result = export_checkpoint(argv)
    except ValueError as error:  # ExportError, ConfigError and the config loader's errors: one line each
        print(f"reflow.export: {error}", file=sys.stderr)
        return 2
    print(f"reflow.export: step {result['step']} -> {result['out']} ({result['num_tensors']} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
