"""Benchmark 4: LieRE encoder cost against tokens (64 to 1024) and head_dim (16 to 128).

The cost of the rotations of one layer with 12 heads (``liere.rotations``, forward; the
application R x is a batched matvec, linear in everything), dense and blocks of 8, with
sequential positions (range [0, 1] at every size, so the norms and squarings do not change
with the grid). Ratios are against the smallest size in the same run: "per-token ratio" 1.0
means linear in tokens. The sizes of one series are timed round-robin.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from experiments.benchmarks import common
from rope_lie.encodings import expm_combination, lie, liere, positions

HEADS = 12
GRIDS = {64: (8, 8), 256: (16, 16), 576: (24, 24), 1024: (32, 32)}
HEAD_DIMS = (16, 32, 64, 128)


def _case(head_dim: int, block: int | None, grid) -> tuple[dict, object]:
    """The case's description and a no-argument call computing its rotations."""
    params = liere.init(
        jax.random.key(0), num_heads=HEADS, head_dim=head_dim, num_axes=2, block_size=block
    )
    pos = positions.grid_positions(grid, "sequential", num_prefix=1 if grid == (14, 14) else 0)
    fn = jax.jit(liere.rotations)
    skew = lie.skew_from_upper(params["gen_ANKbb"])
    b = skew.shape[-1]
    s_x = expm_combination.num_squarings(pos, skew.reshape(2, -1, b, b)) if b > 4 else None
    case = {
        "tokens": int(pos.shape[0]),
        "head_dim": head_dim,
        "block": block or head_dim,
        "squarings": None if s_x is None else int(np.max(s_x)),
    }
    return case, lambda: fn(params, pos)


def _series(cases: list, repeats: int) -> list[dict]:
    """Time one series of cases round-robin; each case gets its "time"."""
    built = [_case(*c) for c in cases]
    times = common.timeit_interleaved({i: call for i, (_, call) in enumerate(built)}, repeats)
    return [{**case, "time": times[i]} for i, (case, _) in enumerate(built)]


def run(quick: bool = False) -> dict:
    repeats = 3 if quick else 5
    tokens = (64, 256) if quick else tuple(GRIDS)
    head_dims = (16, 64) if quick else HEAD_DIMS
    out = {"tokens": [], "head_dim": [], "load_before": common.machine()["loadavg_1_5_15"]}
    for block in (None, 8):
        out["tokens"] += _series([(64, block, GRIDS[t]) for t in tokens], repeats)
        out["head_dim"] += _series([(h, block, (14, 14)) for h in head_dims], repeats)
        for r in out["tokens"][-len(tokens) :] + out["head_dim"][-len(head_dims) :]:
            print(
                f"  scaling b={block} tokens={r['tokens']} head_dim={r['head_dim']}: "
                f"{common.fmt_time(r['time'])} ms",
                flush=True,
            )
    out["load_after"] = common.machine()["loadavg_1_5_15"]
    return out


def table(results: dict) -> None:
    rows = []
    for r in results["tokens"]:
        base = next(b for b in results["tokens"] if b["block"] == r["block"])
        ratio = common.ratio(r["time"], base["time"])
        per_token = {k: v * base["tokens"] / r["tokens"] for k, v in ratio.items()}
        rows.append(
            [
                r["block"],
                r["tokens"],
                r["squarings"],
                common.fmt_time(r["time"]),
                common.fmt_ratio(ratio),
                f"{r['tokens'] / base['tokens']:.0f}",
                common.fmt_ratio(per_token),
            ]
        )
    common.print_table(
        "4a. LieRE rotations of one layer (12 heads, head_dim 64) against tokens",
        [
            "b",
            "tokens",
            "squarings",
            "ms min / median",
            "/ smallest",
            "tokens ratio",
            "per-token ratio",
        ],
        rows,
    )
    rows = []
    for r in results["head_dim"]:
        dense = r["block"] == r["head_dim"]
        base = next(b for b in results["head_dim"] if (b["block"] == b["head_dim"]) == dense)
        rows.append(
            [
                r["block"],
                r["head_dim"],
                r["squarings"],
                common.fmt_time(r["time"]),
                common.fmt_ratio(common.ratio(r["time"], base["time"])),
            ]
        )
    common.print_table(
        "4b. LieRE rotations of one layer (197 tokens, 12 heads) against head_dim",
        ["b", "head_dim", "squarings", "ms min / median", "/ head_dim 16"],
        rows,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    table(run(parser.parse_args().quick))
