"""TFDS input pipelines and this project's own TFDS datasets.

The names below load on first use, and TensorFlow with them: a recipe reads its dataset defaults
(``rope_lie.data.defaults``) without it. Using any of them (or importing ``rope_lie.data.catalog``)
registers the local builders ``spatial_arrows``, ``spatial_arrows_3d``, ``sklearn_digits`` and
``fashion_mnist_idx`` with TFDS, so ``tfds.builder("spatial_arrows/c8_g8", data_dir=...)``
works; ``prepare`` generates them on first use. See docs/data.md.
"""

import importlib

# name -> the module of this package that defines it
_DEFINED_IN = {
    "LOCAL_BUILDERS": "catalog",
    "check_config": "catalog",
    "missing_dataset_message": "catalog",
    "prepare": "catalog",
    "RECIPES": "defaults",
    "default_config": "defaults",
    "FashionMnistIdx": "fashion_mnist_idx",
    "FashionMnistIdxConfig": "fashion_mnist_idx",
    "dataset_summary": "pipeline",
    "make_eval_iterator": "pipeline",
    "make_train_iterator": "pipeline",
    "SklearnDigits": "sklearn_digits",
    "SklearnDigitsConfig": "sklearn_digits",
    "SpatialArrows": "spatial_arrows",
    "SpatialArrowsConfig": "spatial_arrows",
    "SpatialArrows3d": "spatial_arrows_3d",
    "SpatialArrows3dConfig": "spatial_arrows_3d",
}
__all__ = sorted(_DEFINED_IN)


def __getattr__(name: str):
    """``rope_lie.data.<name>``: imported from its module when first asked for (PEP 562)."""
    if name not in _DEFINED_IN:
        raise AttributeError(f"module 'rope_lie.data' has no attribute {name!r}")
    from rope_lie.data import catalog  # noqa: F401  (importing it registers the local builders)

    return getattr(importlib.import_module(f"{__name__}.{_DEFINED_IN[name]}"), name)
