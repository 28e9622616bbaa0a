"""Runs side by side: one figure of their curves, drawn with matplotlib (labelled axes, values, seeds as bands).

    python -m reflow.metrics.compare outputs/async outputs/reflow --out compare.png
    python -m reflow.metrics.compare async=runs/a_s0,runs/a_s1,runs/a_s2 reflow=runs/r_s0,runs/r_s1,runs/r_s2

Each argument is a run's dump folder (labelled by its name) or ``LABEL=DIR,DIR,...``, the seeds of one
configuration: their mean is the line and one standard deviation either side the band (evaluations: error
bars). The panels: training reward against steps and against training wall time (5-step moving averages),
held-out eval reward, tokens/s, trainer and rollout idle, the replayed share of each batch, the stalest sample
trained, and samples evicted unused; a dotted line marks each placement change.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass

MOVING_AVERAGE = 5
EVICTION_KEYS = ("evicted_arrived_stale", "evicted_aged", "evicted_at_sync")


@dataclass
class Series:
    """One configuration's curve: x values, and the mean and standard deviation over its seeds at each."""

    x: list[float]
    mean: list[float]
    std: list[float]


def read_run(folder: str) -> list[dict]:
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{folder}: no metrics.jsonl (is it a run's job.dump_folder?)")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _moving(values: list[float], width: int) -> list[float]:
    out = []
    for k in range(len(values)):
        window = [v for v in values[max(0, k - width + 1) : k + 1] if not math.isnan(v)]
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def step_curve(rows: list[dict], key: str, smooth: int = 1) -> dict[int, float]:
    """``key`` at each step of a run's step rows (``smooth``: a moving average over that many steps)."""
    steps = [row for row in rows if "loss" in row and key in row]
    values = _moving([float(row[key]) for row in steps], smooth)
    return {int(row["step"]): value for row, value in zip(steps, values)}


def derived(rows: list[dict]) -> list[dict]:
    """The step rows with the figures the panels draw that a row does not hold: training wall time so far, the
    replayed share of the batch, samples evicted."""
    out, wall = [], 0.0
    for row in rows:
        if "loss" not in row:
            continue
        wall += float(row.get("step_time_s", 0.0))
        fresh, replayed = row.get("fresh_samples"), row.get("replayed_samples")
        extra = {"wall_s": wall, "evicted": float(sum(row.get(key, 0) for key in EVICTION_KEYS))}
        if fresh is not None and replayed is not None and fresh + replayed > 0:
            extra["replay_fraction"] = replayed / (fresh + replayed)
        out.append({**row, **extra})
    return out


def combine(curves: list[dict[float, float]]) -> Series:
    """Seeds' curves on the x values they share: mean and (population) standard deviation."""
    shared = sorted(set.intersection(*(set(curve) for curve in curves))) if curves else []
    mean, std = [], []
    for x in shared:
        values = [curve[x] for curve in curves]
        mu = sum(values) / len(values)
        mean.append(mu)
        std.append(math.sqrt(sum((v - mu) ** 2 for v in values) / len(values)))
    return Series(list(shared), mean, std)


PANELS = (  # (title, y label, key, x: "step" or "wall_s", smoothing)
    ("training reward", "reward (5-step mean)", "reward_mean", "step", MOVING_AVERAGE),
    ("training reward against time", "reward (5-step mean)", "reward_mean", "wall_s", MOVING_AVERAGE),
    ("held-out eval reward", "eval reward", "eval_reward", "step", 1),
    ("throughput", "tokens / s", "tokens_per_s", "step", 1),
    ("trainer idle (solid), rollout idle (dashed)", "fraction of the step", "trainer_idle_ratio", "step", 1),
    ("replayed share of each batch", "replayed / batch", "replay_fraction", "step", 1),
    ("stalest sample trained", "policy versions behind", "staleness_max", "step", 1),
    ("samples evicted unused", "samples per step", "evicted", "step", 1),
)


def panel_series(groups: dict[str, list[list[dict]]], key: str, x: str, smooth: int) -> dict[str, Series]:
    """Per configuration, ``key`` against ``x`` (seeds combined); configurations that never log it are left out."""
    out = {}
    for label, runs in groups.items():
        curves = []
        for rows in runs:
            if key == "eval_reward":
                points = {float(r["step"]): float(r[key]) for r in rows if key in r}
            else:
                steps = derived(rows)
                by_step = step_curve(steps, key, smooth)
                xs = {int(r["step"]): float(r[x]) for r in steps}
                points = {xs[step]: value for step, value in by_step.items()}
            if points:
                curves.append(points)
        if curves:
            out[label] = combine(curves) if x == "step" else _align_by_rank(curves)
    return out


def _align_by_rank(curves: list[dict[float, float]]) -> Series:
    """Curves against wall time: seeds' times differ, so the k-th points are averaged (times too)."""
    ordered = [sorted(curve.items()) for curve in curves]
    length = min(len(points) for points in ordered)
    xs, mean, std = [], [], []
    for k in range(length):
        times = [points[k][0] for points in ordered]
        values = [points[k][1] for points in ordered]
        mu = sum(values) / len(values)
        xs.append(sum(times) / len(times))
        mean.append(mu)
        std.append(math.sqrt(sum((v - mu) ** 2 for v in values) / len(values)))
    return Series(xs, mean, std)


def transitions(groups: dict[str, list[list[dict]]]) -> dict[str, list[int]]:
    """The steps after which each configuration's first run changed placement."""
    return {label: [int(r["step"]) for r in runs[0] if "transition" in r] for label, runs in groups.items()}


def draw(groups: dict[str, list[list[dict]]], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(22, 9), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    changes = transitions(groups)
    for axis, (title, ylabel, key, x, smooth) in zip(axes.flat, PANELS):
        keys = [(key, "-")] + ([("rollout_idle_ratio", "--")] if key == "trainer_idle_ratio" else [])
        drawn = 0
        for key_k, style in keys:
            for k, (label, series) in enumerate(panel_series(groups, key_k, x, smooth).items()):
                drawn += 1
                color = colors[k % len(colors)]
                name = label if style == "-" else None
                if key_k == "eval_reward":
                    axis.errorbar(series.x, series.mean, yerr=series.std, color=color, marker="o", capsize=3, label=name)
                else:
                    axis.plot(series.x, series.mean, style, color=color, label=name)
                    if any(series.std):
                        low = [m - s for m, s in zip(series.mean, series.std)]
                        high = [m + s for m, s in zip(series.mean, series.std)]
                        axis.fill_between(series.x, low, high, color=color, alpha=0.2)
        if x == "step":
            for k, (label, steps) in enumerate(changes.items()):
                for step in steps:
                    axis.axvline(step, color=colors[k % len(colors)], linestyle=":", linewidth=1)
        if not drawn:
            axis.text(0.5, 0.5, f"{key}: not in these runs' metrics", ha="center", va="center", transform=axis.transAxes)
        axis.set_title(title)
        axis.set_xlabel("training wall time (s)" if x == "wall_s" else "step")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
    axes.flat[0].legend(title="run (mean ± 1 sd over seeds)")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def parse_groups(arguments: list[str]) -> dict[str, list[list[dict]]]:
    groups: dict[str, list[list[dict]]] = {}
    for argument in arguments:
        if "=" in argument:
            label, folders = argument.split("=", 1)
            groups[label] = [read_run(folder) for folder in folders.split(",") if folder]
        else:
            groups[os.path.basename(os.path.normpath(argument))] = [read_run(argument)]
    return groups


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m reflow.metrics.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="DUMP_FOLDER, or LABEL=DIR,DIR,... for the seeds of one configuration")
    parser.add_argument("--out", default="compare.png")
    args = parser.parse_args(argv)
    try:
        out = draw(parse_groups(args.runs), args.out)
    except (FileNotFoundError, ValueError) as error:
        print(f"reflow.metrics.compare: {error}", file=sys.stderr)
        return 2
    print(f"reflow.metrics.compare: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
