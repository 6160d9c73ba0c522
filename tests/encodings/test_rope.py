"""RoPE (1D): float64 reference of RoFormer's formula, relativity, dtypes, per-example positions."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import rope

KEY = jax.random.key(0)


def rotate_ref(x, angle):
    """Float64 rotation of interleaved pairs as complex numbers (the form of RoFormer, rope-vit)."""
    x = np.asarray(x, np.float64)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)
    out = np.empty(x.shape)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def angles_ref(pos_XA, head_dim, base):
    """theta_j(p) = p * base^(-2j/H), float64 (..., F)."""
    j = np.arange(head_dim // 2)
    return np.asarray(pos_XA, np.float64)[..., :1] * base ** (-2.0 * j / head_dim)


def scores_ref(q, k, pos_q, pos_k, head_dim, base):
    """<R(p_i) q_i, R(p'_j) k_j> from the position differences only, float64 (B, N, T, S)."""
    zq = q[..., 0::2] + 1j * q[..., 1::2]
    zk = k[..., 0::2] + 1j * k[..., 1::2]
    diff_TS1 = np.asarray(pos_q, np.float64)[:, None] - np.asarray(pos_k, np.float64)[None]
    phase_TSF = np.exp(1j * angles_ref(diff_TS1, head_dim, base))
    return np.einsum("btnf,bsnf,tsf->bnts", zq, np.conj(zk), phase_TSF).real


def _x(shape, seed=0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


@pytest.mark.parametrize("head_dim", [8, 16])
@pytest.mark.parametrize("base", [10000.0, 100.0])
def test_matches_float64_reference(head_dim, base):
    x = _x((2, 7, 3, head_dim))
    pos_TA = np.random.default_rng(1).uniform(-5.0, 20.0, (7, 1))
    params = rope.init(KEY, num_heads=3, head_dim=head_dim, num_axes=1, base=base)
    assert params == {}
    out = rope.apply(params, x, jnp.asarray(pos_TA, jnp.float32), base=base)
    chex.assert_shape(out, x.shape)
    ref = rotate_ref(x, angles_ref(pos_TA, head_dim, base)[:, None, :])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_default_base_is_10000():
    x = _x((1, 5, 2, 8))
    pos_TA = jnp.arange(5.0)[:, None] * 3.0
    out = rope.apply({}, x, pos_TA)
    ref = rotate_ref(x, angles_ref(pos_TA, 8, 10000.0)[:, None, :])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_integer_positions_accepted():
    x = _x((2, 6, 2, 8))
    out_int = rope.apply({}, x, jnp.arange(6, dtype=jnp.int32)[:, None])
    out_float = rope.apply({}, x, jnp.arange(6.0)[:, None])
    np.testing.assert_array_equal(out_int, out_float)


def test_relative_position_property():
    """q.k at (p, p') equals q.k at (p + t, p' + t), and both match the difference-only ref."""
    rng = np.random.default_rng(2)
    q, k = _x((2, 6, 2, 16), seed=3), _x((2, 6, 2, 16), seed=4)
    pos_q, pos_k = rng.uniform(0, 10, (6, 1)), rng.uniform(0, 10, (6, 1))
    ref = scores_ref(np.asarray(q), np.asarray(k), pos_q, pos_k, 16, 10000.0)
    for t in rng.uniform(-20, 20, 4):
        qr = rope.apply({}, q, jnp.asarray(pos_q + t, jnp.float32))
        kr = rope.apply({}, k, jnp.asarray(pos_k + t, jnp.float32))
        scores = jnp.einsum("btnh,bsnh->bnts", qr, kr)
        np.testing.assert_allclose(scores, ref, rtol=1e-4, atol=1e-4)


def test_bfloat16_in_bfloat16_out():
    x = _x((2, 5, 2, 8), dtype=jnp.bfloat16)
    pos_TA = jnp.arange(5.0)[:, None] * 7.0
    out = rope.apply({}, x, pos_TA)
    assert out.dtype == jnp.bfloat16
    ref = rotate_ref(np.asarray(x, np.float32), angles_ref(pos_TA, 8, 10000.0)[:, None, :])
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2e-2, atol=2e-2)


def test_per_example_positions_equal_separate_application():
    x = _x((3, 5, 2, 8))
    pos_BTA = jnp.asarray(np.random.default_rng(5).uniform(0, 30, (3, 5, 1)), jnp.float32)
    out = rope.apply({}, x, pos_BTA)
    for b in range(3):
        np.testing.assert_allclose(out[b : b + 1], rope.apply({}, x[b : b + 1], pos_BTA[b]))


def test_per_example_positions_differ_from_shared():
    """Guards the per-example path against silently using example 0's positions."""
    x = _x((2, 5, 2, 8))
    pos_BTA = jnp.stack([jnp.arange(5.0), 2 * jnp.arange(5.0)])[..., None]
    out = rope.apply({}, x, pos_BTA)
    assert not np.allclose(out[1], rope.apply({}, x, pos_BTA[0])[1])


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


def test_unknown_hparam_is_a_type_error():
    with pytest.raises(TypeError, match="theta"):
        rope.init(KEY, num_heads=2, head_dim=8, num_axes=1, theta=100.0)


def test_apply_hparams():
    assert rope.APPLY_HPARAMS == ("base", "rotary_fraction")
