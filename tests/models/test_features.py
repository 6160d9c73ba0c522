"""Tests for ``ViT.features``: patch and prefix tokens of chosen layers, for images and token
batches, equal to the activations of a block loop written out here (the converted-timm check,
against ``forward_intermediates``, is in tests/test_interop.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie.models import tokens
from rope_lie.models.vit import ViT

DIMS = dict(width=16, depth=3, num_heads=2, mlp_dim=32)
IMAGE = (8, 12)  # a 4 x 6 grid of 2 x 2 patches


def _model(**overrides):
    config = dict(
        variant=None,
        dims=DIMS,
        patch_size=2,
        image_shape=IMAGE,
        channels=3,
        num_classes=5,
        pe="rope_mixed",
        num_registers=2,
        head_zero_init=False,
    )
    return ViT(**{**config, **overrides}, rngs=nnx.Rngs(0))


def _images(batch=2, shape=IMAGE, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(batch, *shape, 3)), jnp.float32)


def _reference_outputs(model, images):
    """Every block's output (prefix tokens first), by a loop over the blocks written here."""
    grid = model.input_grid(images)
    x_BTD = model.embed_tokens(images, grid)
    outputs = []
    for block, state in zip(model.blocks, model.precompute_pe(grid), strict=True):
        x_BTD = block(x_BTD, state, train=False)
        outputs.append(x_BTD)
    return outputs


def test_every_layer_equals_the_block_loop_normed_or_not():
    model = _model()
    images = _images()
    reference = _reference_outputs(model, images)
    prefix = model.num_prefix
    assert prefix == 3  # the class token and two registers
    for norm in (False, True):
        feats = model.features(images, layers=3, norm=norm)
        assert len(feats.patch) == len(feats.prefix) == 3
        for layer, y_BTD in enumerate(reference):
            expected = model.norm(y_BTD) if norm else y_BTD
            np.testing.assert_allclose(
                feats.patch[layer], expected[:, prefix:], rtol=1e-6, atol=1e-6
            )
            np.testing.assert_allclose(
                feats.prefix[layer], expected[:, :prefix], rtol=1e-6, atol=1e-6
            )
    # Layers differ from one another, and the norm changes them: the checks see the choice.
    assert not np.allclose(reference[0], reference[2], atol=1e-3)
    normed, plain = model.features(images, norm=True), model.features(images)
    assert not np.allclose(normed.patch[0], plain.patch[0], atol=1e-3)


def test_the_last_layer_is_what_the_head_classifies():
    """``__call__``'s logits are the head on the last layer's output (one forward pass)."""
    model = _model(pool="mean_with_cls")
    images = _images()
    feats = model.features(images)
    last = jnp.concatenate([feats.prefix[0], feats.patch[0]], axis=1)
    np.testing.assert_allclose(model.classify_features(last), model(images), rtol=1e-6, atol=1e-6)


def test_layer_selection_as_dinov3_and_timm():
    model = _model()
    images = _images()
    reference = _reference_outputs(model, images)
    cases = {2: [1, 2], 1: [2], (0,): [0], (-1, 0): [2, 0], (2, -2): [2, 1]}
    for layers, expected in cases.items():
        feats = model.features(images, layers=layers)
        assert len(feats.patch) == len(expected)
        for got, layer in zip(feats.patch, expected, strict=True):
            np.testing.assert_allclose(got, reference[layer][:, 3:], rtol=1e-6, atol=1e-6)


def test_reshape_gives_the_grid_channels_last():
    model = _model()
    images = _images(shape=(6, 10))  # another resolution: a 3 x 5 grid
    flat = model.features(images, layers=(0, 2))
    grid = model.features(images, layers=(0, 2), reshape=True)
    for f, g in zip(flat.patch, grid.patch, strict=True):
        assert g.shape == (2, 3, 5, 16)
        np.testing.assert_array_equal(g.reshape(2, 15, 16), f)
        np.testing.assert_array_equal(g[:, 1, 2], f[:, 1 * 5 + 2])  # row-major


def test_token_batches_give_each_images_features_alone():
    """A padded mixed-size batch: each example's real tokens' features are its image's alone."""
    model = _model(additive="ape")
    grids = ((4, 6), (3, 2))
    rng = np.random.default_rng(1)
    images = [rng.normal(size=(2 * g[0], 2 * g[1], 3)).astype(np.float32) for g in grids]
    batch = tokens.Tokens(*map(jnp.asarray, tokens.pack(images, (2, 2), 24)))
    graphdef, state = nnx.split(model)

    @jax.jit  # the batch and each image alone in one program, not eagerly op by op
    def features(s, batch, images):
        m = nnx.merge(graphdef, s)
        each = [m.features(im[None], layers=(0, 2), norm=True) for im in images]
        return m.features(batch, layers=(0, 2), norm=True), each

    feats, each_alone = features(state, batch, [jnp.asarray(im) for im in images])
    for b, alone in enumerate(each_alone):
        count = int(np.prod(grids[b]))
        for layer in range(2):
            np.testing.assert_allclose(
                feats.patch[layer][b, :count], alone.patch[layer][0], rtol=1e-5, atol=1e-5
            )
            np.testing.assert_allclose(
                feats.prefix[layer][b], alone.prefix[layer][0], rtol=1e-5, atol=1e-5
            )


def test_features_jit_and_gradients():
    model = _model()
    graphdef, state = nnx.split(model)
    images = _images()

    def loss(s):
        feats = nnx.merge(graphdef, s).features(images, layers=(1,), norm=True)
        return jnp.mean(feats.patch[0] ** 2)

    value, grads = jax.jit(jax.value_and_grad(loss))(state)
    assert np.isfinite(value)
    # Only the blocks up to layer 1 and the norm are used: the last block gets no gradient.
    last = jax.tree.leaves(nnx.state(grads, nnx.Param)["blocks"][2])
    assert all(float(jnp.abs(g).max()) == 0.0 for g in last)
    first = jax.tree.leaves(grads["blocks"][0])
    assert any(float(jnp.abs(g).max()) > 0.0 for g in first)


def test_errors_name_the_value():
    model = _model()
    images = _images()
    for layers, match in (
        (0, r"layers=0 \(the last n\) must be in \[1, 3\]"),
        (4, r"layers=4"),
        ((3,), r"index 3 is outside \[-3, 2\]"),
        ((), "non-empty sequence"),
        ("1", "non-empty sequence"),
        ((1.0,), "1.0 is not a layer index"),
    ):
        with pytest.raises(ValueError, match=match):
            model.features(images, layers=layers)
    with pytest.raises(ValueError, match="final_norm=False"):
        _model(final_norm=False, fc_norm=True, pool="mean").features(images, norm=True)
    batch = model.image_tokens(images)
    with pytest.raises(ValueError, match="reshape=True"):
        model.features(batch, reshape=True)
