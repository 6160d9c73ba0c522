"""Which datasets the input pipeline knows, how their examples become model inputs, and their
default settings: the part of rope_lie.data that recipes need to build a config.

It imports no TensorFlow, so a recipe loads, and a bad command line fails, in the time it takes
to import JAX (rope_lie.main): ``rope_lie/data/__init__.py`` imports nothing until a name of it
is used.
"""

import dataclasses

import ml_collections


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a dataset's examples become model inputs.

    Attributes:
      feature: TFDS feature holding the pixels.
      kind: "image" (H, W, C), "video" (T, H, W, C, frames sampled) or "volume" (D, H, W, C).
      geometry_keeps_label: False where crops, flips or RandAugment change the label.
    """

    feature: str
    kind: str
    geometry_keeps_label: bool = True


RECIPES = {
    "cifar10": Recipe("image", "image"),
    "cifar100": Recipe("image", "image"),
    "mnist": Recipe("image", "image"),
    "imagenet2012": Recipe("image", "image"),
    "ucf101": Recipe("video", "video"),
    "sklearn_digits": Recipe("image", "image"),
    "fashion_mnist_idx": Recipe("image", "image"),
    "spatial_arrows": Recipe("image", "image", geometry_keeps_label=False),
    "spatial_arrows_3d": Recipe("volume", "volume", geometry_keeps_label=False),
}
CROPS = ("none", "pad", "inception")
_IMAGENET_STATS = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
_CIFAR_AUG = {"crop": "pad", "flip": True, "randaugment": {"num_layers": 2, "magnitude": 9}}
_DEFAULTS = {
    "cifar10": dict(image_size=32, mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616)),
    "cifar100": dict(image_size=32, mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762)),
    "mnist": dict(image_size=32, mean=(0.1307,), std=(0.3081,)),
    "fashion_mnist_idx": dict(mean=(0.2860,), std=(0.3530,)),  # of the 60,000 training images
    "imagenet2012": dict(
        image_size=224, eval_split="validation", eval_crop_fraction=0.875, **_IMAGENET_STATS
    ),
    "ucf101": dict(image_size=224, **_IMAGENET_STATS),
}
_DEFAULT_AUGMENT = {
    "cifar10": _CIFAR_AUG,
    "cifar100": _CIFAR_AUG,
    "imagenet2012": dict(
        crop="inception", flip=True, randaugment={"num_layers": 2, "magnitude": 9}
    ),
    "ucf101": dict(crop="inception", flip=True),
}


def base_name(name: str) -> str:
    """'spatial_arrows/c8_g8:1.0.0' -> 'spatial_arrows'."""
    return name.split("/")[0].split(":")[0]


def recipe_for(name: str) -> Recipe:
    """The Recipe of a TFDS name; raises ValueError for datasets without one."""
    if base_name(name) not in RECIPES:
        raise ValueError(f"dataset {name!r} has no input recipe; supported: {sorted(RECIPES)}")
    return RECIPES[base_name(name)]


def default_config(name: str) -> ml_collections.ConfigDict:
    """A complete ds_cfg with this dataset's recipe defaults (see the module docstring).

    Args:
      name: TFDS name with config, e.g. "cifar100" or "spatial_arrows/c8_g8".

    Returns:
      ConfigDict with every field ``make_train_iterator`` reads.
    """
    recipe_for(name)
    cfg = dict(
        name=name,
        data_dir=None,
        train_split="train",
        eval_split="test",
        image_size=None,
        num_frames=8,
        frame_stride=2,
        train_fraction=1.0,
        shuffle_buffer=50_000,
        mean=(0.5,),
        std=(0.5,),
        eval_crop_fraction=1.0,
    )
    cfg.update(_DEFAULTS.get(base_name(name), {}))
    aug = dict(
        crop="none",
        crop_padding=4,
        crop_area_min=0.08,
        flip=False,
        randaugment={"num_layers": 0, "magnitude": 9},
        mixup_alpha=0.0,
        cutmix_alpha=0.0,
        label_smoothing=0.0,
    )
    aug.update(_DEFAULT_AUGMENT.get(base_name(name), {}))
    cfg["augment"] = aug
    return ml_collections.ConfigDict(cfg, type_safe=False)
