"""The memory plan: every term of one recipe against figures computed by hand, the shipped GPU recipes fitting
8 x 80 GB nodes, and a run that does not fit refused before any rank starts, naming the term and the knob."""

import os
import subprocess
import sys

import pytest

from reflow.config import ConfigManager
from reflow.config.validate import validate_world
from reflow.memory_plan import GIB, USABLE_FRACTION, memory_plan
from reflow.model.recipe import load_recipe
from tests.conftest import ROOT


def _plan(config: str, *overrides: str, world: int):
    cfg = ConfigManager().parse_args(["--config", os.path.join(ROOT, config), *overrides])
    return cfg, memory_plan(cfg, load_recipe(cfg.model.recipe), validate_world(cfg, world))


def test_the_qwen3_8b_plan_term_by_term():
    """train_configs/qwen3_8b.toml: sync mode on 8 colocated ranks, FSDP2 over 8, bf16 gathers, full activation
    checkpointing, micro-batches of 4 rows of 10240 tokens, 1024-token log-prob chunks, 0.6 of an 80 GiB GPU."""
    _, plan = _plan("train_configs/qwen3_8b.toml", world=8)
    (role,) = plan.roles
    assert role.role == "colocated" and role.ranks == 8
    generate, train, sync = role.phases
    # N = 8,190,735,360 parameters; N / 8 = 1,023,841,920 per shard
    # root unit: 151936 x 4096 x 2 (embeddings and head, untied) + 4096 (final norm) = 1,244,663,808
    # a block: (N - root) / 36 = 192,946,432
    # a token's saved tensors in a block: 2 bytes x (3 x 4096 + 3 x 4096 + 3 x 1024 + 4 x 12288) = 153,600
    # activations: 40960 tokens x (36 x 2 x 4096 + 153,600) = 18,371,051,520
    # log-prob workspace: 40960 x 4096 x 2 + 1024 x 151936 x (2 + 20) = 335,544,320 + 3,422,814,208
    assert {term.name: term.bytes for term in train.terms} == {
        "parameter shards": 4_095_367_680,
        "gradient shards": 4_095_367_680,
        "AdamW moments": 8_190_735_360,
        "gathered parameters": 6_522_226_688,  # 2 x 2 x (1,244,663,808 + 2 x 192,946,432)
        "activations": 18_371_051_520,
        "log-prob workspace": 3_758_358_528,
        "engine asleep": GIB,
        "CUDA context, NCCL": int(1.5 * GIB),  # 0.75 GiB of context + 3 communicators x 0.25 (world, shard, replica)
    }
    # the engine: 0.6 x 80 GiB = 51,539,607,552; bf16 weights 2 N = 16,381,470,720; 2 GiB reserve; the KV cache the
    # rest, 33,010,653,184 bytes at 4 x 36 x 8 x 128 = 147,456 bytes a token: 223,867 tokens
    assert {term.name: term.bytes for term in generate.terms} == {
        "engine weights": 16_381_470_720, "engine non-KV reserve": 2 * GIB, "KV cache": 33_010_653_184,
        "CUDA context, NCCL": int(1.5 * GIB),
    }
    assert role.kv_tokens == 223_867
    # the engine's whole budget and the context: the trainer waits in host memory (at an evaluation too)
    assert generate.bytes == 51_539_607_552 + int(1.5 * GIB)
    # the sync: the parameter shards back, the engine's weights mapped to receive them, and two buckets in flight,
    # a bucket being 64 MiB of values or the largest tensor, the embeddings' 151936 x 4096 x 2 bytes
    assert {term.name: term.bytes for term in sync.terms} == {
        "parameter shards": 4_095_367_680, "engine weights": 16_381_470_720, "engine asleep": GIB,
        "weight-sync buckets": 2 * 1_244_659_712, "CUDA context, NCCL": int(1.5 * GIB),
    }
    # pinned host: parameter shards and AdamW moments parked while generating; the engine, with a sync after every
    # step, sleeps at level 2 (its weights dropped, not pinned)
    assert role.pinned_host_bytes == 4_095_367_680 + 8_190_735_360
    _, every_other = _plan("train_configs/qwen3_8b.toml", "--weight_sync.interval=2", world=8)
    assert every_other.roles[0].pinned_host_bytes == 4_095_367_680 + 8_190_735_360 + 16_381_470_720
    assert plan.fits and role.peak is generate


def test_chunked_log_probs_and_checkpointing_shrink_their_terms():
    def term(plan, name):
        return next(t.bytes for t in plan.roles[0].phases[1].terms if t.name == name)

    _, chunked = _plan("train_configs/qwen3_8b.toml", world=8)
    _, whole = _plan("train_configs/qwen3_8b.toml", "--training.logprob_chunk_tokens=0", world=8)
    _, no_ac = _plan("train_configs/qwen3_8b.toml", "--training.activation_checkpointing=none", world=8)
    # the whole micro-batch's logits: 40960 x 151936 x 22 bytes, 128 GiB, against one chunk's 3.2 GiB
    assert term(whole, "log-prob workspace") - term(chunked, "log-prob workspace") == (40960 - 1024) * 151936 * 22
    assert not whole.fits and "log-prob workspace" in whole.problems[0] and "training.logprob_chunk_tokens" in whole.problems[0]
    assert term(no_ac, "activations") == 40960 * 36 * 153_600
    # a token budget bounds a pass's padded tokens: 16384 of them rather than 4 rows x 10240
    _, budget = _plan("train_configs/qwen3_8b.toml", "--training.micro_batch_tokens=16384", world=8)
    assert term(budget, "activations") * 40960 == term(chunked, "activations") * 16384
    assert term(budget, "log-prob workspace") == 16384 * 4096 * 2 + 1024 * 151936 * 22
    _, roomy = _plan("train_configs/qwen3_8b.toml", "--training.micro_batch_tokens=100000", world=8)
    assert term(roomy, "activations") == term(chunked, "activations")  # never above micro_batch_size rows
    assert not no_ac.fits and "training.activation_checkpointing" in no_ac.problems[0]


@pytest.mark.parametrize("config, world", [
    ("qwen3_4b", 8), ("qwen3_8b", 8), ("qwen3_14b", 16), ("qwen3_32b", 32),
    ("paper_math_qwen3_8b", 32), ("paper_retool_qwen3_14b", 32), ("paper_coding_qwen3_32b", 64),
])
def test_the_shipped_gpu_recipes_fit_80_gb_gpus(config, world):
    _, plan = _plan(f"train_configs/{config}.toml", world=world)
    assert plan.device_bytes == 80 * GIB and plan.fits, plan.problems
    assert all(role.peak.bytes <= USABLE_FRACTION * 80 * GIB for role in plan.roles)
    assert plan.pinned_host_bytes_per_node() <= 512 * GIB  # within an 8-GPU node's host memory


def _train(*args: str, world: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_WORLD_SIZE")}
    env["WORLD_SIZE"] = str(world)
    return subprocess.run([sys.executable, "-m", "reflow.train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_check_refuses_a_run_that_does_not_fit_and_names_the_term_and_the_knob():
    # Qwen3-32B's trainer sharded over 8 GPUs: 61 GiB of fp32 state per GPU before any activation
    proc = _train("--config", "train_configs/qwen3_32b.toml", "--check", "--placement.trainer_shard_degree=8",
                  "--placement.trainer_replicate_degree=2", world=32)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "AdamW moments" in line and "placement.trainer_shard_degree" in line and "qwen3_32b" in line, line
    # a bigger device makes it fit (placement.gpu_memory_gib overrides the recipe's 80)
    _, plan = _plan("train_configs/qwen3_32b.toml", "--placement.trainer_shard_degree=8",
                    "--placement.trainer_replicate_degree=2", "--placement.gpu_memory_gib=141", world=32)
    assert plan.fits


def test_a_gpu_recipe_without_cuda_stops_before_ranks_start_with_one_line():
    import torch

    from reflow.train import visible_gpus

    if torch.cuda.is_available() or visible_gpus():
        pytest.skip("this machine has a GPU")
    proc = _train("--config", "train_configs/qwen3_8b.toml", world=8)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "device = 'cuda'" in line and "shows no GPU" in line and "models/qwen3_8b.toml" in line, line
