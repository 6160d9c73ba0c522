"""Plots of a benchmark run's JSON: rotation cost against tokens and head_dim, accuracy against
the norm of the generator, rotation times per implementation.

    python -m experiments.benchmarks.plot [--results experiments/benchmarks/results.json]

Writes ``scaling.png``, ``accuracy.png`` and ``rotations.png`` beside the results (matplotlib,
from the ``bench`` or ``experiments`` extra). Benchmarks missing from the JSON are skipped.
"""

from __future__ import annotations

import argparse
import json
import os


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(
            "plotting needs matplotlib: pip install -e '.[bench]' (or '.[experiments]')"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def scaling(plt, results: dict, path: str) -> None:
    """Milliseconds per token against tokens (flat = linear), and time against head_dim."""
    fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(10, 4))
    for block in sorted({c["block"] for c in results["tokens"]}, reverse=True):
        cases = sorted(
            (c for c in results["tokens"] if c["block"] == block), key=lambda c: c["tokens"]
        )
        x = [c["tokens"] for c in cases]
        ax_t.plot(
            x, [c["time"]["min_s"] * 1e3 / c["tokens"] for c in cases], "o-", label=f"b = {block}"
        )
    ax_t.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms per token (min)")
    ax_t.set_title("one layer, 12 heads, head_dim 64: flat = linear")
    for label, select in (
        ("dense", lambda c: c["block"] == c["head_dim"]),
        ("b = 8", lambda c: c["block"] == 8),
    ):
        cases = sorted((c for c in results["head_dim"] if select(c)), key=lambda c: c["head_dim"])
        ax_h.plot(
            [c["head_dim"] for c in cases],
            [c["time"]["min_s"] * 1e3 for c in cases],
            "o-",
            label=label,
        )
    ax_h.set(xscale="log", yscale="log", xlabel="head_dim", ylabel="ms (min)")
    ax_h.set_title("one layer, 197 tokens, 12 heads")
    for ax in (ax_t, ax_h):
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def accuracy(plt, rows: list[dict], path: str) -> None:
    """max |R - R_f64| and max |R^T R - I| against the Frobenius norm, per implementation."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = [r for r in rows if r["impl"] == impl]
        for ax, key in zip(axes, ("max_abs_err", "max_orthogonality_err"), strict=True):
            ax.plot([r["norm"] for r in mine], [r[key] for r in mine], "o-", label=impl)
    for ax, title in zip(axes, ("max |R - R_f64|", "max |R^T R - I|"), strict=True):
        ax.axhline(1e-4, color="gray", ls="--", lw=1, label="issue's bound 1e-4")
        ax.set(xscale="log", yscale="log", xlabel="Frobenius norm of the 64 x 64 generator")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rotations(plt, cases: list[dict], path: str) -> None:
    """Min time per implementation, block size and mode (log scale)."""
    keys = sorted({(c["block"], c["mode"]) for c in cases}, key=lambda k: (-k[0], k[1]))
    impls = list(dict.fromkeys(c["impl"] for c in cases))
    times = {(c["block"], c["mode"], c["impl"]): c["time"]["min_s"] * 1e3 for c in cases}
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        xs = [k for k in range(len(keys)) if (*keys[k], impl) in times]
        ax.bar(
            [x + i * width for x in xs], [times[(*keys[x], impl)] for x in xs], width, label=impl
        )
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
    ax.set_xticklabels([f"b={b} {mode}" for b, mode in keys])
    ax.set(yscale="log", ylabel="ms (min)")
    ax.set_title("LieRE rotations, ViT-B/16 one layer (197 tokens x 12 heads, head_dim 64)")
    ax.legend()
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results", default=os.path.join(os.path.dirname(__file__), "results.json")
    )
    flags = parser.parse_args()
    with open(flags.results) as f:
        results = json.load(f)
    plt = _pyplot()
    out = os.path.dirname(os.path.abspath(flags.results))
    written = []
    if "scaling" in results:
        written.append(os.path.join(out, "scaling.png"))
        scaling(plt, results["scaling"], written[-1])
    if "rotations" in results:
        written.append(os.path.join(out, "accuracy.png"))
        accuracy(plt, results["rotations"]["accuracy_over_norms"], written[-1])
        written.append(os.path.join(out, "rotations.png"))
        rotations(plt, results["rotations"]["cases"], written[-1])
    print("wrote", ", ".join(written) or "nothing (no scaling or rotations results)")


if __name__ == "__main__":
    main()
