"""NaFlex-style inputs: each image resized under a token budget, patchified and padded.

As SigLIP 2's NaFlex (big_vision) and timm's NaFlex ViT: an image of H x W pixels is resized,
keeping its aspect ratio as closely as whole patches allow, to the largest grid of
``gh x gw`` patches with ``gh * gw <= budget`` tokens, then cut into patches in token order
and padded to ``max_tokens`` slots. A batch then mixes grid sizes and aspect ratios, and the
model (``ViT.classify_tokens``) treats each example as if it were alone at its own grid.

In training every example gets its own budget from its stateless key: ``side**2`` tokens with
``side`` uniform in [min_side, max_side] (a square image is then side x side patches). In
evaluation the budget is fixed, so an evaluation "at a size" is one budget.

Native mode (``native``): nothing is resized; each image is read at its own size, one token per
patch, and padded. It is for datasets whose images already differ in size, stored on a common
canvas with an ``extent`` feature (the content's height and width in pixels, multiples of the
patch), such as ``spatial_arrows/c8_g6to10``: scenes of 6 to 10 cells a side, whose glyphs a
resize would blur into other patches. In either mode an ``extent`` crops the image first.

The batches are dicts of numpy arrays (B per process):
  patches     float32 (B, max_tokens, prod(patch) * C), the patches in ``tokens.patchify``'s layout
  index       int32 (B, max_tokens, 2): each token's (row, col) in its image's patch grid
  grid        int32 (B, 2): each image's patch grid (gh, gw)
  token_mask  float32 (B, max_tokens): 1 for a real token, 0 for padding
  label, soft_label, mask: as ``pipeline``'s batches.
Positions follow from ``index`` and ``grid`` under the model's convention
(``positions.index_positions``), computed by the model.

``config.naflex`` fields (``config_lib.naflex_config``):
  min_side, max_side  training budget side**2, side uniform in [min_side, max_side]
  max_tokens          padded length of every training batch (>= max_side**2)
  native              no resizing: each image at its own ``extent`` (optional; default False)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import tensorflow as tf

TOKEN_KEYS = ("patches", "index", "grid", "token_mask")


def budget_grid(height: tf.Tensor, width: tf.Tensor, patch: int, budget: tf.Tensor) -> tf.Tensor:
    """The patch grid (gh, gw) of an image resized under a token budget, int32 (2,).

    The largest scale s with floor(H s / p) * floor(W s / p) <= budget, s = sqrt(budget p^2 /
    (H W)); each side at least 1 patch (a side clamped to 1 leaves the other at most budget).
    """
    h, w = tf.cast(height, tf.float64), tf.cast(width, tf.float64)
    b = tf.cast(budget, tf.float64)
    scale = tf.sqrt(b * patch * patch / (h * w))
    # The small epsilon keeps exact products (a 64 x 64 image at budget 64: 8 x 8) from
    # rounding down.
    gh = tf.maximum(tf.floor(h * scale / patch + 1e-9), 1.0)
    gw = tf.maximum(tf.floor(w * scale / patch + 1e-9), 1.0)
    gh = tf.minimum(gh, tf.maximum(tf.floor(b / gw), 1.0))
    gw = tf.minimum(gw, tf.maximum(tf.floor(b / gh), 1.0))
    return tf.cast(tf.stack([gh, gw]), tf.int32)


def tokens_of(
    image: tf.Tensor, patch: int, grid: tf.Tensor, max_tokens: int, *, resize: bool = True
) -> dict:
    """A float image (H, W, C) resized to ``grid * patch`` pixels (unless ``resize`` is False:
    then it must be that size), patchified and padded.

    Returns:
      {"patches", "index", "grid", "token_mask"} of one example (module docstring).
    """
    channels = image.shape[-1]
    gh, gw = grid[0], grid[1]
    if resize:
        image = tf.image.resize(image, [gh * patch, gw * patch], antialias=True)
    x = tf.reshape(image, [gh, patch, gw, patch, channels])
    x = tf.transpose(x, [0, 2, 1, 3, 4])  # (gh, gw, p, p, C): tokens.patchify's order
    count = gh * gw
    patches = tf.reshape(x, [count, patch * patch * channels])
    rows, cols = tf.meshgrid(tf.range(gh), tf.range(gw), indexing="ij")
    index = tf.stack([tf.reshape(rows, [-1]), tf.reshape(cols, [-1])], axis=-1)
    pad = max_tokens - count
    # The pads wait for the check, so that too many tokens fail with its message, not with
    # tf.pad's "Paddings must be non-negative" (which one ran first varied from run to run).
    check = tf.debugging.assert_non_negative(pad, message="more tokens than max_tokens")
    with tf.control_dependencies([check]):
        pad = tf.identity(pad)
    return {
        "patches": tf.ensure_shape(
            tf.pad(patches, [[0, pad], [0, 0]]), [max_tokens, patch * patch * channels]
        ),
        "index": tf.ensure_shape(tf.pad(index, [[0, pad], [0, 0]]), [max_tokens, 2]),
        "grid": tf.ensure_shape(grid, [2]),
        "token_mask": tf.ensure_shape(
            tf.pad(tf.ones([count], tf.float32), [[0, pad]]), [max_tokens]
        ),
    }


def random_budget(key: tf.Tensor, min_side: int, max_side: int) -> tf.Tensor:
    """side**2 with side uniform in [min_side, max_side] from a stateless key, int32."""
    side = tf.random.stateless_uniform([], key, min_side, max_side + 1, dtype=tf.int32)
    return side * side


def native_grid(extent: tf.Tensor, patch: int) -> tf.Tensor:
    """The patch grid (gh, gw) of an image read at its own ``extent`` (pixels), int32 (2,)."""
    extent = tf.cast(extent, tf.int32)
    tf.debugging.assert_equal(
        extent % patch, 0, message=f"an image's extent is not a multiple of the patch ({patch})"
    )
    return extent // patch


def crop_to_extent(example: dict, image: tf.Tensor) -> tf.Tensor:
    """``image`` cut to the example's ``extent`` (popped), or whole without one."""
    if "extent" not in example:
        return image
    extent = tf.cast(example.pop("extent"), tf.int32)
    return image[: extent[0], : extent[1]]


def check_config(naflex, patch: Sequence[int], image_rank: int) -> None:
    """Errors that name the bad field: square 2D patches, 1 <= min_side <= max_side, room."""
    if image_rank != 2 or len(set(patch)) != 1:
        raise ValueError(
            f"naflex needs 2D images with square patches; got patch={tuple(patch)} for "
            f"{image_rank}D inputs"
        )
    if not 1 <= naflex.min_side <= naflex.max_side:
        raise ValueError(
            f"naflex: min_side={naflex.min_side}, max_side={naflex.max_side}; expected "
            "1 <= min_side <= max_side"
        )
    if naflex.max_tokens < naflex.max_side**2:
        raise ValueError(
            f"naflex: max_tokens={naflex.max_tokens} < max_side**2 = {naflex.max_side**2}"
        )


def example_fn(
    patch: int,
    max_tokens: int,
    *,
    min_side: int = 0,
    max_side: int = 0,
    budget: int = 0,
    native: bool = False,
):
    """(example dict with a normalised "image", key) -> the example with tokens, no "image".

    A fixed ``budget`` (evaluation), a random one per example (training: ``min_side`` and
    ``max_side``) from the key, or ``native``: each image at its own ``extent``, unresized.
    """
    if budget and budget > max_tokens:
        raise ValueError(f"budget={budget} > max_tokens={max_tokens}")

    def fn(example: dict, key: tf.Tensor | None) -> dict:
        example = dict(example)
        image = crop_to_extent(example, example.pop("image"))
        shape = tf.shape(image)
        if native:
            grid = native_grid(shape[:2], patch)
        else:
            own = (
                tf.constant(budget, tf.int32) if budget else random_budget(key, min_side, max_side)
            )
            grid = budget_grid(shape[0], shape[1], patch, own)
        return {**example, **tokens_of(image, patch, grid, max_tokens, resize=not native)}

    return fn


def side_budget(side: int) -> int:
    """Tokens of a side x side budget (the evaluation entries' ``naflex_side``)."""
    return int(side) ** 2


def padding_fraction(token_mask) -> float:
    """Fraction of padded slots in a batch's token mask."""
    total = math.prod(token_mask.shape)
    return float(1.0 - token_mask.sum() / total)
