"""Turning prompts into scored, packed training samples (shared by every mode)."""

from __future__ import annotations

import hashlib

import torch

from reflow.algorithms.grpo import group_advantages
from reflow.types import Sample
from reflow.rollout.engine import Request
from reflow.tasks.base import Problem, Task
from reflow.trainer.batch import TrainBatch, pack


class PromptTokenizer:
    """Wraps a Hugging Face tokenizer: encode prompts (BOS first when the tokenizer has one), decode completions."""

    def __init__(self, hf_dir: str, chat: bool = False):
        from transformers import AutoTokenizer

        self.hf_dir = hf_dir
        self.chat = chat
        """task.chat: a text prompt is rendered as a user message with the chat template too."""
        self.tok = AutoTokenizer.from_pretrained(hf_dir)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        self.bos_id = self.tok.bos_token_id

    def encode(self, text: str) -> list[int]:
        ids = self.tok(text, add_special_tokens=True).input_ids
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def encode_prompt(self, prompt: str | list[dict]) -> list[int]:
        """A task's prompt: text as ``encode``, chat messages through the tokenizer's chat template (ending
        with the assistant's opening, so the completion is the assistant's message)."""
        if isinstance(prompt, str):
            if not self.chat:
                return self.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        if not self.tok.chat_template:
            raise ValueError(f"the task's prompts are chat messages, but the tokenizer in {self.hf_dir} has no chat template")
        return list(self.tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))

    def encode_continuation(self, text: str) -> list[int]:
        """Tokens that continue a sequence (an environment's answer inside a response): no BOS."""
        return self.tok(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def request_seed(job_seed: int, uid: str, sample: int, version: int) -> int:
    """A stable per-sample sampling seed (same run, same samples)."""
    h = hashlib.blake2b(f"{job_seed}/{uid}/{sample}/{version}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def make_group_requests(
    problem: Problem, draw: int, task: Task, tok: PromptTokenizer, group_size: int, max_tokens: int, job_seed: int, version: int
) -> list[Request]:
    """G sample-level requests for one prompt; they travel (and are scored) together.

    ``draw`` is the prompt's position in the run's prompt stream: unique even when a problem is drawn twice."""
    ids = tok.encode_prompt(task.format_prompt(problem))
    group = f"{problem.uid}#{draw}"
    return [
        Request(
            request_id=f"{group}/{k}",
            prompt_ids=ids,
            max_tokens=max_tokens,
            seed=request_seed(job_seed, group, k, version),
            meta={"problem": problem, "group": group, "draw": draw},
        )
        for k in range(group_size)
    ]


def score(requests: list[Request], task: Task, tok: PromptTokenizer) -> list[Sample]:
    out = []
    for r in requests:
        problem: Problem = r.meta["problem"]
        out.append(
            Sample(
                uid=r.request_id,
                draw=r.meta["draw"],
                group_id=r.meta["group"],
                prompt_ids=r.prompt_ids,
                output_ids=r.output_ids,
                logprobs=r.logprobs,
                versions=r.versions,
                reward=r.reward if r.reward is not None else task.reward(problem, tok.decode(r.output_ids)),
                finish_reason=r.finish_reason,
                model_spans=r.model_spans if task.environment is not None else None,
                tool_calls=r.tool_calls,
                tool_s=r.tool_s,
            )
        )
    return out


def assign_advantages(samples: list[Sample], normalize_std: bool, eps: float) -> None:
    """GRPO advantages within each group (a group's samples are all present); also each group's mean reward."""
    if not samples:
        return
    groups = {g: i for i, g in enumerate(dict.fromkeys(s.group_id for s in samples))}
    rewards = torch.tensor([s.reward for s in samples])
    gids = torch.tensor([groups[s.group_id] for s in samples])
    adv = group_advantages(rewards, gids, normalize_std, eps)
    means = {g: rewards[gids == i].mean().item() for g, i in groups.items()}
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
        s.group_reward_mean = means[s.group_id]


def to_batch(samples: list[Sample], pad_id: int, weights: list[float] | None = None) -> TrainBatch:
    weights = weights if weights is not None else [1.0] * len(samples)
    return pack(
        [s.prompt_ids for s in samples],
        [s.output_ids for s in samples],
        [s.logprobs for s in samples],
        [s.versions for s in samples],
        [s.advantage for s in samples],
        weights,
        [s.reward for s in samples],
        pad_id,
        [s.model_spans if s.model_spans is not None else [[0, len(s.output_ids)]] for s in samples],
    )


def evaluate_share(parts, turns, num_prompts: int, index: int, count: int) -> tuple[float, int]:
    """Share ``index`` of ``count`` of the first ``num_prompts`` held-out prompts, one sample each on this rank's
    engine, run to completion through ``turns`` (a ``TurnDriver`` holding nothing else): (sum of rewards,
    samples)."""
    problems = parts.eval_problems[:num_prompts][index::count]
    requests = []
    for problem in problems:
        requests.extend(make_group_requests(
            problem, -1, parts.task, parts.tokenizer, 1, parts.cfg.rollout.max_new_tokens, parts.cfg.job.seed, -1,
        ))
    samples = score(turns.generate(requests), parts.task, parts.tokenizer) if requests else []
    return sum(s.reward for s in samples), len(samples)
