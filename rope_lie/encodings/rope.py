"""RoPE (RoFormer, Su et al., arXiv:2104.09864): rotary position encoding of 1D positions.

R(p) rotates the interleaved channel pair (2j, 2j+1) of every head by the angle

    theta_j(p) = p * base^(-2j/H),    j = 0, ..., H/2 - 1,    base = 10000,

so <R(p) q, R(p') k> = <q, R(p' - p) k> depends on p' - p only (RoFormer section 3.2).

Conventions: interleaved pairs, (a, b) -> (a cos t - b sin t, a sin t + b cos t); R(p) multiplies
q and k from the left (never v); positions are ``pos_TA`` or ``pos_BTA`` with A = 1 (use
``rope_axial`` or ``rope_mixed`` for images and volumes); prefix (class) tokens sit at position 0
and get R(0) = I, i.e. they are not rotated. Angles, cos and sin are float32 whatever x's dtype;
the output has x's dtype. No parameters: ``init`` returns ``{}``.

This module also holds the pieces shared by the fixed-frequency families (``rope_axial``,
``visionllama``): a pair j rotated by ``pos[axis_F[j]] * freq_F[j]`` (``rotate_fixed``), and the
validation of ``base`` and of the empty parameter dict.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _checks, lie

APPLY_HPARAMS: tuple[str, ...] = ("base",)

_FAMILY = "rope"


def check_base(base, family: str) -> float:
    """``base`` must be a positive finite Python number (frequencies are fixed at trace time)."""
    if (
        isinstance(base, bool)
        or not isinstance(base, numbers.Real)
        or not math.isfinite(base)
        or base <= 0
    ):
        raise ValueError(f"{family}: base={base!r} must be a positive finite number")
    return float(base)


def check_no_params(params, family: str) -> None:
    """Parameter-free families take ``{}``: anything else is another family's parameters."""
    if params:
        raise ValueError(
            f"{family} has no parameters and expects params={{}}, got keys {sorted(params)}"
        )


def rotate_fixed(
    x_BTNH: jax.Array, pos: jax.Array, axis_F: np.ndarray, freq_F: np.ndarray
) -> jax.Array:
    """Rotate pair j of every head by ``pos[..., axis_F[j]] * freq_F[j]`` (fixed frequencies).

    The angles depend on the token only, so they are computed once per token (once for the
    whole batch when positions are shared) and broadcast over heads.

    Args:
      x_BTNH: queries or keys, any float dtype, already validated.
      pos: ``pos_TA`` shared by the batch or ``pos_BTA`` per example.
      axis_F: (F,) int, the position axis of pair j.
      freq_F: (F,) float, the frequency of pair j.

    Returns:
      (B, T, N, H) array in x's dtype.
    """
    return _rotate_fixed(
        x_BTNH,
        jnp.asarray(pos, jnp.float32),
        jnp.asarray(axis_F, jnp.int32),
        jnp.asarray(freq_F, jnp.float32),
    )


# Jitted so that eager calls compile one program per shape instead of one per primitive; inside
# a caller's jit it is inlined.
@jax.jit
def _rotate_fixed(x_BTNH, pos32, axis_F, freq32_F):
    angle_XF = pos32[..., axis_F] * freq32_F
    return lie.rotate_pairs(x_BTNH, angle_XF[..., None, :])  # (..., T, 1, F): same for all heads


def _check_one_axis(num_axes: int) -> None:
    if num_axes != 1:
        raise ValueError(
            f"rope encodes 1D positions (num_axes=1), got num_axes={num_axes}; use rope_axial "
            "or rope_mixed for 2D/3D positions"
        )


def _check_even(head_dim: int) -> None:
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even: rope rotates channel pairs (rope)")


def frequencies(head_dim: int, base: float = 10000.0) -> np.ndarray:
    """RoFormer's frequencies ``base^(-2j/H)`` for j < H/2, float64 of shape (H/2,)."""
    return base ** (-2.0 * np.arange(head_dim // 2) / head_dim)


def init(
    key: jax.Array, *, num_heads: int, head_dim: int, num_axes: int, base: float = 10000.0
) -> dict[str, jax.Array]:
    """Validate the configuration; RoPE has no parameters.

    Args:
      key: unused (kept for the common ``init`` signature).
      num_heads: number of heads N.
      head_dim: head dimension H, even.
      num_axes: number of position axes A, must be 1.
      base: frequency base (10000 in RoFormer).

    Returns:
      ``{}``.
    """
    del key
    _checks.check_shape_args(num_heads, head_dim, num_axes, _FAMILY)
    _check_one_axis(num_axes)
    _check_even(head_dim)
    check_base(base, _FAMILY)
    return {}


def apply(
    params: dict[str, jax.Array], x_BTNH: jax.Array, pos: jax.Array, *, base: float = 10000.0
) -> jax.Array:
    """Rotate queries or keys by R(p).

    Args:
      params: ``{}`` (from ``init``).
      x_BTNH: queries or keys (B, T, N, H), any float dtype, H even.
      pos: positions ``pos_TA`` (T, 1) shared by the batch, or ``pos_BTA`` (B, T, 1).
      base: frequency base, the same as given to ``init``.

    Returns:
      (B, T, N, H) array in x's dtype.
    """
    check_no_params(params, _FAMILY)
    _checks.check_x(x_BTNH, _FAMILY)
    _checks.check_pos(pos, x_BTNH, _FAMILY)
    _check_one_axis(pos.shape[-1])
    head_dim = x_BTNH.shape[-1]
    _check_even(head_dim)
    freq_F = frequencies(head_dim, check_base(base, _FAMILY))
    return rotate_fixed(x_BTNH, pos, np.zeros(len(freq_F), np.int32), freq_F)
