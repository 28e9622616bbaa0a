"""Exact resume: a run stopped and resumed from its checkpoint trains on the same samples and ends with the same
parameters, bitwise on CPU, as the run that never stopped (sampling is a function of each request's seed and
prefix, not of the engine's history: ``reflow.rollout.engine``)."""

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_torchrun


def _args(dump: str, steps: int, *extra: str) -> list[str]:
    return [
        "-m", "reflow.train", "--config", "train_configs/tiny.toml", f"--job.dump_folder={dump}",
        "--training.prompts_per_step=4", "--training.group_size=4", "--rollout.max_new_tokens=24",
        "--metrics.enable_progress_bar=false", f"--training.steps={steps}", *extra,
    ]


def _train(dump: str, steps: int, *extra: str) -> None:
    run_torchrun(2, _args(dump, steps, *extra))


def _rows(dump: str) -> dict[int, dict]:
    return {r["step"]: r for r in (json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))) if "loss" in r}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sync_six_steps_straight_equal_three_resume_three(tmp_path, lora):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    # a learning-rate warmup that straddles the checkpoint: the resumed run continues it from the saved update count
    # (with LoRA: the adapters and their optimizer state come back; the export is the merged policy)
    extra = ("--training.warmup_steps=4", *(("--lora.rank=8",) if lora else ()))
    _train(straight, 6, *extra)
    _train(resumed, 3, *extra, "--checkpoint.enable=true", "--checkpoint.interval=3", "--checkpoint.export_hf=false")
    _train(resumed, 6, *extra, "--checkpoint.enable=true", "--checkpoint.interval=3")
    a, b = _rows(straight), _rows(resumed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):  # the same sample stream: rewards and lengths step by step
        assert ((a[step]["reward_mean"], a[step]["response_len_mean"])
                == (b[step]["reward_mean"], b[step]["response_len_mean"])), step
        assert a[step]["lr"] == b[step]["lr"] == 3e-4 * min(step / 4, 1.0), step
    final_a = load_file(os.path.join(straight, "hf_final", "model.safetensors"))
    final_b = load_file(os.path.join(resumed, "hf_final", "model.safetensors"))
    assert final_a.keys() == final_b.keys()
    different = [name for name in final_a if not torch.equal(final_a[name], final_b[name])]
    assert not different, different[:5]


def _ledgers(dump: str) -> dict[int, dict]:
    return {led["rank"]: led for led in (json.load(open(p)) for p in glob.glob(os.path.join(dump, "ledger", "rank*.json")))}


def test_reflow_resume_restores_the_buffer_and_trains_no_sample_twice(tmp_path):
    dump = str(tmp_path / "reflow")
    common = [
        "--training.mode=reflow", "--placement.num_rollout_ranks=1", "--replay.sigma=0.5", "--replay.delta=2",
        "--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.keep_last=0", "--checkpoint.export_hf=false",
    ]
    _train(dump, 4, *common)
    first = _ledgers(dump)
    saved = torch.load(os.path.join(dump, "checkpoint", "step-4", "replay-shard0.pt"), weights_only=False)
    stream = torch.load(os.path.join(dump, "checkpoint", "step-4", "prompt-stream.pt"), weights_only=False)
    _train(dump, 8, *common)
    second = _ledgers(dump)
    # the buffer after the restore is the buffer that was saved: every sample, its use count, versions, advantage
    restored = second[0]["restored"]
    assert restored == [
        {"uid": x.uid, "use_count": x.use_count, "versions": x.versions, "advantage": x.advantage}
        for x in saved["unused"] + saved["replayable"]
    ]
    assert restored, "the test needs a non-empty buffer at the checkpoint"
    # no sample trained fresh twice across the restart
    consumed = [c["uid"] for run in (first, second) for c in run[0]["consumed"]]
    assert len(consumed) == len(set(consumed))
    # what the first run delivered before the checkpoint is not generated again: the second run's rollout rank
    # starts only holes and draws past the frontier
    draw = lambda uid: int(uid.split("#")[1].split("/")[0])  # noqa: E731
    started_again = {draw(uid) for uid in second[1]["started"]}
    assert all(d >= stream["frontier"] or d in stream["holes"] for d in started_again)
    assert set(stream["holes"]) <= started_again  # every hole is generated again
    # and the prompt stream lost nothing: every draw below the frontier was delivered in the first run or is a hole
    delivered_first = {draw(uid) for uid in first[0]["received"]}
    assert set(range(stream["frontier"])) <= delivered_first | set(stream["holes"])


def test_reflow_resumes_onto_another_world_size(tmp_path):
    """Saved on 4 ranks (2 trainer replicas, 2 rollout ranks), resumed on 2: the saved placement does not fit
    (the run says so and stays on T1x1+R1), DCP reshards the trainer onto one shard, and both saved shards'
    samples are restored into it; nothing is trained fresh twice."""
    dump = str(tmp_path / "reflow")
    common = [
        "--training.mode=reflow", "--replay.sigma=0.5", "--replay.delta=2", "--placement.trainer_shard_degree=1",
        "--checkpoint.enable=true", "--checkpoint.interval=3", "--checkpoint.export_hf=false",
    ]
    run_torchrun(4, _args(dump, 3, *common, "--placement.num_rollout_ranks=2", "--placement.trainer_replicate_degree=2"))
    folder = os.path.join(dump, "checkpoint", "step-3")
    saved = [torch.load(os.path.join(folder, f"replay-shard{k}.pt"), weights_only=False) for k in (0, 1)]
    first = [c["uid"] for led in _ledgers(dump).values() for c in led["consumed"]]
    resumed = run_torchrun(2, _args(dump, 6, *common, "--placement.num_rollout_ranks=1"))
    assert "saved with 2 trainer replicas, not feasible on this world; continuing on T1x1+R1" in resumed.stderr
    rows = _rows(dump)
    assert [rows[s]["placement"] for s in (4, 5, 6)] == ["T1x1+R1"] * 3
    restored = _ledgers(dump)[0]["restored"]
    assert sorted(r["uid"] for r in restored) == sorted(x.uid for state in saved for x in state["unused"] + state["replayable"])
    assert restored
    consumed = first + [c["uid"] for led in _ledgers(dump).values() for c in led["consumed"]]
    assert len(consumed) == len(set(consumed))
