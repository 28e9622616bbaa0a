"""vLLM's and its dependencies' notices that say nothing to a ReFlow user, hidden by name; everything else stays.

A 4-step tiny run printed 36 vendor lines before its first step, most of them about choices ReFlow makes on
purpose (the engine runs in the rank's process with per-request seeds; a CPU build has no Triton). Each entry
below is a notice and why it is noise here. ``REFLOW_VENDOR_LOGS=all`` shows them all again.
"""

from __future__ import annotations

import logging
import os
import warnings

KNOWN_NOISE: tuple[tuple[str, str], ...] = (
    ("RotaryEmbedding", "every in-place reload: its cos/sin cache is derived, not a checkpoint tensor"),
    ("CPU backend doesn't allow to use `torch.set_num_threads`", "ReFlow sets each rank's threads itself"),
    ("Model Runner V2 requires Triton", "a CPU build: the V1 runner is the one that runs"),
    ("Passing raw prompts to InputProcessor is deprecated", "vLLM's own LLM.generate path, not ReFlow's API use"),
    ("is not found in LD_PRELOAD", "tcmalloc and libiomp speed up vLLM's CPU build; a GPU run never reads it"),
    ("Reset SSM cache type to float32", "no SSM layer in Qwen3"),
    ("Inductor compilation was disabled by user settings", "rollout.enforce_eager, asked for"),
    ("Enforce eager set, disabling torch.compile", "rollout.enforce_eager, asked for"),
    ("Triton is not installed", "a CPU build"),
    ("Triton is installed, but doesn't include CPU backend", "a CPU build"),
    ("Triton is installed but 0 active driver", "a CPU build"),
    ("Triton not installed or not compatible", "a CPU build"),
    ("does not officially support disabling chunked prefill", "disabled on purpose on CPU: seeded requests "
     "need whole-prompt prefills there (reflow.rollout.engine)"),
    ("The global random seed is set to", "the engine is in the rank's process on purpose; samples carry their own seeds"),
)
"""(text a notice contains, why it is noise in a ReFlow run)."""


class KnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text, _ in KNOWN_NOISE)


_FILTER = KnownNoise()


def quiet_vendor_logs() -> None:
    """Hide ``KNOWN_NOISE`` (idempotent): on the root logger's handlers (what vLLM's dependencies say while it
    imports), on vLLM's handler now, and in vLLM's default logging config, which it applies again whenever an
    engine is built (``dictConfig`` replaces the handlers); and the deprecation warning vLLM's own code triggers."""
    if os.environ.get("REFLOW_VENDOR_LOGS") == "all":
        return
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.*is deprecated", category=FutureWarning)
    for handler in logging.getLogger().handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
    try:
        import vllm.logger as vllm_logger
    except ImportError:
        return
    config = vllm_logger.DEFAULT_LOGGING_CONFIG
    config.setdefault("filters", {})["reflow_known_noise"] = {"()": f"{__name__}.KnownNoise"}
    handler_config = config["handlers"]["vllm"]
    if "reflow_known_noise" not in handler_config.setdefault("filters", []):
        handler_config["filters"].append("reflow_known_noise")
    for handler in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, KnownNoise) for f in handler.filters):
            handler.addFilter(_FILTER)
