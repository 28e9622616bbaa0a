"""Hugging Face checkpoints in and out of the sharded torchtitan model.

Loading reads only what each rank's shards need (DCP's Hugging Face storage
reader over the adapter's HF names). Export gathers full tensors on the
trainer mesh and writes safetensors plus the tokenizer and config files of
the source checkpoint, so vLLM (and transformers) load the result.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from reflow.trainer.hf_shards import ShardWriter
from reflow.trainer.lora import PEFT_CONFIG, PEFT_WEIGHTS, adapters_of, build_adapter_plan, merge

HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def is_derived_buffer(key: str) -> bool:
    """A state-dict entry derived at build time (the RoPE cache), never in a checkpoint or an export."""
    return "rope" in key or "freqs" in key


def is_lora_key(key: str) -> bool:
    """A LoRA adapter's tensor (``reflow.trainer.lora``): never in a base checkpoint; merged into its projection
    in an export and a weight sync."""
    return key.endswith((".lora_a", ".lora_b"))


def build_adapter(model_config, hf_dir: str | None):
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    has_index = bool(hf_dir) and os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json"))
    return Qwen3StateDictAdapter(model_config, hf_dir if has_index else None)


def check_hf_dir(hf_dir: str, key: str = "model.hf_checkpoint") -> None:
    """A Hugging Face folder the trainer and the engine can load: weights (safetensors), config.json and a
    tokenizer (tokenizer.json, or tokenizer_config.json with its vocabulary files)."""
    if not hf_dir or not os.path.isdir(hf_dir):
        raise ValueError(f"{key}: Hugging Face checkpoint folder not found: {hf_dir!r}")
    files = set(os.listdir(hf_dir))
    if not any(f.endswith(".safetensors") for f in files):
        raise ValueError(f"{key}: no .safetensors weights in {hf_dir}")
    if "config.json" not in files:
        raise ValueError(f"{key}: no config.json in {hf_dir}")
    if not files & {"tokenizer.json", "tokenizer_config.json"}:
        raise ValueError(f"{key}: no tokenizer (tokenizer.json or tokenizer_config.json) in {hf_dir}")
    for name in sorted(f for f in files if f.endswith(".safetensors")):
        check_safetensors(os.path.join(hf_dir, name), key)


SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                      "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def check_safetensors(path: str, key: str) -> None:
    """A safetensors file whose header reads and whose tensors fill the file exactly (the format: an 8-byte
    little-endian header length, a JSON header of {name: {dtype, shape, data_offsets}}, then the data): a
    header overwritten with junk or a truncated download is one line naming the file, before any rank loads
    it, instead of a traceback from deep inside the loader. Only the header is read."""
    size = os.path.getsize(path)

    def bad(why: str) -> ValueError:
        return ValueError(f"{key}: {path} is not a readable safetensors file: {why} (download it again)")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the header's length field")
        length = int.from_bytes(head, "little")
        if length <= 0 or 8 + length > size:
            raise bad(f"its header claims {length} bytes, the file has {size}")
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise bad(f"its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = entry["data_offsets"]
            count = SAFETENSORS_DTYPES[entry["dtype"]]
            for dim in entry["shape"]:
                count *= dim
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has no dtype, shape or data_offsets the format knows") from None
        if stop - start != count:
            raise bad(f"tensor {name!r} spans {stop - start} bytes, its shape and dtype need {count}")
        end = max(end, stop)
    if 8 + length + end != size:
        raise bad(f"its tensors end at byte {8 + length + end}, the file has {size} (truncated?)" if 8 + length + end > size
                  else f"{size - 8 - length - end} bytes follow its last tensor")


@torch.no_grad()
def load_hf_into(model: torch.nn.Module, adapter, hf_dir: str, process_group=None, alone: bool = False) -> None:
    """Fill the (sharded) model from a HF safetensors folder. ``alone``: this rank reads its own shards with no
    collective (a rank joining a LoRA trainer takes the frozen base from the checkpoint, not from a peer)."""
    check_hf_dir(hf_dir)
    state = model.state_dict()
    hf_state = adapter.to_hf(state)
    dcp.load(hf_state, storage_reader=adapter.get_hf_storage_reader(hf_dir), process_group=process_group,
             no_dist=alone)
    missing, unexpected = model.load_state_dict(adapter.from_hf(hf_state), strict=False)
    missing = [m for m in missing if not is_derived_buffer(m) and not is_lora_key(m)]  # (adapters: init_lora)
    if missing or unexpected:
        raise ValueError(f"{hf_dir}: checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Gather a DTensor on its mesh (a collective for every mesh member)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def export_hf(model: torch.nn.Module, adapter, out_dir: str, source_dir: str, group=None,
              shard_bytes: int = 5 * 2**30, lora_scale: float = 0.0) -> None:
    """Write the policy as a HF folder of float32 safetensors shards. Every trainer rank of ``group`` calls: each
    tensor is gathered on the mesh, one at a time, and shard k is written by the k-th rank of the group modulo
    its size (``reflow.trainer.hf_shards``), so no rank holds more than one shard on the host (never the whole
    float32 model on one rank: 131 GB for 32B). The tokenizer and config files come from ``source_dir``. A LoRA
    run's projections are written merged (``lora_scale``: alpha / rank)."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    writer = ShardWriter(out_dir, shard_bytes, writer=rank, writers=size)
    count = 0
    state = model.state_dict()
    adapted = adapters_of(state, state)
    for key, value in state.items():
        if not value.is_floating_point() or is_derived_buffer(key) or is_lora_key(key):
            continue
        full = full_tensor(value)  # collective: every trainer rank gathers, one tensor at a time
        if key in adapted:  # a LoRA run: the projection as the policy has it, W + (alpha / r) B A
            a, b = (full_tensor(state[k]) for k in adapted[key])
            full = merge(full, a, b, lora_scale)
        for hf_name, hf_value in adapter.to_hf({key: full.detach()}).items():
            writer.add(hf_name, hf_value.numel() * 4, lambda hf_value=hf_value: hf_value.to("cpu", torch.float32))
            count += 1
        del full
    writer.close()
    if rank == 0:
        for name in HF_SIDE_FILES:
            src = os.path.join(source_dir, name)
            if os.path.exists(src):
                shutil.copy(src, os.path.join(out_dir, name))
        with open(os.path.join(out_dir, "reflow_export.json"), "w") as f:
            json.dump({"source": os.path.abspath(source_dir), "num_tensors": count}, f)
    if dist.is_initialized():
        dist.barrier(group=group)  # every writer's shards are in place before anyone reads the folder


@torch.no_grad()
def export_peft_adapter(model: torch.nn.Module, adapter, model_config, out_dir: str, source_dir: str, lora,
                        group=None) -> int:
    """A LoRA policy's adapters as a ``peft`` folder (``adapter_config.json`` and ``adapter_model.safetensors``,
    in the layout of ``reflow.trainer.lora.build_adapter_plan``, which ``peft`` and vLLM read), loadable onto the
    source checkpoint. Every trainer rank of ``group`` calls (each adapter is gathered); the group's first rank
    writes. Returns the number of adapted projections. ``lora``: the run's [lora] section."""
    from safetensors.torch import save_file

    if lora.train_embeddings or lora.train_head:
        raise ValueError("lora.train_embeddings / lora.train_head: an adapter folder holds adapters only; the "
                         "merged export (hf_final) has the trained embeddings and head")
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    plan = build_adapter_plan(model_config, adapter, lora, source_dir)
    state = model.state_dict()
    tensors = {}
    for key, name, _ in plan.tensors:
        full = full_tensor(state[key])  # collective, on every rank of the group
        tensors[name] = full.detach().to("cpu", torch.float32).contiguous()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, PEFT_WEIGHTS))
        with open(os.path.join(out_dir, PEFT_CONFIG), "w") as f:
            json.dump(plan.config, f, indent=1)
    if dist.is_initialized():
        dist.barrier(group=group)
    return len(tensors) // 2
