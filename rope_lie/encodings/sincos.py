"""Fixed sinusoidal position embedding (Vaswani et al., arXiv:1706.03762) on 1D/2D/3D grids.

The width D is split equally between the A axes; each axis block of D/A channels embeds the
integer patch index p of its axis as

    [sin(p * omega_0), ..., sin(p * omega_(F-1)), cos(p * omega_0), ..., cos(p * omega_(F-1))],
    omega_i = 10000^(-2i / (D/A)),    F = D / (2A),

i.e. sin and cos halves, not interleaved. The 2D layout replicates MAE's
``get_2d_sincos_pos_embed`` (He et al., arXiv:2111.06377) exactly: MAE builds its grid with
``np.meshgrid(grid_w, grid_h)``, so its first channel half (``emb_h``) encodes the column and the
second half the row. In general the channel blocks follow the axes in reverse array order
(fastest-varying axis first: x, y, z): block k encodes axis A - 1 - k. Tokens are row-major over
the grid (axis order = the array order of the input), after ``num_prefix`` prefix tokens whose
rows are zero (MAE's ``cls_token=True``). Positions are the integer indices at every grid, so a
larger grid extends the table (MAE evaluates this way; no resizing).

Additive-family contract (see ``ape``): ``init(key, *, grid_shape, width, num_prefix=0) -> {}``
and ``table(params, *, grid_shape, width, num_prefix=0) -> emb_TD`` (float32, T = num_prefix +
prod(grid_shape)), added once to the tokens before the first layer; ``APPLY_HPARAMS = ()``.
The table is computed in float64 numpy at trace time (shapes are static) and cast to float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _checks, _sharding
from rope_lie.encodings.ape import check_grid, check_num_prefix

APPLY_HPARAMS: tuple[str, ...] = ()

_FAMILY = "sincos"


def _check_args(grid_shape: Sequence[int], width: int, num_prefix: int) -> tuple[int, ...]:
    grid = check_grid(grid_shape, _FAMILY)
    _checks.check_positive_int(width, "width", _FAMILY)
    check_num_prefix(num_prefix, _FAMILY)
    if width % (2 * len(grid)):
        raise ValueError(
            f"{_FAMILY}: width={width} is not divisible by 2 * num_axes = {2 * len(grid)} "
            f"(a sin and a cos half for each of the {len(grid)} axes of grid {grid})"
        )
    return grid


def axis_embedding(pos_I: np.ndarray, dim: int) -> np.ndarray:
    """1D sinusoidal embedding ``[sin(pos * omega), cos(pos * omega)]`` of positions.

    Args:
      pos_I: (M,) positions.
      dim: embedding size, even.

    Returns:
      (M, dim) float64, ``omega_i = 10000^(-2i/dim)`` for i < dim / 2.
    """
    omega_F = 10000.0 ** (-np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    angle_IF = np.asarray(pos_I, np.float64)[:, None] * omega_F[None, :]
    return np.concatenate([np.sin(angle_IF), np.cos(angle_IF)], axis=1)


def init(
    key: jax.Array, *, grid_shape: Sequence[int], width: int, num_prefix: int = 0
) -> dict[str, jax.Array]:
    """Validate the configuration; the table is fixed.

    Args:
      key: unused (kept for the common ``init`` signature).
      grid_shape: grid, rank 1-3.
      width: model width D, divisible by 2 * len(grid_shape).
      num_prefix: number of prefix (class) tokens.

    Returns:
      ``{}``.
    """
    del key
    _check_args(grid_shape, width, num_prefix)
    return {}


def table(
    params: dict[str, jax.Array], *, grid_shape: Sequence[int], width: int, num_prefix: int = 0
) -> jax.Array:
    """The fixed sinusoidal embedding of every token of a grid.

    Args:
      params: ``{}`` (from ``init``).
      grid_shape: grid to embed, rank 1-3 (any size: positions are integer indices).
      width: model width D, divisible by 2 * len(grid_shape).
      num_prefix: number of prefix (class) tokens, whose rows are zero.

    Returns:
      float32 ``emb_TD`` of shape (num_prefix + prod(grid_shape), D), values in [-1, 1].
    """
    if params:
        raise ValueError(
            f"{_FAMILY} has no parameters and expects params={{}}, got keys {sorted(params)}"
        )
    grid = _check_args(grid_shape, width, num_prefix)
    index_AG = np.meshgrid(*[np.arange(n) for n in grid], indexing="ij")
    blocks = [axis_embedding(index_AG[a].reshape(-1), width // len(grid)) for a in range(len(grid))]
    # MAE's channel order: the last (fastest) axis first.
    emb_TD = np.concatenate([np.zeros((num_prefix, width)), np.concatenate(blocks[::-1], 1)], 0)
    return jnp.asarray(emb_TD, jnp.float32)


def gather(
    params: dict[str, jax.Array],
    index_BTA: jax.Array,
    grid_BA: jax.Array | None = None,
    *,
    width: int,
    num_prefix: int = 0,
) -> jax.Array:
    """The embedding of given tokens at their integer grid coordinates (traceable ``table``).

    Token t of example b gets row ``index[b, t]`` of ``table`` (positions are the integer
    indices at every grid, so the grid itself is not needed), computed in float32 in JAX.

    Args:
      params: ``{}``.
      index_BTA: integer grid coordinates (B, T, A), A in 1-3.
      grid_BA: unused (the additive contract's argument).
      width: model width D, divisible by 2 A.
      num_prefix: prefix (class) tokens, whose rows are zero.

    Returns:
      float32 ``emb_BTD`` (B, num_prefix + T, D).
    """
    del grid_BA
    _checks.check_index(index_BTA, _FAMILY)
    if params:
        raise ValueError(
            f"{_FAMILY} has no parameters and expects params={{}}, got keys {sorted(params)}"
        )
    num_axes = index_BTA.shape[-1]
    _check_args((1,) * num_axes, width, num_prefix)
    dim = width // num_axes
    omega_F = jnp.asarray(10000.0 ** (-np.arange(dim // 2) / (dim / 2.0)), jnp.float32)
    angle_BTAF = index_BTA.astype(jnp.float32)[..., None] * omega_F[None, None, None]
    blocks = [
        jnp.concatenate([jnp.sin(angle_BTAF[..., a, :]), jnp.cos(angle_BTAF[..., a, :])], -1)
        for a in reversed(range(num_axes))  # MAE's channel order: the last axis first
    ]
    emb_BTD = jnp.concatenate(blocks, axis=-1)
    prefix_BPD = jnp.zeros((emb_BTD.shape[0], num_prefix, width), jnp.float32)
    prefix_BPD = _sharding.split_batch(prefix_BPD, _sharding.batch_axes(emb_BTD))  # Explicit
    return jnp.concatenate([prefix_BPD, emb_BTD], axis=1)
