"""DINOv3's RoPE (Simeoni et al., arXiv:2508.10104; facebookresearch/dinov3,
``dinov3/layers/rope_position_encoding.py``, ``RopePositionEmbedding``): axial, fixed periods.

For A position axes and P = H / (2A) periods per axis, pair a P + i of every head turns by

    theta(p) = 2 pi p_a / period_i,    period_i = base^(2A i / H)    (base = 100),

or, with ``min_period`` and ``max_period`` instead of ``base``, periods spaced geometrically from
min to max: period_i = min_period (max_period / min_period)^(i / (P - 1)). For A = 2 this is the
reference's ``periods`` (D_head // 4 of them, base^(2i / (D_head / 2))) and its angle layout
[axis 0's P angles, axis 1's P angles]; with ``base`` it is ``rope_axial`` with 2 pi times its
frequencies. Every pair sees one axis: q.k depends on p' - p only.

Positions: the reference's coordinates are the pixel centres normalised to [-1, 1] per axis,
2 (i + 0.5) / n - 1 (``normalize_coords="separate"``), or divided by the longest / shortest side
("max" / "min"): ``positions``' conventions ``"centred"``, ``"centred_max"``,
``"centred_min"`` (``config_lib`` gives this family ``"centred"``). Its prefix tokens (class
and registers) are not rotated: ours sit at position 0, where R(0) = I. Its train-time
augmentations of the coordinates (shift, jitter, rescale) are ``positions.augment``, drawn from
an explicit key.

Where we differ: the reference rotates half-split pairs (channels c and c + H/2,
``rope_rotate_half``); ours are interleaved (2c, 2c + 1), the same rotation after a fixed
permutation of the q and k channels (a converter permutes the projection columns:
``interop.timm_eva.qk_permutation`` for timm's port, ``RotaryEmbeddingDinoV3``, whose ViTs
convert with equal logits). The reference computes the angles in the periods' dtype (its
checkpoints store bf16 periods); ours are float32, as timm's.

Conventions: interleaved pairs, (a, b) -> (a cos t - b sin t, a sin t + b cos t); R(p)
multiplies q and k from the left; no parameters (``{}``); validation and rotation are
``fixed_frequency``'s (so ``rotary_fraction``, p-RoPE, applies too).
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from rope_lie.encodings import _checks, family, fixed_frequency, state

_FAMILY = "dinov3"
FAMILY = family.Family(
    name=_FAMILY,
    kind="rotary",
    convention="centred",
    relative=True,
    apply_defaults={"base": 100.0, "min_period": None, "max_period": None, "rotary_fraction": 1.0},
    stored_count=lambda num_heads, head_dim, num_axes, settings: 0,
    examples=(
        ({}, (2, 3)),
        ({"base": None, "min_period": 0.5, "max_period": 20.0}, (2,)),
    ),
    pair_spectrum=lambda head_dim, num_axes, s: pair_frequencies(
        head_dim, num_axes, s["base"], min_period=s["min_period"], max_period=s["max_period"]
    ),
)
APPLY_HPARAMS: tuple[str, ...] = tuple(FAMILY.apply_defaults)


def _check_dims(head_dim: int, num_axes: int) -> None:
    _checks.check_divisible(head_dim, 2 * num_axes, "2*num_axes", _FAMILY)


def _check_periods(base, min_period, max_period) -> None:
    both = min_period is not None and max_period is not None
    if (base is None) == (not both) or (min_period is None) != (max_period is None):
        raise ValueError(
            f"{_FAMILY}: give either base or both min_period and max_period, got base={base!r}, "
            f"min_period={min_period!r}, max_period={max_period!r}"
        )
    if both:
        for name, value in (("min_period", min_period), ("max_period", max_period)):
            _checks.check_base(value, f"{_FAMILY} ({name})")


def periods(head_dim: int, num_axes: int, base=100.0, min_period=None, max_period=None):
    """The P = H / (2A) periods of every axis, float64 (the reference's ``_init_weights``)."""
    num_periods = head_dim // (2 * num_axes)
    if base is not None:
        return base ** (2.0 * num_axes * np.arange(num_periods) / head_dim)
    ratio = max_period / min_period
    exponents = np.linspace(0.0, 1.0, num_periods)
    return ratio**exponents / ratio * max_period


def pair_frequencies(head_dim: int, num_axes: int, base=100.0, *, min_period=None, max_period=None):
    """(axis_F, freq_F): pair a P + i has axis a and angular frequency 2 pi / period_i."""
    if min_period is not None:  # the periods replace the base
        base = None
    per_axis = periods(head_dim, num_axes, base, min_period, max_period)
    axis_F = np.repeat(np.arange(num_axes), len(per_axis))
    return axis_F, np.tile(2.0 * math.pi / per_axis, num_axes)


def _table(min_period, max_period):
    return functools.partial(pair_frequencies, min_period=min_period, max_period=max_period)


def _base_arg(base) -> float:
    """``fixed_frequency`` validates a base; with min/max periods the base is None (unused)."""
    return 1.0 if base is None else base


def init(
    key: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    base: float | None = 100.0,
    min_period: float | None = None,
    max_period: float | None = None,
    rotary_fraction: float = 1.0,
) -> dict[str, jax.Array]:
    """Validate the configuration; DINOv3's RoPE has no parameters.

    Args:
      key: unused (kept for the common ``init`` signature).
      num_heads: N.
      head_dim: H, divisible by 2 A.
      num_axes: A.
      base: period base (100 in DINOv3), or None with ``min_period`` and ``max_period``.
      min_period: shortest period (with ``max_period``, ``base=None``).
      max_period: longest period.
      rotary_fraction: p-RoPE's fraction of pairs rotated per axis (``fixed_frequency``).

    Returns:
      ``{}``.
    """
    del key
    _check_periods(base, min_period, max_period)
    fixed_frequency.init(
        _FAMILY,
        _check_dims,
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        base=_base_arg(base),
        rotary_fraction=rotary_fraction,
    )
    return family.params(
        _FAMILY,
        {},
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        base=base,
        min_period=min_period,
        max_period=max_period,
        rotary_fraction=rotary_fraction,
    )


def apply(
    params: dict[str, jax.Array],
    x_BTNH: jax.Array,
    pos: jax.Array,
    *,
    base: float | None = family.INIT,
    min_period: float | None = family.INIT,
    max_period: float | None = family.INIT,
    rotary_fraction: float = family.INIT,
) -> jax.Array:
    """Rotate queries or keys by R(p).

    Args:
      params: ``{}``.
      x_BTNH: queries or keys (B, T, N, H).
      pos: ``pos_TA`` or ``pos_BTA`` (e.g. ``positions.grid_positions(grid, "centred")``).
      base, min_period, max_period, rotary_fraction: ``init``'s (read from its parameters; a
        plain ``{}``: these arguments, else ``init``'s defaults).

    Returns:
      (B, T, N, H) in x's dtype.
    """
    s = _bound(params, base, min_period, max_period, rotary_fraction)
    return fixed_frequency.apply(
        _FAMILY,
        _check_dims,
        _table(s["min_period"], s["max_period"]),
        params,
        x_BTNH,
        pos,
        base=_base_arg(s["base"]),
        rotary_fraction=s["rotary_fraction"],
    )


def precompute(
    params: dict[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_prefix: int = 0,
    base: float | None = family.INIT,
    min_period: float | None = family.INIT,
    max_period: float | None = family.INIT,
    rotary_fraction: float = family.INIT,
) -> state.PairAngles:
    """The rotation angles of every token (the encoder state).

    Args:
      params: ``{}``.
      pos: ``pos_TA`` or ``pos_BTA``.
      num_heads: N (the angles are the same for every head).
      head_dim: H.
      num_prefix: prefix tokens (at position 0, not rotated).
      base, min_period, max_period, rotary_fraction: ``init``'s (read from its parameters; a
        plain ``{}``: these arguments, else ``init``'s defaults).

    Returns:
      ``PairAngles`` (T, 1, H/2) or (B, T, 1, H/2); float32.
    """
    s = _bound(params, base, min_period, max_period, rotary_fraction)
    return fixed_frequency.precompute(
        _FAMILY,
        _check_dims,
        _table(s["min_period"], s["max_period"]),
        params,
        pos,
        num_heads=num_heads,
        head_dim=head_dim,
        num_prefix=num_prefix,
        base=_base_arg(s["base"]),
        rotary_fraction=s["rotary_fraction"],
    )


def _bound(params, base, min_period, max_period, rotary_fraction) -> dict:
    """The settings of the call (``family.bound``), the periods checked."""
    s = family.bound(
        params,
        _FAMILY,
        base=base,
        min_period=min_period,
        max_period=max_period,
        rotary_fraction=rotary_fraction,
    )
    _check_periods(s["base"], s["min_period"], s["max_period"])
    return s
