from reflow.distributed.placement import Placement, build_placement
from reflow.distributed.utils import TrainerLayout, build_trainer_layouts, device_type, exit_ranks, init_distributed

__all__ = [
    "Placement", "TrainerLayout", "build_placement", "build_trainer_layouts", "device_type", "exit_ranks",
    "init_distributed",
]
