"""Packed batches (NaViT): several images per row, each in its own segment.

The core property, for every ``pe=`` value the recipes accept: every image of a packed row gets
the logits (and features) it gets alone at its own size (``ViT.__call__``), to float32
rounding, on every backend that takes segments ("xla", "xla_cpu", "chunked", and the Pallas
TPU kernel in its interpret mode); "cudnn" refuses packed batches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie.models import backends, tokens, xla_attention
from tests.models.test_tokens import _images, _logits_alone, _model, _pe_values

# Six grids packed into rows of 20 tokens, at most 3 images a row: first-fit decreasing puts
# 16+4, 12+3+3 and 10 in three rows, so rows have 1, 2 and 3 images, empty slots and padding.
GRIDS_2D = ((3, 4), (2, 2), (1, 3), (4, 4), (2, 5), (3, 1))
PATCH_2D = (2, 2)
MAX_TOKENS, MAX_IMAGES = 20, 3


def _packed(model, batch, method="classify_tokens", **kwargs):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda s, b: getattr(nnx.merge(graphdef, s), method)(b, **kwargs))
    return fn(state, tokens.Packed(*map(jnp.asarray, batch)))


def _check_packed_equals_alone(model, grids, patch, max_tokens, max_images, alone=None):
    """``model``'s packed rows give each image its logits alone at its own size (``alone``, or
    ``model``'s own, in the same program); other values in the padded slots change nothing."""
    images = _images(grids, patch)
    batch, place = tokens.pack_images(images, patch, max_tokens, max_images)
    # Other values (large, different per slot) in the padded slots, to change nothing.
    noise = np.random.default_rng(1).normal(scale=100.0, size=batch.patches_BTC.shape)
    padded = batch.segment_BT[..., None] == 0
    changed = batch._replace(patches_BTC=np.where(padded, noise, batch.patches_BTC))
    graphdef, state = nnx.split(model)
    as_jax = lambda b: tokens.Packed(*map(jnp.asarray, b))  # noqa: E731
    if alone is None:
        # One program (one compilation) for the packed rows, the rows with other padding, and
        # each image alone at its own size.
        @jax.jit
        def logits(s, batch, changed, images):
            m = nnx.merge(graphdef, s)
            alone = jnp.concatenate([m(im[None]) for im in images])
            return m.classify_tokens(batch), m.classify_tokens(changed), alone

        logits_BUV, again_BUV, alone = logits(
            state, as_jax(batch), as_jax(changed), [jnp.asarray(im) for im in images]
        )
    else:
        rows = jax.jit(lambda s, *bs: [nnx.merge(graphdef, s).classify_tokens(b) for b in bs])
        logits_BUV, again_BUV = rows(state, as_jax(batch), as_jax(changed))
    assert logits_BUV.shape == (batch.segment_BT.shape[0], max_images, 5)
    packed = np.asarray(logits_BUV)[place[:, 0], place[:, 1]]
    np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=2e-5)
    again = np.asarray(again_BUV)[place[:, 0], place[:, 1]]
    np.testing.assert_allclose(again, packed, rtol=1e-6, atol=1e-6)
    return batch, place


def test_greedy_rows_first_fit_decreasing():
    place, rows = tokens.assign_rows([12, 4, 3, 16, 10, 3], MAX_TOKENS, MAX_IMAGES)
    assert rows == 3
    # 16 -> row 0; 12 -> row 1; 10 -> row 2; 4 -> row 0; 3 and 3 -> row 1 (room: 8).
    np.testing.assert_array_equal(place, [[1, 0], [0, 1], [1, 1], [0, 0], [2, 0], [1, 2]])
    assert tokens.assign_rows([5] * 4, 20, 2)[1] == 2  # two images a row at most
    with pytest.raises(ValueError, match="max_tokens=20"):
        tokens.assign_rows([21], 20, 2)
    with pytest.raises(ValueError, match="max_images=0"):
        tokens.assign_rows([2], 20, 0)


def test_pack_images_layout():
    images = _images(GRIDS_2D, PATCH_2D)
    batch, place = tokens.pack_images(images, PATCH_2D, MAX_TOKENS, MAX_IMAGES, row_multiple=2)
    assert batch.patches_BTC.shape == (4, MAX_TOKENS, 12)  # 3 rows rounded up to 4
    assert (batch.segment_BT[3] == 0).all() and (batch.grid_BUA[3] == 0).all()
    for n, (row, slot) in enumerate(place):
        own = batch.segment_BT[row] == slot + 1
        assert own.sum() == np.prod(GRIDS_2D[n])
        np.testing.assert_array_equal(batch.grid_BUA[row, slot], GRIDS_2D[n])
        expected = tokens.patchify(images[n][None], PATCH_2D)[0]
        np.testing.assert_array_equal(batch.patches_BTC[row][own], expected)
    grid_BTA = np.asarray(tokens.slot_grids(tokens.Packed(*map(jnp.asarray, batch))))
    assert (grid_BTA[batch.segment_BT == 0] == 1).all()


@pytest.mark.parametrize("pe", [p for p in _pe_values() if p != "rope"])
def test_packed_rows_equal_each_image_alone(pe):
    _check_packed_equals_alone(_model(pe), GRIDS_2D, PATCH_2D, MAX_TOKENS, MAX_IMAGES)


def test_packed_rows_equal_alone_1d_rope():
    grids = ((3,), (5,), (2,), (4,))
    _check_packed_equals_alone(_model("rope", rank=1), grids, (2,), 8, 2)


def test_packed_rows_equal_alone_3d():
    """LieRE's 3D rotations and a trilinear APE table per image."""
    model = _model("liere", rank=3, additive="ape")
    grids = ((2, 1, 3), (1, 3, 2), (2, 2, 2), (1, 1, 2))
    _check_packed_equals_alone(model, grids, (2, 2, 2), 16, 3)


@pytest.mark.parametrize("pool", ["cls", "mean", "mean_with_cls"])
def test_packed_rows_with_registers_every_pool(pool):
    """Every image's own class token and registers (their APE rows too), pooled per image."""
    model = _model("rope_axial", pool=pool, num_registers=2, additive="ape")
    _check_packed_equals_alone(model, GRIDS_2D, PATCH_2D, MAX_TOKENS, MAX_IMAGES)


@pytest.mark.parametrize("convention", ["centred", "normalized", "autoscale", "sequential"])
def test_packed_rows_every_grid_convention(convention):
    """Conventions whose positions depend on the image's grid: each token's own image's."""
    model = _model(
        "rope_mixed",
        pool="mean",
        additive="ape",
        additive_prefix=False,
        position_convention=convention,
    )
    _check_packed_equals_alone(model, GRIDS_2D, PATCH_2D, MAX_TOKENS, MAX_IMAGES)


def test_without_segments_images_would_see_each_other():
    """The equality sees the segments: attending across a row's images moves the logits."""
    model = _model("rope_mixed")
    images = _images(GRIDS_2D, PATCH_2D)
    batch, place = tokens.pack_images(images, PATCH_2D, MAX_TOKENS, MAX_IMAGES)
    expected = _logits_alone(model, images)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(xla_attention, "with_segments", lambda bias, segments: bias)
        patch.setattr(backends, "with_segments", lambda bias, segments: bias)
        leaky = np.asarray(_packed(model, batch))[place[:, 0], place[:, 1]]
    shared = [n for n, (row, _) in enumerate(place) if (place[:, 0] == row).sum() > 1]
    assert np.abs(leaky[shared] - expected[shared]).max() > 1e-3


@functools.cache
def _xla_logits_alone(pe):
    """Each image of ``GRIDS_2D`` alone through ``_model(pe)`` on the "xla" backend, once per
    ``pe`` for every backend's packed rows (the same parameters: the backend holds none)."""
    return _logits_alone(_model(pe), _images(GRIDS_2D, PATCH_2D))


@pytest.mark.parametrize("backend", ["xla_cpu", "chunked", "pallas"])
@pytest.mark.parametrize("pe", ["alibi", "rope_mixed"])
def test_packed_rows_through_every_backend_that_takes_segments(backend, pe):
    """ALiBi's per-row bias beside the segments: every backend that keeps segments apart
    (Pallas in its TPU interpret mode) gives each packed image the logits "xla" gives it alone."""
    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode():
        _check_packed_equals_alone(
            _model(pe, attention=backend),
            GRIDS_2D,
            PATCH_2D,
            MAX_TOKENS,
            MAX_IMAGES,
            alone=_xla_logits_alone(pe),
        )


@functools.partial(jax.jit, static_argnums=(0, 1))
def _values_and_grads(f, g, q, k, v):
    """f's and g's outputs and the gradients of sum(out ** 2) in q, k, v: one program, not
    the values and gradients op by op."""
    loss = lambda h: lambda *a: jnp.sum(h(*a) ** 2)
    return [(h(q, k, v), jax.grad(loss(h), (0, 1, 2))(q, k, v)) for h in (f, g)]


def test_chunked_segments_in_small_key_blocks_values_and_gradients():
    """Segments compared per key block (blocks of 3 keys, a row of 11): values and gradients
    equal "xla"'s segment bias, with and without a bias."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 11, 2, 8)), jnp.float32) for _ in range(3))
    segment_BS = jnp.asarray([[1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0], [2, 2, 2, 2, 2, 1, 1, 0, 0, 0, 0]])
    bias = jnp.asarray(-rng.uniform(size=(2, 2, 11, 11)), jnp.float32)
    for b in (None, bias):
        xla = lambda q, k, v, b=b: xla_attention.attend(
            q, k, v, xla_attention.with_segments(b, segment_BS)
        )
        chunked = lambda q, k, v, b=b: backends.attend_chunked(
            q, k, v, b, block=3, segment_BS=segment_BS
        )
        (out, grads), (want_out, want_grads) = _values_and_grads(chunked, xla, q, k, v)
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_pallas_segments_values_and_gradients():
    from jax.experimental.pallas import tpu as pltpu

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 11, 2, 8)), jnp.float32) for _ in range(3))
    segment_BS = jnp.asarray([[1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0], [2, 2, 2, 2, 2, 1, 1, 0, 0, 0, 0]])
    xla = lambda q, k, v: xla_attention.attend(
        q, k, v, xla_attention.with_segments(None, segment_BS)
    )
    pallas = lambda q, k, v: backends.attend_pallas(q, k, v, segment_BS=segment_BS)
    with pltpu.force_tpu_interpret_mode():
        (out, grads), (want_out, want_grads) = _values_and_grads(pallas, xla, q, k, v)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_cudnn_refuses_packed_batches():
    with pytest.raises(ValueError, match="cannot keep the images of a packed batch apart"):
        backends.check_attention(
            "cudnn", platform="gpu", dtype=jnp.bfloat16, head_dim=64, packed=True
        )
    backends.check_attention("cudnn", platform="gpu", dtype=jnp.bfloat16, head_dim=64)
    for name in ("xla", "chunked"):
        backends.check_attention(name, platform="gpu", dtype=jnp.float32, head_dim=8, packed=True)
    q = jnp.zeros((1, 4, 1, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="model.attention='cudnn' cannot keep"):
        backends.attend_cudnn(q, q, q, segment_BS=jnp.ones((1, 4), jnp.int32), implementation="xla")


def test_packed_features_equal_each_image_alone():
    model = _model("liere", num_registers=1, additive="ape")
    images = _images(GRIDS_2D, PATCH_2D)
    batch, place = tokens.pack_images(images, PATCH_2D, MAX_TOKENS, MAX_IMAGES)
    graphdef, state = nnx.split(model)

    @jax.jit  # the packed rows and each image alone in one program
    def features(s, batch, images):
        m = nnx.merge(graphdef, s)
        packed = m.features(batch, layers=(0, 1), norm=True)
        return packed, [m.features(im[None], layers=(0, 1), norm=True) for im in images]

    packed = tokens.Packed(*map(jnp.asarray, batch))
    feats, each_alone = features(state, packed, [jnp.asarray(im) for im in images])
    segment = batch.segment_BT
    for n, alone in enumerate(each_alone):
        row, slot = place[n]
        for layer in range(2):
            got = np.asarray(feats.patch[layer][row])[segment[row] == slot + 1]
            np.testing.assert_allclose(got, alone.patch[layer][0], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(
                feats.prefix[layer][row, slot], alone.prefix[layer][0], rtol=1e-5, atol=1e-5
            )


def test_packed_training_refuses_patch_dropout():
    model = _model("nope", patch_dropout=0.5)
    batch, _ = tokens.pack_images(_images(GRIDS_2D, PATCH_2D), PATCH_2D, MAX_TOKENS, MAX_IMAGES)
    with pytest.raises(ValueError, match="patch_dropout=0.5 is not available on packed"):
        model.classify_tokens(tokens.Packed(*map(jnp.asarray, batch)), train=True)
