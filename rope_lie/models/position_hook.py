"""The position-encoding hook of the attention: the one place where encoder families meet the model.

What a family contributes to an attention layer, from its parameters and the token positions,
goes through one contract (``docs/encoders.md``, ``encodings/state.py``):

- ``pe_encoder``: the family and its settings as one value (``encodings.Encoder``);
- ``precompute_pe``: the encoder's ``precompute(params, pos)``, its *state*:
  everything that depends on parameters and positions only, computed once per step (once per
  resolution at evaluation) and shared by the layers that share the parameters;
- ``fold_projection``: the state's position-independent ``fold_NHH`` (Cayley-STRING's P)
  folded into the q/k projection weights; the attention then applies ``state.rotate`` to q and
  k and adds ``state.bias_BNTS`` to the logits, the same calls for every family;
- ``init_pe_params``: the encoder's parameters as ``PositionParam`` variables (a ``NoDecay``
  parameter type, so that the optimiser excludes them from weight decay by type).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rope_lie import encodings
from rope_lie.encodings import extrapolation
from rope_lie.encodings.state import State
from rope_lie.models.variables import NoDecay


class PositionParam(NoDecay):
    """A position-encoding parameter (rotary frequencies/generators, ALiBi slopes, APE tables).

    A ``NoDecay`` (so an ``nnx.Param``): ``nnx.state(model, PositionParam)`` selects exactly the
    encoder parameters, and weight decay leaves them alone.
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


def pe_encoder(
    pe: str,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    share_heads: bool,
    hparams: Mapping[str, Any] | None = None,
) -> encodings.Encoder:
    """The encoder of a layer (or of all layers that share parameters): every static setting.

    Args:
      pe: family name (``pe_names()``).
      num_heads: N; the family is built for 1 head when ``share_heads``.
      head_dim: H.
      num_axes: A, position axes of the token grid.
      share_heads: one set of parameters for all heads.
      hparams: keyword arguments of the family's ``init``.

    Returns:
      the ``encodings.Encoder`` (hashable: a static attribute of the modules).
    """
    pe_module(pe)  # an unknown pe names the valid ones
    return encodings.encoder(
        pe,
        num_heads=1 if share_heads else num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        **dict(hparams or {}),
    )


def init_pe_params(encoder: encodings.Encoder, key: jax.Array) -> nnx.Dict:
    """Initialise one set of encoder parameters as ``PositionParam`` variables.

    Args:
      encoder: the layer's encoder (``pe_encoder``).
      key: PRNG key.

    Returns:
      ``nnx.Dict`` of ``PositionParam`` holding the family's arrays (empty for parameter-free
      families).
    """
    arrays = encoder.init(key)
    return nnx.Dict({name: PositionParam(value) for name, value in arrays.items()})


def precompute_pe(
    encoder: encodings.Encoder,
    params: Mapping[str, jax.Array],
    pos: jax.Array,
    *,
    num_prefix: int,
    fold: bool = True,
    scaling: extrapolation.Scaling | None = None,
) -> State:
    """The encoder state for a position set (the family's ``precompute``).

    Args:
      encoder: the layer's encoder (``pe_encoder``).
      params: its parameters, a mapping of arrays.
      pos: ``pos_TA`` (or ``pos_BTA``, per example).
      num_prefix: prefix (class) tokens at the start of the sequence.
      fold: leave a position-independent P (Cayley-STRING) to fold into the q/k projections
        (``state.to_fold()``, D N H^2 work per layer); False keeps it in the state, whose
        ``rotate`` then applies it to every token (B T N H^2, what the reference code does).
        The same logits either way, to float32 rounding.
      scaling: an extrapolation tool resolved at the evaluation grid
        (``extrapolation.resolve``); None (the default): the family's own state.

    Returns:
      the family's state (``encodings/state.py``), a pytree of arrays.
    """
    if scaling is None:
        pe_state = encoder.precompute(params, pos, num_prefix=num_prefix)
    else:
        pe_state = extrapolation.precompute(
            encoder, params, pos, num_prefix=num_prefix, scaling=scaling
        )
    return pe_state.to_fold() if fold else pe_state


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
