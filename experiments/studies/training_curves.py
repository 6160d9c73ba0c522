r"""Training curves of a study's runs: has each arm reached a plateau?

    python -m experiments.studies.training_curves fashion

Reads ``metrics.jsonl`` of every finished (arm, seed) run of the study under ``--root`` (the
runner's workdirs) and writes ``<study>/training.csv`` (arm, seed, step, epoch, loss,
train_accuracy: the logged training-window means, as the runs logged them) and
``<study>/training.png`` (training accuracy and loss against epochs, the mean over seeds per
arm, the seeds' range shaded). The CSV is what the plot is drawn from, so the figure can be
redrawn without the workdirs (``--from-csv``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from collections import defaultdict

import numpy as np

from experiments.studies import lib
from experiments.studies.definitions import STUDIES

COLUMNS = ("arm", "seed", "step", "epoch", "loss", "train_accuracy")


def read_run(workdir: str) -> list[dict]:
    """The logged training lines (those with a training loss) of one run."""
    rows = []
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            if "loss" in record and "train_accuracy" in record:
                rows.append({k: record[k] for k in ("step", "epoch", "loss", "train_accuracy")})
    return rows


def collect(study: lib.Study, root: str, seeds: int) -> list[dict]:
    rows = []
    for arm in study.arms:
        for seed in range(seeds):
            workdir = lib.run_dir(root, arm, seed, "cpu")
            if lib.is_finished(workdir):
                rows += [{"arm": arm.name, "seed": seed, **r} for r in read_run(workdir)]
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    with open(path + ".tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: f"{row[k]:.6g}" if isinstance(row[k], float) else row[k]
                             for k in COLUMNS})  # fmt: skip
    os.replace(path + ".tmp", path)


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["seed"], row["step"] = int(row["seed"]), int(row["step"])
        for key in ("epoch", "loss", "train_accuracy"):
            row[key] = float(row[key])
    return rows


def plot(study: lib.Study, rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_arm: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        by_arm[row["arm"]][row["seed"]].append(row)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.get_cmap("tab10" if len(study.arms) <= 10 else "tab20")
    for i, arm in enumerate(study.arms):
        if arm.name not in by_arm:
            continue
        runs = list(by_arm[arm.name].values())
        length = min(len(r) for r in runs)
        epoch = np.array([r["epoch"] for r in runs[0][:length]])
        for ax, key in zip(axes, ("train_accuracy", "loss"), strict=True):
            values = np.array([[r[key] for r in run[:length]] for run in runs])
            ax.plot(epoch, values.mean(0), color=colors(i), lw=1.2,
                    label=f"{arm.label} ({len(runs)} seeds)")  # fmt: skip
            ax.fill_between(epoch, values.min(0), values.max(0), color=colors(i), alpha=0.15)
    axes[0].set_ylabel("training accuracy (logged window, augmented batches)")
    axes[1].set_ylabel("training loss")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, loc="lower right")
    fig.suptitle(f"{study.title}: training curves (mean over seeds, range shaded)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", choices=sorted(STUDIES))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--root", default=os.path.join(lib.REPO, "workdirs", "studies"))
    parser.add_argument("--results", default=lib.STUDIES_DIR, help="results root")
    parser.add_argument("--from-csv", action="store_true", help="redraw from training.csv")
    args = parser.parse_args(argv)
    study = STUDIES[args.study]
    directory = os.path.join(args.results, study.name)
    path = os.path.join(directory, "training.csv")
    if args.from_csv:
        rows = read_csv(path)
    else:
        rows = collect(study, args.root, args.seeds)
        if not rows:
            raise SystemExit(f"{study.name}: no finished runs under {args.root}")
        os.makedirs(directory, exist_ok=True)
        write_csv(rows, path)
    plot(study, rows, os.path.join(directory, "training.png"))
    print(f"wrote {path} and training.png ({len({(r['arm'], r['seed']) for r in rows})} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
