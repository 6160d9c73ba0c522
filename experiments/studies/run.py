r"""Run a study, resumably, and summarise it.

    python -m experiments.studies.run arrows                 # 3 seeds, CPU scale
    python -m experiments.studies.run arrows --seeds 5
    python -m experiments.studies.run arrows --report        # summary.md and accuracy.png only
    python -m experiments.studies.run arrows --scale paper --dry-run   # the pod's commands

Every (arm, seed) is one ``rope_lie.main`` run in ``<root>/runs/<scale>/...`` (default root
``workdirs/studies``, kept out of git); results go to ``experiments/studies/<study>/``
(``results.csv``, ``examples.npz``, ``summary.md``, ``accuracy.png``, and ``curves.png`` or
``scaling.png`` for a study that defines them). Kill it at any time and
rerun: finished runs are never redone and the runs in progress resume from their checkpoints.
One run at a time by default (a 2-core CPU has no room for more); ``--jobs N`` trains N at
once, for a GPU, which one small run leaves mostly idle:

    python -m experiments.studies.run fashion_plateau --jobs 8     # its arms read from memory

(the ``cpu`` column of ``results.csv`` says where each run trained). ``--ensemble`` trains
each arm's seeds still to train as one ``rope_lie.ensemble`` job (one program, the seeds
vmapped; each seed still written to its own run's workdir), for arms that read from memory:

    python -m experiments.studies.run fashion_plateau --seeds 5 --ensemble --jobs 4

A run longer than the machine it trains on is carried to the next one through the repository
(``carry.py``): stop the runner, ``--pack`` writes each unfinished run's newest checkpoint to
``<study>/unfinished/``, to be committed, and the runner on the next machine resumes from it.

``--flag`` passes a ``rope_lie.main`` flag to every run that must not change what the run
computes (a data directory, say): runs are named without it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from experiments.studies import carry, lib, plateau, report
from experiments.studies.definitions import STUDIES


def study_dir(name: str, results_root: str | None, scale: str = "cpu") -> str:
    """Where a study's results go: <results root>/<study>, and at paper scale without an
    explicit results root, <study>/paper (never mixed with the CPU-scale results)."""
    directory = os.path.join(results_root or lib.STUDIES_DIR, name)
    return (
        os.path.join(directory, "paper") if scale == "paper" and results_root is None else directory
    )


def write_report(study: lib.Study, directory: str, scale: str = "cpu") -> str:
    """summary.md and the plots of `study` (already `at_scale(scale)`) from `directory`'s results.
    The reference lines (chance, the position-blind ceiling) are the CPU tasks' and are drawn at
    CPU scale only: the paper-scale tasks (CIFAR-100, UCF101, ...) have other chance levels."""
    rows, examples = lib.read_results(directory), lib.read_examples(directory)
    if not rows:
        raise SystemExit(f"{study.name}: no results yet in {directory}; run the study first")
    text = report.markdown(study, rows, examples)
    if study.name == plateau.STUDY:
        rule = plateau.markdown(study, rows, examples)
        text = text.rstrip("\n") + "\n\n" + "\n".join(rule) + "\n"
    with open(os.path.join(directory, "summary.md"), "w") as f:
        f.write(text)
    try:
        lines = report.REFERENCE_LINES.get(study.name, ()) if scale == "cpu" else ()
        report.plot(study, rows, examples, os.path.join(directory, "accuracy.png"), lines)
        if study.curves is not None:
            report.plot_curves(study, rows, os.path.join(directory, "curves.png"), lines)
        if study.eval_curves is not None:
            report.plot_eval_curves(study, rows, os.path.join(directory, "scaling.png"), lines)
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[experiments]'): no plot")
    return text


@contextlib.contextmanager
def sigterm_stops_the_runs():
    """While the runner trains, SIGTERM (a scheduler's, or ``timeout``'s on a lent machine)
    stops it as Ctrl-C does: the runs in progress get SIGTERM, save their next step and exit,
    and the runner waits for them (``lib._train``), so that ``--pack`` right after it finds
    their checkpoints written. Without this the runner would die at once and leave them
    saving behind it."""

    def stop(signum, frame):
        del frame
        raise SystemExit(
            f"{signal.Signals(signum).name}: the runs in progress save their next step and "
            "stop; rerun to resume them, or --pack to carry them to another machine"
        )

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", choices=sorted(STUDIES))
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--scale", choices=("cpu", "paper"), default="cpu")
    parser.add_argument("--arms", default="", help="comma-separated subset of the arms")
    parser.add_argument("--root", default=os.path.join(lib.REPO, "workdirs", "studies"))
    parser.add_argument("--results", default=None, help="results root (default: this folder)")
    parser.add_argument("--report", action="store_true", help="only write the summary")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the commands only (none, and an error, where a recipe does not build)",
    )
    parser.add_argument(
        "--flag",
        action="append",
        default=[],
        help="extra rope_lie.main flag for every run, one that does not change what it computes",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs trained at once (default 1; more on a GPU)"
    )
    parser.add_argument(
        "--ensemble",
        action="store_true",
        help="train each arm's pending seeds as one rope_lie.ensemble job (input=memory arms)",
    )
    parser.add_argument(
        "--pack",
        action="store_true",
        help="write each unfinished run's newest checkpoint to <study>/unfinished/ (carry.py)",
    )
    args = parser.parse_args(argv)
    study = STUDIES[args.study]
    seeds = args.seeds if args.seeds is not None else study.default_seeds
    if seeds < 1:
        parser.error(f"--seeds={seeds}; expected at least 1")
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs}; expected at least 1")
    directory = study_dir(study.name, args.results, args.scale)
    others = [
        (other, study_dir(other.name, args.results, args.scale))
        for other in STUDIES.values()
        if other.name != study.name
    ]
    arms = [a for a in args.arms.split(",") if a] or None
    if args.pack:
        selected = [study.arm(a) for a in arms] if arms else list(study.arms)
        carry.pack_study(study, selected, seeds, args.root, args.scale, directory)
        return 0
    if not args.report and not args.dry_run:
        carry.unpack(directory, os.path.join(args.root, "runs", args.scale))
    if not args.report:
        with contextlib.ExitStack() as stack:
            if not args.dry_run:
                stack.enter_context(sigterm_stops_the_runs())
            lib.run_study(
                study,
                seeds=seeds,
                scale=args.scale,
                root=args.root,
                study_dir=directory,
                dry_run=args.dry_run,
                extra_flags=args.flag,
                arms=arms,
                others=others,
                jobs=args.jobs,
                ensemble=args.ensemble,
            )
    if not args.report and not args.dry_run:
        for path in carry.prune_study(study, args.root, args.scale, directory):
            print(f"finished, no longer carried: {path}")
    if not args.dry_run:
        print(write_report(study.at_scale(args.scale), directory, args.scale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
