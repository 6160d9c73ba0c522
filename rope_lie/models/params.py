"""Parameter counts of a ViT: as stored (``count_params``) and by formula (``pe_param_count``).

The formula side is written from each family's documented parameter shapes, not read off the
code, so tests that compare the two catch an encoder that stores more or less than it says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from rope_lie.models.position_hook import PositionParam
from rope_lie.models.vit import ViT


def _num_elements(state: nnx.State) -> int:
    return sum(int(math.prod(leaf.shape)) for leaf in jax.tree.leaves(state))


def count_params(model: ViT) -> dict[str, Any]:
    """Parameter counts of a model, as stored.

    Args:
      model: a ``ViT``.

    Returns:
      ``{"total": int, "position": int, "by_family": {name: int}}``: all ``nnx.Param``, the
      ``PositionParam`` among them, and those split by family (``model.pe`` and, when
      used, ``model.additive``).
    """
    position = _num_elements(nnx.state(model, PositionParam))
    additive = _num_elements(nnx.state(model.additive_params, PositionParam))
    by_family = {model.pe: position - additive}
    if model.additive != "none":
        by_family[model.additive] = additive
    return {
        "total": _num_elements(nnx.state(model, nnx.Param)),
        "position": position,
        "by_family": by_family,
    }


def _liere_per_head(head_dim: int, num_axes: int, hparams: Mapping[str, Any]) -> int:
    block = hparams.get("block_size") or head_dim
    return num_axes * (head_dim // block) * block * block  # stored raw (A, N, K, b, b)


def _cayley_per_head(head_dim: int, num_axes: int, hparams: Mapping[str, Any]) -> int:
    generator = hparams.get("generator", "dense")
    s_count = {  # s_dense_NHH, s_block2x2_NF, s_banded_NWH, s_topk_NHH
        "dense": head_dim * head_dim,
        "block2x2": head_dim // 2,
        "banded": (hparams.get("bandwidth") or 0) * head_dim,
        "topk": head_dim * head_dim,
    }[generator]
    return num_axes * (head_dim // 2) + s_count  # + RoPE-Mixed freqs_ANF


# Stored parameters per layer shared by the heads (ComRoPE-LD's scale_AK, as its reference).
_PER_LAYER_COUNT = {
    "comrope": lambda head_dim, num_axes, hparams: (
        num_axes * (head_dim // hparams.get("block_size", 8))
        if hparams.get("variant", "ld") == "ld"
        else 0
    ),
}

# Stored parameters per head and per layer, written from each family's documented parameter
# shapes (not read off the code): ``pe_param_count`` multiplies by heads and layers.
_PER_HEAD_COUNT = {
    "nope": lambda head_dim, num_axes, hparams: 0,
    "rope": lambda head_dim, num_axes, hparams: 0,
    "rope_axial": lambda head_dim, num_axes, hparams: 0,
    "visionllama": lambda head_dim, num_axes, hparams: 0,
    "rope_mixed": lambda head_dim, num_axes, hparams: num_axes * (head_dim // 2),  # (A, N, H/2)
    "liere": _liere_per_head,
    "cayley_string": _cayley_per_head,
    "circulant_string": lambda head_dim, num_axes, hparams: num_axes * head_dim,  # (A, N, H)
    "comrope": lambda head_dim, num_axes, hparams: head_dim * hparams.get("block_size", 8),  # P
    "dinov3": lambda head_dim, num_axes, hparams: 0,
    "alibi": lambda head_dim, num_axes, hparams: int(bool(hparams.get("learnable"))),  # (N,)
}


def pe_param_count(
    pe: str,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    depth: int,
    share_pe_heads: bool = False,
    share_pe_layers: bool = False,
    hparams: Mapping[str, Any] | None = None,
) -> int:
    """Stored encoder parameters of a model, by formula.

    Counts stored arrays, not degrees of freedom: LieRE stores A*N*K*b*b raw entries of which
    only the strict upper triangles (A*N*K*b*(b-1)/2) are used; Cayley-STRING stores RoPE-Mixed
    frequencies (A*N*H/2) plus N*H*H (dense, top-k: H(H-1)/2 used), N*H/2 (block 2x2) or
    N*bandwidth*H (banded); Circulant-STRING stores A*N*H of which floor((H-1)/2) per axis and
    head are effective; ComRoPE stores N*K*b*b raw P (b(b-1)/2 used per block) plus, for LD, A*K
    scales shared by the heads.

    Args:
      pe: rotary or bias family.
      num_heads: N.
      head_dim: H.
      num_axes: A.
      depth: L, layers.
      share_pe_heads: one set for all heads.
      share_pe_layers: one set for all layers.
      hparams: the family's ``init`` hyperparameters.

    Returns:
      number of scalars in the ``PositionParam`` of the rotary/bias family.
    """
    if pe not in _PER_HEAD_COUNT:
        raise ValueError(
            f"no parameter-count formula for pe={pe!r}; known: {sorted(_PER_HEAD_COUNT)}"
        )
    hparams = dict(hparams or {})
    per_head = _PER_HEAD_COUNT[pe](head_dim, num_axes, hparams)
    per_layer = _PER_LAYER_COUNT.get(pe, lambda *_: 0)(head_dim, num_axes, hparams)
    heads = 1 if share_pe_heads else num_heads
    layers = 1 if share_pe_layers else depth
    return (per_head * heads + per_layer) * layers
