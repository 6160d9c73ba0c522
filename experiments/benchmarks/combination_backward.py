"""LieRE's exponentials, forward and backward, with each of the combination's VJPs.

``expm_combination.COMBINATION_BACKWARDS``: "frechet" (every platform's default: the Frechet
derivative of each token's exponential in forward mode) against "reverse" (reverse mode
through the Taylor rows' large product, the squarings' adjoint in one loop). The rotations of
the ImageNet recipe's ViT-B/16 at 224 px (197 tokens, the class token at position 0, 12 heads
of 64 channels in 8 x 8 blocks, or ``--block 64`` for dense LieRE; ``liere.init``'s
generators), for one layer (the CPU's layer
plan, ``position_hook.LAYER_PLANS`` "each") and for 12 layers at once (``jax.vmap``, the GPU's
and TPU's "batched" plan); forward alone and forward plus the backward pass to the
generators, all cases round-robin (``common.timeit_interleaved``), with the ratios of
"reverse" to "frechet" from the same run, and the two gradients' largest difference over the
largest gradient. On this process's platform (on a GPU the device queue times the same in a
train step: its variant ``backward=reverse``). Run:
``python -m experiments.benchmarks.combination_backward [--out FILE.json] [--repeats 7]
[--block 8] [--layers 1,12]``.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from experiments.benchmarks import common
from experiments.device.rotations import exponential_programs

HEADS, HEAD_DIM, BLOCK, GRID, DEPTH = 12, 64, 8, (14, 14), 12
BACKWARDS = ("frechet", "reverse")


def cases(layers: int, backward: str, block: int = BLOCK) -> tuple:
    """(forward, forward and backward, its gradient) compiled with ``backward``."""
    forward, both, params = exponential_programs(
        f"backward={backward}", layers, HEADS, HEAD_DIM, GRID, block
    )
    return (lambda: forward(params)), (lambda: both(params)), both(params)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--block", type=int, default=BLOCK, help="8 (LieRE 8x8) or 64 (dense)")
    parser.add_argument("--layers", default="1,12", help="layer counts: 1 each, more vmapped")
    args = parser.parse_args(argv)
    results = {
        "machine": common.machine(),
        "repeats": args.repeats,
        "block": args.block,
        "rows": [],
    }
    rows = []
    for layers in map(int, args.layers.split(",")):
        plan = "each" if layers == 1 else "batched"
        fns, grads = {}, {}
        for backward in BACKWARDS:
            fwd, both, grads[backward] = cases(layers, backward, args.block)
            fns[f"{backward} forward"] = fwd
            fns[f"{backward} forward + backward"] = both
        times = common.timeit_interleaved(fns, repeats=args.repeats)
        a, b = (np.asarray(jax.tree.leaves(grads[k])[0]) for k in BACKWARDS)
        diff = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
        for part in ("forward", "forward + backward"):
            ratio = common.ratio(times[f"reverse {part}"], times[f"frechet {part}"])
            row = {
                "layers": layers,
                "plan": plan,
                "pass": part,
                "frechet": times[f"frechet {part}"],
                "reverse": times[f"reverse {part}"],
                "reverse_over_frechet": ratio,
                "gradient_difference": diff,
            }
            results["rows"].append(row)
            rows.append(
                [
                    f"{layers} ({plan})",
                    part,
                    common.fmt_time(row["frechet"]),
                    common.fmt_time(row["reverse"]),
                    common.fmt_ratio(ratio),
                    f"{diff:.1e}",
                ]
            )
    common.print_table(
        f"LieRE's exponentials in {args.block} x {args.block} blocks, ViT-B/16 224 px, "
        f"{jax.default_backend()} (ms min / median)",
        ["layers", "pass", "frechet", "reverse", "reverse / frechet", "gradient difference"],
        rows,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    return results


if __name__ == "__main__":
    main()
