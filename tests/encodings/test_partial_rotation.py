"""p-RoPE (partial rotation, arXiv:2410.06205) in the fixed-frequency families and RoPE-Mixed:
the lowest frequencies of every axis unrotated, against float64 angle tables; p = 1 unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import fixed_frequency, rope, rope_axial, rope_mixed, visionllama

B, T, N = 1, 5, 2


def _inputs(num_axes, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    pos_TA = rng.uniform(-3.0, 3.0, (T, num_axes)).astype(np.float32)
    x_BTNH = rng.standard_normal((B, T, N, head_dim)).astype(np.float32)
    return pos_TA, x_BTNH


def _np_rotate(x_BTNH, angle_TF):
    """Interleaved pairs (2j, 2j+1) turned by angle[t, j], float64; channels past 2F kept."""
    x = np.asarray(x_BTNH, np.float64).copy()
    a, b = x[..., 0::2].copy(), x[..., 1::2].copy()
    cos, sin = np.cos(angle_TF)[None, :, None], np.sin(angle_TF)[None, :, None]
    x[..., 0::2], x[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return x


@pytest.mark.parametrize("fraction,kept", [(1.0, 8), (0.75, 6), (0.5, 4), (0.3, 2), (0.0, 0)])
def test_rope_keeps_the_highest_frequencies(fraction, kept):
    head_dim = 16
    pos_TA, x_BTNH = _inputs(1, head_dim)
    out = rope.apply({}, x_BTNH, pos_TA, rotary_fraction=fraction)
    freq_F = 10000.0 ** (-2.0 * np.arange(8) / head_dim)  # RoFormer's, highest first
    freq_F[kept:] = 0.0
    want = _np_rotate(x_BTNH, pos_TA.astype(np.float64) * freq_F)
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-5)
    # The unrotated pairs are exactly x.
    np.testing.assert_array_equal(out[..., 2 * kept :], x_BTNH[..., 2 * kept :])


def test_fraction_one_is_the_default_path():
    pos_TA, x_BTNH = _inputs(2, 16)
    for module in (rope_axial, visionllama):
        np.testing.assert_array_equal(
            module.apply({}, x_BTNH, pos_TA, rotary_fraction=1.0), module.apply({}, x_BTNH, pos_TA)
        )
    params = rope_mixed.init(jax.random.key(0), num_heads=N, head_dim=16, num_axes=2)
    np.testing.assert_array_equal(
        rope_mixed.apply(params, x_BTNH, pos_TA, rotary_fraction=1.0),
        rope_mixed.apply(params, x_BTNH, pos_TA),
    )


@pytest.mark.parametrize("module", [rope_axial, visionllama], ids=["rope_axial", "visionllama"])
def test_several_axes_truncate_per_axis(module):
    head_dim, fraction = 16, 0.5  # 4 pairs per axis, 2 kept on each
    pos_TA, x_BTNH = _inputs(2, head_dim)
    out = module.apply({}, x_BTNH, pos_TA, rotary_fraction=fraction)
    axis_F, freq_F = module.pair_frequencies(head_dim, 2, 100.0 if module is rope_axial else 1e4)
    kept = np.zeros(8, bool)
    for axis in (0, 1):  # written from the definition: the 2 largest of each axis
        pairs = np.flatnonzero(axis_F == axis)
        kept[pairs[np.argsort(-freq_F[pairs])[:2]]] = True
    angle_TF = pos_TA.astype(np.float64)[:, axis_F] * np.where(kept, freq_F, 0.0)
    np.testing.assert_allclose(out, _np_rotate(x_BTNH, angle_TF), rtol=0, atol=2e-5)
    assert kept.sum() == 4 and set(axis_F[kept]) == {0, 1}


def test_keep_high_frequencies_rounds_halves_up_and_keeps_ties_in_order():
    axis_F = np.array([0, 0, 0, 1, 1, 1])
    freq_F = np.array([1.0, 1.0, 0.5, 0.1, 0.3, 0.2])
    out = fixed_frequency.keep_high_frequencies(axis_F, freq_F, 0.5)  # 1.5 -> 2 per axis
    np.testing.assert_array_equal(out, [1.0, 1.0, 0.0, 0.0, 0.3, 0.2])
    out = fixed_frequency.keep_high_frequencies(axis_F, freq_F, 0.2)  # 0.6 -> 1 per axis
    np.testing.assert_array_equal(out, [1.0, 0.0, 0.0, 0.0, 0.3, 0.0])


def test_rope_mixed_leaves_the_low_magnitude_pairs_unrotated():
    head_dim, fraction = 16, 0.5  # groups of 4 pairs per axis, the first 2 of each rotated
    params = rope_mixed.init(
        jax.random.key(1), num_heads=N, head_dim=head_dim, num_axes=2, rotary_fraction=fraction
    )
    pos_TA, x_BTNH = _inputs(2, head_dim, seed=2)
    mask_F = rope_mixed.rotated_pairs(8, 2, fraction)
    np.testing.assert_array_equal(mask_F, [1, 1, 0, 0, 1, 1, 0, 0])
    out = rope_mixed.apply(params, x_BTNH, pos_TA)  # the fraction init was given
    freqs = np.asarray(params["freqs_ANF"], np.float64)
    for n in range(N):
        angle_TF = pos_TA.astype(np.float64) @ freqs[:, n] * mask_F
        want = _np_rotate(x_BTNH[:, :, n : n + 1], angle_TF)
        np.testing.assert_allclose(out[:, :, n : n + 1], want, rtol=0, atol=2e-5)
    # The masked frequencies get no gradient, the others do.
    k_BTNH = _inputs(2, head_dim, seed=3)[1]

    def loss(p):
        q = rope_mixed.apply(p, x_BTNH, pos_TA)
        k = rope_mixed.apply(p, k_BTNH, pos_TA)
        return jnp.sum(jnp.sin(jnp.einsum("BTNH,BSNH->BNTS", q, k)))

    grad = np.asarray(jax.grad(loss)(params)["freqs_ANF"])
    assert np.all(grad[..., ~mask_F] == 0) and np.all(np.abs(grad[..., mask_F]).max(-1) > 0)


@pytest.mark.parametrize("fraction", [-0.1, 1.5, True, "half"])
def test_bad_fractions_name_the_value(fraction):
    with pytest.raises(ValueError, match="rotary_fraction="):
        rope_axial.init(
            jax.random.key(0), num_heads=1, head_dim=8, num_axes=2, rotary_fraction=fraction
        )
    with pytest.raises(ValueError, match="rotary_fraction="):
        rope_mixed.init(
            jax.random.key(0), num_heads=1, head_dim=8, num_axes=2, rotary_fraction=fraction
        )
