"""Tests for rope_lie.models.tokens and ``ViT.classify_tokens``: padded mixed-size batches.

The core property, for every family the recipes accept (every ``pe=`` value of
``config_lib``, with the position convention of its reference): the logits of a padded batch
of images of different grids equal those of each image alone at its own size (``ViT.__call__``)
to float32 rounding, and the values in padded slots change nothing. The same images packed
into rows (``tokens.Packed``, test_packing.py) are checked against the same images alone, in
the same program: one compilation of each image alone serves both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie import config_lib, encodings
from rope_lie.encodings import liere, positions
from rope_lie.models import backends, tokens, xla_attention
from rope_lie.models.vit import ViT

# Three grids of different sizes and aspect ratios, padded to 20 tokens (16 is the largest).
GRIDS_2D = ((3, 4), (5, 2), (4, 4))
PATCH_2D = (2, 2)
MAX_TOKENS = 20
# Six grids (GRIDS_2D among them), padded, and packed into rows of 20 tokens, at most 3 images
# a row: first-fit decreasing puts 16+4, 12+3+3 and 10 in three rows, so rows have 1, 2 and 3
# images, empty slots and padding.
GRIDS_PACKED_2D = ((3, 4), (2, 2), (1, 3), (4, 4), (5, 2), (3, 1))
MAX_IMAGES = 3
# Tiny, with two layers: padding that leaked into a real token would spread in the second.
DIMS = dict(width=16, depth=2, num_heads=2, mlp_dim=32)
# Each family's first example (its FAMILY): valid at head_dim 8, the non-default structure.
HPARAMS = {name: dict(f.examples[0][0]) for name, f in encodings.families().items()}


def _pe_values():
    """Every ``pe=`` value the recipes accept: families, named variants, additive tables."""
    families = sorted(encodings.ROTARY) + sorted(encodings.BIAS)
    return families + sorted(config_lib.PE_VARIANTS) + list(config_lib.ADDITIVE_PES)


def _model(pe, rank=2, **overrides):
    fields = config_lib.pe_fields(pe, block=4, ape_std=0.5)
    if fields["pe"] in HPARAMS and pe not in config_lib.PE_VARIANTS:
        fields["pe_hparams"] = dict(HPARAMS[fields["pe"]])
    shape = {1: (8,), 2: (8, 8), 3: (4, 4, 4)}[rank]
    config = dict(
        variant=None,
        dims=DIMS,
        patch_size=2,
        image_shape=shape,
        channels=3,
        num_classes=5,
        head_zero_init=False,
        **fields,
    )
    config.update(overrides)
    return ViT(**config, rngs=nnx.Rngs(0))


def _images(grids, patch, seed=0):
    rng = np.random.default_rng(seed)
    return [
        rng.normal(size=(*(g * p for g, p in zip(grid, patch, strict=True)), 3)).astype(np.float32)
        for grid in grids
    ]


def _logits_packed(model, batch, **kwargs):
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, b: nnx.merge(graphdef, s).classify_tokens(b, **kwargs))
    return np.asarray(forward(state, tokens.Tokens(*map(jnp.asarray, batch))))


def _with_other_padding(batch, padded_BT):
    """The batch and, after it, a copy with other values (large, different per slot) in its
    padded slots: one batch of twice the rows, whose second half must give the first's logits
    (a row's logits are its own)."""
    noise = np.random.default_rng(1).normal(scale=100.0, size=batch.patches_BTC.shape)
    changed = batch._replace(patches_BTC=np.where(padded_BT[..., None], noise, batch.patches_BTC))
    return type(batch)(*(np.concatenate([a, c]) for a, c in zip(batch, changed, strict=True)))


def _check_padded_equals_alone(model, grids, patch, max_tokens, packed=None):
    """The padded batch of the images (``tokens.pack`` to ``max_tokens``) gives each image's
    logits alone at its own size (``ViT.__call__``), and other values in its padded slots
    change nothing. ``packed=(row_tokens, max_images)``: the images packed into rows
    (``tokens.pack_images``) as well, each image's logits in its slot equal to its own alone,
    the padding again changing nothing (test_packing.py: packed batches)."""
    images = _images(grids, patch)
    batch = tokens.pack(images, patch, max_tokens)
    assert (batch.mask_BT.sum(1) < max_tokens).all()  # every example has padding
    both = _with_other_padding(batch, batch.mask_BT == 0)
    rows = None
    if packed is not None:
        rows, place = tokens.pack_images(images, patch, *packed)
        rows = _with_other_padding(rows, rows.segment_BT == 0)
    graphdef, state = nnx.split(model)

    # One program (one compilation) for the batch and its copy with other padding, the packed
    # rows and theirs, and each image alone at its own size.
    @jax.jit
    def logits(s, images, both, rows):
        m = nnx.merge(graphdef, s)
        packed_rows = None if rows is None else m.classify_tokens(rows)
        alone = jnp.concatenate([m(im[None]) for im in images])
        return m.classify_tokens(both), packed_rows, alone

    as_jax = lambda b: None if b is None else type(b)(*map(jnp.asarray, b))  # noqa: E731
    padded_2B, rows_2RUV, alone = logits(
        state, [jnp.asarray(im) for im in images], as_jax(both), as_jax(rows)
    )
    padded, padded_changed = np.split(np.asarray(padded_2B), 2)
    np.testing.assert_allclose(padded, alone, rtol=1e-5, atol=2e-5, err_msg="padded")
    np.testing.assert_allclose(padded_changed, padded, rtol=1e-6, atol=1e-6, err_msg="padding")
    if packed is not None:
        assert rows_2RUV.shape == (rows.segment_BT.shape[0], packed[1], 5)
        in_rows, in_changed = np.split(np.asarray(rows_2RUV), 2)
        in_rows, in_changed = (r[place[:, 0], place[:, 1]] for r in (in_rows, in_changed))
        np.testing.assert_allclose(in_rows, alone, rtol=1e-5, atol=2e-5, err_msg="packed")
        np.testing.assert_allclose(in_changed, in_rows, rtol=1e-6, atol=1e-6, err_msg="rows")


@pytest.mark.parametrize("pe", [p for p in _pe_values() if p != "rope"])
def test_padded_and_packed_batches_equal_each_image_alone(pe):
    _check_padded_equals_alone(
        _model(pe), GRIDS_PACKED_2D, PATCH_2D, MAX_TOKENS, (MAX_TOKENS, MAX_IMAGES)
    )


def test_padded_and_packed_batches_equal_alone_1d_rope():
    """RoPE encodes 1D positions: sequences of 3, 5, 2 and 4 patches padded to 7, and packed
    into rows of 8, at most 2 a row."""
    _check_padded_equals_alone(_model("rope", rank=1), ((3,), (5,), (2,), (4,)), (2,), 7, (8, 2))


# Conventions whose positions depend on the image's grid: packed, each token's own image's.
_PACKED_CONVENTIONS = ("centred", "normalized", "autoscale", "sequential")


@pytest.mark.parametrize("convention", positions.CONVENTIONS)
def test_padded_equals_alone_every_convention_mean_pool(convention):
    """Mean pooling over real tokens only; APE outside the class token (timm's no_embed_class).
    Packed rows too for the conventions of ``_PACKED_CONVENTIONS``."""
    model = _model(
        "rope_mixed",
        pool="mean",
        additive="ape",
        additive_prefix=False,
        position_convention=convention,
    )
    if convention in _PACKED_CONVENTIONS:
        packed = (MAX_TOKENS, MAX_IMAGES)
        _check_padded_equals_alone(model, GRIDS_PACKED_2D, PATCH_2D, MAX_TOKENS, packed)
    else:
        _check_padded_equals_alone(model, GRIDS_2D, PATCH_2D, MAX_TOKENS)


@pytest.mark.parametrize("pool", ["cls", "mean", "mean_with_cls"])
def test_padded_and_packed_equal_alone_with_registers(pool):
    """Registers (prefix tokens at 0, unpooled) in the padded path as in the image path; with an
    APE table holding their rows. Packed: every image's own class token and registers (their
    APE rows too), pooled per image."""
    model = _model("rope_axial", pool=pool, num_registers=2, additive="ape")
    packed = (MAX_TOKENS, MAX_IMAGES)
    _check_padded_equals_alone(model, GRIDS_PACKED_2D, PATCH_2D, MAX_TOKENS, packed)


def test_padded_equals_alone_with_timms_avg_head():
    """The mean of the real patch tokens beside a class token, no final norm, a LayerNorm on
    the pooled feature (timm's "avg" with fc_norm): the padded path as the image path."""
    model = _model("rope_axial", pool="mean_with_cls", final_norm=False, fc_norm=True)
    _check_padded_equals_alone(model, GRIDS_2D, PATCH_2D, MAX_TOKENS)


@pytest.mark.parametrize("spacing", [1.0, 2.0])
def test_padded_equals_alone_3d_diagonal(spacing):
    """VideoRoPE's diagonal layout from each example's own (t, h, w) grid (traced centres)."""
    model = _model(
        "rope_axial",
        rank=3,
        pe_hparams=dict(layout="videorope", base=1e4),
        position_convention="diagonal",
        position_hparams=dict(temporal_spacing=spacing),
    )
    _check_padded_equals_alone(model, ((2, 1, 3), (1, 3, 2), (2, 2, 2)), (2, 2, 2), 10)


def test_padded_and_packed_batches_equal_alone_3d():
    """Trilinear APE resized per example, and LieRE's 3D rotations: padded to 10 tokens, and
    packed into rows of 16, at most 3 a row."""
    model = _model("liere", rank=3, additive="ape")
    grids = ((2, 1, 3), (1, 3, 2), (2, 2, 2), (1, 1, 2))
    _check_padded_equals_alone(model, grids, (2, 2, 2), 10, (16, 3))


def test_changing_a_real_token_changes_its_example_only():
    """The equality tests could pass if the batch path ignored the tokens: it does not."""
    model = _model("rope_mixed")
    batch = tokens.pack(_images(GRIDS_2D, PATCH_2D), PATCH_2D, MAX_TOKENS)
    changed = batch.patches_BTC.copy()
    changed[1, 0] += 1.0
    before = _logits_packed(model, batch)
    after = _logits_packed(model, batch._replace(patches_BTC=changed))
    assert np.abs(after[1] - before[1]).max() > 1e-4
    np.testing.assert_allclose(after[[0, 2]], before[[0, 2]], rtol=1e-6, atol=1e-6)


def test_key_mask_gives_padded_keys_exactly_zero_weight_with_or_without_a_bias():
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(2, 4, 2, 8)), jnp.float32) for _ in range(2))
    mask_BS = jnp.asarray([[1, 1, 0, 1], [1, 0, 0, 0]])
    alibi_1NTS = jnp.asarray(-rng.uniform(size=(1, 2, 4, 4)), jnp.float32)
    assert xla_attention.with_key_mask(alibi_1NTS, None) is alibi_1NTS
    for bias in (None, alibi_1NTS):
        probs = xla_attention.attention_probs(q, k, xla_attention.with_key_mask(bias, mask_BS))
        np.testing.assert_array_equal(np.asarray(probs)[0, :, :, 2], 0.0)
        np.testing.assert_array_equal(np.asarray(probs)[1, :, :, 1:], 0.0)
        # The real keys' weights are the softmax over the real keys alone.
        own_bias = None if bias is None else bias[..., [0, 1, 3]]
        alone = xla_attention.attention_probs(q[:1], k[:1, [0, 1, 3]], own_bias)
        np.testing.assert_allclose(np.asarray(probs)[0][..., [0, 1, 3]], alone[0], rtol=1e-6)


@pytest.mark.parametrize("mask", ["key_mask", "segments"])
def test_masks_take_a_bias_of_fewer_axes_as_it_broadcasts(mask):
    # An (N, T, S) bias is "broadcastable to (B, N, T, S)"; adding the mask's 4-d array to it
    # raised under rank promotion "raise" (the GPU tests' reference with a per-head bias).
    bias_NTS = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, 4)), jnp.float32)
    if mask == "key_mask":
        add = lambda b: xla_attention.with_key_mask(b, jnp.asarray([[1, 1, 0, 1], [1, 0, 0, 0]]))  # noqa: E731
    else:
        add = lambda b: xla_attention.with_segments(b, jnp.asarray([[1, 1, 2, 2], [1, 1, 1, 0]]))  # noqa: E731
    with jax.numpy_rank_promotion("raise"):
        np.testing.assert_array_equal(add(bias_NTS), add(bias_NTS[None]))


def _packed(grids=GRIDS_2D, max_tokens=MAX_TOKENS):
    return tokens.Tokens(
        *map(jnp.asarray, tokens.pack(_images(grids, PATCH_2D), PATCH_2D, max_tokens))
    )


def test_patch_dropout_keeps_a_random_subset_of_each_examples_own_tokens():
    batch = _packed()
    counts = np.asarray(batch.mask_BT.sum(1)).astype(int)  # 12, 10, 16
    kept = tokens.patch_dropout(jax.random.key(0), batch, 11)
    assert kept.patches_BTC.shape == (3, 11, batch.patches_BTC.shape[-1])
    np.testing.assert_array_equal(kept.mask_BT.sum(1), np.minimum(counts, 11))
    for b, grid in enumerate(GRIDS_2D):
        real = np.asarray(kept.mask_BT[b]) > 0
        index = np.asarray(kept.index_BTA[b])[real]
        flat = index[:, 0] * grid[1] + index[:, 1]  # row-major slot in the full sequence
        assert len(set(flat.tolist())) == len(flat) and (flat < counts[b]).all()
        assert (np.diff(flat) > 0).all()  # kept in their order
        # Each kept slot holds its own patch.
        np.testing.assert_array_equal(kept.patches_BTC[b][real], batch.patches_BTC[b][flat])
    other = tokens.patch_dropout(jax.random.key(1), batch, 11)
    assert not np.array_equal(other.index_BTA, kept.index_BTA)  # the subset depends on the key


def test_patch_dropout_errors_and_keep_count():
    with pytest.raises(ValueError, match="num_keep=21"):
        tokens.patch_dropout(jax.random.key(0), _packed(), 21)
    with pytest.raises(ValueError, match="patch_dropout=1.0"):
        tokens.keep_count(20, 1.0)
    assert tokens.keep_count(20, 0.0) == 20 and tokens.keep_count(20, 0.25) == 15
    with pytest.raises(ValueError, match="needs a patch_key"):
        _model("nope", patch_dropout=0.5).classify_tokens(_packed(), train=True)


@pytest.mark.parametrize("pe", sorted(encodings.ROTARY) + sorted(encodings.BIAS))
def test_patch_dropout_keeps_the_rotations_of_the_kept_tokens_positions(pe):
    """The encoder state of the kept tokens is the full grid's state at those tokens."""
    rank = 1 if pe == "rope" else 2
    grid = (7,) if rank == 1 else (4, 5)
    model = _model(pe, rank=rank)
    full = tokens.from_patches(jnp.zeros((2, int(np.prod(grid)), 12)), grid)
    kept = tokens.patch_dropout(jax.random.key(3), full, 5)
    slot_BT = np.ravel_multi_index(tuple(np.moveaxis(np.asarray(kept.index_BTA), -1, 0)), grid)
    slot_BT = np.concatenate([np.zeros((2, 1), int), 1 + slot_BT], axis=1)  # class token first
    x_BTNH = jnp.asarray(np.random.default_rng(0).normal(size=(2, 1 + full.mask_BT.shape[1], 2, 8)))
    graphdef, params = nnx.split(model)

    @jax.jit  # one program, not the states and rotations op by op
    def states_and_rotations(params, kept, slot_BT):
        m = nnx.merge(graphdef, params)
        full_state = m.precompute_pe(grid)[0]
        kept_state = m.pe_states(m.token_positions(kept))[0]
        x_kept = jnp.take_along_axis(x_BTNH, slot_BT[..., None, None], axis=1)
        rotated_full = jnp.take_along_axis(full_state.rotate(x_BTNH), slot_BT[..., None, None], 1)
        return full_state, kept_state, kept_state.rotate(x_kept), rotated_full

    full_state, kept_state, rotated_kept, rotated_full = states_and_rotations(
        params, kept, jnp.asarray(slot_BT)
    )
    np.testing.assert_allclose(rotated_kept, rotated_full, rtol=1e-5, atol=1e-5)
    if full_state.bias_BNTS is not None:  # ALiBi: the bias between kept tokens
        for b in range(2):
            expected = full_state.bias_BNTS[0][:, slot_BT[b]][:, :, slot_BT[b]]
            np.testing.assert_allclose(kept_state.bias_BNTS[b], expected, rtol=1e-6, atol=1e-6)
    if full_state.fold_NHH is not None:
        np.testing.assert_array_equal(kept_state.fold_NHH, full_state.fold_NHH)


def test_training_patch_dropout_is_the_model_on_the_kept_tokens_and_off_is_identity():
    batch, key = _packed(), jax.random.key(5)
    model = _model("rope_mixed", additive="ape", patch_dropout=0.4)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=1)
    def logits(b, train, patch_key):
        return nnx.merge(graphdef, state).classify_tokens(b, train=train, patch_key=patch_key)

    kept = tokens.patch_dropout(key, batch, tokens.keep_count(MAX_TOKENS, 0.4))
    evaluation = _logits_packed(model, batch)
    np.testing.assert_allclose(
        logits(batch, True, key), _logits_packed(model, kept), rtol=1e-6, atol=1e-6
    )
    assert not np.allclose(_logits_packed(model, kept), evaluation, atol=1e-4)
    # Off in evaluation, and at rate 0 in training: every token, whatever the key.
    np.testing.assert_allclose(logits(batch, False, key), evaluation, rtol=1e-6, atol=1e-6)
    off = _model("rope_mixed", additive="ape")
    np.testing.assert_allclose(
        _logits_packed(off, batch, train=True, patch_key=key),
        _logits_packed(off, batch),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("pe", ["visionllama", "ape"])
def test_an_all_padding_example_gives_finite_logits_and_leaves_the_others_alone(pe):
    """An evaluation batch's zero-filled tail: grid 0, no real token (autoscale divides by n)."""
    model = _model(pe)
    batch = tokens.pack(_images(GRIDS_2D, PATCH_2D), PATCH_2D, MAX_TOKENS)
    tail = tokens.Tokens(*(np.concatenate([a, np.zeros_like(a[:1])]) for a in batch))
    logits = _logits_packed(model, tail)
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits[:3], _logits_packed(model, batch), rtol=1e-6, atol=1e-6)


def test_image_tokens_path_equals_the_image_path():
    """Patch dropout on fixed-size batches goes through ``image_tokens``: no change without it."""
    model = _model("cayley_string", additive="sincos")
    images = jnp.asarray(np.stack(_images([(4, 3), (4, 3)], PATCH_2D)))
    graphdef, state = nnx.split(model)

    @jax.jit  # both paths in one program: eager calls would compile every operation apart
    def both(s, x):
        m = nnx.merge(graphdef, s)
        return m.classify_tokens(m.image_tokens(x)), m(x)

    np.testing.assert_allclose(*both(state, images), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pe", ["alibi", "rope_mixed"])
def test_padded_batch_of_four_through_the_cpu_attention_chunks(pe):
    """An even batch through the "xla_cpu" backend is attended in two concurrent chunks
    (``cpu_chunks``): the mask (and ALiBi's per-example bias) is chunked with its examples. The
    check runs 4 images and their copy with other padding as one batch of 8."""
    assert xla_attention.cpu_chunks(8, 2, 21, 21)[1] == 2
    model = _model(pe, attention="xla_cpu")
    _check_padded_equals_alone(model, GRIDS_2D[:2] * 2, PATCH_2D, MAX_TOKENS)


@pytest.mark.parametrize("backend", ["pallas", "cudnn"])
def test_padded_batch_through_the_fused_backends_equals_xla(backend, monkeypatch):
    """The key mask reaches the fused backends as they take it (Pallas: segment ids, run in its
    TPU interpret mode; cuDNN: sequence lengths, through jax's reference of the same call, as
    no cuDNN runs here): ALiBi's per-example bias and the mask, the same logits as "xla"."""
    from jax.experimental.pallas import tpu as pltpu

    cudnn = backends.attend_cudnn
    monkeypatch.setattr(backends, "attend_cudnn", lambda *a: cudnn(*a, implementation="xla"))
    batch = tokens.pack(_images(GRIDS_2D, PATCH_2D), PATCH_2D, MAX_TOKENS)
    expected = _logits_packed(_model("alibi"), batch)
    with pltpu.force_tpu_interpret_mode():
        logits = _logits_packed(_model("alibi", attention=backend), batch)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("rank", [2, 3])
def test_liere_padded_batch_by_distinct_position_equals_per_token(rank, monkeypatch):
    """LieRE's rotations of a padded mixed batch, once per distinct position and gathered,
    give the logits of one exponential per token (the path before, ``liere._rotations`` on
    every slot) to float32 rounding, in 2D and 3D."""
    grids, patch, length = {
        2: (GRIDS_2D, PATCH_2D, MAX_TOKENS),
        3: (((2, 1, 3), (1, 3, 2), (2, 2, 2)), (2, 2, 2), 10),
    }[rank]
    model = _model("liere", rank=rank)
    batch = tokens.pack(_images(grids, patch), patch, length)
    shared = _logits_packed(model, batch)
    monkeypatch.setattr(liere, "_token_rotations", liere._rotations)
    np.testing.assert_allclose(shared, _logits_packed(model, batch), rtol=1e-5, atol=2e-5)


def test_tokens_outside_their_grid_and_bad_segments_are_refused_where_values_are_known():
    """An index outside its example's grid, a real example with a zero grid, a segment id
    above U or below 0, or a used slot without a grid would move tokens or drop an image,
    with other logits and no error. Eager calls check them; under jit values are unknown."""
    model = _model("rope_axial")
    images = _images([(2, 3), (3, 2), (2, 2)], (2, 2))
    batch = tokens.pack(images, (2, 2), 8)
    rows, _ = tokens.pack_images(images, (2, 2), 12, 3)
    assert np.isfinite(model.classify_tokens(tokens.Tokens(*map(jnp.asarray, batch)))).all()
    assert np.isfinite(model.classify_tokens(tokens.Packed(*map(jnp.asarray, rows)))).all()

    def padded(**change):
        return tokens.Tokens(*map(jnp.asarray, batch._replace(**change)))

    def packed(**change):
        return tokens.Packed(*map(jnp.asarray, rows._replace(**change)))

    index = batch.index_BTA.copy()
    index[0, 0] = (7, 9)
    with pytest.raises(ValueError, match=r"example 0: grid_BA=\[2, 3\] .* every index in"):
        model.classify_tokens(padded(index_BTA=index))
    grid = batch.grid_BA.copy()
    grid[1] = 0
    with pytest.raises(ValueError, match=r"example 1: grid_BA=\[0, 0\]"):
        model.classify_tokens(padded(grid_BA=grid))
    segment = rows.segment_BT.copy()
    segment[segment == 2] = 5
    with pytest.raises(ValueError, match=r"segment_BT holds \[1, 5\]; expected 0 .* to U=3"):
        model.classify_tokens(packed(segment_BT=segment))
    grid = rows.grid_BUA.copy()
    grid[0, 1] = 0
    with pytest.raises(ValueError, match=r"row 0, segment 2: grid_BUA=\[0, 0\]"):
        model.classify_tokens(packed(grid_BUA=grid))
    with pytest.raises(ValueError, match=r"row 0, segment 2"):
        model.features(packed(grid_BUA=grid))
    # inside jit the values are not known: the check stands aside, the pipeline builds them
    graphdef, state = nnx.split(model)
    jitted = jax.jit(lambda s, b: nnx.merge(graphdef, s).classify_tokens(b))
    assert jitted(state, padded(index_BTA=index)).shape == (3, 5)


def test_features_of_packed_rows_without_prefix_tokens():
    """pool="mean" and no registers: no prefix tokens, an empty (B, U, 0, D) prefix."""
    model = _model("rope_axial", pool="mean")
    assert model.num_prefix == 0
    rows, place = tokens.pack_images(_images([(2, 3), (3, 2)], (2, 2)), (2, 2), 12, 2)
    features = model.features(tokens.Packed(*map(jnp.asarray, rows)))
    assert features.prefix[0].shape == (rows.segment_BT.shape[0], 2, 0, DIMS["width"])


def test_token_batch_shapes_that_disagree_are_named():
    """A patch width of another patch size or channel count, or a mask of another length,
    ended in XLA's messages about dot_general or broadcasting, naming no field."""
    model = _model("rope_axial")
    batch = tokens.pack(_images([(2, 3), (3, 2)], (2, 2)), (2, 2), 8)
    wide = batch._replace(patches_BTC=np.zeros((2, 8, 16), np.float32))
    with pytest.raises(ValueError, match=r"Tokens.patches_BTC has shape \(2, 8, 16\); expected"):
        model.classify_tokens(tokens.Tokens(*map(jnp.asarray, wide)))
    short = batch._replace(mask_BT=batch.mask_BT[:, :7])
    with pytest.raises(ValueError, match=r"Tokens.mask_BT has shape \(2, 7\); expected \(2, 8\)"):
        jax.jit(model.classify_tokens)(tokens.Tokens(*map(jnp.asarray, short)))
