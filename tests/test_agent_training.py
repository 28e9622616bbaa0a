"""An agent task trains under torchrun (``train_configs/tiny_agent.toml``: the example calculator agent through
each rank's endpoint): in reflow mode with a checkpoint taken while episodes are in flight and a resume that
loses and repeats nothing, and in sync and one_step_off mode (the agent driver serves every mode's rollout loop)."""

import glob
import json
import os

import pytest
import torch

from tests.conftest import run_torchrun


def _args(dump: str, steps: int, *extra: str) -> list[str]:
    return [
        "-m", "reflow.train", "--config", "train_configs/tiny_agent.toml", f"--job.dump_folder={dump}",
        "--training.prompts_per_step=4", "--training.group_size=4", "--metrics.enable_progress_bar=false",
        "--metrics.eval_interval=0", f"--training.steps={steps}", *extra,
    ]


def _rows(dump: str) -> list[dict]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def _ledgers(dump: str) -> dict[int, dict]:
    return {led["rank"]: led for led in (json.load(open(p)) for p in glob.glob(os.path.join(dump, "ledger", "rank*.json")))}


def _check_agent_rows(rows: list[dict]) -> None:
    for r in rows:
        # the example agent continues what it was returned, and neither fails nor overruns its budgets (its
        # calls extend the sampled tokens exactly except after a special token in a turn: a counted mismatch)
        assert r["agent_failed_frac"] == 0 and "token_mismatches_mean" in r, r
        assert 0.0 <= r["reward_mean"] <= 1.0
    # its calculator answers are context: in the responses, never trained
    assert sum(r["tool_calls_mean"] for r in rows) > 0 and max(r["env_token_frac"] for r in rows) > 0


def test_reflow_agent_run_resumes_with_episodes_in_flight(tmp_path):
    dump = str(tmp_path / "agent")
    common = ["--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.keep_last=0",
              "--checkpoint.export_hf=false", "--replay.delta=2"]
    run_torchrun(2, _args(dump, 2, *common))
    first = _ledgers(dump)
    stream = torch.load(os.path.join(dump, "checkpoint", "step-2", "prompt-stream.pt"), weights_only=False)
    run_torchrun(2, _args(dump, 4, *common))
    second = _ledgers(dump)
    rows = _rows(dump)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    _check_agent_rows(rows)
    assert all(r["staleness_max"] <= 2 for r in rows)
    # no sample trained fresh twice across the restart
    consumed = [c["uid"] for run in (first, second) for c in run[0]["consumed"]]
    assert len(consumed) == len(set(consumed))
    # episodes in flight at the checkpoint (started, not delivered) are started again; what was delivered is not
    draw = lambda uid: int(uid.split("#")[1].split("/")[0])  # noqa: E731
    delivered_first = {draw(uid) for uid in first[0]["received"]}
    in_flight = {draw(uid) for uid in first[1]["started"]} - delivered_first
    started_again = {draw(uid) for uid in second[1]["started"]}
    print(f"in flight at the checkpoint: {sorted(in_flight)}; frontier {stream['frontier']}, holes {stream['holes']}")
    assert in_flight, "the test needs episodes in flight at the checkpoint"
    assert in_flight <= started_again
    assert all(d >= stream["frontier"] or d in stream["holes"] for d in started_again)
    assert set(range(stream["frontier"])) <= delivered_first | set(stream["holes"])


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_agent_run_in_the_other_modes(tmp_path, mode):
    """sync generates each batch whole; one_step_off waits, before each sync, for every admitted episode's
    first token (its agent's first call), so that none is born under the next version and left ineligible."""
    dump = str(tmp_path / mode)
    placement = (["--placement.num_rollout_ranks=0", "--placement.trainer_replicate_degree=2"] if mode == "sync"
                 else [])
    run_torchrun(2, _args(dump, 3, f"--training.mode={mode}", *placement, "--checkpoint.export_hf=false"))
    rows = _rows(dump)
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_agent_rows(rows)
    assert all(r["staleness_max"] == (0 if mode == "sync" else min(r["step"] - 1, 1)) for r in rows), rows
