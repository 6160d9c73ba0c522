r"""Steps to an accuracy: does one arm reach a held-out accuracy in fewer training steps?

    python -m experiments.studies.steps_to fashion_plateau liere_b8 ape --threshold 0.85,0.88
    python -m experiments.studies.steps_to fashion_plateau liere_b8 ape --threshold final

LieRE's Appendix D (arXiv:2406.10322; section 5.4 of its first version) claims that LieRE
reaches the accuracy APE (DeiT III) has after 200 CIFAR-100 epochs with 3.5-3.9x less training
compute. That is a claim about the whole training curve: this reads the held-out curves a
study's runs recorded (``<study>/held_out.csv``, written by
``python -m experiments.studies.training_curves <study>`` from runs with ``curve_every``) and,
per seed, the first training step at which the evaluation (``--eval``, default ``test``)
reaches each threshold, interpolated linearly between the evaluated steps
(`steps_to_accuracy`). ``final`` is the threshold b's seeds reach at the end of training, on
average: the paper's "the accuracy APE reaches".

Arms are compared over seeds as `compare` does (`lib.shares_data`): as pairs where seed k of
both saw the same data order, the per-pair ratio b / a of the steps (how many times fewer
steps a needs) tested on its logarithm by a paired t and the exact sign-flip test; otherwise
the arms' log steps by Welch's t. A seed that never reaches a threshold is reported as "not
reached" and left out of the ratio and its t test (the ratio then says over how many pairs or
seeds). Those seeds are often the slow ones (with ``final``, b's seeds below b's mean), so a
rank test keeps them, as slower than any that reached it: the exact sign-flip test of the
pairs' signed ranks (Wilcoxon's signed-rank test; a pair where neither reached is a tie and
left out), or the exact permutation test of the ranks (Mann-Whitney's) for independent arms.
The output is a markdown table, one row per threshold; ``p=`` with each threshold's t-test p
last.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

from experiments.studies import curves_csv, lib, stats


def steps_to_accuracy(steps_T: np.ndarray, accuracy_T: np.ndarray, threshold: float) -> float:
    """The first step at which a held-out curve reaches `threshold`: linear interpolation
    between the last evaluation below it and the first at or above it; the first evaluated step
    if the curve starts at or above it; inf if it never reaches it.

    Args:
      steps_T: increasing training steps of the evaluations.
      accuracy_T: the accuracy at each of them.
      threshold: the accuracy to reach.
    """
    steps_T, accuracy_T = np.asarray(steps_T, np.float64), np.asarray(accuracy_T, np.float64)
    if steps_T.shape != accuracy_T.shape or steps_T.ndim != 1 or len(steps_T) == 0:
        raise ValueError(
            f"a curve needs steps and accuracies of one length: {steps_T.shape}, {accuracy_T.shape}"
        )
    if np.any(np.diff(steps_T) <= 0):
        raise ValueError(f"steps must increase: {steps_T.tolist()}")
    reached = np.flatnonzero(accuracy_T >= threshold)
    if len(reached) == 0:
        return math.inf
    k = int(reached[0])
    if k == 0:
        return float(steps_T[0])
    s0, s1, a0, a1 = steps_T[k - 1], steps_T[k], accuracy_T[k - 1], accuracy_T[k]
    return float(s0 + (threshold - a0) / (a1 - a0) * (s1 - s0))


def curves(rows: list[dict], arm: str, eval_name: str) -> dict[int, tuple[np.ndarray, ...]]:
    """seed -> (steps, accuracies) of `arm`'s held-out curve on `eval_name` (held_out.csv rows)."""
    out = {}
    for seed in sorted({r["seed"] for r in rows if r["arm"] == arm and r["eval"] == eval_name}):
        points = sorted(
            (r["step"], r["accuracy"])
            for r in rows
            if (r["arm"], r["seed"], r["eval"]) == (arm, seed, eval_name)
        )
        out[seed] = tuple(np.array(v) for v in zip(*points, strict=True))
    return out


def compare_steps(
    steps_a: dict[int, float], steps_b: dict[int, float], *, paired: bool
) -> dict[str, float]:
    """Steps of arm a against arm b over seeds (seed -> steps, inf: never reached).

    Returns {"ratio": geometric mean of steps b / steps a (> 1: a is faster), "p" (paired t on
    the log ratio, or Welch on log steps), "p_perm" (sign-flip or permutation), "pairs" or
    seeds used, "unreached_a", "unreached_b"}; p NaN with fewer than 2 usable per side.
    """
    nan = float("nan")
    unreached_a = sum(math.isinf(v) for v in steps_a.values())
    unreached_b = sum(math.isinf(v) for v in steps_b.values())
    if paired:
        seeds = sorted(
            s
            for s in set(steps_a) & set(steps_b)
            if math.isfinite(steps_a[s]) and math.isfinite(steps_b[s])
        )
        log_a = np.log([steps_a[s] for s in seeds])
        log_b = np.log([steps_b[s] for s in seeds])
        used = len(seeds)
    else:
        log_a = np.log([v for v in steps_a.values() if math.isfinite(v)])
        log_b = np.log([v for v in steps_b.values() if math.isfinite(v)])
        used = min(len(log_a), len(log_b))
    ratio = float(np.exp(log_b.mean() - log_a.mean())) if len(log_a) and len(log_b) else nan
    p = p_perm = nan
    if used >= 2:
        if paired:
            p, p_perm = stats.paired_t(log_b, log_a)["p"], stats.sign_flip_test(log_b, log_a)["p"]
        else:
            p = stats.welch_t(log_b, log_a)["p"]
            p_perm = stats.permutation_test(log_b, log_a)["p"]
    return dict(
        ratio=ratio,
        p=p,
        p_perm=p_perm,
        p_rank=_rank_p(steps_a, steps_b, paired=paired),
        used=used,
        unreached_a=unreached_a,
        unreached_b=unreached_b,
    )


def _rank_p(steps_a: dict[int, float], steps_b: dict[int, float], *, paired: bool) -> float:
    """Two-sided p of a rank test of b's steps against a's, a seed that never reached the
    threshold (inf) slower than any that did: exact sign-flip of the signed ranks of the pairs'
    log ratios (a pair where neither reached is a tie, left out), or exact permutation of the
    ranks of both arms' log steps; NaN with fewer than 2 pairs or seeds a side."""
    from scipy.stats import rankdata

    if paired:
        pairs = [s for s in set(steps_a) & set(steps_b) if min(steps_a[s], steps_b[s]) < math.inf]
        if len(pairs) < 2:
            return float("nan")
        d = np.array([np.log(steps_b[s]) - np.log(steps_a[s]) for s in sorted(pairs)])
        signed = np.sign(d) * rankdata(np.abs(d))
        return stats.sign_flip_test(signed, np.zeros_like(signed))["p"]
    if min(len(steps_a), len(steps_b)) < 2:
        return float("nan")
    ranks = rankdata(np.log([*steps_b.values(), *steps_a.values()]))
    return stats.permutation_test(ranks[: len(steps_b)], ranks[len(steps_b) :])["p"]


def _over(result: dict, steps_a: dict, steps_b: dict, paired: bool) -> str:
    """ " (over k of n pairs)" when seeds that never reached the threshold are left out."""
    if not result["unreached_a"] and not result["unreached_b"]:
        return ""
    total = len(set(steps_a) & set(steps_b)) if paired else len(steps_a) + len(steps_b)
    used = (
        result["used"]
        if paired
        else len(steps_a) + len(steps_b) - (result["unreached_a"] + result["unreached_b"])
    )
    return f" (over {used} of {total} {'pairs' if paired else 'seeds'})"


def _steps(steps: float) -> str:
    return "not reached" if math.isinf(steps) else f"{steps:.0f}"


def report(rows, arm_a: str, arm_b: str, eval_name: str, thresholds, paired: bool) -> list[str]:
    """Markdown lines: per threshold, each seed's steps for a and b, the ratio and its tests;
    `p=` last."""
    curves_a, curves_b = curves(rows, arm_a, eval_name), curves(rows, arm_b, eval_name)
    if not curves_a or not curves_b:
        raise SystemExit(
            f"held_out.csv has no {eval_name!r} curve for {arm_a if not curves_a else arm_b!r}"
        )
    final_b = float(np.mean([acc[-1] for _, acc in curves_b.values()]))
    test = "paired t on log(b / a), sign-flip" if paired else "Welch on log steps, permutation"
    lines = [
        f"steps to an accuracy on {eval_name}: a = {arm_a}, b = {arm_b} "
        f"({'as pairs' if paired else 'independent data orders'}; {test})",
        "",
        "| threshold | a: steps per seed | b: steps per seed | b / a (geometric mean) | p "
        "| perm. p | seeds used | rank p, not reached = slowest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ps = []
    for spec in thresholds:
        threshold = final_b if spec == "final" else float(spec)
        label = f"{100 * threshold:.2f} %" + (f" ({arm_b}'s final mean)" if spec == "final" else "")
        steps_a = {s: steps_to_accuracy(*c, threshold) for s, c in curves_a.items()}
        steps_b = {s: steps_to_accuracy(*c, threshold) for s, c in curves_b.items()}
        result = compare_steps(steps_a, steps_b, paired=paired)
        ps.append(result["p"])
        lines.append(
            f"| {label} | {', '.join(_steps(steps_a[s]) for s in sorted(steps_a))} "
            f"| {', '.join(_steps(steps_b[s]) for s in sorted(steps_b))} "
            f"| {result['ratio']:.2f}{_over(result, steps_a, steps_b, paired)} "
            f"| {result['p']:.2g} | {result['p_perm']:.2g} | {result['used']} "
            f"| {result['p_rank']:.2g} |"
        )
    lines.append("p=" + ",".join(f"{p:.4g}" for p in ps))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study")
    parser.add_argument("arm_a")
    parser.add_argument("arm_b")
    parser.add_argument(
        "--threshold", default="final", help="comma-separated accuracies in [0, 1], or 'final'"
    )
    parser.add_argument("--eval", default="test", dest="eval_name")
    parser.add_argument("--results", default=lib.STUDIES_DIR, help="results root")
    parser.add_argument("--pairing", choices=("auto", "paired", "independent"), default="auto")
    args = parser.parse_args(argv)
    path = os.path.join(args.results, args.study, "held_out.csv")
    if not os.path.exists(path):
        raise SystemExit(
            f"{path} not found: run python -m experiments.studies.training_curves "
            f"{args.study} first (runs with curve_every)"
        )
    rows = curves_csv.read_csv(path)
    thresholds = [t for t in args.threshold.split(",") if t]
    for t in thresholds:
        if t != "final" and not 0 < float(t) <= 1:
            raise SystemExit(f"--threshold {t}: expected an accuracy in (0, 1] or 'final'")
    from experiments.studies.definitions import STUDIES

    study = STUDIES.get(args.study)
    paired = (
        lib.shares_data(study, args.arm_a, args.arm_b)
        if args.pairing == "auto"
        else args.pairing == "paired"
    )
    print("\n".join(report(rows, args.arm_a, args.arm_b, args.eval_name, thresholds, paired)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
