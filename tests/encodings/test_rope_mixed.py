"""RoPE-Mixed: the rope-vit init (numpy re-implementation), its generalisation to 1D/3D, the
float64 reference of apply, the reduction to RoPE-Axial, relativity, gradients, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from rope_lie.encodings import rope_axial, rope_mixed, state
from tests.encodings.reference import mixed_angles, normal, rotate_pairs, scores_from_phases

KEY = jax.random.key(0)


def rope_vit_init(phi_N, dim, theta=10.0):
    """rope-vit ``init_random_2d_freqs`` in numpy with given per-head angles: (2=(x, y), N, F)."""
    mag = 1.0 / theta ** (np.arange(0, dim, 4)[: dim // 4] / dim)
    fx = [np.concatenate([mag * np.cos(a), mag * np.cos(np.pi / 2 + a)]) for a in phi_N]
    fy = [np.concatenate([mag * np.sin(a), mag * np.sin(np.pi / 2 + a)]) for a in phi_N]
    return np.stack([np.stack(fx), np.stack(fy)])


def axial_freqs_ref(num_heads, head_dim, num_axes, base):
    """Axis-aligned frequencies: pair a*F/A + i on axis a only, base^(-2A*i/H), float64."""
    per_axis = head_dim // 2 // num_axes
    freqs = np.zeros((num_axes, num_heads, head_dim // 2))
    for a in range(num_axes):
        for i in range(per_axis):
            freqs[a, :, a * per_axis + i] = base ** (-2.0 * num_axes * i / head_dim)
    return freqs


def group_magnitudes_ref(head_dim, num_axes, base):
    """|f[:, n, j]| expected from the init: base^(-2A*i/H), i counted within array_split groups."""
    sizes = [len(g) for g in np.array_split(np.arange(head_dim // 2), num_axes)]
    within = np.concatenate([np.arange(s) for s in sizes])
    return base ** (-2.0 * num_axes * within / head_dim), np.cumsum([0] + sizes[:-1])


@pytest.mark.parametrize("num_heads, head_dim, num_axes", [(3, 8, 2), (2, 16, 3), (4, 6, 1)])
def test_init_shapes_and_dtype(num_heads, head_dim, num_axes):
    params = rope_mixed.init(KEY, num_heads=num_heads, head_dim=head_dim, num_axes=num_axes)
    assert set(params) == {"freqs_ANF"}
    chex.assert_shape(params["freqs_ANF"], (num_axes, num_heads, head_dim // 2))
    assert params["freqs_ANF"].dtype == jnp.float32
    chex.assert_tree_all_finite(params)


@pytest.mark.parametrize("head_dim, base", [(8, 10.0), (16, 100.0), (32, 10.0)])
def test_2d_helper_matches_rope_vit_init(head_dim, base):
    phi_N = np.random.default_rng(0).uniform(0, 2 * np.pi, 5).astype(np.float32)
    ours = rope_mixed._freqs_from_basis(rope_mixed._reference_basis_2d(phi_N), head_dim, base)
    ref_xy = rope_vit_init(phi_N.astype(np.float64), head_dim, theta=base)
    # Our axis order is (row, col) = (y, x).
    np.testing.assert_allclose(ours, ref_xy[::-1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head_dim", [8, 16, 32])
def test_2d_init_is_rope_vit_init_with_uniform_angles(head_dim):
    """init draws phi ~ U[0, 2pi) per head from the key and builds exactly rope-vit's freqs."""
    key = jax.random.key(3)
    freqs = np.asarray(
        rope_mixed.init(key, num_heads=6, head_dim=head_dim, num_axes=2)["freqs_ANF"]
    )
    phi_N = np.asarray(jax.random.uniform(key, (6,), jnp.float32, 0.0, 2 * np.pi))
    np.testing.assert_allclose(freqs, rope_vit_init(phi_N, head_dim)[::-1], rtol=1e-6, atol=1e-6)
    # Pair 0 has magnitude 1 and direction (x, y) = (cos phi, sin phi): read phi back.
    phi_back = np.mod(np.arctan2(freqs[0, :, 0], freqs[1, :, 0]), 2 * np.pi)
    np.testing.assert_allclose(phi_back, phi_N, atol=1e-5)


def test_2d_init_angles_are_uniform():
    freqs = rope_mixed.init(KEY, num_heads=512, head_dim=8, num_axes=2)["freqs_ANF"]
    phi = np.mod(np.arctan2(freqs[0, :, 0], freqs[1, :, 0]), 2 * np.pi)
    assert scipy.stats.kstest(phi / (2 * np.pi), "uniform").pvalue > 0.01


@pytest.mark.parametrize("num_axes, head_dim", [(1, 8), (2, 8), (2, 6), (3, 12), (3, 10), (3, 24)])
def test_init_groups_are_orthonormal_directions_times_magnitudes(num_axes, head_dim):
    """Within group g, f[:, n, start_g + i] = basis column g * base^(-2A*i/H) with an
    orthonormal basis per head; groups follow np.array_split when A does not divide F."""
    freqs = np.asarray(
        rope_mixed.init(KEY, num_heads=32, head_dim=head_dim, num_axes=num_axes)["freqs_ANF"],
        np.float64,
    )
    mag_F, starts = group_magnitudes_ref(head_dim, num_axes, 10.0)
    np.testing.assert_allclose(
        np.linalg.norm(freqs, axis=0), np.broadcast_to(mag_F, (32, len(mag_F))), rtol=1e-5
    )
    basis_NAG = np.transpose(freqs[:, :, starts], (1, 0, 2))
    eye = np.broadcast_to(np.eye(num_axes), basis_NAG.shape)
    np.testing.assert_allclose(np.swapaxes(basis_NAG, 1, 2) @ basis_NAG, eye, atol=1e-5)
    direction_F = np.repeat(np.arange(num_axes), np.diff(np.append(starts, head_dim // 2)))
    np.testing.assert_allclose(
        freqs, basis_NAG.transpose(1, 0, 2)[:, :, direction_F] * mag_F, atol=1e-6
    )


@pytest.mark.parametrize("head_dim", [6, 12, 24])
def test_3d_init_gives_every_axis_nonzero_frequencies(head_dim):
    freqs = rope_mixed.init(KEY, num_heads=32, head_dim=head_dim, num_axes=3)
    per_axis_head = np.abs(np.asarray(freqs["freqs_ANF"])).max(axis=-1)
    assert per_axis_head.min() > 1e-3, per_axis_head


def test_3d_init_directions_vary_between_heads():
    freqs = np.asarray(rope_mixed.init(KEY, num_heads=32, head_dim=12, num_axes=3)["freqs_ANF"])
    directions = freqs[:, :, 0]  # group 0, magnitude 1: (A, N)
    # Haar on O(3): every entry has mean 0 and standard deviation 1/sqrt(3) over heads, so the
    # mean over 32 heads has a standard error of 0.1; identical heads would give std 0.
    assert np.abs(directions.mean(axis=1)).max() < 0.35
    assert directions.std(axis=1).min() > 0.3


def test_1d_init_is_rope_frequencies_with_a_random_sign_per_head():
    freqs = np.asarray(rope_mixed.init(KEY, num_heads=64, head_dim=8, num_axes=1)["freqs_ANF"])[0]
    mags = 10.0 ** (-2.0 * np.arange(4) / 8)
    signs = np.sign(freqs[:, :1])
    np.testing.assert_allclose(freqs, signs * mags, rtol=1e-6)
    assert (signs > 0).any() and (signs < 0).any()


@pytest.mark.parametrize("num_axes, head_dim", [(1, 8), (2, 8), (2, 16), (3, 12)])
@pytest.mark.parametrize("per_example", [False, True])
def test_apply_matches_float64_reference(num_axes, head_dim, per_example):
    rng = np.random.default_rng(1)
    x = normal((2, 7, 2, head_dim))
    params = rope_mixed.init(KEY, num_heads=2, head_dim=head_dim, num_axes=num_axes)
    pos = rng.uniform(-4, 12, (2, 7, num_axes) if per_example else (7, num_axes))
    out = rope_mixed.apply(params, x, jnp.asarray(pos, jnp.float32))
    chex.assert_shape(out, x.shape)
    ref = rotate_pairs(x, mixed_angles(pos, params["freqs_ANF"]))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "num_axes, head_dim, base",
    [(1, 8, 100.0), (2, 8, 100.0), (2, 16, 10000.0), (3, 12, 100.0), (3, 24, 10000.0)],
)
def test_axis_aligned_frequencies_reduce_to_rope_axial(num_axes, head_dim, base):
    rng = np.random.default_rng(2)
    x = normal((2, 8, 2, head_dim))
    pos_TA = jnp.asarray(rng.uniform(-5, 30, (8, num_axes)), jnp.float32)
    params = rope_mixed.params_from_freqs(axial_freqs_ref(2, head_dim, num_axes, base))
    np.testing.assert_allclose(
        rope_mixed.apply(params, x, pos_TA),
        rope_axial.apply({}, x, pos_TA, base=base),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("num_axes, head_dim", [(2, 16), (3, 12)])
def test_relative_position_property(num_axes, head_dim):
    """q.k at (p, p') equals q.k at (p + t, p' + t) and the float64 difference-only ref."""
    rng = np.random.default_rng(3)
    params = rope_mixed.init(KEY, num_heads=2, head_dim=head_dim, num_axes=num_axes)
    q, k = normal((2, 6, 2, head_dim), seed=4), normal((2, 6, 2, head_dim), seed=5)
    pos_q, pos_k = rng.uniform(0, 8, (6, num_axes)), rng.uniform(0, 8, (6, num_axes))
    ref = scores_from_phases(q, k, mixed_angles(pos_q[:, None] - pos_k[None], params["freqs_ANF"]))
    for t in rng.uniform(-15, 15, (4, num_axes)):
        qr = rope_mixed.apply(params, q, jnp.asarray(pos_q + t, jnp.float32))
        kr = rope_mixed.apply(params, k, jnp.asarray(pos_k + t, jnp.float32))
        scores = jnp.einsum("btnh,bsnh->bnts", qr, kr)
        np.testing.assert_allclose(scores, ref, rtol=1e-4, atol=1e-4)


def test_gradient_wrt_freqs_matches_float64_finite_differences():
    rng = np.random.default_rng(7)
    x, w = normal((2, 5, 2, 8), seed=8), rng.normal(size=(2, 5, 2, 8))
    pos_TA = rng.uniform(0, 4, (5, 2))
    freqs = np.asarray(rope_mixed.init(KEY, num_heads=2, head_dim=8, num_axes=2)["freqs_ANF"])

    def loss_ref(f):
        return np.sum(w * rotate_pairs(x, mixed_angles(pos_TA, f)))

    def loss(f):
        out = rope_mixed.apply({"freqs_ANF": f}, x, jnp.asarray(pos_TA, jnp.float32))
        return jnp.sum(jnp.asarray(w, jnp.float32) * out)

    grad = jax.grad(loss)(jnp.asarray(freqs))
    eps, fd = 1e-6, np.zeros(freqs.shape)
    for idx in np.ndindex(freqs.shape):
        step = np.zeros(freqs.shape)
        step[idx] = eps
        fd[idx] = (loss_ref(freqs + step) - loss_ref(freqs - step)) / (2 * eps)
    np.testing.assert_allclose(grad, fd, rtol=1e-3, atol=1e-3)


def test_params_from_freqs_casts_to_float32():
    params = rope_mixed.params_from_freqs(np.ones((2, 3, 4)), head_dim=8)
    assert params["freqs_ANF"].dtype == jnp.float32
    chex.assert_shape(params["freqs_ANF"], (2, 3, 4))


@pytest.mark.parametrize(
    "shape, head_dim, match",
    [
        ((3, 4), None, r"\(A, N, F\).*got shape \(3, 4\)"),
        ((1, 2, 3, 4), None, r"\(A, N, F\).*got shape \(1, 2, 3, 4\)"),
        ((2, 0, 4), None, r"got shape \(2, 0, 4\)"),
        ((2, 3, 4), 10, r"F=4 pairs but head_dim=10"),
    ],
)
def test_params_from_freqs_bad_shape(shape, head_dim, match):
    with pytest.raises(ValueError, match=match):
        rope_mixed.params_from_freqs(np.ones(shape), head_dim=head_dim)


@pytest.mark.parametrize(
    "x_shape, pos_shape, match",
    [
        ((5, 2, 8), (5, 2), r"rank 4.*\(5, 2, 8\)"),
        ((2, 5, 2, 8), (5,), r"\(T, A\) or \(B, T, A\).*\(5,\)"),
        ((2, 5, 2, 8), (7, 2), r"T=7 tokens but x has T=5"),
        ((2, 5, 2, 8), (5, 3), r"A=3 axes but the parameters were initialised for num_axes=2"),
        ((2, 5, 3, 8), (5, 2), r"\(N, H\)=\(3, 8\).*num_heads=2, head_dim=8"),
        ((2, 5, 2, 12), (5, 2), r"\(N, H\)=\(2, 12\).*num_heads=2, head_dim=8"),
    ],
)
def test_apply_errors_name_the_bad_value(x_shape, pos_shape, match):
    params = rope_mixed.init(KEY, num_heads=2, head_dim=8, num_axes=2)
    with pytest.raises(ValueError, match=match):
        rope_mixed.apply(params, jnp.zeros(x_shape), jnp.zeros(pos_shape))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_heads=2, head_dim=7, num_axes=2), r"head_dim=7 must be even"),
        (dict(num_heads=2, head_dim=8, num_axes=0), r"num_axes=0"),
        (dict(num_heads=2.0, head_dim=8, num_axes=2), r"num_heads=2.0"),
        (dict(num_heads=2, head_dim=8, num_axes=2, base=-10.0), r"base=-10.0"),
    ],
)
def test_init_errors_name_the_bad_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rope_mixed.init(KEY, **kwargs)


def test_apply_hparams():
    assert rope_mixed.APPLY_HPARAMS == ("rotary_fraction",)


@pytest.mark.parametrize("per_example", [False, True])
def test_precompute_then_apply_matches_float64_reference(per_example):
    params = rope_mixed.init(KEY, num_heads=3, head_dim=8, num_axes=2)
    rng = np.random.default_rng(7)
    pos = rng.uniform(-3, 3, size=(2, 5, 2) if per_example else (5, 2)).astype(np.float32)
    x = normal((2, 5, 3, 8), seed=8)
    pre = rope_mixed.precompute(params, pos, num_heads=3, head_dim=8)
    assert isinstance(pre, state.PairAngles) and pre.fold_NHH is None
    chex.assert_shape(pre.angle_TNF, (*pos.shape[:-1], 3, 4))
    expected = rotate_pairs(x, mixed_angles(pos, params["freqs_ANF"]))
    np.testing.assert_allclose(pre.rotate(x), expected, atol=2e-5)


def test_precompute_errors():
    params = rope_mixed.init(KEY, num_heads=3, head_dim=8, num_axes=2)
    pos = np.zeros((5, 2), np.float32)
    for heads, head_dim in [(2, 8), (3, 6), (3, 9)]:
        with pytest.raises(ValueError, match=f"num_heads={heads}, head_dim={head_dim}"):
            rope_mixed.precompute(params, pos, num_heads=heads, head_dim=head_dim)
    with pytest.raises(ValueError, match="positions have A=3 axes but .* num_axes=2"):
        rope_mixed.precompute(params, np.zeros((5, 3), np.float32), num_heads=3, head_dim=8)
