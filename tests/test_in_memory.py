"""The in-memory input path (rope_lie/in_memory.py) against the TFDS path: the same data, the
same statistics, other batches; exact resumes; and a training run with TensorFlow blocked."""

import gzip
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from rope_lie import fashion_mnist_files, in_memory, sharding, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL = fashion_mnist_files.DEFAULT_DIR


def _write_idx(path: str, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">i4").tobytes()
    with gzip.open(path + ".gz", "wb") as f:
        f.write(header + np.ascontiguousarray(array, np.uint8).tobytes())


def _write_split(directory, split: str, images: np.ndarray, labels: np.ndarray) -> None:
    stems = fashion_mnist_files.FILES[split]
    _write_idx(os.path.join(directory, stems[0]), images)
    _write_idx(os.path.join(directory, stems[1]), labels)


@pytest.fixture(scope="module")
def real_subset(tmp_path_factory):
    """IDX files of the first 1,200 training and 300 test images of the installed dataset."""
    if not os.path.exists(os.path.join(REAL, "t10k-labels-idx1-ubyte.gz")):
        pytest.skip(f"Fashion-MNIST is not installed in {REAL} (dataset-fashion-mnist)")
    directory = tmp_path_factory.mktemp("idx")
    for split, count in (("train", 1200), ("test", 300)):
        images, labels = fashion_mnist_files.load_split(split, REAL)
        _write_split(directory, split, images[:count], labels[:count])
    return str(directory)


@pytest.fixture
def at(monkeypatch):
    """Point the IDX reader at a directory (and forget arrays read from another)."""

    def point(directory):
        monkeypatch.setenv(fashion_mnist_files.DIR_ENV, str(directory))
        in_memory._split_arrays.cache_clear()

    yield point
    in_memory._split_arrays.cache_clear()


def _config(arg="pe=ape", **fields):
    from configs import fashion_mnist

    config = fashion_mnist.get_config(f"{arg},input=memory")
    for key, value in fields.items():
        config[key] = value
    return config


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _memory_batches(config, n, start=0):
    batches = _take(in_memory.data_train_batches(config, None, start), n)
    return {k: np.concatenate([np.asarray(b[k]) for b in batches]) for k in ("image", "label")}


def _tfds_batches(config, tfds_dir, n):
    from rope_lie.data import pipeline

    ds = config.dataset.copy_and_resolve_references()
    ds.data_dir = tfds_dir
    iterator = pipeline.make_train_iterator(ds, batch_size=config.batch_size, seed=config.seed)
    batches = _take(iterator, n)
    return {k: np.concatenate([b[k] for b in batches]) for k in ("image", "label")}


def test_the_recipe_selects_it_and_turns_tensorboard_off():
    config = _config()
    assert config.input == "memory" and not config.tensorboard
    assert in_memory.uses_memory(config) and train.input_module(config) is in_memory
    from configs import fashion_mnist

    assert fashion_mnist.get_config("pe=ape").input == "tfds"
    config.input = "disk"
    with pytest.raises(ValueError, match="input='disk'; expected 'tfds' .* or 'memory'"):
        in_memory.uses_memory(config)


def test_label_and_pixel_statistics_match_the_tfds_path(real_subset, at, tfds_dir):
    """Ten batches of 128 (the first 1,280 of a stream over 1,200 images, both paths, the
    recipe's crop and flip): the same label counts over the first epoch, pixel mean and SD
    within sampling error, and the same first epoch's examples in another order."""
    at(real_subset)
    config = _config()
    memory, tfds = _memory_batches(config, 10), _tfds_batches(config, tfds_dir, 10)
    first = slice(0, 1200)  # one epoch each: every image once
    np.testing.assert_array_equal(
        np.bincount(memory["label"][first], minlength=10),
        np.bincount(tfds["label"][first], minlength=10),
    )
    assert not np.array_equal(memory["label"], tfds["label"])  # another order
    for stat in (np.mean, np.std):
        assert abs(stat(memory["image"]) - stat(tfds["image"])) < 0.02, stat
    # Mirroring and shifting keep the class-average image's mass where it was: the mean image
    # over the epoch agrees pixel by pixel up to the augmentation's sampling noise.
    mean_memory, mean_tfds = memory["image"][first].mean(0), tfds["image"][first].mean(0)
    assert np.abs(mean_memory - mean_tfds).max() < 0.25
    assert np.abs(mean_memory - mean_tfds).mean() < 0.05


def _probe_files(directory, count=600):
    """Every image the same: black, one bright 3x3 block left of centre (rows 12-14, columns
    6-8), so each augmented copy shows its crop shift and flip."""
    images = np.zeros((count, 28, 28), np.uint8)
    images[:, 12:15, 6:9] = 255
    labels = (np.arange(count) % 10).astype(np.uint8)
    _write_split(directory, "train", images, labels)
    _write_split(directory, "test", images[:10], labels[:10])


def _shifts_and_flips(images_BHWC):
    """(dy, dx, flipped) of each augmented probe image: the block's top-left corner moved by
    (dy, dx) from (12, 6), or mirrored (its corner near column 19)."""
    bright = images_BHWC[..., 0] > images_BHWC.min() + 1.0
    rows = bright.any(axis=2).argmax(axis=1)
    cols = bright.any(axis=1).argmax(axis=1)
    flipped = cols > 13
    dx = np.where(flipped, (27 - 8) - cols, cols - 6)  # a mirrored block starts at 19 - dx
    return rows - 12, dx, flipped


def test_augmentation_statistics_match_the_tfds_path(tmp_path, at, tfds_dir):
    """On probe images: both paths shift by -2..2 px in each direction, uniformly and
    independently of each other and of the flip, and mirror half the images."""
    _probe_files(tmp_path)
    at(tmp_path)
    config = _config()
    tfds_root = str(tmp_path / "tfds")
    observed = {}
    for path, batches in (
        ("memory", _memory_batches(config, 15)),
        ("tfds", _tfds_batches(config, tfds_root, 15)),
    ):
        dy, dx, flipped = _shifts_and_flips(batches["image"])
        n = len(dy)
        assert set(dy) <= set(range(-2, 3)) and set(dx) <= set(range(-2, 3)), path
        for shift in (dy, dx):  # 5 values, 384 expected each: within 4.5 SDs
            counts = np.bincount(shift + 2, minlength=5)
            assert np.all(np.abs(counts - n / 5) < 4.5 * np.sqrt(n * 0.2 * 0.8)), (path, counts)
        assert abs(flipped.mean() - 0.5) < 4.5 * np.sqrt(0.25 / n), path
        assert abs(np.corrcoef(dy, dx)[0, 1]) < 0.1 and abs(np.corrcoef(dx, flipped)[0, 1]) < 0.1
        observed[path] = np.bincount((dy + 2) * 5 + dx + 2, minlength=25)
    # The 25 shift cells: one distribution on both paths (chi-squared test of homogeneity of
    # the 2 x 25 table, 24 degrees of freedom; two samples of 1,920 from one distribution are
    # about 0.06 apart in total variation, so a fixed distance bound would be a coin's toss).
    from scipy import stats

    table = np.stack([observed["memory"], observed["tfds"]])
    assert stats.chi2_contingency(table).pvalue > 1e-3, table


def _real_examples(batches):
    """(images, labels) of the unpadded examples of eval batches."""
    keep = np.concatenate([b["mask"] for b in batches]) > 0
    images = np.concatenate([np.asarray(b["image"]) for b in batches])[keep]
    return images, np.concatenate([np.asarray(b["label"]) for b in batches])[keep]


def test_eval_batches_hold_the_tfds_paths_examples(real_subset, at, tfds_dir):
    """Evaluation has no randomness: the same examples as the TFDS path (each image to a grey
    level after bilinear resizing, with its label) and the same padding, at 28 px, resized,
    and on a canvas. The order differs (file order here; TFDS stores a hash order), so
    per-example results of runs on the two paths do not line up."""
    from rope_lie.data import pipeline

    at(real_subset)
    config = _config("pe=ape,px56")
    ds = config.dataset.copy_and_resolve_references()
    ds.data_dir = tfds_dir
    one_level = 1 / 255 / config.dataset.std[0]
    config.eval_batch_size = 128
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1}, jax.devices()[:1])
    for name in ("test", "px56", "canvas44"):
        entry = config.evals[name]
        memory = list(in_memory.eval_batches(config, entry, mesh))
        tfds = list(
            pipeline.make_eval_iterator(
                ds, batch_size=128, name=entry.name, image_size=entry.image_size
            )
        )
        assert len(memory) == len(tfds) == 3, name  # 300 images: 128 + 128 + 44 and padding
        assert np.asarray(memory[-1]["mask"]).sum() == 44 and memory[-1]["image"].shape[0] == 128
        images_m, labels_m = _real_examples(memory)
        images_t, labels_t = _real_examples(tfds)
        stored = in_memory.arrays("fashion_mnist_idx/plain", "test")[1]
        np.testing.assert_array_equal(labels_m, stored)  # file order
        # Each TFDS example's nearest in-memory image (max abs difference) is one image, its
        # match for every pixel to a grey level, with the same label.
        distance_TM = np.abs(images_t[:, None] - images_m[None]).reshape(300, 300, -1).max(-1)
        match = distance_TM.argmin(axis=1)
        assert len(set(match)) == 300, name
        assert distance_TM[np.arange(300), match].max() <= 1.01 * one_level, name
        np.testing.assert_array_equal(labels_m[match], labels_t)


def test_eval_batches_are_prepared_once_per_split_and_read_only(real_subset, at, tmp_path):
    # A run evaluates its test split at every evaluation, and a seed ensemble's members each
    # do: the second pass reads the kept batches, which no reader can change.
    at(real_subset)
    config = _config("pe=ape")
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1}, jax.devices()[:1])
    in_memory._prepared_eval_batches.cache_clear()
    first = list(in_memory.eval_batches(config, config.evals["test"], mesh))
    again = list(in_memory.eval_batches(config, config.evals["test"], mesh))
    info = in_memory._prepared_eval_batches.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    for a, b in zip(first, again, strict=True):
        for key in ("image", "label", "mask"):
            np.testing.assert_array_equal(a[key], b[key])
    with pytest.raises(ValueError, match="read-only"):
        first[0]["image"][0, 0, 0, 0] = 1.0
    # Other files (the same names in another directory) are other batches.
    images, labels = in_memory.arrays("fashion_mnist_idx/plain", "test")
    _write_split(tmp_path, "test", 255 - images[..., 0], labels)
    _write_split(tmp_path, "train", images[..., 0], labels)
    at(tmp_path)
    other = list(in_memory.eval_batches(config, config.evals["test"], mesh))
    assert not np.array_equal(other[0]["image"], first[0]["image"])


def test_the_stream_resumes_exactly_and_data_seed_sets_it(real_subset, at):
    at(real_subset)
    config = _config()  # 1,200 images: 9.4 batches of 128 an epoch; batch 9 straddles two
    reference = _take(in_memory.data_train_batches(config, None, 0), 12)
    for start in (5, 9):
        resumed = _take(in_memory.data_train_batches(config, None, start), 12 - start)
        for step, batch in enumerate(resumed, start):
            for key in ("image", "label"):
                np.testing.assert_array_equal(batch[key], reference[step][key], f"{key}@{step}")
    epoch0 = np.concatenate([np.asarray(b["label"]) for b in reference])[:1200]
    stored = in_memory.arrays("fashion_mnist_idx/plain", "train")[1]
    np.testing.assert_array_equal(np.sort(epoch0), np.sort(stored))

    # Two arms with other init seeds and one data_seed read one stream; data_seed k reads
    # seed k's.
    def first(**fields):
        return np.asarray(next(in_memory.data_train_batches(_config(**fields), None, 0))["image"])

    np.testing.assert_array_equal(first(seed=0, data_seed=7), first(seed=1, data_seed=7))
    np.testing.assert_array_equal(first(seed=0, data_seed=7), first(seed=7))
    assert not np.array_equal(first(seed=0), first(seed=1))


def test_interleaved_streams_compute_each_epoch_order_once():
    # A seed ensemble reads its members' streams in turn; each epoch's permutation is then
    # computed once per stream, not once per batch.
    in_memory.epoch_order.cache_clear()
    seeds, num, batch = range(5), 1_000, 128  # batch 7 straddles epochs 0 and 1
    for step in range(12):
        for seed in seeds:
            in_memory.batch_indices(seed, step, batch, num)
    assert in_memory.epoch_order.cache_info().misses == 2 * len(seeds)


def test_it_refuses_what_it_does_not_do(real_subset, at):
    at(real_subset)
    with pytest.raises(ValueError, match="augment.crop='inception'; it supports 'none' or 'pad'"):
        in_memory.check_config(_config("pe=ape,scale_aug"))
    with pytest.raises(ValueError, match="naflex=.*it supports unset"):
        in_memory.check_config(_config("pe=ape,naflex"))
    cropped = _config("pe=ape")
    cropped.dataset.eval_crop_fraction = 0.875
    with pytest.raises(ValueError, match="eval_crop_fraction=0.875; it supports 1.0"):
        in_memory.check_config(cropped)
    rooted = _config("pe=ape")  # a TFDS root would be ignored: the IDX files are read
    rooted.dataset.data_dir = "/data/tfds"
    with pytest.raises(ValueError, match="data_dir='/data/tfds'; it supports None; it reads"):
        in_memory.check_config(rooted)
    both = _config("pe=ape")  # a slice and a fraction of it: refused, as the TFDS path does
    both.dataset.train_split, both.dataset.train_fraction = "train[:1000]", 0.5
    with pytest.raises(ValueError, match="train_fraction=0.5 needs a plain split name"):
        in_memory.check_config(both)
    with pytest.raises(ValueError, match="reads fashion_mnist_idx/.*not 'cifar10'"):
        in_memory.arrays("cifar10", "test")
    with pytest.raises(ValueError, match="canvas44 holds the test split only"):
        in_memory.arrays("fashion_mnist_idx/canvas44", "train")
    with pytest.raises(ValueError, match="split='test\\[:10%\\]'; expected train or test"):
        in_memory.arrays("fashion_mnist_idx/plain", "test[:10%]")
    assert in_memory.arrays("fashion_mnist_idx/canvas56", "test[:4]")[0].shape == (4, 56, 56, 1)


def test_a_run_trains_and_evaluates_with_tensorflow_blocked(tmp_path, real_subset):
    """configs/fashion_mnist.py:smoke,input=memory through rope_lie.main in a process where
    importing tensorflow or tensorflow_datasets fails, as on a machine without them. The input
    path is under test, not the encoder: APE's steps compile in about half LieRE's time."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["tensorflow"] = None  # import tensorflow -> ImportError
        sys.modules["tensorflow_datasets"] = None
        sys.argv = ["rope_lie.main",
                    "--config={REPO}/configs/fashion_mnist.py:pe=ape,smoke,px56,input=memory",
                    "--workdir={tmp_path / "run"}"]
        import runpy
        runpy.run_module("rope_lie.main", run_name="__main__")
        """
    )
    env = dict(os.environ, **{fashion_mnist_files.DIR_ENV: real_subset, "PYTHONPATH": REPO})
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "run" / "final.json") as f:
        final = json.load(f)
    assert set(final["evals"]) == {"test", "test_shuffled", "px56", "px56_shuffled"} | {
        f"{kind}{side}" for kind in ("px", "canvas") for side in (36, 44)
    } | {"canvas56"}
    assert final["evals"]["px56"]["resolution"] == "56x56"
    assert all(res["num_examples"] == 16 for res in final["evals"].values())


def test_the_augmentation_keys_are_not_the_models_keys():
    """train.py splits key(seed) into the init and dropout keys, fold_in(key(seed), 0) and 1:
    with data_seed = seed, batches 0 and 1 were cropped with them. The stream has its own root."""
    import jax

    def data(key):
        return tuple(np.asarray(jax.random.key_data(key)).ravel())

    for seed in (0, 3):
        init_key, dropout_key = jax.random.split(jax.random.key(seed))
        model = {data(init_key), data(dropout_key)}
        model |= {data(jax.random.fold_in(dropout_key, step)) for step in range(4)}
        root = in_memory.augment_key(seed)
        assert not model & ({data(root)} | {data(jax.random.fold_in(root, k)) for k in range(4)})
