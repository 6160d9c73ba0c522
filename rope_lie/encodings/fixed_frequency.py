"""The machinery shared by the fixed-frequency rotary families: rope, rope_axial, visionllama.

Each of them rotates channel pair j of every head by ``pos[..., axis_F[j]] * freq_F[j]``, with a
table (axis_F, freq_F) that depends only on (H, A, base) and the family; they differ only in
that table and in which (H, A) they accept. A family module defines those two and calls
``init``/``apply`` here, which do the validation, the float32 angles and the rotation (once per
token, broadcast over heads), so the three cannot drift apart.

Conventions: interleaved pairs (2j, 2j+1), (a, b) -> (a cos t - b sin t, a sin t + b cos t);
R(p) multiplies q and k from the left; prefix tokens at position 0 get R(0) = I; no parameters
(``{}``); angles, cos and sin in float32, output in x's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _checks, lie

# (head_dim, num_axes, base) -> (axis_F, freq_F) of the F = H/2 pairs.
PairTable = Callable[[int, int, float], tuple[np.ndarray, np.ndarray]]
# (head_dim, num_axes) -> None, raising ValueError for shapes the family does not accept.
DimsCheck = Callable[[int, int], None]


def init(
    family: str, check_dims: DimsCheck, *, num_heads: int, head_dim: int, num_axes: int, base
) -> dict[str, jax.Array]:
    """Validate a fixed-frequency family's configuration; returns ``{}``."""
    _checks.check_shape_args(num_heads, head_dim, num_axes, family)
    check_dims(head_dim, num_axes)
    _checks.check_base(base, family)
    return {}


def apply(
    family: str,
    check_dims: DimsCheck,
    pair_table: PairTable,
    params: dict[str, jax.Array],
    x_BTNH: jax.Array,
    pos: jax.Array,
    *,
    base,
) -> jax.Array:
    """Validate, then rotate queries or keys by the family's R(p) (``pos_TA`` or ``pos_BTA``)."""
    _checks.check_no_params(params, family)
    _checks.check_x(x_BTNH, family)
    _checks.check_pos(pos, x_BTNH, family)
    num_axes, head_dim = pos.shape[-1], x_BTNH.shape[-1]
    _checks.check_positive_int(num_axes, "num_axes", family)
    check_dims(head_dim, num_axes)
    axis_F, freq_F = pair_table(head_dim, num_axes, _checks.check_base(base, family))
    return rotate_fixed(x_BTNH, pos, axis_F, freq_F)


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
      freq_F: (F,) float, the frequency of pair j (0: the pair is not rotated).

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
