"""TFDS input pipelines and this project's own TFDS datasets.

Importing this package registers the local builders ``spatial_arrows``,
``spatial_arrows_3d``, ``sklearn_digits`` and ``fashion_mnist_idx`` with TFDS, so
``tfds.builder("spatial_arrows/c8_g8", data_dir=...)`` works; ``prepare``
generates them on first use. See docs/data.md.
"""

from rope_lie.data.catalog import (
    LOCAL_BUILDERS,
    RECIPES,
    check_config,
    default_config,
    missing_dataset_message,
    prepare,
)
from rope_lie.data.fashion_mnist_idx import FashionMnistIdx, FashionMnistIdxConfig
from rope_lie.data.pipeline import (
    dataset_summary,
    make_eval_iterator,
    make_train_iterator,
)
from rope_lie.data.sklearn_digits import SklearnDigits, SklearnDigitsConfig
from rope_lie.data.spatial_arrows import SpatialArrows, SpatialArrowsConfig
from rope_lie.data.spatial_arrows_3d import SpatialArrows3d, SpatialArrows3dConfig

__all__ = [
    "FashionMnistIdx",
    "FashionMnistIdxConfig",
    "LOCAL_BUILDERS",
    "RECIPES",
    "SklearnDigits",
    "SklearnDigitsConfig",
    "SpatialArrows",
    "SpatialArrows3d",
    "SpatialArrows3dConfig",
    "SpatialArrowsConfig",
    "check_config",
    "dataset_summary",
    "default_config",
    "make_eval_iterator",
    "make_train_iterator",
    "missing_dataset_message",
    "prepare",
]
