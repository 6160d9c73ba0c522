"""ComRoPE: the eigenbasis fast path against per-token matrix exponentials, one layer, one step.

ViT-B/16 shapes: 197 tokens (14 x 14 patches, ``unit_centred`` positions, class token at 0), 12
heads of 64 channels, width 768, batches of 1 and 8; ComRoPE-LD and -AP with blocks of 8 from
``comrope.init``. Each implementation maps (raw P [, scales], W_q, W_k, x) to the rotated q and
k of the batch, what an attention layer needs from its encoder in a step:

- fast: ``comrope.precompute`` (one complex64 ``eigh`` per head and block, angles linear in p),
  P = diag(Q^T) folded into W_q and W_k (``position_hook.fold_projection``), pair rotations of
  q and k (the model's path);
- expm_combination: R(p) per token, head and block from ``comrope.rotations_expm`` (LieRE's
  per-token exponential), q and k multiplied block by block (``lie.apply_blocks``);
- jax_scipy: ``jax.scipy.linalg.expm`` of every token's exponent sum_a p_a A_a (what the
  reference does with ``torch.matrix_exp``), then the same block products.

fwd+bwd is the gradient of sum(w_q * q' + w_k * k') with respect to the raw parameters and
W_q, W_k. The three are timed round-robin (``common.timeit_interleaved``) and the ratios are
against the fast path in the same run. Run: ``python -m experiments.benchmarks.comrope_fast_path
[--out experiments/benchmarks/comrope_fast_path.json] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import common
from rope_lie.encodings import comrope, lie, positions
from rope_lie.models import position_hook

HEADS, HEAD_DIM, WIDTH, GRID, BLOCK = 12, 64, 768, (14, 14), 8
BATCHES = (1, 8)
IMPLS = ("fast", "expm_combination", "jax_scipy")


def make_inputs(variant: str, batch: int, seed: int = 0) -> dict:
    """Parameters, positions, x, W_q, W_k (zero biases) and the cotangents of q' and k'."""
    keys = jax.random.split(jax.random.key(seed), 6)
    params = comrope.init(
        keys[0], num_heads=HEADS, head_dim=HEAD_DIM, num_axes=2, variant=variant, block_size=BLOCK
    )
    pos = positions.grid_positions(GRID, "unit_centred", num_prefix=1)
    shape_q = (batch, pos.shape[0], HEADS, HEAD_DIM)
    return dict(
        params=params,
        pos=pos,
        x=jax.random.normal(keys[1], (batch, pos.shape[0], WIDTH)),
        w_q=jax.random.normal(keys[2], (WIDTH, HEADS, HEAD_DIM)) / np.sqrt(WIDTH),
        w_k=jax.random.normal(keys[3], (WIDTH, HEADS, HEAD_DIM)) / np.sqrt(WIDTH),
        c_q=jax.random.normal(keys[4], shape_q),
        c_k=jax.random.normal(keys[5], shape_q),
    )


def _project(x, w):
    return jnp.einsum("BTD,DNH->BTNH", x, w)


def _fast(variant):
    def forward(params, w_q, w_k, x, pos):
        pe = comrope.precompute(params, pos, num_heads=HEADS, head_dim=HEAD_DIM, variant=variant)
        zeros = jnp.zeros((HEADS, HEAD_DIM))
        if pe.fold_NHH is not None:
            w_q, _ = position_hook.fold_projection(pe.fold_NHH, w_q, zeros)
            w_k, _ = position_hook.fold_projection(pe.fold_NHH, w_k, zeros)
        return pe.rotate(_project(x, w_q)), pe.rotate(_project(x, w_k))

    return forward


def _per_token(variant, exponential):
    def forward(params, w_q, w_k, x, pos):
        r = exponential(params, pos, variant)
        return lie.apply_blocks(_project(x, w_q), r), lie.apply_blocks(_project(x, w_k), r)

    return forward


def _expm_combination(params, pos, variant):
    return comrope.rotations_expm(params, pos, variant=variant)


def _jax_scipy(params, pos, variant):
    gen = comrope.generators(params, variant=variant)
    exponent = jnp.einsum("TA,ANKij->TNKij", pos, gen, precision="highest")
    return jax.scipy.linalg.expm(exponent)


def forward_fn(impl: str, variant: str):
    """(params, w_q, w_k, x, pos) -> (q', k') of one implementation."""
    if impl == "fast":
        return _fast(variant)
    return _per_token(
        variant, {"expm_combination": _expm_combination, "jax_scipy": _jax_scipy}[impl]
    )


def jitted(impl: str, variant: str, mode: str):
    """The jitted forward, or the gradient of sum(c_q q' + c_k k') (fwd+bwd)."""
    forward = forward_fn(impl, variant)
    if mode == "fwd":
        return jax.jit(forward)

    def loss(params, w_q, w_k, x, pos, c_q, c_k):
        q, k = forward(params, w_q, w_k, x, pos)
        return jnp.sum(c_q * q) + jnp.sum(c_k * k)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def logits_agree(variant: str, inputs: dict) -> float:
    """max |q'.k' (fast) - q'.k' (expm_combination)| / max |q'.k'| for one example."""
    args = (inputs["params"], inputs["w_q"], inputs["w_k"], inputs["x"][:1], inputs["pos"])
    out = {}
    for impl in ("fast", "expm_combination"):
        q, k = jax.jit(forward_fn(impl, variant))(*args)
        out[impl] = np.asarray(jnp.einsum("BTNH,BSNH->BNTS", q, k))
    return float(np.abs(out["fast"] - out["expm_combination"]).max() / np.abs(out["fast"]).max())


def run(repeats: int = 5) -> dict:
    results = {
        "machine": common.machine(),
        "shapes": dict(
            heads=HEADS, head_dim=HEAD_DIM, width=WIDTH, batches=BATCHES, grid=GRID, block=BLOCK
        ),
        "cases": [],
    }
    for variant, batch in [(v, b) for v in ("ld", "ap") for b in BATCHES]:
        inputs = make_inputs(variant, batch)
        for mode in ("fwd", "fwd+bwd"):
            args = [inputs[k] for k in ("params", "w_q", "w_k", "x", "pos")]
            if mode == "fwd+bwd":
                args += [inputs["c_q"], inputs["c_k"]]
            fns = {impl: jitted(impl, variant, mode) for impl in IMPLS}
            times = common.timeit_interleaved(
                {impl: (lambda f=fn, a=tuple(args): f(*a)) for impl, fn in fns.items()},
                repeats=repeats,
            )
            results["cases"].append(
                {
                    "variant": variant,
                    "batch": batch,
                    "mode": mode,
                    "times": times,
                    "ratio_vs_fast": {
                        impl: common.ratio(times[impl], times["fast"]) for impl in IMPLS
                    },
                }
            )
        results["cases"][-1]["logits_rel_diff_fast_vs_expm"] = logits_agree(variant, inputs)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = run(args.repeats)
    rows = [
        [c["variant"], c["batch"], c["mode"]]
        + [common.fmt_time(c["times"][impl]) for impl in IMPLS]
        + [common.fmt_ratio(c["ratio_vs_fast"][impl]) for impl in IMPLS[1:]]
        for c in results["cases"]
    ]
    common.print_table(
        f"ComRoPE b={BLOCK}, {HEADS} heads x {HEAD_DIM}, {GRID[0] * GRID[1] + 1} tokens: q and k "
        "of one layer, ms min / median",
        ["variant", "batch", "mode", *IMPLS, "expm_comb / fast", "jax_scipy / fast"],
        rows,
    )
    for c in results["cases"]:
        if "logits_rel_diff_fast_vs_expm" in c:
            print(
                f"{c['variant']}, batch {c['batch']}: max |logit diff| / max |logit| fast vs "
                f"expm_combination = {c['logits_rel_diff_fast_vs_expm']:.1e}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
