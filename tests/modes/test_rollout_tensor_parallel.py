"""Rollout tensor parallelism: one vLLM engine over 2 of 4 ranks (external_launcher), in reflow mode, on the
multi-turn calculator task: the block's first rank runs the rollout worker (tool calls included), the other
replays its engine calls; weight syncs reach both halves of the engine."""

import json
import os

from tests.conftest import run_torchrun


def _rows(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "reward_mean" in row]


def test_tensor_parallel_engine_in_reflow_mode(tmp_path):
    dump = str(tmp_path / "run")
    proc = run_torchrun(4, [
        "-m", "reflow.train", "--config", "train_configs/tiny_retool.toml", f"--job.dump_folder={dump}",
        "--placement.trainer_replicate_degree=2", "--placement.num_rollout_ranks=2", "--rollout.tensor_parallel_degree=2",
        "--training.steps=4", "--training.prompts_per_step=4", "--training.group_size=4",
        # a learning rate too small to move the policy in 4 steps: every sample, stale or not, must then have
        # the trainer's log-probs, which only holds if each sync loaded the weights into both halves correctly
        "--training.lr=1e-8", "--metrics.eval_interval=2", "--metrics.eval_num_prompts=8",
    ])
    assert "1 engines of tensor-parallel degree 2" in proc.stderr + proc.stdout
    rows = _rows(dump)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["placement"] == "T2x1+R1x2" for r in rows)
    assert all(r["behavior_logprob_gap_max"] < 1e-3 for r in rows), [r["behavior_logprob_gap_max"] for r in rows]
    assert sum(r["tool_calls_mean"] for r in rows) > 0  # the calculator answered, and its tokens were not scored
    assert any("eval_reward" in r for r in rows)
    ledgers = {rank: json.load(open(os.path.join(dump, "ledger", f"rank{rank}.json"))) for rank in range(4)}
    # rank 2 leads the engine and admits everything; rank 3 replays its calls and admits nothing
    assert ledgers[2]["started"] and not ledgers[3]["started"]
    received = ledgers[0]["received"] + ledgers[1]["received"]
    assert {s["uid"] for s in ledgers[2]["sent"]} <= set(ledgers[2]["started"])
    assert len(received) == len(set(received)) and set(received) <= set(ledgers[2]["started"])


def _random_adapter(folder: str) -> str:
    """A peft folder for tiny_lora.toml's adapters (rank 16, every projection of tiny_tools) with B != 0: the
    policy differs from the base from step 0."""
    import torch
    from safetensors.torch import save_file

    from reflow.config.job_config import LoraSection
    from reflow.model.qwen3 import build_model_config
    from reflow.model.recipe import load_recipe, resolve_path
    from reflow.trainer.hf_io import build_adapter
    from reflow.trainer.lora import PEFT_CONFIG, PEFT_WEIGHTS, build_adapter_plan

    recipe = load_recipe("tiny_tools")
    model_cfg = build_model_config(recipe, "sdpa")
    lora = LoraSection(rank=16, alpha=32.0)
    plan = build_adapter_plan(model_cfg, build_adapter(model_cfg, None), lora, resolve_path(recipe.hf_checkpoint))
    g = torch.Generator().manual_seed(0)
    os.makedirs(folder, exist_ok=True)
    save_file({name: torch.randn(shape, generator=g) * 0.05 for _, name, shape in plan.tensors},
              os.path.join(folder, PEFT_WEIGHTS))
    with open(os.path.join(folder, PEFT_CONFIG), "w") as f:
        json.dump(plan.config, f)
    return folder


def test_tensor_parallel_engine_serves_lora_adapter_versions(tmp_path):
    """LoRA with a tensor-parallel engine: each adapter version reaches both halves of the engine (the follower
    receives the sync as a rollout rank and replays the leader's requests with their pins). The run starts
    from adapters with B != 0, at a learning rate too small to move them: every sample's behaviour log-probs
    must then be the trainer's, which only holds if both halves applied the same adapter as the trainer."""
    dump = str(tmp_path / "run")
    adapter = _random_adapter(str(tmp_path / "adapter"))
    run_torchrun(4, [
        "-m", "reflow.train", "--config", "train_configs/tiny_lora.toml", f"--job.dump_folder={dump}",
        f"--lora.adapter={adapter}", "--placement.trainer_replicate_degree=2", "--placement.num_rollout_ranks=2",
        "--rollout.tensor_parallel_degree=2", "--training.steps=4", "--training.prompts_per_step=4",
        "--training.group_size=4", "--training.lr=1e-8", "--metrics.eval_interval=0",
    ])
    rows = _rows(dump)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["behavior_logprob_gap_max"] < 1e-3 for r in rows), [r["behavior_logprob_gap_max"] for r in rows]
    assert sum(r["rollout_held_at_sync"] for r in rows) == 0
