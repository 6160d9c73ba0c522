"""NoPE: no position encoding, the baseline for the other families.

R(p) = I for every position: ``apply`` returns the queries/keys unchanged, so attention is
permutation-equivariant and only the content of the tokens is seen. ``apply`` still validates x
and the positions like the rotary families do, so a bad input fails loudly rather than being
silently ignored. No parameters: ``init`` returns ``{}``; no hyperparameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rope_lie.encodings import _checks, family, state

_FAMILY = "nope"
FAMILY = family.Family(
    name=_FAMILY,
    kind="rotary",
    convention="integer",
    relative=True,
    apply_defaults={},
    stored_count=lambda num_heads, head_dim, num_axes, settings: 0,
    examples=(({}, (1, 2, 3)),),
)
APPLY_HPARAMS: tuple[str, ...] = tuple(FAMILY.apply_defaults)


def init(key: jax.Array, *, num_heads: int, head_dim: int, num_axes: int) -> dict[str, jax.Array]:
    """Validate the configuration; NoPE has no parameters.

    Args:
      key: unused (kept for the common ``init`` signature).
      num_heads: number of heads N.
      head_dim: head dimension H.
      num_axes: number of position axes A.

    Returns:
      ``{}``.
    """
    del key
    _checks.check_shape_args(num_heads, head_dim, num_axes, _FAMILY)
    return family.params(_FAMILY, {}, num_heads=num_heads, head_dim=head_dim, num_axes=num_axes)


def apply(params: dict[str, jax.Array], x_BTNH: jax.Array, pos: jax.Array) -> jax.Array:
    """Return queries or keys unchanged, after validating them and the positions.

    Args:
      params: ``{}`` (from ``init``).
      x_BTNH: queries or keys (B, T, N, H), any float dtype.
      pos: positions ``pos_TA`` shared by the batch, or ``pos_BTA`` per example.

    Returns:
      ``x_BTNH`` itself, (B, T, N, H) in x's dtype.
    """
    _checks.check_no_params(params, _FAMILY)
    _checks.check_x(x_BTNH, _FAMILY)
    _checks.check_pos(pos, x_BTNH, _FAMILY)
    family.check_made_for(params, _FAMILY, head_dim=x_BTNH.shape[-1], num_axes=jnp.shape(pos)[-1])
    return x_BTNH


def precompute(
    params: dict[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_prefix: int = 0,
) -> state.Unrotated:
    """The encoder state of NoPE: nothing to rotate (after validating the inputs).

    Args:
      params: ``{}`` (from ``init``).
      pos: positions ``pos_TA`` or ``pos_BTA``.
      num_heads: N.
      head_dim: H.
      num_prefix: prefix tokens.

    Returns:
      ``Unrotated()``.
    """
    _checks.check_no_params(params, _FAMILY)
    _checks.check_state_args(num_heads, head_dim, num_prefix, _FAMILY)
    pos = _checks.check_positions(pos, _FAMILY)
    family.check_made_for(params, _FAMILY, head_dim=head_dim, num_axes=pos.shape[-1])
    return state.Unrotated()
