"""VisionLlama AS2DRoPE (Chu et al., "VisionLLaMA", arXiv:2403.00522): axial RoPE, alternating axes.

The F = H/2 channel pairs of a head alternate between the A position axes: pair j belongs to
axis j mod A and is rotated by

    theta_j(p) = p_{j mod A} * base^(-2A*floor(j/A)/H),    base = 10000,

so in 2D the pairs go (row, col, row, col, ...) with frequencies 1, 1, base^(-4/H),
base^(-4/H), ... Every pair sees a single axis, so <R(p) q, R(p') k> depends on p' - p only.
For A = 1 this is ``rope``.

Auto-scaling (the "AS" of AS2DRoPE: positions times anchor/current grid size, so that a larger
image covers the anchor's range of positions) is a positions convention, not part of this
module: build positions with ``positions.grid_positions(grid, convention="autoscale",
anchor_grid=...)``.

Conventions: interleaved pairs (2j, 2j+1), (a, b) -> (a cos t - b sin t, a sin t + b cos t);
axis order = array order of the input ((row, col) for images, (depth/time, row, col) for
volumes); R(p) multiplies q and k from the left (never v); prefix (class) tokens sit at position
0 and get R(0) = I. Angles in float32, output in x's dtype. No parameters: ``init`` returns
``{}``; the number of axes is read from ``pos`` in ``apply``.
"""

from __future__ import annotations

import jax
import numpy as np

from rope_lie.encodings import _checks, rope

APPLY_HPARAMS: tuple[str, ...] = ("base",)

_FAMILY = "visionllama"


def pair_frequencies(head_dim: int, num_axes: int, base: float = 10000.0):
    """The axis and frequency of every pair.

    Args:
      head_dim: H, divisible by 2 * num_axes.
      num_axes: A.
      base: frequency base.

    Returns:
      (axis_F, freq_F): int (F,) axis j mod A of pair j and float64 (F,) its frequency
      base^(-2A*floor(j/A)/H), F = H/2.
    """
    j = np.arange(head_dim // 2)
    return j % num_axes, base ** (-2.0 * num_axes * (j // num_axes) / head_dim)


def init(
    key: jax.Array, *, num_heads: int, head_dim: int, num_axes: int, base: float = 10000.0
) -> dict[str, jax.Array]:
    """Validate the configuration; AS2DRoPE has no parameters.

    Args:
      key: unused (kept for the common ``init`` signature).
      num_heads: number of heads N.
      head_dim: head dimension H, divisible by 2 * num_axes.
      num_axes: number of position axes A.
      base: frequency base (10000 in VisionLlama).

    Returns:
      ``{}``.
    """
    del key
    _checks.check_shape_args(num_heads, head_dim, num_axes, _FAMILY)
    _checks.check_divisible(head_dim, 2 * num_axes, "2*num_axes", _FAMILY)
    rope.check_base(base, _FAMILY)
    return {}


def apply(
    params: dict[str, jax.Array], x_BTNH: jax.Array, pos: jax.Array, *, base: float = 10000.0
) -> jax.Array:
    """Rotate queries or keys by R(p).

    Args:
      params: ``{}`` (from ``init``).
      x_BTNH: queries or keys (B, T, N, H), any float dtype, H divisible by 2A.
      pos: positions ``pos_TA`` shared by the batch, or ``pos_BTA`` per example (already
        auto-scaled if wanted, see the module docstring).
      base: frequency base, the same as given to ``init``.

    Returns:
      (B, T, N, H) array in x's dtype.
    """
    rope.check_no_params(params, _FAMILY)
    _checks.check_x(x_BTNH, _FAMILY)
    _checks.check_pos(pos, x_BTNH, _FAMILY)
    num_axes, head_dim = pos.shape[-1], x_BTNH.shape[-1]
    _checks.check_positive_int(num_axes, "num_axes", _FAMILY)
    _checks.check_divisible(head_dim, 2 * num_axes, "2*num_axes", _FAMILY)
    axis_F, freq_F = pair_frequencies(head_dim, num_axes, rope.check_base(base, _FAMILY))
    return rope.rotate_fixed(x_BTNH, pos, axis_F, freq_F)
