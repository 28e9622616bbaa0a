"""The driver a rank runs its trajectories through: a ``TurnDriver`` (single-turn tasks, and multi-turn tasks
with an ``Environment``), or for an agent task an ``AgentDriver`` over the rank's agents' process (its endpoint
and its agents, ``reflow.serving.agent_host``).

    serving = AgentServing.start(task, tokenizer, name, rollout)    # None unless task.name = 'agent'
    turns = new_driver(engine, task, tokenizer, tool_workers, rewards, serving)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from reflow.rollout.turns import TurnDriver

if TYPE_CHECKING:
    from reflow.rewards import RewardMix
    from reflow.rollout.protocols import Engine
    from reflow.rollout.tokenizer import PromptTokenizer
    from reflow.serving.agent_host import AgentHost
    from reflow.serving.agents import AgentDriver
    from reflow.tasks.base import Task


@dataclass
class AgentServing:
    """A rank's endpoint for its agent episodes (loopback, a key of its own) and its agents, in a process of their
    own."""

    host: "AgentHost"

    @classmethod
    def start(cls, task: "Task", tokenizer: "PromptTokenizer", name: str, rollout) -> "AgentServing | None":
        if task.name != "agent":
            return None
        from reflow.serving.agent_host import AgentHost

        return cls(AgentHost.start(task, tokenizer, name, rollout))

    def close(self) -> None:
        self.host.close()


def new_driver(
    engine: "Engine", task: "Task", tokenizer: "PromptTokenizer", tool_workers: int,
    rewards: "RewardMix | None" = None, agents: AgentServing | None = None,
) -> "TurnDriver | AgentDriver":
    """A driver over ``engine`` (several may share one engine: the run's and the evaluation's)."""
    if task.name == "agent":
        from reflow.serving.agents import AgentDriver

        if agents is None:
            raise ValueError("an agent task needs the rank's endpoint (AgentServing.start)")
        return AgentDriver(engine, task, tokenizer, agents.host, rewards)
    return TurnDriver(engine, task, tokenizer, tool_workers, rewards)
