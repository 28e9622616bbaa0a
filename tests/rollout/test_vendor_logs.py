"""vLLM's known noise is hidden by name, on vLLM's handler as vLLM configures it again for every engine, and
nothing else is: a warning that matters still shows."""

import copy
import logging
from logging.config import dictConfig

from reflow.rollout.vendor_logs import KNOWN_NOISE, KnownNoise, quiet_vendor_logs


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("vllm.v1.worker.cpu_worker", logging.WARNING, __file__, 1, message, None, None)


def test_known_noise_is_dropped_and_everything_else_kept():
    noise = KnownNoise()
    for text, why in KNOWN_NOISE:
        assert why and not noise.filter(_record(f"prefix {text} suffix")), text
    assert noise.filter(_record("KV cache is full: preempting 3 requests"))


def test_vllm_configures_its_handler_with_the_filter(monkeypatch, capsys):
    monkeypatch.delenv("REFLOW_VENDOR_LOGS", raising=False)
    quiet_vendor_logs()
    import vllm.logger as vllm_logger

    config = copy.deepcopy(vllm_logger.DEFAULT_LOGGING_CONFIG)  # what vLLM applies when an engine is built
    config["handlers"]["vllm"]["stream"] = "ext://sys.stderr"
    vllm_root = logging.getLogger("vllm")
    previous = vllm_root.handlers[:], vllm_root.level
    try:
        dictConfig(config)
        log = logging.getLogger("vllm.v1.worker.cpu_worker")
        log.warning("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
        log.warning("a warning that matters")
        said = capsys.readouterr().err
        assert "torch.set_num_threads" not in said and "a warning that matters" in said, said
    finally:
        vllm_root.handlers, level = previous
        vllm_root.setLevel(level)
