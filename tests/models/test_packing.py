"""Packed batches (NaViT): several images per row, each in its own segment.

The core property, for every ``pe=`` value the recipes accept: every image of a packed row gets
the logits (and features) it gets alone at its own size (``ViT.__call__``), to float32
rounding, on every backend that takes segments ("xla", "xla_cpu", "chunked", and the Pallas
TPU kernel in its interpret mode); "cudnn" refuses packed batches. The "xla" checks of every
``pe=`` value (in 1D, 2D and 3D, with registers and every pool, under the conventions that
depend on the image's grid) share their programs with the padded batches' in test_tokens.py
(``_check_padded_equals_alone``): the same images alone, compiled once for both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie.models import backends, tokens, xla_attention
from tests.models.test_tokens import (  # GRIDS_PACKED_2D: rows of 1, 2 and 3 images
    GRIDS_PACKED_2D,
    MAX_IMAGES,
    MAX_TOKENS,
    PATCH_2D,
    _images,
    _model,
    _with_other_padding,
)


def _check_packed_equals_alone(model, alone_model):
    """``model``'s logits of the packed rows of GRIDS_PACKED_2D's images (and of the rows
    with other values in their padding) equal each image's alone through ``alone_model``'s
    graph (another attention backend) with ``model``'s parameters."""
    images = _images(GRIDS_PACKED_2D, PATCH_2D)
    batch, place = tokens.pack_images(images, PATCH_2D, MAX_TOKENS, MAX_IMAGES)
    both = _with_other_padding(batch, batch.segment_BT == 0)
    graphdef, state = nnx.split(model)
    alone_graphdef = nnx.graphdef(alone_model)

    @jax.jit  # one program (one compilation) for the rows, their copy and each image alone
    def logits(s, both, images):
        m, alone_m = nnx.merge(graphdef, s), nnx.merge(alone_graphdef, s)
        return m.classify_tokens(both), jnp.concatenate([alone_m(im[None]) for im in images])

    both_2BUV, alone = logits(
        state, tokens.Packed(*map(jnp.asarray, both)), [jnp.asarray(im) for im in images]
    )
    assert both_2BUV.shape == (2 * batch.segment_BT.shape[0], MAX_IMAGES, 5)
    logits_BUV, again_BUV = np.split(np.asarray(both_2BUV), 2)
    packed = logits_BUV[place[:, 0], place[:, 1]]
    np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(again_BUV[place[:, 0], place[:, 1]], packed, rtol=1e-6, atol=1e-6)


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
    images = _images(GRIDS_PACKED_2D, PATCH_2D)
    batch, place = tokens.pack_images(images, PATCH_2D, MAX_TOKENS, MAX_IMAGES, row_multiple=2)
    assert batch.patches_BTC.shape == (4, MAX_TOKENS, 12)  # 3 rows rounded up to 4
    assert (batch.segment_BT[3] == 0).all() and (batch.grid_BUA[3] == 0).all()
    for n, (row, slot) in enumerate(place):
        own = batch.segment_BT[row] == slot + 1
        assert own.sum() == np.prod(GRIDS_PACKED_2D[n])
        np.testing.assert_array_equal(batch.grid_BUA[row, slot], GRIDS_PACKED_2D[n])
        expected = tokens.patchify(images[n][None], PATCH_2D)[0]
        np.testing.assert_array_equal(batch.patches_BTC[row][own], expected)
    grid_BTA = np.asarray(tokens.slot_grids(tokens.Packed(*map(jnp.asarray, batch))))
    assert (grid_BTA[batch.segment_BT == 0] == 1).all()


def test_without_segments_images_would_see_each_other():
    """The equality sees the segments: attending across a row's images moves the logits of
    its images, from those they get with the segments (each image's own alone, test_tokens.py's
    packed check)."""
    model = _model("rope_mixed")
    images = _images(GRIDS_PACKED_2D, PATCH_2D)
    batch, place = tokens.pack_images(images, PATCH_2D, MAX_TOKENS, MAX_IMAGES)
    graphdef, state = nnx.split(model)

    @jax.jit  # one program; the segments are dropped while the second call is traced
    def with_and_without_segments(s, batch):
        m = nnx.merge(graphdef, s)
        kept = m.classify_tokens(batch)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(xla_attention, "with_segments", lambda bias, segments: bias)
            patch.setattr(backends, "with_segments", lambda bias, segments: bias)
            return kept, m.classify_tokens(batch)

    kept, leaky = (
        np.asarray(logits_BUV)[place[:, 0], place[:, 1]]
        for logits_BUV in with_and_without_segments(state, tokens.Packed(*map(jnp.asarray, batch)))
    )
    shared = [n for n, (row, _) in enumerate(place) if (place[:, 0] == row).sum() > 1]
    assert np.abs(leaky[shared] - kept[shared]).max() > 1e-3


@pytest.mark.parametrize("backend", ["xla_cpu", "chunked", "pallas"])
@pytest.mark.parametrize("pe", ["alibi", "rope_mixed"])
def test_packed_rows_through_every_backend_that_takes_segments(backend, pe):
    """ALiBi's per-row bias beside the segments: the same logits on every backend that keeps
    segments apart (Pallas in its TPU interpret mode) as each image alone through "xla" (the
    backends without segments: test_attention_backends.py)."""
    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode():
        _check_packed_equals_alone(_model(pe, attention=backend), alone_model=_model(pe))


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
    images = _images(GRIDS_PACKED_2D, PATCH_2D)
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
    batch, _ = tokens.pack_images(
        _images(GRIDS_PACKED_2D, PATCH_2D), PATCH_2D, MAX_TOKENS, MAX_IMAGES
    )
    with pytest.raises(ValueError, match="patch_dropout=0.5 is not available on packed"):
        model.classify_tokens(tokens.Packed(*map(jnp.asarray, batch)), train=True)
