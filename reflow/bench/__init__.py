"""Benchmarks (JSON out, never timed tests): ``python -m reflow.bench modes`` compares the training modes,
``python -m reflow.bench resize`` the trainer replica resize with a cold restart."""
