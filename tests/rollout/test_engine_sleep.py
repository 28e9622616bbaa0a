"""The engine's sleep levels as vLLM sees them on CUDA, with a recording stand-in for ``vllm.LLM`` (the CPU build
has no sleep mode): a sleep before a weight sync drops the weights (level 2) and the reload maps only their
memory, leaving the KV cache asleep until the engine next runs; any other sleep keeps the weights (level 1), and a
reload into it still wakes only the weights."""

import pytest
import torch

from reflow.rollout.engine import RolloutEngine


class RecordingLLM:
    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))
        return True

    def collective_rpc(self, name, kwargs):
        self.calls.append((name,))

    def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append(("reset_prefix_cache",))
        return True


class NothingInFlight:
    """The engine's scheduler view with no request holding KV (a colocated engine asleep)."""

    def kv_holders(self):
        return set()

    def held_preemptions(self):
        return 0

    def excuse_reload(self, preempted):
        assert preempted == 0


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = object.__new__(RolloutEngine)  # the sleep and reload logic, without building vLLM
    engine.llm, engine.active, engine.asleep, engine.weights_discarded, engine.version = RecordingLLM(), {}, set(), False, 0
    engine.keeps_weight_backup, engine.signal_reader = False, NothingInFlight()
    monkeypatch.setattr("reflow.rollout.engine.release_host_cache", lambda: engine.llm.calls.append(("release_host_cache",)))
    return engine


def test_a_sleep_before_a_sync_drops_the_weights_and_the_reload_maps_only_theirs(engine):
    engine.sleep(discard_weights=True)
    with pytest.raises(RuntimeError, match="load_weights must come before"):
        engine.wake_up()  # it must not run on weights it no longer has
    engine.load_weights(iter(()), version=1)
    assert engine.llm.calls == [
        ("sleep", 2), ("wake_up", ("weights",)), ("release_host_cache",), ("reload_weights",), ("reset_prefix_cache",)
    ]
    assert engine.sleeping and not engine.weights_discarded and engine.version == 1
    engine.wake_up()  # the next generation maps the KV cache, after the trainer parked its state
    assert engine.llm.calls[-1] == ("wake_up", None) and not engine.sleeping


def test_any_other_sleep_keeps_the_weights_and_a_reload_still_leaves_the_cache_asleep(engine):
    engine.sleep()
    engine.sleep()  # asleep already: nothing more
    engine.load_weights(iter(()), version=3)
    # the level-1 backup, copied back into the mapped weights, leaves PyTorch's host cache too
    assert engine.llm.calls == [
        ("sleep", 1), ("wake_up", ("weights",)), ("release_host_cache",), ("reload_weights",), ("reset_prefix_cache",)
    ]
    assert engine.sleeping
    engine.wake_up()  # the KV cache only: no backup to release
    assert engine.llm.calls[-1] == ("wake_up", None) and not engine.sleeping


def test_a_wake_releases_the_weight_backup_unless_the_engine_sleeps_at_level_1_every_step(engine):
    """The start-up sleep (level 1) leaves a pinned copy of the weights that vLLM frees into PyTorch's host
    cache at the wake; only sync mode with a sync every few steps sleeps at level 1 again and reuses it."""
    engine.sleep()
    engine.wake_up()
    assert engine.llm.calls == [("sleep", 1), ("wake_up", None), ("release_host_cache",)]
    engine.keeps_weight_backup = True
    engine.sleep()
    engine.wake_up()
    assert engine.llm.calls[-2:] == [("sleep", 1), ("wake_up", None)]


def test_an_awake_engine_reloads_without_waking_anything(engine):
    engine.load_weights(iter(()), version=2)
    assert engine.llm.calls == [("reload_weights",), ("reset_prefix_cache",)] and not engine.sleeping


def test_a_sleep_after_a_weights_only_wake_puts_the_weights_back_to_sleep(engine):
    """A rank leaves the trainer (its engine asleep), receives weights (only they are mapped), then rejoins the
    trainer before it generated: its sleep must unmap the weights again, not find the engine "asleep" and do
    nothing (about 15 GiB of an 8B engine's weights beside the trainer)."""
    engine.sleep()
    engine.load_weights(iter(()), version=1)
    assert engine.asleep == {"kv_cache"}
    engine.sleep()
    assert engine.llm.calls[-1] == ("sleep", 1) and engine.asleep == {"weights", "kv_cache"}
    engine.load_weights(iter(()), version=2)  # and back: only the weights again
    engine.sleep(discard_weights=True)
    assert engine.llm.calls[-3:] == [("reload_weights",), ("reset_prefix_cache",), ("sleep", 2)]
    engine.sleep()  # asleep whole: nothing more
    assert engine.llm.calls[-1] == ("sleep", 2)
    engine.load_weights(iter(()), version=3)
    engine.wake_up()
    assert engine.llm.calls[-1] == ("wake_up", None) and engine.asleep == set()


def test_each_rank_has_its_own_vllm_cache_root():
    from reflow.rollout.engine import vllm_cache_root

    env = {"XDG_CACHE_HOME": "/c"}
    env["VLLM_CACHE_ROOT"] = vllm_cache_root(env, 3)
    assert env["VLLM_CACHE_ROOT"] == "/c/vllm/rank3"
    env["VLLM_CACHE_ROOT"] = vllm_cache_root(env, 3)  # a second engine in the process: the same root, not nested
    assert env["VLLM_CACHE_ROOT"] == "/c/vllm/rank3"
    user = {"VLLM_CACHE_ROOT": "/fast/vllm"}
    assert vllm_cache_root(user, 0) == "/fast/vllm/rank0"


def test_the_padding_token_ends_a_sample_where_it_is_not_an_eos():
    """A sampled padding token fed back as an input reaches RMSNorm as the zero vector (its embedding row is
    never trained): the tiny runs' gradient-norm spike (620 at the second update). It ends the sample instead."""
    from types import SimpleNamespace

    from reflow.rollout.engine import padding_stops
    from reflow.rollout.tokenizer import PromptTokenizer
    from tests.conftest import TINY_HF

    assert padding_stops(SimpleNamespace(pad_token_id=0, eos_token_id=2)) == [0]
    assert padding_stops(SimpleNamespace(pad_token_id=151643, eos_token_id=151643)) == []  # Qwen3's: an EOS already
    assert padding_stops(SimpleNamespace(pad_token_id=None, eos_token_id=2)) == []
    tiny = PromptTokenizer(TINY_HF)
    assert padding_stops(tiny.tok) == [tiny.pad_id]
