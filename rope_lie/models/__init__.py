"""Flax NNX models: attention with one position-encoding hook, and the ViT (2D and 3D)."""

from rope_lie.models.attention import Attention, PositionParam
from rope_lie.models.vit import VARIANTS, ViT, count_params, pe_param_count

__all__ = ["VARIANTS", "Attention", "PositionParam", "ViT", "count_params", "pe_param_count"]
