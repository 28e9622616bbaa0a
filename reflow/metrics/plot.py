"""The benchmarks' and the simulator's charts, drawn with matplotlib: labelled axes with their values, bars with
their numbers on them, error bars where there are seeds."""

from __future__ import annotations


def figure(rows: int, cols: int, width: float, height: float):
    """A figure of ``rows`` x ``cols`` panels (an off-screen backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(width, height), constrained_layout=True, squeeze=False)
    return fig, axes


def grouped_bars(axis, groups: dict[str, dict[str, float]], title: str, ylabel: str,
                 errors: dict[str, dict[str, float]] | None = None, digits: int = 2) -> None:
    """Bars ``groups[group][series]`` side by side per group, each labelled with its value; ``errors`` (same
    keys): one standard deviation over seeds, as error bars."""
    import numpy as np

    names = list(groups)
    series = list(next(iter(groups.values()))) if groups else []
    width = 0.8 / max(len(series), 1)
    positions = np.arange(len(names))
    for k, label in enumerate(series):
        values = [groups[name][label] for name in names]
        yerr = [errors[name][label] for name in names] if errors else None
        bars = axis.bar(positions + (k - (len(series) - 1) / 2) * width, values, width, yerr=yerr, capsize=3, label=label)
        axis.bar_label(bars, labels=[f"{v:.{digits}f}" for v in values], fontsize=8, padding=2)
    axis.set_xticks(positions, names, rotation=15)
    axis.set_title(title)
    axis.set_ylabel(ylabel)
    axis.grid(axis="y", alpha=0.3)
    if len(series) > 1:
        axis.legend()


def save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
