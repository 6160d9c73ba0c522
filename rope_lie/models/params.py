"""Parameter counts of a ViT: as stored (``count_params``) and by formula (``pe_param_count``).

The formula side is each family's ``FAMILY.stored_count``, written in its module from the
documented parameter shapes (not read off the arrays), so tests that compare the two catch an
encoder that stores more or less than it says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from rope_lie.models import position_hook
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
    encoder = position_hook.pe_encoder(
        pe,
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        share_heads=share_pe_heads,
        hparams=hparams,
    )
    return encoder.param_count() * (1 if share_pe_layers else depth)
