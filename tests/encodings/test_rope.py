"""RoPE (1D): float64 reference of RoFormer's formula, relativity, dtypes, per-example positions."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import rope
from tests.encodings.reference import (
    normal,
    rope_angles,
    rotate_pairs,
    scores_from_phases,
)

KEY = jax.random.key(0)


@pytest.mark.parametrize("head_dim", [8, 16])
@pytest.mark.parametrize("base", [10000.0, 100.0])
def test_matches_float64_reference(head_dim, base):
    x = normal((2, 7, 3, head_dim))
    pos_TA = np.random.default_rng(1).uniform(-5.0, 20.0, (7, 1))
    params = rope.init(KEY, num_heads=3, head_dim=head_dim, num_axes=1, base=base)
    assert params == {}
    out = rope.apply(params, x, jnp.asarray(pos_TA, jnp.float32), base=base)
    chex.assert_shape(out, x.shape)
    ref = rotate_pairs(x, rope_angles(pos_TA, head_dim, base)[:, None, :])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_default_base_is_10000():
    x = normal((1, 5, 2, 8))
    pos_TA = jnp.arange(5.0)[:, None] * 3.0
    out = rope.apply({}, x, pos_TA)
    ref = rotate_pairs(x, rope_angles(pos_TA, 8, 10000.0)[:, None, :])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_integer_positions_accepted():
    x = normal((2, 6, 2, 8))
    out_int = rope.apply({}, x, jnp.arange(6, dtype=jnp.int32)[:, None])
    out_float = rope.apply({}, x, jnp.arange(6.0)[:, None])
    np.testing.assert_array_equal(out_int, out_float)


def test_relative_position_property():
    """q.k at (p, p') equals q.k at (p + t, p' + t), and both match the difference-only ref."""
    rng = np.random.default_rng(2)
    q, k = normal((2, 6, 2, 16), seed=3), normal((2, 6, 2, 16), seed=4)
    pos_q, pos_k = rng.uniform(0, 10, (6, 1)), rng.uniform(0, 10, (6, 1))
    ref = scores_from_phases(q, k, rope_angles(pos_q[:, None] - pos_k[None], 16, 10000.0))
    for t in rng.uniform(-20, 20, 4):
        qr = rope.apply({}, q, jnp.asarray(pos_q + t, jnp.float32))
        kr = rope.apply({}, k, jnp.asarray(pos_k + t, jnp.float32))
        scores = jnp.einsum("btnh,bsnh->bnts", qr, kr)
        np.testing.assert_allclose(scores, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "x_shape, pos_shape, match",
    [
        ((5, 2, 8), (5, 1), r"rank 4.*\(5, 2, 8\)"),
        ((2, 5, 2, 8), (5,), r"\(T, A\) or \(B, T, A\).*\(5,\)"),
        ((2, 5, 2, 8), (4, 1), r"T=4 tokens but x has T=5"),
        ((2, 5, 2, 8), (3, 5, 1), r"B=3 but x has B=2"),
        ((2, 5, 2, 8), (5, 2), r"num_axes=2.*rope_axial or rope_mixed"),
        ((2, 5, 2, 7), (5, 1), r"head_dim=7 must be even"),
    ],
)
def test_apply_errors_name_the_bad_value(x_shape, pos_shape, match):
    with pytest.raises(ValueError, match=match):
        rope.apply({}, jnp.zeros(x_shape), jnp.zeros(pos_shape))


def test_apply_rejects_parameters_of_another_family():
    with pytest.raises(ValueError, match=r"expects params=\{\}.*freqs_ANF"):
        rope.apply({"freqs_ANF": jnp.zeros((1, 2, 4))}, jnp.zeros((2, 5, 2, 8)), jnp.zeros((5, 1)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_heads=2, head_dim=8, num_axes=2), r"num_axes=2.*rope_axial or rope_mixed"),
        (dict(num_heads=2, head_dim=8, num_axes=3), r"num_axes=3"),
        (dict(num_heads=2, head_dim=7, num_axes=1), r"head_dim=7 must be even"),
        (dict(num_heads=0, head_dim=8, num_axes=1), r"num_heads=0"),
        (dict(num_heads=2, head_dim=8, num_axes=1, base=0.0), r"base=0.0"),
        (dict(num_heads=2, head_dim=8, num_axes=1, base=-10.0), r"base=-10.0"),
        (dict(num_heads=2, head_dim=8, num_axes=1, base=float("inf")), r"base=inf"),
        (dict(num_heads=2, head_dim=8, num_axes=1, base="10000"), r"base='10000'"),
    ],
)
def test_init_errors_name_the_bad_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rope.init(KEY, **kwargs)


def test_apply_rejects_bad_base():
    with pytest.raises(ValueError, match=r"base=-1"):
        rope.apply({}, jnp.zeros((2, 5, 2, 8)), jnp.zeros((5, 1)), base=-1)


def test_apply_hparams():
    assert rope.APPLY_HPARAMS == ("base", "rotary_fraction")
