"""The machinery shared by the fixed-frequency rotary families: rope, rope_axial, visionllama.

Each of them rotates channel pair j of every head by ``pos[..., axis_F[j]] * freq_F[j]``, with a
table (axis_F, freq_F) that depends only on (H, A, base) and the family; they differ only in
that table and in which (H, A) they accept. A family module defines those two and calls
``init``/``precompute``/``apply`` here, which do the validation, the float32 angles (once per
token, one set for every head: a ``state.PairAngles`` with N = 1) and the rotation, so the three
cannot drift apart.

Conventions: interleaved pairs (2j, 2j+1), (a, b) -> (a cos t - b sin t, a sin t + b cos t);
R(p) multiplies q and k from the left; prefix tokens at position 0 get R(0) = I; no parameters
(``{}``); angles, cos and sin in float32, output in x's dtype.

Partial rotation (p-RoPE, Barbero et al., "Round and Round We Go! What makes Rotary Positional
Encodings useful?", arXiv:2410.06205): ``rotary_fraction`` = p < 1 keeps, on every axis, the
round(p n_a) highest of its n_a frequencies (halves rounded up) and sets the others to 0, so
that those pairs are not rotated (the paper truncates the lowest frequencies of 1D RoPE; per
axis is our generalisation to several axes; ties are kept in pair order). The paper's code
(``apply_p_rope``: ``int(p * head_dim // 2)``) rounds down instead: at a half (p = 0.25 of 6
pairs, 0.75 of 2) we keep one pair more. p = 1 (the default) leaves the table untouched, p = 0
is NoPE.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _checks, state
from rope_lie.encodings.family import check_made_for

# (head_dim, num_axes, base) -> (axis_F, freq_F) of the F = H/2 pairs.
PairTable = Callable[[int, int, float], tuple[np.ndarray, np.ndarray]]
# (head_dim, num_axes) -> None, raising ValueError for shapes the family does not accept.
DimsCheck = Callable[[int, int], None]


def check_fraction(rotary_fraction, family: str) -> float:
    """``rotary_fraction`` must be a number in [0, 1]."""
    if isinstance(rotary_fraction, bool) or not (
        isinstance(rotary_fraction, (int, float)) and 0.0 <= rotary_fraction <= 1.0
    ):
        raise ValueError(f"{family}: rotary_fraction={rotary_fraction!r} must be in [0, 1]")
    return float(rotary_fraction)


def kept_count(fraction: float, num_pairs: int) -> int:
    """round(fraction * num_pairs), halves rounded up: how many pairs p-RoPE keeps rotating."""
    return int(np.floor(fraction * num_pairs + 0.5))


def keep_high_frequencies(axis_F: np.ndarray, freq_F: np.ndarray, fraction: float) -> np.ndarray:
    """p-RoPE: on every axis, all but the round(fraction n_a) highest frequencies set to 0.

    Args:
      axis_F: (F,) axis of every pair.
      freq_F: (F,) frequency of every pair.
      fraction: p in [0, 1].

    Returns:
      float64 (F,) frequencies, 0 for the pairs left unrotated.
    """
    freq_F = np.array(freq_F, np.float64)
    for axis in np.unique(axis_F):
        pairs = np.flatnonzero(axis_F == axis)
        order = pairs[np.argsort(-np.abs(freq_F[pairs]), kind="stable")]
        freq_F[order[kept_count(fraction, len(pairs)) :]] = 0.0
    return freq_F


def init(
    family: str,
    check_dims: DimsCheck,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    base,
    rotary_fraction=1.0,
) -> dict[str, jax.Array]:
    """Validate a fixed-frequency family's configuration; returns ``{}``."""
    _checks.check_shape_args(num_heads, head_dim, num_axes, family)
    check_dims(head_dim, num_axes)
    _checks.check_base(base, family)
    check_fraction(rotary_fraction, family)
    return {}


def precompute(
    family: str,
    check_dims: DimsCheck,
    pair_table: PairTable,
    params: dict[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_prefix: int,
    base,
    rotary_fraction=1.0,
) -> state.PairAngles:
    """Validate, then the angles ``pos[..., axis_F[j]] * freq_F[j]`` of every token and pair.

    The angles depend on the token only: one set (N = 1) serves every head. With
    ``rotary_fraction`` < 1 the lowest frequencies of every axis are 0 (p-RoPE).

    Returns:
      ``PairAngles`` with ``angle_TNF`` (T, 1, F), or (B, T, 1, F) for ``pos_BTA``; float32.
    """
    _checks.check_no_params(params, family)
    _checks.check_state_args(num_heads, head_dim, num_prefix, family)
    pos = _checks.check_positions(pos, family)
    num_axes = pos.shape[-1]
    check_made_for(params, family, head_dim=head_dim, num_axes=num_axes)
    check_dims(head_dim, num_axes)
    axis_F, freq_F = pair_table(head_dim, num_axes, _checks.check_base(base, family))
    fraction = check_fraction(rotary_fraction, family)
    if fraction != 1.0:
        freq_F = keep_high_frequencies(axis_F, freq_F, fraction)
    angle_XF = _angles(
        jnp.asarray(pos, jnp.float32),
        jnp.asarray(axis_F, jnp.int32),
        jnp.asarray(freq_F, jnp.float32),
    )
    return state.PairAngles(angle_XF[..., None, :])


def apply(
    family: str,
    check_dims: DimsCheck,
    pair_table: PairTable,
    params: dict[str, jax.Array],
    x_BTNH: jax.Array,
    pos: jax.Array,
    *,
    base,
    rotary_fraction=1.0,
) -> jax.Array:
    """Validate, then rotate queries or keys by the family's R(p) (``pos_TA`` or ``pos_BTA``)."""
    _checks.check_x(x_BTNH, family)
    _checks.check_pos(pos, x_BTNH, family)
    pe = precompute(
        family,
        check_dims,
        pair_table,
        params,
        pos,
        num_heads=x_BTNH.shape[2],
        head_dim=x_BTNH.shape[3],
        num_prefix=0,
        base=base,
        rotary_fraction=rotary_fraction,
    )
    return pe.rotate(x_BTNH)


# Jitted so that eager calls compile one program per shape instead of one per primitive; inside
# a caller's jit it is inlined.
@jax.jit
def _angles(pos32: jax.Array, axis_F: jax.Array, freq32_F: jax.Array) -> jax.Array:
    pos_XF = pos32[..., axis_F]
    return pos_XF * jnp.expand_dims(freq32_F, tuple(range(pos_XF.ndim - 1)))
