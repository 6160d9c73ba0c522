"""Circulant-STRING: dense float64 expm reference, orthogonality, relativity, redundancy."""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from rope_lie.encodings import circulant_string

# Jitted once per shape: compiling is much cheaper than eager op-by-op dispatch on CPU.
_apply = jax.jit(circulant_string.apply)


def _dense_generators(c_ANH) -> np.ndarray:
    """``C - C^T`` with ``C[i, j] = c[(i - j) mod H]``, float64 of shape (A, N, H, H)."""
    c = np.asarray(c_ANH, np.float64)
    head_dim = c.shape[-1]
    index_HH = (np.arange(head_dim)[:, None] - np.arange(head_dim)[None, :]) % head_dim
    circ = c[..., index_HH]
    return circ - np.swapaxes(circ, -1, -2)


def _reference_apply(c_ANH, x_BTNH, pos) -> np.ndarray:
    """x' = expm(sum_a p_a L_a) x per token and head, by scipy in float64."""
    gen = _dense_generators(c_ANH)
    x = np.asarray(x_BTNH, np.float64)
    pos = np.broadcast_to(np.asarray(pos, np.float64), (x.shape[0], *np.shape(pos)[-2:]))
    out = np.empty_like(x)
    for b, t, n in itertools.product(*map(range, x.shape[:3])):
        rot = scipy.linalg.expm(np.einsum("a,aij->ij", pos[b, t], gen[:, n]))
        out[b, t, n] = rot @ x[b, t, n]
    return out


def _setup(head_dim, num_axes, num_heads=2, tokens=5, batch=2, init_std=0.3, seed=0):
    """Params, x and pos_TA from numpy's RNG (jax.random would compile per shape)."""
    rng = np.random.default_rng(seed)
    c_ANH = init_std * rng.normal(size=(num_axes, num_heads, head_dim))
    params = {"c_ANH": jnp.asarray(c_ANH, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(batch, tokens, num_heads, head_dim)), jnp.float32)
    pos = jnp.asarray(3.0 * rng.normal(size=(tokens, num_axes)), jnp.float32)
    return params, x, pos


def _rotation_matrices(params, pos_TA, head_dim) -> np.ndarray:
    """R(p) as dense (T, N, H, H) matrices read off by rotating the standard basis."""
    num_heads = params["c_ANH"].shape[1]
    eye = jnp.broadcast_to(
        jnp.eye(head_dim)[:, None, None, :], (head_dim, pos_TA.shape[0], num_heads, head_dim)
    )
    cols_BTNH = _apply(params, eye, pos_TA)  # batch index = basis vector
    return np.asarray(jnp.moveaxis(cols_BTNH, 0, -1), np.float64)


@pytest.mark.parametrize(
    "head_dim, num_axes", [(3, 1), (5, 2), (8, 1), (8, 3), (9, 2), (16, 2), (16, 3)]
)
def test_matches_dense_expm(head_dim, num_axes):
    params, x, pos = _setup(head_dim, num_axes)
    out = _apply(params, x, pos)
    chex.assert_shape(out, x.shape)
    ref = _reference_apply(params["c_ANH"], x, pos)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-5)


def test_per_example_positions_match_dense_expm():
    params, x, _ = _setup(head_dim=10, num_axes=2)
    pos_BTA = jnp.asarray(np.random.default_rng(7).uniform(-4.0, 4.0, (2, 5, 2)), jnp.float32)
    out = _apply(params, x, pos_BTA)
    ref = _reference_apply(params["c_ANH"], x, pos_BTA)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [7, 12])
def test_rotations_are_orthogonal(head_dim):
    params, _, pos = _setup(head_dim, num_axes=2)
    rot = _rotation_matrices(params, pos, head_dim)
    eye = np.broadcast_to(np.eye(head_dim), rot.shape)
    np.testing.assert_allclose(np.swapaxes(rot, -1, -2) @ rot, eye, atol=1e-5)
    np.testing.assert_allclose(np.linalg.det(rot), 1.0, atol=1e-4)


@pytest.mark.parametrize("head_dim", [5, 8])
def test_zero_position_is_identity(head_dim):
    params, x, _ = _setup(head_dim, num_axes=3)
    out = _apply(params, x, jnp.zeros((x.shape[1], 3)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(x), atol=1e-6)


@pytest.mark.parametrize("head_dim", [9, 16])
def test_translation_invariance(head_dim):
    """<R(p) q, R(p') k> = <q, R(p' - p) k>, exactly because the generators commute."""
    params, q, pos = _setup(head_dim, num_axes=2, seed=1)
    k = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    shift = jnp.array([[2.5, -1.75]])
    rq, rk = _apply(params, q, pos), _apply(params, k, pos)
    rq_shift = _apply(params, q, pos + shift)
    rk_shift = _apply(params, k, pos + shift)
    logits = jnp.einsum("BTNH,BSNH->BNTS", rq, rk)
    logits_shift = jnp.einsum("BTNH,BSNH->BNTS", rq_shift, rk_shift)
    np.testing.assert_allclose(np.asarray(logits_shift), np.asarray(logits), atol=1e-4)

    # float64: the generators built from the module's first columns commute, so
    # R(p)^T R(p') = R(p' - p) to double precision.
    g_ANH = np.asarray(circulant_string.generator_columns(params["c_ANH"]), np.float64)
    index_HH = (np.arange(head_dim)[:, None] - np.arange(head_dim)[None, :]) % head_dim
    gen = g_ANH[..., index_HH]
    np.testing.assert_allclose(gen, -np.swapaxes(gen, -1, -2), atol=0)
    np.testing.assert_allclose(gen[0] @ gen[1], gen[1] @ gen[0], atol=1e-12)
    p, p_prime = np.array([0.3, -1.2]), np.array([2.1, 0.4])
    for n in range(gen.shape[1]):
        r = scipy.linalg.expm(np.einsum("a,aij->ij", p, gen[:, n]))
        r_prime = scipy.linalg.expm(np.einsum("a,aij->ij", p_prime, gen[:, n]))
        r_rel = scipy.linalg.expm(np.einsum("a,aij->ij", p_prime - p, gen[:, n]))
        np.testing.assert_allclose(r.T @ r_prime, r_rel, atol=1e-12)


@pytest.mark.parametrize("head_dim", [6, 7])
def test_frequencies_are_generator_eigenvalues(head_dim):
    """L_a v_k = i theta_ak v_k for the Fourier vectors v_k[j] = exp(2 pi i j k / H)."""
    params, _, _ = _setup(head_dim, num_axes=2)
    theta_ANJ = np.asarray(circulant_string.frequencies(params), np.float64)
    chex.assert_shape(theta_ANJ, (2, 2, head_dim // 2 + 1))
    gen = _dense_generators(params["c_ANH"])
    for k in range(head_dim // 2 + 1):
        v_H = np.exp(2j * np.pi * np.arange(head_dim) * k / head_dim)
        np.testing.assert_allclose(gen @ v_H, 1j * theta_ANJ[..., k, None] * v_H, atol=1e-5)
    np.testing.assert_allclose(theta_ANJ[..., 0], 0.0, atol=1e-6)  # DC bin is never rotated


@pytest.mark.parametrize("head_dim", [7, 8])
def test_redundant_entries_get_antisymmetric_or_zero_gradient(head_dim):
    """Only c_i - c_(H-i) matters: grad[i] = -grad[H-i]; c_0 (and c_(H/2) for even H) cancel."""
    params, x, pos = _setup(head_dim, num_axes=1)
    target = jnp.asarray(np.random.default_rng(3).normal(size=x.shape), jnp.float32)

    def loss(p):
        return jnp.sum(_apply(p, x, pos) * target)

    grad = np.asarray(jax.grad(loss)(params)["c_ANH"], np.float64)
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(grad[..., 0], 0.0, atol=1e-6)
    i = np.arange(1, head_dim)
    np.testing.assert_allclose(grad[..., i], -grad[..., head_dim - i], atol=1e-5)
    effective = grad[..., 1 : (head_dim + 1) // 2]
    assert np.all(np.abs(effective) > 1e-6)
    if head_dim % 2 == 0:
        np.testing.assert_allclose(grad[..., head_dim // 2], 0.0, atol=1e-6)


def test_init_distribution():
    params = circulant_string.init(
        jax.random.key(0), num_heads=4, head_dim=64, num_axes=3, init_std=0.25
    )
    assert set(params) == {"c_ANH"}
    c = params["c_ANH"]
    chex.assert_shape(c, (3, 4, 64))
    chex.assert_type(c, jnp.float32)
    np.testing.assert_allclose(np.std(np.asarray(c)), 0.25, rtol=0.1)
    np.testing.assert_allclose(np.mean(np.asarray(c)), 0.0, atol=0.03)


@pytest.mark.parametrize("head_dim", [1, 2])
def test_rejects_trivial_head_dim(head_dim):
    with pytest.raises(ValueError, match=f"head_dim={head_dim}"):
        circulant_string.init(jax.random.key(0), num_heads=2, head_dim=head_dim, num_axes=2)


@pytest.mark.parametrize("init_std", [-0.1, float("nan"), "0.1"])
def test_rejects_bad_init_std(init_std):
    with pytest.raises(ValueError, match="init_std="):
        circulant_string.init(
            jax.random.key(0), num_heads=2, head_dim=8, num_axes=2, init_std=init_std
        )


def test_apply_errors_name_the_mismatch():
    params, x, pos = _setup(head_dim=8, num_axes=2)
    with pytest.raises(ValueError, match="A=3"):
        circulant_string.apply(params, x, jnp.zeros((x.shape[1], 3)))
    with pytest.raises(ValueError, match=r"\(N, H\)=\(2, 6\)"):
        circulant_string.apply(params, x[..., :6], pos)
    with pytest.raises(ValueError, match="c_ANH"):
        circulant_string.apply({"freqs_ANF": params["c_ANH"]}, x, pos)
