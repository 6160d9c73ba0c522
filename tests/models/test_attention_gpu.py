"""The "cudnn" backend on a real NVIDIA GPU: cuDNN's fused attention against "xla" in bfloat16.

On CPU these tests skip (the suite checks the cuDNN wrapper's own work through jax's reference of
the same call in test_attention_backends.py); run them where ``jax.default_backend()`` is
"gpu": ``python -m pytest tests/models/test_attention_gpu.py``. Both backends get the same
bfloat16 inputs; cuDNN's kernel and XLA's attention round differently, so values and gradients
are compared at bfloat16's precision (relative distance of the whole array), not elementwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie.models import ViT, backends, tokens, xla_attention

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU"
)
BATCH, TOKENS, HEADS, HEAD_DIM = 4, 64, 4, 64
# bfloat16 keeps 8 bits of mantissa (epsilon 2^-8 = 0.0039): two correct kernels land within a
# few epsilons of each other over a whole array.
MAX_RELATIVE_DISTANCE = 0.02


def _distance(a, b) -> float:
    a, b = np.float32(a), np.float32(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _qkv(tokens, seed=0):
    rng = np.random.default_rng(seed)
    shape = (BATCH, tokens, HEADS, HEAD_DIM)
    return tuple(jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for _ in "qkv")


def _values_and_grads(fn, q, k, v, bias):
    w = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    loss = lambda q, k, v: jnp.sum(w * fn(q, k, v, bias).astype(jnp.float32))  # noqa: E731
    return jax.jit(fn)(q, k, v, bias), jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("bias_kind", ["none", "heads", "per_example"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tokens", [TOKENS, TOKENS + 1])  # an odd T: the wrapper pads it
def test_cudnn_matches_xla_in_values_and_gradients(bias_kind, masked, tokens):
    q, k, v = _qkv(tokens)
    rng = np.random.default_rng(1)
    bias = {
        "none": None,
        "heads": jnp.asarray(rng.normal(size=(HEADS, tokens, tokens)), jnp.float32),
        "per_example": jnp.asarray(rng.normal(size=(BATCH, HEADS, tokens, tokens)), jnp.float32),
    }[bias_kind]
    mask = np.ones((BATCH, tokens), bool)
    if masked:  # padding at the end (tokens.pack) and, in example 1, holes
        mask[0, 40:] = False
        mask[1, [3, 17, 50]] = False
    mask = jnp.asarray(mask)
    cudnn = lambda q, k, v, b: backends.attend_cudnn(q, k, v, b, mask)  # noqa: E731
    xla = lambda q, k, v, b: xla_attention.attend(  # noqa: E731
        q, k, v, xla_attention.with_key_mask(None if b is None else b, mask)
    )
    out, grads = _values_and_grads(cudnn, q, k, v, bias)
    ref, ref_grads = _values_and_grads(xla, q, k, v, bias)
    assert out.dtype == jnp.bfloat16
    assert _distance(out, ref) < MAX_RELATIVE_DISTANCE
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert _distance(g, r) < MAX_RELATIVE_DISTANCE, name


def _vit(pe, attention_name, pool):
    return ViT(
        variant=None,
        dims=dict(width=256, depth=2, num_heads=4, mlp_dim=512),
        patch_size=4,
        image_shape=(32, 32),
        channels=3,
        num_classes=10,
        pe=pe,
        pool=pool,
        head_zero_init=False,
        dtype="bfloat16",
        attention=attention_name,
        rngs=nnx.Rngs(0),
    )


@pytest.mark.parametrize("pe", ["rope_mixed", "liere", "alibi"])
@pytest.mark.parametrize("pool", ["mean", "cls"])  # 64 tokens, or 65 with the class token
def test_vit_with_cudnn_trains_like_xla_on_images_and_padded_token_batches(pe, pool):
    """The same parameters: logits and parameter gradients of a bfloat16 ViT (64 tokens, or an
    odd 65 with a class token, which the wrapper pads), on an image batch and on a padded batch
    of 4x4 to 8x8 grids (the key mask through cuDNN's sequence lengths)."""
    models = {name: _vit(pe, name, pool) for name in ("xla", "cudnn")}
    nnx.update(models["cudnn"], nnx.state(models["xla"], nnx.Param))
    rng = np.random.default_rng(3)
    images = jnp.asarray(rng.normal(size=(4, 32, 32, 3)), jnp.float32)
    grids = [(8, 8), (6, 7), (4, 4), (8, 5)]
    packed = tokens.pack(
        [rng.normal(size=(4 * h, 4 * w, 3)).astype(np.float32) for h, w in grids], (4, 4), 64
    )
    packed = tokens.Tokens(*map(jnp.asarray, packed))
    results = {}
    for name, model in models.items():
        graphdef, state = nnx.split(model)

        def loss(state, graphdef=graphdef):
            m = nnx.merge(graphdef, state)
            return jnp.sum(jnp.sin(m(images))) + jnp.sum(jnp.sin(m.classify_tokens(packed)))

        results[name] = jax.jit(jax.value_and_grad(loss))(state)
    (value, grads), (ref_value, ref_grads) = results["cudnn"], results["xla"]
    assert abs(float(value) - float(ref_value)) < MAX_RELATIVE_DISTANCE * abs(float(ref_value))
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))
    ref_leaves = jax.tree.leaves(nnx.state(ref_grads, nnx.Param))
    for (path, g), r in zip(leaves, ref_leaves, strict=True):
        name = jax.tree_util.keystr(path)
        if "bk_NH" in name:  # a key bias shifts all of a query's logits alike: softmax ignores
            continue  # it, so its gradient is 0 in exact arithmetic and rounding noise here
        assert _distance(g, r) < 5 * MAX_RELATIVE_DISTANCE, name
