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
  parameter type, so that the optimiser excludes them from weight decay by type);
- ``layer_states``: every layer's state, one precompute per layer or one vmapped over the
  stacked layers, by platform (``LAYER_PLANS``);
- ``PECache``: every layer's state at one token grid, with that grid, so that a model given it
  for images of another grid refuses it (``ViT.precompute_pe``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rope_lie import encodings
from rope_lie.encodings import _checks, extrapolation
from rope_lie.encodings.state import State
from rope_lie.models.variables import NoDecay


class PositionParam(NoDecay):
    """A position-encoding parameter (rotary frequencies/generators, ALiBi slopes, APE tables).

    A ``NoDecay`` (so an ``nnx.Param``): ``nnx.state(model, PositionParam)`` selects exactly the
    encoder parameters, and weight decay leaves them alone.
    """


@dataclasses.dataclass(frozen=True)
class PECache(Sequence):
    """Every block's encoder state at one token grid (``ViT.precompute_pe``), and that grid.

    A sequence of the states, as a list of them would be. The grid is static (pytree
    metadata), so a jitted evaluation step compiles once per grid, as it does per image size.
    A model refuses a cache whose grid is not its images' grid: two grids with equal token
    counts give states of equal shapes, which would otherwise be used silently.
    """

    states: tuple[State, ...]
    grid: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def __getitem__(self, index):
        return self.states[index]

    def __len__(self) -> int:
        return len(self.states)


jax.tree_util.register_dataclass(PECache, data_fields=["states"], meta_fields=["grid"])
# An evaluation step that takes a cache can be exported and serialised (jax.export).
jax.export.register_pytree_node_serialization(
    PECache,
    serialized_name="rope_lie.models.PECache",
    serialize_auxdata=lambda meta: json.dumps(meta).encode(),  # (grid,)
    deserialize_auxdata=lambda data: tuple(tuple(field) for field in json.loads(data)),
)


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
        num_heads=encoder_heads(pe, num_heads, share_heads, hparams),
        head_dim=head_dim,
        num_axes=num_axes,
        **dict(hparams or {}),
    )


def encoder_heads(
    pe: str, num_heads: int, share_heads: bool, hparams: Mapping[str, Any] | None = None
) -> int:
    """The heads a family is built for: 1 when the heads share its parameters (its state then
    broadcasts over them). Fixed ALiBi has no parameters to share: built for 1 head it would
    give every head the 1-head slope 2^-8, about no bias, so it is refused."""
    if share_heads and pe == "alibi" and not dict(hparams or {}).get("learnable", False):
        raise ValueError(
            f"alibi: share_heads (share_pe_heads) with fixed slopes would give all {num_heads} "
            "heads the 1-head slope 2^-8 (about no bias); ALiBi's slopes are per head. Leave "
            "it off, or share learnable slopes (learnable=True)"
        )
    return 1 if share_heads else num_heads


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


# How the states of layers with their own parameters are computed, by platform
# (``jax.default_backend()``, read when a program is traced; "default" for platforms not named):
# - "each": one precompute per layer. The CPU's: its programs, and so its numbers, stay as
#   they were measured (the goldens, the quickstart table, the studies).
# - "batched": the layers' parameters stacked and one ``jax.vmap``-ed precompute. One program
#   instead of one per layer: LieRE's squaring loop runs once per step, not once per layer
#   (its trip count is read on the host each iteration on a GPU), and its small products are
#   one kernel each for all layers (Cayley-STRING's solve and ComRoPE's eigendecomposition
#   alike). Equal to "each" to float32 rounding. Chosen for GPUs and TPUs from the lowered
#   programs (``tests/models/test_layer_plans.py``). On an H100 (ViT-B/16 224 px, batch 64,
#   LieRE 8x8, fixed squaring loops then) the two were within 1.5 %: 44.4 ms a step batched,
#   43.8 ms each, the latter with 7 ms less work on the GPU and as much more waiting
#   (benchmarks README, section 13); ``python -m experiments.device`` times both.
# An export for another platform (``jax.export``) uses this process's plan: set it here first.
LAYER_PLANS: dict[str, str] = {"cpu": "each", "default": "batched"}
_PLANS = ("each", "batched")


def layer_plan(platform: str | None = None) -> str:
    """``LAYER_PLANS``' entry for ``platform`` (None: ``jax.default_backend()``)."""
    platform = jax.default_backend() if platform is None else platform
    return _checks.platform_choice(LAYER_PLANS, "LAYER_PLANS", platform, _PLANS)


def layer_states(
    encoder: encodings.Encoder,
    params_per_layer: Sequence[Mapping[str, jax.Array]],
    pos: jax.Array,
    *,
    num_prefix: int,
    fold: bool = True,
    scaling: extrapolation.Scaling | None = None,
    plan: str | None = None,
) -> list[State]:
    """``precompute_pe`` for every layer, each with its own parameters of one encoder.

    Args:
      encoder: the layers' encoder (the same settings in every layer).
      params_per_layer: each layer's parameters, mappings of arrays of equal shapes.
      pos, num_prefix, fold, scaling: as ``precompute_pe``'s.
      plan: "each" or "batched" (``LAYER_PLANS``); None: this platform's (``layer_plan()``).

    Returns:
      one state per layer, in order.
    """
    plan = layer_plan() if plan is None else plan
    if plan not in _PLANS:
        raise ValueError(f"plan={plan!r}; expected one of {list(_PLANS)}")

    def precompute(params):
        return precompute_pe(
            encoder, params, pos, num_prefix=num_prefix, fold=fold, scaling=scaling
        )

    if plan == "each" or not params_per_layer or not params_per_layer[0]:
        return [precompute(params) for params in params_per_layer]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *map(dict, params_per_layer))
    states = jax.vmap(precompute)(stacked)
    return [jax.tree.map(lambda x, i=i: x[i], states) for i in range(len(params_per_layer))]
