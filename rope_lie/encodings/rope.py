"""RoPE (RoFormer, Su et al., arXiv:2104.09864): rotary position encoding of 1D positions.

R(p) rotates the interleaved channel pair (2j, 2j+1) of every head by the angle

    theta_j(p) = p * base^(-2j/H),    j = 0, ..., H/2 - 1,    base = 10000,

so <R(p) q, R(p') k> = <q, R(p' - p) k> depends on p' - p only (RoFormer section 3.2).

Conventions: interleaved pairs, (a, b) -> (a cos t - b sin t, a sin t + b cos t); R(p) multiplies
q and k from the left (never v); positions are ``pos_TA`` or ``pos_BTA`` with A = 1 (use
``rope_axial`` or ``rope_mixed`` for images and volumes); prefix (class) tokens sit at position 0
and get R(0) = I, i.e. they are not rotated. Angles, cos and sin are float32 whatever x's dtype;
the output has x's dtype. No parameters: ``init`` returns ``{}``.

The validation and the rotation are ``fixed_frequency``'s, shared with ``rope_axial`` and
``visionllama``; this module holds RoFormer's frequency table.
"""

from __future__ import annotations

import jax
import numpy as np

from rope_lie.encodings import family, fixed_frequency, state

_FAMILY = "rope"
FAMILY = family.Family(
    name=_FAMILY,
    kind="rotary",
    convention="integer",
    relative=True,
    apply_defaults={"base": 10000.0, "rotary_fraction": 1.0},
    stored_count=lambda num_heads, head_dim, num_axes, settings: 0,
    examples=(({}, (1,)), ({"rotary_fraction": 0.5}, (1,))),  # p-RoPE: lowest pairs unrotated
    pair_spectrum=lambda head_dim, num_axes, s: pair_frequencies(head_dim, num_axes, s["base"]),
)
APPLY_HPARAMS: tuple[str, ...] = tuple(FAMILY.apply_defaults)


def _check_dims(head_dim: int, num_axes: int) -> None:
    if num_axes != 1:
        raise ValueError(
            f"rope encodes 1D positions (num_axes=1), got num_axes={num_axes}; use rope_axial "
            "or rope_mixed for 2D/3D positions"
        )
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even: rope rotates channel pairs (rope)")


def frequencies(head_dim: int, base: float = 10000.0) -> np.ndarray:
    """RoFormer's frequencies ``base^(-2j/H)`` for j < H/2, float64 of shape (H/2,)."""
    return base ** (-2.0 * np.arange(head_dim // 2) / head_dim)


def pair_frequencies(head_dim: int, num_axes: int, base: float = 10000.0):
    """(axis_F, freq_F): every pair on the one axis, RoFormer's frequencies."""
    del num_axes  # 1
    freq_F = frequencies(head_dim, base)
    return np.zeros(len(freq_F), np.int64), freq_F


def init(
    key: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    base: float = 10000.0,
    rotary_fraction: float = 1.0,
) -> dict[str, jax.Array]:
    """Validate the configuration; RoPE has no parameters.

    Args:
      key: unused (kept for the common ``init`` signature).
      num_heads: number of heads N.
      head_dim: head dimension H, even.
      num_axes: number of position axes A, must be 1.
      base: frequency base (10000 in RoFormer).
      rotary_fraction: p-RoPE's fraction of pairs rotated, the highest frequencies
        (``fixed_frequency``); 1 = all.

    Returns:
      ``{}``.
    """
    del key
    fixed_frequency.init(
        _FAMILY,
        _check_dims,
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        base=base,
        rotary_fraction=rotary_fraction,
    )
    return family.params(
        _FAMILY,
        {},
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        base=base,
        rotary_fraction=rotary_fraction,
    )


def apply(
    params: dict[str, jax.Array],
    x_BTNH: jax.Array,
    pos: jax.Array,
    *,
    base: float = family.INIT,
    rotary_fraction: float = family.INIT,
) -> jax.Array:
    """Rotate queries or keys by R(p).

    Args:
      params: ``{}`` (from ``init``).
      x_BTNH: queries or keys (B, T, N, H), any float dtype, H even.
      pos: positions ``pos_TA`` (T, 1) shared by the batch, or ``pos_BTA`` (B, T, 1).
      base, rotary_fraction: ``init``'s (read from its parameters; a plain ``{}``: these
        arguments, else 10000 and 1).

    Returns:
      (B, T, N, H) array in x's dtype.
    """
    settings = family.bound(params, _FAMILY, base=base, rotary_fraction=rotary_fraction)
    return fixed_frequency.apply(
        _FAMILY, _check_dims, pair_frequencies, params, x_BTNH, pos, **settings
    )


def precompute(
    params: dict[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_prefix: int = 0,
    base: float = family.INIT,
    rotary_fraction: float = family.INIT,
) -> state.PairAngles:
    """The rotation angles of every token (the encoder state, ``encodings/state.py``).

    Args:
      params: ``{}`` (from ``init``).
      pos: positions pos_TA (T, 1) or pos_BTA (B, T, 1).
      num_heads: N (the angles are the same for every head).
      head_dim: H.
      num_prefix: prefix tokens (at position 0, not rotated).
      base, rotary_fraction: ``init``'s (read from its parameters; a plain ``{}``: these
        arguments, else 10000 and 1).

    Returns:
      ``PairAngles`` of shape (T, 1, H/2), or (B, T, 1, H/2) per example; float32.
    """
    settings = family.bound(params, _FAMILY, base=base, rotary_fraction=rotary_fraction)
    return fixed_frequency.precompute(
        _FAMILY,
        _check_dims,
        pair_frequencies,
        params,
        pos,
        num_heads=num_heads,
        head_dim=head_dim,
        num_prefix=num_prefix,
        **settings,
    )
