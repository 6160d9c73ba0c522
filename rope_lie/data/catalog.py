"""Which datasets the pipeline knows, their default settings, and getting them prepared.

``RECIPES`` says how each dataset's examples become model inputs,
``default_config`` gives a complete ds_cfg for one (fields documented in
pipeline.py), ``check_config`` validates one, and ``prepare`` returns a
prepared TFDS builder: this project's own datasets (``LOCAL_BUILDERS``) are
generated into data_dir on first use; catalogue datasets (cifar10, cifar100,
mnist, imagenet2012, ucf101) must be prepared by the user, and a missing one
raises an error that says how. ``RECIPES`` and ``default_config`` live in
rope_lie/data/defaults.py (no TensorFlow).
"""

import contextlib
import io
import logging
import time

import ml_collections
import tensorflow_datasets as tfds
from absl import logging as absl_logging
from tensorflow_datasets.core.utils import tqdm_utils

from rope_lie.data import fashion_mnist_idx, sklearn_digits, spatial_arrows, spatial_arrows_3d
from rope_lie.data.defaults import CROPS, Recipe, base_name, default_config, recipe_for

LOCAL_BUILDERS = {
    "spatial_arrows": spatial_arrows.SpatialArrows,
    "spatial_arrows_3d": spatial_arrows_3d.SpatialArrows3d,
    "sklearn_digits": sklearn_digits.SklearnDigits,
    "fashion_mnist_idx": fashion_mnist_idx.FashionMnistIdx,
}


def _missing_fields(cfg: ml_collections.ConfigDict, ref: ml_collections.ConfigDict, prefix=""):
    missing = []
    for key, value in ref.items():
        if key not in cfg:
            missing.append(prefix + key)
        elif isinstance(value, ml_collections.ConfigDict):
            missing += _missing_fields(cfg[key], value, f"{prefix}{key}.")
    return missing


def check_config(ds_cfg: ml_collections.ConfigDict) -> Recipe:
    """Validates ds_cfg against its recipe; returns the recipe.

    Raises:
      ValueError: naming the first bad field and what was expected.
    """
    recipe = recipe_for(ds_cfg.name)
    missing = _missing_fields(ds_cfg, default_config(ds_cfg.name))
    if missing:
        raise ValueError(f"ds_cfg lacks {missing}; start from rope_lie.data.default_config(name)")
    aug = ds_cfg.augment
    if aug.crop not in CROPS:
        raise ValueError(f"augment.crop={aug.crop!r}; expected one of {CROPS}")
    if aug.crop == "inception" and ds_cfg.image_size is None:
        raise ValueError("augment.crop='inception' needs image_size (the output side)")
    if not 0.0 < aug.crop_area_min <= 1.0:
        raise ValueError(f"augment.crop_area_min={aug.crop_area_min} must lie in (0, 1]")
    geometric = aug.crop != "none" or aug.flip or aug.randaugment.num_layers > 0
    if geometric and not recipe.geometry_keeps_label:
        raise ValueError(
            f"{ds_cfg.name}: augment.crop={aug.crop!r}, flip={aug.flip}, randaugment.num_layers="
            f"{aug.randaugment.num_layers} would move or mirror glyphs and change the label; "
            "expected crop='none', flip=False, num_layers=0"
        )
    # a centre crop cuts border cells away, cutmix pastes another scene's: either can remove
    # the glyphs that set the label
    cuts = {
        "eval_crop_fraction": (ds_cfg.eval_crop_fraction, 1.0),
        "augment.cutmix_alpha": (aug.cutmix_alpha, 0.0),
    }
    for key, (value, keeps) in cuts.items():
        if value != keeps and not recipe.geometry_keeps_label:
            raise ValueError(
                f"{ds_cfg.name}: {key}={value} would cut glyphs away and change the label; "
                f"expected {keeps}"
            )
    if aug.randaugment.num_layers > 0 and recipe.kind != "image":
        raise ValueError(f"RandAugment is for 2D images; {ds_cfg.name} holds {recipe.kind}s")
    if recipe.kind == "volume" and ds_cfg.image_size is not None:
        raise ValueError(f"image_size={ds_cfg.image_size}: volumes keep their stored size (None)")
    if not 0.0 < ds_cfg.train_fraction <= 1.0:
        raise ValueError(f"train_fraction={ds_cfg.train_fraction} must lie in (0, 1]")
    if not 0.0 < ds_cfg.eval_crop_fraction <= 1.0:
        raise ValueError(f"eval_crop_fraction={ds_cfg.eval_crop_fraction} must lie in (0, 1]")
    if len(ds_cfg.mean) != len(ds_cfg.std):
        raise ValueError(f"mean={ds_cfg.mean} and std={ds_cfg.std} differ in length")
    return recipe


def missing_dataset_message(name: str, data_dir: str) -> str:
    """How to prepare a catalogue dataset that is not in data_dir."""
    msg = f"TFDS dataset {name!r} is not prepared in data_dir={data_dir}. Prepare it once with:\n"
    return msg + _build_commands(name, data_dir)


def _build_commands(name: str, data_dir: str) -> str:
    """The commands that prepare a catalogue dataset in data_dir, indented, one a line."""
    base, _, config = name.split(":")[0].partition("/")
    flags = f" --config={config}" if config else ""
    build = f"tfds build {base}{flags} --data_dir={data_dir}"
    if base == "imagenet2012":
        return (
            "  1. download ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from "
            f"https://image-net.org into {data_dir}/downloads/manual/\n"
            f"  2. {build} --manual_dir={data_dir}/downloads/manual"
        )
    return f"  {build}"


def damaged_dataset_message(
    name: str, split: str, path: str | None, reason: str, version_dir: str, data_dir: str
) -> str:
    """How to prepare again a dataset whose record file `path` (None: not found) is damaged."""
    what = path or "one of its files"
    msg = (
        f"TFDS dataset {name!r}, split {split!r}: {what} is damaged or missing ({reason}). "
        f"Prepare the dataset again:\n  rm -r {version_dir}\n"
    )
    if base_name(name) in LOCAL_BUILDERS:
        return msg + "  then rerun: this project's datasets are generated on first use"
    return msg + _build_commands(name, data_dir)


def prepare(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    """A prepared builder: generates this project's datasets on first use, checks the others.

    Args:
      name: TFDS name with config, e.g. "spatial_arrows/c8_g8" or "cifar100".
      data_dir: TFDS data root; None uses TFDS's default.

    Returns:
      The builder, ready for ``as_dataset``.

    Raises:
      FileNotFoundError: for a catalogue dataset that is not prepared, saying how
        to prepare it.
    """
    with _without_tfds_warnings():
        builder = tfds.builder(name, data_dir=data_dir)
        if builder.is_prepared():
            return builder
        if base_name(name) not in LOCAL_BUILDERS:
            raise FileNotFoundError(missing_dataset_message(name, str(builder.data_dir_root)))
        print(f"Generating {name} into {builder.data_dir} (first use) ...", flush=True)
        start = time.perf_counter()
        with _without_tfds_prints():  # our builders show one progress bar per split instead
            builder.download_and_prepare()
    print(f"Generated {name} in {time.perf_counter() - start:.1f}s", flush=True)
    return builder


def _not_tfds_chatter(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR or "tensorflow_datasets" not in record.pathname


@contextlib.contextmanager
def _without_tfds_warnings():
    """TFDS's absl warnings off (e.g. "Variant folder ... has no dataset_info.json" before a
    first generation); its errors still show."""
    absl_logger = absl_logging.get_absl_logger()
    absl_logger.addFilter(_not_tfds_chatter)
    try:
        yield
    finally:
        absl_logger.removeFilter(_not_tfds_chatter)


@contextlib.contextmanager
def _without_tfds_prints():
    """TFDS's nested progress bars and its "Downloading and preparing dataset Unknown size ..."
    prints off while it generates one of our datasets: we print what is generated, where and
    how long it took, and our builders show one progress bar per split."""
    was_active = getattr(tqdm_utils, "_active", True)
    tfds.display_progress_bar(False)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        tfds.display_progress_bar(was_active)


def write_mock_metadata(
    name: str, data_dir: str, *, num_examples: int, splits: tuple[str, ...] = ("train", "test")
) -> None:
    """Writes the metadata of a prepared dataset (no records) for ``tfds.testing.mock_data``.

    With ``tfds.testing.mock_data(num_examples=n, data_dir=data_dir,
    policy=tfds.testing.MockPolicy.USE_FILES)`` the dataset then counts as
    prepared, its splits have known sizes (``num_examples`` each) and
    ``as_dataset`` yields n random examples shaped by the builder's features, so
    the whole pipeline runs on catalogue datasets that cannot be downloaded.

    Args:
      name: TFDS name with config, e.g. "cifar10" or "ucf101/ucf101_1_256".
      data_dir: TFDS data root to write into.
      num_examples: recorded size of every split; pass the same n to mock_data.
      splits: split names to record.
    """
    builder = tfds.builder(name, data_dir=data_dir)
    infos = [
        tfds.core.SplitInfo(
            name=split,
            shard_lengths=[num_examples],
            num_bytes=0,
            filename_template=tfds.core.ShardedFileTemplate(
                data_dir=builder.data_path,
                dataset_name=builder.name,
                split=split,
                filetype_suffix="tfrecord",
            ),
        )
        for split in splits
    ]
    builder.info.set_splits(tfds.core.SplitDict(infos))
    builder.data_path.mkdir(parents=True, exist_ok=True)
    builder.info.write_to_directory(builder.data_path)
