"""The slow concurrency controller and the fast KV admission rule, on synthetic engine signals."""

import pytest

from reflow.scheduler.concurrency import (
    ConcurrencyController,
    ConcurrencySettings,
    KVAdmission,
    ResponseLengths,
    WorkerLoad,
)

BUDGET = 10_000


def controller(**overrides) -> ConcurrencyController:
    settings = ConcurrencySettings(alpha=1.0, interval_s=1.0, min_cap=4, max_cap=256, horizon_s=1.0, **overrides)
    control = ConcurrencyController(settings, initial_cap=64)
    assert control.observe(0.0, 0.0, BUDGET, 0, 0) is None  # the first observation only sets the baseline
    return control


def test_grows_by_the_factor_only_when_the_cap_binds_and_the_cache_has_headroom():
    control = controller()
    assert control.observe(1.0, 0.3, BUDGET, 64, 0).reason == "hold"  # cap not binding: no reason to grow
    control.note_cap_binding()
    decision = control.observe(2.0, 0.3, BUDGET, 64, 0)  # no growth of KV tokens since the last update
    assert (decision.reason, decision.previous, decision.cap) == ("grow", 64, 80)  # ceil(64 x 1.25)
    control.note_cap_binding()
    assert control.observe(2.5, 0.3, BUDGET, 80, 0) is None  # within interval_s: no decision


def test_growth_of_kv_tokens_holds_off_a_grow_at_low_usage():
    """u = 0.4 is below 0.6, but the tokens in use grew by 3,000/s: projected 0.4 + 3000 x 1 / 10000 = 0.7."""
    control = controller()
    control.observe(1.0, 0.1, BUDGET, 64, 0)
    control.note_cap_binding()
    decision = control.observe(2.0, 0.4, BUDGET, 64, 0)
    assert decision.growth_ema == pytest.approx(3000.0)
    assert decision.projected_usage == pytest.approx(0.7)
    assert decision.reason == "hold" and decision.cap == 64


def test_trims_to_the_target_usage_under_kv_pressure():
    control = controller()
    decision = control.observe(1.0, 0.9, BUDGET, 64, 0)  # 0.0 -> 0.9 in 1 s: projected 0.9 + 9000 / 10000
    assert decision.reason == "trim" and decision.projected_usage == pytest.approx(1.8)
    assert decision.cap == int(64 * 0.7 / 1.8)  # 24: aimed at the target against the projection
    decision = control.observe(2.0, 0.9, BUDGET, 50, 0)  # steady at 0.9: in-flight 50 would give 38
    assert (decision.reason, decision.cap) == ("trim", 24)  # pressure never raises the cap
    steady = ConcurrencyController(ConcurrencySettings(alpha=1.0, interval_s=1.0, min_cap=4, horizon_s=1.0), 64)
    steady.observe(0.0, 0.9, BUDGET, 50, 0)
    assert steady.observe(1.0, 0.9, BUDGET, 50, 0).cap == int(50 * 0.7 / 0.9)  # 38


def test_cuts_on_preemption_whatever_the_usage():
    control = controller()
    decision = control.observe(1.0, 0.2, BUDGET, 60, preemptions=3)
    assert (decision.reason, decision.cap, decision.preemptions) == ("cut", 48, 3)  # 0.8 x 60
    assert control.observe(2.0, 0.2, BUDGET, 40, preemptions=3).reason == "hold"  # only new preemptions cut


def test_the_cap_stays_within_its_bounds():
    control = controller()
    assert control.observe(1.0, 0.5, BUDGET, 2, preemptions=1).cap == 4  # min_cap
    for t in range(2, 40):
        control.note_cap_binding()
        control.observe(float(t), 0.1, BUDGET, control.cap, preemptions=1)
    assert control.cap == 256  # max_cap


def test_response_length_estimate_is_a_high_percentile_of_a_recent_window():
    lengths = ResponseLengths(0.9, window=10, initial=512)
    assert lengths.estimate() == 512  # nothing finished yet: the longest allowed
    for n in range(1, 21):
        lengths.add(n)
    assert list(lengths.recent) == list(range(11, 21))
    assert lengths.estimate() == 19  # nearest rank: ceil(0.9 x 10) = 9th of 11..20


def test_group_estimate_counts_the_prompt_once():
    lengths = ResponseLengths(1.0, window=8, initial=100)
    admission = KVAdmission(0.9, lengths)
    assert admission.group_estimate(30, 4) == 30 + 4 * 100


def test_a_running_sequence_is_expected_to_end_at_the_mean_of_recent_lengths_that_reached_it():
    lengths = ResponseLengths(0.9, window=8, initial=100)
    for n in (10, 20, 30, 40, 200):
        lengths.add(n)
    assert lengths.expected_final(0) == 60  # all five
    assert lengths.expected_final(25) == 90  # 30, 40, 200
    assert lengths.expected_final(250) == 250  # beyond every recent one: at least what it has
    admission = KVAdmission(0.9, lengths)
    # a group of two in flight, expected to end at 60 and 90: the cache peaks when the first ends, 60 steps from
    # now (prompt 30 + 60 + 25 + 60 = 175), not at the sum of the final sizes (180): at t = 65 the first is gone
    assert admission.peak_tokens([(30, [0, 25])]) == 30 + 60 + 85


def test_peak_counts_new_groups_at_the_estimate_and_takes_the_worst_moment():
    lengths = ResponseLengths(1.0, window=8, initial=100)
    for n in (10, 100):
        lengths.add(n)  # estimate 100; a sequence at 0 expects 55, one at 50 expects 100
    admission = KVAdmission(0.9, lengths)
    running = [(0, [50])]  # one sequence, ends in 50 steps at 100 tokens
    # with a new group of 2 (prompt 20, each to 100 tokens): at t = 50 the running one holds 100, the new ones
    # 20 + 2 x 50; at t = 100 only the new ones, 20 + 2 x 100 = 220 (the peak)
    assert admission.peak_tokens(running, [(20, 2)]) == 220
    assert admission.peak_tokens(running, [(20, 1)]) == max(100 + 20 + 50, 20 + 100)
    assert admission.peak_tokens([]) == 0


def test_group_estimate_in_kv_blocks_shares_only_the_prompts_full_blocks():
    admission = KVAdmission(0.9, ResponseLengths(1.0, window=8, initial=40), block_size=16)
    # prompt 40 = 2 shared full blocks + 8 tokens per sequence; 8 + 40 = 48 tokens = 3 blocks per sequence
    assert admission.group_estimate(40, 4) == 16 * (2 + 4 * 3)
    # in flight: 2 shared blocks, and per sequence its tokens past them plus half a partly filled block; the
    # sequence at 57 has reached the estimate (ends now), the other ends in 40 steps
    assert admission.peak_tokens([(40, [57, 0])]) == 32 + (8 + 57 + 7.5) + (8 + 0 + 7.5)


def test_admission_never_exceeds_rho_and_respects_the_cap():
    admission = KVAdmission(0.8, ResponseLengths(1.0, window=8, initial=100))
    # predicted_tokens: T_pred with the group started
    assert admission.admits(WorkerLoad(8_000, BUDGET, 8, 64), 4)  # exactly 0.8
    assert not admission.admits(WorkerLoad(8_001, BUDGET, 8, 64), 4)
    assert not admission.admits(WorkerLoad(0, BUDGET, 62, 64), 4)  # the cap
    assert admission.admits(WorkerLoad(50_000, BUDGET, 0, 64), 4)  # an empty engine always admits


def test_admission_rule_names_what_refuses_and_tells_the_controller_its_cap_binds():
    from reflow.scheduler.concurrency import AdmissionRule

    control = ConcurrencyController(ConcurrencySettings(min_cap=4, max_cap=256), initial_cap=16)
    rule = AdmissionRule(64, control, KVAdmission(0.5, ResponseLengths(1.0, window=8, initial=100)))
    nothing = lambda: []  # noqa: E731
    assert rule.cap == 16
    assert rule.refuses(0, BUDGET, 30, 4, nothing) is None  # an empty engine always admits
    assert rule.refuses(14, BUDGET, 30, 4, nothing) == "cap" and control._binding
    # 3 groups of 4 in flight, all ending 100 steps from now at 30 + 4 x 100 = 430 tokens each: with another,
    # the peak 4 x 430 is within 0.5 x 10k
    in_flight = lambda: [(30, [0, 0, 0, 0])] * 3  # noqa: E731
    assert rule.refuses(12, BUDGET, 30, 4, in_flight) is None
    crowded = lambda: [(30, [0, 0, 0, 0])] * 11  # noqa: E731  (11 x 430 + 430 > 5000)
    assert AdmissionRule(256, None, rule.kv_rule).refuses(12, BUDGET, 30, 4, crowded) == "kv"
