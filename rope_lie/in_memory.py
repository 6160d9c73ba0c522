"""A run's data held in memory (numpy) and augmented in JAX: training without TensorFlow.

``config.input = "memory"`` (``configs/fashion_mnist.py:...,input=memory``) makes the training
job read its data here instead of through tf.data and TFDS (``rope_lie/run_inputs.py``), so
it runs on a machine that has JAX but no TensorFlow, such as an accelerator image with jax,
flax, optax and orbax only (set ``tensorboard=False`` there as well: TensorBoard's events are
written through TensorFlow). The two paths do not give the same batches; they draw from the same
distribution (tests/test_in_memory.py compares their statistics).

Datasets: ``fashion_mnist_idx/plain`` (``train``, ``test``) and ``fashion_mnist_idx/canvas36``,
``canvas44``, ``canvas56`` (``test``), read from Fashion-MNIST's IDX files
(``rope_lie/fashion_mnist_files.py``: ``$ROPE_LIE_FASHION_MNIST_DIR`` or Debian's path), once
per process (60,000 x 28 x 28 bytes: 47 MB). Splits may be sliced (``test[:16]``).

Training stream (one process; ``data_seed``, else ``seed``): epoch e is the training examples
(the first ``train_fraction`` of them) in the order ``np.random.default_rng([data_seed, e])``
permutes them; epochs are concatenated and cut into batches, so batch k holds stream positions
[k B, (k + 1) B), may straddle two epochs, and is the same whatever step the stream starts at
(an exact resume). Batch k is made on the device from the training set held there, in one
program (``batch_maker``), and augmented with the key fold_in(``augment_key(data_seed)``, k): per
example, a random crop after ``crop_padding`` px of zero padding (``augment.crop="pad"``) and
a left-right flip with probability 1/2 (``augment.flip``), the augmentations of the
Fashion-MNIST recipe; others (inception crops, RandAugment, mixup, cutmix, label smoothing,
NaFlex) are refused with a message. Evaluation: every example of the split once, in file order,
resized (bilinear, antialiased, rounded to bytes as the TFDS path does) to the entry's
``image_size``, the last batch padded with ``mask`` 0. The TFDS path evaluates the same
examples in TFDS's stored order (a hash of the keys), so per-example results (a study's
``examples.npz``) line up only between runs of one path: a study runs all its arms on one.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections as mc
import numpy as np
from jax.sharding import Mesh

from rope_lie import fashion_mnist_files, sharding
from rope_lie.config_lib import data_seed

DATASET = "fashion_mnist_idx"
CANVASES = {"plain": fashion_mnist_files.SIDE, "canvas36": 36, "canvas44": 44, "canvas56": 56}
NUM_CLASSES = len(fashion_mnist_files.CLASS_NAMES)


# The augmentation stream's root is fold_in(key(data_seed), AUGMENT_STREAM), apart from the
# model's keys: train.py splits key(seed) into init and dropout keys, which are fold_in(key(seed),
# 0) and fold_in(key(seed), 1), so with data_seed = seed batch 0 would be cropped with the init
# key and batch 1 with the dropout key.
AUGMENT_STREAM = 0x61756775


def augment_key(seed: int) -> jax.Array:
    """The root of a run's augmentation keys; batch k's is fold_in(augment_key(data_seed), k)."""
    return jax.random.fold_in(jax.random.key(seed), AUGMENT_STREAM)


def uses_memory(config: mc.ConfigDict) -> bool:
    """Whether the run reads its data here (``config.input == "memory"``) rather than through
    TFDS (``"tfds"``, the default, and what a config without the field means)."""
    source = config.get("input", "tfds")
    if source not in ("tfds", "memory"):
        raise ValueError(f"input={source!r}; expected 'tfds' (tf.data) or 'memory' (no TF)")
    return source == "memory"


# --------------------------------------------------------------------------- the arrays


def _parse(name: str, split: str) -> tuple[str, str, slice]:
    """(canvas config, split, slice) of a dataset name and a split such as ``test[:16]``."""
    base, _, variant = name.partition("/")
    variant = variant.split(":")[0] or "plain"
    if base != DATASET or variant not in CANVASES:
        raise ValueError(
            f"input='memory' reads {DATASET}/{{{', '.join(CANVASES)}}}, not {name!r}; "
            "other datasets need input='tfds'"
        )
    match = re.fullmatch(r"(train|test)(?:\[(-?\d*):(-?\d*)\])?", split)
    if match is None:
        raise ValueError(f"split={split!r}; expected train or test, optionally [a:b] (integers)")
    start, stop = (int(x) if x else None for x in match.group(2, 3))
    if variant != "plain" and match.group(1) != "test":
        raise ValueError(f"{name} holds the test split only, not {split!r}")
    return variant, match.group(1), slice(start, stop)


@functools.cache
def _split_arrays(directory: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    images, labels = fashion_mnist_files.load_split(split, directory)
    return images, labels.astype(np.int32)


def arrays(name: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8 (N, S, S, 1) images and int32 (N,) labels of a dataset split, in stored order (S:
    28, or the canvas side)."""
    variant, base_split, part = _parse(name, split)
    images, labels = _split_arrays(fashion_mnist_files.idx_dir(), base_split)
    images = fashion_mnist_files.on_canvas(images[part], CANVASES[variant])
    return images[..., None], labels[part]


def train_arrays(ds_cfg: mc.ConfigDict) -> tuple[np.ndarray, np.ndarray]:
    """The training examples: the first round(train_fraction N) of ``train_split``, in file
    order (the TFDS path's are the first of its stored order: other examples)."""
    images, labels = arrays(ds_cfg.name, ds_cfg.train_split)
    if ds_cfg.train_fraction != 1.0:
        count = round(ds_cfg.train_fraction * len(labels))
        if count < 1:
            raise ValueError(f"train_fraction={ds_cfg.train_fraction} of {len(labels)} keeps none")
        images, labels = images[:count], labels[:count]
    return images, labels


def check_config(config: mc.ConfigDict) -> None:
    """Raise ValueError naming what the in-memory path does not do (a single process, the
    recipe's pad-and-crop and flip, no NaFlex, no TFDS ``data_dir``)."""
    ds, aug = config.dataset, config.dataset.augment
    _parse(ds.name, ds.train_split)
    if ds.train_fraction != 1.0 and "[" in ds.train_split:
        raise ValueError(  # as the TFDS path (pipeline.train_split): one way to take a part
            f"train_fraction={ds.train_fraction} needs a plain split name, "
            f"got train_split={ds.train_split!r}"
        )
    shards = config.get("data_shards", 0)
    supported = (  # (field, value, whether supported, what is)
        ("augment.crop", aug.crop, aug.crop in ("none", "pad"), "'none' or 'pad'"),
        (
            "augment.randaugment.num_layers",
            aug.randaugment.num_layers,
            not aug.randaugment.num_layers,
            "0",
        ),
        ("augment.mixup_alpha", aug.mixup_alpha, not aug.mixup_alpha, "0"),
        ("augment.cutmix_alpha", aug.cutmix_alpha, not aug.cutmix_alpha, "0"),
        ("augment.label_smoothing", aug.label_smoothing, not aug.label_smoothing, "0"),
        (  # evaluation images are resized whole, never centre-cropped
            "dataset.eval_crop_fraction",
            ds.eval_crop_fraction,
            ds.eval_crop_fraction == 1.0,
            "1.0",
        ),
        ("naflex", "set" if config.get("naflex") else None, not config.get("naflex"), "unset"),
        (  # a TFDS root: this path reads the IDX files (fashion_mnist_files.idx_dir)
            "dataset.data_dir",
            ds.get("data_dir"),
            ds.get("data_dir") is None,
            "None; it reads the IDX files from $ROPE_LIE_FASHION_MNIST_DIR or Debian's path",
        ),
        ("processes", jax.process_count(), jax.process_count() == 1, "1"),
        ("data_shards", shards, shards in (0, 1), "0 or 1"),
    )
    for field, value, ok, expected in supported:
        if not ok:
            raise ValueError(
                f"input='memory': {field}={value!r}; it supports {expected} (input='tfds' "
                "supports more)"
            )


def prepare_data(config: mc.ConfigDict) -> int:
    """Read the training split and every evaluation's dataset into memory, check them against
    ``config.model``; returns the number of training examples."""
    check_config(config)
    images, _ = train_arrays(config.dataset)
    side = config.dataset.image_size or images.shape[1]
    model = config.model
    expected = ((side, side), 1, NUM_CLASSES)
    actual = (tuple(model.image_shape), model.channels, model.num_classes)
    if expected != actual:
        raise ValueError(
            f"config.model (image_shape, channels, num_classes)={actual} does not match "
            f"dataset {config.dataset.name!r} (image_size={config.dataset.image_size}): {expected}"
        )
    for entry in config.evals.values():
        if entry.get("naflex_side") is not None:
            raise ValueError("input='memory' has no NaFlex evaluations; use input='tfds'")
        arrays(entry.name or config.dataset.name, entry.split or config.dataset.eval_split)
    return len(images)


# --------------------------------------------------------------------------- in JAX


@functools.partial(jax.jit, static_argnames=("padding", "flip", "size"))
def augment_batch(
    images_BHWC: jax.Array, key: jax.Array, *, padding: int, flip: bool, size: int | None
) -> jax.Array:
    """uint8 (B, H, W, C) -> uint8 (B, H, W, C) (or size x size): per example, a random H x W
    window of the image zero-padded by `padding` px (0: none), resized to `size` (None: kept),
    then mirrored left-right with probability 1/2 when `flip`."""
    b, h, w, c = images_BHWC.shape
    crop_key, flip_key = jax.random.split(key)
    out = images_BHWC
    if padding:
        pads = ((0, 0), (padding, padding), (padding, padding), (0, 0))
        padded = jnp.pad(images_BHWC, pads)
        offsets_B2 = jax.random.randint(crop_key, (b, 2), 0, 2 * padding + 1)
        out = jax.vmap(lambda im, o: jax.lax.dynamic_slice(im, (o[0], o[1], 0), (h, w, c)))(
            padded, offsets_B2
        )
    if size is not None and size != h:
        out = resize(out, size)
    if flip:
        mirror_B = jax.random.bernoulli(flip_key, 0.5, (b,))
        out = jnp.where(mirror_B[:, None, None, None], out[:, :, ::-1], out)
    return out


def resize(images_BHWC: jax.Array, size: int) -> jax.Array:
    """Bilinear, antialiased resize to size x size, rounded and saturated to uint8 (as the
    TFDS path's ``augment.resize``)."""
    b, _, _, c = images_BHWC.shape
    out = jax.image.resize(
        images_BHWC.astype(jnp.float32), (b, size, size, c), "bilinear", antialias=True
    )
    return jnp.clip(jnp.round(out), 0, 255).astype(jnp.uint8)


def normalise(images_BHWC: jax.Array, ds_cfg: mc.ConfigDict) -> jax.Array:
    """(x / 255 - mean) / std, float32."""
    mean_111C = jnp.asarray(ds_cfg.mean, jnp.float32).reshape(1, 1, 1, -1)
    std_111C = jnp.asarray(ds_cfg.std, jnp.float32).reshape(1, 1, 1, -1)
    return (images_BHWC.astype(jnp.float32) / 255.0 - mean_111C) / std_111C


# --------------------------------------------------------------------------- the streams


# Two orders per stream (the epoch a batch is in, and the one it may straddle into) for up to
# 8 streams read in turn, as a seed ensemble's members are: with room for two, 5 interleaved
# streams recomputed a 60,000-example permutation at every batch. Fashion-MNIST's: 7.7 MB.
EPOCH_ORDERS_CACHED = 16


@functools.lru_cache(maxsize=EPOCH_ORDERS_CACHED)
def epoch_order(seed: int, epoch: int, num: int) -> np.ndarray:
    """The example order of one epoch: a permutation of range(num) from (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num)


def batch_indices(seed: int, step: int, batch_size: int, num: int) -> np.ndarray:
    """Example indices of batch `step`: stream positions [step B, (step + 1) B) of the
    concatenated epochs (a batch may straddle two)."""
    positions = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs = positions // num
    out = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):
        here = epochs == epoch
        out[here] = epoch_order(seed, int(epoch), num)[positions[here] % num]
    return out


def batch_maker(ds_cfg: mc.ConfigDict) -> Callable[..., dict[str, jax.Array]]:
    """``make(images_NHWC, labels_N, key, index_B, step)``: the training batch of the examples
    ``index_B`` at step ``step``, gathered from the training set, cropped and flipped with the
    key fold_in(key, step) (``augment_batch``) and normalised: {"image": float32 (B, H, W, C),
    "label": int32 (B,)}. A function of arrays only, so that one program makes a batch: a
    single run jits it (``data_train_batches``), a seed ensemble vmaps it over its members
    (``rope_lie.ensemble``). The augmentations are the ones ``check_config`` accepts."""
    padding = ds_cfg.augment.crop_padding if ds_cfg.augment.crop == "pad" else 0
    flip, size = bool(ds_cfg.augment.flip), ds_cfg.image_size

    def make(images_NHWC, labels_N, key, index_B, step):
        out = augment_batch(
            images_NHWC[index_B],
            jax.random.fold_in(key, step),
            padding=padding,
            flip=flip,
            size=size,
        )
        return {"image": normalise(out, ds_cfg), "label": labels_N[index_B]}

    return make


def data_train_batches(
    config: mc.ConfigDict, patch: Sequence[int] | None, start_step: int
) -> Iterator[dict[str, Any]]:
    """Infinite training batches from `start_step` on: {"image": float32 (B, H, W, C),
    "label": int32 (B,)}, batch k the same whatever step the stream started at.

    The training set is put on the default device once; each batch is one call of the jitted
    ``batch_maker`` on its example indices (computed here, on the host), so that a step's
    input is a single dispatch and a transfer of B int32 indices: on a GPU, eager gathers and
    normalisations made a single run's input slower than its step. ``patch`` is unused
    (images, not token batches: the model cuts them into patches); it is
    ``rope_lie.run_inputs``'s signature, so the two are interchangeable.
    """
    del patch
    check_config(config)
    if start_step < 0:
        raise ValueError(f"start_step={start_step} must be >= 0")
    images, labels = train_arrays(config.dataset)
    seed, batch, num = data_seed(config), config.batch_size, len(labels)
    make = jax.jit(batch_maker(config.dataset))
    images_NHWC, labels_N, key = jnp.asarray(images), jnp.asarray(labels), augment_key(seed)
    for step in itertools.count(start_step):
        index_B = jnp.asarray(batch_indices(seed, step, batch, num), jnp.int32)
        yield make(images_NHWC, labels_N, key, index_B, step)


def eval_batches(config: mc.ConfigDict, entry: mc.ConfigDict, mesh: Mesh, patch=None):
    """Every example of an evaluation entry once, in stored order: {"image", "label", "mask"},
    the last batch padded with zeros and mask 0; ``config.eval_batch_size`` rounded up to a
    multiple of the mesh's devices, as ``rope_lie.run_inputs.eval_batches``, whose signature
    this is (``patch`` unused). The batches are prepared once per split, size, batch size and
    normalisation and kept (``EVAL_SPLITS_CACHED``), read-only."""
    del patch
    ds = config.dataset
    yield from _prepared_eval_batches(
        fashion_mnist_files.idx_dir(),  # the files read: another directory, other batches
        entry.name or ds.name,
        entry.split or ds.eval_split,
        entry.image_size or ds.image_size,
        sharding.padded_batch_size(config.eval_batch_size, mesh),
        tuple(np.ravel(ds.mean).tolist()),
        tuple(np.ravel(ds.std).tolist()),
    )


# Evaluation splits whose prepared batches are kept: a run evaluates the same split at every
# evaluation (the plateau arms' test curve: 80-320 times), and every member of a seed ensemble
# does. Fashion-MNIST's test split is 31 MB of float32 at 28 px, 125 MB at 56.
EVAL_SPLITS_CACHED = 4


@functools.lru_cache(maxsize=EVAL_SPLITS_CACHED)
def _prepared_eval_batches(
    directory: str,
    name: str,
    split: str,
    size: int | None,
    batch_size: int,
    mean: tuple,
    std: tuple,
) -> tuple[dict[str, np.ndarray], ...]:
    del directory  # part of the key: ``arrays`` reads the same directory
    images, labels = arrays(name, split)
    stats = mc.ConfigDict({"mean": mean, "std": std})
    batches = []
    for start in range(0, len(labels), batch_size):
        chunk = jnp.asarray(images[start : start + batch_size])
        real = chunk.shape[0]
        if size is not None and size != chunk.shape[1]:
            chunk = resize(chunk, size)
        pad = batch_size - real
        image = np.asarray(normalise(chunk, stats))  # numpy: evaluate's patch shuffle reads it
        batch = {
            "image": np.pad(image, ((0, pad), (0, 0), (0, 0), (0, 0))),
            "label": np.pad(labels[start : start + batch_size], (0, pad)),
            "mask": np.pad(np.ones(real, np.float32), (0, pad)),
        }
        for array in batch.values():
            array.flags.writeable = False  # shared by every evaluation that reads the split
        batches.append(batch)
    return tuple(batches)
