"""The attention backends (``backends.py``) behind ``Attention``'s one seam, on CPU.

"chunked" (online softmax over key blocks, custom VJP) must equal "xla" (``attend``) to float32
rounding in values and gradients, with and without a bias, at 2D and 3D token counts; the Pallas
TPU kernel runs here in its interpret mode; the checks run before a step name the setting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie.models import backends, options, xla_attention
from rope_lie.models.attention import Attention
from rope_lie.models.position_hook import PositionParam

BATCH, HEADS, HEAD_DIM = 3, 2, 8
# A class token and a 4x4 grid (2D), and a 2x3x3 grid (3D).
TOKENS = {"2d": 1 + 4 * 4, "3d": 1 + 2 * 3 * 3}
BIAS_SHAPES = {
    "none": None,
    "shared": lambda t: (1, HEADS, t, t),
    "heads": lambda t: (HEADS, t, t),  # as ALiBi's state gives it
    "per_example": lambda t: (BATCH, HEADS, t, t),
}


def _qkv(tokens: int, dtype=jnp.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (BATCH, tokens, HEADS, HEAD_DIM)
    return tuple(jnp.asarray(2 * rng.normal(size=shape), dtype) for _ in "qkv")


def _bias(kind: str, tokens: int, seed: int = 1):
    if BIAS_SHAPES[kind] is None:
        return None
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=BIAS_SHAPES[kind](tokens)), jnp.float32)


def _values_and_grads(fn, q, k, v, bias, examples=None):
    """fn's output and the gradients of a random projection of it w.r.t. q, k, v (and bias);
    ``examples``: the examples the projection weighs (None: all)."""
    w = np.random.default_rng(2).normal(size=q.shape)
    if examples is not None:
        w[np.setdiff1d(np.arange(len(w)), examples)] = 0.0
    w = jnp.asarray(w, jnp.float32)
    args = (q, k, v) if bias is None else (q, k, v, bias)

    def out(*a):
        return fn(*a[:3], a[3] if len(a) > 3 else None)

    def loss(*a):
        return jnp.sum(w * out(*a).astype(jnp.float32))

    @jax.jit  # the output and the gradients in one program
    def values_and_grads(*a):
        return out(*a), jax.grad(loss, argnums=tuple(range(len(a))))(*a)

    return values_and_grads(*args)


@pytest.mark.parametrize("bias_kind", sorted(BIAS_SHAPES))
@pytest.mark.parametrize("grid", sorted(TOKENS))
def test_chunked_equals_xla_in_values_and_gradients(grid, bias_kind):
    """Blocks of 8 keys: 17 or 19 keys make three blocks, the last padded and masked."""
    tokens = TOKENS[grid]
    q, k, v = _qkv(tokens)
    bias = _bias(bias_kind, tokens)
    chunked = lambda q, k, v, b: backends.attend_chunked(q, k, v, b, block=8)  # noqa: E731
    xla = lambda q, k, v, b: xla_attention.attend(q, k, v, b)  # noqa: E731
    out, grads = _values_and_grads(chunked, q, k, v, bias)
    ref_out, ref_grads = _values_and_grads(xla, q, k, v, bias)
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    assert len(grads) == len(ref_grads) == (3 if bias is None else 4)
    for name, g, ref in zip("qkvb", grads, ref_grads, strict=False):
        assert g.shape == ref.shape, name
        np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("block", [1, 5, 17, 64])
def test_chunked_any_block_size(block):
    """One key per block, uneven blocks, exactly S, more than S: the same attention."""
    q, k, v = _qkv(TOKENS["2d"], seed=3)
    bias = _bias("heads", TOKENS["2d"])
    ref = xla_attention.attend(q, k, v, bias)
    out = backends.attend_chunked(q, k, v, bias, block=block)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="block=0"):
        backends.attend_chunked(q, k, v, block=0)


def test_chunked_bfloat16_close_to_xla():
    """bfloat16 q, k, v: float32 statistics in both, so they agree to bfloat16 rounding."""
    q, k, v = _qkv(TOKENS["3d"], jnp.bfloat16, seed=4)
    bias = _bias("heads", TOKENS["3d"]).astype(jnp.bfloat16)
    out = backends.attend_chunked(q, k, v, bias, block=8)
    ref = xla_attention.attend(q, k, v, bias)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(out), np.float32(ref), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("pe, hparams", [("alibi", {"learnable": True}), ("liere", {})])
def test_attention_layer_backend_chunked_equals_xla(pe, hparams):
    """The whole layer: the same parameters give the same output and parameter gradients
    (ALiBi's learnable slopes through the bias's gradient) with either backend."""
    x_BTD = jnp.asarray(np.random.default_rng(5).normal(size=(2, 17, 16)), jnp.float32)
    pos_TA = jnp.asarray(np.random.default_rng(6).uniform(size=(17, 2)), jnp.float32)
    layers = {
        name: Attention(
            16,
            2,
            num_axes=2,
            pe=pe,
            pe_hparams=hparams,
            attention=name,
            num_prefix=1,
            rngs=nnx.Rngs(0),
        )
        for name in ("xla", "chunked")
    }
    results = {}
    for name, layer in layers.items():
        graphdef, state = nnx.split(layer)

        def loss(state, graphdef=graphdef):
            return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x_BTD, pos_TA)))

        results[name] = jax.jit(jax.value_and_grad(loss))(state)
    (value, grads), (ref_value, ref_grads) = results["chunked"], results["xla"]
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-4)
    assert (
        any(np.max(np.abs(g)) > 0 for g in jax.tree.leaves(nnx.state(grads, PositionParam)))
        or pe != "alibi"
    )


def test_unknown_attention_is_named():
    with pytest.raises(ValueError, match=r"unknown attention='flash'; expected one of"):
        Attention(16, 2, num_axes=2, attention="flash", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("with_bias", [False, True])
def test_pallas_tpu_kernel_in_interpret_mode(with_bias):
    """The Pallas TPU flash kernel, interpreted on CPU: 17 tokens padded to its 128-token block
    and masked with segment ids; the bias through its ``ab`` input (divided by the scale it
    multiplies). Values, and with the bias the gradients, equal ``attend``'s."""
    from jax.experimental.pallas import tpu as pltpu

    q, k, v = (x[:1] for x in _qkv(TOKENS["2d"], seed=7))
    bias = _bias("heads", TOKENS["2d"]) if with_bias else None
    with pltpu.force_tpu_interpret_mode():
        if with_bias:
            out, grads = _values_and_grads(backends.attend_pallas, q, k, v, bias)
        else:
            out, grads = jax.jit(backends.attend_pallas)(q, k, v, None), ()
    ref_out, ref_grads = _values_and_grads(xla_attention.attend, q, k, v, bias)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for name, g, ref in zip("qkvb", grads, ref_grads, strict=False):
        np.testing.assert_allclose(g, ref, atol=1e-4, rtol=1e-4, err_msg=name)


def test_pallas_blocks_follow_the_padded_token_count():
    """The whole padded sequence up to 512 tokens (ViT-B/16 at 224 px: 197 -> one block of 256),
    else the largest multiple of 128 up to 512 that divides it; not the kernel's 128 defaults."""
    assert [backends.pallas_block(n) for n in (128, 256, 384, 512)] == [128, 256, 384, 512]
    assert [backends.pallas_block(n) for n in (640, 768, 896, 1024)] == [128, 384, 128, 512]
    for bad in (0, 100, 200):
        with pytest.raises(ValueError, match=f"padded={bad} must be a positive multiple of 128"):
            backends.pallas_block(bad)
    sizes = backends.pallas_block_sizes(256, 768)
    assert (sizes.block_q, sizes.block_k_major, sizes.block_k, sizes.block_b) == (256, 384, 384, 1)
    backward = (sizes.block_q_dkv, sizes.block_k_dkv, sizes.block_q_dq, sizes.block_k_dq)
    assert backward == (256, 384, 256, 384)


@pytest.mark.parametrize("tokens", [300, 700])
def test_pallas_kernel_with_large_blocks_in_interpret_mode(tokens):
    """One block of 384 tokens (300 padded), and 2 x 2 blocks of 384 (700 padded to 768), with a
    per-head bias: values and gradients equal ``attend``'s."""
    from jax.experimental.pallas import tpu as pltpu

    q, k, v = (x[:1] for x in _qkv(tokens, seed=11))
    bias = _bias("heads", tokens)
    with pltpu.force_tpu_interpret_mode():
        out, grads = _values_and_grads(backends.attend_pallas, q, k, v, bias)
    ref_out, ref_grads = _values_and_grads(xla_attention.attend, q, k, v, bias)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for name, g, ref in zip("qkvb", grads, ref_grads, strict=False):
        np.testing.assert_allclose(g, ref, atol=1e-4, rtol=1e-4, err_msg=name)


# A key mask over the 2D token count (a class token and 16 slots): example 0 padded at the end
# (as tokens.pack pads), example 1 with holes (a token batch may hold its slots in any order),
# example 2 with no real key (an evaluation's zero-filled batch tail without a class token).
KEY_MASK = np.ones((BATCH, TOKENS["2d"]), bool)
KEY_MASK[0, 11:] = False
KEY_MASK[1, [2, 5, 15, 16]] = False
KEY_MASK[2, :] = False
REAL = [0, 1]  # the examples with real keys


def _masked_reference(bias_kind):
    """q, k, v, the bias, and ``attend``'s output and gradients with the mask as a logit bias
    (``with_key_mask``, the "xla" backend), the gradients of the examples in ``REAL``."""
    q, k, v = _qkv(TOKENS["2d"], seed=10)
    bias = _bias(bias_kind, TOKENS["2d"])
    mask = jnp.asarray(KEY_MASK)

    def xla(q, k, v, b):
        return xla_attention.attend(q, k, v, xla_attention.with_key_mask(b, mask))

    return (q, k, v, bias), _values_and_grads(xla, q, k, v, bias, examples=REAL)


def _check_masked(fn, bias_kind, grads=True):
    """``fn(q, k, v, bias, key_mask)`` equals the reference on the examples with real keys, in
    values and (with ``grads``) gradients, and is finite on the one without."""
    (q, k, v, bias), (ref_out, ref_grads) = _masked_reference(bias_kind)
    masked = lambda q, k, v, b: fn(q, k, v, b, jnp.asarray(KEY_MASK))  # noqa: E731
    if grads:
        out, grads = _values_and_grads(masked, q, k, v, bias, examples=REAL)
    else:
        out, grads = jax.jit(masked)(q, k, v, bias), ()
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(
        np.asarray(out)[REAL], np.asarray(ref_out)[REAL], atol=1e-5, rtol=1e-5
    )
    for name, g, ref in zip("qkvb", grads, ref_grads, strict=False):
        np.testing.assert_allclose(g, ref, atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("bias_kind", ["none", "per_example"])
def test_pallas_takes_the_key_mask_as_segment_ids_in_interpret_mode(bias_kind):
    """Padded keys in segment 0 (with the block padding), the rest in segment 1: equal to the
    mask as a logit bias in values and gradients, with ALiBi's per-example bias beside it."""
    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode():
        _check_masked(backends.attend_pallas, bias_kind)


@pytest.mark.parametrize("bias_kind", ["none", "shared", "per_example"])
def test_cudnn_takes_the_key_mask_as_sequence_lengths(bias_kind):
    """The cuDNN wrapper's own work, checked through jax's reference of the same call
    (``implementation="xla"``: the same bias, key order and ``key_value_seq_lengths``): real
    keys sorted first, the bias's key axis with them, each example's count as its length."""
    cudnn_as_xla = lambda *a: backends.attend_cudnn(*a, implementation="xla")  # noqa: E731
    _check_masked(cudnn_as_xla, bias_kind)


@pytest.mark.parametrize("bias_kind", sorted(BIAS_SHAPES))
@pytest.mark.parametrize("grid", sorted(TOKENS))
def test_cudnn_pads_an_odd_token_count(grid, bias_kind):
    """cuDNN trains only at an even T: at 17 or 19 tokens the wrapper adds a zero query and a
    key that the sequence lengths leave out; values and gradients (bias's too) equal ``attend``,
    through jax's reference of the same call."""
    q, k, v = _qkv(TOKENS[grid])
    bias = _bias(bias_kind, TOKENS[grid])
    cudnn_as_xla = lambda *a: backends.attend_cudnn(*a, implementation="xla")  # noqa: E731
    out, grads = _values_and_grads(cudnn_as_xla, q, k, v, bias)
    ref_out, ref_grads = _values_and_grads(xla_attention.attend, q, k, v, bias)
    assert out.shape == q.shape and len(grads) == len(ref_grads)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for name, g, ref in zip("qkvb", grads, ref_grads, strict=False):
        assert g.shape == ref.shape, name
        np.testing.assert_allclose(g, ref, atol=1e-4, rtol=1e-4, err_msg=name)


CHECK = dict(platform="gpu", dtype=jnp.bfloat16, head_dim=64)


@pytest.mark.parametrize(
    "name, changes, message",
    [
        ("cudnn", dict(platform="cpu"), r"model.attention='cudnn' needs platform in \['gpu'"),
        ("cudnn", dict(platform="tpu"), "needs platform"),
        (
            "cudnn",
            dict(dtype=jnp.float32),
            "needs model.dtype 'bfloat16' or 'float16'; got float32",
        ),
        ("cudnn", dict(head_dim=12), "multiple of 8 and <= 128 .*got 12"),
        ("pallas", dict(platform="gpu"), r"model.attention='pallas' needs platform in \['tpu'\]"),
        ("pallas", dict(platform="tpu", head_dim=192), "multiple of 128 .*got 192"),
        ("xla_cpu", {}, r"model.attention='xla_cpu' needs platform in \['cpu'\]"),
        ("bogus", {}, "unknown attention='bogus'"),
    ],
)
def test_check_attention_names_the_setting_and_its_needs(name, changes, message):
    with pytest.raises(ValueError, match=message):
        backends.check_attention(name, **(CHECK | changes))


@pytest.mark.parametrize(
    "name, changes",
    [
        ("xla", dict(platform="cpu", dtype=jnp.float32)),
        ("chunked", dict(platform="tpu", dtype=jnp.float32)),
        ("xla_cpu", dict(platform="cpu", dtype=jnp.float32)),
        ("cudnn", {}),
        ("cudnn", dict(platform="cuda", dtype=jnp.float16, head_dim=256)),
        ("pallas", dict(platform="tpu", dtype=jnp.float32, head_dim=256)),
    ],
)
def test_check_attention_accepts_what_runs(name, changes):
    backends.check_attention(name, **(CHECK | changes))


def test_check_model_attention_from_a_config():
    """From ``config.model``: the platform, the dtype, and head_dim from the variant."""
    from configs import quickstart

    model = quickstart.get_config("pe=alibi").model  # mu/8: H = 16; 8x8 grid + class token
    assert model.attention == "xla"
    options.check_model_attention(model, "cpu")
    model.attention = "cudnn"
    with pytest.raises(ValueError, match="model.attention='cudnn' needs platform"):
        options.check_model_attention(model, "cpu")
    with pytest.raises(ValueError, match="model.dtype 'bfloat16'"):
        options.check_model_attention(model, "gpu")
    model.dtype = "bfloat16"
    options.check_model_attention(model, "gpu")  # 65 tokens: attend_cudnn pads them to 66
    model.update(variant=None, dims=dict(width=48, depth=1, num_heads=4, mlp_dim=96))
    model.patch_size = 4
    with pytest.raises(ValueError, match="multiple of 8 and <= 128 .*got 12"):
        options.check_model_attention(model, "gpu")


def test_default_backend_is_attend():
    """The default ("xla") is today's ``attend`` on the layer's q, k, v and bias."""
    layer = Attention(16, 2, num_axes=2, pe="alibi", num_prefix=1, rngs=nnx.Rngs(0))
    assert layer.attention == "xla"
    x_BTD = jnp.asarray(np.random.default_rng(8).normal(size=(2, 17, 16)), jnp.float32)
    pos_TA = jnp.asarray(np.random.default_rng(9).uniform(size=(17, 2)), jnp.float32)
    q, k, v, bias = layer.qkv(x_BTD, pos_TA)
    o_BTNH = xla_attention.attend(q, k, v, bias)
    expected = jnp.einsum("BTNH,NHD->BTD", o_BTNH, layer.wo_NHD[...]) + layer.bo_D[...][None, None]
    np.testing.assert_allclose(layer(x_BTD, pos_TA), expected, rtol=1e-6, atol=1e-6)
