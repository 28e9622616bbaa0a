from reflow.distributed.placement import Placement, build_placement
from reflow.distributed.utils import build_trainer_group, build_trainer_mesh, device_type, init_distributed

__all__ = ["Placement", "build_placement", "build_trainer_group", "build_trainer_mesh", "device_type", "init_distributed"]
