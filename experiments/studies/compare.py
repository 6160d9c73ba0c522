r"""Compare two arms of a study on one evaluation, at the level of seeds.

    python -m experiments.studies.compare block_size liere_b8 liere_b2 --eval g20
    python -m experiments.studies.compare init liere_b8_init1 liere_b8 --eval g16
    python -m experiments.studies.compare STUDY A B --eval test --scale paper
    python -m experiments.studies.compare volumes_long liere_b8 ape --eval g6,g8,shuffled
    python -m experiments.studies.compare fashion liere_b8 ape --eval all
    python -m experiments.studies.compare fashion_data_fraction liere_b8_f010 ape_f010 \
        --versus liere_b8 ape --eval test

Reads ``<results root>/<study>/results.csv`` and ``examples.npz`` (any study directory with
those two files works, defined in `definitions` or not). The test over seeds follows how the
seeds were drawn, and the output says which it used:

- arms that share data orders (seed k of each saw the same batches: the seed sets the data
  order unless a study gives an arm a data stream of its own, `lib.Arm.data_stream`; arms of a
  study `definitions` does not know are taken to share them) are compared as **pairs** over
  the seeds both have: the paired t-test over the per-seed differences (the primary test) and
  the exact sign-flip test (with 5 pairs it cannot go below 0.0625);
- arms on independent data orders by **Welch's t** over the per-seed accuracies and the exact
  permutation test over seeds.

``--pairing paired`` or ``--pairing independent`` overrides what the definitions say. It prints
each arm's seeds and their accuracies, the difference of the arm means a - b with its two-level
bootstrap CI (seeds or seed pairs, then test examples), the tests above, the seeds (pairs, or
seeds per arm) that 80 % power would need at the measured spread, the example-level paired test
(these trained models on this test set, not a test of the encodings) and, last,
``p=<the primary test's p>``.

With several evaluations (a comma-separated list, or ``all`` for every one both arms have) it
prints one markdown table row per evaluation: seeds, the test, difference with its CI, its p,
the p-value Holm-adjusted over the listed evaluations (one claim tested on several: the
family-wise level stays at 0.05), the sign-flip or permutation p and the seeds 80 % power would
need; last, ``p=<p of each evaluation, comma-separated>``.

An arm with an ``eval_suffix`` (the same trained runs evaluated with, say, an extrapolation
tool) shares its base arm's data orders, so the two are compared as pairs: seed s of each is
one model.

    python -m experiments.studies.compare fashion_extrapolation rope_axial_ntk rope_axial \
        --eval px56

With ``--versus C D`` it asks instead whether the gap a - b differs from the gap c - d (e.g.
LieRE - APE at 10 % of the data against LieRE - APE at 100 %): the difference of differences
of the four arms' seed means, tested per seed pair when the four arms share data orders
(`stats.paired_gap_change`: a one-sample t over the seeds' differences of differences, and the
sign-flip test) and otherwise by Welch-Satterthwaite's t over the four arms' seeds
(`stats.gap_change`); one line per evaluation (Holm-adjusted when there are several) and
``p=<p of each evaluation>`` last.
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


def arm_seeds(rows: list[dict], arm: str, eval_name: str) -> set[int]:
    """The seeds of `arm` recorded on `eval_name`."""
    return {r["seed"] for r in rows if r["arm"] == arm and r["eval"] == eval_name}


def arm_examples(
    rows: list[dict], examples: dict, arm: str, eval_name: str, seeds=None
) -> np.ndarray:
    """bool (S, N): the per-example results of `arm` on `eval_name`, every recorded seed or
    those of `seeds` (sorted)."""
    recorded = arm_seeds(rows, arm, eval_name)
    if not recorded:
        arms = sorted({r["arm"] for r in rows})
        evals = sorted({r["eval"] for r in rows if r["arm"] == arm})
        raise SystemExit(
            f"no results for arm {arm!r} on eval {eval_name!r}; arms: {arms}"
            + (f"; evals of {arm!r}: {evals}" if evals else "")
        )
    keys = [f"{arm}/{s}/{eval_name}" for s in sorted(recorded if seeds is None else seeds)]
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
        f"[{_pts(result['ci_low'])}, {_pts(result['ci_high'])}] (two-level bootstrap: "
        + ("seed pairs" if result["test"] == stats.PAIRED else "seeds within each arm")
        + f", then test examples; B = {stats.B})"
    )
    need = result["seeds_needed"]
    power = (
        "(no difference measured)"
        if math.isinf(need)
        else f"~{need:.0f} seed pairs"
        if result["test"] == stats.PAIRED
        else f"~{need:.0f} seeds per arm"
    )
    if result["test"] == stats.PAIRED:
        lines.append(
            f"seed level, as pairs (seed k of each arm saw the same data order): paired t = "
            f"{result['t']:.2f} (df {result['df']:.0f}), p = {result['p']:.3g}; exact sign-flip "
            f"over the {len(result['acc_a'])} pairs p = {result['p_perm']:.3g} (the smallest "
            f"they can give: {result['p_perm_min']:.3g}); Welch on the same seeds, which treats "
            f"them as independent, p = {result['p_welch']:.3g}"
        )
        lines.append(
            f"seed spread: SD of the pair differences {100 * result['sd']:.2f} points; 80 % "
            f"power at alpha 0.05 for a difference of {abs(100 * result['diff']):.2f} points "
            f"needs {power}"
        )
    else:
        lines.append(
            f"seed level (independent data orders): Welch t = {result['t']:.2f} (df "
            f"{result['df']:.1f}), p = {result['p']:.3g}; exact permutation over seeds p = "
            f"{result['p_perm']:.3g} (the smallest these seeds can give: "
            f"{result['p_perm_min']:.3g})"
        )
        lines.append(
            f"seed spread: pooled SD {100 * result['sd']:.2f} points; 80 % power at alpha 0.05 "
            f"for a difference of {abs(100 * result['diff']):.2f} points needs {power}"
        )
    lines.append(
        f"example level (these trained models on this test set, not the encodings): paired "
        f"z = {result['z_examples']:.2f}, p = {result['p_examples']:.3g}"
    )
    lines.append(f"p={result['p']:.4g}")
    return lines


def table(arm_a: str, arm_b: str, results: dict[str, dict]) -> list[str]:
    """Markdown lines: one row per evaluation of `results` ({eval: `stats.compare_arms`}), with
    the primary test's p Holm-adjusted over them; `p=` with every p is the last line."""
    holm = stats.holm([r["p"] for r in results.values()])
    paired = any(r["test"] == stats.PAIRED for r in results.values())
    lines = [
        f"a = {arm_a}, b = {arm_b}"
        + (
            " (as pairs: seed k of each saw the same data order)"
            if paired
            else " (independent data orders)"
        ),
        "",
        "| eval | seeds a + b | test | a - b, points [95 % CI] | p | Holm p | "
        + ("sign-flip p" if paired else "permutation p")
        + " (smallest possible) | "
        + ("seed pairs" if paired else "seeds per arm")
        + " for 80 % power |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (name, r), p_holm in zip(results.items(), holm, strict=True):
        need = r["seeds_needed"]
        need = "-" if math.isnan(need) or math.isinf(need) else f"{need:.0f}"
        lines.append(
            f"| {name} | {r['seeds_a']} + {r['seeds_b']} | {r['test']} | {_pts(r['diff'])} "
            f"[{_pts(r['ci_low'])}, {_pts(r['ci_high'])}] | {r['p']:.2g} | {p_holm:.2g} | "
            f"{r['p_perm']:.2g} ({r['p_perm_min']:.2g}) | {need} |"
        )
    lines.append("p=" + ",".join(f"{r['p']:.4g}" for r in results.values()))
    return lines


def gap_lines(arms: tuple[str, str, str, str], results: dict[str, dict]) -> list[str]:
    """The printed lines of `--versus`: per evaluation, the two gaps, their difference and
    `stats.gap_change`'s test (Holm-adjusted over the evaluations); `p=` is the last line."""
    a, b, c, d = arms
    holm = stats.holm([r["p"] for r in results.values()])
    paired = any("p_flip" in r for r in results.values())
    how = (
        "as pairs (seed k of the four arms saw one data order): one-sample t over the seeds' "
        "differences of differences, and the exact sign-flip test"
        if paired
        else "independent data orders: Welch-Satterthwaite"
    )
    lines = [f"gap change: ({a} - {b}) - ({c} - {d}), seed level, {how}"]
    for (name, r), p_holm in zip(results.items(), holm, strict=True):
        seeds = " + ".join(str(n) for n in r["seeds"])
        adjusted = f", Holm p = {p_holm:.3g}" if len(results) > 1 else ""
        flip = f", sign-flip p = {r['p_flip']:.3g}" if "p_flip" in r else ""
        lines.append(
            f"{name}: {a} - {b} = {_pts(r['gap_ab'])}, {c} - {d} = {_pts(r['gap_cd'])} points; "
            f"change {_pts(r['diff'])} points, t = {r['t']:.2f} (df {r['df']:.1f}), "
            f"p = {r['p']:.3g}{adjusted}{flip} (seeds {seeds})"
        )
    lines.append("p=" + ",".join(f"{r['p']:.4g}" for r in results.values()))
    return lines


def eval_names(rows: list[dict], arm_a: str, arm_b: str, spec: str) -> list[str]:
    """The evaluations `spec` names: a comma-separated list, or ``all`` (those both arms have,
    in results.csv's order)."""
    if spec != "all":
        return [name for name in spec.split(",") if name]
    evals = {arm: [] for arm in (arm_a, arm_b)}
    for r in rows:
        if r["arm"] in evals and r["eval"] not in evals[r["arm"]]:
            evals[r["arm"]].append(r["eval"])
    shared = [name for name in evals[arm_a] if name in evals[arm_b]]
    if not shared:
        raise SystemExit(f"arms {arm_a!r} and {arm_b!r} share no evaluation")
    return shared


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", help="study name: the folder holding results.csv")
    parser.add_argument("arm_a")
    parser.add_argument("arm_b")
    parser.add_argument(
        "--eval",
        required=True,
        dest="eval_name",
        help="evaluation name, several comma-separated, or 'all' (a table, Holm-adjusted)",
    )
    parser.add_argument(
        "--versus",
        nargs=2,
        metavar=("C", "D"),
        default=None,
        help="test whether the gap a - b differs from the gap c - d (arms of the same study)",
    )
    parser.add_argument("--scale", choices=("cpu", "paper"), default="cpu")
    parser.add_argument("--results", default=None, help="results root (default: this folder)")
    parser.add_argument(
        "--pairing",
        choices=("auto", "paired", "independent"),
        default="auto",
        help="auto: as pairs where the study's arms share data orders (its definitions)",
    )
    args = parser.parse_args(argv)
    directory = study_directory(args.study, args.results, args.scale)
    rows, examples = lib.read_results(directory), lib.read_examples(directory)
    if not rows:
        raise SystemExit(f"no results.csv with rows in {directory}")
    names = eval_names(rows, args.arm_a, args.arm_b, args.eval_name)
    arms = (args.arm_a, args.arm_b, *(args.versus or ()))
    paired = _paired(args.pairing, args.study, arms)
    if args.versus:
        gaps, left_out = {}, []
        for name in names:
            seeds = _common_seeds(rows, arms, name) if paired else None
            left_out += _left_out(rows, arms, name, seeds)
            accs = [
                stats.seed_accuracies(arm_examples(rows, examples, a, name, seeds)) for a in arms
            ]
            test = stats.paired_gap_change if paired else stats.gap_change
            try:
                gaps[name] = dict(test(*accs), seeds=[len(x) for x in accs])
            except ValueError as e:  # too few seeds: a message, not a traceback
                raise SystemExit(f"eval {name!r}, arms {list(arms)}: {e}") from None
        print(f"{args.study}, eval {','.join(names)} ({directory})")
        for line in dict.fromkeys(left_out):
            print(line)
        print("\n".join(gap_lines(arms, gaps)))
        return 0
    results, left_out = {}, []
    for name in names:
        seeds = _common_seeds(rows, arms, name) if paired else None
        left_out += _left_out(rows, arms, name, seeds)
        results[name] = stats.compare_arms(
            arm_examples(rows, examples, args.arm_a, name, seeds),
            arm_examples(rows, examples, args.arm_b, name, seeds),
            paired=paired,
        )
    print(f"{args.study}, eval {','.join(names)} ({directory})")
    for line in dict.fromkeys(left_out):  # once each, in order
        print(line)
    if len(names) == 1:
        print("\n".join(describe(args.arm_a, args.arm_b, results[names[0]])))
    else:
        print("\n".join(table(args.arm_a, args.arm_b, results)))
    return 0


def _paired(pairing: str, study_name: str, arms: tuple[str, ...]) -> bool:
    """Whether `arms` are compared as seed pairs: `pairing`, or with "auto" whether the study's
    definitions give them one data stream (`lib.shares_data`)."""
    if pairing != "auto":
        return pairing == "paired"
    from experiments.studies.definitions import STUDIES

    study = STUDIES.get(study_name)
    return all(lib.shares_data(study, arms[0], other) for other in arms[1:])


def _left_out(
    rows: list[dict], arms: tuple[str, ...], eval_name: str, seeds: list[int] | None
) -> list[str]:
    """A line per arm whose seeds on `eval_name` outside the pairs `seeds` are left out."""
    if seeds is None:
        return []
    lines = []
    for arm in arms:
        extra = sorted(set(arm_seeds(rows, arm, eval_name)) - set(seeds))
        if extra:
            lines.append(
                f"{arm}: seeds {extra} left out ({eval_name!r}): the pairs are the seeds every "
                f"arm has, {seeds}"
            )
    return lines


def _common_seeds(rows: list[dict], arms: tuple[str, ...], eval_name: str) -> list[int] | None:
    """The seeds every arm of `arms` has on `eval_name` (the pairs); None when an arm has none
    (`arm_examples` names it)."""
    for arm in arms:
        if not arm_seeds(rows, arm, eval_name):
            return None
    common = set.intersection(*(arm_seeds(rows, arm, eval_name) for arm in arms))
    if not common:
        raise SystemExit(
            f"arms {list(arms)} share no seed on {eval_name!r}: no pairs (--pairing independent "
            "compares them as independent)"
        )
    return sorted(common)


if __name__ == "__main__":
    sys.exit(main())
