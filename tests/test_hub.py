"""Models and datasets by hub id, offline, from a Hugging Face cache the test builds from the tiny assets; a
missing id, and a corrupt or truncated checkpoint, are one line before any rank starts."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_entry(cache: str, kind: str, repo: str) -> str:
    """The hub cache's layout for ``repo`` at one commit (what ``huggingface-cli download`` leaves): returns the
    snapshot folder to fill."""
    folder = os.path.join(cache, f"{kind}s--{repo.replace('/', '--')}")
    os.makedirs(os.path.join(folder, "refs"))
    with open(os.path.join(folder, "refs", "main"), "w") as f:
        f.write(COMMIT)
    snapshot = os.path.join(folder, "snapshots", COMMIT)
    os.makedirs(snapshot)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cache = str(tmp_path / "hub")
    model = _cache_entry(cache, "model", "reflow-test/tiny-qwen3")
    source = os.path.join(ROOT, "assets", "tiny-qwen3")
    for name in os.listdir(source):
        shutil.copy(os.path.join(source, name), model)
    data = _cache_entry(cache, "dataset", "reflow-test/chain-sum")
    os.makedirs(os.path.join(data, "data"))
    for split, file in (("train", "chain_sum_train.jsonl"), ("test", "chain_sum_eval.jsonl")):
        rows = [json.loads(line) for line in open(os.path.join(ROOT, "assets", "data", file)) if line.strip()]
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(data, "data", f"{split}-00000-of-00001.parquet"))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.update(HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "datasets"), WORLD_SIZE="1")
    return env, model


def _python(env, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _check(env, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reflow.train", "--config", "train_configs/tiny.toml", "--check", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_model_and_a_dataset_by_hub_id_load_offline_from_the_cache(offline_cache):
    env, snapshot = offline_cache
    proc = _python(env, "from reflow.hub import resolve_model; from reflow.tasks import load_problems\n"
                        "print(resolve_model('reflow-test/tiny-qwen3', 'model.hf_checkpoint'))\n"
                        "print(len(load_problems('reflow-test/chain-sum:train')), "
                        "len(load_problems('assets/data/chain_sum_train.jsonl')))")
    assert proc.returncode == 0, proc.stderr[-2000:]
    folder, counts = proc.stdout.split("\n")[:2]
    assert os.path.samefile(folder, snapshot)
    from_hub, local = map(int, counts.split())
    assert from_hub == local > 0
    # the whole start-up check: config, placement, the checkpoint and both data files by name
    proc = _check(env, "--model.hf_checkpoint=reflow-test/tiny-qwen3", "--task.train_file=reflow-test/chain-sum:train",
                  "--task.eval_file=reflow-test/chain-sum:test", f"--job.dump_folder={os.path.dirname(snapshot)}/run")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


def test_an_id_missing_from_the_cache_is_one_line_that_says_how_to_fetch_it(offline_cache):
    env, _ = offline_cache
    for override, fetch in (("--model.hf_checkpoint=Qwen/Qwen3-0.6B", "huggingface-cli download Qwen/Qwen3-0.6B"),
                            ("--task.train_file=reflow-test/no-such-set:train",
                             "huggingface-cli download --repo-type dataset reflow-test/no-such-set")):
        proc = _check(env, override)
        assert proc.returncode == 2
        (line,) = proc.stderr.strip().splitlines()
        assert fetch in line and "HF_HUB_OFFLINE=1" in line, line
    proc = _check(env, "--task.train_file=reflow-test/chain-sum:validation")
    assert proc.returncode == 2 and "no data files for split 'validation'" in proc.stderr


@pytest.mark.parametrize("damage", ["junk header", "truncated"])
def test_a_corrupt_checkpoint_is_one_line_naming_the_file(tmp_path, damage):
    folder = tmp_path / "ckpt"
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-qwen3"), folder)
    weights = next(p for p in folder.iterdir() if p.suffix == ".safetensors")
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + b"\x07junk{" * 20 + data[8 + 120:] if damage == "junk header" else data[: len(data) - 1000])
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = _check(env, f"--model.hf_checkpoint={folder}")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert str(weights) in line and "not a readable safetensors file" in line, line


def test_what_counts_as_a_hub_id():
    from reflow.hub import is_dataset_spec, is_hub_id

    assert is_hub_id("Qwen/Qwen3-8B") and is_dataset_spec("openai/gsm8k:train")
    assert not is_hub_id("assets/tiny-qwen3")  # a local folder
    assert not is_hub_id("assets/no-such-folder")  # a mistyped local path: its first part is a local folder
    assert not is_hub_id("/checkpoints/Qwen3-8B") and not is_hub_id("Qwen3-8B") and not is_hub_id("a/b/c")
    assert not is_dataset_spec("assets/data/chain_sum_train.jsonl") and not is_dataset_spec("openai/gsm8k")
