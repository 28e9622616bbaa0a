"""Benchmarks (JSON out, never timed tests). ``python -m reflow.bench modes`` compares the training modes."""
