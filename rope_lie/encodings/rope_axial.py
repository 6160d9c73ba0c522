"""RoPE-Axial (Heo et al., "Rotary Position Embedding for Vision Transformer", arXiv:2403.13298).

Axial RoPE for A position axes: the F = H/2 channel pairs of a head are split into A contiguous
groups of F/A pairs, and axis a rotates its own group with 1D RoPE frequencies:

    pair a*F/A + i:   theta(p) = p_a * base^(-2A*i/H),    i = 0, ..., F/A - 1,    base = 100

(for A = 2 this is base^(-4i/H), the rope-vit reference's ``compute_axial_cis`` with
theta = 100). Every pair sees a single axis, so
<R(p) q, R(p') k> depends on p' - p only. For A = 1 this is ``rope`` with the same base.

Axis order: axis 0 of ``pos`` (the row of an image, array order) gets the first F/A pairs. The
rope-vit reference gives the first half to x (the column); the two agree up to swapping the
position axes, i.e. ours at (row, col) = reference at (t_x=row, t_y=col).

Conventions: interleaved pairs (2j, 2j+1), (a, b) -> (a cos t - b sin t, a sin t + b cos t);
contiguous groups per axis; R(p) multiplies q and k from the left (never v); prefix (class)
tokens sit at position 0 and get R(0) = I. Angles in float32, output in x's dtype. No
parameters: ``init`` returns ``{}``; the number of axes is read from ``pos`` in ``apply``.
Validation and rotation are ``fixed_frequency``'s; this module holds the frequency table.
"""

from __future__ import annotations

import jax
import numpy as np

from rope_lie.encodings import _checks, fixed_frequency, state

APPLY_HPARAMS: tuple[str, ...] = ("base",)

_FAMILY = "rope_axial"


def _check_dims(head_dim: int, num_axes: int) -> None:
    _checks.check_divisible(head_dim, 2 * num_axes, "2*num_axes", _FAMILY)


def pair_frequencies(head_dim: int, num_axes: int, base: float = 100.0):
    """The axis and frequency of every pair.

    Args:
      head_dim: H, divisible by 2 * num_axes.
      num_axes: A.
      base: frequency base.

    Returns:
      (axis_F, freq_F): int (F,) axis of pair j and float64 (F,) its frequency, F = H/2.
    """
    per_axis = head_dim // (2 * num_axes)
    axis_F = np.repeat(np.arange(num_axes), per_axis)
    freq_F = base ** (-2.0 * num_axes * np.tile(np.arange(per_axis), num_axes) / head_dim)
    return axis_F, freq_F


def init(
    key: jax.Array, *, num_heads: int, head_dim: int, num_axes: int, base: float = 100.0
) -> dict[str, jax.Array]:
    """Validate the configuration; RoPE-Axial has no parameters.

    Args:
      key: unused (kept for the common ``init`` signature).
      num_heads: number of heads N.
      head_dim: head dimension H, divisible by 2 * num_axes.
      num_axes: number of position axes A.
      base: frequency base (100 in the rope-vit reference).

    Returns:
      ``{}``.
    """
    del key
    return fixed_frequency.init(
        _FAMILY, _check_dims, num_heads=num_heads, head_dim=head_dim, num_axes=num_axes,
        base=base,
    )  # fmt: skip


def apply(
    params: dict[str, jax.Array], x_BTNH: jax.Array, pos: jax.Array, *, base: float = 100.0
) -> jax.Array:
    """Rotate queries or keys by R(p).

    Args:
      params: ``{}`` (from ``init``).
      x_BTNH: queries or keys (B, T, N, H), any float dtype, H divisible by 2A.
      pos: positions ``pos_TA`` shared by the batch, or ``pos_BTA`` per example.
      base: frequency base, the same as given to ``init``.

    Returns:
      (B, T, N, H) array in x's dtype.
    """
    return fixed_frequency.apply(
        _FAMILY, _check_dims, pair_frequencies, params, x_BTNH, pos, base=base
    )


def precompute(
    params: dict[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_prefix: int = 0,
    base: float = 100.0,
) -> state.PairAngles:
    """The rotation angles of every token (the encoder state, ``encodings/state.py``).

    Args:
      params: ``{}`` (from ``init``).
      pos: positions pos_TA or pos_BTA.
      num_heads: N (the angles are the same for every head).
      head_dim: H.
      num_prefix: prefix tokens (at position 0, not rotated).
      base: frequency base, the same as given to ``init``.

    Returns:
      ``PairAngles`` of shape (T, 1, H/2), or (B, T, 1, H/2) per example; float32.
    """
    return fixed_frequency.precompute(
        _FAMILY, _check_dims, pair_frequencies, params, pos, num_heads=num_heads, head_dim=head_dim,
        num_prefix=num_prefix, base=base,
    )  # fmt: skip
