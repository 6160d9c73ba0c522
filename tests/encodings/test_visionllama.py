"""VisionLlama AS2DRoPE: float64 reference of the alternating-axes formula (1D, 2D, 3D),
layout, relativity, dtypes, per-example positions, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import positions, rope, visionllama
from tests.encodings.reference import alternating_angles, normal, rotate_pairs, scores_from_phases

KEY = jax.random.key(0)


@pytest.mark.parametrize("num_axes, head_dim", [(1, 8), (2, 8), (2, 16), (3, 12), (3, 24)])
@pytest.mark.parametrize("base", [10000.0, 100.0])
def test_matches_float64_reference(num_axes, head_dim, base):
    x = normal((2, 9, 3, head_dim))
    pos_TA = np.random.default_rng(1).uniform(-3.0, 12.0, (9, num_axes))
    params = visionllama.init(KEY, num_heads=3, head_dim=head_dim, num_axes=num_axes, base=base)
    assert params == {}
    out = visionllama.apply(params, x, jnp.asarray(pos_TA, jnp.float32), base=base)
    chex.assert_shape(out, x.shape)
    ref = rotate_pairs(x, alternating_angles(pos_TA, head_dim, base)[:, None, :])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_default_base_is_10000_on_a_3d_grid():
    x = normal((2, 2 * 3 * 4, 2, 12))
    pos_TA = positions.grid_positions((2, 3, 4), "integer")
    ref = rotate_pairs(x, alternating_angles(pos_TA, 12, 10000.0)[:, None, :])
    np.testing.assert_allclose(visionllama.apply({}, x, pos_TA), ref, rtol=1e-5, atol=1e-5)


def test_pairs_alternate_between_axes():
    """H=8, A=2: the row rotates pairs 0 and 2 (channels 0,1,4,5), the column pairs 1 and 3."""
    x = normal((1, 3, 2, 8))
    row_only = visionllama.apply({}, x, jnp.array([[1.0, 0.0], [2.0, 0.0], [5.0, 0.0]]))
    col_only = visionllama.apply({}, x, jnp.array([[0.0, 1.0], [0.0, 2.0], [0.0, 5.0]]))
    row_channels, col_channels = np.array([0, 1, 4, 5]), np.array([2, 3, 6, 7])
    np.testing.assert_array_equal(row_only[..., col_channels], x[..., col_channels])
    np.testing.assert_array_equal(col_only[..., row_channels], x[..., row_channels])
    assert not np.allclose(row_only[..., row_channels], x[..., row_channels])
    assert not np.allclose(col_only[..., col_channels], x[..., col_channels])


def test_autoscaled_positions_are_just_positions():
    """Auto-scale lives in the positions: apply on autoscale positions = apply on scaled ints."""
    x = normal((1, 16, 2, 8))
    pos_auto = positions.grid_positions((4, 4), "autoscale", anchor_grid=(2, 2))
    pos_int = positions.grid_positions((4, 4), "integer") * 0.5
    np.testing.assert_allclose(
        visionllama.apply({}, x, pos_auto), visionllama.apply({}, x, pos_int)
    )


def test_one_axis_equals_rope():
    x = normal((2, 6, 2, 16))
    pos_TA = jnp.asarray(np.random.default_rng(2).uniform(0, 50, (6, 1)), jnp.float32)
    np.testing.assert_allclose(
        visionllama.apply({}, x, pos_TA), rope.apply({}, x, pos_TA), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("num_axes, head_dim", [(2, 16), (3, 12)])
def test_relative_position_property(num_axes, head_dim):
    """q.k at (p, p') equals q.k at (p + t, p' + t) and the float64 difference-only ref."""
    rng = np.random.default_rng(3)
    q, k = normal((2, 6, 2, head_dim), seed=4), normal((2, 6, 2, head_dim), seed=5)
    pos_q, pos_k = rng.uniform(0, 8, (6, num_axes)), rng.uniform(0, 8, (6, num_axes))
    ref = scores_from_phases(
        q, k, alternating_angles(pos_q[:, None] - pos_k[None], head_dim, 10000.0)
    )
    for t in rng.uniform(-15, 15, (4, num_axes)):
        qr = visionllama.apply({}, q, jnp.asarray(pos_q + t, jnp.float32))
        kr = visionllama.apply({}, k, jnp.asarray(pos_k + t, jnp.float32))
        scores = jnp.einsum("btnh,bsnh->bnts", qr, kr)
        np.testing.assert_allclose(scores, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "x_shape, pos_shape, match",
    [
        ((2, 5, 8), (5, 2), r"rank 4.*\(2, 5, 8\)"),
        ((2, 5, 2, 8), (10,), r"\(T, A\) or \(B, T, A\).*\(10,\)"),
        ((2, 5, 2, 8), (2, 4, 2), r"T=4 tokens but x has T=5"),
        ((2, 5, 2, 10), (5, 2), r"head_dim=10 is not divisible by 2\*num_axes=4 \(visionllama\)"),
        ((2, 5, 2, 8), (5, 3), r"head_dim=8 is not divisible by 2\*num_axes=6 \(visionllama\)"),
    ],
)
def test_apply_errors_name_the_bad_value(x_shape, pos_shape, match):
    with pytest.raises(ValueError, match=match):
        visionllama.apply({}, jnp.zeros(x_shape), jnp.zeros(pos_shape))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(num_heads=2, head_dim=10, num_axes=2),
            r"^head_dim=10 is not divisible by 2\*num_axes=4 \(visionllama\)$",
        ),
        (dict(num_heads=2, head_dim=8, num_axes=3), r"head_dim=8 .* 2\*num_axes=6"),
        (dict(num_heads=2, head_dim=16, num_axes=4), r"num_axes=4; positions have 1 to 3 axes"),
        (dict(num_heads=-1, head_dim=8, num_axes=2), r"num_heads=-1"),
        (dict(num_heads=2, head_dim=8, num_axes=2, base=float("nan")), r"base=nan"),
    ],
)
def test_init_errors_name_the_bad_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        visionllama.init(KEY, **kwargs)


def test_apply_hparams():
    assert visionllama.APPLY_HPARAMS == ("base", "variant", "rotary_fraction")


def liere_angles_ref(pos_XA, head_dim):
    """The LieRE reference's "VisionLlama" (TiledPositionEncoder, inverse_exp), as a loop:
    P = H // A // 2 phases exp(-4 * linspace(0, 1, P)); pair a * P + p turns by pos_a * phase_p;
    leftover pairs do not turn."""
    pos_XA = np.asarray(pos_XA, np.float64)
    num_axes = pos_XA.shape[-1]
    num_phases = head_dim // num_axes // 2
    phases = np.exp(-4 * np.linspace(0, 1, num_phases))
    angle = np.zeros(pos_XA.shape[:-1] + (head_dim // 2,))
    for a in range(num_axes):
        for p in range(num_phases):
            angle[..., a * num_phases + p] = pos_XA[..., a] * phases[p]
    return angle


@pytest.mark.parametrize("num_axes, head_dim", [(1, 8), (2, 8), (2, 16), (2, 64), (3, 12), (3, 64)])
def test_liere_variant_matches_the_reference_construction(num_axes, head_dim):
    x = normal((2, 9, 3, head_dim))
    pos_TA = np.random.default_rng(1).uniform(0.0, 1.25, (9, num_axes))
    params = visionllama.init(
        KEY, num_heads=3, head_dim=head_dim, num_axes=num_axes, variant="liere"
    )
    assert params == {}
    out = visionllama.apply(params, x, jnp.asarray(pos_TA, jnp.float32), variant="liere")
    ref = rotate_pairs(x, liere_angles_ref(pos_TA, head_dim)[:, None, :])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_liere_variant_layout_and_leftover_channels():
    """H=14, A=3: P=2 phases (1, e^-4), pairs (row, row, col, col, depth, depth); the 7th pair
    (channels 12, 13) is never rotated; every head turns alike."""
    axis_F, freq_F = visionllama.liere_pair_frequencies(14, 3)
    np.testing.assert_array_equal(axis_F[:6], [0, 0, 1, 1, 2, 2])
    np.testing.assert_allclose(freq_F, [1, np.exp(-4), 1, np.exp(-4), 1, np.exp(-4), 0])
    x = normal((1, 4, 2, 14))
    pos = jnp.asarray(np.random.default_rng(2).uniform(0, 1, (4, 3)), jnp.float32)
    out = visionllama.apply({}, x, pos, variant="liere")
    np.testing.assert_array_equal(out[..., 12:], x[..., 12:])
    same_x = jnp.broadcast_to(x[:, :, :1], x.shape)
    out_same = visionllama.apply({}, same_x, pos, variant="liere")
    np.testing.assert_allclose(out_same[:, :, 0], out_same[:, :, 1], rtol=0, atol=0)


def test_liere_variant_differs_from_visionllama():
    x = normal((1, 3, 1, 16))
    pos = jnp.array([[0.0, 0.0], [0.5, 0.25], [1.0, 1.0]])
    assert not np.allclose(
        visionllama.apply({}, x, pos), visionllama.apply({}, x, pos, variant="liere"), atol=1e-3
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(variant="llama"), r"variant='llama'; expected one of \('visionllama', 'liere'\)"),
        (dict(variant="liere", head_dim=4, num_axes=3), r"head_dim=4 leaves no pair .*num_axes=3"),
        (dict(variant="liere", head_dim=9, num_axes=1), r"head_dim=9 is not divisible by 2"),
    ],
)
def test_variant_errors_name_the_bad_value(kwargs, match):
    args = dict(num_heads=2, head_dim=8, num_axes=2) | kwargs
    with pytest.raises(ValueError, match=match):
        visionllama.init(KEY, **args)
    pos = jnp.zeros((3, args["num_axes"]))
    with pytest.raises(ValueError, match=match):
        visionllama.apply({}, jnp.zeros((1, 3, 2, args["head_dim"])), pos, variant=args["variant"])
