r"""Memory soak: train with periodic evaluation for a fixed wall time, sampling resident memory.

    nice -n 10 python -m experiments.soak  # 32 min; --report=1 redoes session 1's summary

Trains a recipe (default: the quickstart, ViT-mu/8 + LieRE on spatial_arrows/c8_g8, with a
schedule too long to finish) in this process, evaluating every ``--eval_every`` steps. A thread
reads this process's resident memory (``VmRSS`` in /proc/self/status) every ``--every``
seconds and appends it to ``OUT/rss.csv`` as it goes (session, elapsed_s, step, rss_mib, and in
CSVs started since the heap columns exist, glibc's heap bytes in use and held: a leak raises
the first, allocator retention only the second). At
the deadline it sends this process SIGTERM: the training loop checkpoints the step it is on
and returns (its preemption path), so rerunning the same command resumes the training in
``--workdir`` and appends a new session to the CSV.

At the end it prints, for this session: the RSS after the warm-up (``--warmup_minutes``:
compilation and the first evaluations) and at the end, while training and at the evaluation
peaks, and least-squares slopes after warm-up in MiB per hour (``summarise``); it writes them
to ``OUT/session<k>.json`` and plots ``OUT/session<k>.png`` when matplotlib is installed
(``--report=k`` redoes this for session k). A flat memory profile is a slope whose size
over a day (slope x 24 h) is small against the RSS.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import importlib
import json
import os
import signal
import threading
import time

import numpy as np

from rope_lie import job, metrics, train

MIB = 1024 * 1024


def rss_mib() -> float:
    """This process's resident set size in MiB (VmRSS of /proc/self/status; Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB
    raise OSError("no VmRSS line in /proc/self/status (not Linux?)")


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33, <malloc.h>
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
        "keepcost".split()
    ]


def heap_mib() -> tuple[float, float]:
    """(bytes in use, bytes held) of the C heap in MiB, from glibc's ``mallinfo2``: in use is
    what live allocations hold, held adds the free memory kept in the arenas (a leak grows
    the first; fragmentation or retention only the second). (nan, nan) without glibc 2.33."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return float("nan"), float("nan")
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    in_use = info.uordblks + info.hblkhd  # arena chunks in use + mmapped chunks
    return in_use / MIB, (info.arena + info.hblkhd) / MIB


def last_step(workdir: str) -> int:
    """The step of the last line of workdir/metrics.jsonl (0 before the first one)."""
    path = os.path.join(workdir, metrics.JSONL_NAME)
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - 8192))
        lines = f.read().decode(errors="replace").strip().splitlines()
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue  # a partial line at the start of the window
    return 0


class Sampler(threading.Thread):
    """Appends (session, elapsed_s, step, rss_mib) to `csv_path` every `every` seconds and
    sends this process SIGTERM once `seconds` have passed."""

    def __init__(self, csv_path: str, workdir: str, session: int, every: float, seconds: float):
        super().__init__(daemon=True)
        self.csv_path, self.workdir, self.session = csv_path, workdir, session
        self.every, self.seconds = every, seconds
        with open(csv_path) as f:  # files of the first sessions have no heap columns
            self.heap = "heap_in_use_mib" in f.readline()
        self.start_time = time.monotonic()
        self.done = threading.Event()

    def sample(self) -> None:
        row = [self.session, round(time.monotonic() - self.start_time, 1)]
        row += [last_step(self.workdir), round(rss_mib(), 1)]
        if self.heap:
            row += [round(x, 1) for x in heap_mib()]
        with open(self.csv_path, "a", newline="") as f:
            csv.writer(f).writerow(row)

    def run(self) -> None:
        signalled = False
        while not self.done.wait(self.every):
            self.sample()
            if not signalled and time.monotonic() - self.start_time >= self.seconds:
                os.kill(os.getpid(), signal.SIGTERM)  # the loop saves and returns
                signalled = True


def read_session(csv_path: str, session: int) -> np.ndarray:
    """(elapsed_s, step, rss_mib) rows of one session."""
    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if int(r["session"]) == session]
    return np.array([[float(r["elapsed_s"]), int(r["step"]), float(r["rss_mib"])] for r in rows])


def read_heap(csv_path: str, session: int) -> np.ndarray | None:
    """(elapsed_s, heap_in_use_mib, heap_held_mib) rows of one session; None without them."""
    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if int(r["session"]) == session]
    if not rows or not rows[0].get("heap_in_use_mib"):
        return None
    keys = ("elapsed_s", "heap_in_use_mib", "heap_held_mib")
    return np.array([[float(r[k]) for k in keys] for r in rows])


def heap_summary(heap: np.ndarray, warmup_s: float) -> dict:
    """C-heap bytes in use and held after warm-up: first and last values, least-squares slopes."""
    t, in_use, held = heap[heap[:, 0] >= warmup_s].T
    per_hour = lambda y: round(float(np.polyfit(t, y, 1)[0] * 3600), 1)
    return {
        "heap_in_use_after_warmup_mib": round(float(in_use[0]), 1),
        "heap_in_use_end_mib": round(float(in_use[-1]), 1),
        "heap_in_use_slope_mib_per_hour": per_hour(in_use),
        "heap_held_after_warmup_mib": round(float(held[0]), 1),
        "heap_held_end_mib": round(float(held[-1]), 1),
        "heap_held_slope_mib_per_hour": per_hour(held),
    }


def summarise(rows: np.ndarray, warmup_s: float, eval_every: int, evals: list[int]) -> dict:
    """Resident memory after warm-up and at the end, and its least-squares slopes after warm-up.

    Each interval of `eval_every` steps trains and then evaluates, so the 10th percentile of its
    samples is the training level and the 90th the evaluation peak (percentiles: a single
    sample can dip or spike); "after warm-up" and "end" are those of the first and last whole
    intervals after warm-up, and the slopes are fitted to every sample, to the lows and to the
    peaks, and to the second half of the lows and peaks (is a rise levelling off?). The last
    sample is taken after the run returned (its checkpoint manager and writers
    closed).
    """
    t, step, rss = rows.T
    after = t >= warmup_s
    per_hour = lambda x, y: round(float(np.polyfit(x, y, 1)[0] * 3600), 1)
    interval = step[after] // eval_every
    lows, peaks = [], []  # (mean time, percentile) of each whole interval
    for k in np.unique(interval)[1:-1]:  # the first and last are cut by warm-up and deadline
        t_k, rss_k = t[after][interval == k], rss[after][interval == k]
        lows.append((t_k.mean(), np.percentile(rss_k, 10)))
        peaks.append((t_k.mean(), np.percentile(rss_k, 90)))
    if len(lows) < 4:
        raise ValueError(f"{len(lows)} whole evaluation intervals after warm-up; run longer")
    lows, peaks = np.array(lows), np.array(peaks)
    mib = lambda x: round(float(x), 1)
    return {
        "duration_min": round(float(t[-1]) / 60, 1),
        "samples": len(t),
        "steps": [int(step[0]), int(step[-1])],
        "evaluations": len(evals),
        "warmup_min": round(warmup_s / 60, 1),
        "whole_intervals_after_warmup": len(lows),
        "rss_after_warmup_mib": mib(lows[0, 1]),
        "rss_end_mib": mib(lows[-1, 1]),
        "rss_after_run_mib": mib(rss[-1]),
        "eval_peak_after_warmup_mib": mib(peaks[0, 1]),
        "eval_peak_end_mib": mib(peaks[-1, 1]),
        "rss_max_mib": mib(rss.max()),
        "slope_mib_per_hour": per_hour(t[after], rss[after]),
        "low_slope_mib_per_hour": per_hour(*lows.T),
        "peak_slope_mib_per_hour": per_hour(*peaks.T),
        "low_slope_second_half_mib_per_hour": per_hour(*lows[len(lows) // 2 :].T),
        "peak_slope_second_half_mib_per_hour": per_hour(*peaks[len(peaks) // 2 :].T),
        "interval_lows_mib": [mib(r) for r in lows[:, 1]],
        "interval_peaks_mib": [mib(r) for r in peaks[:, 1]],
    }


def plot(rows: np.ndarray, warmup_s: float, evals_at_s: list[float], path: str) -> bool:
    """RSS against time with the warm-up and the evaluations marked; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t, _, rss = rows.T
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(t / 60, rss, lw=1, label="RSS")
    ax.axvline(warmup_s / 60, color="grey", ls="--", lw=1, label="end of warm-up")
    for i, s in enumerate(evals_at_s):
        ax.axvline(
            s / 60, color="tab:orange", lw=0.5, alpha=0.5, label="evaluation ends" * (i == 0)
        )
    ax.set_xlabel("minutes")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_ylim(0, rss.max() * 1.1)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def eval_steps(workdir: str, first: int, last: int) -> list[int]:
    """Steps in (first, last] at which metrics.jsonl records an evaluation."""
    records = metrics.read_jsonl(os.path.join(workdir, metrics.JSONL_NAME))
    return [
        r["step"]
        for r in records
        if first < r["step"] <= last and any(k.endswith("/accuracy") for k in r)
    ]


def report(out: str, workdir: str, session: int, warmup_s: float, eval_every: int) -> dict:
    """Summary of one session from OUT/rss.csv and the workdir's metrics, printed and written to
    OUT/session<k>.json and OUT/session<k>.png."""
    rows = read_session(os.path.join(out, "rss.csv"), session)
    evals = eval_steps(workdir, int(rows[0, 1]), int(rows[-1, 1]))
    summary = {"session": session, **summarise(rows, warmup_s, eval_every, evals)}
    heap = read_heap(os.path.join(out, "rss.csv"), session)
    if heap is not None:
        summary.update(heap_summary(heap, warmup_s))
    with open(os.path.join(out, f"session{session}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    evals_at_s = [float(rows[np.argmax(rows[:, 1] >= s), 0]) for s in evals]
    png = os.path.join(out, f"session{session}.png")
    plotted = plot(rows, warmup_s, evals_at_s, png)
    for key, value in summary.items():
        print(f"{key:>36}  {value}")
    print(f"{'plot':>36}  {png if plotted else 'no matplotlib'}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="quickstart", help="configs/<name>.py[:arg]")
    parser.add_argument("--workdir", default="workdirs/soak")
    parser.add_argument("--out", default="experiments/soak")
    parser.add_argument("--minutes", type=float, default=32.0, help="wall time of this session")
    parser.add_argument("--warmup_minutes", type=float, default=8.0)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--eval_every", type=int, default=100, help="steps between evaluations")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--report", type=int, default=0, help="only summarise session N (-1: last)")
    parser.add_argument(
        "--keep_free_heap",
        action="store_true",
        help="control: skip the loop's job.release_free_heap after evaluations",
    )
    args = parser.parse_args()

    csv_path = os.path.join(args.out, "rss.csv")
    if not os.path.exists(csv_path):
        os.makedirs(args.out, exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            csv.writer(f).writerow(
                ["session", "elapsed_s", "step", "rss_mib", "heap_in_use_mib", "heap_held_mib"]
            )
    with open(csv_path) as f:
        last_session = max((int(r["session"]) for r in csv.DictReader(f)), default=0)
    if args.report:
        session = last_session if args.report < 0 else args.report
        report(args.out, args.workdir, session, args.warmup_minutes * 60, args.eval_every)
        return

    name, _, arg = args.config.partition(":")
    config = importlib.import_module(f"configs.{name}").get_config(arg or None)
    config.total_steps = 10**6  # never reached: the deadline stops the run
    config.batch_size = args.batch_size
    config.eval_every_steps = args.eval_every
    config.checkpoint.every_steps = args.eval_every
    config.progress = False
    session = last_session + 1
    print(
        f"Soak session {session}: {args.minutes} min of {args.config} in {args.workdir}, "
        f"evaluating every {args.eval_every} steps; RSS every {args.every} s -> {csv_path}"
    )
    sampler = Sampler(csv_path, args.workdir, session, args.every, args.minutes * 60)
    sampler.sample()
    sampler.start()
    if args.keep_free_heap:
        job.release_free_heap = lambda: False  # the control: glibc keeps what it frees
    train.train_and_evaluate(config, args.workdir)
    sampler.done.set()
    sampler.join()
    sampler.sample()
    report(args.out, args.workdir, session, args.warmup_minutes * 60, args.eval_every)


if __name__ == "__main__":
    main()
