r"""Compare two arms of a study on one evaluation, at the level of seeds.

    python -m experiments.studies.compare block_size liere_b8 liere_b2 --eval g20
    python -m experiments.studies.compare init liere_b8_init1 liere_b8 --eval g16
    python -m experiments.studies.compare STUDY A B --eval test --scale paper
    python -m experiments.studies.compare volumes_long liere_b8 ape --eval g6,g8,shuffled
    python -m experiments.studies.compare fashion liere_b8 ape --eval all
    python -m experiments.studies.compare fashion_data_fraction liere_b8_f010 ape_f010 \
        --versus liere_b8 ape --eval test

Reads ``<results root>/<study>/results.csv`` and ``examples.npz`` (any study directory with
those two files works, defined in `definitions` or not) and prints: each arm's seeds and their
accuracies, the difference of the arm means a - b with its two-level bootstrap CI (seeds, then
test examples), Welch's t over the per-seed accuracies (the primary test) and the exact
permutation test over seeds, the seeds per arm that 80 % power would need at the measured
spread, the example-level paired test (these trained models on this test set, not a test of the
encodings) and, last, ``p=<Welch p>``.

With several evaluations (a comma-separated list, or ``all`` for every one both arms have) it
prints one markdown table row per evaluation: seeds, difference with its CI, Welch's p, the
p-value Holm-adjusted over the listed evaluations (one claim tested on several: the family-wise
level stays at 0.05), the permutation p and the seeds 80 % power would need; last,
``p=<Welch p of each evaluation, comma-separated>``.

With ``--paired`` the arms are two evaluations of the same trained runs (an arm and its
``eval_suffix`` arm: the same model with and without an extrapolation tool), so seed s of a
and of b is one model: it adds the paired t-test over the seeds' differences
(`stats.paired_seeds`, on the seeds both have) and ``p=`` is its p.

    python -m experiments.studies.compare fashion_extrapolation rope_axial_ntk rope_axial \
        --eval px56 --paired

With ``--versus C D`` it asks instead whether the gap a - b differs from the gap c - d (e.g.
LieRE - APE at 10 % of the data against LieRE - APE at 100 %): the difference of differences
of the four arms' seed means, Welch-Satterthwaite's t over the four arms' seeds
(`stats.gap_change`), one line per evaluation (Holm-adjusted when there are several) and
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


def table(arm_a: str, arm_b: str, results: dict[str, dict]) -> list[str]:
    """Markdown lines: one row per evaluation of `results` ({eval: `stats.compare_arms`}), with
    Welch's p Holm-adjusted over them; `p=` with every Welch p is the last line."""
    holm = stats.holm([r["p"] for r in results.values()])
    lines = [
        f"a = {arm_a}, b = {arm_b}",
        "",
        "| eval | seeds a + b | a - b, points [95 % CI] | Welch p | Holm p | permutation p "
        "(smallest possible) | seeds per arm for 80 % power |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, r), p_holm in zip(results.items(), holm, strict=True):
        need = r["seeds_needed"]
        need = "-" if math.isnan(need) or math.isinf(need) else f"{need:.0f}"
        lines.append(
            f"| {name} | {r['seeds_a']} + {r['seeds_b']} | {_pts(r['diff'])} "
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
    lines = [f"gap change: ({a} - {b}) - ({c} - {d}), seed level (Welch-Satterthwaite)"]
    for (name, r), p_holm in zip(results.items(), holm, strict=True):
        seeds = " + ".join(str(n) for n in r["seeds"])
        adjusted = f", Holm p = {p_holm:.3g}" if len(results) > 1 else ""
        lines.append(
            f"{name}: {a} - {b} = {_pts(r['gap_ab'])}, {c} - {d} = {_pts(r['gap_cd'])} points; "
            f"change {_pts(r['diff'])} points, t = {r['t']:.2f} (df {r['df']:.1f}), "
            f"p = {r['p']:.3g}{adjusted} (seeds {seeds})"
        )
    lines.append("p=" + ",".join(f"{r['p']:.4g}" for r in results.values()))
    return lines


def paired_lines(rows: list[dict], examples: dict, arm_a: str, arm_b: str, names) -> list[str]:
    """Per evaluation: each seed's a and b, the paired t-test (`stats.paired_seeds`) over the
    seeds both have, Holm-adjusted over the evaluations; ``p=`` with every paired p is last."""
    results = {}
    for name in names:
        seeds = [
            sorted({r["seed"] for r in rows if r["arm"] == arm and r["eval"] == name})
            for arm in (arm_a, arm_b)
        ]
        common = sorted(set(seeds[0]) & set(seeds[1]))
        if len(common) < 2:
            raise SystemExit(
                f"eval {name!r}: arms {arm_a!r} and {arm_b!r} share {len(common)} seed(s) "
                f"({seeds[0]} and {seeds[1]}); a paired test needs 2"
            )
        acc = [
            np.array([examples[f"{arm}/{s}/{name}"].mean() for s in common])
            for arm in (arm_a, arm_b)
        ]
        results[name] = dict(stats.paired_seeds(*acc), seeds=common, acc=acc)
    holm = stats.holm([r["p"] for r in results.values()])
    lines = [f"a = {arm_a}, b = {arm_b}, paired t over seeds (a_s - b_s, one model per seed)"]
    for (name, r), p_holm in zip(results.items(), holm, strict=True):
        per_seed = ", ".join(
            f"{s}: {100 * x:.2f} - {100 * y:.2f}"
            for s, x, y in zip(r["seeds"], *r["acc"], strict=True)
        )
        adjusted = f", Holm p = {p_holm:.3g}" if len(results) > 1 else ""
        lines.append(
            f"{name}: a - b = {_pts(r['diff'])} points (seeds {per_seed}); t = {r['t']:.2f} "
            f"(df {r['df']:.0f}), p = {r['p']:.3g}{adjusted}"
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
    parser.add_argument(
        "--paired",
        action="store_true",
        help="a and b are evaluations of the same runs: pair the seeds (paired t-test)",
    )
    parser.add_argument("--scale", choices=("cpu", "paper"), default="cpu")
    parser.add_argument("--results", default=None, help="results root (default: this folder)")
    args = parser.parse_args(argv)
    directory = study_directory(args.study, args.results, args.scale)
    rows, examples = lib.read_results(directory), lib.read_examples(directory)
    if not rows:
        raise SystemExit(f"no results.csv with rows in {directory}")
    names = eval_names(rows, args.arm_a, args.arm_b, args.eval_name)
    if args.versus:
        arms = (args.arm_a, args.arm_b, *args.versus)
        gaps = {}
        for name in names:
            accs = [stats.seed_accuracies(arm_examples(rows, examples, a, name)) for a in arms]
            try:
                gaps[name] = dict(stats.gap_change(*accs), seeds=[len(x) for x in accs])
            except ValueError as e:  # too few seeds: a message, not a traceback
                raise SystemExit(f"eval {name!r}, arms {list(arms)}: {e}") from None
        print(f"{args.study}, eval {','.join(names)} ({directory})")
        print("\n".join(gap_lines(arms, gaps)))
        return 0
    if args.paired:
        print(f"{args.study}, eval {','.join(names)} ({directory}), paired by seed")
        print("\n".join(paired_lines(rows, examples, args.arm_a, args.arm_b, names)))
        return 0
    results = {
        name: stats.compare_arms(
            arm_examples(rows, examples, args.arm_a, name),
            arm_examples(rows, examples, args.arm_b, name),
        )
        for name in names
    }
    print(f"{args.study}, eval {','.join(names)} ({directory})")
    if len(names) == 1:
        print("\n".join(describe(args.arm_a, args.arm_b, results[names[0]])))
    else:
        print("\n".join(table(args.arm_a, args.arm_b, results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
