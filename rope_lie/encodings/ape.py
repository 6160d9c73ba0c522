"""APE: the learned absolute position embedding of ViT (Dosovitskiy et al., arXiv:2010.11929).

A learned table, one row per token, added to the tokens before the first layer:

    tokens_BTD <- tokens_BTD + emb_TD,    emb_TD = [prefix_PD; grid_GD reshaped to (prod G, D)].

At another grid the grid part is resized (the prefix rows are kept as they are): bicubic in 2D
(``jax.image.resize`` method ``"cubic"``, Keys a = -0.5, as ViT/DeiT fine-tuning at a higher
resolution does), trilinear in 3D and linear in 1D (method ``"linear"``). Resizing uses
half-pixel centres (new index j samples old coordinate (j + 1/2) n_old / n_new - 1/2, i.e.
``align_corners=False``) and is antialiased when shrinking (a no-op when enlarging), as timm's
``resample_abs_pos_embed`` (``F.interpolate(mode="bicubic", antialias=True)``, its default:
torch's antialiased kernel has a = -0.5 like this one, and the two agreed to float32 rounding
growing and shrinking when compared (benchmarks README, section 14); torch's bicubic without
antialias has a = -0.75 and differs). At the training grid the stored table
is returned unchanged.

Additive-family contract (followed by ``ape`` and ``sincos``):

- ``init(key, *, grid_shape, width, num_prefix=0, **hparams) -> params``.
- ``table(params, *, grid_shape, width=..., num_prefix=...) -> emb_TD`` in float32, with
  T = num_prefix + prod(grid_shape), rows in token order: prefix (class) tokens first, then the
  grid row-major (axis order = the array order of the input, (row, col) or (depth, row, col)).
  The model adds it once: ``x_BTD + emb_TD.astype(x_BTD.dtype)``.
- ``APPLY_HPARAMS = ()``: ``table`` needs only the contract's shape arguments.

Params: ``{"grid_GD": (*grid_shape, D)}`` plus ``{"prefix_PD": (num_prefix, D)}`` when
``num_prefix > 0`` (the key is omitted, not zero-sized, when there are no prefix tokens).
Init: i.i.d. Normal(0, init_std^2), ``init_std = 0.02`` as in the ViT reference.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from rope_lie.encodings import _checks, _sharding

APPLY_HPARAMS: tuple[str, ...] = ()

# The table is resized at full float32 precision (a GPU contracts float32 in TF32 by default, a
# TPU in bfloat16 passes), as every other float32 contraction in encodings/.
_HIGHEST = jax.lax.Precision.HIGHEST

_FAMILY = "ape"
# Resize method per grid rank: linear (1D), bicubic (2D), trilinear (3D).
DEFAULT_METHODS = {1: "linear", 2: "cubic", 3: "linear"}
_METHODS = ("linear", "cubic")


def check_grid(grid_shape: Sequence[int], family: str) -> tuple[int, ...]:
    """``grid_shape`` must be a sequence of 1 to 3 positive ints; returns it as a tuple."""
    grid = tuple(grid_shape)
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"{family}: grid_shape={grid} must have rank 1, 2 or 3")
    for n in grid:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"{family}: grid_shape={grid} must contain positive integers")
    return tuple(int(n) for n in grid)


def check_num_prefix(num_prefix, family: str) -> int:
    """``num_prefix`` must be a non-negative int."""
    return _checks.check_nonnegative_int(num_prefix, "num_prefix", family)


def init(
    key: jax.Array,
    *,
    grid_shape: Sequence[int],
    width: int,
    num_prefix: int = 0,
    init_std: float = 0.02,
) -> dict[str, jax.Array]:
    """Initialise the learned table for the training grid.

    Args:
      key: PRNG key.
      grid_shape: training grid, rank 1-3, e.g. (14, 14).
      width: model width D.
      num_prefix: number of prefix (class/register) tokens P, each with its own row.
      init_std: standard deviation of the normal init.

    Returns:
      ``{"grid_GD": (*grid_shape, D)}`` and, if P > 0, ``{"prefix_PD": (P, D)}``; float32.
    """
    grid = check_grid(grid_shape, _FAMILY)
    _checks.check_positive_int(width, "width", _FAMILY)
    check_num_prefix(num_prefix, _FAMILY)
    _checks.check_real(init_std, "init_std", _FAMILY)
    key_grid, key_prefix = jax.random.split(key)
    params = {"grid_GD": init_std * jax.random.normal(key_grid, (*grid, width), jnp.float32)}
    if num_prefix:
        params["prefix_PD"] = init_std * jax.random.normal(
            key_prefix, (num_prefix, width), jnp.float32
        )
    return params


def _check_params(params: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array | None]:
    if "grid_GD" not in params or not set(params) <= {"grid_GD", "prefix_PD"}:
        raise ValueError(
            f"{_FAMILY} expects params with key 'grid_GD' (and optionally 'prefix_PD'), got "
            f"keys {sorted(params)}"
        )
    grid_GD, prefix_PD = params["grid_GD"], params.get("prefix_PD")
    if not 2 <= grid_GD.ndim <= 4:
        raise ValueError(f"{_FAMILY}: grid_GD must have shape (*grid, D), got {grid_GD.shape}")
    if prefix_PD is not None and (prefix_PD.ndim != 2 or prefix_PD.shape[1] != grid_GD.shape[-1]):
        raise ValueError(
            f"{_FAMILY}: prefix_PD has shape {tuple(prefix_PD.shape)} but grid_GD has width "
            f"D={grid_GD.shape[-1]} (expected (P, {grid_GD.shape[-1]}))"
        )
    return grid_GD, prefix_PD


def _check_call(prefix_PD, dim: int, width, num_prefix, method, rank: int) -> str:
    """``table``'s and ``gather``'s shared argument checks; returns the resize method."""
    stored_prefix = 0 if prefix_PD is None else prefix_PD.shape[0]
    if width is not None and width != dim:
        raise ValueError(f"{_FAMILY}: width={width!r} but the stored table has width D={dim}")
    if num_prefix is not None and num_prefix != stored_prefix:
        raise ValueError(
            f"{_FAMILY}: num_prefix={num_prefix!r} but the table stores {stored_prefix} prefix rows"
        )
    method = DEFAULT_METHODS[rank] if method is None else method
    if method not in _METHODS:
        raise ValueError(f"{_FAMILY}: method={method!r} must be one of {_METHODS}")
    return method


def table(
    params: dict[str, jax.Array],
    *,
    grid_shape: Sequence[int],
    width: int | None = None,
    num_prefix: int | None = None,
    method: str | None = None,
) -> jax.Array:
    """The embedding of every token for a grid, resizing the learned grid table if needed.

    Args:
      params: from ``init``.
      grid_shape: the grid to embed, of the same rank as the training grid.
      width: optional; checked against the stored width D.
      num_prefix: optional; checked against the stored number of prefix rows P.
      method: ``"linear"`` or ``"cubic"`` to override the default resize method of the rank
        (``DEFAULT_METHODS``: linear in 1D, cubic in 2D, linear in 3D).

    Returns:
      float32 ``emb_TD`` of shape (P + prod(grid_shape), D): prefix rows, then the grid
      row-major.
    """
    grid_GD, prefix_PD = _check_params(params)
    stored, dim = tuple(grid_GD.shape[:-1]), grid_GD.shape[-1]
    grid = check_grid(grid_shape, _FAMILY)
    if len(grid) != len(stored):
        raise ValueError(
            f"{_FAMILY}: grid_shape={grid} has rank {len(grid)} but the table was trained on "
            f"grid {stored} of rank {len(stored)}"
        )
    method = _check_call(prefix_PD, dim, width, num_prefix, method, len(grid))
    grid_GD = grid_GD.astype(jnp.float32)
    if grid != stored:
        grid_GD = jax.image.resize(grid_GD, (*grid, dim), method=method, antialias=True)
    emb_TD = grid_GD.reshape(-1, dim)
    if prefix_PD is not None:
        emb_TD = jnp.concatenate([prefix_PD.astype(jnp.float32), emb_TD], axis=0)
    return emb_TD


def _axis_weights(n_in: int, n_out: jax.Array, coord: jax.Array, method: str) -> jax.Array:
    """Weights over the ``n_in`` stored rows of output row ``coord`` of a resize to ``n_out``.

    The row of ``jax.image.resize``'s weight matrix (``scale_and_translate`` with scale
    n_out / n_in): output ``coord`` is output 0 translated by ``-coord``, so the weights of one
    row are computed alone, with a traced size and coordinate. At n_out = n_in the row is the
    identity's, as ``jax.image.resize`` leaves an axis of unchanged size alone.
    """
    eye = jnp.eye(n_in, dtype=jnp.float32)
    scale = jnp.asarray(n_out, jnp.float32) / n_in
    row = jax.image.scale_and_translate(
        eye,
        (1, n_in),
        (0,),
        scale[None],
        -jnp.asarray(coord, jnp.float32)[None],
        method,
        antialias=True,
    )[0]
    # The identity's row as a one-hot (the same 0/1 values as indexing ``eye``): a gather at a
    # batch-split coordinate has no output split JAX can name under Explicit mesh axes.
    identity_row = jax.nn.one_hot(jnp.clip(coord, 0, n_in - 1), n_in, dtype=jnp.float32)
    return jnp.where(n_out == n_in, identity_row, row)


def gather(
    params: dict[str, jax.Array],
    index_BTA: jax.Array,
    grid_BA: jax.Array,
    *,
    width: int | None = None,
    num_prefix: int | None = None,
    method: str | None = None,
) -> jax.Array:
    """The embedding of given tokens, each example's table resized to that example's grid.

    Token t of example b gets row ``index[b, t]`` of ``table(params, grid_shape=grid[b])``
    (to float32 rounding; the grids may differ between examples and are traced: the resize is
    evaluated at the tokens' coordinates only, one separable weight vector per axis). With a
    grid per token (``grid_BTA``: a packed row of several images), token t gets row
    ``index[b, t]`` of its own grid ``grid[b, t]``'s table.

    Args:
      params: from ``init``.
      index_BTA: integer grid coordinates of the tokens, each in [0, grid[b]).
      grid_BA: tokens per axis of each example's grid, of the stored table's rank; or
        ``grid_BTA``, each token's own grid.
      width: optional; checked against the stored width D.
      num_prefix: optional; checked against the stored number of prefix rows P.
      method: as ``table``.

    Returns:
      float32 ``emb_BTD`` (B, P + T, D): each example's prefix rows, then its tokens'.
    """
    grid_GD, prefix_PD = _check_params(params)
    stored, dim = tuple(grid_GD.shape[:-1]), grid_GD.shape[-1]
    _checks.check_index(index_BTA, _FAMILY)
    if index_BTA.ndim != 3 or index_BTA.shape[-1] != len(stored):
        raise ValueError(
            f"{_FAMILY}: index_BTA has shape {tuple(index_BTA.shape)}; expected (B, T, "
            f"{len(stored)}) for the stored grid {stored}"
        )
    per_token = grid_BA.ndim == 3
    if tuple(grid_BA.shape) not in ((index_BTA.shape[0], len(stored)), index_BTA.shape):
        raise ValueError(
            f"{_FAMILY}: grid_BA has shape {tuple(grid_BA.shape)}; expected "
            f"({index_BTA.shape[0]}, {len(stored)}), or {tuple(index_BTA.shape)} per token"
        )
    method = _check_call(prefix_PD, dim, width, num_prefix, method, len(stored))
    emb_BTD = grid_GD.astype(jnp.float32)
    for axis, n_in in enumerate(stored):  # contract one stored axis after the other
        # n_in and method are closed over, not passed through vmap: under Explicit mesh axes
        # vmap's arguments must all be arrays.
        row = lambda n_out, coord, n_in=n_in: _axis_weights(n_in, n_out, coord, method)
        w_BTI = jax.vmap(jax.vmap(row, (0 if per_token else None, 0)), (0, 0))(
            grid_BA[..., axis], index_BTA[..., axis]
        )
        if axis == 0:
            emb_BTD = jnp.einsum("BTI,I...->BT...", w_BTI, emb_BTD, precision=_HIGHEST)
        else:
            emb_BTD = jnp.einsum("BTI,BTI...->BT...", w_BTI, emb_BTD, precision=_HIGHEST)
    if prefix_PD is not None:
        prefix_BPD = jnp.broadcast_to(
            prefix_PD.astype(jnp.float32), (emb_BTD.shape[0], *prefix_PD.shape)
        )
        prefix_BPD = _sharding.split_batch(prefix_BPD, _sharding.batch_axes(emb_BTD))
        emb_BTD = jnp.concatenate([prefix_BPD, emb_BTD], axis=1)
    return emb_BTD
