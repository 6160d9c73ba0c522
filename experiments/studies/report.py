"""A study's summary: per arm and evaluation, the seed mean, the seeds' range and a bootstrap
95 % CI over test examples, beside the paper's number; seed-level comparisons of the study's
arm pairs (difference of means, two-level bootstrap CI, and over seeds the paired t and
sign-flip tests for arms that share data orders or Welch's and the permutation test for arms
that do not, seeds needed for 80 % power) with the example-level paired z beside; one plot.

Written to ``<study>/summary.md`` and ``<study>/accuracy.png`` by
``python -m experiments.studies.run <study> --report``.
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np

from experiments.studies import lib, stats


def arm_stats(study: lib.Study, rows: list[dict], examples: dict) -> list[dict]:
    """One dict per (arm, eval) that has results: mean, min, max, ci, seeds, paper."""
    by_key = defaultdict(list)
    for row in rows:
        by_key[(row["arm"], row["eval"])].append(row)
    out = []
    for arm in study.arms:
        for name in study.evals:
            group = sorted(by_key.get((arm.name, name), []), key=lambda r: r["seed"])
            if not group:
                continue
            acc = np.array([r["accuracy"] for r in group])
            per_example = [examples.get(f"{arm.name}/{r['seed']}/{name}") for r in group]
            ci = (float("nan"), float("nan"))
            if all(e is not None for e in per_example) and len({len(e) for e in per_example}) == 1:
                ci = stats.bootstrap_ci(np.stack(per_example))
            out.append(
                dict(
                    arm=arm.name,
                    label=arm.label,
                    eval=name,
                    mean=float(acc.mean()),
                    min=float(acc.min()),
                    max=float(acc.max()),
                    ci=ci,
                    seeds=len(group),
                    paper=study.paper.get(arm.name, {}).get(name),
                    ex_per_s=float(np.nanmedian([r["train_ex_per_s"] for r in group])),
                )
            )
    return out


def comparisons(study: lib.Study, rows: list[dict], examples: dict) -> list[dict]:
    """`stats.compare_arms` of the study's (a, b) arm pairs on every reported eval. Arms that
    share data orders (`lib.shares_data`; an arm with an ``eval_suffix`` reads its base arm's
    very runs) are compared as pairs over the seeds both have; arms on independent data orders
    by all their recorded seeds."""
    seeds = defaultdict(set)
    for row in rows:
        seeds[(row["arm"], row["eval"])].add(row["seed"])
    out = []
    for a, b in study.comparisons:
        paired = lib.shares_data(study, a, b)
        for name in study.evals:
            seeds_a, seeds_b = seeds[(a, name)], seeds[(b, name)]
            if paired:
                seeds_a = seeds_b = seeds_a & seeds_b
            keys_a = [f"{a}/{s}/{name}" for s in sorted(seeds_a)]
            keys_b = [f"{b}/{s}/{name}" for s in sorted(seeds_b)]
            if not keys_a or not keys_b or not all(k in examples for k in keys_a + keys_b):
                continue
            test = stats.compare_arms(
                np.stack([examples[k] for k in keys_a]),
                np.stack([examples[k] for k in keys_b]),
                paired=paired,
            )
            out.append(dict(a=a, b=b, eval=name, **test))
    return out


def provenance(rows: list[dict]) -> str:
    """One line: how many runs, on which code trees and CPUs (results.csv's tree and cpu
    columns), whether the runs mix trees (then a comparison also compares code versions), and
    how many were resumed elsewhere or trained in seed ensembles (the tree's marks)."""
    runs = {(r["arm"], r["seed"]): (*lib.split_tree(r["tree"]), r["cpu"]) for r in rows}
    trees, cpus = defaultdict(int), defaultdict(int)
    for tree, _, cpu in runs.values():
        trees[tree or "not recorded"] += 1
        cpus[cpu or "not recorded"] += 1
    if set(trees) == {"not recorded"}:
        return (
            f"Provenance: {len(runs)} runs, recorded before the runner kept their code tree and "
            "CPU (experiments/studies/README.md bounds the trees from git history)."
        )
    mixed = "one code tree" if len(trees) == 1 else f"**{len(trees)} code trees (mixed)**"
    text = (
        f"Provenance: {len(runs)} runs on {mixed}: {_counts(trees)} (runs per tree); CPUs: "
        f"{_counts(cpus)}"
    )
    resumed = sum(lib.RESUMED in marks for _, marks, _ in runs.values())
    if resumed:
        text += f"; {resumed} resumed on another tree or CPU than they started on"
    ensemble = sum(lib.ENSEMBLE in marks for _, marks, _ in runs.values())
    if ensemble:
        text += f"; {ensemble} trained in seed ensembles (rope_lie.ensemble)"
    return text + " (results.csv's tree and cpu columns)."


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} ({n})" for key, n in sorted(counts.items()))


def _pct(x: float) -> str:
    return "" if x is None or np.isnan(x) else f"{100 * x:.1f}"


def markdown(study: lib.Study, rows: list[dict], examples: dict) -> str:
    """The summary table (and paired tests) as markdown."""
    table = arm_stats(study, rows, examples)
    lines = [
        f"# {study.title}",
        "",
        "Accuracy in %: mean over seeds [seed min - max] (bootstrap 95 % CI over test "
        f"examples, B = {stats.B}: how precisely this test set measures these trained models, "
        "not the seed spread); paper's number where it has one. Generated by "
        f"`python -m experiments.studies.run {study.name} --report` from results.csv.",
        "",
        "| arm | seeds | " + " | ".join(study.evals) + " | train ex/s |",
        "|---|---|" + "---|" * len(study.evals) + "---|",
    ]
    by_arm = defaultdict(dict)
    for entry in table:
        by_arm[entry["arm"]][entry["eval"]] = entry
    for arm in study.arms:
        cells = by_arm.get(arm.name)
        if not cells:
            continue
        row = [arm.label, str(max(e["seeds"] for e in cells.values()))]
        for name in study.evals:
            e = cells.get(name)
            if e is None:
                row.append("")
                continue
            text = f"{_pct(e['mean'])} [{_pct(e['min'])}-{_pct(e['max'])}]"
            text += f" ({_pct(e['ci'][0])}-{_pct(e['ci'][1])})"
            if e["paper"] is not None:
                text += f"; paper {_pct(e['paper'])}"
            row.append(text)
        row.append(f"{next(iter(cells.values()))['ex_per_s']:.0f}")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", provenance(rows)]
    tests = comparisons(study, rows, examples)
    if tests:
        lines += [
            "",
            "Comparisons at the level of seeds (the unit of replication): a - b is the difference "
            "of the arms' seed means in points, its 95 % CI a two-level bootstrap (seeds, or seed "
            "pairs, then test examples). Arms whose seed k saw the same data order (the seed "
            "sets it unless an arm has a data stream of its own) are compared as pairs over the "
            "seeds both have (test: paired t over the per-seed differences; perm. p the exact "
            "sign-flip test, which with 5 pairs cannot go below 0.0625, with 3 below 0.25; seed "
            "SD the SD of the differences; seeds for 80 % power: pairs, n = (t + t)^2 SD^2 / d^2 "
            "at n - 1 degrees of freedom); arms on independent data orders by Welch's t over the "
            "per-seed accuracies (perm. p the exact permutation test over seeds; seed SD pooled; "
            "seeds per arm for 80 % power, n = 2 (t + t)^2 SD^2 / d^2 at 2 n - 2 degrees of "
            "freedom). The last column is the example-level paired z-test (seed-mean per "
            "example), which compares *these trained models on this test set*, not the "
            "encodings: it ignores seed variance and rejects even between seeds of one arm.",
            "",
            "| a | b | eval | seeds | test | a - b | 95 % CI | p | perm. p | seed SD "
            "| seeds for 80 % | examples: z (p) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in tests:
            need = t["seeds_needed"]
            need_text = (
                "-" if np.isnan(need) or np.isinf(need) else ">999" if need > 999 else f"{need:.0f}"
            )
            lines.append(
                f"| {t['a']} | {t['b']} | {t['eval']} | {t['seeds_a']}+{t['seeds_b']} "
                f"| {t['test']} "
                f"| {100 * t['diff']:+.2f} | [{100 * t['ci_low']:+.2f}, {100 * t['ci_high']:+.2f}] "
                f"| {t['p']:.2g} | {t['p_perm']:.2g} | {100 * t['sd']:.2f} | {need_text} "
                f"| {t['z_examples']:.1f} ({t['p_examples']:.2g}) |"
            )
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _accuracies(rows: list[dict]) -> dict[tuple[str, str], list[float]]:
    """The seeds' accuracies per (arm, eval)."""
    out = defaultdict(list)
    for r in rows:
        out[(r["arm"], r["eval"])].append(r["accuracy"])
    return out


def _curve(ax, accuracies: dict, points, color: str, label: str, style: str = "-o") -> None:
    """A line through the seed means of ``points`` ((x, (arm, eval)), ...), the seeds as dots;
    points without results are left out."""
    xs, means = [], []
    for x, key in sorted(points):
        accs = accuracies.get(key, [])
        if accs:
            xs.append(x)
            means.append(float(np.mean(accs)))
            ax.plot([x] * len(accs), accs, ".", color=color, ms=3, alpha=0.5)
    if xs:
        ax.plot(xs, means, style, color=color, ms=3, lw=1.2, label=label)


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # legends below the axes stay in
    plt.close(fig)


def plot(study: lib.Study, rows: list[dict], examples: dict, path: str, lines=()):
    """Grouped bars: one group per evaluation, one bar per arm (seed mean, bootstrap CI as the
    error bar, the seeds as dots); ``lines``: (accuracy, label) reference lines (chance, the
    position-blind ceiling). Needs matplotlib (the `experiments` or `test` extra)."""
    plt = _pyplot()
    table = arm_stats(study, rows, examples)
    arms = [a for a in study.arms if any(e["arm"] == a.name for e in table)]
    evals = [n for n in study.evals if any(e["eval"] == n for e in table)]
    width = 0.8 / max(len(arms), 1)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(evals) * max(1, len(arms)) / 4, 5.0))
    per_seed = _accuracies(rows)
    for i, arm in enumerate(arms):
        xs, ys, lo, hi = [], [], [], []
        for j, name in enumerate(evals):
            e = next((e for e in table if e["arm"] == arm.name and e["eval"] == name), None)
            if e is None:
                continue
            x = j + (i - (len(arms) - 1) / 2) * width
            xs.append(x)
            ys.append(e["mean"])
            lo.append(e["mean"] - e["ci"][0] if not np.isnan(e["ci"][0]) else 0.0)
            hi.append(e["ci"][1] - e["mean"] if not np.isnan(e["ci"][1]) else 0.0)
            pts = per_seed.get((arm.name, name), [])
            ax.plot([x] * len(pts), pts, "k.", ms=3, zorder=3)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=arm.label)
    draw_reference_lines(ax, lines, len(evals) - 0.5)
    ax.set_xticks(range(len(evals)), evals)
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(study.title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=4, frameon=False)
    fig.tight_layout()
    _save(fig, path)


def plot_curves(study: lib.Study, rows: list[dict], path: str, lines=()):
    """One panel per evaluation: each of ``study.curves``' lines through its arms' seed means
    (the seeds as dots), against the curve's x (log scale); ``lines`` as in `plot`."""
    if study.curves is None:
        raise ValueError(f"study {study.name!r} defines no curves")
    plt = _pyplot()
    x_label, curves = study.curves
    accuracies = _accuracies(rows)
    evals = [n for n in study.evals if any(k[1] == n for k in accuracies)]
    xticks = sorted({x for _, points in curves for x, _ in points})
    fig, axes = plt.subplots(
        1, len(evals), figsize=(2.6 * len(evals), 3.4), sharey=True, squeeze=False
    )
    for ax, name in zip(axes[0], evals, strict=True):
        for i, (label, points) in enumerate(curves):
            _curve(ax, accuracies, [(x, (arm, name)) for x, arm in points], f"C{i}", label)
        ax.set_xscale("log")
        _finish_panel(ax, name, "", xticks, lines)
        ax.minorticks_off()
    axes[0][0].legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("accuracy")
    fig.supxlabel(x_label, fontsize=8)  # once: per panel, long labels run into each other
    fig.suptitle(study.title, fontsize=9)
    fig.tight_layout()
    _save(fig, path)


def plot_eval_curves(study: lib.Study, rows: list[dict], path: str, lines=()):
    """One panel per ``study.eval_curves`` panel: each arm's seed mean (the seeds as dots)
    against the x of its evaluations, e.g. accuracy against the test size; ``lines`` as in
    `plot`."""
    if study.eval_curves is None:
        raise ValueError(f"study {study.name!r} defines no eval_curves")
    plt = _pyplot()
    x_label, panels = study.eval_curves
    accuracies = _accuracies(rows)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.2 * len(panels), 4.0), sharey=True, squeeze=False
    )
    names = {name for _, points in panels for _, name in points}
    # Colours go to the arms with results, in the study's order, so no two drawn arms share
    # one unless more than 10 are drawn (then the style changes).
    drawn = [a for a in study.arms if any((a.name, n) in accuracies for n in names)]
    for ax, (title, points) in zip(axes[0], panels, strict=True):
        for i, arm in enumerate(drawn):
            style = "-o" if i < 10 else "--s"  # matplotlib's 10 colours come round again
            points_of_arm = [(x, (arm.name, name)) for x, name in points]
            _curve(ax, accuracies, points_of_arm, f"C{i % 10}", arm.label, style)
        _finish_panel(ax, title, x_label, sorted({x for x, _ in points}), lines)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=2,
        frameon=False,
    )
    axes[0][0].set_ylabel("accuracy")
    fig.suptitle(study.title, fontsize=9)
    fig.tight_layout()
    _save(fig, path)


def _finish_panel(ax, title: str, x_label: str, xticks: list[float], lines) -> None:
    """Reference lines (labelled at the right edge), ticks at the points, titles, 0-1 range."""
    ax.set_xticks(xticks, [f"{x:.3g}" for x in xticks])
    draw_reference_lines(ax, lines, xticks[-1])
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(x_label, fontsize=8)
    ax.set_ylim(0, 1.02)


_ARROWS_LINES = ((0.25, "chance"), (stats.blind_ceiling(), "position-blind ceiling"))
REFERENCE_LINES = {  # (accuracy, label) drawn on each study's CPU-scale plots
    **{
        name: _ARROWS_LINES
        for name in ("arrows", "block_size", "sharing", "init", "data_fraction", "resolution")
    },
    **{
        name: ((1 / 6, "chance"), (stats.blind_ceiling(8, 6), "position-blind ceiling"))
        for name in ("volumes", "volumes_long")
    },
    "cayley": ((0.1, "chance"),),
}


def draw_reference_lines(ax, lines, x, *, xycoords="data", scale: float = 1.0) -> None:
    """``lines``' (accuracy, label) pairs as dotted horizontal lines, each labelled at `x`
    (in `xycoords`), right-aligned; `scale` multiplies the accuracies (100 for percent)."""
    for value, label in lines:
        ax.axhline(scale * value, color="gray", ls=":", lw=1)
        ax.annotate(
            label,
            (x, scale * value),
            xycoords=xycoords,
            fontsize=6,
            color="gray",
            ha="right",
            va="bottom",
        )
