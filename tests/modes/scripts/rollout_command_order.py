"""A rollout rank admits what a Progress grants before it applies a SyncWeights queued behind it.

One real vLLM engine and the real RolloutWorker; the trainer side is scripted: a control stand-in hands
the worker [Progress (room for one more group), SyncWeights(1)] in a single poll, as happens when the
trainer finishes a step while the rollout rank is inside an engine step. The weight sync reloads the same
weights as version 1. The granted group must be admitted on version 0, so its first tokens carry version 0:
that is what lets one_step_off train exactly the previous policy's batch. Writes a JSON report to argv[1].
"""

import json
import os
import sys
import time

from safetensors.torch import load_file

from reflow.algorithms.settings import advantage_estimator
from reflow.config.job_config import JobConfig
from reflow.model.recipe import load_recipe, resolve_path
from reflow.modes.prompts import PromptStream, initial_shares
from reflow.modes.rollout_worker import RolloutWorker
from reflow.rollout.admission import AdmissionGate
from reflow.rollout.engine import RolloutEngine
from reflow.rollout.groups import PromptGroups
from reflow.rollout.scoring import TaskScorer
from reflow.rollout.tokenizer import PromptTokenizer
from reflow.rollout.turns import TurnDriver
from reflow.scheduler import DispatchBudget, DispatchRule
from reflow.tasks import build_task, load_problems
from reflow.types import GroupDone, Progress, Stop, SyncWeights

cfg = JobConfig()
cfg.training.group_size = 2
cfg.rollout.max_new_tokens = 24
recipe = load_recipe("tiny")
hf = resolve_path(recipe.hf_checkpoint)
engine = RolloutEngine(cfg.rollout, recipe, hf, seed=0)
weights = list(load_file(os.path.join(hf, "model.safetensors")).items())


class SameWeights:
    """The weight sync, minus the trainer: reload the checkpoint's weights as ``version``."""

    def sync(self, trainer, rollout_engine, version):
        rollout_engine.load_weights(weights, version)


class CollectingOutbox:
    def __init__(self):
        self.groups = []

    def put(self, dst, body):
        if isinstance(body, GroupDone):
            self.groups.append(body.samples)


class ScriptedControl:
    """Polls 1-2: nothing (the window's two groups run); poll 3: Progress + SyncWeights together; then
    Stop once every group has been sent."""

    leader = 0

    def __init__(self, outbox):
        self.outbox, self.polls = outbox, 0

    def poll(self):
        self.polls += 1
        if self.polls == 3:
            return [Progress(steps_done=1, retired=2), SyncWeights(1)]
        if len(self.outbox.groups) == 3:
            return [Stop()]
        return []

    def wait(self, timeout=None):
        time.sleep(timeout or 0)
        return None


outbox = CollectingOutbox()
task, tokenizer = build_task(cfg.task), PromptTokenizer(hf)
budget = DispatchBudget(DispatchRule(window=4), 0, 1, group_size=2)  # one_step_off's window of 2 batches
stream = PromptStream(load_problems(resolve_path(cfg.task.train_file)), 0)
groups = PromptGroups(stream, initial_shares(1)[0], task, tokenizer, 2, cfg.rollout.max_new_tokens, cfg.job.seed)
turns = TurnDriver(engine, task, tokenizer)
worker = RolloutWorker(
    engine, turns, groups, TaskScorer(task, tokenizer, advantage_estimator(cfg)),
    SameWeights(),
    ScriptedControl(outbox), outbox, budget, AdmissionGate(cfg.scheduler, cfg.rollout, engine, 2, turns), 0, [0],
    first_tokens_before_sync=True,  # as one_step_off runs it (async and reflow: tests/modes/test_roles.py)
)
worker.run()
report = {
    "groups": len(outbox.groups),
    "birth_versions": [min(s.birth_version for s in group) for group in outbox.groups],
    "last_versions": [max(max(s.versions) for s in group) for group in outbox.groups],
    "started": len(worker.ledger["started"]),
}
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
