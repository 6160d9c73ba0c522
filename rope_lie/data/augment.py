"""Stateless-seeded augmentations for tf.data: crops, flips, RandAugment, mixup/cutmix.

Every random function takes ``key``, an int32/int64 tensor of shape (2,) for
``tf.random.stateless_*``; the same key gives the same output, which is what
makes the training stream resumable. Images are uint8 (H, W, C); clips and
volumes (T, H, W, C) get one crop/flip shared by all frames.

RandAugment (Cubuk et al., arXiv:1909.13719) is written here over tf.image
ops because the maintained implementations are not usable: tf-models-official
pins an older TensorFlow (pip would downgrade tensorflow-cpu 2.21 to 2.20 and
add ~40 packages) and, like keras_cv and keras' RandAugment layer, draws from
stateful RNGs. The op list is torchvision's (identity, shear x/y, translate
x/y, rotate, brightness, color, contrast, sharpness, posterize, solarize,
autocontrast, equalize), with tf-models/timm magnitudes: level = magnitude / 10
(10 is the strongest setting of those libraries; larger values extrapolate),
max rotation 30 degrees, shear 0.3, translation 45% of the side, enhance
factors 1 +- 0.9 level, posterize to 8 - 4 level bits, solarize threshold
256 (1 - level), geometric fill 128. Signed ops get a random sign.
"""

import math

import tensorflow as tf

FILL_VALUE = 128.0  # geometric RandAugment ops fill uncovered pixels with mid-grey


def split_key(key: tf.Tensor, num: int) -> tf.Tensor:
    """Splits a stateless key into ``num`` independent keys, shape (num, 2)."""
    return tf.random.experimental.stateless_split(key, num)


def _coin(key: tf.Tensor, prob: float = 0.5) -> tf.Tensor:
    return tf.random.stateless_uniform([], seed=key) < prob


def random_flip(image: tf.Tensor, key: tf.Tensor) -> tf.Tensor:
    """Flips left-right (the width axis, -2) with probability 1/2; clips share one flip."""
    return tf.cond(_coin(key), lambda: tf.reverse(image, axis=[-2]), lambda: image)


def pad_and_crop(image: tf.Tensor, key: tf.Tensor, padding: int) -> tf.Tensor:
    """Zero-pads height and width by ``padding`` and crops a random window of the input size."""
    pads = [[0, 0]] * (image.shape.rank - 3) + [[padding, padding]] * 2 + [[0, 0]]
    return tf.image.stateless_random_crop(tf.pad(image, pads), tf.shape(image), seed=key)


def to_uint8(image: tf.Tensor) -> tf.Tensor:
    """Rounds and saturates a float image in [0, 255] to uint8."""
    return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def resize(image: tf.Tensor, size: int) -> tf.Tensor:
    """Bilinear (antialiased) resize of height and width to size x size, uint8 out."""
    if image.shape[-3] == size and image.shape[-2] == size:
        return image
    return to_uint8(tf.image.resize(image, [size, size], antialias=True))


def inception_crop(
    image: tf.Tensor,
    key: tf.Tensor,
    size: int,
    area_range: tuple[float, float] = (0.08, 1.0),
    aspect_range: tuple[float, float] = (3 / 4, 4 / 3),
) -> tf.Tensor:
    """Random-resized crop (Szegedy et al.): a random box of the given area/aspect, resized.

    Args:
      image: uint8 (H, W, C) or (T, H, W, C); a clip gets one box for all frames.
      key: stateless key.
      size: output side.
      area_range: box area as a fraction of the image.
      aspect_range: box width / height.

    Returns:
      uint8 (size, size, C) or (T, size, size, C).
    """
    begin, box, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image)[-3:],
        bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=key,
        min_object_covered=0.0,
        aspect_ratio_range=aspect_range,
        area_range=area_range,
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    lead = image.shape.rank - 3
    crop = tf.slice(image, [0] * lead + tf.unstack(begin), [-1] * lead + tf.unstack(box))
    return resize(crop, size)


def resize_and_center_crop(image: tf.Tensor, size: int, crop_fraction: float) -> tf.Tensor:
    """Resizes the shorter side to size / crop_fraction, then takes the central size x size.

    Args:
      image: uint8 (H, W, C) or (T, H, W, C).
      size: output side.
      crop_fraction: 1.0 resizes the whole image to size x size (aspect not kept);
        below 1 (e.g. 0.875 for ImageNet) keeps the aspect ratio and centre-crops.

    Returns:
      uint8 (size, size, C) or (T, size, size, C).
    """
    if crop_fraction >= 1.0:
        return resize(image, size)
    hw = tf.cast(tf.shape(image)[-3:-1], tf.float32)
    scale = (size / crop_fraction) / tf.reduce_min(hw)
    new_hw = tf.maximum(tf.cast(tf.math.ceil(hw * scale), tf.int32), size)
    resized = to_uint8(tf.image.resize(image, new_hw, antialias=True))
    offset = (new_hw - size) // 2
    lead = image.shape.rank - 3
    return tf.slice(resized, [0] * lead + tf.unstack(offset) + [0], [-1] * lead + [size, size, -1])


def _blend(base: tf.Tensor, image: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    """PIL ImageEnhance: base + factor (image - base), clipped to [0, 255]."""
    return tf.clip_by_value(base + factor * (image - base), 0.0, 255.0)


def _gray(image: tf.Tensor) -> tf.Tensor:
    if image.shape[-1] == 1:
        return image
    return tf.image.rgb_to_grayscale(image)


def _transform(image: tf.Tensor, matrix: list) -> tf.Tensor:
    """Projective warp; ``matrix`` maps output (x, y) to input, 8 entries (tf.image convention)."""
    out = tf.raw_ops.ImageProjectiveTransformV3(
        images=image[None],
        transforms=tf.cast(tf.stack(matrix)[None], tf.float32),
        output_shape=tf.shape(image)[:2],
        fill_value=FILL_VALUE,
        interpolation="NEAREST",
        fill_mode="CONSTANT",
    )
    return out[0]


def _rotate(image: tf.Tensor, degrees: tf.Tensor) -> tf.Tensor:
    theta = degrees * math.pi / 180.0
    cy, cx = [(tf.cast(s, tf.float32) - 1.0) / 2.0 for s in tf.unstack(tf.shape(image)[:2])]
    cos, sin = tf.cos(theta), tf.sin(theta)
    zero = tf.zeros([])
    matrix = [cos, -sin, cx - cos * cx + sin * cy, sin, cos, cy - sin * cx - cos * cy, zero, zero]
    return _transform(image, matrix)


def _sharpness(image: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    """PIL SHARPEN: blend with a 3x3 smoothed copy; border pixels keep their value."""
    kernel = tf.constant([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]]) / 13.0
    channels = image.shape[-1]
    kernel = tf.tile(kernel[:, :, None, None], [1, 1, channels, 1])
    smooth = tf.nn.depthwise_conv2d(image[None], kernel, [1, 1, 1, 1], "VALID")[0]
    smooth = tf.pad(smooth, [[1, 1], [1, 1], [0, 0]])
    interior = tf.pad(tf.ones_like(smooth[1:-1, 1:-1]), [[1, 1], [1, 1], [0, 0]])
    smooth = interior * smooth + (1.0 - interior) * image
    return _blend(smooth, image, factor)


def _equalize(image: tf.Tensor) -> tf.Tensor:
    """Per-channel histogram equalisation (PIL ImageOps.equalize)."""

    def channel(values: tf.Tensor) -> tf.Tensor:
        values = tf.cast(values, tf.int32)
        hist = tf.histogram_fixed_width(values, [0, 255], nbins=256)
        last = tf.gather(hist, tf.reduce_max(tf.where(hist > 0)))
        step = (tf.reduce_sum(hist) - last) // 255
        safe = tf.maximum(step, 1)
        lut = tf.clip_by_value((tf.cumsum(hist) + safe // 2) // safe, 0, 255)
        lut = tf.concat([[0], lut[:-1]], 0)
        return tf.cast(tf.where(step > 0, tf.gather(lut, values), values), tf.float32)

    return tf.stack([channel(c) for c in tf.unstack(image, axis=-1)], axis=-1)


def _autocontrast(image: tf.Tensor) -> tf.Tensor:
    low = tf.reduce_min(image, axis=[0, 1], keepdims=True)
    high = tf.reduce_max(image, axis=[0, 1], keepdims=True)
    scale = 255.0 / tf.maximum(high - low, 1.0)
    return tf.where(high > low, (image - low) * scale, image)


def _randaugment_ops(image: tf.Tensor, level: float, sign: tf.Tensor) -> list:
    """The 14 ops as thunks on a float32 image in [0, 255]."""
    h, w = [tf.cast(s, tf.float32) for s in tf.unstack(tf.shape(image)[:2])]
    one, zero, shear = tf.ones([]), tf.zeros([]), sign * 0.3 * level
    enhance = 1.0 + sign * 0.9 * level
    bits = 8 - int(4 * min(level, 2.0))
    threshold = 256.0 * (1.0 - level)
    return [
        lambda: image,
        lambda: _transform(image, [one, shear, zero, zero, one, zero, zero, zero]),
        lambda: _transform(image, [one, zero, zero, shear, one, zero, zero, zero]),
        lambda: _transform(
            image, [one, zero, sign * 0.45 * level * w, zero, one, zero, zero, zero]
        ),
        lambda: _transform(
            image, [one, zero, zero, zero, one, sign * 0.45 * level * h, zero, zero]
        ),
        lambda: _rotate(image, sign * 30.0 * level),
        lambda: _blend(tf.zeros_like(image), image, enhance),
        lambda: _blend(_gray(image), image, enhance),
        lambda: _blend(tf.reduce_mean(_gray(image)), image, enhance),
        lambda: _sharpness(image, enhance),
        lambda: tf.cast(
            tf.bitwise.left_shift(
                tf.bitwise.right_shift(tf.cast(image, tf.int32), 8 - max(bits, 0)), 8 - max(bits, 0)
            ),
            tf.float32,
        ),
        lambda: tf.where(image >= threshold, 255.0 - image, image),
        lambda: _autocontrast(image),
        lambda: _equalize(image),
    ]


NUM_RANDAUGMENT_OPS = 14


def randaugment(image: tf.Tensor, key: tf.Tensor, num_layers: int, magnitude: float) -> tf.Tensor:
    """RandAugment: ``num_layers`` ops drawn uniformly (with repetition), all at one magnitude.

    Args:
      image: uint8 (H, W, C), C = 1 or 3.
      key: stateless key.
      num_layers: ops applied in sequence (N in the paper); 0 returns the image.
      magnitude: shared strength (M), on the 0..10 scale of tf-models/timm.

    Returns:
      uint8 (H, W, C).
    """
    if image.shape.rank != 3 or image.shape[-1] not in (1, 3):
        raise ValueError(f"randaugment expects an (H, W, 1|3) image, got shape {image.shape}")
    if magnitude < 0:
        raise ValueError(f"randaugment magnitude={magnitude} must be >= 0")
    if num_layers == 0:
        return image
    x = tf.cast(image, tf.float32)
    for layer_key in tf.unstack(split_key(key, num_layers)):
        op_key, sign_key = tf.unstack(split_key(layer_key, 2))
        op = tf.random.stateless_uniform([], op_key, 0, NUM_RANDAUGMENT_OPS, dtype=tf.int32)
        sign = tf.where(_coin(sign_key), -1.0, 1.0)
        x = tf.switch_case(op, _randaugment_ops(x, magnitude / 10.0, sign))
        x = tf.ensure_shape(x, image.shape)
    return to_uint8(x)


def smooth_labels(labels: tf.Tensor, num_classes: int, smoothing: float) -> tf.Tensor:
    """One-hot targets with label smoothing: (1 - s) one_hot + s / V for V classes.

    (B,) -> (B, V) float32.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"label_smoothing={smoothing} must lie in [0, 1)")
    one_hot = tf.one_hot(labels, num_classes, dtype=tf.float32)
    return one_hot * (1.0 - smoothing) + smoothing / num_classes


def _beta(key: tf.Tensor, alpha: tf.Tensor) -> tf.Tensor:
    g = tf.random.stateless_gamma([2], seed=key, alpha=alpha)
    return g[0] / (g[0] + g[1])


def _cutmix_mask(key: tf.Tensor, lam: tf.Tensor, height: tf.Tensor, width: tf.Tensor):
    """Box covering about (1 - lam) of the image, centre uniform, clipped to the image.

    Returns:
      (mask (H, W, 1) float32 with 1 inside the box, fraction of the image outside the box).
    """
    cut = tf.sqrt(1.0 - lam)
    hw = tf.cast(tf.stack([height, width]), tf.float32)
    centre = tf.random.stateless_uniform([2], key) * hw
    low = tf.cast(tf.round(tf.clip_by_value(centre - cut * hw / 2, 0.0, hw)), tf.int32)
    high = tf.cast(tf.round(tf.clip_by_value(centre + cut * hw / 2, 0.0, hw)), tf.int32)
    rows = tf.logical_and(tf.range(height) >= low[0], tf.range(height) < high[0])
    cols = tf.logical_and(tf.range(width) >= low[1], tf.range(width) < high[1])
    mask = tf.cast(tf.logical_and(rows[:, None], cols[None, :]), tf.float32)[..., None]
    return mask, 1.0 - tf.reduce_mean(mask)


def mix_batch(
    images: tf.Tensor,
    soft_labels_BV: tf.Tensor,
    key: tf.Tensor,
    *,
    mixup_alpha: float,
    cutmix_alpha: float,
    switch_prob: float = 0.5,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Mixup (Zhang et al.) or CutMix (Yun et al.) of a batch with its reverse.

    One lam ~ Beta(alpha, alpha) per batch; example i is mixed with example
    B-1-i. When both alphas are positive, CutMix is chosen with probability
    ``switch_prob`` (timm's convention); CutMix pastes a box over height and
    width (all frames of a clip) and sets lam to the uncovered fraction.

    Args:
      images: float32 (B, H, W, C) or (B, T, H, W, C).
      soft_labels_BV: float32 (B, V), rows summing to 1.
      key: stateless key.
      mixup_alpha: 0 disables mixup.
      cutmix_alpha: 0 disables cutmix.
      switch_prob: probability of CutMix when both are enabled.

    Returns:
      (mixed images, mixed soft labels (B, V)); label rows still sum to 1.
    """
    if mixup_alpha < 0 or cutmix_alpha < 0 or (mixup_alpha == 0 and cutmix_alpha == 0):
        raise ValueError(
            f"mixup_alpha={mixup_alpha}, cutmix_alpha={cutmix_alpha}: need both >= 0, one > 0"
        )
    choice_key, lam_key, box_key = tf.unstack(split_key(key, 3))
    if mixup_alpha > 0 and cutmix_alpha > 0:
        use_cutmix = _coin(choice_key, switch_prob)
    else:
        use_cutmix = tf.constant(cutmix_alpha > 0)
    alpha = tf.where(use_cutmix, float(cutmix_alpha), float(mixup_alpha))
    lam = _beta(lam_key, alpha)
    partner = tf.reverse(images, axis=[0])

    def cutmix():
        shape = tf.shape(images)
        mask, kept = _cutmix_mask(box_key, lam, shape[-3], shape[-2])
        return images * (1.0 - mask) + partner * mask, kept

    mixed, lam = tf.cond(use_cutmix, cutmix, lambda: (lam * images + (1 - lam) * partner, lam))
    labels = lam * soft_labels_BV + (1.0 - lam) * tf.reverse(soft_labels_BV, axis=[0])
    return mixed, labels
