"""Apply FSDP2 to the policy: each transformer block, then the root.

With a 2-D mesh (dp_replicate, dp_shard) ``fully_shard`` gives HSDP: parameters
are sharded over dp_shard and replicated over dp_replicate.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
