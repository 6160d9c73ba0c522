"""lie.py: skew matrices, the Cayley transform (float64 formula, pivoting, VJP, no deadlock),
pair and block rotations."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import lie
from tests.encodings.reference import random_skew


def test_skew_from_upper_uses_only_the_strict_upper_triangle():
    raw = np.random.default_rng(5).normal(size=(5, 5)).astype(np.float32)
    s = np.asarray(lie.skew_from_upper(raw))
    np.testing.assert_array_equal(s, -s.T)
    np.testing.assert_array_equal(np.triu(s, 1), np.triu(raw, 1))


@pytest.mark.parametrize("h, norm", [(7, 4.0), (64, 0.1), (64, 1.0), (64, 30.0), (64, 1e3)])
def test_cayley_against_float64_formula(h, norm):
    s = random_skew(np.random.default_rng(6), 3, h, norm).astype(np.float32)
    eye = np.eye(h)
    expected = np.stack([(eye - m) @ np.linalg.inv(eye + m) for m in s.astype(np.float64)])
    p = np.asarray(lie.cayley(s), np.float64)
    np.testing.assert_allclose(p, expected, rtol=0, atol=3e-6)
    np.testing.assert_allclose(np.swapaxes(p, -1, -2) @ p, np.broadcast_to(eye, p.shape), atol=5e-6)
    np.testing.assert_array_equal(np.asarray(lie.cayley(np.zeros((2, h, h)))), [np.eye(h)] * 2)


def test_cayley_needs_pivoting_and_gets_it():
    # Leading entries of I + S near zero would break elimination without row exchanges; a
    # permutation of a skew matrix is skew, and P must still match the formula.
    s = np.zeros((1, 4, 4))
    s[0, 0, 1], s[0, 1, 0] = 1e4, -1e4
    s[0, 2, 3], s[0, 3, 2] = 0.5, -0.5
    expected = (np.eye(4) - s[0]) @ np.linalg.inv(np.eye(4) + s[0])
    np.testing.assert_allclose(lie.cayley(s)[0], expected, atol=1e-6)


@pytest.mark.parametrize("h", [5, 16])
def test_cayley_vjp_matches_finite_differences(h):
    rng = np.random.default_rng(16)
    s, d = random_skew(rng, 2, h, 3.0), random_skew(rng, 2, h, 1.0)
    w = rng.normal(size=(2, h, h))
    grad = jax.grad(lambda x: jnp.sum(jnp.asarray(w, jnp.float32) * lie.cayley(x)))(
        jnp.asarray(s, jnp.float32)
    )

    def loss64(x):
        eye = np.eye(h)
        return np.sum(w * np.stack([(eye - m) @ np.linalg.inv(eye + m) for m in x]))

    eps = 1e-6
    fd = (loss64(s + eps * d) - loss64(s - eps * d)) / (2 * eps)
    np.testing.assert_allclose(np.sum(np.asarray(grad) * d), fd, rtol=1e-4)


def test_cayley_of_many_layers_in_one_program_does_not_deadlock():
    # jnp.linalg.solve (LAPACK LU on CPU) deadlocks on a 2-core machine with a dozen batched
    # 64 x 64 solves in one jit (jax 0.10.2); cayley must not. Run in a subprocess with a
    # timeout so a hang fails the test instead of the whole suite.
    code = (
        "import jax, jax.numpy as jnp\n"
        "from rope_lie.encodings import lie\n"
        "x = jax.random.normal(jax.random.key(0), (12, 3, 64, 64)) * 0.1\n"
        "s = x - jnp.swapaxes(x, -1, -2)\n"
        "f = jax.jit(jax.grad(lambda s: sum(jnp.sum(lie.cayley(s[i]) ** 3) for i in range(12))))\n"
        "for _ in range(10):\n"
        "    jax.block_until_ready(f(s))\n"
        "print('done')\n"
    )
    # As users run it: XLA's default flags and OpenBLAS's default threads (conftest sets both).
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    env["XLA_FLAGS"] = ""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]


def test_rotate_pairs_is_the_interleaved_convention():
    x = np.arange(1.0, 6.0)  # (a0, b0, a1, b1, leftover)
    t = np.array([0.3, -1.1])
    out = np.asarray(lie.rotate_pairs(jnp.asarray(x, jnp.float32), jnp.asarray(t, jnp.float32)))
    for j in range(2):
        a, b = x[2 * j], x[2 * j + 1]
        expected = [a * np.cos(t[j]) - b * np.sin(t[j]), a * np.sin(t[j]) + b * np.cos(t[j])]
        np.testing.assert_allclose(out[2 * j : 2 * j + 2], expected, rtol=1e-6)
    assert out[4] == x[4]


def test_apply_blocks_equals_dense_block_diagonal_product():
    rng = np.random.default_rng(7)
    r = rng.normal(size=(4, 2, 2, 3, 3))  # (T, N, K, b, b); H = 7 leaves one channel
    x = rng.normal(size=(2, 4, 2, 7))
    dense = np.zeros((4, 2, 7, 7))
    for k in range(2):
        dense[..., 3 * k : 3 * k + 3, 3 * k : 3 * k + 3] = r[:, :, k]
    dense[..., 6, 6] = 1.0
    expected = np.einsum("TNij,BTNj->BTNi", dense, x)
    np.testing.assert_allclose(
        lie.apply_blocks(jnp.asarray(x), jnp.asarray(r)), expected, rtol=1e-5, atol=1e-5
    )
    per_example = np.broadcast_to(r, (2, *r.shape))
    np.testing.assert_allclose(
        lie.apply_blocks(jnp.asarray(x), jnp.asarray(per_example)), expected, rtol=1e-5, atol=1e-5
    )
