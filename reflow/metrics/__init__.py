from reflow.metrics.logger import MetricsLogger

__all__ = ["MetricsLogger"]
