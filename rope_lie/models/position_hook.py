"""The position-encoding hook of the attention: the one place where encoder families meet the model.

What a family contributes to an attention layer, from its parameters and the token positions:

- ``precompute_pe``: the encoder *state*, everything that depends on parameters and positions
  only, computed once per step (once per resolution at evaluation) and shared by the layers
  that share the parameters: a bias family's bias, a family's ``precompute`` (LieRE's
  rotations, RoPE-Mixed's angles), its ``precompute_folded`` (Cayley-STRING: P to fold into
  the q/k projections, and the angles), or else the parameters and positions themselves;
- ``apply_pe``: that state applied to queries and keys (or returned as the logit bias);
- ``fold_projection``: a position-independent P folded into the projection weights;
- ``init_pe_params``: the family's parameters as ``PositionParam`` variables (an ``nnx.Param``
  subclass, so that the optimiser can exclude them from weight decay by type).

The dispatch here still goes by family membership and ``hasattr``, and the states are dicts
told apart by their keys; issue 12 replaces that by one typed state contract
(``docs/encoders.md``, section 6).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rope_lie import encodings


class PositionParam(nnx.Param):
    """A position-encoding parameter (rotary frequencies/generators, ALiBi slopes, APE tables).

    A subclass of ``nnx.Param`` so that ``nnx.state(model, PositionParam)`` selects exactly the
    encoder parameters (e.g. to exclude them from weight decay).
    """


def pe_names() -> list[str]:
    """The valid values of ``pe``: every rotary and bias family."""
    return sorted(encodings.ROTARY) + sorted(encodings.BIAS)


def pe_module(pe: str) -> ModuleType:
    """The encoder module of a rotary or bias family.

    Args:
      pe: a key of ``encodings.ROTARY`` or ``encodings.BIAS``.

    Returns:
      the family's module (``init``/``apply`` or ``init``/``bias``).
    """
    if pe in encodings.ROTARY:
        return encodings.ROTARY[pe]
    if pe in encodings.BIAS:
        return encodings.BIAS[pe]
    raise ValueError(f"unknown pe={pe!r}; expected one of {pe_names()}")


def init_pe_params(
    pe: str,
    key: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    share_heads: bool,
    hparams: Mapping[str, Any] | None = None,
) -> nnx.Dict:
    """Initialise one set of encoder parameters as ``PositionParam`` variables.

    Args:
      pe: family name (``pe_names()``).
      key: PRNG key.
      num_heads: N; the family is initialised with 1 head when ``share_heads``.
      head_dim: H.
      num_axes: A, position axes of the token grid.
      share_heads: one set of parameters for all heads.
      hparams: keyword arguments of the family's ``init``.

    Returns:
      ``nnx.Dict`` of ``PositionParam`` holding the family's arrays (empty for parameter-free
      families).
    """
    arrays = pe_module(pe).init(
        key,
        num_heads=1 if share_heads else num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        **dict(hparams or {}),
    )
    return nnx.Dict({name: PositionParam(value) for name, value in arrays.items()})


def apply_hparams(pe: str, hparams: Mapping[str, Any] | None) -> dict[str, Any]:
    """The subset of ``hparams`` that the family's ``apply``/``bias`` also takes."""
    names = getattr(pe_module(pe), "APPLY_HPARAMS", ())
    return {k: v for k, v in (hparams or {}).items() if k in names}


def rotate_qk(
    module: ModuleType,
    params: Mapping[str, jax.Array],
    q_BTNH: jax.Array,
    k_BTNH: jax.Array,
    pos: jax.Array,
    *,
    share_heads: bool,
    hparams: Mapping[str, Any],
) -> tuple[jax.Array, jax.Array]:
    """Rotate queries and keys with the family's ``apply`` (one call each).

    Args:
      module: a rotary family module.
      params: its parameters (for 1 head when ``share_heads``).
      q_BTNH: queries.
      k_BTNH: keys, same shape.
      pos: ``pos_TA`` shared by the batch or ``pos_BTA`` per example.
      share_heads: fold the heads into the batch and rotate them all with the same parameters.
      hparams: the family's apply hyperparameters.

    Returns:
      (q_BTNH, k_BTNH) rotated, in their dtype.
    """
    return (
        _rotate_one(module, params, q_BTNH, pos, share_heads=share_heads, hparams=hparams),
        _rotate_one(module, params, k_BTNH, pos, share_heads=share_heads, hparams=hparams),
    )


def _rotate_one(module, params, x_BTNH, pos, *, share_heads: bool, hparams) -> jax.Array:
    """``module.apply`` on q or k; shared heads are folded into the batch (1-head params)."""
    if not share_heads:
        return module.apply(params, x_BTNH, pos, **hparams)
    batch, tokens, heads, head_dim = x_BTNH.shape
    x_MT1H = jnp.transpose(x_BTNH, (2, 0, 1, 3)).reshape(heads * batch, tokens, 1, head_dim)
    if pos.ndim == 3:
        pos = jnp.tile(pos, (heads, 1, 1))
    x_MT1H = module.apply(params, x_MT1H, pos, **hparams)
    return jnp.transpose(x_MT1H.reshape(heads, batch, tokens, head_dim), (1, 2, 0, 3))


def position_bias(
    module: ModuleType,
    params: Mapping[str, jax.Array],
    pos_TA: jax.Array,
    *,
    num_heads: int,
    num_prefix: int,
    hparams: Mapping[str, Any],
) -> jax.Array:
    """The attention-logit bias of a bias family, shaped for ``attend`` (B, N, T, S).

    Args:
      module: a bias family module (ALiBi).
      params: its parameters.
      pos_TA: token positions shared by the batch (queries and keys are the same tokens).
      num_heads: heads the parameters were initialised for (1 when shared across heads).
      num_prefix: prefix (class) tokens at the start of the sequence.
      hparams: the family's apply hyperparameters.

    Returns:
      (1, N, T, T) float32 bias (N = 1 broadcasts over the heads).
    """
    if pos_TA.ndim != 2:
        raise ValueError(
            f"bias families take positions shared by the batch, shape (T, A); got shape "
            f"{tuple(pos_TA.shape)}"
        )
    bias_NTS = module.bias(
        params, pos_TA, pos_TA, num_heads=num_heads, num_prefix=num_prefix, **hparams
    )
    return bias_NTS[None]


def precompute_pe(
    module: ModuleType,
    params: Mapping[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    num_prefix: int,
    hparams: Mapping[str, Any],
) -> dict[str, Any]:
    """The encoder state for a position set: everything the hook needs that depends on the
    parameters and positions only, computed once and shared by every layer that shares them.

    Args:
      module: the family's module.
      params: its parameters (for 1 head when shared across heads).
      pos: ``pos_TA`` (or ``pos_BTA`` for rotary families).
      num_heads: heads the parameters were initialised for (bias families).
      num_prefix: prefix (class) tokens at the start of the sequence (bias families).
      hparams: the family's apply hyperparameters.

    Returns:
      {"bias_1NTS": bias} for bias families; for rotary families that define
      ``precompute_folded`` (Cayley-STRING) {"fold_NHH": P, "rotations": the rest}, P to fold
      into the q/k projections; {"rotations": module.precompute(params, pos)} for those that
      define ``precompute`` (LieRE, RoPE-Mixed); else {"params": params, "pos": pos}.
    """
    if module in encodings.BIAS.values():
        bias = position_bias(
            module, params, pos, num_heads=num_heads, num_prefix=num_prefix, hparams=hparams
        )
        return {"bias_1NTS": bias}
    if hasattr(module, "precompute_folded"):
        fold_NHH, rotations = module.precompute_folded(params, pos, **hparams)
        return {"fold_NHH": fold_NHH, "rotations": rotations}
    if hasattr(module, "precompute"):
        return {"rotations": module.precompute(params, pos, **hparams)}
    return {"params": dict(params), "pos": pos}


def fold_projection(
    fold_NHH: jax.Array, w_DNH: jax.Array, b_NH: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Weights and biases of ``P (x w + b)``: ``(w P^T, P b)`` per head, in float32.

    Args:
      fold_NHH: per-head P (N = 1: one P for every head).
      w_DNH: projection weights.
      b_NH: projection biases.

    Returns:
      (w_DNH, b_NH) folded.
    """
    p = fold_NHH.astype(jnp.float32)
    heads = "n" if p.shape[0] == w_DNH.shape[1] else ""
    p = p if heads else p[0]
    hi = jax.lax.Precision.HIGHEST
    w = jnp.einsum(f"{heads}ij,dnj->dni", p, w_DNH.astype(jnp.float32), precision=hi)
    b = jnp.einsum(f"{heads}ij,nj->ni", p, b_NH.astype(jnp.float32), precision=hi)
    return w, b


def apply_pe(
    module: ModuleType,
    state: Mapping[str, Any],
    q_BTNH: jax.Array,
    k_BTNH: jax.Array,
    *,
    share_heads: bool,
    hparams: Mapping[str, Any],
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Apply an encoder state from ``precompute_pe`` to queries and keys.

    Returns:
      (q_BTNH, k_BTNH, bias_1NTS or None).
    """
    if "bias_1NTS" in state:
        return q_BTNH, k_BTNH, state["bias_1NTS"]
    if "rotations" in state:
        # Precomputed rotations: q and k each cost only their application; rotations for one
        # head apply to every head.
        rot = state["rotations"]
        return module.apply_precomputed(rot, q_BTNH), module.apply_precomputed(rot, k_BTNH), None
    q_BTNH, k_BTNH = rotate_qk(
        module, state["params"], q_BTNH, k_BTNH, state["pos"], share_heads=share_heads,
        hparams=hparams,
    )  # fmt: skip
    return q_BTNH, k_BTNH, None
