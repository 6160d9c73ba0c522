r"""The plateau rule of ``fashion_plateau_length``: where does doubling the run stop paying?

    python -m experiments.studies.plateau          # the verdict so far, as markdown
    python -m experiments.studies.plateau --next   # the arms still to train, for run.py --arms
    python -m experiments.studies.plateau --plot   # plateau.png in the study's folder

Issue 48's rule: an arm's plateau is the epoch count E beyond which doubling the run adds less
than ``MIN_GAIN`` (0.3 points) of test accuracy, acc(2E) - acc(E) < 0.3 points, for the first
such E of its ladder (the study's ``curves``: each arm at 10, 20, 40, ... epochs; seed means
where there are several seeds). The recipe's plateau (``configs/fashion_mnist.py``'s
``PLATEAU_EPOCHS``) is the longest of the arms' plateaus, known once every arm has one. An
arm's next length is trained only while its last doubling still added 0.3 points (or it has
fewer than two lengths).

Each doubling's gain is printed with its standard error on this test set, paired over its
10,000 images (``doubling_errors``: both runs classified the same images, so the images both get
right or both get wrong add no noise to the difference). That error counts the test set's
sampling only, not the variation between seeds' training, which one seed a rung cannot measure:
a gain within it of the rule's 0.3 points is not resolved from them; one beyond it may still
not be.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from experiments.studies import lib, stats

STUDY = "fashion_plateau_length"
MIN_GAIN = 0.003  # test accuracy: 0.3 points
EVAL = "test"
TEST_IMAGES = 10_000  # Fashion-MNIST's test set: the binomial standard error of one run
PLOT = "plateau.png"


def ladders(study: lib.Study, rows: Sequence[dict], eval_name: str = EVAL) -> dict:
    """{line label: [(epochs, arm name, mean accuracy over seeds or None), ...]} along the
    study's ``curves``, from results.csv rows.

    A gain is a difference of two rungs' seed means, so the measured rungs of a line must hold
    the same seeds, each once, with a finite accuracy: otherwise this raises, naming the arm,
    rather than compare other seeds (or a rerun twice) at each rung."""
    if study.curves is None:
        raise ValueError(f"{study.name} has no curves (arms on an epochs axis)")
    accuracy = defaultdict(dict)  # arm -> {seed: accuracy}
    for row in rows:
        if row["eval"] != eval_name:
            continue
        arm, seed, value = row["arm"], row["seed"], float(row["accuracy"])
        if seed in accuracy[arm]:
            raise ValueError(f"{arm} seed {seed}: two {eval_name!r} rows in results.csv")
        if not np.isfinite(value):
            raise ValueError(f"{arm} seed {seed}: {eval_name} accuracy {value}, not a number")
        accuracy[arm][seed] = value
    for label, line in study.curves[1]:
        measured = [name for _, name in line if accuracy[name]]
        seeds = {name: sorted(accuracy[name]) for name in measured}
        if len({tuple(s) for s in seeds.values()}) > 1:
            raise ValueError(
                f"{label}: the rungs hold different seeds ({seeds}); the rule compares rungs "
                "over the same seeds: train the missing ones or leave the extra ones out"
            )
    return {
        label: [
            (x, name, float(np.mean(list(accuracy[name].values()))) if accuracy[name] else None)
            for x, name in line
        ]
        for label, line in study.curves[1]
    }


def doubling_errors(
    study: lib.Study, examples: Mapping[str, np.ndarray], eval_name: str = EVAL
) -> dict[str, dict[float, float]]:
    """{line label: {2E: standard error of acc(2E) - acc(E)}} for each doubling whose two runs
    both have per-example results (``examples``: ``arm/seed/eval`` -> bool per image) for the
    same seeds: ``stats.paired_z`` over the test images, seeds averaged per image. The test
    set's sampling error of the gain, paired; a doubling without such results is left out."""
    if study.curves is None:
        raise ValueError(f"{study.name} has no curves (arms on an epochs axis)")
    seeds = defaultdict(set)  # arm -> the seeds with per-image results of `eval_name`
    for key in examples:
        arm, seed, name = key.split("/")
        if name == eval_name:
            seeds[arm].add(seed)
    out = {}
    for label, line in study.curves[1]:
        out[label] = {}
        for (_, arm), (e2, arm2) in zip(line, line[1:], strict=False):
            both = sorted(seeds[arm] & seeds[arm2])
            if both:
                before = np.stack([examples[f"{arm}/{s}/{eval_name}"] for s in both])
                after = np.stack([examples[f"{arm2}/{s}/{eval_name}"] for s in both])
                out[label][e2] = stats.paired_z(after, before)["se"]
    return out


def arm_plateau(ladder: Sequence[tuple[float, str, float | None]]) -> float | None:
    """The first E of the ladder whose doubling (the next rung, at 2E) added less than
    ``MIN_GAIN``; None while no measured doubling has."""
    for (e, _, acc), (e2, _, acc2) in zip(ladder, ladder[1:], strict=False):
        if acc is None or acc2 is None:
            return None
        if e2 != 2 * e:
            raise ValueError(f"rungs {e} and {e2}: the rule compares doublings")
        # rounded: a gain of exactly 0.3 points (0.9259 - 0.9229) is not less than 0.3
        if round(acc2 - acc, 9) < MIN_GAIN:
            return e
    return None


def next_arms(ladder: Sequence[tuple[float, str, float | None]]) -> list[str]:
    """The arm to train next on this ladder (none once it has a plateau or every rung ran)."""
    if arm_plateau(ladder) is not None:
        return []
    missing = [name for _, name, acc in ladder if acc is None]
    return missing[:1]


def verdict(study: lib.Study, rows: Sequence[dict]) -> dict:
    """Per line: its plateau (None: not reached); the recipe's plateau (None until every line
    has one); the arms to train next, the shortest first."""
    lines = ladders(study, rows)
    epochs = {name: e for ladder in lines.values() for e, name, _ in ladder}
    plateaus = {label: arm_plateau(ladder) for label, ladder in lines.items()}
    known = [p for p in plateaus.values() if p is not None]
    return {
        "plateaus": plateaus,
        "plateau": max(known) if len(known) == len(plateaus) else None,
        # the shorter rungs first: the runner trains in this order, one at a time
        "next": [
            name
            for _, name in sorted(
                (epochs[name], name) for ladder in lines.values() for name in next_arms(ladder)
            )
        ],
    }


def markdown(
    study: lib.Study, rows: Sequence[dict], examples: Mapping[str, np.ndarray] | None = None
) -> list[str]:
    """The rule's reading: test accuracy per rung and the gain of each doubling, with its paired
    standard error where ``examples`` holds both runs' per-image results; each line's plateau,
    how far its last gain is from the rule's threshold, and the recipe's plateau."""
    lines = ladders(study, rows)
    errors = doubling_errors(study, examples or {})
    result = verdict(study, rows)
    out = [
        f"Plateau rule (issue 48): the epochs E after which doubling adds less than "
        f"{100 * MIN_GAIN:.1f} points of {EVAL} accuracy (mean over seeds). After each gain: "
        f"its standard error on the {TEST_IMAGES:,} test images, paired (the test set's "
        "sampling only, not the variation between seeds' training, which one seed a rung "
        "cannot measure).",
        "",
        "| " + " | ".join(["epochs", *lines]) + " |",
        "|---|" + "---|" * len(lines),
    ]
    rungs = sorted({e for ladder in lines.values() for e, _, _ in ladder})
    for e in rungs:
        cells = [f"{e:g}"]
        for label, ladder in lines.items():
            at = {x: acc for x, _, acc in ladder}
            acc, before = at.get(e), at.get(e / 2)
            cell = "" if acc is None else f"{100 * acc:.2f} %"
            if acc is not None and before is not None:
                se = errors[label].get(e)
                cell += f" ({100 * (acc - before):+.2f}" + (
                    f" ± {100 * se:.2f})" if se is not None else ")"
                )
            cells.append(cell)
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for label, plateau in result["plateaus"].items():
        measured = [(e, acc) for e, _, acc in lines[label] if acc is not None]
        if plateau is not None:
            said = f"- {label}: plateau at {plateau:g} epochs"
        elif measured:
            said = f"- {label}: not reached by {measured[-1][0]:g} epochs"
        else:
            out.append(f"- {label}: no runs yet.")
            continue
        last = 2 * plateau if plateau is not None else measured[-1][0]  # the deciding rung
        se = errors[label].get(last)
        at = dict(measured)
        if se and last / 2 in at:
            gain = at[last] - at[last / 2]
            said += (
                f"; its doubling to {last:g} added {100 * gain:+.2f} points, "
                f"{(gain - MIN_GAIN) / se:+.1f} standard errors from {100 * MIN_GAIN:.1f}"
            )
        out.append(said + ".")
    if result["plateau"] is not None:
        out.append(f"- The recipe's plateau: {result['plateau']:g} epochs (PLATEAU_EPOCHS).")
    else:
        todo = ", ".join(result["next"]) or "none (every rung ran)"
        out.append(f"- The recipe's plateau is not known yet; to train next: {todo}.")
    return out


def plot(
    study: lib.Study,
    rows: Sequence[dict],
    path: str,
    examples: Mapping[str, np.ndarray] | None = None,
) -> str:
    """Test accuracy against the epochs (doublings) per line, each doubling's gain written
    beside its point (with its paired standard error where ``examples`` has both runs'
    per-image results), bars of one binomial standard error of the test set; `path` (PNG)."""
    from experiments.studies.report import _pyplot

    plt = _pyplot()
    lines = ladders(study, rows)
    errors = doubling_errors(study, examples or {})
    plateaus = verdict(study, rows)["plateaus"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (label, ladder), dy in zip(lines.items(), (8, -14), strict=False):
        points = [(e, 100 * acc) for e, _, acc in ladder if acc is not None]
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        se = [100 * np.sqrt(y / 100 * (1 - y / 100) / TEST_IMAGES) for y in ys]
        plateau = plateaus[label]
        name = label + (f": plateau at {plateau:g} epochs" if plateau else "")
        line = ax.errorbar(xs, ys, yerr=se, marker="o", capsize=3, label=name)
        colour = line[0].get_color()
        for (_, y0), (x1, y1) in zip(points, points[1:], strict=False):
            se = errors[label].get(x1)
            ax.annotate(
                f"{y1 - y0:+.2f}" + (f" ± {100 * se:.2f}" if se is not None else ""),
                (x1, y1),
                textcoords="offset points",
                xytext=(8, dy),
                fontsize=7,
                color=colour,
            )
    ax.set_xscale("log", base=2)
    rungs = sorted({e for ladder in lines.values() for e, _, _ in ladder})
    ax.set_xticks(rungs, [f"{e:g}" for e in rungs])
    ax.set_xlim(rungs[0] / 1.3, rungs[-1] * 1.9)  # room for the last gain's label
    ax.set_xlabel("epochs (the whole cosine schedule stretched; one seed a rung)")
    ax.set_ylabel(f"{EVAL} accuracy, %")
    ax.set_title(
        f"The plateau: where doubling the run adds less than {100 * MIN_GAIN:.1f} points\n"
        f"(numbers: each doubling's gain ± its standard error, paired over the {TEST_IMAGES:,} "
        "test images;\nbars: one binomial standard error of the test set)",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from experiments.studies.definitions import STUDIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=lib.STUDIES_DIR, help="results root")
    parser.add_argument("--next", action="store_true", help="only the arms to train next")
    parser.add_argument("--plot", action="store_true", help=f"draw {PLOT} beside the results")
    args = parser.parse_args(argv)
    study = STUDIES[STUDY]
    rows = lib.read_results(os.path.join(args.results, STUDY))
    examples = lib.read_examples(os.path.join(args.results, STUDY))
    if args.plot:
        print(plot(study, rows, os.path.join(args.results, STUDY, PLOT), examples))
    elif args.next:
        print(",".join(verdict(study, rows)["next"]))
    else:
        print("\n".join(markdown(study, rows, examples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
