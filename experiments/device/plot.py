"""A device queue run as a picture: each encoder's train step, and LieRE's variants beside it.

    python -m experiments.device.plot experiments/benchmarks/device/<run>.json  # <run>.png

One horizontal bar per encoder: its step at the queue's batch (``shapes["batch"]``, 64) on its
fastest backend with its platform's defaults (``steps.best_rows``, the first pass), and one per
variant of LieRE timed on that backend (lighter), each labelled with its step in ms and its
ratio over NoPE's. Dashed lines: NoPE's step, and RoPE-Mixed's times 1.10 (issue 47's goal
for LieRE 8x8). ``python -m experiments.device.collect`` draws it beside the JSON it copies.
Needs matplotlib (the ``experiments`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from experiments.device.steps import GOAL_RATIOS, best_rows

GOAL = next((b, t) for a, b, t in GOAL_RATIOS if a == "liere")  # ("rope_mixed", 1.10)


def _variant_label(r: dict, defaults: dict) -> str:
    """A variant's name: the queue's ``variant``, else (runs before variants were named) the
    choices in which its row differs from its encoder's defaults row."""
    if r.get("variant"):
        return r["variant"]
    keys = ("block_product", "layer_plan", "squaring_loop", "small_products")
    differ = [k for k in keys if r.get(k) != defaults.get(k)]
    return ", ".join(f"{k.replace('_', ' ')} {r[k]}" for k in differ) or "defaults, again"


def _defaults(data: dict) -> tuple[int, list[dict], dict[str, dict]]:
    """The queue's batch, its first-pass rows, and each encoder's fastest defaults row there."""
    batch = data.get("shapes", {}).get("batch", 64)
    first = [r for r in data.get("rows", []) if r.get("case") == "fixed_batch"]
    return batch, first, best_rows(first, batch)


def bars(data: dict) -> list[tuple[str, float, bool]]:
    """(label, step ms, is a variant) per bar, fastest first: each encoder's defaults on its
    fastest backend at the queue's batch, then after each LieRE encoder its variants timed on
    that backend and batch (first pass)."""
    batch, first, best = _defaults(data)
    out = []
    for encoder, row in sorted(best.items(), key=lambda kv: kv[1]["step_ms"]):
        out.append((f"{encoder} ({row['attention']})", row["step_ms"], False))
        variants = [
            r
            for r in first
            if r["encoder"] == encoder
            and r.get("platform_default") is False
            and r.get("step_ms") is not None
            and r["attention"] == row["attention"]
            and r["batch"] == batch
        ]
        for r in sorted(variants, key=lambda r: r["step_ms"]):
            out.append((f"{encoder}: {_variant_label(r, row)}", r["step_ms"], True))
    return out


def plot(data: dict, path: str) -> str:
    """Draw `data`'s bars into `path` (PNG); the path."""
    from experiments.benchmarks.plot import _pyplot

    plt = _pyplot()
    rows = bars(data)
    if not rows:
        raise ValueError("no timed step at the queue's batch: nothing to draw")
    batch, _, best = _defaults(data)
    nope = best["nope"]["step_ms"] if "nope" in best else None
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.6))
    y = range(len(rows))[::-1]
    colours = ["#9ecae1" if variant else "#3182bd" for _, _, variant in rows]
    ax.barh(list(y), [ms for _, ms, _ in rows], color=colours)
    ax.set_yticks(list(y), [label for label, _, _ in rows], fontsize=8)
    for yi, (_, ms, _) in zip(y, rows, strict=True):
        text = f" {ms:.1f}" + (f" ({ms / nope:.2f}x)" if nope else "")
        ax.text(ms, yi, text, va="center", fontsize=7)
    if nope:
        ax.axvline(nope, color="grey", linestyle="--", linewidth=1, label="NoPE")
    baseline, target = GOAL
    if baseline in best:
        ax.axvline(
            best[baseline]["step_ms"] * target,
            color="#e6550d",
            linestyle="--",
            linewidth=1,
            label=f"{baseline} x {target} (LieRE 8x8's goal)",
        )
    ax.set_xlabel(
        f"train step, ms (min over {data.get('shapes', {}).get('steps', '?')} steps; "
        "in brackets: over NoPE)"
    )
    ax.set_title(
        f"{data.get('device')}, jax {data.get('jax')}: ViT-B/16 224 px, bfloat16, batch {batch}",
        fontsize=9,
    )
    ax.set_xlim(0, max(ms for _, ms, _ in rows) * 1.25)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="a device queue run's JSON")
    parser.add_argument("--out", default=None, help="the PNG (default: beside the JSON)")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    out = args.out or os.path.splitext(args.json)[0] + ".png"
    try:
        print(plot(data, out))
    except ValueError as e:
        print(f"plot: {args.json}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
