"""Flax NNX models: attention with one position-encoding hook, and the ViT (2D and 3D)."""

from rope_lie.models.attention import Attention
from rope_lie.models.params import count_params, pe_param_count
from rope_lie.models.position_hook import PositionParam
from rope_lie.models.variants import VARIANTS
from rope_lie.models.vit import ViT

__all__ = ["VARIANTS", "Attention", "PositionParam", "ViT", "count_params", "pe_param_count"]
