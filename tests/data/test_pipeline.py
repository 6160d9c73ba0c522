"""Tests for the input pipeline: shapes, resumability, eval coverage, process splits, recipes,
damaged record files."""

import os
import re
import shutil
import struct

import numpy as np
import pytest
import tensorflow_datasets as tfds

import rope_lie.data as data
from rope_lie.data import catalog, pipeline
from rope_lie.data.spatial_arrows import SpatialArrowsConfig
from rope_lie.data.spatial_arrows_3d import SpatialArrows3dConfig


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    """sklearn_digits/size8 plus tiny spatial_arrows(_3d) configs, loadable by name."""
    root = str(tmp_path_factory.mktemp("tfds"))
    data.prepare("sklearn_digits/size8", root)
    for name, config in [
        (
            "spatial_arrows",
            SpatialArrowsConfig(name="tiny_g6", grid_size=6, num_train=48, num_test=20),
        ),
        (
            "spatial_arrows",
            SpatialArrowsConfig(name="tiny_g9", grid_size=9, num_train=8, num_test=20),
        ),
        (
            "spatial_arrows_3d",
            SpatialArrows3dConfig(name="tiny", grid_size=4, depth_size=3, num_train=16, num_test=8),
        ),
    ]:
        tfds.builder(name, config=config, data_dir=root).download_and_prepare()
    return root


def _cfg(name: str, data_dir: str, **fields):
    cfg = data.default_config(name)
    cfg.data_dir = data_dir
    cfg.update(fields)
    return cfg


def _full_augment(cfg):
    aug = cfg.augment
    aug.crop, aug.crop_padding, aug.flip = "pad", 1, True
    aug.randaugment.num_layers = 2
    aug.mixup_alpha, aug.cutmix_alpha, aug.label_smoothing = 0.2, 1.0, 0.1
    return cfg


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _stored(data_dir, name, split, key="image"):
    builder = tfds.builder(name, data_dir=data_dir)
    return [ex[key] for ex in tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False))]


@pytest.mark.parametrize("name", sorted(data.RECIPES))
def test_default_configs_are_valid(name):
    assert data.check_config(data.default_config(name)) is data.RECIPES[name]


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("augment.flip", True, "change the label"),
        ("eval_crop_fraction", 0.75, "eval_crop_fraction=0.75 would cut glyphs away"),
        ("augment.cutmix_alpha", 1.0, "augment.cutmix_alpha=1.0 would cut glyphs away"),
        ("augment.crop", "random", "augment.crop='random'"),
        ("train_fraction", 0.0, "train_fraction=0.0"),
        ("image_size", 16, "volumes keep their stored size"),
    ],
)
def test_bad_configs_are_rejected(field, value, match):
    name = "spatial_arrows_3d/c4_g6" if field == "image_size" else "spatial_arrows/c8_g8"
    cfg = data.default_config(name)
    section, _, leaf = field.rpartition(".")
    (cfg[section] if section else cfg)[leaf] = value
    with pytest.raises(ValueError, match=match):
        data.check_config(cfg)


def test_incomplete_config_and_bad_batch_are_rejected():
    cfg = data.default_config("cifar10")
    del cfg["shuffle_buffer"]
    with pytest.raises(ValueError, match="lacks \\['shuffle_buffer'\\]"):
        data.check_config(cfg)
    cfg = data.default_config("ucf101")
    cfg.augment.randaugment.num_layers = 2
    with pytest.raises(ValueError, match="RandAugment is for 2D images"):
        data.check_config(cfg)
    with pytest.raises(ValueError, match="batch_size=10 must be a positive multiple"):
        pipeline.local_batch_size(10, 4)


def test_train_batches_shapes_and_dtypes(data_dir):
    batch = next(
        data.make_train_iterator(
            _full_augment(_cfg("sklearn_digits/size8", data_dir)), batch_size=16, seed=0
        )
    )
    assert batch["image"].shape == (16, 8, 8, 1) and batch["image"].dtype == np.float32
    assert batch["label"].shape == (16,) and batch["label"].dtype == np.int32
    assert batch["soft_label"].shape == (16, 10) and batch["soft_label"].dtype == np.float32
    np.testing.assert_allclose(batch["soft_label"].sum(1), 1.0, rtol=1e-5)
    arrows = next(
        data.make_train_iterator(_cfg("spatial_arrows/tiny_g6", data_dir), batch_size=8, seed=0)
    )
    assert set(arrows) == {"image", "label"} and arrows["image"].shape == (8, 48, 48, 1)
    assert set(np.unique(arrows["image"])) == {-1.0, 1.0}  # (0 or 255) / 255 - 0.5) / 0.5
    volumes = next(
        data.make_train_iterator(_cfg("spatial_arrows_3d/tiny", data_dir), batch_size=4, seed=0)
    )
    assert volumes["image"].shape == (4, 12, 16, 16, 1) and volumes["label"].max() < 6


@pytest.mark.parametrize("process_index, process_count", [(0, 1), (1, 2)])
def test_resuming_gives_the_same_batches(data_dir, process_index, process_count):
    # 359 examples (train_fraction) over 1 or 2 processes, 32 or 16 per batch: batches
    # straddle epoch boundaries and the resumed streams start in epochs 0, 1 and 2.
    cfg = _full_augment(_cfg("sklearn_digits/size8", data_dir, train_fraction=0.25))
    kwargs = dict(batch_size=32, seed=3, process_index=process_index, process_count=process_count)
    reference = _take(data.make_train_iterator(cfg, **kwargs), 30)
    for start in (7, 17, 26):
        resumed = _take(data.make_train_iterator(cfg, start_step=start, **kwargs), 30 - start)
        for step, batch in enumerate(resumed, start):
            for key, value in batch.items():
                np.testing.assert_array_equal(value, reference[step][key], err_msg=f"{key}@{step}")
    other_seed = next(data.make_train_iterator(cfg, **{**kwargs, "seed": 4}))
    assert not np.array_equal(other_seed["image"], reference[0]["image"])


def _run_config(data_dir, seed, data_seed=None):
    """The fields of a run config that `run_inputs.data_train_batches` reads."""
    import ml_collections as mc

    cfg = _full_augment(_cfg("sklearn_digits/size8", data_dir, train_fraction=0.25))
    config = mc.ConfigDict(dict(dataset=cfg, batch_size=32, seed=seed, data_shards=0))
    config.data_seed = mc.config_dict.placeholder(int)
    config.data_seed = data_seed
    return config


def _images(batches, n=4):
    return np.stack([b["image"] for b in _take(batches, n)])


def test_data_seed_sets_the_batches_apart_from_the_seed(data_dir):
    from rope_lie import run_inputs

    def batches(seed, data_seed=None):
        config = _run_config(data_dir, seed, data_seed)
        return _images(run_inputs.data_train_batches(config, (4, 4), 0))

    # Without data_seed the seed sets the batches, as before data_seed existed (the pipeline
    # called with the seed), so runs recorded before it stay valid.
    expected = _images(
        data.make_train_iterator(_run_config(data_dir, 3).dataset, batch_size=32, seed=3)
    )
    np.testing.assert_array_equal(batches(3), expected)
    np.testing.assert_array_equal(batches(3, data_seed=3), expected)
    # Two arms with different init seeds and one data_seed read the same batches ...
    seed0_data7 = batches(0, data_seed=7)
    np.testing.assert_array_equal(seed0_data7, batches(1, data_seed=7))
    # ... and different data_seeds give different orders (and augmentations).
    assert not np.array_equal(seed0_data7, batches(0, data_seed=8))
    # data_seed k reads what seed k alone reads: it takes the seed's place in the pipeline.
    np.testing.assert_array_equal(seed0_data7, batches(7))


def test_each_epoch_is_a_fresh_permutation(data_dir):
    name = "spatial_arrows/tiny_g6"  # 48 train examples = 6 batches of 8 per epoch
    batches = _take(data.make_train_iterator(_cfg(name, data_dir), batch_size=8, seed=0), 12)
    stored = sorted(
        ((im.astype(np.float32) / 255 - 0.5) / 0.5).tobytes()
        for im in _stored(data_dir, name, "train")
    )
    epochs = [np.concatenate([b["image"] for b in batches[e * 6 : e * 6 + 6]]) for e in (0, 1)]
    for images in epochs:
        assert sorted(im.tobytes() for im in images) == stored
    assert not np.array_equal(epochs[0], epochs[1])


def test_train_fraction_takes_the_first_examples(data_dir):
    cfg = _cfg("sklearn_digits/size8", data_dir, train_fraction=0.25, shuffle_buffer=1)
    assert data.dataset_summary(cfg) == {
        "num_classes": 10,
        "num_train_examples": 359,
        "example_shape": (8, 8, 1),
    }
    # A buffer of one keeps the stored order: the stream starts with the first 359 examples.
    labels = np.concatenate(
        [b["label"] for b in _take(data.make_train_iterator(cfg, batch_size=359, seed=0), 2)]
    )
    stored = _stored(data_dir, "sklearn_digits/size8", "train", "label")
    np.testing.assert_array_equal(labels, np.tile(stored[:359], 2))


def test_augmentation_is_fresh_each_epoch_and_reproducible(data_dir):
    cfg = _cfg("sklearn_digits/size8", data_dir, train_fraction=0.25, shuffle_buffer=1)
    cfg.augment.crop, cfg.augment.crop_padding, cfg.augment.flip = "pad", 2, True
    first, second = _take(data.make_train_iterator(cfg, batch_size=359, seed=0), 2)
    np.testing.assert_array_equal(first["label"], second["label"])  # same order, one per epoch
    changed = (first["image"] != second["image"]).any(axis=(1, 2, 3))
    assert changed.mean() > 0.5
    again = next(data.make_train_iterator(cfg, batch_size=359, seed=0, start_step=1))
    np.testing.assert_array_equal(again["image"], second["image"])


def test_eval_covers_every_example_once_with_a_mask(data_dir):
    cfg = _cfg("sklearn_digits/size8", data_dir)
    batches = list(data.make_eval_iterator(cfg, batch_size=64))
    assert len(batches) == 6 and all(b["image"].shape == (64, 8, 8, 1) for b in batches)
    mask = np.concatenate([b["mask"] for b in batches])
    assert mask.dtype == np.float32 and mask.tolist() == [1.0] * 360 + [0.0] * 24
    images = np.concatenate([b["image"] for b in batches])
    labels = np.concatenate([b["label"] for b in batches])
    stored = np.stack(_stored(data_dir, "sklearn_digits/size8", "test"))
    np.testing.assert_allclose(images[:360], (stored / 255 - 0.5) / 0.5, atol=1e-6)
    np.testing.assert_array_equal(
        labels[:360], _stored(data_dir, "sklearn_digits/size8", "test", "label")
    )
    assert not images[360:].any() and not labels[360:].any()


@pytest.mark.parametrize("process_count", [2, 3])
def test_process_splits_are_disjoint_and_cover_the_split(data_dir, process_count):
    builder = tfds.builder("sklearn_digits/size8", data_dir=data_dir)
    recipe = data.RECIPES["sklearn_digits"]
    seen = []
    for p in range(process_count):
        ds, n = pipeline.read_split(
            builder, recipe, pipeline.process_split("test", p, process_count)
        )
        indices = [int(ex["index"]) for ex in tfds.as_numpy(ds)]
        assert len(indices) == n
        seen.append(set(indices))
    assert sum(len(s) for s in seen) == 360
    assert set().union(*seen) == set(_stored(data_dir, "sklearn_digits/size8", "test", "index"))
    cfg = _cfg("sklearn_digits/size8", data_dir)
    per_process = [
        list(
            data.make_eval_iterator(
                cfg, batch_size=24 * process_count, process_index=p, process_count=process_count
            )
        )
        for p in range(process_count)
    ]
    assert len({len(batches) for batches in per_process}) == 1
    assert per_process[0][0]["image"].shape[0] == 24
    assert sum(b["mask"].sum() for batches in per_process for b in batches) == 360
    # where each process's part starts in the split (evaluate's shuffled patches skip to it)
    assert "first_example" not in per_process[0][0]
    for p in range(1, process_count):
        before = sum(b["mask"].sum() for batches in per_process[:p] for b in batches)
        assert {int(b["first_example"]) for b in per_process[p]} == {before}
    firsts = [
        next(
            data.make_train_iterator(
                cfg,
                batch_size=8 * process_count,
                seed=0,
                process_index=p,
                process_count=process_count,
            )
        )
        for p in range(2)
    ]
    assert not np.array_equal(firsts[0]["image"], firsts[1]["image"])


def test_eval_overrides_grid_and_resolution(data_dir):
    cfg = _cfg("spatial_arrows/tiny_g6", data_dir)
    larger = next(data.make_eval_iterator(cfg, batch_size=8, name="spatial_arrows/tiny_g9"))
    assert larger["image"].shape == (8, 72, 72, 1)
    digits = _cfg("sklearn_digits/size8", data_dir)
    assert next(data.make_eval_iterator(digits, batch_size=8, image_size=16))["image"].shape == (
        8,
        16,
        16,
        1,
    )


CATALOGUE = {
    "cifar10": ((32, 32, 3), 10, ("train", "test")),
    "cifar100": ((32, 32, 3), 100, ("train", "test")),
    "mnist": ((32, 32, 1), 10, ("train", "test")),
    "imagenet2012": ((224, 224, 3), 1000, ("train", "validation")),
    "ucf101": ((8, 224, 224, 3), 101, ("train", "test")),
}


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_catalogue_recipes_on_mock_data(tmp_path, name):
    shape, num_classes, splits = CATALOGUE[name]
    catalog.write_mock_metadata(name, str(tmp_path), num_examples=4, splits=splits)
    cfg = _cfg(name, str(tmp_path))
    cfg.augment.label_smoothing = 0.1
    policy = tfds.testing.MockPolicy.USE_FILES
    with tfds.testing.mock_data(num_examples=4, data_dir=str(tmp_path), policy=policy):
        train = next(data.make_train_iterator(cfg, batch_size=2, seed=0))
        evals = list(data.make_eval_iterator(cfg, batch_size=2))
    assert train["image"].shape == (2, *shape) and train["image"].dtype == np.float32
    assert train["soft_label"].shape == (2, num_classes)
    assert np.isfinite(train["image"]).all() and 0 <= train["label"].min() < num_classes + 1
    assert len(evals) == 2 and evals[0]["image"].shape == (2, *shape)
    assert evals[-1]["mask"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("cifar100", "tfds build cifar100 --data_dir="),
        ("imagenet2012", "downloads/manual"),
        ("ucf101/ucf101_1", "tfds build ucf101 --config=ucf101_1 --data_dir="),
    ],
)
def test_missing_catalogue_dataset_says_how_to_prepare_it(tmp_path, name, expected):
    cfg = _cfg(name, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="is not prepared") as error:
        data.make_train_iterator(cfg, batch_size=2, seed=0)
    assert expected in str(error.value) and str(tmp_path) in str(error.value)


def test_prepare_generates_local_datasets_on_first_use(tmp_path, capsys):
    builder = data.prepare("sklearn_digits/size16", str(tmp_path))
    assert builder.is_prepared() and "Generating sklearn_digits/size16" in capsys.readouterr().out
    data.prepare("sklearn_digits/size16", str(tmp_path))
    assert "Generating" not in capsys.readouterr().out


def _cut_in_half(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _overwrite_first_record_data(path):  # its length field intact: only its checksum fails
    # Inverted, not overwritten with a constant: the record's bytes vary between processes
    # (protobuf writes the feature map in a per-process order), and the 0xff runs of the
    # glyph grid's -1 varints sometimes sat where a constant went, leaving the file intact.
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(12 + length // 2)
        data = f.read(8)
        f.seek(12 + length // 2)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize(
    "damage, split, reason",
    [
        (_cut_in_half, "train", "truncated record at"),
        (_overwrite_first_record_data, "train", "corrupted record at 12"),
        (os.remove, "test", "No such file or directory"),
    ],
)
def test_a_damaged_record_file_is_named_with_how_to_prepare_again(
    data_dir, tmp_path, damage, split, reason
):
    name = "spatial_arrows/tiny_g6"
    shutil.copytree(os.path.join(data_dir, name), tmp_path / name)
    version_dir = tmp_path / name / "1.0.0"
    path = str(version_dir / f"spatial_arrows-{split}.tfrecord-00000-of-00001")
    damage(path)
    cfg = _cfg(name, str(tmp_path))
    if split == "train":
        batches = data.make_train_iterator(cfg, batch_size=8, seed=0)
    else:
        batches = data.make_eval_iterator(cfg, batch_size=8)
    match = f"TFDS dataset '{name}', split '{split}': {re.escape(path)} is damaged or missing"
    with pytest.raises(OSError, match=match) as error:
        for _ in range(10):  # 48 train examples: the whole file within 6 batches
            next(batches)
    assert reason in str(error.value)
    assert f"rm -r {version_dir}" in str(error.value) and "generated on first use" in str(
        error.value
    )


def test_closing_the_stream_needs_no_tensorflow_at_exit(monkeypatch):
    """A stream closed while TensorFlow is torn down (interpreter exit) closes quietly; it used
    to print "Exception ignored in ... naming_damage: AttributeError" after every run."""
    from rope_lie.data import records

    stream = records.naming_damage(iter([1, 2]), None, "name", "train", "train")
    assert next(stream) == 1
    monkeypatch.setattr(records.tf, "errors", None)
    stream.close()  # GeneratorExit passes the except clause without touching tf.errors
