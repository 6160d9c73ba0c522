"""Tests for rope_lie.models.vit: every family in 2D and some in 3D, sharing, resolution, errors."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie import encodings
from rope_lie.models import tokens
from rope_lie.models.position_hook import PositionParam
from rope_lie.models.vit import ViT

# pico: width 32, depth 2, heads 2 -> head_dim 16.
TINY = dict(variant="pico/4", image_shape=(8, 12), channels=3, num_classes=5)
TINY_3D = dict(
    variant="pico", patch_size=(2, 4, 4), image_shape=(4, 8, 8), channels=2, num_classes=3
)
# Each family's first example (its FAMILY): valid at head_dim 16, the non-default structure.
HPARAMS = {name: dict(f.examples[0][0]) for name, f in encodings.families().items()}


def _families():
    return sorted(encodings.ROTARY) + sorted(encodings.BIAS)


def _images(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _jit_forward(model, images, **kwargs):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, **kwargs))(state, images)


def _config_for(pe, **overrides):
    """A tiny config for ``pe``; 1D RoPE needs 1D inputs."""
    config = dict(TINY, pe=pe, pe_hparams=HPARAMS.get(pe), head_zero_init=False)
    if pe == "rope":
        config.update(image_shape=(24,), variant="pico/4")
    return {**config, **overrides}


# Every family alone through the ViT: tests/models/test_tokens.py (each family's logits at six
# grids, equal to the padded and the packed batch's) and test_bfloat16.py (float32 logits of
# every family); here every additive table beside a rotary family, the dtype and the shape.
@pytest.mark.parametrize("additive", ["none", "ape", "sincos"])
def test_forward_2d_with_every_additive_table(additive):
    config = _config_for("liere", additive=additive)
    model = ViT(**config, rngs=nnx.Rngs(0))
    shape = (2, *config["image_shape"], 3)
    logits = model(_images(shape))
    chex.assert_shape(logits, (2, 5))
    assert logits.dtype == jnp.float32
    chex.assert_tree_all_finite(logits)


def test_visionllama_variant_reaches_the_attention():
    """pe_hparams=dict(variant="liere") is applied in every layer, not only checked at init."""
    images = _images((2, *TINY["image_shape"], 3))
    logits = {
        variant: ViT(
            **_config_for("visionllama", pe_hparams=dict(variant=variant)), rngs=nnx.Rngs(0)
        )(images)
        for variant in ("visionllama", "liere")
    }
    assert not np.allclose(logits["visionllama"], logits["liere"], atol=1e-4)


def test_rope_is_1d_and_says_so_in_2d():
    with pytest.raises(ValueError, match="rope_axial"):
        ViT(**TINY, pe="rope", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("pe", ["liere", "rope_mixed", "cayley_string", "alibi", "comrope"])
def test_forward_3d_tubelets(pe):
    model = ViT(**TINY_3D, pe=pe, pe_hparams=HPARAMS.get(pe), additive="ape", rngs=nnx.Rngs(0))
    assert model.train_grid == (2, 2, 2)
    logits = model(_images((2, 4, 8, 8, 2)))
    chex.assert_shape(logits, (2, 3))
    chex.assert_tree_all_finite(logits)


@pytest.mark.parametrize("convention", ["integer", "sequential", "normalized", "autoscale"])
def test_larger_resolution_recomputes_positions_and_resizes_ape(convention):
    model = ViT(
        **TINY,
        pe="rope_mixed",
        additive="ape",
        position_convention=convention,
        head_zero_init=False,
        rngs=nnx.Rngs(0),
    )
    big = _images((2, 16, 20, 3))
    chex.assert_tree_all_finite(model(big))
    grid = model.input_grid(big)
    assert grid == (4, 5) and model.train_grid == (2, 3)
    # The APE table at the new grid is the resized one, added once to every token.
    tokens = model.embed_tokens(big, grid)
    no_ape = ViT(**TINY, pe="rope_mixed", head_zero_init=False, rngs=nnx.Rngs(0))
    params = {k: v[...] for k, v in model.additive_params.items()}
    table = encodings.ADDITIVE["ape"].table(params, grid_shape=(4, 5), num_prefix=1)
    chex.assert_shape(table, (1 + 20, 32))
    added = tokens - no_ape.embed_tokens(big, grid)
    np.testing.assert_allclose(added, np.broadcast_to(table, added.shape), atol=1e-5)


def test_shared_layer_params_live_in_the_vit():
    model = ViT(**TINY, pe="rope_mixed", share_pe_layers=True, rngs=nnx.Rngs(0))
    paths = [p for p, _ in nnx.to_flat_state(nnx.state(model, PositionParam))]
    assert paths == [("pe_params", "freqs_ANF")]
    model = ViT(**TINY, pe="rope_mixed", additive="ape", rngs=nnx.Rngs(0))
    paths = {p[0] for p, _ in nnx.to_flat_state(nnx.state(model, PositionParam))}
    assert paths == {"blocks", "additive_params"}


def test_zero_init_head_gives_zero_logits():
    model = ViT(**TINY, pe="rope_mixed", additive="ape", rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(model(_images((2, 8, 12, 3))), np.zeros((2, 5)))
    model = ViT(**TINY, pe="rope_mixed", head_zero_init=False, rngs=nnx.Rngs(0))
    assert np.max(np.abs(model(_images((2, 8, 12, 3))))) > 1e-3


def _shuffle_patches(images_BHWC, patch, perm):
    """Move patch i of the row-major patch grid to position perm[i]."""
    b, h, w, c = images_BHWC.shape
    gh, gw = h // patch, w // patch
    x = images_BHWC.reshape(b, gh, patch, gw, patch, c).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(b, gh * gw, patch, patch, c)[:, perm]
    return x.reshape(b, gh, gw, patch, patch, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


@pytest.mark.parametrize(
    "pe, additive, invariant",
    [
        ("nope", "none", True),
        ("rope_axial", "none", False),
        ("nope", "sincos", False),
    ],
)
def test_permutation_of_patches(pe, additive, invariant):
    model = ViT(
        **TINY, pe=pe, additive=additive, pool="mean", head_zero_init=False, rngs=nnx.Rngs(0)
    )
    images = _images((2, 8, 12, 3))
    perm = np.random.default_rng(0).permutation(6)
    shuffled = _shuffle_patches(images, 4, perm)
    assert not np.allclose(shuffled, images)
    logits, logits_shuffled = model(images), model(shuffled)
    if invariant:
        np.testing.assert_allclose(logits_shuffled, logits, rtol=1e-5, atol=1e-5)
    else:
        assert np.max(np.abs(logits_shuffled - logits)) > 1e-4


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_alibi_2d_sees_distances_only_the_grid_symmetries_leave_logits_unchanged(pool):
    """2D ALiBi's bias depends on |p_t - p_s| alone, so moving whole patches by a symmetry of
    the square grid (turned or mirrored, patch contents untouched) changes nothing: the
    distance-only ceiling of the arrows studies (`experiments.studies.stats`) rests on it."""
    config = dict(TINY, image_shape=(12, 12), pe="alibi", pool=pool, head_zero_init=False)
    model = ViT(**config, rngs=nnx.Rngs(0))
    images = _images((2, 12, 12, 3))
    cells = np.arange(9).reshape(3, 3)
    for moved in (np.rot90(cells), cells.T, cells[:, ::-1]):
        perm = moved.reshape(-1)  # a symmetry of the 3x3 patch grid, as a permutation
        turned = _shuffle_patches(images, 4, perm)
        assert not np.allclose(turned, images)
        np.testing.assert_allclose(model(turned), model(images), rtol=1e-5, atol=1e-5)
    broken = _shuffle_patches(images, 4, np.array([1, 0, 2, 3, 4, 5, 6, 7, 8]))  # not an isometry
    assert np.max(np.abs(model(broken) - model(images))) > 1e-4


def test_jit_split_merge_with_dropout():
    model = ViT(
        **TINY,
        pe="liere",
        pe_hparams={"block_size": 4},
        dropout=0.2,
        head_zero_init=False,
        rngs=nnx.Rngs(params=0, dropout=1),
    )
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, images):
        model = nnx.merge(graphdef, state)
        logits = model(images, train=True)
        return logits, nnx.state(model)

    images = _images((2, 8, 12, 3))
    logits1, state = forward(state, images)
    logits2, state = forward(state, images)
    chex.assert_tree_all_finite((logits1, logits2))
    assert np.max(np.abs(logits1 - logits2)) > 1e-4  # the dropout stream advanced
    eval_jit = _jit_forward(nnx.merge(graphdef, state), images)
    np.testing.assert_allclose(eval_jit, model(images), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model(images), model(images))  # no dropout at eval


def test_bfloat16_activations():
    model = ViT(
        **TINY,
        pe="rope_mixed",
        additive="ape",
        dtype="bfloat16",
        head_zero_init=False,
        rngs=nnx.Rngs(0),
    )
    logits = _jit_forward(model, _images((2, 8, 12, 3)))
    assert logits.dtype == jnp.float32
    chex.assert_tree_all_finite(logits)
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pe="bogus"), r"unknown pe='bogus'.*liere"),
        (dict(additive="learned"), r"unknown additive='learned'.*ape"),
        (dict(pool="max"), r"unknown pool='max'.*cls"),
        (dict(variant="XL/4"), r"unknown variant='XL/4'.*Ti"),
        (
            dict(image_shape=(8, 10)),
            r"image_shape=\(8, 10\) is not divisible by patch_size=\(4, 4\)",
        ),
        (dict(pe="liere", pe_hparams={"block_size": 32}), "block_size=32"),
        (dict(position_convention="log"), "unknown position_convention='log'"),
        (dict(dtype="int8"), "unknown dtype='int8'"),
        (dict(variant="pico/4", patch_size=8), "disagree"),
        (dict(variant="pico"), "patch_size is None"),
        (dict(position_hparams={"temporal_spacing": 2.0}), "'integer' does not take"),
        (
            dict(position_convention="diagonal", position_hparams={"temporal_spacing": -1.0}),
            r"temporal_spacing=-1.0 must be a positive",
        ),
        (
            dict(
                pe="rope_axial", pe_hparams={"temporal_scale": 2.0}, position_convention="diagonal"
            ),
            "temporal_scale=2.0 with position_convention='diagonal'",
        ),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ViT(**{**TINY, **kwargs}, rngs=nnx.Rngs(0))


def test_call_errors():
    model = ViT(**TINY, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\(B, H, W, C\) with C=3.*got shape \(8, 12, 3\)"):
        model(jnp.zeros((8, 12, 3)))
    with pytest.raises(ValueError, match="with C=3"):
        model(jnp.zeros((2, 8, 12, 1)))
    with pytest.raises(ValueError, match=r"images spatial shape=\(8, 10\) is not divisible"):
        model(jnp.zeros((2, 8, 10, 3)))


def test_patchify_matches_convolution_layout():
    images = _images((2, 4, 6, 3))
    patches = tokens.patchify(images, (2, 3))
    chex.assert_shape(patches, (2, 4, 18))
    # Token 3 is grid cell (1, 1): rows 2-3, columns 3-5, flattened (row, col, channel).
    np.testing.assert_array_equal(patches[:, 3], images[:, 2:4, 3:6].reshape(2, 18))


@pytest.mark.parametrize("shape, patch", [((2, 4, 6, 3), (2, 3)), ((1, 4, 2, 6, 2), (2, 1, 3))])
def test_patch_blocks_puts_each_patch_on_the_trailing_axes_and_inverts(shape, patch):
    images = np.arange(math.prod(shape)).reshape(shape)  # numpy: the host path of evaluate
    blocks = tokens.patch_blocks(images, patch)
    grid = tuple(s // p for s, p in zip(shape[1:-1], patch, strict=True))
    assert blocks.shape == (shape[0], *grid, *patch, shape[-1])
    last = tuple(slice((g - 1) * p, g * p) for g, p in zip(grid, patch, strict=True))
    np.testing.assert_array_equal(
        blocks[(slice(None), *(g - 1 for g in grid))], images[(slice(None), *last)]
    )
    np.testing.assert_array_equal(tokens.unpatch_blocks(blocks, patch), images)


@pytest.mark.parametrize(
    "pe, hparams, share_heads, share_layers",
    [
        ("liere", None, False, False),
        ("liere", None, True, True),
        ("liere", {"block_size": 4}, False, False),
        ("liere", {"block_size": 2}, True, False),
        ("cayley_string", {"init_std": 0.3}, False, True),
        ("rope_mixed", None, False, False),
        ("alibi", {"learnable": True}, False, False),
    ],
)
def test_cached_encoder_states_give_the_same_logits(pe, hparams, share_heads, share_layers):
    model = ViT(
        **TINY,
        pe=pe,
        pe_hparams=hparams,
        share_pe_heads=share_heads,
        share_pe_layers=share_layers,
        position_convention="sequential",
        head_zero_init=False,
        rngs=nnx.Rngs(0),
    )
    graphdef, state = nnx.split(model)
    precompute = jax.jit(
        lambda s, grid: nnx.merge(graphdef, s).precompute_pe(grid), static_argnums=1
    )

    @jax.jit
    def cached_and_uncached(s, x, cache):  # one program per grid, the cache its argument
        model = nnx.merge(graphdef, s)
        return model(x, pe_cache=cache), model(x)

    for shape in [(2, 8, 12, 3), (3, 12, 16, 3)]:  # training grid (2, 3), then (3, 4)
        images = _images(shape, seed=shape[0])
        cache = precompute(state, model.input_grid(images))
        cached, uncached = cached_and_uncached(state, images, cache)
        np.testing.assert_allclose(cached, uncached, rtol=1e-6, atol=1e-6)
        assert np.max(np.abs(uncached)) > 1e-3
    with pytest.raises(ValueError, match="pe_cache has 1 block states"):
        model(images, pe_cache=cache[:1])


@pytest.mark.parametrize("pe", ["liere", "rope_mixed", "alibi"])
def test_a_cache_for_another_grid_is_refused(pe):
    """A (2, 3) grid's states have a (3, 2) grid's shapes; used for (3, 2) images they would
    give other logits silently. The cache carries its grid, and the model refuses it, also
    inside ``jit`` (the grid is static) and through ``features``."""
    model = ViT(
        **TINY, pe=pe, position_convention="sequential", head_zero_init=False, rngs=nnx.Rngs(0)
    )
    wide, tall = _images((2, 8, 12, 3), seed=0), _images((2, 12, 8, 3), seed=1)
    cache = model.precompute_pe(model.input_grid(wide))
    assert cache.grid == (2, 3) and len(cache) == len(model.blocks)
    np.testing.assert_allclose(model(wide, pe_cache=cache), model(wide), rtol=1e-6, atol=1e-6)
    message = r"computed for the token grid \(2, 3\), the images make \(3, 2\)"
    with pytest.raises(ValueError, match=message):
        model(tall, pe_cache=cache)
    with pytest.raises(ValueError, match=message):
        nnx.jit(lambda m, x, c: m(x, pe_cache=c))(model, tall, cache)
    with pytest.raises(ValueError, match=message):
        model.features(tall, pe_cache=cache)
    states = list(cache)  # a plain list of states: the user's own positions, unchecked
    assert np.max(np.abs(model(tall, pe_cache=states) - model(tall))) > 1e-3


@pytest.mark.parametrize("share_heads", [False, True])
@pytest.mark.parametrize("share_layers, calls", [(False, 2), (True, 1)])
def test_shared_generators_share_the_exponential(monkeypatch, share_heads, share_layers, calls):
    shapes = []
    precompute = encodings.ROTARY["liere"].precompute

    def counting(params, pos, **context):
        out = precompute(params, pos, **context)
        shapes.append(out.r_TNKbb.shape)
        return out

    monkeypatch.setattr(encodings.ROTARY["liere"], "precompute", counting)
    model = ViT(
        **TINY,
        pe="liere",
        share_pe_heads=share_heads,
        share_pe_layers=share_layers,
        head_zero_init=False,
        rngs=nnx.Rngs(0),
    )
    chex.assert_tree_all_finite(_jit_forward(model, _images((2, 8, 12, 3))))
    # Once per forward pass for all layers sharing generators (depth 2 otherwise), and for one
    # head when the heads share them: 7 tokens, dense 16 x 16 generators.
    assert shapes == [(7, 1 if share_heads else 2, 1, 16, 16)] * calls


@pytest.mark.parametrize("generator", ["dense", "block2x2"])
def test_cayley_string_fold_through_the_vit(generator):
    hparams = {"generator": generator, "init_std": 0.3}
    model = ViT(
        **TINY, pe="cayley_string", pe_hparams=hparams, head_zero_init=False, rngs=nnx.Rngs(0)
    )
    images = _images((2, 8, 12, 3))
    expected = model(images)
    for block in model.blocks:
        attn, pe = block.attn, block.attn.pe_params
        params = {name: value[...] for name, value in pe.items()}
        p_NHH = encodings.ROTARY["cayley_string"].orthogonal(params)
        for w, b in (("wq_DNH", "bq_NH"), ("wk_DNH", "bk_NH")):
            getattr(attn, w)[...] = encodings.ROTARY["cayley_string"].fold(
                params, getattr(attn, w)[...]
            )
            getattr(attn, b)[...] = jnp.einsum("nij,nj->ni", p_NHH, getattr(attn, b)[...])
        key = next(name for name in pe if name.startswith("s_"))
        pe[key][...] = jnp.zeros_like(pe[key][...])  # P = I: only RoPE-Mixed is left
    np.testing.assert_allclose(model(images), expected, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(expected)) > 1e-3


@pytest.mark.parametrize("generator", ["dense", "topk"])
def test_cayley_string_p_per_token_equals_folded(generator):
    """fold_mix=False applies P to every token's q and k (the reference's way): the same
    logits and the same gradients as folding it into the projections; the states differ."""
    hparams = {"generator": generator, "init_std": 0.3}
    hparams.update({"k": 12} if generator == "topk" else {})
    images = _images((2, 8, 12, 3))
    labels = jnp.asarray([1, 3])
    out = {}
    for fold in (True, False):
        model = ViT(
            **TINY,
            pe="cayley_string",
            pe_hparams=hparams,
            head_zero_init=False,
            fold_mix=fold,
            rngs=nnx.Rngs(0),
        )
        state = model.blocks[0].attn.pe_state(model.positions(model.train_grid))
        assert (state.fold_NHH is not None) == fold
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p, graphdef=graphdef, rest=rest):
            logits = nnx.merge(graphdef, p, rest)(images)
            return jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(2), labels]), logits

        out[fold] = jax.jit(jax.grad(loss, has_aux=True))(params)
    (g_fold, logits_fold), (g_token, logits_token) = out[True], out[False]
    np.testing.assert_allclose(logits_token, logits_fold, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(logits_fold)) > 1e-3
    flat_fold, flat_token = (jax.tree.leaves(nnx.to_pure_dict(g)) for g in (g_fold, g_token))
    for a, b in zip(flat_fold, flat_token, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    s_grad = g_token["blocks"][0]["attn"]["pe_params"]
    assert max(float(jnp.abs(v[...]).max()) for v in s_grad.values()) > 1e-6  # S is trained


@pytest.mark.parametrize("pe", ["liere", "alibi", "cayley_string"])
def test_attention_maps_are_the_weights_the_model_uses(pe):
    """Rows sum to 1; weighting the values with a layer's map and projecting gives that
    layer's attention output (rotations, ALiBi's bias and Cayley's folded P included)."""
    model = ViT(**_config_for(pe), rngs=nnx.Rngs(0))
    images = _images((2, *TINY["image_shape"], 3))
    maps = model.attention_maps(images)
    depth, heads, tokens = len(model.blocks), model.blocks[0].attn.num_heads, 1 + 2 * 3
    chex.assert_shape(maps, (depth, 2, heads, tokens, tokens))
    np.testing.assert_allclose(maps.sum(-1), 1.0, rtol=1e-5)
    grid = model.input_grid(images)
    attn, state = model.blocks[0].attn, model.precompute_pe(grid)[0]
    x_BTD = model.blocks[0].ln1(model.embed_tokens(images, grid))
    _, _, v_BTNH, _ = attn.qkv(x_BTD, None, pe_state=state)
    o_BTNH = jnp.einsum("BNTS,BSNH->BTNH", maps[0], v_BTNH)
    y_BTD = jnp.einsum("BTNH,NHD->BTD", o_BTNH, attn.wo_NHD[...]) + attn.bo_D[...][None, None]
    np.testing.assert_allclose(y_BTD, attn(x_BTD, None, pe_state=state), rtol=1e-5, atol=1e-5)


def _features(model, images):
    """What enters the classifier: the head made the identity."""
    width = model.head.in_features
    model.head = nnx.Linear(width, width, rngs=nnx.Rngs(0))
    model.head.kernel[...], model.head.bias[...] = jnp.eye(width), jnp.zeros(width)
    return model(images)


@pytest.mark.parametrize("pool", ["cls", "mean"])
@pytest.mark.parametrize("pe", _families())
def test_registers_sit_with_the_class_token_for_every_family(pe, pool):
    """Registers are prefix tokens at position 0 like the class token (R(0) for every rotary
    family, no ALiBi bias) and are not pooled: swapping two of them changes no logit, which
    fails if a register got a grid position or its own rotation. Changing one changes the
    logits: they are in the sequence."""
    model = ViT(**_config_for(pe, pool=pool, num_registers=3), rngs=nnx.Rngs(0))
    assert model.num_prefix == 3 + (pool == "cls")
    images = _images((2, *model.image_shape, 3))
    np.testing.assert_array_equal(model.positions(model.input_grid(images))[: model.num_prefix], 0)
    logits = model(images)
    reg_RD = model.reg_RD[...]
    model.reg_RD[...] = reg_RD[jnp.array([2, 1, 0])]
    np.testing.assert_allclose(model(images), logits, rtol=1e-5, atol=1e-5)
    model.reg_RD[...] = reg_RD.at[0].set(jnp.linspace(-3.0, 3.0, reg_RD.shape[1]))
    assert np.max(np.abs(model(images) - logits)) > 1e-3


def test_registers_are_one_parameter_drawn_after_the_others():
    """num_registers=0 (the default) has none; with R registers every other parameter is the
    model's without them, bit for bit, and the registers are N(0, 0.02), distinct. An APE table
    gives them their own rows after the class token's."""
    plain = ViT(**TINY, pe="rope_mixed", rngs=nnx.Rngs(0))
    assert plain.reg_RD is None and plain.num_prefix == 1
    with_reg = ViT(**TINY, pe="rope_mixed", num_registers=4, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(with_reg, nnx.Param))
    reg_RD = np.asarray(params.pop("reg_RD"))
    assert reg_RD.shape == (4, 32) and 0.01 < reg_RD.std() < 0.03
    assert len({row.tobytes() for row in reg_RD}) == 4
    chex.assert_trees_all_equal(params, nnx.to_pure_dict(nnx.state(plain, nnx.Param)))
    with_ape = ViT(**TINY, additive="ape", num_registers=4, rngs=nnx.Rngs(0))
    chex.assert_shape(with_ape.additive_params["prefix_PD"][...], (5, 32))


def test_mean_pool_averages_the_patch_tokens_not_the_registers():
    """pool="mean" with registers: the final norm's patch rows averaged (timm's "avg" over the
    tokens after the prefix), computed here from the blocks themselves."""
    model = ViT(**_config_for("rope_axial", pool="mean", num_registers=2), rngs=nnx.Rngs(0))
    images = _images((2, *TINY["image_shape"], 3))
    grid = model.input_grid(images)
    x_BTD = model.embed_tokens(images, grid)
    assert x_BTD.shape[1] == 2 + 6
    for block, state in zip(model.blocks, model.precompute_pe(grid), strict=True):
        x_BTD = block(x_BTD, state, train=False)
    x_BTD = model.norm(x_BTD)
    features = _features(model, images)
    np.testing.assert_allclose(features, x_BTD[:, 2:].mean(axis=1), rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(features - x_BTD.mean(axis=1))) > 1e-4


@pytest.mark.parametrize("final_norm, fc_norm", [(True, False), (False, True)])
def test_mean_with_cls_pools_the_patch_tokens_beside_an_unpooled_class_token(final_norm, fc_norm):
    """pool="mean_with_cls" (timm's "avg" with a class token): the class token and registers
    are in the sequence, the mean of the patch rows is pooled, computed here from the blocks;
    final_norm=False with fc_norm=True (timm's Identity norm and its fc_norm) puts the
    LayerNorm on the pooled feature instead of on every token."""
    config = _config_for("rope_axial", pool="mean_with_cls", num_registers=2)
    model = ViT(**config, final_norm=final_norm, fc_norm=fc_norm, rngs=nnx.Rngs(0))
    assert model.num_prefix == 3 and model.cls_1D is not None
    assert (model.norm is not None, model.fc_norm is not None) == (final_norm, fc_norm)
    images = _images((2, *TINY["image_shape"], 3))
    grid = model.input_grid(images)
    x_BTD = model.embed_tokens(images, grid)
    for block, state in zip(model.blocks, model.precompute_pe(grid), strict=True):
        x_BTD = block(x_BTD, state, train=False)
    x_BTD = model.norm(x_BTD) if final_norm else x_BTD
    pooled_BD = x_BTD[:, 3:].mean(axis=1)
    pooled_BD = model.fc_norm(pooled_BD) if fc_norm else pooled_BD
    logits = model(images)
    np.testing.assert_allclose(logits, model.head(pooled_BD), rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(logits - model.head(x_BTD[:, 0]))) > 1e-3  # not the class token's
    model.cls_1D[...] = jnp.linspace(-3.0, 3.0, model.cls_1D.shape[1])[None]
    assert np.max(np.abs(model(images) - logits)) > 1e-3  # but it is in the sequence


def _param_shapes(model: ViT) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {jax.tree_util.keystr(path): tuple(v.shape) for path, v in leaves}


def test_the_pooling_head_options_change_only_their_own_parameters():
    """The defaults keep the parameters every existing checkpoint has (a final "norm", no
    "fc_norm"); pool="mean_with_cls" has the same ones (the class token included), and timm's
    avg head drops "norm" for "fc_norm" of the same shapes."""
    default = _param_shapes(ViT(**TINY, rngs=nnx.Rngs(0)))
    assert default["['norm']['scale']"] == (32,) and "['cls_1D']" in default
    assert not any("fc_norm" in name for name in default)
    with_cls = _param_shapes(ViT(**TINY, pool="mean_with_cls", rngs=nnx.Rngs(0)))
    assert with_cls == default
    timm_avg = ViT(**TINY, pool="mean_with_cls", final_norm=False, fc_norm=True, rngs=nnx.Rngs(0))
    renamed = {
        name.replace("fc_norm", "norm"): shape for name, shape in _param_shapes(timm_avg).items()
    }
    assert renamed == default


@pytest.mark.parametrize("name", ["final_norm", "fc_norm"])
def test_the_norm_switches_must_be_booleans(name):
    with pytest.raises(ValueError, match=f"{name}=1 must be True or False"):
        ViT(**TINY, **{name: 1}, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_register_count_errors_name_the_value(value):
    with pytest.raises(ValueError, match=f"num_registers={value!r} must be a non-negative int"):
        ViT(**TINY, num_registers=value, rngs=nnx.Rngs(0))
