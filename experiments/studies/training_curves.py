r"""Training curves of a study's runs: has each arm reached a plateau?

    python -m experiments.studies.training_curves fashion

Reads ``metrics.jsonl`` of every finished (arm, seed) run of the study under ``--root`` (the
runner's workdirs) and writes ``<study>/training.csv`` (arm, seed, step, epoch, loss,
train_accuracy: the logged training-window means, as the runs logged them; the format is
``curves_csv``'s, and the runner adds each run as it records it) and
``<study>/training.png`` (training accuracy and loss against epochs, the mean over seeds per
arm, the seeds' range shaded). The CSV is what the plot is drawn from, so the figure can be
redrawn without the workdirs (``--from-csv``). Runs already in the CSV whose workdirs are gone
(made on another machine, say) are kept; a run with a workdir replaces its rows.
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

import numpy as np

from experiments.studies import lib, report
from experiments.studies.curves_csv import (
    HELD_OUT_COLUMNS,
    has_curve,
    merged_with,
    read_csv,
    read_held_out,
    read_run,
    write_csv,
)
from experiments.studies.definitions import STUDIES


def _finished_runs(study: lib.Study, root: str, seeds: int):
    for arm in study.arms:
        for seed in range(seeds):
            workdir = lib.run_dir(root, arm, seed, "cpu")
            if lib.is_finished(workdir):
                yield arm, seed, workdir


def collect(study: lib.Study, root: str, seeds: int) -> list[dict]:
    return [
        {"arm": arm.name, "seed": seed, **r}
        for arm, seed, workdir in _finished_runs(study, root, seeds)
        for r in read_run(workdir)
    ]


def collect_held_out(study: lib.Study, root: str, seeds: int) -> list[dict]:
    return [
        {"arm": arm.name, "seed": seed, **r}
        for arm, seed, workdir in _finished_runs(study, root, seeds)
        for r in read_held_out(workdir, study.evals)
    ]


SEED_STYLES = ("o-", "s--", "^:", "D-.", "v-")  # seed 0, 1, 2, ...


def plot_held_out(study: lib.Study, rows: list[dict], path: str, lines=()) -> None:
    """Held-out accuracy against the training step: one panel per evaluation, a line per run;
    ``lines``: (accuracy, label) reference lines (chance, the position-blind ceiling)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [name for name in study.evals if any(r["eval"] == name for r in rows)]
    fig, axes = plt.subplots(1, len(evals), figsize=(4.2 * len(evals), 3.6), squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, name in zip(axes[0], evals, strict=True):
        for i, arm in enumerate(study.arms):
            for seed in sorted({r["seed"] for r in rows if r["arm"] == arm.name}):
                key = (arm.name, seed, name)
                run = sorted(
                    (r["step"], r["accuracy"])
                    for r in rows
                    if (r["arm"], r["seed"], r["eval"]) == key
                )
                if run:  # colour: the arm; line and marker: the seed
                    steps, accuracy = zip(*run, strict=True)
                    style = SEED_STYLES[int(seed) % len(SEED_STYLES)]
                    ax.plot(
                        steps,
                        100 * np.array(accuracy),
                        style,
                        ms=3,
                        color=colors(i),
                        label=f"{arm.label}, seed {seed}",
                    )
        report.draw_reference_lines(ax, lines, 1, xycoords=("axes fraction", "data"), scale=100)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out accuracy (%)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle(f"{study.title}: held-out accuracy along the way", fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))  # the legend below the panels, not over a curve
    fig.legend(
        handles, labels, fontsize=7, loc="lower center", ncol=min(4, len(labels)), frameon=False
    )
    fig.savefig(path, dpi=130)


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
            ax.plot(
                epoch,
                values.mean(0),
                color=colors(i),
                lw=1.2,
                label=f"{arm.label} ({len(runs)} seeds)",
            )
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
    held_out_path = os.path.join(directory, "held_out.csv")
    if args.from_csv:
        rows = read_csv(path)
        held_out = read_csv(held_out_path) if os.path.exists(held_out_path) else []
    else:
        collected = collect(study, args.root, args.seeds)
        rows = merged_with(path, collected, study.arm_names)
        if not rows:
            raise SystemExit(f"{study.name}: no finished runs under {args.root} nor in {path}")
        os.makedirs(directory, exist_ok=True)
        write_csv(rows, path)
        held_out = merged_with(
            held_out_path, collect_held_out(study, args.root, args.seeds), study.arm_names
        )
        if has_curve(held_out):
            write_csv(held_out, held_out_path, HELD_OUT_COLUMNS)
    plot(study, rows, os.path.join(directory, "training.png"))
    runs = len({(r["arm"], r["seed"]) for r in rows})
    if not args.from_csv:
        kept = runs - len({(r["arm"], r["seed"]) for r in collected})
        print(f"{kept} of the {runs} runs kept from {path} (no workdir under {args.root})")
    print(f"wrote {path} and training.png ({runs} runs)")
    if has_curve(held_out):
        lines = report.REFERENCE_LINES.get(study.name, ())
        plot_held_out(study, held_out, os.path.join(directory, "held_out.png"), lines)
        print(f"wrote {held_out_path} and held_out.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
