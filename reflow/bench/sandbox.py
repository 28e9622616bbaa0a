"""The sandbox's cost per call, with the kernel boundary and without it, side by side in one run.

    python -m reflow.bench sandbox [--calls 100] [--threads 8] [--out outputs/bench/sandbox.json]

Three programs of the kind the tasks run (a ReTool calculation, a coding test reading stdin, a program that
fails), each called ``--calls`` times, one call at a time and then from ``--threads`` threads at once (the
rollout worker's ``task.tool_workers``), under:

  kernel        the default: bubblewrap's namespaces, seccomp, limits, the audit hook
  kernel_no_hook  the same without the audit hook (what the hook costs)
  unisolated    limits and the audit hook only (task.sandbox_allow_unisolated: no kernel boundary)

Per configuration and mode: ``calls_per_s``, ``p50_s``, ``p99_s``; and the kernel boundary's overhead per call
against ``unisolated`` (p50 and calls/s ratios). Without bubblewrap the kernel rows are left out, with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

PROGRAMS = {
    "retool": ("import math\nprint(sum(math.comb(20, k) for k in range(0, 21, 2)) % 1000)", ""),
    "coding_test": ("n = int(input())\nprint(' '.join(str(k * k) for k in range(n)))", "12\n"),
    "failing": ("def f(x):\n    return 1 / x\nprint(f(0))", ""),
}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def measure(sandbox, calls: int, threads: int) -> dict:
    """``calls`` calls of every program, in order, ``threads`` at a time."""
    jobs = [program for program in PROGRAMS.values() for _ in range(calls)]

    def one(job):
        code, stdin = job
        t0 = time.perf_counter()
        result = sandbox.run(code, stdin)
        return time.perf_counter() - t0, result.status

    sandbox.run("print('warm')")  # the interpreter's files into the page cache
    t0 = time.perf_counter()
    if threads == 1:
        outcomes = [one(job) for job in jobs]
    else:
        with ThreadPoolExecutor(threads) as pool:
            outcomes = list(pool.map(one, jobs))
    elapsed = time.perf_counter() - t0
    latencies = [seconds for seconds, _ in outcomes]
    statuses = sorted({status for _, status in outcomes})
    return {
        "calls": len(jobs), "threads": threads, "calls_per_s": len(jobs) / elapsed,
        "p50_s": statistics.median(latencies), "p99_s": _percentile(latencies, 0.99), "statuses": statuses,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m reflow.bench sandbox", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["sandbox"])
    ap.add_argument("--calls", type=int, default=100, help="calls of each program per configuration and mode")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--out", default="outputs/bench/sandbox.json")
    args = ap.parse_args(argv)
    from reflow.envs.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

    limits = SandboxLimits()
    configurations = {}
    skipped = {}
    try:
        configurations["kernel"] = Sandbox(limits)
        configurations["kernel_no_hook"] = Sandbox(limits, audit_hook=False)
    except SandboxUnavailable as error:
        skipped["kernel"] = str(error)
    configurations["unisolated"] = Sandbox(limits, allow_unisolated=True, python=sys.executable, kernel=False)
    rows = {}
    for name, sandbox in configurations.items():
        rows[name] = {
            "isolation": sandbox.isolation, "interpreter": sandbox.python,
            "sequential": measure(sandbox, args.calls, 1), "concurrent": measure(sandbox, args.calls, args.threads),
        }
        for mode in ("sequential", "concurrent"):
            row = rows[name][mode]
            print(f"{name:15s} {mode:10s} {row['calls_per_s']:7.1f} calls/s  p50 {row['p50_s'] * 1000:6.1f} ms  "
                  f"p99 {row['p99_s'] * 1000:6.1f} ms  {row['statuses']}")
    result = {
        "benchmark": "sandbox",
        "command": " ".join(["python -m reflow.bench sandbox", *argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "limits": dataclasses.asdict(limits),
        "programs": {name: code for name, (code, _) in PROGRAMS.items()},
        "configurations": rows,
        "skipped": skipped,
    }
    # the headline keys: the default configuration's
    default = rows.get("kernel") or rows["unisolated"]
    result["calls_per_s"] = default["sequential"]["calls_per_s"]
    result["p99_s"] = default["sequential"]["p99_s"]
    if "kernel" in rows:
        result["kernel_overhead"] = {
            mode: {
                "p50_s_added": rows["kernel"][mode]["p50_s"] - rows["unisolated"][mode]["p50_s"],
                "calls_per_s_ratio": rows["kernel"][mode]["calls_per_s"] / rows["unisolated"][mode]["calls_per_s"],
            }
            for mode in ("sequential", "concurrent")
        }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"[bench] wrote {args.out}")
    return 0

