"""A study's training and held-out curves as CSV files beside its results, so they outlive
the runs' workdirs.

- ``<study>/training.csv`` (``COLUMNS``): each run's logged training lines (step, epoch, the
  window's loss and training accuracy), as its ``metrics.jsonl`` has them;
- ``<study>/held_out.csv`` (``HELD_OUT_COLUMNS``): the held-out accuracy at every step it
  evaluated of each run that evaluated at more than one step (a curve, not just the end: runs
  with ``curve_every``).

The runner adds each run's rows as it records the run (``record_run``), and
``training_curves`` collects every finished workdir of a study at once and draws the curves.
A run's rows replace any rows the file had for it; runs whose workdirs are gone keep theirs.
"""

from __future__ import annotations

import csv
import json
import os
from collections import defaultdict
from collections.abc import Sequence

COLUMNS = ("arm", "seed", "step", "epoch", "loss", "train_accuracy")
HELD_OUT_COLUMNS = ("arm", "seed", "step", "eval", "accuracy")
TRAINING = "training.csv"
HELD_OUT = "held_out.csv"


def _records(workdir: str):
    """The records of the run's metrics.jsonl (none without one: a stand-in run's workdir)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def read_run(workdir: str) -> list[dict]:
    """The logged training lines (those with a training loss) of one run."""
    keys = ("step", "epoch", "loss", "train_accuracy")
    return [
        {k: record[k] for k in keys}
        for record in _records(workdir)
        if "loss" in record and "train_accuracy" in record
    ]


def read_held_out(workdir: str, evals: Sequence[str]) -> list[dict]:
    """The held-out accuracies (``<eval>/accuracy``) of one run at every step it evaluated."""
    return [
        {"step": record["step"], "eval": name, "accuracy": record[f"{name}/accuracy"]}
        for record in _records(workdir)
        for name in evals
        if f"{name}/accuracy" in record
    ]


def write_csv(rows: list[dict], path: str, columns: tuple[str, ...] = COLUMNS) -> None:
    with open(path + ".tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: f"{row[k]:.6g}" if isinstance(row[k], float) else row[k] for k in columns}
            )
    os.replace(path + ".tmp", path)


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["seed"], row["step"] = int(row["seed"]), int(row["step"])
        for key in ("epoch", "loss", "train_accuracy", "accuracy"):
            if key in row:
                row[key] = float(row[key])
    return rows


def merge(kept: list[dict], collected: list[dict], arms: Sequence[str]) -> list[dict]:
    """``collected`` (read from workdirs) and those runs of ``kept`` (a CSV's rows) that
    ``collected`` has no rows for, in the order of ``arms``, then seed; each run's rows keep
    their order. Rows of arms not in ``arms`` (no longer in the study) are dropped."""
    fresh = {(r["arm"], r["seed"]) for r in collected}
    rows = [r for r in kept if (r["arm"], r["seed"]) not in fresh and r["arm"] in arms]
    position = {arm: i for i, arm in enumerate(arms)}
    return sorted(rows + collected, key=lambda r: (position[r["arm"]], r["seed"]))  # stable


def merged_with(path: str, collected: list[dict], arms: Sequence[str]) -> list[dict]:
    """``merge`` of the CSV at `path` (none: nothing kept) and `collected`."""
    if not os.path.exists(path):
        return collected
    return merge(read_csv(path), collected, arms)


def has_curve(held_out: list[dict]) -> bool:
    """Whether some run evaluated at more than one step (one end-of-run point is no curve)."""
    steps = defaultdict(set)
    for row in held_out:
        steps[(row["arm"], row["seed"], row["eval"])].add(row["step"])
    return any(len(s) > 1 for s in steps.values())


def record_run(
    directory: str, arms: Sequence[str], arm: str, seed: int, workdir: str, evals: Sequence[str]
) -> None:
    """Adds the finished run `workdir` (`arm`'s `seed`) to `directory`'s training.csv and, if
    it evaluated at more than one step, to held_out.csv; `arms`: the study's arms, in order."""
    os.makedirs(directory, exist_ok=True)
    training = [{"arm": arm, "seed": seed, **r} for r in read_run(workdir)]
    path = os.path.join(directory, TRAINING)
    write_csv(merged_with(path, training, arms), path)
    held_out = [{"arm": arm, "seed": seed, **r} for r in read_held_out(workdir, evals)]
    if has_curve(held_out):
        path = os.path.join(directory, HELD_OUT)
        write_csv(merged_with(path, held_out, arms), path, HELD_OUT_COLUMNS)
