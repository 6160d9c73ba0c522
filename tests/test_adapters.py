"""rope_lie/adapters.py: every family inside Flax's own attention modules, in minimal ViTs
written here (not rope_lie's), equal to rope_lie's attention on the same weights."""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie import adapters, encodings
from rope_lie.models.attention import Attention

WIDTH, HEADS, GRID, PREFIX = 24, 2, (3, 4), 1
HEAD_DIM = WIDTH // HEADS
FAMILIES = sorted(n for n, f in encodings.families().items() if 2 in f.examples[0][1])  # 2D
SETTINGS = {name: dict(f.examples[0][0]) for name, f in encodings.families().items()}


def _rope_lie_attention(name, share_heads=False):
    attn = Attention(
        WIDTH,
        HEADS,
        num_axes=len(GRID),
        pe=name,
        pe_hparams=SETTINGS[name],
        share_pe_heads=share_heads,
        num_prefix=PREFIX,
        rngs=nnx.Rngs(0),
    )
    rng = np.random.default_rng(1)
    for b in (attn.bq_NH, attn.bk_NH, attn.bv_NH, attn.bo_D):  # non-zero biases
        b[...] = jnp.asarray(rng.normal(size=b[...].shape), jnp.float32)
    return attn


def _weights(attn):
    return {
        n: np.asarray(getattr(attn, n)[...])
        for n in ("wq_DNH", "wk_DNH", "wv_DNH", "wo_NHD", "bq_NH", "bk_NH", "bv_NH", "bo_D")
    }


def _tokens(attn, seed=2):
    x_BTD = jax.random.normal(jax.random.key(seed), (2, PREFIX + np.prod(GRID), WIDTH))
    pos_TA = encodings.positions.grid_positions(GRID, attn.encoder.convention, num_prefix=PREFIX)
    return x_BTD, attn(x_BTD, pos_TA)


@pytest.mark.parametrize("share_heads", [False, True])
@pytest.mark.parametrize("name", FAMILIES)
def test_nnx_multi_head_attention_with_the_adapter_equals_rope_lies(name, share_heads):
    attn = _rope_lie_attention(name, share_heads)
    x_BTD, want = _tokens(attn)
    rngs = nnx.Rngs(0)
    mha = nnx.MultiHeadAttention(
        num_heads=HEADS,
        in_features=WIDTH,
        decode=False,
        rngs=rngs,
        attention_fn=adapters.NNXAttention(
            name,
            num_heads=HEADS,
            head_dim=HEAD_DIM,
            grid=GRID,
            num_prefix=PREFIX,
            share_heads=share_heads,
            rngs=rngs,
            **SETTINGS[name],
        ),
    )
    w = _weights(attn)
    for layer, kernel, bias in (
        (mha.query, "wq_DNH", "bq_NH"),
        (mha.key, "wk_DNH", "bk_NH"),
        (mha.value, "wv_DNH", "bv_NH"),
        (mha.out, "wo_NHD", "bo_D"),
    ):
        layer.kernel[...], layer.bias[...] = w[kernel], w[bias]
    for k, v in attn.pe_params.items():
        mha.attention_fn.params[k][...] = v[...]
    np.testing.assert_allclose(mha(x_BTD), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_linen_attention_with_the_adapter_equals_rope_lies(name):
    attn = _rope_lie_attention(name)
    x_BTD, want = _tokens(attn)
    mha = nn.MultiHeadDotProductAttention(
        num_heads=HEADS,
        attention_fn=adapters.LinenAttention(
            name,
            num_heads=HEADS,
            head_dim=HEAD_DIM,
            grid=GRID,
            num_prefix=PREFIX,
            settings=SETTINGS[name],
        ),
    )
    variables = mha.init(jax.random.key(0), x_BTD)
    w = _weights(attn)
    params = dict(variables["params"])
    for layer, kernel, bias in (
        ("query", "wq_DNH", "bq_NH"),
        ("key", "wk_DNH", "bk_NH"),
        ("value", "wv_DNH", "bv_NH"),
        ("out", "wo_NHD", "bo_D"),
    ):
        assert params[layer]["kernel"].shape == w[kernel].shape
        params[layer] = {"kernel": w[kernel], "bias": w[bias]}
    assert set(params["attention_fn"]["pe"]) == set(attn.pe_params)
    params["attention_fn"] = {"pe": {k: v[...] for k, v in attn.pe_params.items()}}
    np.testing.assert_allclose(mha.apply({"params": params}, x_BTD), want, rtol=2e-5, atol=2e-5)


# Two minimal ViTs of someone else's: patches, a class token, pre-norm blocks of Flax's own
# attention and an MLP, a head. The lines marked "glue" are all rope_lie adds.
PATCH, IMAGE = 4, (12, 16)


class NNXViT(nnx.Module):
    def __init__(self, pe: str, settings: dict, *, rngs: nnx.Rngs, depth: int = 2):
        grid = (IMAGE[0] // PATCH, IMAGE[1] // PATCH)
        glue = dict(num_heads=HEADS, head_dim=HEAD_DIM, grid=grid, num_prefix=1)  # glue
        self.embed = nnx.Linear(PATCH * PATCH * 3, WIDTH, rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((1, 1, WIDTH)))
        self.norms = nnx.List(nnx.LayerNorm(WIDTH, rngs=rngs) for _ in range(2 * depth))
        self.mlps = nnx.List(nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(depth))
        self.attns = nnx.List(
            nnx.MultiHeadAttention(
                num_heads=HEADS,
                in_features=WIDTH,
                decode=False,
                rngs=rngs,
                attention_fn=adapters.NNXAttention(pe, rngs=rngs, **glue, **settings),  # glue
            )
            for _ in range(depth)
        )
        self.head = nnx.Linear(WIDTH, 5, rngs=rngs)

    def __call__(self, images_BHWC):
        b, h, w, c = images_BHWC.shape
        patches = images_BHWC.reshape(b, h // PATCH, PATCH, w // PATCH, PATCH, c)
        patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, PATCH * PATCH * c)
        x = jnp.concatenate(
            [jnp.broadcast_to(self.cls[...], (b, 1, WIDTH)), self.embed(patches)], axis=1
        )
        for i, (attn, mlp) in enumerate(zip(self.attns, self.mlps, strict=True)):
            x = x + attn(self.norms[2 * i](x))
            x = x + mlp(jax.nn.gelu(self.norms[2 * i + 1](x)))
        return self.head(x[:, 0])


class LinenViT(nn.Module):
    pe: str
    settings: dict
    depth: int = 2

    @nn.compact
    def __call__(self, images_BHWC):
        b, h, w, c = images_BHWC.shape
        grid = (h // PATCH, w // PATCH)
        glue = dict(num_heads=HEADS, head_dim=HEAD_DIM, grid=grid, num_prefix=1)  # glue
        patches = images_BHWC.reshape(b, h // PATCH, PATCH, w // PATCH, PATCH, c)
        patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, PATCH * PATCH * c)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, WIDTH))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, WIDTH)), nn.Dense(WIDTH)(patches)], 1)
        for _ in range(self.depth):
            pe_fn = adapters.LinenAttention(self.pe, settings=self.settings, **glue)  # glue
            attn = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=pe_fn)  # glue
            x = x + attn(nn.LayerNorm()(x))
            x = x + nn.Dense(WIDTH)(nn.gelu(nn.LayerNorm()(x)))
        return nn.Dense(5)(x[:, 0])


def test_the_glue_is_at_most_three_lines_per_model():
    source = pathlib.Path(__file__).read_text()
    for model in ("class NNXViT", "class LinenViT"):
        body = source.split(model)[1].split("\nclass ")[0].split("\ndef ")[0]
        assert 1 <= body.count("# glue") <= 3, model


@pytest.mark.parametrize("name", FAMILIES)
def test_a_foreign_nnx_vit_trains_with_every_family(name):
    model = NNXViT(name, SETTINGS[name], rngs=nnx.Rngs(0))
    images = jax.random.normal(jax.random.key(1), (2, *IMAGE, 3))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return jnp.mean(nnx.merge(graphdef, p, rest)(images) ** 2)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert np.isfinite(float(value))
    pe_grads = [
        g
        for path, g in jax.tree_util.tree_leaves_with_path(grads)
        if "attention_fn" in jax.tree_util.keystr(path)
    ]
    assert len(pe_grads) == 2 * len(
        adapters.NNXAttention(
            name,
            num_heads=HEADS,
            head_dim=HEAD_DIM,
            grid=(3, 4),
            rngs=nnx.Rngs(0),
            **SETTINGS[name],
        ).params
    )
    assert all(np.isfinite(g).all() for g in pe_grads)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_foreign_linen_vit_trains_with_every_family(name):
    model = LinenViT(name, SETTINGS[name])
    images = jax.random.normal(jax.random.key(1), (2, *IMAGE, 3))
    variables = model.init(jax.random.key(0), images)

    def loss(p):
        return jnp.mean(model.apply({"params": p}, images) ** 2)

    value, grads = jax.jit(jax.value_and_grad(loss))(variables["params"])
    assert np.isfinite(float(value))
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    pe = [
        k
        for k in jax.tree_util.tree_leaves_with_path(grads)
        if "'pe'" in jax.tree_util.keystr(k[0])
    ]
    assert len(pe) == 2 * len(
        encodings.encoder(
            name, num_heads=HEADS, head_dim=HEAD_DIM, num_axes=2, **SETTINGS[name]
        ).init(jax.random.key(0))
    )


def test_1d_rope_from_positions_equals_rope_lies():
    attn = Attention(WIDTH, HEADS, num_axes=1, pe="rope", num_prefix=0, rngs=nnx.Rngs(0))
    x_BTD = jax.random.normal(jax.random.key(2), (2, 7, WIDTH))
    pos_TA = jnp.arange(7.0)[:, None]
    fn = adapters.NNXAttention(
        "rope", num_heads=HEADS, head_dim=HEAD_DIM, positions=pos_TA, rngs=nnx.Rngs(0)
    )
    mha = nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=WIDTH, decode=False, attention_fn=fn, rngs=nnx.Rngs(0)
    )
    w = _weights(attn)
    for layer, kernel, bias in (
        (mha.query, "wq_DNH", "bq_NH"),
        (mha.key, "wk_DNH", "bk_NH"),
        (mha.value, "wv_DNH", "bv_NH"),
        (mha.out, "wo_NHD", "bo_D"),
    ):
        layer.kernel[...], layer.bias[...] = w[kernel], w[bias]
    np.testing.assert_allclose(mha(x_BTD), attn(x_BTD, pos_TA), rtol=2e-5, atol=2e-5)


def test_the_grid_or_the_positions_one_of_them():
    with pytest.raises(ValueError, match="give the token grid or the positions"):
        adapters.NNXAttention("rope_mixed", num_heads=HEADS, head_dim=HEAD_DIM, rngs=nnx.Rngs(0))
    fn = adapters.NNXAttention(
        "rope_mixed",
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        grid=GRID,
        num_prefix=PREFIX,
        rngs=nnx.Rngs(0),
    )
    q = jnp.zeros((1, 7, HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match=r"positions have T=13 tokens, but the queries have shape"):
        fn(q, q, q)


def test_weight_decay_leaves_the_nnx_adapters_position_parameters_alone():
    """rope_lie.optim decays plain Params of 2+ dims: the adapter's generators are
    PositionParams, as in rope_lie's own ViT, so a foreign model trained with its mask does not
    pull LieRE's rotations towards the identity."""
    from flax.nnx import traversals

    from rope_lie import optim
    from rope_lie.models.position_hook import PositionParam

    model = NNXViT("liere", SETTINGS["liere"], rngs=nnx.Rngs(0))
    flat = traversals.flatten_mapping(optim.decay_mask(nnx.state(model, nnx.Param)))
    decayed = {"/".join(map(str, path)) for path, decay in flat.items() if decay}
    pe = [p for p, _ in nnx.to_flat_state(nnx.state(model, PositionParam))]
    assert pe and all("attention_fn" in map(str, p) for p in pe)
    assert not [d for d in decayed if "attention_fn" in d], decayed
    assert any("kernel" in d for d in decayed)  # the projections still are
