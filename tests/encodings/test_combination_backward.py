"""expm_combination's two VJPs (``COMBINATION_BACKWARDS``): "reverse" (reverse mode through
the Taylor rows' large product, with the squarings' adjoint in one loop) against "frechet" (the
Frechet derivative per row, every platform's default), against float64 central differences,
under ``jax.vmap`` (LieRE's batched layer plan), and in the program lowered for CUDA, where
"reverse" has no batched per-row products left for the GPU's matrix-multiply kernels."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import expm, expm_combination
from tests.encodings.reference import expm_skew64, random_skew

HOST = expm.Host(jax.default_backend(), 1)


@pytest.fixture
def backward(monkeypatch):
    """``set(choice)``: this platform's combination VJP from now on (read when a program is
    traced; the jitted functions keep their traces, so JAX's caches are cleared each time)."""

    def set_backward(choice):
        monkeypatch.setitem(expm_combination.COMBINATION_BACKWARDS, HOST.platform, choice)
        jax.clear_caches()

    yield set_backward
    jax.clear_caches()


def _problem(h: int, scale: float, seed: int = 0, rows: int = 21, sets: int = 3):
    rng = np.random.default_rng(seed)
    coef = rng.uniform(-7.0, 7.0, size=(rows, 2))
    gen = np.stack([random_skew(rng, sets, h, scale) for _ in range(2)])
    weight = rng.normal(size=(rows, sets, h, h))
    return coef, gen, weight


def _grads(coef, gen, weight):
    def loss(c, g):
        return jnp.sum(
            jnp.asarray(weight, jnp.float32) * expm_combination.expm_skew_combination(c, g)
        )

    c, g = jnp.asarray(coef, jnp.float32), jnp.asarray(gen, jnp.float32)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(c, g)


@pytest.mark.parametrize("h", [6, 8, 16])
@pytest.mark.parametrize("scale", [0.3, 10.0])
def test_reverse_gradients_equal_the_frechet_ones(backward, h, scale):
    coef, gen, weight = _problem(h, scale)
    squarings = expm_combination.num_squarings(jnp.asarray(coef), jnp.asarray(gen))
    # at most one squaring a row; five or six for some rows
    assert int(squarings.max()) <= 1 if scale < 1 else int(squarings.max()) >= 5
    backward("frechet")
    frechet = _grads(coef, gen, weight)
    backward("reverse")
    reverse = _grads(coef, gen, weight)
    for a, b in zip(frechet, reverse, strict=True):
        # float32 rounding, grown by up to six squarings
        scale_ = float(jnp.max(jnp.abs(a)))
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5 * scale_)


@pytest.mark.parametrize("h", [8, 64])  # LieRE 8x8's blocks and dense LieRE's
def test_reverse_gradient_matches_float64_central_differences(backward, h):
    coef, gen, weight = _problem(h, 3.0, seed=1, rows=9, sets=2)
    backward("reverse")
    grad_c, grad_g = _grads(coef, gen, weight)
    rng = np.random.default_rng(2)
    dc, dg = rng.normal(size=coef.shape), rng.normal(size=gen.shape)
    dg = dg - np.swapaxes(dg, -1, -2)  # along skew generators, where expm_skew64 holds

    def loss64(c, g):
        a = np.einsum("xa,ayij->xyij", c, g).reshape(-1, h, h)
        return float(np.sum(weight * expm_skew64(a).reshape(weight.shape)))

    eps = 1e-6
    numeric = (
        loss64(coef + eps * dc, gen + eps * dg) - loss64(coef - eps * dc, gen - eps * dg)
    ) / (2 * eps)
    analytic = float(np.sum(np.asarray(grad_c, np.float64) * dc) + np.sum(np.asarray(grad_g) * dg))
    # Measured against |gradient| |direction|, not the directional derivative: its terms cancel
    # (at h = 8 it is 1/400 of that scale), so a relative bound on it sits below float32
    # rounding, and valid orders of the same products passed or failed it (on a CPU with the
    # "reduce" small products, and on an H200). Each gradient entry is within 4e-7 of the
    # largest of float64's here; a missing term of the VJP is of the order of the scale.
    scale = np.sqrt(np.sum(np.square(grad_c)) + np.sum(np.square(grad_g)))
    scale *= np.sqrt(np.sum(dc**2) + np.sum(dg**2))
    assert abs(analytic - numeric) <= 1e-6 * scale, (analytic, numeric, scale)


@functools.cache
def _float64_gradients(h: int, scale: float):
    """_problem(h, scale)'s loss gradient in float64 by central differences, entry by entry
    (the generators' along skew directions, where ``expm_skew64`` holds: their skew part)."""
    coef, gen, weight = _problem(h, scale)

    def loss64(c, g):
        a = np.einsum("xa,ayij->xyij", c, g).reshape(-1, h, h)
        return float(np.sum(weight * expm_skew64(a).reshape(weight.shape)))

    eps = 1e-7
    grad_c, grad_g = np.zeros_like(coef), np.zeros_like(gen)
    for idx in np.ndindex(coef.shape):
        d = np.zeros_like(coef)
        d[idx] = eps
        grad_c[idx] = (loss64(coef + d, gen) - loss64(coef - d, gen)) / (2 * eps)
    for a, y, i, j in np.ndindex(gen.shape):
        if i < j:
            d = np.zeros_like(gen)
            d[a, y, i, j], d[a, y, j, i] = eps, -eps
            along = (loss64(coef, gen + d) - loss64(coef, gen - d)) / (2 * eps)
            grad_g[a, y, i, j], grad_g[a, y, j, i] = along / 2, -along / 2
    return grad_c, grad_g


@pytest.mark.parametrize("h", [6, 8, 16])
@pytest.mark.parametrize("choice", ["frechet", "reverse"])
def test_each_vjp_matches_float64_entry_by_entry_after_many_squarings(backward, choice, h):
    # Five or six squarings a row. Which VJP a failure of the comparison above comes from: on
    # a CPU each entry of either is within 3.2e-6 of the largest of float64's.
    coef, gen, weight = _problem(h, 10.0)
    backward(choice)
    grad_c, grad_g = _grads(coef, gen, weight)
    grad_g = 0.5 * (grad_g - jnp.matrix_transpose(grad_g))  # its skew part, as float64's
    for got, want in zip((grad_c, grad_g), _float64_gradients(h, 10.0), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_reverse_gradients_under_vmap_equal_each_slice(backward):
    # LieRE's batched layer plan vmaps the combination over the layers.
    backward("reverse")
    problems = [_problem(8, 1.0, seed=s) for s in range(3)]
    coef = jnp.asarray(np.stack([p[0] for p in problems]), jnp.float32)
    gen = jnp.asarray(np.stack([p[1] for p in problems]), jnp.float32)
    weight = jnp.asarray(np.stack([p[2] for p in problems]), jnp.float32)

    def loss(c, g):
        rotations = jax.vmap(expm_combination.expm_skew_combination)(c, g)
        return jnp.sum(weight * rotations)

    grad_c, grad_g = jax.jit(jax.grad(loss, argnums=(0, 1)))(coef, gen)
    for i, p in enumerate(problems):
        each_c, each_g = _grads(*p)
        np.testing.assert_allclose(grad_c[i], each_c, rtol=0, atol=2e-6 * np.abs(each_c).max())
        np.testing.assert_allclose(grad_g[i], each_g, rtol=0, atol=2e-6 * np.abs(each_g).max())


def _per_row_products(choice: str, monkeypatch) -> int:
    """dot_generals of the rows' 8 x 8 matrices (21 rows x 3 sets) in the gradient's program
    traced for a GPU host and lowered for CUDA."""
    monkeypatch.setitem(expm_combination.COMBINATION_BACKWARDS, "gpu", choice)
    jax.clear_caches()
    gpu = expm.Host("gpu", 1)
    coef, gen, _ = _problem(8, 3.0)

    def loss(c, g):
        return jnp.sum(jnp.sin(expm_combination.expm_skew_combination(c, g, host=gpu)))

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    args = (jnp.asarray(coef, jnp.float32), jnp.asarray(gen, jnp.float32))
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    jax.clear_caches()
    return len(re.findall(r"stablehlo\.dot_general.*-> tensor<63x8x8xf32>", text))


def test_reverse_leaves_no_batched_row_products_for_a_gpu(monkeypatch):
    # On an H100 the Frechet pass's batched 8 x 8 products ran as matrix-multiply kernels
    # (benchmarks README, section 13); "reverse" writes its per-row products as the squarings'
    # broadcast products and its other products over all rows at once.
    assert _per_row_products("frechet", monkeypatch) > 0
    assert _per_row_products("reverse", monkeypatch) == 0


def test_every_platform_uses_the_frechet_vjp_by_default():
    # The default path's numbers (goldens, studies) stay as they were.
    assert expm_combination.COMBINATION_BACKWARDS == {"default": "frechet"}
    for platform in ("cpu", "gpu", "tpu"):
        assert expm_combination.combination_backward(platform) == "frechet"


def test_an_unknown_vjp_is_named_with_the_choices(monkeypatch):
    monkeypatch.setitem(expm_combination.COMBINATION_BACKWARDS, "cpu", "adjoint")
    with pytest.raises(ValueError, match=r"COMBINATION_BACKWARDS\['cpu'\]='adjoint'; expected"):
        expm_combination.combination_backward("cpu")
