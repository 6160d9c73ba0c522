"""Input pipelines: resumable, stateless-seeded TFDS streams for training, padded streams for eval.

Training stream. Each process reads its own slice of the train split
(``tfds.split_for_jax_process``) in stored order. Epoch e is that slice
shuffled by ``Dataset.shuffle`` with a seed derived from (seed, process, e);
epochs are concatenated and cut into batches, so batch k holds stream
positions [k B, (k + 1) B) and may straddle two epochs. The process key
fold_in((seed, 0), process) is split into example, shuffle and mix keys:
example i of epoch e is augmented with the stateless key fold_in(fold_in(
example key, e), i), and batch k is mixed (mixup/cutmix) with a key from the
mix key and k. A stream started at ``start_step`` builds only epochs from
start_step B // N on and skips the rest of the first one before decoding, so
batch k is the same whatever step the iterator was created at. The shuffle
order also depends on TensorFlow's global seed (``tf.random.set_seed``),
which rope_lie never sets; a caller that sets it must set the same value on
resume.

Eval stream. Every example of the process's slice exactly once, in stored
order, followed by zero-filled padding with ``mask`` 0 up to a batch count
that is the same on every process (so collectives line up across hosts).

A record file that turns out damaged (truncated, overwritten) or missing while it is read
raises an OSError naming the dataset, the split and the file, and how to prepare it again
(``records.py``).

Batches are dicts of numpy arrays, B = batch_size // process_count per process:
  image       float32 (B, H, W, C), or (B, T, H, W, C) for clips and volumes,
              normalised as (x / 255 - mean) / std
  label       int32 (B,)
  soft_label  float32 (B, V), training only, present when mixup, cutmix or label
              smoothing is on: the target for the loss (rows sum to 1)
  mask        float32 (B,), eval only: 1 for real examples, 0 for padding

``ds_cfg`` fields (start from ``default_config(name)``):
  name               TFDS name with config, e.g. "cifar100", "spatial_arrows/c8_g8"
  data_dir           TFDS data root; None uses TFDS's default (~/tensorflow_datasets)
  train_split        split to train on, e.g. "train"
  eval_split         split to evaluate on, e.g. "test" or "validation"
  image_size         side of the model input in pixels; None keeps the stored size
  num_frames         frames per clip (ucf101)
  frame_stride       stored frames between consecutive clip frames (ucf101)
  train_fraction     in (0, 1]: train on the first round(f N) examples of train_split
  shuffle_buffer     shuffle buffer in examples (capped at the split size)
  mean, std          per-channel normalisation of x / 255 (fractions of the pixel range)
  eval_crop_fraction 1.0: resize eval images to image_size; < 1: resize the shorter
                     side to image_size / f and centre-crop (ImageNet: 0.875)
  augment.crop       "none", "pad" (zero-pad by crop_padding, random crop back) or
                     "inception" (random-resized crop to image_size)
  augment.crop_padding       pixels of padding for crop="pad"
  augment.crop_area_min      smallest crop area (fraction of the image) for crop="inception"
  augment.flip               random left-right flip
  augment.randaugment.num_layers  RandAugment ops per image; 0 disables it
  augment.randaugment.magnitude   RandAugment strength on the 0..10 scale
  augment.mixup_alpha        Beta(alpha, alpha) mixup; 0 disables it
  augment.cutmix_alpha       Beta(alpha, alpha) cutmix; 0 disables it
  augment.label_smoothing    smoothing s of the one-hot targets
"""

import math
from collections.abc import Callable, Iterator

import ml_collections
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from rope_lie.data import augment, catalog, defaults, records

AUTOTUNE = tf.data.AUTOTUNE


def local_batch_size(batch_size: int, process_count: int) -> int:
    """batch_size // process_count; raises ValueError unless it divides evenly and is >= 1."""
    if batch_size < 1 or batch_size % process_count:
        raise ValueError(
            f"batch_size={batch_size} must be a positive multiple of process_count={process_count}"
        )
    return batch_size // process_count


def train_split(builder: tfds.core.DatasetBuilder, ds_cfg: ml_collections.ConfigDict) -> str:
    """ds_cfg.train_split, restricted to its first round(train_fraction N) examples."""
    if ds_cfg.train_fraction == 1.0:
        return ds_cfg.train_split
    if "[" in ds_cfg.train_split:
        raise ValueError(
            f"train_fraction={ds_cfg.train_fraction} needs a plain split name, "
            f"got train_split={ds_cfg.train_split!r}"
        )
    total = builder.info.splits[ds_cfg.train_split].num_examples
    count = round(ds_cfg.train_fraction * total)
    if count < 1:
        raise ValueError(f"train_fraction={ds_cfg.train_fraction} of {total} keeps no example")
    return f"{ds_cfg.train_split}[:{count}]"


def process_split(split: str, process_index: int, process_count: int) -> tfds.typing.SplitArg:
    """This process's contiguous, disjoint slice of ``split`` (their union is the split)."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, process_count={process_count})")
    return tfds.split_for_jax_process(
        split, process_index=process_index, process_count=process_count
    )


def read_split(
    builder: tfds.core.DatasetBuilder, recipe: defaults.Recipe, split: tfds.typing.SplitArg
) -> tuple[tf.data.Dataset, int]:
    """Examples of ``split`` in stored order, pixels still encoded for images and videos.

    Returns:
      (dataset of TFDS example dicts, number of examples in the split).
    """
    decoders = None
    if recipe.kind in ("image", "video"):
        decoders = {recipe.feature: tfds.decode.SkipDecoding()}
    ds = builder.as_dataset(split=split, shuffle_files=False, decoders=decoders)
    return ds, builder.info.splits[split].num_examples


def example_shape(
    builder: tfds.core.DatasetBuilder, ds_cfg: ml_collections.ConfigDict
) -> tuple[int, ...]:
    """Shape of one model input, (H, W, C) or (T, H, W, C), after preprocessing."""
    recipe = defaults.recipe_for(ds_cfg.name)
    stored = tuple(builder.info.features[recipe.feature].shape)
    if recipe.kind == "volume":
        return stored
    if ds_cfg.image_size is None and None in stored[-3:-1]:
        raise ValueError(f"{ds_cfg.name} stores images of varying size {stored}; set image_size")
    side = stored[-3:-1] if ds_cfg.image_size is None else (ds_cfg.image_size,) * 2
    lead = (ds_cfg.num_frames,) if recipe.kind == "video" else ()
    return lead + tuple(side) + stored[-1:]


def _decode(builder, recipe, ds_cfg, example, clip_key):
    """Decoded uint8 pixels; for videos a clip (random start with a key, else central)."""
    feature = builder.info.features[recipe.feature]
    if recipe.kind == "volume":  # read_split decoded it already
        return example[recipe.feature]
    if recipe.kind == "image":
        return feature.decode_example(example[recipe.feature])
    frames = example[recipe.feature]
    total = tf.shape(frames)[0]
    span = (ds_cfg.num_frames - 1) * ds_cfg.frame_stride + 1
    last_start = tf.maximum(total - span, 0)
    if clip_key is None:
        start = last_start // 2
    else:
        start = tf.random.stateless_uniform([], clip_key, 0, last_start + 1, dtype=tf.int32)
    # Videos shorter than the clip wrap around.
    index = (start + ds_cfg.frame_stride * tf.range(ds_cfg.num_frames)) % total
    return tf.map_fn(
        feature.feature.decode_example, tf.gather(frames, index), fn_output_signature=tf.uint8
    )


def _normalise(image: tf.Tensor, ds_cfg: ml_collections.ConfigDict) -> tf.Tensor:
    mean = tf.constant(ds_cfg.mean, tf.float32)
    std = tf.constant(ds_cfg.std, tf.float32)
    return (tf.cast(image, tf.float32) / 255.0 - mean) / std


def _train_example(builder, ds_cfg, shape, key, example) -> dict:
    """Decode, crop, resize, flip, RandAugment and normalise one training example."""
    recipe, aug = defaults.recipe_for(ds_cfg.name), ds_cfg.augment
    clip_key, crop_key, flip_key, ra_key = tf.unstack(augment.split_key(key, 4))
    image = _decode(builder, recipe, ds_cfg, example, clip_key)
    if aug.crop == "pad":
        image = augment.pad_and_crop(image, crop_key, aug.crop_padding)
    if aug.crop == "inception":
        image = augment.inception_crop(
            image, crop_key, ds_cfg.image_size, area_range=(aug.crop_area_min, 1.0)
        )
    elif ds_cfg.image_size is not None:
        image = augment.resize(image, ds_cfg.image_size)
    if aug.flip:
        image = augment.random_flip(image, flip_key)
    if aug.randaugment.num_layers:
        ra = aug.randaugment
        image = augment.randaugment(
            tf.ensure_shape(image, shape), ra_key, ra.num_layers, ra.magnitude
        )
    image = tf.ensure_shape(_normalise(image, ds_cfg), shape)
    return {"image": image, "label": tf.cast(example["label"], tf.int32)}


def _eval_example(builder, ds_cfg, shape, example) -> dict:
    """Decode, resize (or resize and centre-crop) and normalise one eval example."""
    recipe = defaults.recipe_for(ds_cfg.name)
    image = _decode(builder, recipe, ds_cfg, example, None)
    if ds_cfg.image_size is not None:
        image = augment.resize_and_center_crop(image, ds_cfg.image_size, ds_cfg.eval_crop_fraction)
    image = tf.ensure_shape(_normalise(image, ds_cfg), shape)
    return {"image": image, "label": tf.cast(example["label"], tf.int32), "mask": tf.ones([])}


def _as_written(fn: Callable) -> Callable:
    """``fn`` for tf.data to trace as written, without AutoGraph's source transformation (its
    cost per function: benchmarks README, section 14). The pipeline's control flow on tensors
    is explicit (``tf.cond``, ``tf.switch_case``, ``tf.where``); its Python ``if``/``for`` read
    static shapes and config, so the traced graph is the same, and a tensor used as a Python
    bool fails loudly instead of being converted."""
    return tf.autograph.experimental.do_not_convert(fn)


def _epoch_stream(ds, num_examples, *, key, shuffle_buffer, start_position) -> tf.data.Dataset:
    """Infinite (epoch, index, example) stream from position start_position on.

    Epoch e is ``ds`` shuffled with a seed drawn from fold_in(key, e); ``index``
    is the example's position in ``ds``.
    """
    if num_examples < 1:
        raise ValueError("the training split of this process is empty")
    first_epoch, offset = divmod(start_position, num_examples)
    indexed = ds.enumerate()
    buffer = min(shuffle_buffer, num_examples)

    def one_epoch(epoch):
        epoch_key = tf.random.experimental.stateless_fold_in(key, epoch)
        seed = tf.random.stateless_uniform([], epoch_key, 0, 2**31 - 1, dtype=tf.int64)
        shuffled = indexed.shuffle(buffer, seed=seed, reshuffle_each_iteration=False)
        return shuffled.map(_as_written(lambda index, example: (epoch, index, example)))

    return tf.data.Dataset.counter(first_epoch).flat_map(_as_written(one_epoch)).skip(offset)


def _batch_targets(ds_cfg, num_classes, key, step, batch) -> dict:
    """Adds soft labels (smoothing, mixup/cutmix keyed on the step) to a batch."""
    aug = ds_cfg.augment
    soft = augment.smooth_labels(batch["label"], num_classes, aug.label_smoothing)
    if aug.mixup_alpha > 0 or aug.cutmix_alpha > 0:
        step_key = tf.random.experimental.stateless_fold_in(key, step)
        batch["image"], soft = augment.mix_batch(
            batch["image"],
            soft,
            step_key,
            mixup_alpha=aug.mixup_alpha,
            cutmix_alpha=aug.cutmix_alpha,
        )
    return {**batch, "soft_label": soft}


def make_train_iterator(
    ds_cfg: ml_collections.ConfigDict,
    *,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    finish: Callable[[dict, tf.Tensor], dict] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Infinite, exactly resumable training batches for this process.

    Args:
      ds_cfg: dataset config (module docstring); validated by ``check_config``.
      batch_size: global batch size; each process yields batch_size // process_count.
      seed: data seed (shuffling, augmentation, mixing).
      start_step: the first batch yielded is batch ``start_step`` of the stream
        started at 0, identical to it.
      process_index: this process, in [0, process_count).
      process_count: number of processes sharing the batch.
      finish: None, or (example, key) -> example applied to each preprocessed example with a
        key of its own (``naflex.example_fn``: resize under a token budget and patchify); it
        also gets the stored ``extent`` of datasets that have one.

    Returns:
      Iterator of {"image", "label"[, "soft_label"]} numpy batches (module docstring).
    """
    catalog.check_config(ds_cfg)
    if finish is not None and (ds_cfg.augment.mixup_alpha > 0 or ds_cfg.augment.cutmix_alpha > 0):
        raise ValueError("mixup and cutmix mix images of one size; they are off with `finish`")
    if start_step < 0:
        raise ValueError(f"start_step={start_step} must be >= 0")
    local_batch = local_batch_size(batch_size, process_count)
    builder = catalog.prepare(ds_cfg.name, ds_cfg.data_dir)
    recipe, shape = defaults.recipe_for(ds_cfg.name), example_shape(builder, ds_cfg)
    split = process_split(train_split(builder, ds_cfg), process_index, process_count)
    ds, num_examples = read_split(builder, recipe, split)
    process_key = tf.random.experimental.stateless_fold_in(
        tf.constant([seed, 0], tf.int64), process_index
    )
    example_key, shuffle_key, mix_key = tf.unstack(augment.split_key(process_key, 3))
    ds = _epoch_stream(
        ds,
        num_examples,
        key=shuffle_key,
        shuffle_buffer=ds_cfg.shuffle_buffer,
        start_position=start_step * local_batch,
    )

    def preprocess(epoch, index, example):
        key = tf.random.experimental.stateless_fold_in(
            tf.random.experimental.stateless_fold_in(example_key, epoch), index
        )
        example_out = _train_example(builder, ds_cfg, shape, key, example)
        if finish is None:
            return example_out
        if "extent" in example:  # the stored content's pixels (naflex.crop_to_extent)
            example_out["extent"] = example["extent"]
        return finish(example_out, tf.random.experimental.stateless_fold_in(key, 4))

    ds = ds.map(_as_written(preprocess), num_parallel_calls=AUTOTUNE, deterministic=True)
    ds = ds.batch(local_batch, drop_remainder=True)
    aug = ds_cfg.augment
    if aug.label_smoothing > 0 or aug.mixup_alpha > 0 or aug.cutmix_alpha > 0:
        num_classes = builder.info.features["label"].num_classes
        ds = ds.enumerate(start_step).map(
            _as_written(
                lambda step, batch: _batch_targets(ds_cfg, num_classes, mix_key, step, batch)
            ),
            num_parallel_calls=AUTOTUNE,
            deterministic=True,
        )
    return records.naming_damage(
        ds.prefetch(AUTOTUNE).as_numpy_iterator(), builder, ds_cfg.name, ds_cfg.train_split, split
    )


def make_eval_iterator(
    ds_cfg: ml_collections.ConfigDict,
    *,
    batch_size: int,
    split: str | None = None,
    name: str | None = None,
    image_size: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
    finish: Callable[[dict, tf.Tensor | None], dict] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Every example of the split exactly once, padded to whole batches with ``mask`` 0.

    Args:
      ds_cfg: dataset config (module docstring).
      batch_size: global batch size; each process yields batch_size // process_count.
      split: split to read; None uses ds_cfg.eval_split.
      name: TFDS name overriding ds_cfg.name, e.g. "spatial_arrows/c8_g16" to evaluate
        a model trained on "spatial_arrows/c8_g8" on a larger grid.
      image_size: overrides ds_cfg.image_size (resolution sweeps).
      process_index: this process, in [0, process_count).
      process_count: number of processes; all yield the same number of batches.
      finish: None, or (example, None) -> example applied to each preprocessed example
        (``naflex.example_fn`` with a fixed budget).

    Returns:
      Iterator of {"image", "label", "mask"} numpy batches; a process after the first adds
      "first_example", the split position of its part's first example.
    """
    ds_cfg = ds_cfg.copy_and_resolve_references()
    with ds_cfg.unlocked():
        ds_cfg.name = name or ds_cfg.name
        ds_cfg.image_size = image_size or ds_cfg.image_size
    recipe = catalog.check_config(ds_cfg)
    local_batch = local_batch_size(batch_size, process_count)
    builder = catalog.prepare(ds_cfg.name, ds_cfg.data_dir)
    shape = example_shape(builder, ds_cfg)
    split = split or ds_cfg.eval_split
    counts = [
        builder.info.splits[process_split(split, p, process_count)].num_examples
        for p in range(process_count)
    ]
    num_batches = math.ceil(max(counts) / local_batch)
    process_slice = process_split(split, process_index, process_count)
    ds, _ = read_split(builder, recipe, process_slice)

    def preprocess(example):
        example_out = _eval_example(builder, ds_cfg, shape, example)
        return example_out if finish is None else finish(example_out, None)

    ds = ds.map(_as_written(preprocess), num_parallel_calls=AUTOTUNE, deterministic=True)
    padding = tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), ds.element_spec)
    ds = ds.concatenate(tf.data.Dataset.from_tensors(padding).repeat())
    ds = ds.take(num_batches * local_batch).batch(local_batch)
    iterator = ds.prefetch(AUTOTUNE).as_numpy_iterator()
    batches = records.naming_damage(iterator, builder, ds_cfg.name, split, process_slice)
    first = sum(counts[:process_index])
    return _with_first_example(batches, first) if first else batches


def _with_first_example(batches, first: int):
    """`batches`, each with ``first_example``: where this process's part starts in the split
    (so that ``evaluate``'s shuffled patches follow the split's order on any process count)."""
    for batch in batches:
        yield {**batch, "first_example": np.asarray(first)}


def dataset_summary(ds_cfg: ml_collections.ConfigDict) -> dict:
    """What a trainer needs to size a model, preparing the dataset if needed.

    Returns:
      {"num_classes": int, "num_train_examples": int (after train_fraction, all
      processes), "example_shape": (H, W, C) or (T, H, W, C)}.
    """
    catalog.check_config(ds_cfg)
    builder = catalog.prepare(ds_cfg.name, ds_cfg.data_dir)
    return {
        "num_classes": builder.info.features["label"].num_classes,
        "num_train_examples": builder.info.splits[train_split(builder, ds_cfg)].num_examples,
        "example_shape": example_shape(builder, ds_cfg),
    }
