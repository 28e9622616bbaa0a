"""1 rank (gloo): a torchtitan registry flavor, built as the GPU recipes build theirs (``build_model_config``),
sharded with FSDP2 as the trainer shards it, goes through what a GPU run does with its model: the state dict
the checkpoint saves (``get_model_state_dict``, as ``PolicyTrainer.state_dict``), a DCP save and a load into a
fresh model, and the HF names of the weight sync and export. torchtitan's ``debugmodel`` flavor is the one
small enough for a CPU; it fuses q/k/v the way the 4B-32B flavors do. Writes a JSON report to argv[2]; argv[1]
is a scratch folder for the checkpoint.

Before the fix, ``get_model_state_dict`` failed here with "'FusedQKVLinear' object has no attribute 'wq'", as
every GPU recipe would have at its first checkpoint."""

import dataclasses
import json
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from reflow.distributed import exit_ranks, init_distributed
from reflow.model.qwen3 import build_model_config, build_on_meta
from reflow.model.recipe import load_recipe
from reflow.trainer.parallelize import apply_fsdp

rank, world, device = init_distributed()
folder, out = sys.argv[1], sys.argv[2]
recipe = dataclasses.replace(load_recipe("tiny"), flavor="debugmodel")
cfg = build_model_config(recipe, "sdpa")
mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))


def sharded(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = cfg.build()
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    apply_fsdp(model, mesh)
    return model


model = sharded(0)
qkv_modules = sorted({type(m).__name__ for m in model.modules() if "QKV" in type(m).__name__})
state = get_model_state_dict(model)
dcp.save({"model": state}, checkpoint_id=folder)
fresh = sharded(1)
loaded = {"model": get_model_state_dict(fresh)}
dcp.load(loaded, checkpoint_id=folder)
set_model_state_dict(fresh, loaded["model"])
differ = [
    name for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items())
    if not torch.equal(a.full_tensor() if hasattr(a, "full_tensor") else a, b.full_tensor() if hasattr(b, "full_tensor") else b)
]
tokens = torch.randint(0, 100, (1, 12))
with torch.no_grad():
    same_logits = torch.equal(model(tokens), fresh(tokens))
meta_keys = sorted(build_on_meta(cfg).state_dict())
report = {
    "qkv_modules": qkv_modules,
    "state_keys": len(state),
    "layer0_keys": sorted(k for k in state if k.startswith("layers.0.attention.")),
    "differ_after_load": differ,
    "same_logits": same_logits,
    "keys_match_meta": sorted(state) == meta_keys,
}
with open(out, "w") as f:
    json.dump(report, f, indent=1)
exit_ranks()
