"""A tour of every rotary and bias encoder: parameters, norms, relativity, measured here.

Run: ``python -m rope_lie.demo`` (CPU, a few seconds). For each family on a 2D 6x6 grid with
ViT-S-like heads (6 heads of 48 channels) it prints the number of learned parameters, the worst
change of a token's norm under the rotation, and how much q.k changes when both positions are
shifted by the same offset: zero (to float32 rounding) where the math says the encoding depends
only on relative position, clearly non-zero for 2D LieRE with blocks larger than 2 (its
generators do not commute).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rope_lie import encodings
from rope_lie.encodings import positions

# 6 heads of 48 channels: ViT-S-like, and a head size every family's example settings divide.
NUM_HEADS, HEAD_DIM, GRID = 6, 48, (6, 6)


def _label(name: str, hparams: dict) -> str:
    return " ".join([name, *(f"{k}={v}" for k, v in hparams.items())])


# (label, family, settings): every 2D example that each rotary family declares (its FAMILY).
CASES = tuple(
    (_label(name, hparams), name, dict(hparams))
    for name, module in encodings.ROTARY.items()
    for hparams, ranks in module.FAMILY.examples
    if len(GRID) in ranks
)


def _num_params(params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


def check_rotary(name: str, hparams: dict, seed: int = 0) -> dict:
    """Parameter count, norm error and translation error of one rotary family on GRID."""
    module = encodings.ROTARY[name]
    key_p, key_q, key_k = jax.random.split(jax.random.key(seed), 3)
    params = module.init(
        key_p, num_heads=NUM_HEADS, head_dim=HEAD_DIM, num_axes=len(GRID), **hparams
    )
    pos_TA = positions.grid_positions(GRID, "integer")
    shape = (1, pos_TA.shape[0], NUM_HEADS, HEAD_DIM)
    q_BTNH, k_BTNH = jax.random.normal(key_q, shape), jax.random.normal(key_k, shape)

    def scores(offset):
        q = module.apply(params, q_BTNH, pos_TA + offset)  # init's settings, from params
        k = module.apply(params, k_BTNH, pos_TA + offset)
        return jnp.einsum("BTNH,BSNH->BNTS", q, k), q

    base, q_rot = scores(0.0)
    moved, _ = scores(jnp.asarray([[2.0, -3.0]]))  # (1, A): the same shift for every token
    norm_err = jnp.max(jnp.abs(jnp.linalg.norm(q_rot, axis=-1) - jnp.linalg.norm(q_BTNH, axis=-1)))
    rel_err = jnp.max(jnp.abs(moved - base)) / jnp.max(jnp.abs(base))
    return {"params": _num_params(params), "norm_err": float(norm_err), "shift_err": float(rel_err)}


def check_alibi() -> dict:
    """ALiBi's bias: symmetric, zero on the diagonal, unchanged by a common shift."""
    pos_TA = positions.grid_positions(GRID, "integer")
    params = encodings.BIAS["alibi"].init(
        jax.random.key(0), num_heads=NUM_HEADS, head_dim=HEAD_DIM, num_axes=len(GRID)
    )
    bias = encodings.BIAS["alibi"].bias(params, pos_TA, pos_TA, num_heads=NUM_HEADS)
    moved = encodings.BIAS["alibi"].bias(params, pos_TA + 5.0, pos_TA + 5.0, num_heads=NUM_HEADS)
    return {
        "params": _num_params(params),
        "symmetric": bool(jnp.allclose(bias, jnp.swapaxes(bias, -1, -2))),
        "shift_err": float(jnp.max(jnp.abs(moved - bias))),
    }


def main() -> None:
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; grid {GRID}, ", end="")
    print(f"{NUM_HEADS} heads x head_dim {HEAD_DIM}, per layer\n")
    w = max(len(label) for label, _, _ in CASES) + 2
    print(f"{'encoder':<{w}}{'params':>8}  {'max |norm change|':>18}  {'rel. change of q.k':>19}")
    print(f"{'':<{w}}{'':>8}  {'':>18}  {'under a shift':>19}")
    for label, name, hparams in CASES:
        r = check_rotary(name, hparams)
        print(f"{label:<{w}}{r['params']:>8}  {r['norm_err']:>18.1e}  {r['shift_err']:>19.1e}")
    a = check_alibi()
    symmetric = "symmetric: " + str(a["symmetric"])
    print(f"{'alibi (bias)':<{w}}{a['params']:>8}  {symmetric:>18}  {a['shift_err']:>19.1e}")
    print(
        "\nRelative encodings change q.k by float32 rounding only (~1e-6); 2D LieRE with blocks "
        "> 2 is\nnot translation invariant (its generators do not commute), as the math says."
    )


if __name__ == "__main__":
    main()
