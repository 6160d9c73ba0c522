"""RoPE-Axial: float64 references (the formula and rope-vit's compute_axial_cis), layout,
reduction to 1D RoPE, relativity, dtypes, per-example positions, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import positions, rope, rope_axial
from tests.encodings.reference import axial_angles, normal, rotate_pairs, scores_from_phases

KEY = jax.random.key(0)


def rope_vit_axial_angles(t_x, t_y, dim, theta=100.0):
    """rope-vit ``compute_axial_cis`` angles in numpy: cat(outer(t_x, f), outer(t_y, f))."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 4)[: dim // 4] / dim)
    return np.concatenate([np.outer(t_x, freqs), np.outer(t_y, freqs)], axis=-1)


@pytest.mark.parametrize("num_axes, head_dim", [(1, 8), (2, 8), (2, 16), (3, 12), (3, 24)])
@pytest.mark.parametrize("base", [100.0, 10000.0])
def test_matches_float64_reference(num_axes, head_dim, base):
    x = normal((2, 9, 3, head_dim))
    pos_TA = np.random.default_rng(1).uniform(-3.0, 12.0, (9, num_axes))
    params = rope_axial.init(KEY, num_heads=3, head_dim=head_dim, num_axes=num_axes, base=base)
    assert params == {}
    out = rope_axial.apply(params, x, jnp.asarray(pos_TA, jnp.float32), base=base)
    chex.assert_shape(out, x.shape)
    ref = rotate_pairs(x, axial_angles(pos_TA, head_dim, base)[:, None, :])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 16, 32])
def test_matches_rope_vit_up_to_swapping_axes(head_dim):
    """Ours at (row, col) = rope-vit at (t_x=row, t_y=col); on rope-vit's own grid
    (t_x = column, t_y = row) ours needs the axes swapped. Default base is rope-vit's 100."""
    rows, cols = 3, 4
    x = normal((2, rows * cols, 2, head_dim))
    pos_TA = np.asarray(positions.grid_positions((rows, cols), "integer"))
    ours = rope_axial.apply({}, x, jnp.asarray(pos_TA))
    ref_rowfirst = rope_vit_axial_angles(pos_TA[:, 0], pos_TA[:, 1], head_dim)
    np.testing.assert_allclose(
        ours, rotate_pairs(x, ref_rowfirst[:, None, :]), rtol=1e-5, atol=1e-5
    )

    t = np.arange(rows * cols)
    t_x, t_y = t % cols, t // cols  # rope-vit's init_t_xy: x is the column
    ours_swapped = rope_axial.apply({}, x, jnp.asarray(pos_TA[:, ::-1].copy()))
    ref = rotate_pairs(x, rope_vit_axial_angles(t_x, t_y, head_dim)[:, None, :])
    np.testing.assert_allclose(ours_swapped, ref, rtol=1e-5, atol=1e-5)


def test_axis_zero_owns_the_first_pairs():
    """H=8, A=2: the row rotates channels 0-3 only, the column channels 4-7 only."""
    x = normal((1, 3, 2, 8))
    row_only = rope_axial.apply({}, x, jnp.array([[1.0, 0.0], [2.0, 0.0], [5.0, 0.0]]))
    col_only = rope_axial.apply({}, x, jnp.array([[0.0, 1.0], [0.0, 2.0], [0.0, 5.0]]))
    np.testing.assert_array_equal(row_only[..., 4:], x[..., 4:])
    np.testing.assert_array_equal(col_only[..., :4], x[..., :4])
    assert not np.allclose(row_only[..., :4], x[..., :4])
    assert not np.allclose(col_only[..., 4:], x[..., 4:])


@pytest.mark.parametrize("base", [100.0, 10000.0])
def test_one_axis_equals_rope(base):
    x = normal((2, 6, 2, 16))
    pos_TA = jnp.asarray(np.random.default_rng(2).uniform(0, 50, (6, 1)), jnp.float32)
    np.testing.assert_allclose(
        rope_axial.apply({}, x, pos_TA, base=base),
        rope.apply({}, x, pos_TA, base=base),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("num_axes, head_dim", [(2, 16), (3, 12)])
def test_relative_position_property(num_axes, head_dim):
    """q.k at (p, p') equals q.k at (p + t, p' + t) and the float64 difference-only ref."""
    rng = np.random.default_rng(3)
    q, k = normal((2, 6, 2, head_dim), seed=4), normal((2, 6, 2, head_dim), seed=5)
    pos_q, pos_k = rng.uniform(0, 8, (6, num_axes)), rng.uniform(0, 8, (6, num_axes))
    ref = scores_from_phases(q, k, axial_angles(pos_q[:, None] - pos_k[None], head_dim, 100.0))
    for t in rng.uniform(-15, 15, (4, num_axes)):
        qr = rope_axial.apply({}, q, jnp.asarray(pos_q + t, jnp.float32))
        kr = rope_axial.apply({}, k, jnp.asarray(pos_k + t, jnp.float32))
        scores = jnp.einsum("btnh,bsnh->bnts", qr, kr)
        np.testing.assert_allclose(scores, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "x_shape, pos_shape, match",
    [
        ((5, 2, 8), (5, 2), r"rank 4.*\(5, 2, 8\)"),
        ((2, 5, 2, 8), (2, 2, 5, 2), r"\(T, A\) or \(B, T, A\).*\(2, 2, 5, 2\)"),
        ((2, 5, 2, 8), (6, 2), r"T=6 tokens but x has T=5"),
        ((2, 5, 2, 10), (5, 2), r"head_dim=10 is not divisible by 2\*num_axes=4 \(rope_axial\)"),
        ((2, 5, 2, 8), (5, 3), r"head_dim=8 is not divisible by 2\*num_axes=6 \(rope_axial\)"),
        ((2, 5, 2, 8), (5, 0), r"A=0 axes \(shape \(5, 0\)\); expected 1 to 3"),
    ],
)
def test_apply_errors_name_the_bad_value(x_shape, pos_shape, match):
    with pytest.raises(ValueError, match=match):
        rope_axial.apply({}, jnp.zeros(x_shape), jnp.zeros(pos_shape))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(num_heads=2, head_dim=10, num_axes=2),
            r"^head_dim=10 is not divisible by 2\*num_axes=4 \(rope_axial\)$",
        ),
        (dict(num_heads=2, head_dim=8, num_axes=3), r"head_dim=8 .* 2\*num_axes=6"),
        (dict(num_heads=2, head_dim=8, num_axes=0), r"num_axes=0"),
        (dict(num_heads=2, head_dim=8, num_axes=2, base=0), r"base=0"),
    ],
)
def test_init_errors_name_the_bad_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rope_axial.init(KEY, **kwargs)


def test_apply_rejects_parameters_of_another_family():
    with pytest.raises(ValueError, match=r"expects params=\{\}"):
        rope_axial.apply(
            {"freqs_ANF": jnp.zeros((2, 2, 4))}, jnp.zeros((2, 5, 2, 8)), jnp.zeros((5, 2))
        )


def test_apply_hparams():
    assert rope_axial.APPLY_HPARAMS == (
        "base",
        "rotary_fraction",
        "layout",
        "sections",
        "temporal_scale",
    )
