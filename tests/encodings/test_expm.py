"""expm.py: the skew expm and its combination form against scipy's float64 expm, closed forms,
VJPs, squaring counts, the host (the combination form: test_expm_combination.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from rope_lie.encodings import expm
from tests.encodings.reference import random_skew


@pytest.mark.parametrize("h", [2, 3, 8, 16])
@pytest.mark.parametrize(
    "norm,tol", [(1e-6, 1e-6), (0.5, 1e-6), (10.0, 2e-6), (1e2, 1e-5), (1e3, 1e-4)]
)
def test_expm_skew_matches_scipy_float64(h, norm, tol):
    a = random_skew(np.random.default_rng(h), 6, h, norm)
    r = np.asarray(expm.expm_skew(a), np.float64)
    expected = np.stack([scipy.linalg.expm(m) for m in a])
    np.testing.assert_allclose(r, expected, rtol=0, atol=tol)
    np.testing.assert_allclose(
        np.swapaxes(r, -1, -2) @ r, np.broadcast_to(np.eye(h), r.shape), atol=2 * tol
    )


def test_expm_skew_finite_and_orthogonal_at_huge_norms():
    a = random_skew(np.random.default_rng(0), 4, 16, 1e4)
    a = np.concatenate([a, random_skew(np.random.default_rng(1), 1, 16, 1e6)])
    r = np.asarray(expm.expm_skew(a))
    assert np.isfinite(r).all()
    ortho = np.swapaxes(r, -1, -2) @ r - np.eye(16)
    assert np.abs(ortho[:4]).max() < 1e-3


def test_expm_skew_mixed_norms_in_one_batch():
    # Each matrix gets its own number of squarings: tiny ones must not be over-squared.
    rng = np.random.default_rng(2)
    a = np.concatenate([random_skew(rng, 1, 8, n) for n in (1e-3, 1.0, 50.0, 400.0)])
    expected = np.stack([scipy.linalg.expm(m) for m in a])
    np.testing.assert_allclose(expm.expm_skew(a), expected, atol=5e-5)


def test_num_squarings_bounds_the_scaled_spectral_radius():
    a = random_skew(np.random.default_rng(3), 16, 8, 1.0) * np.logspace(-3, 4, 16)[:, None, None]
    s = np.asarray(expm.num_squarings(jnp.asarray(a, jnp.float32)))
    rho = np.abs(np.linalg.eigvals(a)).max(axis=-1)
    assert (rho / 2.0**s <= 2.0 + 1e-4).all()
    assert (s[rho < 2.0] == 0).all()


def test_expm_skew_vjp_matches_finite_differences():
    rng = np.random.default_rng(4)
    a = jnp.asarray(random_skew(rng, 2, 6, 3.0), jnp.float32)
    w = jnp.asarray(rng.normal(size=a.shape), jnp.float32)

    def f(x):
        return jnp.sum(w * expm.expm_skew(x))

    g = jax.grad(f)(a)
    # Central differences in float64 through scipy's expm along a random skew direction.
    d = random_skew(rng, 2, 6, 1.0)
    eps = 1e-5
    a64 = np.asarray(a, np.float64)
    plus = sum(np.sum(np.asarray(w)[i] * scipy.linalg.expm(a64[i] + eps * d[i])) for i in range(2))
    minus = sum(np.sum(np.asarray(w)[i] * scipy.linalg.expm(a64[i] - eps * d[i])) for i in range(2))
    np.testing.assert_allclose(np.sum(np.asarray(g) * d), (plus - minus) / (2 * eps), rtol=1e-3)


def test_expm_skew_rejects_non_square():
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        expm.expm_skew(jnp.zeros((3, 4)))


@pytest.mark.parametrize("h", [3, 4])
@pytest.mark.parametrize("norm", [0.0, 1e-4, 0.7, 30.0, 1e3])
def test_closed_forms_match_scipy_float64(h, norm):
    a = random_skew(np.random.default_rng(13), 5, h, max(norm, 1e-30)) * (norm > 0)
    r = np.asarray(expm.expm_skew(a), np.float64)
    expected = np.stack([scipy.linalg.expm(m) for m in a.astype(np.float32)])
    np.testing.assert_allclose(r, expected, rtol=0, atol=max(1e-6, 6e-8 * norm))
    # Finite gradients at 0 (where sqrt would not be differentiable).
    grad = jax.grad(lambda x: jnp.sum(expm.expm_skew(x) ** 3))(jnp.asarray(a, jnp.float32))
    assert np.isfinite(np.asarray(grad)).all()


def test_expm_skew_chunked_batch_matches_per_matrix():
    # H = 40 and 150 matrices: on CPU the batched products run in one chunk per core.
    a = random_skew(np.random.default_rng(14), 150, 40, 25.0)
    r = np.asarray(expm.expm_skew(a))
    for i in (0, 74, 75, 149):
        np.testing.assert_allclose(r[i], np.asarray(expm.expm_skew(a[i])), atol=1e-6)
    np.testing.assert_allclose(r[:3], [scipy.linalg.expm(m) for m in a[:3]], atol=2e-6)


def test_num_squarings_is_tighter_than_frobenius():
    a = random_skew(np.random.default_rng(15), 32, 64, 1.0) * 300.0
    s = np.asarray(expm.num_squarings(jnp.asarray(a, jnp.float32)))
    frobenius = np.ceil(np.log2(np.linalg.norm(a, axis=(-2, -1)) / np.sqrt(2) / 2.0))
    assert (s <= frobenius).all() and (s < frobenius).any()


def test_the_host_is_decided_outside_jit_and_shapes_the_program():
    # 256 matrices of 40 x 40 are dots (above 32 x 32): one chunk per core on CPU, so a 2-core
    # host traces two independent copies of the squarings and a 1-core host one.
    a = jnp.asarray(
        np.stack([random_skew(np.random.default_rng(i), 1, 40, 1.0)[0] for i in range(256)]),
        jnp.float32,
    )

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
