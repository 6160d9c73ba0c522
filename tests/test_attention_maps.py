"""experiments/studies/attention_maps.py: the class token's map over the grid, with registers."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.studies import attention_maps
from rope_lie.models import ViT

# 8x12 pixels in 4x4 patches: a 2x3 grid after [class token, registers].
TINY = dict(variant="pico/4", image_shape=(8, 12), channels=3, num_classes=5, head_zero_init=False)


def _image(seed=0):
    return np.random.default_rng(seed).normal(size=(8, 12, 3)).astype(np.float32)


def test_the_class_token_map_reads_the_grid_columns_after_the_registers():
    """Row 0 of the last layer at the columns after [class token, 3 registers], shaped as the
    2x3 grid; the registers take part of the class token's attention, which the map leaves
    out."""
    model = ViT(**TINY, pe="rope_mixed", num_registers=3, rngs=nnx.Rngs(0))
    image = _image()
    amap = attention_maps.class_token_map(model, image)
    assert amap.shape == (2, 3)
    maps = np.asarray(model.attention_maps(jnp.asarray(image[None])))
    assert maps.shape[-1] == 1 + 3 + 6
    row = maps[-1, 0, :, 0, :].mean(axis=0)  # the class token's row, mean over heads
    np.testing.assert_allclose(amap, row[4:].reshape(2, 3), rtol=1e-6)
    registers = row[1:4].sum()
    assert registers > 1e-3
    np.testing.assert_allclose(row[0] + registers + amap.sum(), 1.0, rtol=1e-5)


def test_the_map_follows_the_patches_it_was_read_from():
    """Without position encodings the model is equivariant to the order of the patches: swapping
    two patches of the image swaps their two cells of the map and leaves the others, which
    holds only if the map's cells are the grid's tokens (not the registers')."""
    model = ViT(**TINY, pe="nope", num_registers=2, rngs=nnx.Rngs(0))
    image = _image()
    swapped = image.copy()
    swapped[0:4, 0:4], swapped[4:8, 8:12] = image[4:8, 8:12], image[0:4, 0:4]  # cells (0,0), (1,2)
    amap = attention_maps.class_token_map(model, image)
    expected = amap.copy()
    expected[0, 0], expected[1, 2] = amap[1, 2], amap[0, 0]
    assert abs(amap[0, 0] - amap[1, 2]) > 1e-4  # the swap is visible
    np.testing.assert_allclose(attention_maps.class_token_map(model, swapped), expected, rtol=1e-5)


def test_a_model_without_a_class_token_has_no_class_token_map():
    model = ViT(**TINY, pe="rope_mixed", pool="mean", num_registers=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no class token"):
        attention_maps.class_token_map(model, _image())


def test_a_mean_pooled_model_beside_a_class_token_has_its_map():
    """pool="mean_with_cls" (timm's "avg" with a class token) keeps a class token, unpooled."""
    model = ViT(**TINY, pe="rope_mixed", pool="mean_with_cls", rngs=nnx.Rngs(0))
    image = _image()
    row = np.asarray(model.attention_maps(jnp.asarray(image[None])))[-1, 0, :, 0, 1:].mean(0)
    np.testing.assert_allclose(
        attention_maps.class_token_map(model, image), row.reshape(2, 3), rtol=1e-6
    )
