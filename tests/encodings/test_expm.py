"""expm.py: the skew expm and its combination form against scipy's float64 expm, closed forms,
VJPs, squaring counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from rope_lie.encodings import expm


def _random_skew(rng, batch, h, norm):
    w = rng.normal(size=(batch, h, h))
    a = w - np.swapaxes(w, -1, -2)
    return a / np.linalg.norm(a, axis=(-2, -1), keepdims=True) * norm


@pytest.mark.parametrize("h", [2, 3, 8, 16])
@pytest.mark.parametrize(
    "norm,tol", [(1e-6, 1e-6), (0.5, 1e-6), (10.0, 2e-6), (1e2, 1e-5), (1e3, 1e-4)]
)
def test_expm_skew_matches_scipy_float64(h, norm, tol):
    a = _random_skew(np.random.default_rng(h), 6, h, norm)
    r = np.asarray(expm.expm_skew(a), np.float64)
    expected = np.stack([scipy.linalg.expm(m) for m in a])
    np.testing.assert_allclose(r, expected, rtol=0, atol=tol)
    np.testing.assert_allclose(
        np.swapaxes(r, -1, -2) @ r, np.broadcast_to(np.eye(h), r.shape), atol=2 * tol
    )


def test_expm_skew_finite_and_orthogonal_at_huge_norms():
    a = _random_skew(np.random.default_rng(0), 4, 16, 1e4)
    a = np.concatenate([a, _random_skew(np.random.default_rng(1), 1, 16, 1e6)])
    r = np.asarray(expm.expm_skew(a))
    assert np.isfinite(r).all()
    ortho = np.swapaxes(r, -1, -2) @ r - np.eye(16)
    assert np.abs(ortho[:4]).max() < 1e-3


def test_expm_skew_mixed_norms_in_one_batch():
    # Each matrix gets its own number of squarings: tiny ones must not be over-squared.
    rng = np.random.default_rng(2)
    a = np.concatenate([_random_skew(rng, 1, 8, n) for n in (1e-3, 1.0, 50.0, 400.0)])
    expected = np.stack([scipy.linalg.expm(m) for m in a])
    np.testing.assert_allclose(expm.expm_skew(a), expected, atol=5e-5)


def test_num_squarings_bounds_the_scaled_spectral_radius():
    a = _random_skew(np.random.default_rng(3), 16, 8, 1.0) * np.logspace(-3, 4, 16)[:, None, None]
    s = np.asarray(expm.num_squarings(jnp.asarray(a, jnp.float32)))
    rho = np.abs(np.linalg.eigvals(a)).max(axis=-1)
    assert (rho / 2.0**s <= 2.0 + 1e-4).all()
    assert (s[rho < 2.0] == 0).all()


def test_expm_skew_vjp_matches_finite_differences():
    rng = np.random.default_rng(4)
    a = jnp.asarray(_random_skew(rng, 2, 6, 3.0), jnp.float32)
    w = jnp.asarray(rng.normal(size=a.shape), jnp.float32)

    def f(x):
        return jnp.sum(w * expm.expm_skew(x))

    g = jax.grad(f)(a)
    # Central differences in float64 through scipy's expm along a random skew direction.
    d = _random_skew(rng, 2, 6, 1.0)
    eps = 1e-5
    a64 = np.asarray(a, np.float64)
    plus = sum(np.sum(np.asarray(w)[i] * scipy.linalg.expm(a64[i] + eps * d[i])) for i in range(2))
    minus = sum(np.sum(np.asarray(w)[i] * scipy.linalg.expm(a64[i] - eps * d[i])) for i in range(2))
    np.testing.assert_allclose(np.sum(np.asarray(g) * d), (plus - minus) / (2 * eps), rtol=1e-3)


def test_expm_skew_rejects_non_square():
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        expm.expm_skew(jnp.zeros((3, 4)))


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
    gen = np.stack([_random_skew(rng, 1, h, n)[0] for n in norms]).reshape(num_axes, 2, h, h)
    coef = rng.uniform(-1.5, 1.5, size=(130, num_axes))
    coef[0] = 0.0
    r = np.asarray(expm.expm_skew_combination(coef, gen), np.float64)
    expected = _combination_reference(coef, gen.astype(np.float32))
    np.testing.assert_allclose(r, expected, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(r[0], np.broadcast_to(np.eye(h), (2, h, h)))


def test_expm_skew_combination_finite_at_huge_norms_and_zero_generators():
    rng = np.random.default_rng(11)
    gen = np.stack([_random_skew(rng, 2, 8, 1e6), np.zeros((2, 8, 8))])
    coef = np.array([[1.0, 3.0], [-2.0, 0.5]])
    r = np.asarray(expm.expm_skew_combination(coef, gen))
    assert np.isfinite(r).all()
    # Each squaring doubles the rounding error, so after s ~ 19 squarings orthogonality holds to
    # about 2^s u (u = 2^-24 ~ 6e-8): ~3e-2 here (measured 0.6-1.7 x 2^s u over seeds).
    # Jitted: one compiled program instead of hundreds of eagerly dispatched operations.
    squarings = jax.jit(lambda c, g: expm._combination_setup(c, g)[0])
    s = np.asarray(squarings(jnp.asarray(coef, jnp.float32), jnp.asarray(gen, jnp.float32)))
    assert s.max() >= 17
    ortho = np.abs(np.swapaxes(r, -1, -2) @ r - np.eye(8)).max(axis=(-2, -1))
    assert (ortho <= 4.0 * 2.0 ** s[:, None] * 2.0**-24).all(), (ortho, s)
    zero = np.asarray(expm.expm_skew_combination(np.ones((3, 2)), np.zeros((2, 4, 6, 6))))
    np.testing.assert_array_equal(zero, np.broadcast_to(np.eye(6), zero.shape))


@pytest.mark.parametrize("h", [4, 6])
def test_expm_skew_combination_vjp_matches_finite_differences(h):
    rng = np.random.default_rng(12)
    gen = np.stack([_random_skew(rng, 3, h, 5.0), _random_skew(rng, 3, h, 2.0)])
    coef = rng.uniform(-1.0, 1.0, size=(4, 2))
    w = rng.normal(size=(4, 3, h, h))

    def loss(c, g):
        return jnp.sum(jnp.asarray(w, jnp.float32) * expm.expm_skew_combination(c, g))

    grad_c, grad_g = jax.grad(loss, (0, 1))(jnp.asarray(coef, jnp.float32),
                                             jnp.asarray(gen, jnp.float32))  # fmt: skip
    d_c, d_g = rng.normal(size=coef.shape), np.stack([_random_skew(rng, 3, h, 1.0)] * 2)
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
    gen = jnp.asarray(np.stack([_random_skew(rng, 2, h, 3.0), _random_skew(rng, 2, h, 1.0)]),
                      jnp.float32)  # fmt: skip
    coef = jnp.asarray(rng.uniform(-1.0, 1.0, size=(37, 2)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(37, 2, h, h)), jnp.float32)

    def value_and_grads():
        f = lambda c, g: jnp.sum(w * expm.expm_skew_combination(c, g))  # noqa: E731
        return expm.expm_skew_combination(coef, gen), jax.grad(f, (0, 1))(coef, gen)

    whole, (gc_whole, gg_whole) = value_and_grads()
    monkeypatch.setattr(expm, "_GROUP_BYTES", 8 * 2 * h * h * 4)
    # The exponential reads _GROUP_BYTES when traced, and jit and custom_vjp cache their traces
    # per function: fresh ones trace it again (jax.clear_caches() would do it too, but then
    # every later test recompiles what it shares with earlier ones).
    fresh = jax.custom_vjp(expm._combination_impl, nondiff_argnums=(2,))
    fresh.defvjp(expm._combination_fwd, expm._combination_bwd)
    monkeypatch.setattr(expm, "_combination_jit", jax.jit(fresh, static_argnums=2))
    grouped, (gc, gg) = value_and_grads()
    np.testing.assert_allclose(grouped, whole, rtol=0, atol=1e-6)
    np.testing.assert_allclose(gc, gc_whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gg, gg_whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("h", [3, 4])
@pytest.mark.parametrize("norm", [0.0, 1e-4, 0.7, 30.0, 1e3])
def test_closed_forms_match_scipy_float64(h, norm):
    a = _random_skew(np.random.default_rng(13), 5, h, max(norm, 1e-30)) * (norm > 0)
    r = np.asarray(expm.expm_skew(a), np.float64)
    expected = np.stack([scipy.linalg.expm(m) for m in a.astype(np.float32)])
    np.testing.assert_allclose(r, expected, rtol=0, atol=max(1e-6, 6e-8 * norm))
    # Finite gradients at 0 (where sqrt would not be differentiable).
    grad = jax.grad(lambda x: jnp.sum(expm.expm_skew(x) ** 3))(jnp.asarray(a, jnp.float32))
    assert np.isfinite(np.asarray(grad)).all()


def test_expm_skew_chunked_batch_matches_per_matrix():
    # H = 40 and 150 matrices: on CPU the batched products run in one chunk per core.
    a = _random_skew(np.random.default_rng(14), 150, 40, 25.0)
    r = np.asarray(expm.expm_skew(a))
    for i in (0, 74, 75, 149):
        np.testing.assert_allclose(r[i], np.asarray(expm.expm_skew(a[i])), atol=1e-6)
    np.testing.assert_allclose(r[:3], [scipy.linalg.expm(m) for m in a[:3]], atol=2e-6)


def test_num_squarings_is_tighter_than_frobenius():
    a = _random_skew(np.random.default_rng(15), 32, 64, 1.0) * 300.0
    s = np.asarray(expm.num_squarings(jnp.asarray(a, jnp.float32)))
    frobenius = np.ceil(np.log2(np.linalg.norm(a, axis=(-2, -1)) / np.sqrt(2) / 2.0))
    assert (s <= frobenius).all() and (s < frobenius).any()


def test_the_host_is_decided_outside_jit_and_shapes_the_program():
    # 256 matrices of 40 x 40 are dots (above 32 x 32): one chunk per core on CPU, so a 2-core
    # host traces two independent copies of the squarings and a 1-core host one.
    a = jnp.asarray(np.stack([_random_skew(np.random.default_rng(i), 1, 40, 1.0)[0]
                              for i in range(256)]), jnp.float32)  # fmt: skip

    def dots(host):
        return str(jax.make_jaxpr(lambda x: expm.expm_skew(x, host=host))(a)).count("dot_general")

    one, two = expm.Host("cpu", 1), expm.Host("cpu", 2)
    assert dots(two) == 2 * dots(one) > 0
    assert dots(expm.Host("gpu", 1)) == dots(one)  # assumed: one chunk off CPU
    np.testing.assert_allclose(expm.expm_skew(a, host=two), expm.expm_skew(a, host=one), atol=1e-6)
    assert expm.this_host() is expm.this_host()  # decided once per process
    assert expm.this_host().platform == jax.default_backend()
    with pytest.raises(TypeError, match="host='cpu' must be an expm.Host"):
        expm.expm_skew(a, host="cpu")
