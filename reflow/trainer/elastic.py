"""Resizing the replica dimension of the trainer's HSDP mesh at runtime, without gathering a shard.

A trainer placement n x S (dp_replicate x dp_shard) uses ranks 0 .. nS - 1, and shard s of every replica
holds the same rows of every tensor, whatever n is. So a placement change only has to change which FSDP
module the local shards live in (``fully_shard`` binds its process groups when it is applied) and, for a
joining rank, fill its shards:

  skeletons   one FSDP module per placement a rank can belong to, built at startup on the meta device
              (fully_shard over that placement's mesh: no storage, no communication).
  stay        ``adopt``: the rank's local parameter shards, wrapped as DTensors on the target mesh, are
              loaded into the target skeleton with ``load_state_dict(assign=True)``; FSDP2 takes each
              tensor as its sharded storage without a copy (it copies only a shard it has to pad, when
              dim 0 does not divide by the shard degree). AdamW's moments are re-wrapped the same way and
              the ``step`` tensors carried over: same storage, new mesh.
  leave       ``release``: the storage of the parameter, moment and reference shards is freed (the
              module objects stay; on CUDA the bytes return to the caching allocator). Freed, not parked
              in host memory as a colocated rank's state is (``reflow.trainer.offload``): the staying
              replicas keep training, so a parked copy would be stale by the time the rank rejoins, and a
              joining rank receives current shards anyway.
  join        ``adopt`` of fresh zero shards, then ``shard_tensors`` lists what to receive: shard s's
              parameters, AdamW moments and step counters, and the frozen reference's parameters, in one
              canonical order that every rank derives alone. ``reflow.distributed.buckets`` moves them
              from replica 0's rank of shard s in flat buckets over the target mesh's dp_replicate group
              of shard s (built at startup); every shard index transfers in parallel.

What does not work, and why this shape (torch 2.13, see shared/probes): pointing an existing FSDP module
at another mesh (it keeps its groups and hangs in backward), ``fully_shard`` twice on one module, and
reusing optimizer state across meshes ("Cannot run aten.lerp_.Scalar on inputs with different meshes").
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def rewrap(tensor: DTensor, mesh) -> DTensor:
    """The same local shard as a DTensor on another mesh with the same placements (a view, no copy)."""
    return DTensor.from_local(
        tensor.to_local(), mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


@torch.no_grad()
def adopt(skeleton: torch.nn.Module, mesh, sources: dict[str, torch.Tensor]) -> list[str]:
    """Make ``skeleton``'s parameters the given local shards (zero-copy). Returns the names FSDP copied.

    ``sources`` maps each parameter name (``named_parameters``: a tied parameter under its first name) to a
    local tensor of the shard's shape on this rank. Tied names (the embedding and the LM head of a model
    with ``enable_weight_tying``) get one ``Parameter`` object, so they stay one parameter."""
    state, by_identity = {}, {}
    first_names = {id(param): name for name, param in skeleton.named_parameters()}
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        if id(param) not in by_identity:
            local = DTensor.from_local(
                sources[first_names[id(param)]], mesh, param.placements, run_check=False, shape=param.shape,
                stride=param.stride(),
            )
            by_identity[id(param)] = torch.nn.Parameter(local, requires_grad=param.requires_grad)
        # state-dict names: activation checkpointing's wrapper drops its prefix there (and adds it back on load)
        state[name.replace("_checkpoint_wrapped_module.", "")] = by_identity[id(param)]
    skeleton.load_state_dict(state, strict=True, assign=True)
    return [name for name, param in skeleton.named_parameters() if param.to_local().data_ptr() != sources[name].data_ptr()]


def reshard(module: torch.nn.Module) -> None:
    """Register the sharded parameters again: FSDP2 leaves the root's parameters unsharded after a forward
    without backward (the reference model's, or the policy's old log-probs), until the next forward."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def local_shards(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    reshard(module)
    return {name: param.to_local() for name, param in module.named_parameters()}


def zero_shards(skeleton: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Fresh zero-filled local shards shaped as ``skeleton``'s (for a joining rank, filled by a transfer)."""
    return {name: torch.zeros(p.to_local().shape, dtype=p.dtype, device=device) for name, p in skeleton.named_parameters()}


def carry_optimizer_state(new_opt: torch.optim.Optimizer, new_model, old_opt: torch.optim.Optimizer, old_model, mesh) -> None:
    """AdamW state of ``old_model``'s parameters onto ``new_model``'s (same names), re-wrapped on ``mesh``;
    the hyper-parameters (lr and the rest) follow too."""
    old_params = dict(old_model.named_parameters())
    for name, param in new_model.named_parameters():
        state = old_opt.state.get(old_params[name])
        if state:
            new_opt.state[param] = {k: rewrap(v, mesh) if isinstance(v, DTensor) else v for k, v in state.items()}
    for new_group, old_group in zip(new_opt.param_groups, old_opt.param_groups):
        new_group.update({k: v for k, v in old_group.items() if k != "params"})


def zero_optimizer_state(opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """AdamW state as its lazy init makes it (step 0, zero moments), for a load or a transfer to fill: for the
    trained parameters (a frozen one, a LoRA run's base, has none)."""
    for param in model.parameters():
        if not param.requires_grad:
            continue
        opt.state[param] = {
            # as AdamW's own lazy init: step on the CPU (the default, neither fused nor capturable, which keep it
            # on the device), in the default scalar dtype
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(param),
            "exp_avg_sq": torch.zeros_like(param),
        }


def shard_tensors(
    model: torch.nn.Module, opt: torch.optim.Optimizer, reference: torch.nn.Module | None, trained_only: bool = False,
) -> list[torch.Tensor]:
    """This rank's shard of everything a trainer replica holds, in a canonical order: per parameter, the
    parameter, and for a trained one AdamW's exp_avg, exp_avg_sq and step; then the frozen reference's
    parameters. Two ranks with the same shard index derive the same shapes and dtypes (and which parameters
    train), so a transfer needs no metadata. ``trained_only``: the trained parameters and their state alone (a
    LoRA trainer, whose frozen base and reference are the checkpoint's)."""
    reshard(model)
    out = []
    for param in model.parameters():
        if trained_only and not param.requires_grad:
            continue
        out.append(param.to_local())
        if param.requires_grad:
            state = opt.state[param]
            out += [state["exp_avg"].to_local(), state["exp_avg_sq"].to_local(), state["step"]]
    if reference is not None and not trained_only:
        out += list(local_shards(reference).values())
    return out


@torch.no_grad()
def release(tensors: list[torch.Tensor]) -> int:
    """Free the storage behind ``tensors`` (a rank leaving the trainer pool); returns the bytes freed."""
    freed = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        freed += storage.nbytes()
        storage.resize_(0)
    return freed
