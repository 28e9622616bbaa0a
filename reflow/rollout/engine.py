"""The embedded vLLM engine of one rank.

Every rank builds one at startup, at the same point of the program: building
an engine creates process groups, so a rank that skips it hangs the others.
The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and is
driven through its request/step API, so a caller can interleave engine steps
with anything else (polling for a weight sync, streaming finished samples).

Each generated token carries the log-prob vLLM sampled it with (processed
log-probs: after temperature) and the policy version of the weights that
produced it. A request of a multi-turn task (``reflow.rollout.turns``) stops
at the end of a tool call (``Request.stop``); the environment's answer is then
appended to its response as tokens the model did not generate, and it resumes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from reflow.config.job_config import RolloutSection
from reflow.distributed.host_memory import release_host_cache
from reflow.model.recipe import Recipe
from reflow.process_lifetime import freeze_startup_objects
from reflow.rollout.kv_signals import EngineSignalReader, EngineSignals
from reflow.rollout.request import Request
from reflow.rollout.tensor_parallel import EngineMirror
from reflow.rollout.vendor_logs import quiet_vendor_logs

logger = logging.getLogger("reflow")


def set_vllm_env(rollout: RolloutSection) -> None:
    """vLLM reads these at import/engine build time (``rollout``: the run's [rollout] section)."""
    # the engine core must run in this process: the step API and the lazy weight iterator depend on it
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(rollout.kv_cache_gib)))))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["VLLM_CACHE_ROOT"] = vllm_cache_root(os.environ, int(os.environ.get("RANK", "0")))


def vllm_cache_root(env, rank: int) -> str:
    """A vLLM cache root per global rank. Each rank's engine is its own rank 0, so vLLM's compile cache
    (``<root>/torch_compile_cache/<hash>/rank_0_0``) would be one folder that every rank of a node writes at
    once. The base is the user's ``VLLM_CACHE_ROOT`` (else vLLM's default, ``$XDG_CACHE_HOME/vllm``), kept in
    ``REFLOW_VLLM_CACHE_BASE`` so that a second call does not nest."""
    base = env.get("REFLOW_VLLM_CACHE_BASE") or env.get("VLLM_CACHE_ROOT") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm"
    )
    env["REFLOW_VLLM_CACHE_BASE"] = base
    return os.path.join(base, f"rank{rank}")


def padding_stops(tokenizer) -> list[int]:
    """[the padding token's id] when the tokenizer has one that is not its EOS, else [].

    A model may sample its padding token: the tiny model does in about 1 of 1,200 tokens (its output row is
    trained, its embedding row never is: padded positions carry no loss, so that row stays exactly zero). Fed
    back as an input, a zero embedding reaches the first RMSNorm as a zero vector, whose gradient is
    1 / sqrt(eps), about 1000 times a normal one: the gradient-norm spike of every tiny run's second update
    (620 on the default). Ending the sample there, as an EOS would, keeps the sampling distribution exact (the
    trainer's log-probs need no mask) and never feeds the padding token back. Qwen3's padding token is an EOS
    already (``<|endoftext|>``)."""
    pad, eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
    return [pad] if pad is not None and pad != eos else []


@dataclass(frozen=True)
class AdapterSlots:
    """A LoRA run's engine settings: the adapters' rank, and how many versions it keeps loaded at once (the
    newest and the ones before it that a trainable trajectory may still be on: the mode's bound on a sample's
    oldest token, ``max_head_lag`` or delta)."""

    rank: int
    versions: int


class RolloutEngine:
    """The embedded vLLM engine as an ``Engine`` (``reflow.rollout.protocols``)."""

    decode_steps = 1
    """Decode steps one ``step`` runs."""
    sampled_tokens = 0
    """(``Engine.sampled_tokens``) counted in ``step``."""

    def __init__(
        self, rollout: RolloutSection, recipe: Recipe, hf_dir: str, seed: int, *, keeps_weight_backup: bool = False,
        adapters: "AdapterSlots | None" = None,
    ):
        """``rollout``: the run's [rollout] section. ``keeps_weight_backup``: this engine sleeps at level 1 again
        and again (sync mode with a sync every few steps), so its pinned weight
        backup is worth keeping cached between sleeps; elsewhere a wake releases it. ``adapters``: a LoRA run's
        adapter versions (``AdapterSlots``): the engine serves the base with one LoRA adapter per policy
        version, and each request keeps the version it started on (``load_adapter``)."""
        set_vllm_env(rollout)
        quiet_vendor_logs()  # before vLLM's import, whose dependencies speak as it loads
        from vllm import LLM

        r = rollout
        on_gpu = torch.cuda.is_available()
        kwargs = dict(
            model=hf_dir,
            dtype=recipe.vllm.dtype if on_gpu else "float32",
            max_model_len=r.max_model_len,
            max_num_seqs=r.max_num_seqs,
            enforce_eager=True if not on_gpu else r.enforce_eager,
            seed=seed,
            logprobs_mode="processed_logprobs",
            tensor_parallel_size=r.tensor_parallel_degree,
        )
        if r.tensor_parallel_degree > 1:
            # one engine over an aligned block of ranks, each running its copy of the scheduler
            # (reflow.rollout.tensor_parallel keeps the copies in step)
            kwargs["distributed_executor_backend"] = "external_launcher"
        if on_gpu:
            kwargs["gpu_memory_utilization"] = r.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = True
        else:
            # Per-request seeds make a sample a function of its request (prompt, seed, prefix), whatever else the
            # engine ran before or beside it: what an exact resume needs. vLLM 0.32's CPU runner cannot rewind a
            # seeded generator after a chunked prefill step ("CPU Generator does not use offset"), so on CPU a
            # prefill is never chunked: a request waits until its whole prompt fits a step's token budget (the
            # CPU default, 4096 tokens, or max_model_len if larger).
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(4096, r.max_model_len)
        if r.kv_block_size > 0:
            kwargs["block_size"] = r.kv_block_size
        if r.num_kv_blocks > 0:
            kwargs["num_gpu_blocks_override"] = r.num_kv_blocks
        if adapters is not None:
            # every version a request may still be on, in one batch: the newest and the delta before it
            # (one more than the bound: a trajectory past it still finishes, on its own version)
            kwargs.update(enable_lora=True, max_lora_rank=adapters.rank, max_loras=adapters.versions + 1,
                          max_cpu_loras=adapters.versions + 2)
        quiet_vendor_logs()  # (after vLLM's import set up its handlers)
        freeze_startup_objects()  # vLLM's build collects five times (reflow.process_lifetime)
        t0 = time.time()
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        self.build_time_s = time.time() - t0
        self.signal_reader = EngineSignalReader(self.llm)
        self.signals: EngineSignals = self.signal_reader.read()
        """KV usage, request counts and preemptions after the latest step (``reflow.rollout.kv_signals``)."""
        self.block_size = self.signal_reader.block_size
        self.stop_token_ids = padding_stops(self.llm.get_tokenizer())
        """Token ids that end a sample besides the model's EOS: the padding token, where it is not an EOS."""
        self.rollout = rollout
        self.keeps_weight_backup = keeps_weight_backup
        self.version = 0
        self.adapters = adapters
        self.loaded: dict[int, object] = {0: None}
        """A LoRA run's adapter versions in the engine: each one's vLLM ``LoRARequest``, or None for version 0
        served as the base (exactly the policy when the adapters start at B = 0; a run that starts from an
        adapter folder loads it as version 0)."""
        self.asleep: set[str] = set()
        """vLLM's memory tags ("weights", "kv_cache") not mapped on the device now (CUDA; always empty on CPU)."""
        self.weights_discarded = False
        """Asleep at level 2: the device holds no weights until ``load_weights`` brings new ones."""
        self.active: dict[str, Request] = {}  # vLLM request id -> request
        self._submissions = 0
        self.mirror: EngineMirror | None = None
        """Set while this rank leads a tensor-parallel engine that generates: its calls are replayed by the
        block's other ranks (``reflow.rollout.tensor_parallel``)."""

    # ---- request/step API -------------------------------------------------

    def _params(self, req: Request):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        r = self.rollout
        return SamplingParams(
            temperature=r.temperature if req.temperature is None else req.temperature,
            top_p=r.top_p if req.top_p is None else req.top_p,
            max_tokens=req.generation_limit - len(req.output_ids),
            logprobs=0,
            # the request's own seed, advanced by the tokens it has: a held partial rollout resumes with a fresh
            # but reproducible stream
            seed=req.seed + len(req.output_ids),
            detokenize=bool(req.stop),  # vLLM matches stop strings on the detokenized text
            stop=list(req.stop) or None,
            include_stop_str_in_output=True,
            ignore_eos=req.ignore_eos,
            stop_token_ids=self.stop_token_ids or None,
            output_kind=RequestOutputKind.DELTA,
        )

    def add(self, req: Request) -> None:
        """Queue a request. A request with output already (a held partial rollout) resumes from its prefix."""
        from vllm.inputs import TokensPrompt

        self.wake_up()
        if req.generation_limit - len(req.output_ids) <= 0:
            raise ValueError(f"request {req.request_id} has no tokens left to generate")
        if self.mirror is not None:
            self.mirror.record_add(req)
        # a fresh engine id per submission: a resumed request is a new vLLM request over prompt + prefix
        self._submissions += 1
        engine_id = f"{req.request_id}@{self._submissions}"
        prompt = TokensPrompt(prompt_token_ids=req.prompt_ids + req.output_ids)
        if self.adapters is None:
            self.engine.add_request(engine_id, prompt, self._params(req))
        else:  # the adapter it started on, to its end (a resubmitted request keeps it)
            if req.adapter_version is None or req.adapter_version not in self.loaded:
                # new; or its version is gone (held past the versions kept, when its head is too old to train, or
                # handed over from another engine at a placement change): on under the newest from here, each
                # token labelled with the version that samples it, as under full-weight syncs
                req.adapter_version = self.version
            self.engine.add_request(engine_id, prompt, self._params(req),
                                    lora_request=self.loaded[req.adapter_version])
        self.active[engine_id] = req

    @property
    def num_active(self) -> int:
        return len(self.active)

    def resume(self, held: Iterable[Request]) -> None:
        """Held partial rollouts back in: each prefilled again over its prompt and prefix."""
        for req in held:
            self.add(req)

    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it."""
        if self.mirror is not None:
            self.mirror.publish("step")
        finished = []
        for out in self.engine.step():
            req = self.active.get(out.request_id)
            if req is None:
                continue
            comp = out.outputs[0]  # DELTA output: only the tokens generated in this step
            lps = comp.logprobs or []
            tokens = list(comp.token_ids)
            self.sampled_tokens += len(tokens)
            version = self.version if req.adapter_version is None else req.adapter_version  # (the adapter that sampled)
            req.append_model_tokens(tokens, [float(lps[k][tok].logprob) for k, tok in enumerate(tokens)], version)
            if out.finished:
                req.finish_reason = comp.finish_reason
                req.stop_reason = comp.stop_reason
                del self.active[out.request_id]
                finished.append(req)
        self.signals = self.signal_reader.read()
        return finished

    def step_until_started(self) -> tuple[list[Request], list[int]]:
        """Step until every request in flight has at least one token; returns those that finished meanwhile and
        the sequences in flight at each step (one entry per engine step, for the worker's statistics).

        Called before a weight sync (one_step_off), so that a request's first token always comes from the
        weights it was admitted under: its birth version (the oldest of its tokens) is its admission version.
        Without KV pressure that is one step (the prefills of the newest requests); when the cache is full, a
        queued request starts only once running ones finish, and this runs until they have (on the
        rollout-bound bench, about a third of one_step_off's rollout time)."""
        finished: list[Request] = []
        sequences: list[int] = []
        while any(not req.output_ids for req in self.active.values()):
            sequences.append(self.num_active)
            finished.extend(self.step())
        return finished, sequences

    def hold_all(self) -> list[Request]:
        """Stop every in-flight request, keeping what it generated so far (tokens, log-probs, versions).

        Used where the engine must be empty: a placement change (the partial rollouts go to another engine) and
        a sync that evaluates; ``add`` the returned requests afterwards and they continue from their prefix
        (prefilled again, under whatever weights the engine has then); each token keeps the version that
        produced it. A plain weight sync holds nothing (``load_weights``)."""
        held = list(self.active.values())
        if self.mirror is not None:
            self.mirror.record_hold_all()
        if self.active:
            self.engine.abort_request(list(self.active))
            self.active.clear()
        return held

    def abort(self, request_id: str) -> "Request | None":
        """Stop request ``request_id`` alone, its KV freed and its tokens kept (an agent episode that failed or
        was dropped); returns it, or None if it was not in flight."""
        engine_ids = [engine_id for engine_id, active in self.active.items() if active.request_id == request_id]
        if not engine_ids:
            return None
        if self.mirror is not None:
            self.mirror.record_abort(request_id)
        self.engine.abort_request(engine_ids)
        return [self.active.pop(engine_id) for engine_id in engine_ids][0]

    def generate(self, requests: Iterable[Request]) -> list[Request]:
        """Run requests to completion (the synchronous path)."""
        for req in requests:
            self.add(req)
        done: list[Request] = []
        while self.active:
            done.extend(self.step())
        return done

    # ---- weights -------------------------------------------------------------

    @property
    def pins_versions(self) -> bool:
        """(``Engine.pins_versions``) A LoRA run's engine: a weight sync adds an adapter version and holds
        nothing (each request finishes on the adapter it started on)."""
        return self.adapters is not None

    def load_adapter(self, folder: str, version: int) -> float:
        """Serve ``version``'s adapter (a peft folder) to new requests; requests in flight keep theirs, their KV
        valid (vLLM keys cached blocks by adapter: none is shared across versions). Adapters no request uses
        and older than the versions kept (``AdapterSlots.versions``) are removed. Returns seconds taken."""
        from vllm.lora.request import LoRARequest

        t0 = time.time()
        request = LoRARequest(f"policy-v{version}", version + 1, folder)
        if not self.engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter of version {version} from {folder}")
        self.loaded[version] = request
        self.version = version
        in_use = {req.adapter_version for req in self.active.values()}
        for old in sorted(self.loaded):
            if old <= version - self.adapters.versions and old not in in_use:
                request = self.loaded.pop(old)
                if request is not None:
                    self.engine.remove_lora(request.lora_int_id)
        return time.time() - t0

    def holding_kv(self) -> list[Request]:
        """(``Engine.holding_kv``) The requests in flight whose KV the engine holds now (prefilled or decoding):
        the ones a reload preempts. A request still queued, never scheduled or preempted already, holds none."""
        holders = self.signal_reader.kv_holders()
        return [req for engine_id, req in self.active.items() if engine_id in holders]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Replace the engine's weights in place (HF names) with requests in flight; returns seconds taken.

        The requests stay in the engine (a partial rollout is not taken out and added again). Those holding KV
        (``holding_kv``) are preempted, their blocks freed, and go back to the head of vLLM's queue: scheduled
        again, each prefills its prompt and prefix under the new weights and decodes on, every token labelled
        with the version that sampled it. Requests still queued hold no KV and are untouched. Then the prefix
        cache is dropped: vLLM's reload_weights resets the LoRA, encoder and multimodal caches but not the
        prefix cache, and a later request whose prompt blocks are cached (a shared chat template or system
        prompt, the held-out prompts at every evaluation, a preempted request's own prompt and prefix) would
        decode over KV the old weights computed while its tokens are labelled with the new version. vLLM's
        reset preempts the running requests first (``reset_running_requests``), so every block is free and the
        reset cannot fail but loudly. Those preemptions are the reload's, not KV pressure: the signals leave
        them out."""
        t0 = time.time()
        if "weights" in self.asleep:
            # map the weights' memory only (empty after level 2; after level 1 the old weights, overwritten now) and
            # load into it: a sleeping engine's weights are not mapped, never load into them. The KV cache stays
            # asleep until the engine next runs (``add`` wakes it), by when a colocated trainer has parked its
            # state (at a resume, or a sync mode step) or a leaving one has freed it (a placement change)
            self.llm.wake_up(tags=["weights"])
            self.asleep.discard("weights")
            self.weights_discarded = False
            self._release_weight_backup()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        preemptions_before = self.signal_reader.held_preemptions()
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError(
                f"vLLM could not reset its prefix cache after loading version {version} (blocks still in use with "
                f"{len(self.active)} requests in flight); decoding would read KV of the old weights"
            )
        self.signal_reader.excuse_reload(self.signal_reader.held_preemptions() - preemptions_before)
        self.version = version
        return time.time() - t0

    @property
    def sleeping(self) -> bool:
        """Some of the engine's memory is not mapped (its KV cache at least): it must wake before it runs."""
        return bool(self.asleep)

    def sleep(self, discard_weights: bool = False) -> None:
        """Free accelerator memory while this rank trains (a no-op on CPU). Level 1 keeps the weights in pinned
        host memory, to wake with; ``discard_weights`` (level 2) drops them, for a caller that loads new ones
        before the engine runs again (a weight sync): no round trip of weights the reload overwrites.

        Tracked per tag: after a weights-only wake (``load_weights`` into a sleeping engine) the weights are
        mapped while the KV cache sleeps, and a sleep then puts the weights back to sleep (vLLM sleeps what is
        mapped): a rank that left the trainer, received weights and rejoins must not train beside them."""
        assert not self.active, "cannot sleep with requests in flight"
        if not torch.cuda.is_available():
            return
        if "weights" not in self.asleep:  # (the KV cache alone asleep: vLLM sleeps only what is mapped)
            self.llm.sleep(level=2 if discard_weights else 1)
            self.weights_discarded = discard_weights
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        if self.weights_discarded:
            raise RuntimeError("the engine slept without its weights (level 2): load_weights must come before it runs")
        if self.asleep:
            woke_weights = "weights" in self.asleep
            self.llm.wake_up()  # every tag still asleep
            if woke_weights:
                self._release_weight_backup()
        self.asleep = set()

    def _release_weight_backup(self) -> None:
        """After the weights woke: vLLM frees a level-1 sleep's pinned weight backup into PyTorch's host cache,
        which keeps it (16 GiB for an 8B engine, the start-up sleep's included) unless emptied. Emptied here
        unless this engine sleeps at level 1 again every step (``keeps_weight_backup``), where the next sleep
        would pin it anew; the trainer's parking buffers are held, not cached, so they stay."""
        if not self.keeps_weight_backup:
            release_host_cache()
