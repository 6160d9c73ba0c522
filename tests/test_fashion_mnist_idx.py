"""fashion_mnist_idx: the IDX reader, the TFDS builder on IDX files written here, and the real
files of Debian's dataset-fashion-mnist when they are installed (always in CI)."""

import gzip
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from rope_lie.data import catalog, fashion_mnist_idx
from rope_lie.data import pipeline as pipeline_lib


def _write_idx(path: str, array: np.ndarray, gz: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">i4").tobytes()
    data = header + np.ascontiguousarray(array, np.uint8).tobytes()
    with (gzip.open if gz else open)(path + (".gz" if gz else ""), "wb") as f:
        f.write(data)


def _fake_files(directory, num_train=12, num_test=6, gz=True):
    rng = np.random.default_rng(0)
    arrays = {}
    for split, num in (("train", num_train), ("test", num_test)):
        images = rng.integers(0, 256, size=(num, 28, 28), dtype=np.uint8)
        labels = (np.arange(num) % 10).astype(np.uint8)
        stems = fashion_mnist_idx.FILES[split]
        _write_idx(os.path.join(directory, stems[0]), images, gz)
        _write_idx(os.path.join(directory, stems[1]), labels, gz)
        arrays[split] = (images, labels)
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_read_idx_roundtrip(tmp_path, gz):
    arrays = _fake_files(str(tmp_path), gz=gz)
    images, labels = fashion_mnist_idx.load_split("test", str(tmp_path))
    np.testing.assert_array_equal(images, arrays["test"][0])
    np.testing.assert_array_equal(labels, arrays["test"][1])


def test_read_idx_rejects_a_bad_header_and_a_short_file(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x00\x00\x0d\x01" + np.asarray([3], ">i4").tobytes() + b"\x00" * 12)
    with pytest.raises(ValueError, match="not an IDX file of uint8"):
        fashion_mnist_idx.read_idx(str(bad))
    short = tmp_path / "short"
    short.write_bytes(b"\x00\x00\x08\x01" + np.asarray([5], ">i4").tobytes() + b"\x01\x02")
    with pytest.raises(ValueError, match=r"header says \(5,\) .* file has 2"):
        fashion_mnist_idx.read_idx(str(short))


def test_missing_files_name_the_debian_package(tmp_path, monkeypatch):
    monkeypatch.setenv(fashion_mnist_idx.DIR_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        fashion_mnist_idx.load_split("train")


def test_builder_on_written_files(tmp_path, monkeypatch):
    """The builder's splits hold the files' images in order; the canvas config centres them."""
    files = tmp_path / "idx"
    files.mkdir()
    arrays = _fake_files(str(files))
    monkeypatch.setenv(fashion_mnist_idx.DIR_ENV, str(files))
    data_dir = str(tmp_path / "tfds")
    builder = catalog.prepare("fashion_mnist_idx/plain", data_dir)
    assert builder.info.splits["train"].num_examples == 12
    assert builder.info.features["label"].names[9] == "Ankle boot"
    test = list(tfds.as_numpy(builder.as_dataset(split="test", shuffle_files=False)))
    test.sort(key=lambda e: e["index"])
    np.testing.assert_array_equal(np.stack([e["image"][..., 0] for e in test]), arrays["test"][0])
    np.testing.assert_array_equal([e["label"] for e in test], arrays["test"][1])

    canvas = catalog.prepare("fashion_mnist_idx/canvas36", data_dir)
    assert list(canvas.info.splits) == ["test"]
    example = next(iter(tfds.as_numpy(canvas.as_dataset(split="test[:1]"))))
    index = int(example["index"])
    assert example["image"].shape == (36, 36, 1)
    np.testing.assert_array_equal(example["image"][4:32, 4:32, 0], arrays["test"][0][index])
    assert not example["image"][:4].any() and not example["image"][:, 32:].any()


def test_canvas_config_needs_an_even_margin():
    with pytest.raises(ValueError, match="canvas=31"):
        fashion_mnist_idx.FashionMnistIdxConfig(name="x", canvas=31)


def test_real_files_when_installed():
    """Debian's files: 60,000 + 10,000 images, balanced classes, the known pixel mean. CI
    installs the package (.ci/run), so there this test must run, not skip."""
    directory = fashion_mnist_idx.DEFAULT_DIR
    if not os.path.isdir(directory) and not os.environ.get("CI"):
        pytest.skip(f"{directory} absent: apt-get install -y dataset-fashion-mnist")
    train_images, train_labels = fashion_mnist_idx.load_split("train", directory)
    test_images, test_labels = fashion_mnist_idx.load_split("test", directory)
    assert train_images.shape == (60_000, 28, 28) and test_images.shape == (10_000, 28, 28)
    np.testing.assert_array_equal(np.bincount(train_labels), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(test_labels), [1000] * 10)
    # The normalisation constants of configs/fashion_mnist.py, measured on these files: the
    # pixels' mean and standard deviation from the count of each value (exact, and without a
    # float copy of 47 M pixels).
    counts = np.bincount(train_images.ravel(), minlength=256)
    values = np.arange(256) / 255.0
    mean = counts @ values / counts.sum()
    std = np.sqrt(counts @ (values - mean) ** 2 / counts.sum())
    assert abs(mean - 0.2860) < 5e-4
    assert abs(std - 0.3530) < 5e-4


def test_recipe_inputs_through_the_pipeline(tmp_path, monkeypatch):
    """configs/fashion_mnist.py's dataset config and evals build batches of the right shapes."""
    from configs import fashion_mnist

    files = tmp_path / "idx"
    files.mkdir()
    _fake_files(str(files), num_train=16, num_test=8)
    monkeypatch.setenv(fashion_mnist_idx.DIR_ENV, str(files))
    c = fashion_mnist.get_config("pe=liere,scale_aug")
    c.dataset.data_dir = str(tmp_path / "tfds")
    assert c.dataset.augment.crop == "inception" and c.dataset.augment.crop_area_min == 0.35
    train = pipeline_lib.make_train_iterator(c.dataset, batch_size=4, seed=0)
    batch = next(train)
    assert batch["image"].shape == (4, 28, 28, 1)
    for name, size in (("px56", 56), ("canvas44", 44), ("test", 28)):
        entry = c.evals[name]
        batches = list(
            pipeline_lib.make_eval_iterator(
                c.dataset, batch_size=8, name=entry.name, image_size=entry.image_size
            )
        )
        assert batches[0]["image"].shape == (8, size, size, 1), name


def test_recipe_smoke_trains_and_evaluates_every_regime(tmp_path, monkeypatch):
    """configs/fashion_mnist.py:smoke end to end on written files: an evaluation of each regime
    at its own resolution (28 px, shuffled, upsampled, on a canvas; the recipe's other sizes are
    the same regimes: test_recipe_arguments_for_p_rope_and_the_evaluations counts them)."""
    from configs import fashion_mnist
    from rope_lie import train

    files = tmp_path / "idx"
    files.mkdir()
    _fake_files(str(files), num_train=32, num_test=16)
    monkeypatch.setenv(fashion_mnist_idx.DIR_ENV, str(files))
    c = fashion_mnist.get_config("pe=rope_mixed,smoke")
    c.dataset.data_dir = str(tmp_path / "tfds")
    c.evals = {name: c.evals[name] for name in ("test", "test_shuffled", "px56", "canvas44")}
    final = train.train_and_evaluate(c, str(tmp_path / "run"))
    resolutions = {name: res["resolution"] for name, res in final["evals"].items()}
    assert resolutions == {
        "test": "28x28",
        "test_shuffled": "28x28",
        "px56": "56x56",
        "canvas44": "44x44",
    }
    assert all(np.isfinite(res["loss"]) for res in final["evals"].values())


def test_recipe_arguments_for_p_rope_and_the_evaluations():
    """rotary_fraction reaches the family (p-RoPE: DINOv3's lowest frequency per axis off at
    0.75, head_dim 16), is refused for a family without it; resolution_evals=false keeps only
    the two evaluations at the training size."""
    import jax

    from configs import fashion_mnist
    from rope_lie import train

    config = fashion_mnist.get_config("pe=dinov3,rotary_fraction=0.75")

    @jax.jit  # one program (the model's unused weights dropped), not the eager ops of an init
    def angles_TNF(key):
        return train.build_model(config.model, key).precompute_pe((7, 7))[0].angle_TNF

    angles = np.abs(np.asarray(angles_TNF(jax.random.key(0)))).max(axis=(0, 1))
    assert angles.shape == (8,) and list(angles == 0) == [False, False, False, True] * 2
    assert "rotary_fraction" not in fashion_mnist.get_config("pe=dinov3").model.pe_hparams
    with pytest.raises(
        ValueError, match="rotary_fraction=0.5 does nothing here: it needs a pe in .*not pe='liere'"
    ):
        fashion_mnist.get_config("pe=liere,rotary_fraction=0.5")
    assert set(fashion_mnist.get_config("resolution_evals=false").evals) == {
        "test",
        "test_shuffled",
    }
    assert len(fashion_mnist.get_config("").evals) == 8
