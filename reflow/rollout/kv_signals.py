"""What the in-process vLLM engine's scheduler knows about KV-cache pressure, read after every engine step.

The only module that touches vLLM internals for scheduling signals. In vLLM 0.32 the V1 scheduler of an
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) is ``llm.llm_engine.engine_core.engine_core.scheduler``:

  kv_cache_manager.usage                     fraction of KV blocks in use (0..1)
  kv_cache_manager.block_pool.num_gpu_blocks KV blocks in the pool (one is the null block, never allocated)
  block_size                                 tokens per block
  get_request_counts()                       (running, waiting)
  requests[id].num_preemptions               times that request was preempted (its KV blocks freed)
  running, kv_holding_waiting                the requests that hold KV blocks (running, or waiting with blocks);
                                             their ids are the caller's with "-" and 8 random characters added

None of this is public API: ``EngineSignalReader`` checks every path when it is built and raises naming the
one that moved, and ``tests/rollout/test_kv_signals.py`` builds a real engine under KV pressure, so a vLLM
upgrade that renames one fails there, not silently in a run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSignals:
    kv_usage: float
    """Fraction of the KV cache in use after the step."""
    kv_budget_tokens: int
    """Tokens the KV cache holds in all."""
    running: int
    waiting: int
    preemptions: int
    """Preemptions since the reader was built (cumulative)."""

    @property
    def kv_tokens_used(self) -> float:
        return self.kv_usage * self.kv_budget_tokens


class EngineSignalReader:
    """Reads ``EngineSignals`` from one in-process vLLM engine (``vllm.LLM``)."""

    def __init__(self, llm):
        try:
            self.scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            manager = self.scheduler.kv_cache_manager
            blocks = manager.block_pool.num_gpu_blocks
            block_size = self.scheduler.block_size
            probed = (manager.usage, self.scheduler.get_request_counts(), self.scheduler.requests,
                      self.scheduler.running, self.scheduler.kv_holding_waiting)
        except AttributeError as e:
            raise RuntimeError(
                "reading KV-cache signals from vLLM failed: the path llm.llm_engine.engine_core.engine_core.scheduler"
                f"(.kv_cache_manager.usage / .block_pool.num_gpu_blocks / .block_size / .get_request_counts() / "
                f".requests / .running / .kv_holding_waiting) changed in this vLLM version ({e}); update "
                "reflow/rollout/kv_signals.py"
            ) from e
        del probed  # read once above only to fail here, not in the first step
        self.manager = manager
        self.block_size = block_size
        self.kv_budget_tokens = (blocks - 1) * block_size  # the null block holds nothing
        self._live: dict[str, int] = {}  # preemptions of the requests the scheduler still holds
        self._retired = 0  # preemptions of requests it has let go
        self._by_reloads = 0  # preemptions a weight reload made: not KV pressure

    def kv_holders(self) -> set[str]:
        """The ids (as the caller gave them) of the requests that hold KV blocks now: running, or waiting with
        their blocks kept. A request queued and never scheduled, or preempted (its blocks freed), holds none.
        vLLM adds "-" and 8 random characters to each id unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set:
        both forms are in the set, and neither can be another request's id (the engine's end in "@n")."""
        internal = [request.request_id for request in (*self.scheduler.running, *self.scheduler.kv_holding_waiting)]
        return {*internal, *(request_id.rsplit("-", 1)[0] for request_id in internal)}

    def held_preemptions(self) -> int:
        """Preemptions of the requests the scheduler holds now (before and after a reload, which keeps them)."""
        return sum(request.num_preemptions for request in self.scheduler.requests.values())

    def excuse_reload(self, preempted: int) -> None:
        """A weight reload preempted ``preempted`` requests on purpose (their KV was the old weights'): not
        counted as the KV-pressure preemptions the concurrency controller reacts to. The count must be what the
        reload did (``held_preemptions`` after less before): the reset preempts the running requests only, not
        the waiting ones that keep blocks, so counting every KV holder would drive the total below zero. The
        requests' counts are taken now too: a request the reload preempted may leave the engine before the next
        ``read`` (handed over or evicted at the sync), and its excused preemption must be in the total it leaves
        (the total went below zero in a run whose placement changed)."""
        self._by_reloads += preempted
        self._take_counts()

    def _take_counts(self) -> None:
        """The preemptions of the requests held now, and of those that left since the last count."""
        live = {request_id: request.num_preemptions for request_id, request in self.scheduler.requests.items()}
        self._retired += sum(count for request_id, count in self._live.items() if request_id not in live)
        self._live = live

    def read(self) -> EngineSignals:
        running, waiting = self.scheduler.get_request_counts()
        self._take_counts()
        live = self._live
        return EngineSignals(
            kv_usage=float(self.manager.usage),
            kv_budget_tokens=self.kv_budget_tokens,
            running=running,
            waiting=waiting,
            preemptions=self._retired + sum(live.values()) - self._by_reloads,
        )
