"""Tests for the stateless augmentations."""

import numpy as np
import pytest
import tensorflow as tf

from rope_lie.data import augment

KEY = tf.constant([3, 7], tf.int64)
OTHER_KEY = tf.constant([4, 7], tf.int64)


def _image(h=16, w=16, c=3, seed=0) -> tf.Tensor:
    return tf.constant(np.random.default_rng(seed).integers(0, 256, (h, w, c), dtype=np.uint8))


def test_random_flip_is_identity_or_mirror_and_keyed():
    image = _image()
    outs = [augment.random_flip(image, tf.constant([k, 0], tf.int64)).numpy() for k in range(16)]
    flipped = [not np.array_equal(o, image.numpy()) for o in outs]
    for o, f in zip(outs, flipped, strict=True):
        np.testing.assert_array_equal(o, image.numpy()[:, ::-1] if f else image.numpy())
    assert 0 < sum(flipped) < 16
    np.testing.assert_array_equal(augment.random_flip(image, KEY), augment.random_flip(image, KEY))


def test_pad_and_crop_is_a_shifted_window():
    image = _image(8, 8, 1)
    out = augment.pad_and_crop(image, KEY, padding=2).numpy()
    padded = np.pad(image.numpy(), [(2, 2), (2, 2), (0, 0)])
    windows = [padded[i : i + 8, j : j + 8] for i in range(5) for j in range(5)]
    assert any(np.array_equal(out, w) for w in windows)
    assert out.shape == (8, 8, 1) and out.dtype == np.uint8


def test_clip_crop_and_flip_are_shared_by_all_frames():
    frame = _image(20, 24, 3)
    clip = tf.stack([frame] * 3)
    crop = augment.inception_crop(clip, KEY, 8).numpy()
    assert crop.shape == (3, 8, 8, 3) and crop.dtype == np.uint8
    assert (crop == crop[:1]).all()
    flips = [augment.random_flip(clip, tf.constant([k, 1], tf.int64)).numpy() for k in range(4)]
    assert all((f == f[:1]).all() for f in flips)


def test_inception_crop_and_center_crop_shapes_and_determinism():
    image = _image(30, 40, 3)
    a = augment.inception_crop(image, KEY, 12)
    assert a.shape == (12, 12, 3) and a.dtype == tf.uint8
    np.testing.assert_array_equal(a, augment.inception_crop(image, KEY, 12))
    assert not np.array_equal(a, augment.inception_crop(image, OTHER_KEY, 12))
    centre = augment.resize_and_center_crop(image, 16, 0.875)
    assert centre.shape == (16, 16, 3)
    # A constant image stays constant whatever the resize.
    flat = augment.resize_and_center_crop(tf.fill([30, 40, 1], tf.constant(77, tf.uint8)), 16, 1.0)
    assert flat.shape == (16, 16, 1) and (flat.numpy() == 77).all()


@pytest.mark.parametrize("channels", [1, 3])
def test_randaugment_shape_dtype_determinism(channels):
    image = _image(16, 16, channels)
    out = augment.randaugment(image, KEY, num_layers=2, magnitude=9)
    assert out.shape == image.shape and out.dtype == tf.uint8
    np.testing.assert_array_equal(out, augment.randaugment(image, KEY, 2, 9))
    outs = {
        augment.randaugment(image, tf.constant([k, 5], tf.int64), 2, 9).numpy().tobytes()
        for k in range(8)
    }
    assert len(outs) > 1
    np.testing.assert_array_equal(augment.randaugment(image, KEY, 0, 9), image)


def test_every_randaugment_op_keeps_shape_and_range():
    # Low contrast, and >= 256 pixels so that equalize has work to do (as in PIL).
    image = tf.cast(_image(32, 32, 3) // 4 + 60, tf.float32)
    ops = augment._randaugment_ops(image, 0.9, tf.constant(1.0))
    assert len(ops) == augment.NUM_RANDAUGMENT_OPS
    changed = 0
    for op in ops:
        out = op().numpy()
        assert out.shape == (32, 32, 3)
        assert out.min() >= 0 and out.max() <= 255 and np.isfinite(out).all()
        changed += not np.allclose(out, image.numpy())
    assert changed == augment.NUM_RANDAUGMENT_OPS - 1  # all but identity change the image


def test_randaugment_rejects_clips():
    with pytest.raises(ValueError, match="randaugment expects"):
        augment.randaugment(tf.zeros([2, 8, 8, 3], tf.uint8), KEY, 2, 9)


def test_label_smoothing():
    soft = augment.smooth_labels(tf.constant([0, 2]), 4, 0.2).numpy()
    np.testing.assert_allclose(soft, [[0.85, 0.05, 0.05, 0.05], [0.05, 0.05, 0.85, 0.05]])
    with pytest.raises(ValueError, match="label_smoothing=1.0"):
        augment.smooth_labels(tf.constant([0]), 4, 1.0)


@pytest.mark.parametrize("mixup,cutmix", [(0.8, 0.0), (0.0, 1.0), (0.8, 1.0)])
def test_mix_batch_labels_sum_to_one_and_match_the_pixels(mixup, cutmix):
    batch, classes = 4, 5
    # Image i is constant i + 1 and has label i, so the pixel mass reveals the mixing weight.
    images = tf.constant(
        np.broadcast_to(
            np.arange(1, batch + 1, dtype=np.float32)[:, None, None, None], (batch, 8, 8, 1)
        ).copy()
    )
    labels = augment.smooth_labels(tf.range(batch), classes, 0.0)
    for k in range(6):
        key = tf.constant([k, 11], tf.int64)
        mixed, soft = augment.mix_batch(images, labels, key, mixup_alpha=mixup, cutmix_alpha=cutmix)
        soft = soft.numpy()
        np.testing.assert_allclose(soft.sum(1), 1.0, rtol=1e-6)
        lam = soft[0, 0]
        np.testing.assert_allclose(soft[0, batch - 1], 1 - lam, atol=1e-6)
        expected = lam * 1 + (1 - lam) * batch  # mean pixel of example 0
        np.testing.assert_allclose(mixed.numpy()[0].mean(), expected, rtol=1e-5)
        again = augment.mix_batch(images, labels, key, mixup_alpha=mixup, cutmix_alpha=cutmix)
        np.testing.assert_array_equal(again[0], mixed)


def test_cutmix_on_clips_pastes_the_same_box_in_every_frame():
    images = tf.concat([tf.zeros([1, 3, 8, 8, 1]), tf.ones([1, 3, 8, 8, 1])], axis=0)
    labels = augment.smooth_labels(tf.range(2), 2, 0.0)
    mixed, soft = augment.mix_batch(images, labels, KEY, mixup_alpha=0.0, cutmix_alpha=1.0)
    frames = mixed.numpy()[0]
    assert (frames == frames[:1]).all()
    np.testing.assert_allclose(frames.mean(), soft.numpy()[0, 1], atol=1e-6)


def test_mix_batch_needs_an_alpha():
    with pytest.raises(ValueError, match="mixup_alpha=0.0, cutmix_alpha=0.0"):
        augment.mix_batch(
            tf.zeros([2, 4, 4, 1]), tf.zeros([2, 2]), KEY, mixup_alpha=0.0, cutmix_alpha=0.0
        )
