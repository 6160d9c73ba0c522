r"""Compare two arms of a study on one evaluation, at the level of seeds.

    python -m experiments.studies.compare block_size liere_b8 liere_b2 --eval g20
    python -m experiments.studies.compare init liere_b8_init1 liere_b8 --eval g16
    python -m experiments.studies.compare STUDY A B --eval test --scale paper

Reads ``<results root>/<study>/results.csv`` and ``examples.npz`` (any study directory with
those two files works, defined in `definitions` or not) and prints: each arm's seeds and their
accuracies, the difference of the arm means a - b with its two-level bootstrap CI (seeds, then
test examples), Welch's t over the per-seed accuracies (the primary test) and the exact
permutation test over seeds, the seeds per arm that 80 % power would need at the measured
spread, the example-level paired test (these trained models on this test set, not a test of the
encodings) and, last, ``p=<Welch p>``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

from experiments.studies import lib, stats


def study_directory(study: str, results_root: str | None, scale: str) -> str:
    """<results root>/<study> (default root: this folder), and its ``paper`` subfolder at
    paper scale without an explicit root, as `run.study_dir`."""
    directory = os.path.join(results_root or lib.STUDIES_DIR, study)
    return (
        os.path.join(directory, "paper") if scale == "paper" and results_root is None else directory
    )


def arm_examples(rows: list[dict], examples: dict, arm: str, eval_name: str) -> np.ndarray:
    """bool (S, N): the per-example results of every recorded seed of `arm` on `eval_name`."""
    seeds = sorted({r["seed"] for r in rows if r["arm"] == arm and r["eval"] == eval_name})
    if not seeds:
        arms = sorted({r["arm"] for r in rows})
        evals = sorted({r["eval"] for r in rows if r["arm"] == arm})
        raise SystemExit(
            f"no results for arm {arm!r} on eval {eval_name!r}; arms: {arms}"
            + (f"; evals of {arm!r}: {evals}" if evals else "")
        )
    keys = [f"{arm}/{s}/{eval_name}" for s in seeds]
    missing = [k for k in keys if k not in examples]
    if missing:
        raise SystemExit(f"examples.npz lacks {missing}: per-example results are needed")
    return np.stack([examples[k] for k in keys])


def _pts(x: float) -> str:
    return "nan" if math.isnan(x) else f"{100 * x:+.2f}"


def describe(arm_a: str, arm_b: str, result: dict) -> list[str]:
    """The printed lines of one comparison (`stats.compare_arms`' result); `p=` is the last."""
    lines = []
    for name, key in ((arm_a, "a"), (arm_b, "b")):
        acc = result[f"acc_{key}"]
        accs = " ".join(f"{100 * x:.2f}" for x in acc)
        lines.append(
            f"{key} = {name}: {len(acc)} seeds, accuracy % {accs} (mean {100 * acc.mean():.2f})"
        )
    lines.append(
        f"difference of means a - b: {_pts(result['diff'])} points, 95 % CI "
        f"[{_pts(result['ci_low'])}, {_pts(result['ci_high'])}] (two-level bootstrap: seeds "
        f"within each arm, then test examples; B = {stats.B})"
    )
    lines.append(
        f"seed level: Welch t = {result['t']:.2f} (df {result['df']:.1f}), p = {result['p']:.3g}; "
        f"exact permutation over seeds p = {result['p_perm']:.3g} (the smallest these seeds can "
        f"give: {result['p_perm_min']:.3g})"
    )
    need = result["seeds_needed"]
    lines.append(
        f"seed spread: pooled SD {100 * result['sd']:.2f} points; 80 % power at alpha 0.05 for a "
        f"difference of {abs(100 * result['diff']):.2f} points needs "
        + ("(no difference measured)" if math.isinf(need) else f"~{need:.0f} seeds per arm")
    )
    lines.append(
        f"example level (these trained models on this test set, not the encodings): paired "
        f"z = {result['z_examples']:.2f}, p = {result['p_examples']:.3g}"
    )
    lines.append(f"p={result['p']:.4g}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", help="study name: the folder holding results.csv")
    parser.add_argument("arm_a")
    parser.add_argument("arm_b")
    parser.add_argument("--eval", required=True, dest="eval_name", help="evaluation name")
    parser.add_argument("--scale", choices=("cpu", "paper"), default="cpu")
    parser.add_argument("--results", default=None, help="results root (default: this folder)")
    args = parser.parse_args(argv)
    directory = study_directory(args.study, args.results, args.scale)
    rows, examples = lib.read_results(directory), lib.read_examples(directory)
    if not rows:
        raise SystemExit(f"no results.csv with rows in {directory}")
    a = arm_examples(rows, examples, args.arm_a, args.eval_name)
    b = arm_examples(rows, examples, args.arm_b, args.eval_name)
    print(f"{args.study}, eval {args.eval_name} ({directory})")
    print("\n".join(describe(args.arm_a, args.arm_b, stats.compare_arms(a, b))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
