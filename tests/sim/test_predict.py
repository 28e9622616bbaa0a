"""``python -m reflow.sim predict``: a config that has not run, predicted from its own settings."""

import json

import pytest

from reflow.config import ConfigManager
from reflow.sim.predict import PREDICTED, predict, sim_config, workload_of, world_of
from reflow.sim.profiles import TINY_CPU


def _config(*args):
    return ConfigManager().parse_args(list(args))


def test_every_setting_the_simulator_models_comes_from_the_config():
    cfg = _config(
        "--config", "train_configs/bench_rollout_bound.toml", "--training.prompts_per_step=6", "--training.group_size=4",
        "--replay.sigma=0.25", "--replay.tau=0.75", "--replay.delta=3", "--replay.strict_window=true",
        "--weight_sync.interval=1", "--rollout.b_max=12", "--scheduler.adaptive_concurrency=true",
        "--scheduler.kv_admission=true", "--scheduler.rho=0.8", "--scheduler.adaptive_placement=true",
        "--scheduler.cooldown_steps=3", "--scheduler.margin=0.2", "--scheduler.horizon_steps=11",
        "--reward.dynamic_sampling=true", "--job.seed=7", "--placement.trainer_shard_degree=1",
        "--placement.trainer_replicate_degree=2", "--placement.num_rollout_ranks=2",
    )
    assert world_of(cfg) == 4
    sim = sim_config(cfg, 4, steps=9, warmup_steps=2)
    assert (sim.mode, sim.gpus, sim.replicas, sim.shard_degree, sim.batch) == ("reflow", 4, 2, 1, 24)
    assert (sim.sigma, sim.tau, sim.delta, sim.strict_window, sim.interval, sim.b_max) == (0.25, 0.75, 3, True, 1, 12)
    assert (sim.adaptive_concurrency, sim.kv_admission, sim.rho, sim.adaptive_placement) == (True, True, 0.8, True)
    assert (sim.cooldown_steps, sim.margin, sim.horizon_steps, sim.dynamic_sampling, sim.seed) == (3, 0.2, 11, True, 7)
    # sync is colocated and on-policy whatever the file says; the scheduler's rollout parts are not its own
    on_policy = sim_config(cfg, 4, steps=9, warmup_steps=2, mode="sync")
    assert (on_policy.replicas, on_policy.interval, on_policy.kv_admission, on_policy.adaptive_placement) == (4, 1, False, False)


def test_the_engines_kv_cache_comes_from_the_config_and_bounds_the_prediction():
    """The rollout-bound bench's 7 blocks of 32 tokens, against the same config with the profile's cache: the
    bounded engines run fewer sequences at once and preempt, so fewer tokens/s and a trainer that waits longer
    (the simulation is deterministic: fixed seeds, no clock)."""
    bound = _config("--config", "train_configs/bench_rollout_bound.toml", "--training.mode=async")
    free = _config("--config", "train_configs/bench_rollout_bound.toml", "--training.mode=async", "--rollout.num_kv_blocks=0")
    workload = workload_of(bound, ".")
    tight = predict(bound, 2, TINY_CPU, workload, steps=16, warmup_steps=3)
    roomy = predict(free, 2, TINY_CPU, workload, steps=16, warmup_steps=3)
    assert tight["simulation"]["preemptions"] > 0 == roomy["simulation"]["preemptions"]
    assert tight["predicted"]["tokens_per_s"] < roomy["predicted"]["tokens_per_s"]
    assert tight["predicted"]["trainer_wait_ratio"] > roomy["predicted"]["trainer_wait_ratio"]
    assert set(tight["predicted"]) == set(PREDICTED)


def test_reflow_replays_and_counts_replayed_tokens_at_tau():
    cfg = _config("--config", "train_configs/bench_rollout_bound.toml")
    run = predict(cfg, 2, TINY_CPU, workload_of(cfg, "."), steps=24, warmup_steps=3)["predicted"]
    assert 0 < run["replay_fraction"] <= cfg.replay.sigma
    assert run["loss_tokens_per_s"] < run["tokens_per_s"]  # prompts and tau-weighted replays carry less


def test_a_task_whose_rows_the_simulator_cannot_read_names_the_file(tmp_path):
    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "answer": "1"}) + "\n")
    cfg = _config("--config", "train_configs/bench_modes.toml", f"--task.train_file={rows}")
    with pytest.raises(ValueError, match=r"task.train_file = .*chat.jsonl.*--workload"):
        workload_of(cfg, ".")
    assert workload_of(cfg, ".", named="reasoning-drift").name == "reasoning-drift"


def test_the_command_predicts_every_mode_with_overrides_and_refuses_what_it_cannot_read(tmp_path, capsys):
    from reflow.sim.__main__ import main

    out = tmp_path / "predict.json"
    args = ["predict", "--config", "train_configs/bench_rollout_bound.toml", "--world", "2", "--mode", "all",
            "--steps", "12", "--warmup-steps", "2", "--seeds", "2", "--out", str(out), "--replay.delta=3"]
    assert main(args) == 0
    written = json.loads(out.read_text())
    assert written["seeds"] == 2 and all(run["simulation"]["seeds"] == 2 for run in written["modes"].values())
    assert main([*args[:-5], "--seeds", "0", "--out", str(out)]) == 2
    assert "--seeds must be at least 1" in capsys.readouterr().err
    assert written["overrides"] == ["--replay.delta=3"] and set(written["modes"]) == {"sync", "one_step_off", "async", "reflow"}
    assert all(set(run["predicted"]) == set(PREDICTED) for run in written["modes"].values())
    # the placement leaves the world to torchrun: the command asks for it, naming the key
    assert main(["predict", "--config", "train_configs/bench_rollout_bound.toml", "--out", str(out)]) == 2
    assert "placement.trainer_shard_degree" in capsys.readouterr().err
    assert main(["predict", "--config", "train_configs/bench_rollout_bound.toml", "--world", "2", "--replay.sigma=2"]) == 2
    assert "replay.sigma" in capsys.readouterr().err
    assert main(["validate", "--fit-on", "nonsense"]) == 2


def test_validate_reads_every_seed_the_bench_kept_and_each_groups_prompt(tmp_path):
    """``validate`` fits and compares over every seed's run the modes benchmark kept (seed 0 beside its JSON,
    seed N under seedN/), and pairs each logged group with its prompt (a group's id is the prompt's id, "#", the
    draw's repeat), whose length the simulated engines then hold."""
    from reflow.sim.__main__ import _group_lengths, _seed_runs

    for folder in ("async", "seed2/async", "seed1/reflow"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "metrics.jsonl").write_text("")
    summary = {"per_seed": [{"seed": 0}, {"seed": 1}, {"seed": 2}]}
    assert _seed_runs(str(tmp_path), "async", summary) == {
        0: str(tmp_path / "async" / "metrics.jsonl"), 2: str(tmp_path / "seed2" / "async" / "metrics.jsonl"),
    }  # (seed 1's async run is not there: left out)
    assert _seed_runs(str(tmp_path), "reflow", {}) == {}  # no seeds summarized: seed 0's run, which is missing
    sent = [
        {"uid": "long-4-681#0/0", "response_len": 28, "finish_version": 0},
        {"uid": "long-4-7#1/0", "response_len": 5, "finish_version": 3},
        {"uid": "long-4-681#0/1", "response_len": 29, "finish_version": 0},
    ]
    assert _group_lengths(sent) == [("long-4-681", (28, 29)), ("long-4-7", (5,))]
    assert _group_lengths(sent, max_version=2) == [("long-4-681", (28, 29))]


def test_validate_takes_the_modes_the_benchmark_ran(tmp_path, capsys):
    """A benchmark of some modes (``--modes async,one_step_off``: runs side by side, as a cross-mode check needs)
    validates those; fitting on a mode it did not run is one error that names the modes it has."""
    from reflow.sim.__main__ import main

    real = tmp_path / "bench.json"
    real.write_text(json.dumps({
        "config": "train_configs/bench_rollout_bound.toml", "overrides": [], "world_size": 2, "warmup_steps": 2,
        "modes": {"async": {"per_seed": [{"seed": 0}]}, "one_step_off": {"per_seed": [{"seed": 0}]}},
    }))
    assert main(["validate", "--real", str(real), "--fit-on", "reflow"]) == 2
    assert "has no reflow runs (it has one_step_off, async)" in capsys.readouterr().err
    # the two modes it ran are the ones looked for (their runs, here missing, named as such)
    assert main(["validate", "--real", str(real), "--fit-on", "async"]) == 2
    err = capsys.readouterr().err
    assert "validate: no run of one_step_off, async beside" in err


def test_a_prediction_is_the_mean_of_simulations_with_their_own_random_streams():
    """``simulate_seeds`` averages every number of the summary over seeds cfg.seed, cfg.seed + 1, ... and
    reports their spread: one simulation of the rollout-bound bench is a single draw of its long-tailed groups,
    which moves its fresh samples/s by several percent."""
    import dataclasses

    from reflow.sim.profiles import with_engine_settings
    from reflow.sim.system import simulate, simulate_seeds

    cfg = _config("--config", "train_configs/bench_rollout_bound.toml", "--training.mode=async")
    sim, workload = sim_config(cfg, 2, steps=10, warmup_steps=2), workload_of(cfg, ".")
    profile = with_engine_settings(TINY_CPU, cfg.rollout)
    single = [simulate(dataclasses.replace(sim, seed=sim.seed + k), profile, workload) for k in range(3)]
    mean = simulate_seeds(sim, profile, workload, seeds=3)
    assert mean["seeds"] == 3
    for key in ("tokens_per_s", "fresh_samples_per_s", "trainer_idle_ratio", "preemptions"):
        values = [run[key] for run in single]
        assert mean[key] == pytest.approx(sum(values) / 3, rel=1e-12)
        spread = (sum((v - mean[key]) ** 2 for v in values) / 2) ** 0.5
        assert mean["seed_sd"][key] == pytest.approx(spread, rel=1e-9, abs=1e-12)
    assert len({run["fresh_samples_per_s"] for run in single}) == 3  # the streams differ
    assert simulate_seeds(sim, profile, workload, seeds=1)["fresh_samples_per_s"] == single[0]["fresh_samples_per_s"]
    with pytest.raises(ValueError, match="seeds must be at least 1"):
        simulate_seeds(sim, profile, workload, seeds=0)
