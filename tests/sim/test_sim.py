"""The simulator: its engine's paged KV cache, the modes' guarantees when it runs the real scheduling
classes, the planner moving ranks in simulated time, and profile fitting."""

import dataclasses
import json
import random

import pytest

from reflow.distributed.placement import parse_placement_name
from reflow.modes.transition import TrainerClock
from reflow.rollout.request import Request
from reflow.sim.engine import SimEngine, SimTrajectory, trajectory
from reflow.sim.profiles import QWEN3_8B_H800, TINY_CPU, CostProfile, fit_profile
from reflow.sim.system import SimConfig, SimPlacementLinks, simulate
from reflow.sim.workload import Workload
from reflow.types import Handover

PROFILE = CostProfile(
    name="test", source="test", step_overhead_s=0.01, decode_token_s=0.001, context_token_s=0.0, prefill_token_s=0.0,
    kv_budget_tokens=64 * 16, kv_block_size=16, max_num_seqs=64, train_overhead_s=0.1, train_token_s=0.0005,
    train_collective_s=0.02, weight_sync_s=0.05, transition_s=0.2,
)
WORKLOAD = Workload(name="test", prompt_tokens=20, median_tokens=30, sigma=0.6, max_tokens=200)


def sequences(group: str, count: int, prompt: int, target: int) -> list[Request]:
    ids = [0] * prompt
    return [Request(f"{group}/{k}", ids, 1000, k, meta={"group": group, "sim": SimTrajectory(target)}) for k in range(count)]


def test_engine_shares_full_prompt_blocks_and_costs_each_step():
    engine = SimEngine(PROFILE, 0, max_steps=8)
    engine.resume(sequences("a", 4, prompt=40, target=8))  # 2 full prompt blocks shared, 8 + 8 tokens each: 1 block
    finished = engine.step()
    assert [len(req.output_ids) for req in finished] == [8] * 4 and engine.decode_steps == 8
    assert engine.engine_steps == 8 and engine.step_sequences == 32 and engine.sampled_tokens == 32
    assert engine.busy_s == pytest.approx(8 * (0.01 + 4 * 0.001))
    assert engine._blocks([trajectory(req) for req in finished]) == 2 + 4 * 1


def test_engine_counts_requests_in_flight_apart_from_the_tokens_it_samples():
    """``step_sequences`` counts every request in flight, queued ones too, as the live worker does; the step's
    cost and ``sampled_tokens`` follow the running ones only (here 2 of 4: max_num_seqs)."""
    engine = SimEngine(dataclasses.replace(PROFILE, max_num_seqs=2), 0, max_steps=8)
    engine.resume(sequences("a", 4, prompt=40, target=8))
    assert [len(req.output_ids) for req in engine.step()] == [8, 8] and engine.decode_steps == 8
    assert engine.step_sequences == 4 * 8 and engine.sampled_tokens == 2 * 8
    assert engine.busy_s == pytest.approx(8 * (0.01 + 2 * 0.001))


def test_a_macro_step_of_a_small_batch_fills_its_seconds():
    # one sequence's step costs 0.011 s: 0.25 s of decode is 22 steps, more than max_steps
    engine = SimEngine(PROFILE, 0, max_steps=8, macro_s=0.25)
    engine.resume(sequences("a", 1, prompt=4, target=100))
    engine.step()
    assert engine.decode_steps == int(0.25 / 0.011) == 22
    # twenty sequences' steps cost 0.03 s: 8 of them (0.24 s) are max_steps already
    engine = SimEngine(PROFILE, 0, max_steps=8, macro_s=0.25)
    engine.resume(sequences("b", 20, prompt=4, target=100))
    engine.step()
    assert engine.decode_steps == 8
    engine.resume(sequences("c", 1, prompt=4, target=100))
    engine.step_until_started()  # first-token steps stay single decode steps
    assert engine.decode_steps == 1


def test_the_engine_signals_the_cache_its_sequences_hold_after_each_step():
    engine = SimEngine(PROFILE, 0, max_steps=8)
    engine.resume(sequences("a", 3, prompt=40, target=8) + sequences("b", 3, prompt=24, target=30))
    while engine.num_active:
        engine.step()
        assert engine.signals.kv_usage == engine.kv_usage()
        assert engine.signals.running == len(engine.running)
    assert engine.signals.kv_usage == 0.0


def test_engine_preempts_the_newest_sequence_when_the_cache_runs_out():
    small = CostProfile(**{**PROFILE.as_dict(), "kv_budget_tokens": 10 * 16})  # 10 blocks
    engine = SimEngine(small, 0, max_steps=4)
    engine.resume(sequences("a", 4, prompt=8, target=60) + sequences("b", 4, prompt=8, target=60))
    done = []
    while engine.num_active:
        done += engine.step()
    assert len(done) == 8 and all(len(req.output_ids) == 60 for req in done)
    assert engine.preemptions > 0
    assert engine.kv_usage_sum / engine.engine_steps <= 1.0


@pytest.mark.parametrize("mode", ["one_step_off", "async", "reflow"])
def test_decoupled_modes_keep_their_staleness_guarantees_in_simulation(mode):
    cfg = SimConfig(mode=mode, gpus=4, prompts_per_step=8, group_size=4, steps=12, replicas=2, sigma=0.5, delta=2, interval=2)
    result = simulate(cfg, PROFILE, WORKLOAD)
    assert result["steps"] == 12
    counts = result["staleness_counts"]
    if mode == "one_step_off":  # delta 1: step 1 trains version 0's samples, then exactly one version old
        assert len(counts) == 2 and counts[0] == 32 and counts[1] == 11 * 32
    else:
        assert len(counts) == 3  # nothing trained staler than delta from the finish (the ReplayBuffer refuses it)
        assert result["evicted_unused"] == 0  # the window ties admission to retirement: nothing generated in vain
    assert 0 <= result["trainer_idle_ratio"] <= 1 and 0 <= result["rollout_idle_ratio"] <= 1


def test_sync_alternates_generation_and_training():
    cfg = SimConfig(mode="sync", gpus=2, prompts_per_step=8, group_size=4, steps=5)
    result = simulate(cfg, PROFILE, WORKLOAD)
    assert result["steps"] == 5 and result["trainer_idle_ratio"] > 0 and result["rollout_idle_ratio"] > 0


def test_the_planner_moves_ranks_toward_the_bottleneck_and_says_why():
    """Training is 20x costlier per token than generation here: one trainer replica of 8 GPUs starves 7
    engines' worth of samples; the planner adds replicas."""
    heavy_trainer = CostProfile(**{**PROFILE.as_dict(), "train_token_s": 0.01})
    cfg = SimConfig(mode="reflow", gpus=8, prompts_per_step=16, group_size=4, steps=20, replicas=1, interval=2,
                    adaptive_placement=True, cooldown_steps=2, horizon_steps=20)
    result = simulate(cfg, heavy_trainer, WORKLOAD)
    assert result["transitions"], result["timeline"]
    first = result["transitions"][0]
    assert first["transition"].startswith("T1x1+R7 -> T") and "samples/s at a predicted length" in first["reason"]
    assert _replicas(result["timeline"][-1]["placement"]) > 1


def test_the_simulated_planner_is_the_live_one_built_from_the_same_scheduler_section():
    """The simulator builds its planner as the live run does (``build_controller`` on a ``[scheduler]``
    section): the live section's defaults, the profile's transition cost, steps 7 and 8 when asked for."""
    from reflow.config.job_config import SchedulerSection
    from reflow.sim.system import DecoupledSim

    cfg = SimConfig(mode="reflow", gpus=8, prompts_per_step=16, group_size=4, steps=2, replicas=2,
                    adaptive_placement=True, planner_memory_steps=60, planner_explore_budget=0.1)
    settings = DecoupledSim(cfg, PROFILE, WORKLOAD).planner.settings
    live = SchedulerSection()
    assert (settings.cooldown_steps, settings.margin, settings.horizon_steps, settings.ema) == (
        live.cooldown_steps, live.margin, live.horizon_steps, live.planner_ema)
    assert (settings.memory_steps, settings.explore_budget) == (60, 0.1)
    assert settings.transition_cost_s == PROFILE.transition_s and settings.warmup_steps == cfg.warmup_steps
    assert settings.replica_options == tuple(range(1, 8)) and settings.batch_size == 64
    assert DecoupledSim(dataclasses.replace(cfg, adaptive_placement=False), PROFILE, WORKLOAD).planner is None


@pytest.mark.parametrize("logs_sampled", [True, False], ids=["sampled-tokens", "older-run"])
def test_fit_recovers_the_costs_of_a_synthetic_run(tmp_path, logs_sampled):
    """The engine's cost per sampled token comes from rollout_sampled_tokens (the running sequences), not from
    the requests in flight, queued ones included (here an unrelated multiple of them); a run from before
    rollout_sampled_tokens was logged fits on the requests in flight."""
    rng = random.Random(0)
    rows = []
    for step in range(1, 21):
        steps, sequences_stepped, tokens = rng.randint(50, 150), rng.randint(1000, 6000), rng.randint(2000, 9000)
        prefilled = rng.randint(500, 5000)
        ranks = 1 + step % 2  # T1x1+R3 and T2x1+R2 in turn: the collectives cost 0.02 s with 2 ranks
        in_flight = sequences_stepped * rng.randint(3, 40) if logs_sampled else sequences_stepped
        busy = 0.004 * steps + 0.0002 * sequences_stepped + 0.00005 * prefilled
        train = 0.05 + 0.0003 * tokens / ranks + (0.02 if ranks > 1 else 0.0)
        sync = 0.1 if step % 2 == 0 else 0.0
        wait = 2.0 + rng.random()
        step_time = wait + train + sync + 0.01  # 10 ms a step outside the wait, the train step and the sync
        # each rollout rank syncs 30 ms longer than the trainer's broadcast (its reload); the rest of its
        # seconds: busy, idle, and 1 ms a decode step that is neither
        worker_syncs = (4 - ranks) if sync else 0
        worker_sync = (sync + 0.03) * worker_syncs
        idle = step_time * (4 - ranks) - worker_sync - busy - 0.001 * steps
        rows.append({
            "rollout_sync_s": worker_sync, "rollout_syncs": worker_syncs,
            "step": step, "placement": f"T{ranks}x1+R{4 - ranks}", "rollout_engine_steps": steps,
            "rollout_step_sequences": in_flight, "rollout_prefilled_tokens": prefilled,
            **({"rollout_sampled_tokens": sequences_stepped} if logs_sampled else {}),
            "rollout_busy_s": busy, "rollout_idle_s": idle, "trainer_tokens": tokens, "train_time_s": train,
            "weight_sync_s": sync, "trainer_wait_s": wait, "step_time_s": step_time,
        })
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    profile = fit_profile([str(path)], "synthetic")
    assert profile.step_overhead_s == pytest.approx(0.004) and profile.decode_token_s == pytest.approx(0.0002)
    assert profile.prefill_token_s == pytest.approx(0.00005)  # the tokens prefilled, new and again after syncs
    assert profile.train_overhead_s == pytest.approx(0.05) and profile.train_token_s == pytest.approx(0.0003)
    assert profile.train_collective_s == pytest.approx(0.02)
    assert profile.weight_sync_s == pytest.approx(0.1)
    assert profile.step_fixed_s == pytest.approx(0.01) and profile.worker_tick_s == pytest.approx(0.001)
    assert profile.worker_sync_s == pytest.approx(0.03)
    assert profile.train_time_ratios == pytest.approx([1.0] * 20)  # every step exactly as predicted


def test_a_profile_fitted_on_pass_slots_charges_the_passes_the_trainer_plans(tmp_path):
    """Runs that log ``train_pass_tokens`` are fitted per token slot of the busiest rank's passes, and the
    simulator then charges a rank the slots of the passes ``plan_micro_batches`` makes of its rows: a
    long-tailed row pads its pass, and the same rows split over two ranks pad more per token."""
    rows = []
    for step in range(1, 13):
        slots = 3000 + 250 * step
        rows.append({
            "step": step, "placement": "T1x1+R1", "rollout_engine_steps": 40 + step, "rollout_sampled_tokens": 400 + 9 * step,
            "rollout_prefilled_tokens": 300 + step % 4, "rollout_busy_s": 0.2 + 0.01 * step,
            "trainer_tokens": 1000 + 7 * (step % 5), "train_pass_tokens": slots, "train_time_s": 0.02 + 0.0001 * slots,
            "weight_sync_s": 0.0, "trainer_wait_s": 0.5, "step_time_s": 0.9 + 0.01 * step,
        })
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    profile = fit_profile([str(path)], "passes")
    assert profile.train_token_basis == "pass_slots"
    assert profile.train_token_s == pytest.approx(0.0001) and profile.train_overhead_s == pytest.approx(0.02)
    # rows of 10, 12, 11 and 90 tokens, two a pass: (10, 11) padded to 11 and (12, 90) to 90
    assert profile.charged_tokens([10, 12, 11, 90], micro_batch_size=2) == 2 * 11 + 2 * 90
    assert profile.charged_tokens([10, 12, 11, 90], micro_batch_size=4) == 4 * 90
    assert profile.charged_tokens([10, 12, 11, 90], micro_batch_size=0) == 123  # the size unknown: the tokens
    # a run without the slots is fitted per token, and charges tokens whatever the micro-batches
    for row in rows:
        del row["train_pass_tokens"]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    per_token = fit_profile([str(path)], "tokens")
    assert per_token.train_token_basis == "tokens"
    assert per_token.charged_tokens([10, 12, 11, 90], micro_batch_size=2) == 123


@pytest.mark.parametrize("mode", ["sync", "reflow"])
def test_the_simulated_trainer_pays_for_the_padding_of_its_passes(mode):
    """Under the pass-slot basis a long-tailed batch in passes of 16 rows costs more train time than in passes
    of one row (where the slots are the tokens), in sync's per-GPU steps and the decoupled trainer role alike;
    under the per-token basis the micro-batch size changes nothing."""
    slots = CostProfile(**{**PROFILE.as_dict(), "train_token_basis": "pass_slots", "train_token_s": 0.005})
    cfg = SimConfig(mode=mode, gpus=2, prompts_per_step=4, group_size=4, steps=6, warmup_steps=1)
    unpadded = simulate(dataclasses.replace(cfg, micro_batch_size=1), slots, WORKLOAD)
    padded = simulate(dataclasses.replace(cfg, micro_batch_size=16), slots, WORKLOAD)
    assert padded["tokens_per_s"] < 0.9 * unpadded["tokens_per_s"]
    per_token = CostProfile(**{**slots.as_dict(), "train_token_basis": "tokens"})
    assert simulate(dataclasses.replace(cfg, micro_batch_size=16), per_token, WORKLOAD)["tokens_per_s"] == (
        simulate(dataclasses.replace(cfg, micro_batch_size=1), per_token, WORKLOAD)["tokens_per_s"]
    )


def test_a_colocated_sync_is_the_gather_and_its_own_engines_reload(tmp_path):
    """Sync mode's weight sync gathers, then each rank reloads its own engine: the simulator charges a sync step
    weight_sync_s + worker_sync_s. Fitted from a colocated run, whose sync holds both parts, the profile takes
    the run's mean sync and no worker seconds beyond it, so the run is predicted as measured."""
    rows = [{
        "step": step, "placement": "T1x2+R0", "rollout_engine_steps": 40 + step, "rollout_sampled_tokens": 400 + 9 * step,
        "rollout_prefilled_tokens": 300, "rollout_busy_s": 0.2 + 0.01 * step, "trainer_tokens": 1000 + 50 * step,
        "train_time_s": 0.3 + 0.01 * step, "weight_sync_s": 0.03 + 0.002 * (step % 3), "gen_time_s": 0.5,
        "step_time_s": 0.9 + 0.01 * step,
    } for step in range(1, 11)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    base = CostProfile(**{**TINY_CPU.as_dict(), "worker_sync_s": 0.5})  # (what the run cannot tell comes from base)
    profile = fit_profile([str(path)], "colocated", base)
    assert profile.weight_sync_s == pytest.approx(sum(r["weight_sync_s"] for r in rows) / 10)
    assert profile.worker_sync_s == 0.0
    reloading = CostProfile(**{**PROFILE.as_dict(), "weight_sync_s": 0.05, "worker_sync_s": 0.02})
    result = simulate(SimConfig(mode="sync", gpus=2, prompts_per_step=8, group_size=4, steps=4, warmup_steps=0),
                      reloading, WORKLOAD)
    assert result["sync_s_per_step"] == pytest.approx(0.07)


def test_a_profile_with_measured_train_noise_draws_each_step_from_it():
    noisy = CostProfile(**{**PROFILE.as_dict(), "train_time_ratios": (0.5, 2.0)})
    rng = random.Random(0)
    draws = {round(noisy.train_seconds(1000, 1, rng), 9) for _ in range(50)}
    assert draws == {round(0.5 * (0.1 + 1000 * 0.0005), 9), round(2.0 * (0.1 + 1000 * 0.0005), 9)}
    assert PROFILE.train_seconds(1000, 2, rng) == pytest.approx(0.1 + 0.5 + 0.02)  # no ratios: the prediction


def test_an_empirical_workload_draws_whole_groups():
    """A group's answers to one prompt are alike: the simulator draws a measured group whole (its longest
    member is what the group waits for), or one prompt's length for every member."""
    measured = Workload(name="m", prompt_tokens=10, median_tokens=5, sigma=0.0, max_tokens=100,
                        empirical_groups=((3, 4, 3, 5), (40, 38, 41, 39)))
    rng = random.Random(0)
    drawn = {tuple(measured.group_lengths(rng, 0, 4)) for _ in range(40)}
    assert drawn == {(3, 4, 3, 5), (40, 38, 41, 39)}
    per_prompt = Workload(name="d", prompt_tokens=10, median_tokens=5, sigma=0.0, max_tokens=100, empirical_groups=((7,), (9,)))
    assert all(len(set(per_prompt.group_lengths(rng, 0, 8))) == 1 for _ in range(20))
    growing = Workload(name="g", prompt_tokens=10, median_tokens=5, sigma=0.0, max_tokens=100, empirical_groups=((10,),),
                       length_schedule=((5, 3.0),))
    assert growing.group_lengths(rng, 4, 2) == [10, 10] and growing.group_lengths(rng, 5, 2) == [30, 30]
    # a long chain_sum answer comes with a long prompt: each group's prompt length is drawn with it
    paired = Workload(name="p", prompt_tokens=10, median_tokens=5, sigma=0.0, max_tokens=100,
                      empirical_groups=((3, 4), (40, 38)), empirical_prompt_tokens=(5, 35))
    assert {(prompt, tuple(lengths)) for prompt, lengths in (paired.draw_group(rng, 0, 2) for _ in range(40))} == {
        (5, (3, 4)), (35, (40, 38))
    }
    assert measured.draw_group(rng, 0, 4)[0] == 10  # unknown prompt lengths: the workload's one


def test_shipped_profiles_are_complete():
    for profile in (TINY_CPU, QWEN3_8B_H800):
        assert profile.source and profile.kv_budget_tokens > 0 and profile.train_token_s > 0


def _replicas(placement: str) -> int:
    return parse_placement_name(placement).replicate_degree


def test_the_planner_follows_a_drifting_workload_both_ways():
    """The responses grow eightfold at step 16 and shrink back at step 40: the rollout cost per token rises
    (attention over a longer context) and falls. Within four sync points (8 steps) of each change the planner
    has moved ranks toward the rollout side, then back toward the trainer; each move hands the partial
    rollouts over, so a transition costs the mechanism (the profile's seconds), not a drain."""
    drifting = Workload(name="drift", prompt_tokens=256, median_tokens=400, sigma=0.5, max_tokens=16_384,
                        length_schedule=((16, 8.0), (40, 1.0)))
    cfg = SimConfig(mode="reflow", gpus=8, prompts_per_step=16, group_size=8, steps=56, replicas=4, interval=2,
                    adaptive_placement=True, cooldown_steps=2, horizon_steps=16)
    result = simulate(cfg, QWEN3_8B_H800, drifting)
    placement_after = {row["step"]: _replicas(row["placement"]) for row in result["timeline"]}
    assert placement_after[16 + 8] < placement_after[16], result["transitions"]
    assert placement_after[40 + 8] > placement_after[40], result["transitions"]
    # a transition costs the mechanism plus the wait for the engine step each worker is in (reflow takes no
    # first-token steps before it holds); draining the long answers would take minutes (at about 10 ms a decode
    # step, the 6,800-token median alone is over a minute)
    mechanism = QWEN3_8B_H800.transition_s
    assert all(mechanism - 1e-9 <= t["transition_s"] < mechanism + 2.0 for t in result["transitions"]), result["transitions"]
    assert all(t["reason"] for t in result["transitions"])


def _filtered_bound(fraction: float, groups: float) -> float:
    """Four binomial standard errors of a filtered share over ``groups`` groups (the draws are the seed's)."""
    return 4 * (fraction * (1 - fraction) / groups) ** 0.5


@pytest.mark.parametrize("mode", ["async", "reflow"])
def test_dynamic_sampling_in_the_decoupled_modes_filters_and_still_fills_every_batch(mode):
    """The live shards filter a group without signal on arrival and refund its budget: a third of the groups
    filtered, every step still trains exactly b samples, and no sample is evicted for staleness."""
    workload = Workload(name="test", prompt_tokens=20, median_tokens=30, sigma=0.6, max_tokens=200, no_signal_fraction=0.3)
    cfg = SimConfig(mode=mode, gpus=4, prompts_per_step=8, group_size=4, steps=12, replicas=2, sigma=0.5, delta=2,
                    interval=2, b_max=32, dynamic_sampling=True)
    result = simulate(cfg, PROFILE, workload)
    assert result["trained_per_step"] == [32] * 12
    assert result["evicted_unused"] == 0 and result["filtered_unused"] > 0
    received_groups = 9 * 32 / 4 / (1 - 0.3)  # the nine steps after warm-up, at the expected share
    assert abs(result["filtered_fraction"] - 0.3) <= _filtered_bound(0.3, received_groups), result["filtered_fraction"]
    unfiltered = simulate(SimConfig(**{**cfg.__dict__, "dynamic_sampling": False}), PROFILE, workload)
    assert unfiltered["filtered_fraction"] == 0.0 and unfiltered["filtered_unused"] == 0


def test_dynamic_sampling_with_no_signal_anywhere_stops_the_simulation_as_it_stops_a_run():
    workload = Workload(name="test", prompt_tokens=20, median_tokens=30, sigma=0.6, max_tokens=200, no_signal_fraction=1.0)
    cfg = SimConfig(mode="reflow", gpus=4, prompts_per_step=8, group_size=4, steps=4, replicas=2, dynamic_sampling=True)
    with pytest.raises(RuntimeError, match="reward.dynamic_sampling"):
        simulate(cfg, PROFILE, workload)


def test_sync_dynamic_sampling_generates_extra_rounds_for_the_missing_groups():
    """P groups with signal every step, at the cost of extra rounds of generation (each waiting for the slowest
    GPU); with no signal anywhere a step stops after MAX_EXTRA_BATCHES extra rounds and trains nothing."""
    workload = Workload(name="test", prompt_tokens=20, median_tokens=30, sigma=0.6, max_tokens=200, no_signal_fraction=0.3)
    plain = SimConfig(mode="sync", gpus=2, prompts_per_step=8, group_size=4, steps=8)
    filtered = simulate(SimConfig(**{**plain.__dict__, "dynamic_sampling": True}), PROFILE, workload)
    unfiltered = simulate(plain, PROFILE, workload)
    assert filtered["trained_per_step"] == unfiltered["trained_per_step"] == [32] * 8
    assert unfiltered["filtered_fraction"] == 0.0
    received_groups = 5 * 8 / (1 - 0.3)  # the five steps after warm-up
    assert abs(filtered["filtered_fraction"] - 0.3) <= _filtered_bound(0.3, received_groups), filtered["filtered_fraction"]
    assert filtered["step_time_s"] > unfiltered["step_time_s"]
    barren = Workload(name="test", prompt_tokens=20, median_tokens=30, sigma=0.6, max_tokens=200, no_signal_fraction=1.0)
    nothing = simulate(SimConfig(**{**plain.__dict__, "dynamic_sampling": True, "steps": 2}), PROFILE, barren)
    assert nothing["trained_per_step"] == [0, 0] and nothing["filtered_fraction"] == 1.0
    with pytest.raises(ValueError, match="one_step_off"):
        SimConfig(mode="one_step_off", gpus=4, prompts_per_step=8, group_size=4, steps=2, dynamic_sampling=True)


def test_a_kv_bound_config_sets_the_simulated_engines_cache():
    """``python -m reflow.sim validate`` on the rollout-bound bench: the engines hold what the config gives them
    (7 blocks of 32 tokens, less the one vLLM keeps as its null block: 6 to share), not the fitted profile's
    default cache."""
    from reflow.config import ConfigManager
    from reflow.sim.profiles import with_engine_settings

    cfg = ConfigManager().parse_args(["--config", "train_configs/bench_rollout_bound.toml"])
    bound = with_engine_settings(TINY_CPU, cfg.rollout)
    assert (bound.kv_budget_tokens, bound.kv_block_size, bound.max_num_seqs) == (192, 32, 256)
    assert bound.decode_token_s == TINY_CPU.decode_token_s  # the costs stay the profile's
    free = with_engine_settings(TINY_CPU, ConfigManager().parse_args(["--config", "train_configs/bench_modes.toml"]).rollout)
    assert (free.kv_budget_tokens, free.kv_block_size) == (TINY_CPU.kv_budget_tokens, TINY_CPU.kv_block_size)
    engine = SimEngine(bound, 0, max_steps=1)
    assert engine.budget_blocks == 6


def test_the_simulated_placement_links_hold_the_live_protocols_order():
    """``change_placement`` runs on every simulated rank over ``SimPlacementLinks``: a trainer rank that drains
    before every rollout worker flushed, or a rank that offers the all-gather something else than it holds, is a
    fault, not a silent divergence; a handover waits for the new shards; every rank reads the one clock."""
    clock = TrainerClock(step=7, version=3, steps_done=7, drawn=40)
    links = SimPlacementLinks(clock, offered=[None, None, (None, ["held"]), (None, [])])
    links.rank = 0
    with pytest.raises(RuntimeError, match=r"drained before rollout workers \[2, 3\] flushed"):
        links.drain([2, 3])
    for rank in (2, 3):
        links.rank = rank
        links.flush([0, 1])
    links.rank = 1
    links.drain([2, 3])
    links.hand_over(0, Handover([], frozenset({5})))
    assert links.handovers == [(0, Handover([], frozenset({5})))]
    assert links.broadcast([0, 0, 0, 0]) == [7, 3, 7, 40]
    links.rank = 2
    assert links.all_gather((None, ["held"]))[2] == (None, ["held"])
    with pytest.raises(RuntimeError, match="simulated rank 2 offered"):
        links.all_gather((None, []))


def test_a_simulated_engine_refuses_sleep_with_requests_in_flight_and_work_while_asleep():
    engine = SimEngine(PROFILE, 0)
    engine.add(sequences("g", 1, 10, 5)[0])
    with pytest.raises(RuntimeError, match="put to sleep with 1 requests in flight"):
        engine.sleep()
    engine.hold_all()
    engine.sleep()
    with pytest.raises(RuntimeError, match="while asleep"):
        engine.add(sequences("h", 1, 10, 5)[0])
    engine.load_weights((), 1)  # a weight load wakes it, as RolloutEngine's does
    engine.add(sequences("h", 1, 10, 5)[0])
    assert engine.num_active == 1
