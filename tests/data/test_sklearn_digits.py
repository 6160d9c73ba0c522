"""Tests for the sklearn_digits builder: fixed splits, pixel mapping, resizing."""

import numpy as np
import pytest
import tensorflow_datasets as tfds
from sklearn.datasets import load_digits

from rope_lie.data import sklearn_digits as sd


@pytest.fixture(scope="module")
def digits():
    return load_digits()


@pytest.fixture(scope="module")
def built_size8(tmp_path_factory):
    builder = tfds.builder("sklearn_digits/size8", data_dir=str(tmp_path_factory.mktemp("tfds")))
    builder.download_and_prepare()
    return {s: list(tfds.as_numpy(builder.as_dataset(split=s))) for s in ("train", "test")}


def test_splits_are_disjoint_cover_everything_and_are_fixed(built_size8):
    train = {int(ex["index"]) for ex in built_size8["train"]}
    test = {int(ex["index"]) for ex in built_size8["test"]}
    assert len(train) == 1437 and len(test) == 360
    assert not train & test and train | test == set(range(1797))
    again = sd.split_indices()
    assert sorted(test) == again["test"].tolist() and sorted(train) == again["train"].tolist()


def test_test_split_is_stratified(built_size8):
    counts = np.bincount([ex["label"] for ex in built_size8["test"]], minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37, counts


def test_pixels_and_labels_match_sklearn(built_size8, digits):
    for ex in built_size8["train"][:200] + built_size8["test"][:100]:
        i = int(ex["index"])
        assert ex["label"] == digits.target[i]
        assert ex["image"].shape == (8, 8, 1) and ex["image"].dtype == np.uint8
        expected = np.round(digits.images[i] * 255 / 16).astype(np.uint8)
        np.testing.assert_array_equal(ex["image"][..., 0], expected)


@pytest.mark.parametrize("method", ["bilinear", "nearest"])
def test_upsampling(digits, method):
    images = sd.to_uint8(digits.images[:5], 32, method)
    assert images.shape == (5, 32, 32, 1) and images.dtype == np.uint8
    small = np.round(digits.images[:5] * 255 / 16)
    if method == "nearest":
        np.testing.assert_array_equal(images[:, ::4, ::4, 0], small)
    else:  # smooth, but the 4x4 block means stay close to the original pixels
        means = images[..., 0].reshape(5, 8, 4, 8, 4).mean(axis=(2, 4))
        assert np.abs(means - small).mean() < 20


def test_named_configs_and_validation():
    assert {c.name: c.image_size for c in sd.CONFIGS} == {"size8": 8, "size16": 16, "size32": 32}
    with pytest.raises(ValueError, match="resize_method='cubic'"):
        sd.SklearnDigitsConfig(name="bad", image_size=16, resize_method="cubic")
    with pytest.raises(ValueError, match="image_size=4"):
        sd.SklearnDigitsConfig(name="bad", image_size=4)
