"""``lie.apply_blocks``'s products of the b x b blocks (``lie.BLOCK_PRODUCTS``): the einsum
(XLA:CPU's, and GPUs' and TPUs' above 16 x 16 blocks), the broadcast sum (GPUs' and TPUs' up
to 16 x 16) and the multiply-adds (an option), equal in values and gradients on CPU, and each
platform's program holding its own product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie.encodings import lie, liere
from rope_lie.models import ViT

# On a GPU the einsum ran in TF32 (10 bits of mantissa) before it asked for Precision.HIGHEST;
# its float32 error there is measured by the device queue's rotations stage, and until a run
# shows it, the GPU's tolerance stays TF32's.
FLOAT32_RTOL = 2e-6 if jax.default_backend() == "cpu" else 2e-3


@pytest.fixture
def product(monkeypatch):
    """Run this platform's programs with a given product: sets every ``BLOCK_PRODUCTS`` entry
    and clears JAX's caches (the product is read when a program is traced), and both again
    afterwards. On CPU here; on a GPU too (the device queue runs this file there)."""

    def use(name):
        monkeypatch.setitem(lie.BLOCK_PRODUCTS, "cpu", name)
        monkeypatch.setitem(lie.BLOCK_PRODUCTS, "default", name)
        jax.clear_caches()

    yield use
    monkeypatch.undo()
    jax.clear_caches()


# The products compared with the einsum.
OTHERS = ("broadcast", "adds")


def _both(product, fn, other):
    product("einsum")
    einsum = jax.device_get(fn())
    product(other)
    return einsum, jax.device_get(fn())


def _assert_close(a, b, rtol=FLOAT32_RTOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        scale = max(float(np.max(np.abs(y))), 1e-30)
        np.testing.assert_allclose(x, y, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize(
    "r_shape",
    [
        (5, 3, 2, 4, 4),  # shared by the batch, per head
        (5, 1, 2, 4, 4),  # shared, one set for every head
        (2, 5, 3, 2, 4, 4),  # per example
        (2, 5, 1, 2, 4, 4),  # per example, every head
        (5, 3, 2, 5, 5),  # b = 5: channels 10, 11 unrotated
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("other", OTHERS)
def test_products_agree_in_values_and_gradients(product, r_shape, dtype, other):
    # Inputs from numpy: the fixture clears JAX's caches, which eager jax.random calls would
    # then compile again in every case.
    rng = np.random.default_rng(0)
    r = rng.standard_normal(r_shape).astype(np.float32)
    x = rng.standard_normal((2, 5, 3, 12)).astype(dtype)
    cot = rng.standard_normal((2, 5, 3, 12)).astype(np.float32)

    def value_and_grads():
        out, vjp = jax.vjp(lie.apply_blocks, x, r)
        return out, vjp(cot.astype(out.dtype))

    einsum, others = _both(product, jax.jit(value_and_grads), other)
    assert einsum[0].dtype == others[0].dtype == dtype
    _assert_close(einsum, others, FLOAT32_RTOL if dtype == jnp.float32 else 1e-2)
    if r_shape[-1] == 5:  # the unrotated channels pass through unchanged
        np.testing.assert_array_equal(others[0][..., 10:], x[..., 10:])


def test_default_product_on_cpu_is_the_einsum():
    assert lie.BLOCK_PRODUCTS == {"cpu": "einsum", "default": "by_size"}


@pytest.mark.parametrize("other", OTHERS)
def test_liere_rotations_through_both_products(product, other):
    params = liere.init(jax.random.key(0), num_heads=2, head_dim=16, num_axes=2, block_size=8)
    pos_TA = jnp.stack(jnp.meshgrid(jnp.arange(3.0), jnp.arange(4.0), indexing="ij"), -1)
    pos_TA = pos_TA.reshape(-1, 2)
    x = jax.random.normal(jax.random.key(1), (3, 12, 2, 16))

    def loss_and_grads():
        loss = lambda p, x: jnp.sum(jnp.sin(liere.apply(p, x, pos_TA)))
        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    einsum, others = _both(product, jax.jit(loss_and_grads), other)
    _assert_close(einsum, others, max(1e-5, FLOAT32_RTOL))


@pytest.mark.parametrize("other", OTHERS)
def test_vit_train_gradient_through_both_products(product, other):
    model = ViT(
        variant="pico/4",
        image_shape=(8, 12),
        channels=3,
        num_classes=5,
        pe="liere",
        pe_hparams={"block_size": 4},
        head_zero_init=False,
        rngs=nnx.Rngs(0),
    )
    graphdef, state = nnx.split(model)
    images = jax.random.normal(jax.random.key(2), (2, 8, 12, 3))
    loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(images) ** 2)
    einsum, others = _both(product, jax.jit(lambda: jax.value_and_grad(loss)(state)), other)
    _assert_close(einsum, others, max(1e-5, FLOAT32_RTOL))


@pytest.mark.parametrize(
    "platform, block, dots",
    [
        ("cpu", 8, 1),
        ("cuda", 8, 0),
        ("rocm", 8, 0),
        ("tpu", 8, 0),
        ("cpu", 32, 1),
        ("cuda", 32, 1),  # above BROADCAST_MAX_BLOCK: the einsum
        ("tpu", 32, 1),
    ],
)
def test_each_platform_lowers_its_own_product(platform, block, dots):
    r = jax.ShapeDtypeStruct((5, 3, 2, block, block), jnp.float32)
    x = jax.ShapeDtypeStruct((2, 5, 3, 2 * block), jnp.bfloat16)
    text = jax.export.export(lie.apply_blocks, platforms=[platform])(x, r).mlir_module()
    # The program holds its platform's product alone (the other branch is not lowered).
    assert text.count("stablehlo.dot_general") == dots
    assert text.count("stablehlo.reduce(") == 1 - dots


def test_the_adds_product_lowers_without_dots_or_reductions(monkeypatch):
    # Its point on a GPU: elementwise work only, no reduction over the blocks' minor axis.
    monkeypatch.setitem(lie.BLOCK_PRODUCTS, "cuda", "adds")
    jax.clear_caches()
    r = jax.ShapeDtypeStruct((5, 3, 2, 8, 8), jnp.float32)
    x = jax.ShapeDtypeStruct((2, 5, 3, 16), jnp.bfloat16)
    text = jax.export.export(lie.apply_blocks, platforms=["cuda"])(x, r).mlir_module()
    jax.clear_caches()
    assert "stablehlo.dot_general" not in text and "stablehlo.reduce(" not in text
    assert text.count("stablehlo.multiply") >= 8
