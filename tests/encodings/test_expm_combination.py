"""expm_combination.py: exp(sum_a c_a G_a) for many rows against scipy's float64 expm, huge
norms, VJPs, row groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from rope_lie.encodings import expm, expm_combination
from tests.encodings.reference import random_skew


def _combination_reference(coef, gen):
    """(X, Y, H, H) float64 exp(sum_a coef[x, a] gen[a, y]) by scipy."""
    coef, gen = np.asarray(coef, np.float64), np.asarray(gen, np.float64)
    a = np.einsum("xa,ayij->xyij", coef, gen)
    return np.stack([[scipy.linalg.expm(m) for m in row] for row in a])


@pytest.mark.parametrize("num_axes", [1, 2, 3])
@pytest.mark.parametrize("h", [3, 4, 5, 8, 40])
def test_expm_skew_combination_matches_scipy_float64(num_axes, h):
    rng = np.random.default_rng(10 * h + num_axes)
    # Per-axis generator norms from 0.1 to 60 and coefficients of both signs (axes partly
    # cancel); 130 rows x 2 generator sets exercise the per-core chunks of H = 40 on CPU.
    norms = np.logspace(-1, np.log10(60.0), 2 * num_axes)
    gen = np.stack([random_skew(rng, 1, h, n)[0] for n in norms]).reshape(num_axes, 2, h, h)
    coef = rng.uniform(-1.5, 1.5, size=(130, num_axes))
    coef[0] = 0.0
    r = np.asarray(expm_combination.expm_skew_combination(coef, gen), np.float64)
    expected = _combination_reference(coef, gen.astype(np.float32))
    np.testing.assert_allclose(r, expected, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(r[0], np.broadcast_to(np.eye(h), (2, h, h)))


def test_expm_skew_combination_finite_at_huge_norms_and_zero_generators():
    rng = np.random.default_rng(11)
    gen = np.stack([random_skew(rng, 2, 8, 1e6), np.zeros((2, 8, 8))])
    coef = np.array([[1.0, 3.0], [-2.0, 0.5]])
    r = np.asarray(expm_combination.expm_skew_combination(coef, gen))
    assert np.isfinite(r).all()
    # Each squaring doubles the rounding error, so after s ~ 19 squarings orthogonality holds to
    # about 2^s u (u = 2^-24 ~ 6e-8): ~3e-2 here (measured 0.6-1.7 x 2^s u over seeds).
    # Jitted: one compiled program instead of hundreds of eagerly dispatched operations.
    squarings = jax.jit(expm_combination.num_squarings)
    s = np.asarray(squarings(jnp.asarray(coef, jnp.float32), jnp.asarray(gen, jnp.float32)))
    assert s.max() >= 17
    ortho = np.abs(np.swapaxes(r, -1, -2) @ r - np.eye(8)).max(axis=(-2, -1))
    assert (ortho <= 4.0 * 2.0 ** s[:, None] * 2.0**-24).all(), (ortho, s)
    zero = np.asarray(
        expm_combination.expm_skew_combination(np.ones((3, 2)), np.zeros((2, 4, 6, 6)))
    )
    np.testing.assert_array_equal(zero, np.broadcast_to(np.eye(6), zero.shape))


@pytest.mark.parametrize("h", [4, 6])
def test_expm_skew_combination_vjp_matches_finite_differences(h):
    rng = np.random.default_rng(12)
    gen = np.stack([random_skew(rng, 3, h, 5.0), random_skew(rng, 3, h, 2.0)])
    coef = rng.uniform(-1.0, 1.0, size=(4, 2))
    w = rng.normal(size=(4, 3, h, h))

    def loss(c, g):
        return jnp.sum(jnp.asarray(w, jnp.float32) * expm_combination.expm_skew_combination(c, g))

    grad_c, grad_g = jax.grad(loss, (0, 1))(
        jnp.asarray(coef, jnp.float32), jnp.asarray(gen, jnp.float32)
    )
    d_c, d_g = rng.normal(size=coef.shape), np.stack([random_skew(rng, 3, h, 1.0)] * 2)
    eps = 1e-6

    def loss64(c, g):
        return np.sum(w * _combination_reference(c, g))

    fd = loss64(coef + eps * d_c, gen + eps * d_g) - loss64(coef - eps * d_c, gen - eps * d_g)
    got = np.sum(np.asarray(grad_c) * d_c) + np.sum(np.asarray(grad_g) * d_g)
    np.testing.assert_allclose(got, fd / (2 * eps), rtol=1e-4)


@pytest.mark.parametrize("h", [5, 16])
def test_expm_skew_combination_row_groups_change_nothing(h, monkeypatch):
    # Groups of rows (lax.map) keep the exponentials in cache at many tokens; 37 rows in groups
    # of at most 8 (uneven, padded) must give the ungrouped values and gradients, for broadcast
    # products (H = 5: grouped in the backward only) and dot products (H = 16: both passes).
    rng = np.random.default_rng(13)
    gen = jnp.asarray(
        np.stack([random_skew(rng, 2, h, 3.0), random_skew(rng, 2, h, 1.0)]), jnp.float32
    )
    coef = jnp.asarray(rng.uniform(-1.0, 1.0, size=(37, 2)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(37, 2, h, h)), jnp.float32)

    def value_and_grads():
        f = lambda c, g: jnp.sum(w * expm_combination.expm_skew_combination(c, g))  # noqa: E731
        return expm_combination.expm_skew_combination(coef, gen), jax.grad(f, (0, 1))(coef, gen)

    # One program each time, not op by op; a fresh lambda each time, so that the second one is
    # traced again (with the patched exponential) rather than taken from jit's cache.
    whole, (gc_whole, gg_whole) = jax.jit(lambda: value_and_grads())()
    monkeypatch.setattr(expm_combination, "_GROUP_BYTES", 8 * 2 * h * h * 4)
    # The exponential reads _GROUP_BYTES when traced, and jit and custom_vjp cache their traces
    # per function: fresh ones trace it again (jax.clear_caches() would do it too, but then
    # every later test recompiles what it shares with earlier ones).
    fresh = jax.custom_vjp(expm_combination._combination_impl, nondiff_argnums=(2,))
    fresh.defvjp(expm_combination._combination_fwd, expm_combination._combination_bwd)
    monkeypatch.setattr(expm_combination, "_combination_jit", jax.jit(fresh, static_argnums=2))
    grouped, (gc, gg) = jax.jit(lambda: value_and_grads())()
    np.testing.assert_allclose(grouped, whole, rtol=0, atol=1e-6)
    np.testing.assert_allclose(gc, gc_whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gg, gg_whole, rtol=1e-5, atol=1e-5)


def test_row_groups_run_on_a_cpu_host_only(monkeypatch):
    # Dense 24 x 24 generators are dot products on every host; with 600 rows of 4 matrices
    # (36 KiB a row) the backward pass's rows exceed one 4 MiB group: a CPU host maps over the
    # groups (a scan around the squarings), a GPU host takes every row at once. (The GPU's
    # squarings in one loop here: its loop of fixed length is a scan too.)
    monkeypatch.setitem(expm.SQUARING_LOOPS, "default", "while")
    rng = np.random.default_rng(3)
    gen = jnp.asarray(np.stack([random_skew(rng, 4, 24, 1.0)]), jnp.float32)
    coef = jnp.asarray(rng.uniform(-1.0, 1.0, size=(600, 1)), jnp.float32)

    def scans(host):
        def f(c, g):
            return jnp.sum(expm_combination.expm_skew_combination(c, g, host=host))

        return str(jax.make_jaxpr(jax.grad(f, (0, 1)))(coef, gen)).count(" scan[")

    assert scans(expm.Host("cpu", 1)) > 0 and scans(expm.Host("gpu", 1)) == 0
    assert expm.Host("cpu", 2).groups_rows and not expm.Host("tpu", 1).groups_rows
