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


def test_the_host_is_decided_outside_jit_and_shapes_the_program(monkeypatch):
    # 256 matrices of 40 x 40 are dots (above 32 x 32): one chunk per core on CPU, so a 2-core
    # host traces two independent copies of the squarings and a 1-core host one. (The GPU
    # host's squarings as one loop, as the CPU's: its two loops have their own test below.)
    monkeypatch.setitem(expm.SQUARING_LOOPS, "default", "while")
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


def _loops(fn, *args) -> tuple[int, int]:
    """(loops of known trip count FIXED_SQUARINGS, while loops) in the jaxpr of ``fn``."""
    text = str(jax.make_jaxpr(fn)(*args))
    return text.count(f"length={expm.FIXED_SQUARINGS}"), text.count(" while[")


def test_the_fixed_squaring_loop_squares_at_a_known_trip_count_first_to_the_same_rotations(
    monkeypatch,
):
    # Every platform's default is the data-dependent loop (the H100 measured it faster);
    # "fixed" is the option the device queue times beside it, here on a "gpu" host.
    # Norms from 1e-3 to 1e6: s from 0 to past FIXED_SQUARINGS, so the loop after the fixed one
    # runs too, and every matrix keeps its own s.
    rng = np.random.default_rng(5)
    a = random_skew(rng, 10, 8, 1.0) * np.logspace(-3, 6, 10)[:, None, None]
    a = jnp.asarray(a, jnp.float32)
    assert int(expm.num_squarings(a).max()) > expm.FIXED_SQUARINGS
    w = jnp.asarray(rng.normal(size=a.shape), jnp.float32)
    cpu, gpu, tpu = expm.Host("cpu", 1), expm.Host("gpu", 1), expm.Host("tpu", 1)
    assert cpu.fixed_squarings == gpu.fixed_squarings == tpu.fixed_squarings == 0
    monkeypatch.setitem(expm.SQUARING_LOOPS, "gpu", "fixed")
    assert gpu.fixed_squarings == expm.FIXED_SQUARINGS and cpu.fixed_squarings == 0

    def value_and_grad(host):
        return jax.value_and_grad(lambda x: jnp.sum(w * expm.expm_skew(x, host=host)))

    # The forward pass and the VJP's (the Frechet derivative through the same squarings).
    assert _loops(value_and_grad(cpu), a) == (0, 2)
    assert _loops(value_and_grad(gpu), a) == (2, 2)
    (v_cpu, g_cpu), (v_gpu, g_gpu) = (
        jax.jit(value_and_grad(cpu))(a),
        jax.jit(value_and_grad(gpu))(a),
    )
    np.testing.assert_allclose(v_gpu, v_cpu, rtol=1e-6)
    np.testing.assert_allclose(g_gpu, g_cpu, rtol=1e-5, atol=1e-6)
    r_cpu, r_gpu = expm.expm_skew(a, host=cpu), expm.expm_skew(a, host=gpu)
    np.testing.assert_allclose(r_gpu, r_cpu, rtol=0, atol=1e-6)


def test_an_unknown_squaring_loop_is_named(monkeypatch):
    monkeypatch.setitem(expm.SQUARING_LOOPS, "default", "unrolled")
    with pytest.raises(ValueError, match="SQUARING_LOOPS\\['gpu'\\]='unrolled'; expected one of"):
        expm.expm_skew(jnp.zeros((1, 8, 8)), host=expm.Host("gpu", 1))


def test_small_products_summed_in_one_reduce_give_the_adds_rotations_without_slices(monkeypatch):
    # "reduce" (the option the device queue times on GPUs) writes an H x H product as one
    # broadcast multiply summed over k; "adds" (every platform's default) slices a column and a
    # row per term, which an H100 ran as kernels of their own inside the squaring loop, and
    # computes the products that feed others as batched dots.
    rng = np.random.default_rng(6)
    a = random_skew(rng, 12, 8, 1.0) * np.logspace(-2, 3, 12)[:, None, None]
    a = jnp.asarray(a, jnp.float32)
    w = jnp.asarray(rng.normal(size=a.shape), jnp.float32)
    gpu = expm.Host("gpu", 1)
    assert gpu.small_products == "adds"

    def value_and_grad(x):
        return jax.value_and_grad(lambda y: jnp.sum(w * expm.expm_skew(y, host=gpu)))(x)

    def traced(table_choice):  # the table is read when traced: trace again
        monkeypatch.setitem(expm.SMALL_PRODUCTS, "gpu", table_choice)
        jax.clear_caches()
        rotations = np.float64(expm.expm_skew(a, host=gpu))
        return str(jax.make_jaxpr(value_and_grad)(a)), rotations, jax.jit(value_and_grad)(a)[1]

    (adds_jaxpr, adds, adds_grad), (reduce_jaxpr, reduce, reduce_grad) = map(
        traced, ("adds", "reduce")
    )
    assert gpu.small_products == "reduce"
    assert " slice[" in adds_jaxpr and " slice[" not in reduce_jaxpr
    assert "dot_general" in adds_jaxpr and "dot_general" not in reduce_jaxpr
    # The sums run in another order: each form within float32 rounding of float64's expm.
    exact = np.stack([scipy.linalg.expm(np.float64(x)) for x in a])
    err_adds, err_reduce = np.abs(adds - exact).max(), np.abs(reduce - exact).max()
    assert err_adds < 1e-4 and err_reduce < 2 * err_adds, (err_reduce, err_adds)
    np.testing.assert_allclose(reduce_grad, adds_grad, rtol=1e-4, atol=1e-4)
    monkeypatch.setitem(expm.SMALL_PRODUCTS, "gpu", "einsum")
    jax.clear_caches()
    with pytest.raises(ValueError, match="SMALL_PRODUCTS\\['gpu'\\]='einsum'; expected one of"):
        expm.expm_skew(a, host=gpu)
