"""``reflow.train`` with a fault injected: from the ``REFLOW_TEST_NAN_FROM``-th optimizer update on (one update
per step in the test's config, so from that step on), every advantage is NaN, as a NaN reward would make it.
Arguments are reflow.train's."""

import dataclasses
import os
import sys

from reflow.train import main
from reflow.trainer.policy import PolicyTrainer

first_bad_update = int(os.environ["REFLOW_TEST_NAN_FROM"])
backward = PolicyTrainer._backward


def poisoned_backward(self, mb, old_lp, ref_lp, den, stats, padding=False):
    if self.num_updates + 1 >= first_bad_update and not padding:
        mb = dataclasses.replace(mb, advantages=mb.advantages * float("nan"))
    return backward(self, mb, old_lp, ref_lp, den, stats, padding)


PolicyTrainer._backward = poisoned_backward
sys.exit(main(sys.argv[1:]))
