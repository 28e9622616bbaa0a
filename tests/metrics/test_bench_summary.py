"""The modes benchmark's ledger summary: what counts as evicted, what as filtered, and survival by length."""

import json
import os

import pytest

from reflow.bench.modes import aggregate, ledger_summary


def _write_ledger(folder, rank, sent, consumed, evicted, causes):
    os.makedirs(os.path.join(folder, "ledger"), exist_ok=True)
    ledger = {
        "rank": rank, "trainer": True, "sent": [{"uid": uid, "response_len": n} for uid, n in sent],
        "consumed": [{"uid": uid} for uid in consumed], "evicted_unused": evicted, "eviction_causes": causes,
    }
    with open(os.path.join(folder, "ledger", f"rank{rank}.json"), "w") as f:
        json.dump(ledger, f)


def test_filtered_samples_are_not_staleness_waste(tmp_path):
    # ten samples over two shards: lengths 1..10; 5 trained, 3 evicted stale (the long ones), 2 filtered
    sent = [(f"u{n}", n) for n in range(1, 11)]
    _write_ledger(tmp_path, 0, sent[:5], ["u1", "u2", "u3"], ["u4", "u5"], {"u4": "no_signal", "u5": "no_signal"})
    _write_ledger(tmp_path, 1, sent[5:], ["u6", "u7"], ["u8", "u9", "u10"],
                  {"u8": "aged", "u9": "arrived_stale", "u10": "at_sync"})
    summary = ledger_summary(str(tmp_path))
    assert summary["evicted_fraction"] == 3 / 8  # u8..u10 of the eight decided; u4 and u5 are neither
    assert summary["filtered_fraction"] == 2 / 10
    # eight decided samples in ten bins: bins of 0 or 1; the trained ones are the five shortest decided
    survival = [s for s, upper in zip(summary["survival_by_length_decile"], summary["decile_upper_lengths"]) if upper]
    assert survival == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert summary["received_response_len_mean"] == (1 + 2 + 3 + 6 + 7 + 8 + 9 + 10) / 8
    assert summary["trained_response_len_mean"] == (1 + 2 + 3 + 6 + 7) / 5


def test_a_ledger_without_filtering_counts_every_eviction(tmp_path):
    _write_ledger(tmp_path, 0, [("a", 4), ("b", 8)], ["a"], ["b"], {"b": "aged"})
    summary = ledger_summary(str(tmp_path))
    assert summary["evicted_fraction"] == 0.5 and summary["filtered_fraction"] == 0.0


def test_aggregate_reports_mean_and_spread_over_seeds():
    per_seed = [
        {"tokens_per_s": 10.0, "filtered_fraction": 0.1, "staleness_distribution": {"0": 1.0}},
        {"tokens_per_s": 14.0, "filtered_fraction": 0.3, "staleness_distribution": {"0": 0.5, "1": 0.5}},
    ]
    out = aggregate(per_seed)
    assert out["staleness_distribution"] == {"0": 0.75, "1": 0.25}
    assert out["tokens_per_s"] == 12.0 and out["tokens_per_s_spread"]["std"] == 2.0
    assert abs(out["filtered_fraction"] - 0.2) < 1e-12
    assert out["filtered_fraction_spread"]["values"] == [0.1, 0.3]


def test_paired_difference_gives_the_one_sided_t_bound():
    from reflow.bench.paired import paired_difference, t_quantile_95

    pair = paired_difference([0.50, 0.52, 0.47, 0.49, 0.51], [0.48, 0.50, 0.49, 0.47, 0.49])
    assert [round(d, 12) for d in pair["differences"]] == [0.02, 0.02, -0.02, 0.02, 0.02]
    assert abs(pair["mean"] - 0.012) < 1e-12
    std = (4 * 0.008**2 + 0.032**2) ** 0.5 / 2  # sample sd, n - 1 = 4
    assert abs(pair["std"] - std) < 1e-12
    assert abs(pair["lower_95"] - (0.012 - 2.132 * std / 5**0.5)) < 1e-12
    assert paired_difference([0.3], [0.1])["lower_95"] is None  # one seed: no bound
    assert t_quantile_95(22) == 1.725  # between table entries: the next smaller df (a wider bound)


def test_paired_ratio_bounds_the_geometric_mean_of_per_seed_ratios():
    import math

    from reflow.bench.paired import paired_ratio

    pair = paired_ratio([2.0, 3.3, 1.5], [2.0, 3.0, 1.0])
    assert [round(r, 12) for r in pair["ratios"]] == [1.0, 1.1, 1.5]
    logs = [0.0, math.log(1.1), math.log(1.5)]
    mean = sum(logs) / 3
    half = 2.920 * (sum((x - mean) ** 2 for x in logs) / 2) ** 0.5 / 3**0.5
    assert abs(pair["geometric_mean"] - math.exp(mean)) < 1e-12
    assert abs(pair["lower_95"] - math.exp(mean - half)) < 1e-12 and abs(pair["upper_95"] - math.exp(mean + half)) < 1e-12
    assert paired_ratio([2.0], [1.0])["lower_95"] is None
    with pytest.raises(ValueError, match="positive"):
        paired_ratio([1.0, 0.0], [1.0, 1.0])


def test_engine_figures_separate_the_machine_speed_from_the_rule():
    from reflow.bench.modes import engine_figures, paired_throughput

    rows = [{"rollout_engine_steps": 100, "num_samples": 40}, {"rollout_engine_steps": 300, "num_samples": 60}]
    assert engine_figures(rows, 4.0) == {"engine_steps_per_s": 100.0, "fresh_samples_per_engine_step": 0.25}
    assert engine_figures([{"num_samples": 4}], 1.0) == {}  # no engine window in the rows
    # seed 1's machine ran slower for reflow: its fresh rate falls with its engine steps, not its share of them
    runs = lambda fresh, steps: [  # noqa: E731
        {"seed": s, "fresh_samples_per_s": f, "engine_steps_per_s": e, "fresh_samples_per_engine_step": f / e}
        for s, (f, e) in enumerate(zip(fresh, steps))
    ]
    modes = {"async": {"per_seed": runs([80, 80, 80], [200, 200, 200])},
             "reflow": {"per_seed": runs([84, 60, 80], [210, 150, 200])}}
    pairs = paired_throughput(modes)["reflow/async"]
    assert set(pairs) == {"fresh_samples_per_s", "engine_steps_per_s", "fresh_samples_per_engine_step"}
    assert [round(r, 12) for r in pairs["fresh_samples_per_engine_step"]["ratios"]] == [1.0, 1.0, 1.0]
    assert pairs["fresh_samples_per_s"]["ratios"] == pytest.approx([1.05, 0.75, 1.0])
    assert pairs["fresh_samples_per_s"]["lower_95"] < 0.95 < pairs["fresh_samples_per_s"]["upper_95"]
    # the target line carries the paired ratio beside the ratio of the means
    from reflow.bench.modes import targets

    for mode, fresh in (("async", 80.0), ("reflow", 74.67)):
        modes[mode].update({"fresh_samples_per_s": fresh, "tokens_per_s": 1.0, "loss_tokens_per_s": 1.0,
                            "rollout_idle_ratio": 0.0, "evicted_fraction": 0.0})
    line = targets(modes, {}, paired_throughput(modes))["fresh_samples_per_s_vs_async"]
    assert not line["met"] and line["paired"]["geometric_mean"] == pytest.approx(pairs["fresh_samples_per_s"]["geometric_mean"])


def test_targets_read_the_paired_bound_and_every_claim():
    from reflow.bench.modes import paired_rewards, targets

    def mode(tokens, loss, fresh, idle, evals, evicted=0.0, survival=None, seeds=None):
        seeds = seeds or list(range(len(evals)))
        return {"tokens_per_s": tokens, "loss_tokens_per_s": loss, "fresh_samples_per_s": fresh, "rollout_idle_ratio": idle,
                "eval_reward_at_equal_time": sum(evals) / len(evals), "evicted_fraction": evicted,
                "per_seed": [{"seed": s, "eval_reward_at_equal_time": e} for s, e in zip(seeds, evals)],
                "survival_by_length_decile": survival or [1.0] * 10}

    modes = {
        "sync": mode(50, 50, 1.0, 0.5, [0.30, 0.31], seeds=[0, 2]),  # run apart, on fewer seeds
        "one_step_off": mode(80, 80, 1.5, 0.3, [0.35, 0.36, 0.34]),
        "async": mode(100, 100, 2.0, 0.2, [0.40, 0.42, 0.41]),
        "reflow": mode(130, 120, 1.9, 0.22, [0.41, 0.41, 0.42], evicted=0.01, survival=[1.0] * 9 + [0.85]),
    }
    paired = paired_rewards(modes)
    assert set(paired) == {"reflow-sync", "reflow-one_step_off", "reflow-async"}
    out = targets(modes, paired)
    assert out["tokens_per_s_vs_best_baseline"]["met"] and out["tokens_per_s_vs_best_baseline"]["best"] == "async"
    assert not out["loss_tokens_per_s_vs_best_baseline"]["met"]  # 1.2x < 1.25x
    assert out["fresh_samples_per_s_vs_async"]["met"] and out["rollout_idle_above_async"]["met"]
    assert out["eval_reward_vs_async_lower_95"]["met"] == (paired["reflow-async"]["lower_95"] >= -0.02)
    assert out["eval_reward_vs_sync"]["met"] and out["eval_reward_vs_one_step_off"]["met"]
    # paired by seed, on the seeds both ran: reflow's seeds 0 and 2 against sync's
    assert paired["reflow-sync"]["seeds"] == [0, 2] and [round(d, 9) for d in paired["reflow-sync"]["differences"]] == [
        0.11, 0.11
    ]
    assert out["evicted_fraction"]["met"] and not out["survival_by_length_decile_min"]["met"]


def test_the_regime_is_async_trainer_idle_against_the_rollout_bound_line():
    """The JSON says whether the run measured the paper's regime: async's mean trainer idle (waits and sync
    stalls) of at least ROLLOUT_BOUND_IDLE; without async there is nothing to read it from."""
    from reflow.bench.modes import ROLLOUT_BOUND_IDLE, format_table, regime

    def run(*idles):  # a mode as ``finish`` hands it over: its seeds and their aggregate
        per_seed = [{"trainer_idle_ratio": idle, "staleness_distribution": {}} for idle in idles]
        return {"per_seed": per_seed, **aggregate(per_seed)}

    seen = regime({"async": run(0.30, 0.50), "reflow": run(0.1, 0.1)})
    assert seen == {"async_trainer_idle": pytest.approx(0.40), "per_seed": [0.30, 0.50],
                    "rollout_bound_from": ROLLOUT_BOUND_IDLE, "rollout_bound": True}
    assert not regime({"async": run(0.38)})["rollout_bound"]
    assert regime({"reflow": run(0.1)}) == {}
    line = format_table({"start_eval_reward": 0.2, "seeds": 1, "modes": {}, "regime": regime({"async": run(0.21)})})
    assert "async's trainer idle 0.21 (rollout-bound from 0.4): NOT rollout-bound" in line


def test_learning_curve_samples_the_moving_reward_by_time_and_by_step():
    from reflow.bench.modes import learning_curve

    rows = [{"step_time_s": 4.0, "reward_mean": r} for r in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)]
    curve = learning_curve(rows, every_s=10.0, every_steps=5)
    # 10 s is passed at step 3 (12 s): the mean of steps 1-3; 20 s at step 5; 30 s at step 8; 40 s at step 10
    assert [t for t, _ in curve["by_time"]] == [10.0, 20.0, 30.0, 40.0]
    assert abs(curve["by_time"][0][1] - 0.1) < 1e-12 and abs(curve["by_time"][3][1] - 0.7) < 1e-12
    assert [(n, round(r, 12)) for n, r in curve["by_step"]] == [(5, 0.2), (10, 0.7)]


def test_merging_results_replaces_the_rerun_seeds_and_pairs_by_seed(tmp_path):
    from reflow.bench.modes import SUMMARY_KEYS, finish, merge_results

    def run(seed, reward):
        return {**dict.fromkeys(SUMMARY_KEYS, 1.0), "seed": seed, "placement": "T1x1+R1", "equal_time_s": 60.0,
                "eval_reward_at_equal_time": reward, "staleness_distribution": {"0": 1.0}}

    def result(path, seeds, rewards):
        modes = {m: {"placement": "T1x1+R1", "per_seed": [run(s, rewards[m] + s / 100) for s in seeds]}
                 for m in rewards}
        body = {"command": f"bench {seeds}", "start_eval_reward": 0.3, "config": "c.toml", "overrides": [],
                "world_size": 2, "rollout_ranks": 1,
                "time_budget_s": 60, "eval_prompts": 512, "seed_list": seeds, "modes": modes}
        path.write_text(json.dumps(body))
        return str(path)

    first = result(tmp_path / "a.json", [0, 1, 2, 3], {"async": 0.40, "reflow": 0.50})  # seeds 2, 3 disturbed
    rerun = result(tmp_path / "b.json", [2, 3], {"async": 0.40, "reflow": 0.42})
    merged = merge_results([first, rerun])
    assert merged["seed_list"] == [0, 1, 2, 3] and merged["seeds"] == 4
    out = tmp_path / "merged.json"
    assert finish(merged, str(out), {}) == 0
    written = json.loads(out.read_text())
    diffs = written["paired_eval_reward"]["reflow-async"]["differences"]
    assert [round(d, 9) for d in diffs] == [0.1, 0.1, 0.02, 0.02]  # seeds 2 and 3 from the rerun
    # the baselines, run apart: every mode any result ran is in the merged table, in the modes' order
    baselines = result(tmp_path / "s.json", [0, 1], {"sync": 0.30, "one_step_off": 0.35})
    together = merge_results([first, rerun, baselines])
    assert list(together["modes"]) == ["sync", "one_step_off", "async", "reflow"]
    assert [run["seed"] for run in together["modes"]["sync"]["per_seed"]] == [0, 1]
    bad = result(tmp_path / "c.json", [4], {"async": 0.4, "reflow": 0.4})
    body = json.loads(open(bad).read())
    body["config"] = "other.toml"
    open(bad, "w").write(json.dumps(body))
    with pytest.raises(ValueError, match="config"):
        merge_results([first, bad])
