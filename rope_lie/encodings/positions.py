"""Token positions ``pos_TA`` for grids of rank 1-3 under named conventions.

Tokens are ordered row-major over the grid (the array order of the input: (row, col) for
images, (time/depth, row, col) for volumes), after ``num_prefix`` prefix (class/register) tokens.
Prefix tokens get position 0 on every axis, so rotary families give them R(0): the identity for
RoPE and LieRE, P for Cayley-STRING. Bias and absolute families treat them separately
(``num_prefix`` argument).

Conventions (``convention=``), per axis of length n:

- ``"integer"``: patch indices 0, 1, ..., n - 1 (rope-vit, RoFormer).
- ``"sequential"``: linspace(0, n / n_train, n), i.e. [0, 1] at the training grid and a range
  that grows with the image (LieRE's reference; evaluating at a larger image extrapolates).
- ``"normalized"``: linspace(lo, hi, n) over a fixed ``value_range`` (default [-1, 1]) at every
  resolution (interpolation).
- ``"autoscale"``: integer * n_anchor / n (VisionLlama's AS2DRoPE): the anchor grid's range at
  every resolution.

Evaluating at a new resolution is a change of positions only: pass the new ``grid_shape`` and
the training grid as ``train_grid`` (sequential) or ``anchor_grid`` (autoscale).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _checks

CONVENTIONS = ("integer", "sequential", "normalized", "autoscale")


def _check_grid(grid: Sequence[int], name: str) -> tuple[int, ...]:
    grid = tuple(grid)
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"{name}={grid} must have rank 1, 2 or 3 (sequence, image, volume)")
    for n in grid:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name}={grid} must contain positive integers")
    return tuple(int(n) for n in grid)


def _axis_coords(
    n: int, convention: str, n_ref: int, value_range: tuple[float, float]
) -> np.ndarray:
    if convention == "integer":
        return np.arange(n, dtype=np.float64)
    if convention == "sequential":
        return np.linspace(0.0, n / n_ref, n)
    if convention == "normalized":
        return np.linspace(value_range[0], value_range[1], n)
    return np.arange(n, dtype=np.float64) * (n_ref / n)  # autoscale


def grid_positions(
    grid_shape: Sequence[int],
    convention: str = "integer",
    *,
    num_prefix: int = 0,
    train_grid: Sequence[int] | None = None,
    anchor_grid: Sequence[int] | None = None,
    value_range: tuple[float, float] = (-1.0, 1.0),
) -> jnp.ndarray:
    """Positions of the tokens of a grid, prefix tokens first.

    Args:
      grid_shape: tokens per axis, rank 1-3, e.g. (8, 8) for an 8x8 patch grid.
      convention: one of ``CONVENTIONS`` (see the module docstring).
      num_prefix: number of prefix tokens (class token etc.), placed first at position 0.
      train_grid: the training grid for ``"sequential"``; None means grid_shape is the training
        grid.
      anchor_grid: the anchor grid for ``"autoscale"``; None means grid_shape is the anchor.
      value_range: (lo, hi) for ``"normalized"``.

    Returns:
      float32 array (num_prefix + prod(grid_shape), len(grid_shape)).
    """
    grid = _check_grid(grid_shape, "grid_shape")
    if convention not in CONVENTIONS:
        raise ValueError(
            f"unknown position convention {convention!r}; expected one of {CONVENTIONS}"
        )
    _checks.check_nonnegative_int(num_prefix, "num_prefix", None)
    ref = train_grid if convention == "sequential" else anchor_grid
    ref = grid if ref is None else _check_grid(ref, "train_grid/anchor_grid")
    if len(ref) != len(grid):
        raise ValueError(
            f"reference grid {ref} has rank {len(ref)} but grid_shape={grid} has rank {len(grid)}"
        )
    if convention == "normalized" and not value_range[0] < value_range[1]:
        raise ValueError(f"value_range={value_range} must be (lo, hi) with lo < hi")
    axes = [_axis_coords(n, convention, r, value_range) for n, r in zip(grid, ref, strict=True)]
    mesh = np.meshgrid(*axes, indexing="ij")
    pos_TA = np.stack([m.reshape(-1) for m in mesh], axis=-1)
    pos_TA = np.concatenate([np.zeros((num_prefix, len(grid))), pos_TA], axis=0)
    return jnp.asarray(pos_TA, jnp.float32)
