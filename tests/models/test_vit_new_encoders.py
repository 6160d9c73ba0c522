"""The ViT with ComRoPE, p-RoPE and the video layouts: options reach every layer, and a
ComRoPE model's logits do not depend on where the fold's eigenbases are applied."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie import train
from rope_lie.encodings import positions
from rope_lie.models import tokens
from rope_lie.models.vit import ViT

TINY = dict(variant="pico/4", image_shape=(8, 12), channels=3, num_classes=5, head_zero_init=False)
TINY_3D = dict(
    variant="pico",
    patch_size=(2, 4, 4),
    image_shape=(4, 8, 8),
    channels=2,
    num_classes=3,
    head_zero_init=False,
)


def _images(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


# (pe, hparams, other): `other` differs from `hparams` in the option under test only.
CASES_3D = [
    (
        "rope_axial",
        dict(layout="videorope", base=1e4, temporal_scale=2.0),
        dict(layout="videorope", base=1e4),
    ),
    (
        "rope_axial",
        dict(layout="mrope", sections=[2, 3, 3]),  # a list, as configs give
        dict(layout="mrope", sections=[4, 2, 2]),
    ),
    (
        "rope_axial",
        dict(layout="mrope_interleaved", rotary_fraction=0.75),
        dict(layout="mrope_interleaved"),
    ),
    ("comrope", dict(variant="ld", block_size=4), dict(variant="ld", block_size=2)),
]


@pytest.mark.parametrize("pe,hparams,other", CASES_3D)
def test_3d_options_reach_the_attention(pe, hparams, other):
    images = _images((2, 4, 8, 8, 2))
    model = ViT(**TINY_3D, pe=pe, pe_hparams=hparams, rngs=nnx.Rngs(0))
    logits = model(images)
    chex.assert_shape(logits, (2, 3))
    chex.assert_tree_all_finite(logits)
    # The option changes the numbers: the same weights without it give other logits.
    other_logits = ViT(**TINY_3D, pe=pe, pe_hparams=other, rngs=nnx.Rngs(0))(images)
    assert float(jnp.max(jnp.abs(other_logits - logits))) > 1e-4


@pytest.mark.parametrize("pe", ["rope_axial", "rope_mixed", "visionllama"])
def test_rotary_fraction_reaches_the_attention(pe):
    images = _images((2, 8, 12, 3))
    full = ViT(**TINY, pe=pe, rngs=nnx.Rngs(0))(images)
    same = ViT(**TINY, pe=pe, pe_hparams=dict(rotary_fraction=1.0), rngs=nnx.Rngs(0))(images)
    half = ViT(**TINY, pe=pe, pe_hparams=dict(rotary_fraction=0.5), rngs=nnx.Rngs(0))(images)
    np.testing.assert_allclose(same, full, rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(half - full))) > 1e-4


@pytest.mark.parametrize("share_heads", [False, True])
def test_comrope_model_is_translation_invariant_in_its_positions(share_heads):
    # Shifting every position (class token included) leaves the logits unchanged: the
    # eigenbasis fold and the pair angles together are a relative encoding.
    model = ViT(
        **TINY,
        pe="comrope",
        pe_hparams=dict(block_size=4),
        share_pe_heads=share_heads,
        position_convention="unit_centred",
        rngs=nnx.Rngs(0),
    )
    images = _images((2, 8, 12, 3))
    grid = model.input_grid(images)
    pos_TA = model.positions(grid)
    base = model(images, pe_cache=model.pe_states(pos_TA))
    moved = model(images, pe_cache=model.pe_states(pos_TA + jnp.asarray([[0.5, -0.25]])))
    np.testing.assert_allclose(moved, base, rtol=1e-4, atol=1e-4)
    assert (
        float(jnp.max(jnp.abs(model(images, pe_cache=model.pe_states(2 * pos_TA)) - base))) > 1e-4
    )


AUGMENT = dict(shift=0.5, jitter=1.5, rescale=2.0)


def test_position_augment_changes_training_positions_only():
    images = _images((2, 8, 12, 3))
    config = dict(TINY, pe="dinov3", position_convention="centred")
    plain = ViT(**config, rngs=nnx.Rngs(0))
    model = ViT(**config, position_augment=AUGMENT, rngs=nnx.Rngs(0))
    # The same parameters as without augmentation (the stream is made after them) ...
    chex.assert_trees_all_equal(nnx.state(plain, nnx.Param), nnx.state(model, nnx.Param))
    # ... the same evaluation, and other training positions at every call.
    np.testing.assert_allclose(model(images), plain(images), rtol=1e-6, atol=1e-6)
    first, second = model(images, train=True), model(images, train=True)
    assert float(jnp.max(jnp.abs(first - plain(images)))) > 1e-4
    assert float(jnp.max(jnp.abs(first - second))) > 1e-4


def test_position_augment_is_reseeded_by_the_train_step_key():
    images = _images((2, 8, 12, 3))
    model = ViT(
        **TINY,
        pe="dinov3",
        position_convention="centred",
        position_augment=AUGMENT,
        rngs=nnx.Rngs(0),
    )
    graphdef, params, other = nnx.split(model, nnx.Param, ...)

    def logits(key):
        fresh = train.fresh_rng_state(other, key)
        return nnx.merge(graphdef, params, fresh)(images, train=True)

    a, b = logits(jax.random.key(1)), logits(jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    assert float(jnp.max(jnp.abs(a - logits(jax.random.key(2))))) > 1e-4


def test_position_augment_refuses_to_train_on_token_batches_it_would_not_augment():
    images = _images((2, 8, 12, 3))
    config = dict(TINY, pe="dinov3", position_convention="centred", position_augment=AUGMENT)
    model = ViT(**config, rngs=nnx.Rngs(0))
    batch = model.image_tokens(images)
    with pytest.raises(ValueError, match="augments the positions of image batches only"):
        model.classify_tokens(batch, train=True)
    packed, _ = tokens.pack_images(
        [np.asarray(images[0]), np.asarray(images[1])], model.patch, 12, 2
    )
    with pytest.raises(ValueError, match="training on a packed batch"):
        model.classify_tokens(jax.tree.map(jnp.asarray, packed), train=True)
    # evaluation uses no augmentation: token batches are the images' logits there
    np.testing.assert_allclose(model.classify_tokens(batch), model(images), rtol=1e-5, atol=1e-5)


def test_position_augment_names_unknown_keys():
    with pytest.raises(ValueError, match="unknown keys \\['scale'\\]"):
        ViT(**TINY, pe="dinov3", position_augment=dict(scale=2.0), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="jitter=0.5"):
        ViT(**TINY, pe="dinov3", position_augment=dict(jitter=0.5), rngs=nnx.Rngs(0))


def test_dinov3_augmentation_draws_what_it_drew_before_randomize_existed():
    """Without ``randomize`` the augment stream's key goes to ``positions.augment`` as before."""
    config = dict(TINY, pe="dinov3", position_convention="centred", position_augment=AUGMENT)
    model, twin = ViT(**config, rngs=nnx.Rngs(0)), ViT(**config, rngs=nnx.Rngs(0))
    got = model.augmented_positions((2, 3))
    want = positions.augment(
        twin.augment_rngs.augment(), twin.positions((2, 3)), num_prefix=1, **AUGMENT
    )
    np.testing.assert_array_equal(got, want)


def test_rpe2d_randomize_changes_training_positions_only():
    images = _images((2, 8, 12, 3))
    config = dict(TINY, pe="rope_mixed")
    plain = ViT(**config, rngs=nnx.Rngs(0))
    model = ViT(**config, position_augment=dict(randomize=3.0), rngs=nnx.Rngs(0))
    chex.assert_trees_all_equal(nnx.state(plain, nnx.Param), nnx.state(model, nnx.Param))
    np.testing.assert_allclose(model(images), plain(images), rtol=1e-6, atol=1e-6)
    pos = np.asarray(model.augmented_positions((2, 3)))
    assert pos.shape == (7, 2) and np.all(pos[0] == 0)
    rows, cols = pos[1:, 0].reshape(2, 3), pos[1:, 1].reshape(2, 3)
    assert np.all(rows == rows[:, :1]) and np.all(cols == cols[:1])  # the grid's structure
    assert np.all(np.diff(rows[:, 0]) > 0) and np.all(np.diff(cols[0]) > 0)  # sorted, distinct
    assert rows.max() < 6 and cols.max() < 9  # from the 6 x 9 grid
    first, second = model(images, train=True), model(images, train=True)
    assert float(jnp.max(jnp.abs(first - second))) > 1e-4
