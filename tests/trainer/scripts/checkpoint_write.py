"""One process (a gloo group of 1): save or load a checkpoint through ``CheckpointManager``.

    checkpoint_write.py save DIR STEP VALUE KEEP_LAST [--stall]   # --stall: hang once the data is written,
                                                                  # before DCP writes the metadata
    checkpoint_write.py load DIR                                  # prints {"steps": [...], "value": ...}
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from reflow.checkpoint import CheckpointManager
from reflow.config.job_config import JobConfig

mode, folder = sys.argv[1], sys.argv[2]
cfg = JobConfig()
cfg.checkpoint.enable = True
cfg.job.dump_folder = folder
cfg.checkpoint.keep_last = int(sys.argv[5]) if mode == "save" else 0
manager = CheckpointManager(cfg.checkpoint, cfg.job.dump_folder)

if mode == "load":
    steps = manager.available_steps()
    state = {"trainer": {"weight": torch.zeros(1 << 20)}, "extra": {"step": 0}}
    dcp.load(state, checkpoint_id=manager._path(steps[-1]))
    print(json.dumps({"steps": steps, "value": state["trainer"]["weight"].unique().tolist(), "step": state["extra"]["step"]}))
    sys.exit(0)

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29533"))
dist.init_process_group("gloo", rank=0, world_size=1)
step, value = int(sys.argv[3]), float(sys.argv[4])
if "--stall" in sys.argv:
    writer_finish = dcp.FileSystemWriter.finish

    def stalled_finish(self, metadata, results):  # every data file is written; the metadata is next
        print("stalled", flush=True)
        time.sleep(600)
        return writer_finish(self, metadata, results)

    dcp.FileSystemWriter.finish = stalled_finish


class Trainer:
    group = dist.group.WORLD

    def state_dict(self):
        return {"weight": torch.full((1 << 20,), value)}


print(manager.save(step, Trainer(), {"step": step}), flush=True)
dist.destroy_process_group()
