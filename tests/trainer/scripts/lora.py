"""2 ranks: the tiny policy with and without LoRA adapters (``reflow.trainer.lora``), in the shape LoRA runs
ship (every projection adapted, full activation checkpointing, a KL reference), through two steps, a resize
(2 replicas -> 1) and a step after it. Writes a JSON report to argv[1]:
  - log-probs at step 0 with and without LoRA, bitwise;
  - after training: which parameters changed (only adapters), which have gradients and optimizer state;
  - the merged export against W + (alpha / r) B A computed here, and that it has no adapter tensors;
  - a state dict saved and loaded into a fresh LoRA trainer: the same shards, bitwise.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file

from reflow.config.job_config import JobConfig
from reflow.distributed import build_trainer_layouts, exit_ranks, init_distributed
from reflow.model.recipe import load_recipe, resolve_path
from reflow.trainer.batch import pack
from reflow.trainer.elastic import local_shards
from reflow.trainer.hf_io import full_tensor
from reflow.trainer.lora import lora_modules
from reflow.trainer.policy import PolicyTrainer

rank, world, device = init_distributed()
recipe = load_recipe("tiny")
hf_dir = resolve_path(recipe.hf_checkpoint)
layouts = build_trainer_layouts(world, 1, [2, 1])
out_dir = os.path.dirname(os.path.abspath(sys.argv[1]))


def batch(k: int):
    g = torch.Generator().manual_seed(k)
    rows = [(torch.randint(3, 30, (4,), generator=g).tolist(),
             torch.randint(3, 30, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()) for _ in range(4)]
    return pack([p for p, _ in rows], [o for _, o in rows], [[-1.0] * len(o) for _, o in rows], [[0] * len(o) for _, o in rows],
                [1.0, -1.0, 0.5, -0.5], [1.0] * 4, [0.0] * 4, 0)


def build(lora_rank: int, adapter: str = "", param_dtype: str = "float32") -> PolicyTrainer:
    cfg = JobConfig()
    cfg.lora.adapter = adapter
    cfg.training.param_dtype = param_dtype
    cfg.training.lr = 5e-3
    cfg.training.num_minibatches = 2
    cfg.training.activation_checkpointing = "full"
    cfg.kl.coef = 0.05
    cfg.lora.rank = lora_rank
    cfg.lora.alpha = 16.0
    return PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, 2, device)


report = {}
plain, adapted = build(0), build(8)
probe = batch(100 + rank)
report["init_logprobs_bitwise"] = bool(torch.equal(plain.compute_logprobs(probe), adapted.compute_logprobs(probe)))
report["adapted_modules"] = len(lora_modules(adapted.model))
report["trainable"] = sorted({name.rsplit(".", 1)[-1] for name, p in adapted.model.named_parameters() if p.requires_grad})
before = {name: t.clone() for name, t in local_shards(adapted.model).items()}
for k in range(2):
    adapted.train_step([batch(10 * k + rank)])
after = local_shards(adapted.model)
report["changed"] = sorted({name.rsplit(".", 1)[-1] for name in before if not torch.equal(before[name], after[name])})
report["grads_on_frozen"] = sum(1 for p in adapted.model.parameters() if not p.requires_grad and p.grad is not None)
report["optimizer_states"] = len(adapted.optimizer.state)
report["trainable_count"] = sum(1 for p in adapted.model.parameters() if p.requires_grad)
report["logprobs_moved"] = not bool(torch.equal(plain.compute_logprobs(probe), adapted.compute_logprobs(probe)))

# the merged export
export = os.path.join(out_dir, "export")
adapted.export_hf(export)
state = adapted.model.state_dict()
name = "layers.0.attention.qkv_linear.wq"
w, a, b = (full_tensor(state[f"{name}.{part}"]).float() for part in ("weight", "lora_a", "lora_b"))
expected = w + (16.0 / 8) * (b @ a)
if rank == 0:
    exported = {}
    for file in os.listdir(export):
        if file.endswith(".safetensors"):
            exported.update(load_file(os.path.join(export, file)))
    report["export_merged_max_diff"] = float((exported["model.layers.0.self_attn.q_proj.weight"] - expected).abs().max())
    report["export_differs_from_base"] = float((exported["model.layers.0.self_attn.q_proj.weight"] - w).abs().max())
    report["export_has_adapter_tensors"] = any("lora" in key for key in exported)

# the peft adapter folder, and the log-probs the trainer gives to a probe (the test loads the folder with peft)
report["adapter_modules"] = adapted.export_adapter(os.path.join(out_dir, "adapter"))
probe_tokens = [3, 17, 5, 9, 22, 4, 11, 8, 19, 6]
peft_probe = pack([probe_tokens[:4]], [probe_tokens[4:]], [[-1.0] * 6], [[0] * 6], [1.0], [1.0], [0.0], 0)
report["peft_probe_tokens"] = probe_tokens
report["trainer_logprobs"] = adapted.compute_logprobs(peft_probe)[0].tolist()

# a run that starts from that folder (lora.adapter) has the same adapters: the same log-probs, bitwise
started = build(8, adapter=os.path.join(out_dir, "adapter"))
report["start_from_folder_bitwise"] = bool(torch.equal(started.compute_logprobs(probe), adapted.compute_logprobs(probe)))
del started

# a checkpoint's state dict into a fresh LoRA trainer
saved = adapted.state_dict()
fresh = build(8)
fresh.load_state_dict(saved)
report["resume_bitwise"] = all(torch.equal(x, y) for x, y in zip(local_shards(fresh.model).values(),
                                                                   local_shards(adapted.model).values()))
report["resume_logprobs_bitwise"] = bool(torch.equal(fresh.compute_logprobs(probe), adapted.compute_logprobs(probe)))

# a resize (a rank leaves the trainer), and a step after it on the one left: the base stays frozen
base_before = {n: t.clone() for n, t in local_shards(adapted.model).items() if "lora" not in n}
adapted.resize(1, bucket_bytes=1 << 20)
if adapted.active:
    adapted.train_step([batch(50), batch(51)])
    shards = local_shards(adapted.model)
    report["after_resize_base_unchanged"] = all(torch.equal(base_before[n], shards[n]) for n in base_before)
    report["after_resize_optimizer_states"] = len(adapted.optimizer.state)

# and back to 2 replicas: the rank that rejoins reads the frozen base from the checkpoint and receives only the
# adapters and their AdamW state; both replicas then hold the same shards, bitwise
grow = adapted.resize(2, bucket_bytes=1 << 20)
shards = [t.clone() for t in local_shards(adapted.model).values()]
theirs = [torch.empty_like(t) for t in shards]
for mine, other in zip(shards, theirs):
    gathered = [torch.empty_like(mine) for _ in range(world)]
    torch.distributed.all_gather(gathered, mine)
    other.copy_(gathered[1 - rank])
report_grow = {"bitwise_equal": all(torch.equal(a, b) for a, b in zip(shards, theirs))}
if rank == 1:
    trained = sum(p.numel() * p.element_size() for p in adapted.model.parameters() if p.requires_grad)
    everything = sum(p.numel() * p.element_size() for p in adapted.model.parameters())
    report_grow.update(bytes_moved=grow.bytes_moved, trained_bytes=trained, model_bytes=everything)
grown = [None] * world
torch.distributed.all_gather_object(grown, report_grow)
report["grow"] = grown
# bf16 gathers (the GPU recipes'): the frozen base is kept in bf16, the adapters in float32, and the model is the
# bf16 trainer's without LoRA, bitwise, at step 0
plain16, lora16 = build(0, param_dtype="bfloat16"), build(8, param_dtype="bfloat16")
report["bf16_frozen_dtypes"] = sorted({str(p.dtype) for p in lora16.model.parameters() if not p.requires_grad})
report["bf16_trained_dtypes"] = sorted({str(p.dtype) for p in lora16.model.parameters() if p.requires_grad})
report["bf16_init_logprobs_bitwise"] = bool(torch.equal(plain16.compute_logprobs(probe), lora16.compute_logprobs(probe)))
lora16.train_step([batch(60 + rank)])
report["bf16_trains"] = not bool(torch.equal(plain16.compute_logprobs(probe), lora16.compute_logprobs(probe)))
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
    print(json.dumps(report, indent=1))
exit_ranks()
