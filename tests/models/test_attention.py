"""Tests for rope_lie.models.attention: the position-encoding hook against a numpy reference."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie import encodings
from rope_lie.models import attention, backends, xla_attention
from rope_lie.models.attention import Attention
from rope_lie.models.position_hook import PositionParam
from rope_lie.models.vit import ViT

WIDTH, HEADS, AXES, BATCH, TOKENS = 24, 2, 2, 2, 7
HEAD_DIM = WIDTH // HEADS
# Families whose rotation is non-trivial at generic 2D positions, with hparams valid at H = 12.
# The rotary families that turn 2D positions, each at its first example (its FAMILY): LieRE
# with 4x4 blocks, Cayley-STRING with S != 0 (P is not the identity), ComRoPE folding its
# eigenbases P into the projections, ...
ROTATING = {
    name: dict(module.FAMILY.examples[0][0])
    for name, module in encodings.ROTARY.items()
    if name != "nope" and AXES in module.FAMILY.examples[0][1]
}


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    x_BTD = rng.normal(size=(BATCH, TOKENS, WIDTH)).astype(np.float32)
    pos_TA = rng.uniform(-2.0, 3.0, size=(TOKENS, AXES)).astype(np.float32)
    pos_TA[0] = 0.0  # a prefix token
    return jnp.asarray(x_BTD), jnp.asarray(pos_TA)


def _randomize_biases(attn: Attention, seed: int = 1) -> None:
    """Non-zero biases so that the reference checks them too."""
    rng = np.random.default_rng(seed)
    for name in ("bq_NH", "bk_NH", "bv_NH", "bo_D"):
        var = getattr(attn, name)
        var[...] = jnp.asarray(rng.normal(size=var.shape), jnp.float32)


def _np_params(attn: Attention) -> dict[str, np.ndarray]:
    names = ("wq_DNH", "wk_DNH", "wv_DNH", "bq_NH", "bk_NH", "bv_NH", "wo_NHD", "bo_D")
    return {n: np.asarray(getattr(attn, n)[...], np.float64) for n in names}


def _reference(attn, x_BTD, rotate, bias_NTS=None, rotate_v=False):
    """float64 numpy attention; ``rotate(x_BTNH) -> x_BTNH`` is applied to q and k (and v if
    ``rotate_v``, the mistake the tests must detect)."""
    p = _np_params(attn)
    x = np.asarray(x_BTD, np.float64)
    q = np.einsum("btd,dnh->btnh", x, p["wq_DNH"]) + p["bq_NH"]
    k = np.einsum("btd,dnh->btnh", x, p["wk_DNH"]) + p["bk_NH"]
    v = np.einsum("btd,dnh->btnh", x, p["wv_DNH"]) + p["bv_NH"]
    q, k = rotate(q), rotate(k)
    v = rotate(v) if rotate_v else v
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    if bias_NTS is not None:
        logits = logits + np.asarray(bias_NTS, np.float64)[None]
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("bnts,bsnh->btnh", w, v)
    return np.einsum("btnh,nhd->btd", o, p["wo_NHD"]) + p["bo_D"]


def _family_rotate(pe, params, pos_TA, share_heads):
    """Rotate with the family's own apply, one head at a time when the heads share params."""
    module = encodings.ROTARY[pe]

    def rotate(x_BTNH):
        x32 = jnp.asarray(x_BTNH, jnp.float32)
        if not share_heads:
            return np.asarray(module.apply(params, x32, pos_TA), np.float64)
        heads = [module.apply(params, x32[:, :, n : n + 1], pos_TA) for n in range(x32.shape[2])]
        return np.asarray(jnp.concatenate(heads, axis=2), np.float64)

    return rotate


@pytest.mark.parametrize("share_heads", [False, True])
@pytest.mark.parametrize("pe", sorted(ROTATING))
def test_matches_numpy_reference_rotating_q_and_k_only(pe, share_heads):
    attn = Attention(
        WIDTH,
        HEADS,
        num_axes=AXES,
        pe=pe,
        pe_hparams=ROTATING[pe],
        share_pe_heads=share_heads,
        num_prefix=1,
        rngs=nnx.Rngs(0),
    )
    _randomize_biases(attn)
    x_BTD, pos_TA = _inputs()
    params = {k: v[...] for k, v in attn.pe_params.items()}
    rotate = _family_rotate(pe, params, pos_TA, share_heads)
    expected = _reference(attn, x_BTD, rotate)
    np.testing.assert_allclose(attn(x_BTD, pos_TA), expected, rtol=1e-4, atol=1e-4)
    # The test can fail: without the rotation, or rotating v as well, the output differs.
    unrotated = _reference(attn, x_BTD, lambda x: x)
    assert np.max(np.abs(unrotated - expected)) > 1e-2
    v_rotated = _reference(attn, x_BTD, rotate, rotate_v=True)
    assert np.max(np.abs(v_rotated - expected)) > 1e-2


def test_alibi_bias_added_to_logits():
    pe, hparams = "alibi", {"learnable": True}
    attn = Attention(
        WIDTH, HEADS, num_axes=AXES, pe=pe, pe_hparams=hparams, num_prefix=1, rngs=nnx.Rngs(0)
    )
    _randomize_biases(attn)
    x_BTD, pos_TA = _inputs()
    # Independent bias: -slope_n * ||p_t - p_s||, zero rows/columns for the prefix token.
    slopes_N = 2.0 ** (-8.0 * np.arange(1, HEADS + 1) / HEADS)
    pos = np.asarray(pos_TA, np.float64)
    dist_TS = np.linalg.norm(pos[:, None] - pos[None], axis=-1)
    bias_NTS = -slopes_N[:, None, None] * dist_TS
    bias_NTS[:, 0, :] = bias_NTS[:, :, 0] = 0.0
    expected = _reference(attn, x_BTD, lambda x: x, bias_NTS)
    np.testing.assert_allclose(attn(x_BTD, pos_TA), expected, rtol=1e-4, atol=1e-4)
    assert np.max(np.abs(_reference(attn, x_BTD, lambda x: x) - expected)) > 1e-2


@pytest.mark.parametrize("pe", ["circulant_string", "liere", "alibi"])
def test_shared_heads_equal_per_head_parameters_that_are_all_alike(pe):
    # share_pe_heads: one head's parameters, their state broadcast over the heads, must equal a
    # per-head layer whose heads all hold those same parameters.
    x_BTD, pos_TA = _inputs(3)
    shared = Attention(
        WIDTH,
        HEADS,
        num_axes=AXES,
        pe=pe,
        share_pe_heads=True,
        pe_hparams=_HP.get(pe),
        rngs=nnx.Rngs(4),
    )
    one_head = {name: value[...] for name, value in shared.pe_params.items()}
    tiled = jax.tree.map(lambda a: _tile_heads(pe, a), one_head)
    per_head = Attention(
        WIDTH, HEADS, num_axes=AXES, pe=pe, own_pe=False, pe_hparams=_HP.get(pe), rngs=nnx.Rngs(4)
    )
    for name in ("wq_DNH", "wk_DNH", "wv_DNH", "wo_NHD"):
        getattr(per_head, name)[...] = getattr(shared, name)[...]
    np.testing.assert_allclose(
        per_head(x_BTD, pos_TA, pe_params=tiled), shared(x_BTD, pos_TA), rtol=1e-5, atol=1e-5
    )


_HP = {"alibi": {"learnable": True}}


def _tile_heads(pe, a):
    """Repeat a one-head parameter over HEADS heads (the head axis differs by family)."""
    axis = {"circulant_string": 1, "liere": 1, "alibi": 0}[pe]
    return jnp.repeat(a, HEADS, axis=axis)


@pytest.mark.parametrize("share_heads", [False, True])
def test_per_example_positions_match_shared(share_heads):
    pe = "rope_mixed"
    attn = Attention(
        WIDTH, HEADS, num_axes=AXES, pe=pe, share_pe_heads=share_heads, rngs=nnx.Rngs(1)
    )
    x_BTD, pos_TA = _inputs(2)
    out_shared = attn(x_BTD, pos_TA)
    out_per_example = attn(x_BTD, jnp.broadcast_to(pos_TA, (BATCH, TOKENS, AXES)))
    np.testing.assert_allclose(out_per_example, out_shared, rtol=1e-5, atol=1e-5)
    # A different position for example 1 changes example 1 only.
    pos_BTA = jnp.stack([pos_TA, pos_TA + jnp.arange(TOKENS)[:, None]])
    out = attn(x_BTD, pos_BTA)
    np.testing.assert_allclose(out[0], out_shared[0], rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(out[1] - out_shared[1])) > 1e-3


@pytest.mark.parametrize("share_heads, heads", [(False, HEADS), (True, 1)])
def test_position_params_are_position_param_variables(share_heads, heads):
    attn = Attention(
        WIDTH,
        HEADS,
        num_axes=AXES,
        pe="rope_mixed",
        share_pe_heads=share_heads,
        rngs=nnx.Rngs(0),
    )
    state = nnx.state(attn, PositionParam)
    leaves = jax.tree.leaves(state)
    assert [leaf.shape for leaf in leaves] == [(AXES, heads, HEAD_DIM // 2)]
    others = jax.tree.leaves(nnx.state(attn, nnx.Param))
    assert len(others) == 8 + 1  # q/k/v/o weights and biases, plus the frequencies


def test_shared_layer_params_come_from_exactly_one_place():
    x_BTD, pos_TA = _inputs()
    owner = Attention(WIDTH, HEADS, num_axes=AXES, pe="rope_mixed", rngs=nnx.Rngs(0))
    borrower = Attention(
        WIDTH, HEADS, num_axes=AXES, pe="rope_mixed", own_pe=False, rngs=nnx.Rngs(0)
    )
    assert borrower.pe_params is None
    assert not jax.tree.leaves(nnx.state(borrower, PositionParam))
    # Same seed: same projections; the borrowed parameters reproduce the owner's output.
    np.testing.assert_allclose(
        borrower(x_BTD, pos_TA, pe_params=owner.pe_params), owner(x_BTD, pos_TA), atol=1e-6
    )
    with pytest.raises(ValueError, match="exactly one place"):
        borrower(x_BTD, pos_TA)
    with pytest.raises(ValueError, match="exactly one place"):
        owner(x_BTD, pos_TA, pe_params=owner.pe_params)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_attend_is_jax_dot_product_attention(dtype, with_bias):
    """``attend`` is jax.nn's XLA attention written out: same values and gradients."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(BATCH, TOKENS, HEADS, HEAD_DIM)), dtype) for _ in "qkv")
    bias = jnp.asarray(rng.normal(size=(1, HEADS, TOKENS, TOKENS)), dtype) if with_bias else None
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(f, q, k, v):
        return jnp.sum(w * f(q, k, v, bias=bias).astype(jnp.float32))

    @jax.jit  # one program, not the values and gradients op by op
    def values_and_grads(q, k, v):
        ours = xla_attention.attend(q, k, v, bias)
        theirs = jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")
        g_ours = jax.grad(lambda *a: loss(xla_attention.attend, *a), argnums=(0, 1, 2))(q, k, v)
        g_theirs = jax.grad(lambda *a: loss(jax.nn.dot_product_attention, *a), argnums=(0, 1, 2))(
            q, k, v
        )
        return ours, theirs, g_ours, g_theirs

    ours, theirs, g_ours, g_theirs = values_and_grads(q, k, v)
    assert ours.dtype == theirs.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.float32(ours), np.float32(theirs), atol=tol, rtol=tol)
    for a, b in zip(g_ours, g_theirs, strict=True):
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=10 * tol, rtol=10 * tol)


@functools.partial(jax.jit, static_argnames=("loop", "parallel"))
def _attend_and_grads(q, k, v, bias, w, loop=1, parallel=1):
    """``attend`` in ``loop`` x ``parallel`` chunks (1 x 1: whole), and the gradients of
    sum(w * it) in q, k, v: one program per bias shape and chunking, shared by the cases."""

    def attend(q, k, v):
        return xla_attention.attend(q, k, v, bias, loop_chunks=loop, batch_chunks=parallel)

    return attend(q, k, v), jax.grad(lambda *a: jnp.sum(w * attend(*a)), (0, 1, 2))(q, k, v)


@pytest.mark.parametrize(
    "bias_shape",
    [None, (1, HEADS, TOKENS, TOKENS), (12, HEADS, TOKENS, TOKENS), (HEADS, TOKENS, TOKENS)],
)
@pytest.mark.parametrize("loop, parallel", [(1, 2), (3, 1), (2, 3), (3, 2)])
def test_attend_in_chunks_is_attend(bias_shape, loop, parallel):
    """Groups in a loop and concurrent chunks (two examples per chunk or more, as
    ``cpu_chunks`` plans them): the same attention per example to float32 rounding, the
    examples in their original order; gradients equal to float32 rounding. Not bitwise: how
    XLA:CPU vectorises a chunk depends on the CPU's vector width (AVX2 vs AVX-512)."""
    rng = np.random.default_rng(4)
    q, k, v = (
        jnp.asarray(rng.normal(size=(12, TOKENS, HEADS, HEAD_DIM)), jnp.float32) for _ in "qkv"
    )
    bias = None if bias_shape is None else jnp.asarray(rng.normal(size=bias_shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    whole, g_whole = _attend_and_grads(q, k, v, bias, w)
    chunked, g_chunked = _attend_and_grads(q, k, v, bias, w, loop=loop, parallel=parallel)
    np.testing.assert_allclose(chunked, whole, atol=1e-6, rtol=1e-6)
    # Example 5 alone (its own batch of one) is row 5: no example moved or mixed with another.
    one_bias = bias if bias is None or bias.ndim == 3 or bias.shape[0] == 1 else bias[5:6]
    np.testing.assert_allclose(
        whole[5:6], jax.jit(xla_attention.attend)(q[5:6], k[5:6], v[5:6], one_bias), atol=1e-6
    )
    for a, b in zip(g_chunked, g_whole, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


def test_attend_chunks_must_divide_the_batch():
    q = jnp.zeros((6, TOKENS, HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match=r"loop_chunks=2 x batch_chunks=2 .* divide the batch 6"):
        xla_attention.attend(q, q, q, loop_chunks=2, batch_chunks=2)
    with pytest.raises(ValueError, match="batch_chunks=0"):
        xla_attention.attend(q, q, q, batch_chunks=0)


def test_cpu_chunks_rule():
    """Two concurrent chunks for an even batch, and the fewest loop groups whose logits fit
    the budget with two examples per chunk or more."""
    rule = functools.partial(xla_attention.cpu_chunks, group_logits_bytes=1000 * 4)  # 1000 logits
    assert rule(8, 1, 10, 10) == (1, 2)  # 8 x 100 logits fit: no loop
    assert rule(8, 2, 10, 10) == (2, 2)  # 1600 do not, 4 x 200 do
    # At least two examples per chunk, even where a group's logits then exceed the budget:
    assert rule(12, 1, 20, 20) == (3, 2)  # 4 x 400 per group, the fewest
    assert rule(7, 1, 20, 20) == (1, 1)  # odd, and 7 is prime
    assert rule(4, 1, 40, 40) == (1, 2)
    assert rule(2, 1, 5, 5) == (1, 1)  # two chunks would hold one each
    assert xla_attention.cpu_chunks(8, 2, 10, 10) == (1, 2)  # GROUP_LOGITS_BYTES: 12 MiB fit


def test_inference_backend_from_host_facts():
    """One CPU device: the formula becomes "xla_cpu" (chunks); elsewhere, or another backend,
    the model's own."""
    assert backends.inference_backend("xla", "cpu", 1) == "xla_cpu"
    for platform, devices in (("cpu", 8), ("gpu", 1), ("tpu", 1)):
        assert backends.inference_backend("xla", platform, devices) == "xla"
    for name in ("chunked", "cudnn", "pallas"):
        assert backends.inference_backend(name, "cpu", 1) == name


def test_xla_cpu_backend_is_xla_in_the_chunks_cpu_chunks_plans(monkeypatch):
    """The "xla_cpu" backend cuts the batch as ``cpu_chunks`` says, from the shapes alone (no
    host facts read while tracing), with the logits of "xla" to float32 rounding; and
    ``set_inference_backends`` gives a model's layers that backend on one CPU device only."""
    x_BTD = jnp.asarray(np.random.default_rng(5).normal(size=(8, TOKENS, WIDTH)), jnp.float32)
    pos_TA = jnp.asarray(np.random.default_rng(6).uniform(size=(TOKENS, AXES)), jnp.float32)
    calls = []

    def cpu_chunks(*shape):
        calls.append(shape)
        return 2, 2

    def no_host(*_):
        raise AssertionError("read while tracing")

    monkeypatch.setattr(xla_attention, "cpu_chunks", cpu_chunks)
    monkeypatch.setattr(jax, "default_backend", no_host)
    monkeypatch.setattr(jax, "device_count", no_host)
    outputs = {}
    for name in ("xla", "xla_cpu"):
        attn = Attention(WIDTH, HEADS, num_axes=AXES, pe="liere", attention=name, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(attn)
        outputs[name] = jax.jit(lambda s, g=graphdef: nnx.merge(g, s)(x_BTD, pos_TA))(state)
    assert calls == [(8, HEADS, TOKENS, TOKENS, None)]
    np.testing.assert_allclose(outputs["xla_cpu"], outputs["xla"], atol=1e-6, rtol=1e-6)
    monkeypatch.undo()
    for devices, expected in ((1, "xla_cpu"), (2, "xla")):
        model = ViT(variant="pico/4", image_shape=(8, 8), num_classes=3, rngs=nnx.Rngs(0))
        attention.set_inference_backends(model, "cpu", devices)
        assert {block.attn.attention for block in model.blocks} == {expected}


def test_bfloat16_activations():
    attn = Attention(
        WIDTH,
        HEADS,
        num_axes=AXES,
        pe="liere",
        pe_hparams={"block_size": 4},
        dtype=jnp.bfloat16,
        rngs=nnx.Rngs(0),
    )
    x_BTD, pos_TA = _inputs()
    out = attn(x_BTD, pos_TA)
    assert out.dtype == jnp.bfloat16
    chex.assert_tree_all_finite(out)
    assert attn.wq_DNH[...].dtype == jnp.float32


def test_jit_and_grad():
    attn = Attention(WIDTH, HEADS, num_axes=AXES, pe="liere", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(attn)
    x_BTD, pos_TA = _inputs()

    @jax.jit
    def loss(state):
        return jnp.sum(nnx.merge(graphdef, state)(x_BTD, pos_TA) ** 2)

    grads = jax.grad(loss)(state)
    gen = grads["pe_params"]["gen_ANKbb"][...]
    chex.assert_tree_all_finite(gen)
    assert np.max(np.abs(gen)) > 0.0


def test_errors():
    with pytest.raises(ValueError, match=r"unknown pe='bogus'.*rope_mixed"):
        Attention(WIDTH, HEADS, num_axes=AXES, pe="bogus", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="width=24 is not divisible by num_heads=5"):
        Attention(WIDTH, 5, num_axes=AXES, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="block_size=16"):
        Attention(
            WIDTH,
            HEADS,
            num_axes=AXES,
            pe="liere",
            pe_hparams={"block_size": 16},
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['not_an_hparam'\]"):
        Attention(
            WIDTH,
            HEADS,
            num_axes=AXES,
            pe="rope_mixed",
            pe_hparams={"not_an_hparam": 1},
            rngs=nnx.Rngs(0),
        )


def test_fixed_alibi_with_shared_heads_is_refused_and_learnable_slopes_are_shared():
    """Built for one head, fixed ALiBi gives every head the 1-head slope 2^-8: about no bias,
    where the model was asked for ALiBi. Refused by name; learnable slopes may be shared."""
    with pytest.raises(ValueError, match="alibi: share_heads .* 1-head slope 2\\^-8"):
        Attention(WIDTH, HEADS, num_axes=AXES, pe="alibi", share_pe_heads=True, rngs=nnx.Rngs(0))
    from rope_lie import adapters

    with pytest.raises(ValueError, match="alibi: share_heads"):
        adapters.NNXAttention(
            "alibi", num_heads=HEADS, head_dim=8, grid=(2, 3), share_heads=True, rngs=nnx.Rngs(0)
        )
    shared = Attention(
        WIDTH,
        HEADS,
        num_axes=AXES,
        pe="alibi",
        pe_hparams={"learnable": True},
        share_pe_heads=True,
        rngs=nnx.Rngs(0),
    )
    assert [leaf.shape for leaf in jax.tree.leaves(nnx.state(shared, PositionParam))] == [(1,)]
