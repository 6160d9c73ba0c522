"""Timing, memory and machine helpers shared by the benchmarks.

Every timing is the min and median over ``repeats`` calls after one warm-up call (which also
compiles), each call ending with ``jax.block_until_ready``. Implementations that are compared
are timed round-robin (``timeit_interleaved``), so that machine drift hits them alike. Peak
memory is measured in a fresh subprocess per case (``peak_rss_growth``): the resident set size
is sampled every millisecond by a thread while the function runs (after compilation, before
any call: JAX's and torch's allocators keep freed memory, so later calls would show no growth),
and the peak minus the size just before is reported. The process's maximum RSS
(``ru_maxrss``) cannot show this: importing torch and compiling already set a higher peak than
one call adds. For JAX the sizes of XLA's own buffer assignment (``compiled.memory_analysis()``:
arguments, outputs, temporaries) are given too; they are exact where RSS is an estimate."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine() -> dict[str, Any]:
    """CPU model, cores, load average and library versions, for the results."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    info = {
        "cpu": model,
        "cores": cores(),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "xla_threads": cores(),  # XLA:CPU's intra-op pool: one thread per core
    }
    torch = maybe_torch()
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    return info


def maybe_torch():
    """torch if importable (the optional ``bench`` extra), else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def block(x):
    """Wait for JAX arrays (and pass torch tensors through: torch CPU ops are synchronous)."""
    leaves = jax.tree.leaves(x)
    return jax.block_until_ready(x) if any(hasattr(a, "block_until_ready") for a in leaves) else x


def timeit(fn: Callable, *args, repeats: int = 3) -> dict[str, float]:
    """min and median seconds of ``fn(*args)`` over ``repeats`` calls after one warm-up."""
    block(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        block(fn(*args))
        times.append(time.perf_counter() - start)
    times.sort()
    return {"min_s": times[0], "median_s": times[len(times) // 2], "repeats": repeats}


def round_orders(n: int, rounds: int) -> list[list[int]]:
    """The order of ``n`` functions in each of ``rounds`` rounds: rows of a Williams design.

    Row r is 0, 1, n-1, 2, n-2, ... plus r (mod n). For even n, n rows put every function in
    every position once and right after every other function once; for odd n the rows are
    followed by their mirror images (round 2k: row k, round 2k+1: row k reversed), and 2n rounds
    put every function right after every other twice. With fewer rounds no function follows
    the same one twice (even n; odd n: at most twice)."""
    base, low, high = [0], 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    rows = [[(x + r) % n for x in base] for r in range(n)]
    if n % 2 == 0:
        return [rows[k % n] for k in range(rounds)]
    return [rows[(k // 2) % n][:: 1 if k % 2 == 0 else -1] for k in range(rounds)]


def timeit_interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int = 3
) -> dict[str, dict[str, float]]:
    """min and median seconds of every ``fn()``, timed round-robin: one warm-up call each,
    then ``repeats`` rounds that call every function once, in the orders of ``round_orders``.
    A ratio between two of them then compares calls made under the same machine conditions
    (on a shared 2-core machine, back-to-back blocks of repeats drifted by up to 10 %,
    measured), and no function is timed after the same predecessor every round (the call
    right after the baseline ran up to 15 % slower on our machine, whichever it was). With
    ``repeats`` >= the number of functions (twice it when odd) every function follows every
    other equally often; with fewer, the min over repeats still sees different predecessors."""
    for fn in fns.values():
        block(fn())
    names = list(fns)
    times = {name: [] for name in names}
    for order in round_orders(len(names), repeats):
        for i in order:
            start = time.perf_counter()
            block(fns[names[i]]())
            times[names[i]].append(time.perf_counter() - start)
    out = {}
    for name, ts in times.items():
        ts.sort()
        out[name] = {"min_s": ts[0], "median_s": ts[len(ts) // 2], "repeats": repeats}
    return out


def ratio(num: dict[str, float] | None, den: dict[str, float] | None) -> dict[str, float] | None:
    """num / den of min and median times (None when either is missing)."""
    if not num or not den:
        return None
    return {k: num[k] / den[k] for k in ("min_s", "median_s")}


def rss_bytes() -> int:
    """The process's current resident set size (Linux: /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_growth(fn: Callable[[], Any], min_seconds: float = 0.2) -> int:
    """Peak resident set size while ``fn()`` runs (repeated for at least ``min_seconds``, so that
    short calls are sampled too) minus the size just before, in bytes. Call it after
    compilation but before the first call: allocators keep the memory they freed, so a call
    after the first shows (almost) no growth."""
    baseline = rss_bytes()
    peak = [baseline]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(1e-3)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    try:
        while True:
            block(fn())
            if time.perf_counter() - start >= min_seconds:
                break
    finally:
        done.set()
        thread.join()
    return max(peak[0], rss_bytes()) - baseline


def xla_memory(compiled) -> dict[str, int] | None:
    """Argument, output and temporary bytes of XLA's buffer assignment for a compiled call."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
    }


def run_child(module: str, case: dict[str, Any], timeout: int = 600) -> dict[str, Any]:
    """Run ``python -m module --child JSON`` in a fresh process; its last stdout line is JSON."""
    cmd = [sys.executable, "-m", module, "--child", json.dumps(case)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt_time(t: dict[str, float] | None) -> str:
    if not t:
        return "-"
    return f"{t['min_s'] * 1e3:.1f} / {t['median_s'] * 1e3:.1f}"


def fmt_ratio(r: dict[str, float] | None) -> str:
    if not r:
        return "-"
    return f"{r['min_s']:.2f} / {r['median_s']:.2f}"


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    """A plain fixed-width table."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n## {title}")
    for i, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
