"""Apply FSDP2 to the policy: each transformer block, then the root; optionally activation checkpointing and
torch.compile of each block first (torchtitan's parallelize order: AC, compile, FSDP).

With a 2-D mesh (dp_replicate, dp_shard) ``fully_shard`` gives HSDP: parameters
are sharded over dp_shard and replicated over dp_replicate.

Gradients are reduced with a pure SUM, neither averaged over the data-parallel
ranks nor pre-multiplied: the loss is divided by the global token count
instead, so the gradient scale does not depend on how many ranks train, and a
change between 1 and 2 replicas does not change the arithmetic (with more, the
all-reduce associates its sum differently: float rounding apart). Gloo has no
PREMUL_SUM, which a divide factor alone would select.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    return model


def apply_full_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every transformer block in the backward pass (torchtitan's ``FullAC``). The blocks' state-dict
    names do not change (the wrapper's hooks drop its prefix), so checkpoints, the HF adapter and the weight
    sync see the same names."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    FullAC(FullAC.Config()).apply(model)


def apply_block_compile(model: torch.nn.Module) -> None:
    """torch.compile each transformer block in place (``nn.Module.compile``: the module stays where it is, so
    no ``_orig_mod`` enters the state-dict names), one graph per block, as torchtitan's ``apply_compile``:
    the blocks are alike, so one compile serves them all."""
    refuse_eager_fallback()
    for block in model.layers.values():
        block.compile(fullgraph=True)


def refuse_eager_fallback() -> None:
    """Make a compiled function that reaches dynamo's recompile limit fail, not run eagerly from then on.

    Micro-batch widths and row counts change every step. Dynamo compiles a block (and torchtitan's compiled
    flex attention) for the first shape, recompiles once with the changed dimension symbolic, and reuses that
    graph for every later shape (``tests/trainer/test_recompiles.py`` counts the graphs over a run). Should
    something specialize per shape anyway, the limit (8) would be reached some steps in, and the silent
    fallback would run flex attention eagerly, which materializes the B x H x L x L scores (about 13 GB per
    layer and row at 10k tokens on an 8B model): an out-of-memory error long after the cause. A loud error
    at the limit names it instead. Process-wide; vLLM's compiled model dispatches without dynamo's guards,
    so it never recompiles through them."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True
